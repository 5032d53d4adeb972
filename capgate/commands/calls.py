"""Calls: plan, approve, call -- and an approver's signing key.

The path every face takes to the executor: the command line (``capgate plan``,
``capgate call``), the MCP server (one tool call is one :func:`call`) and a
Python caller.  ``via`` names the face in the records (``executor.channel``):
a capability gap or a coordination request says whether it came through the
CLI, MCP or the API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from capgate.executor import channel
from capgate.executor.call import Executor
from capgate.executor.outcome import Outcome
from capgate.executor.plan import Plan
from capgate.registry.errors import CapgateError

if TYPE_CHECKING:
    from capgate.executor.approvals import SigningKey
    from capgate.executor.ledger import Ledger, PlanRecord
    from capgate.executor.returned import Binding


@contextlib.contextmanager
def _through(via: str | None) -> Iterator[None]:
    """The block as a request that came through ``via`` (unchanged when None)."""
    if via is None:
        yield
        return
    with channel.via(via):
        yield


def plan(gate: Executor, operation: str, inputs: Mapping[str, Any], *, case: str, who: str,
         version: int | None = None, venue: str | None = None, record: bool = True,
         via: str | None = None) -> Plan:
    """The call's plan -- statements, binds, expected counts, target -- and its hash; no DML.

    ``record``: keep the plan in the ledger, so that an approver can find it by its hash.
    """
    with _through(via):
        return gate.plan(operation, dict(inputs), case=case, who=who, version=version,
                         venue=venue, record=record)


def approve(gate: Executor, plan_hash: str, *, by: str, role: str, key: SigningKey,
            ttl_seconds: int | None = None) -> dict[str, Any]:
    """Approve a recorded plan as ``by`` in ``role``, signed with ``by``'s private key.

    ``key``: ``executor.approvals.load_signing_key(FILE)``; its public half must be
    ``by``'s ``approval_key`` in the grants.  The approval is single use and expires
    after ``ttl_seconds`` (default: the row's).
    """
    return gate.approve(plan_hash, by=by, role=role, key=key, ttl_seconds=ttl_seconds)


def show_plan(gate: Executor, plan_hash: str) -> dict[str, Any]:
    """A recorded plan by its hash, as an approver must see it before signing.

    The plan as recorded (operation and version, row hash, connector and environment,
    each statement's SQL with its bound values and expected count, the verify checks,
    target and impact keys), its case, requester and when it was recorded, whether it
    needs an approval, how long an approval of it lasts, and its approvals so far.
    ``UnknownPlan`` when no plan has this hash.
    """
    from capgate.executor.plan import needs_approval

    record = gate.ledger.get_plan(plan_hash)
    shown = describe_plan(gate.ledger, record)
    if needs_approval(record.plan):
        shown["approval_ttl_seconds"] = _approval_ttl(gate, record.plan)
    return shown


def describe_plan(ledger: Ledger, record: PlanRecord) -> dict[str, Any]:
    """:func:`show_plan` from the ledger alone (the HTML case view; no row is looked up)."""
    from datetime import UTC, datetime

    from capgate.executor.plan import needs_approval

    body = dict(record.plan)
    now = datetime.now(UTC)
    given = [{"approval_id": a.approval_id, "approver": a.approver, "role": a.role,
              "created_at": a.created_at.isoformat(), "expires_at": a.expires_at.isoformat(),
              "expired": a.expired(now), "used_by_intent": a.used_by_intent,
              "used_at": a.used_at.isoformat() if a.used_at else None}
             for a in ledger.approvals_for(record.plan_hash)]
    gated = needs_approval(body)
    if not gated:
        status = "needs no approval"
    elif any(a["used_by_intent"] for a in given):
        status = "used"
    elif any(not a["expired"] for a in given):
        status = "approved, not yet used"
    else:
        status = "awaiting approval"
    return {"plan_hash": record.plan_hash, "case": record.case_id,
            "requester": record.requester, "created_at": record.created_at.isoformat(),
            "needs_approval": gated, "status": status, "approval_ttl_seconds": None,
            "approvals": given, "plan": body}


def _approval_ttl(gate: Executor, body: Mapping[str, Any]) -> int | None:
    """How long an approval of this plan lasts unless ``--ttl`` says otherwise."""
    if body.get("kind") is not None:  # a rehearsal's or a simulation's gate
        return 3600
    try:
        row = gate.registry.resolve(str(body.get("operation_id")), int(body.get("version") or 0))
    except CapgateError:  # the row is gone from the files: it cannot be approved
        return None
    return int(row.authorization.approval_ttl_seconds)


def pending_plans(gate: Executor, *, case: str | None = None) -> list[dict[str, Any]]:
    """Recorded plans that need an approval and that no call has used one of yet (the
    approvers' queue), newest first; each as :func:`show_plan` gives it."""
    from capgate.executor.plan import needs_approval

    return [show_plan(gate, r.plan_hash) for r in gate.ledger.recorded_plans(case_id=case)
            if needs_approval(r.plan)]


def make_approver_key(out: str, *, force: bool = False) -> dict[str, str]:
    """A new key pair: the private key written to ``out`` (mode 0600), the grants' public half."""
    from capgate.executor.approvals import generate

    return {"private_key": out, "approval_key": generate(out, force=force)}


def call(gate: Executor, operation: str, inputs: Mapping[str, Any], *, case: str, who: str,
         version: int | None = None, key: str | None = None, task: str | None = None,
         plan_hash: str | None = None, venue: str | None = None,
         bindings: Sequence[Binding] = (), via: str | None = None) -> Outcome:
    """Call a declared operation; its outcome (applied and verified, rolled back, ...).

    ``bindings``: inputs bound to values earlier intents of the case returned, read from
    the ledger (issue 16).  A refusal raises its ``CapgateError``; nothing was written.
    """
    options: dict[str, Any] = {"version": version, "key": key, "task": task,
                               "plan_hash": plan_hash, "venue": venue}
    with _through(via):
        if bindings:
            from capgate.executor.bindings import call_bound

            return call_bound(gate, operation, dict(inputs), list(bindings), case=case,
                              who=who, **options)
        return gate.call(operation, dict(inputs), case=case, who=who, **options)
