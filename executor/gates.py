"""Gates: approvals of exact plans, signed by their approvers, checked when used.

A ``gate`` row (and every DDL or rehearsal plan) runs only with an unused,
unexpired approval of its exact plan hash -- which binds the row, the inputs,
the connector, the environment, the case and the requester -- signed by the
approver's own key (:mod:`executor.approvals`).  :func:`approve` records one;
:func:`check_approval` refuses early, with what is missing, before anything is
recorded; the approval is *consumed* in the transaction that records the
intent's ``prepared`` (``executor.boundaries``), with :func:`approval_problem`
re-checking it against the grants as they are then; :func:`recheck_approval`
does the same for a retry by ``resume``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capgate.executor.approvals import SigningKey
from capgate.executor.connectors import Connector
from capgate.executor.context import CallContext
from capgate.executor.ledger import ApprovalRecord
from capgate.executor.plan import Plan
from capgate.executor.promotion import plan_section
from capgate.executor.runtime import Runtime
from capgate.executor.simulation.records import simulation_of
from capgate.registry.errors import (
    ApprovalExpired,
    ApprovalNotAuthenticated,
    ApprovalRequired,
    ApprovalTtlTooLong,
    ApprovalUsed,
    SelfApproval,
    UnknownPlan,
    UsageError,
)
from capgate.registry.model import AuthKind, EffectClass, Row

__all__ = ["SIMULATION_GATES", "approval_problem", "approve", "check_approval",
           "plan_environment", "recheck_approval", "simulation_gate_roles", "with_promotion"]


def approve(rt: Runtime, plan_hash: str, *, by: str, role: str, key: SigningKey,
            ttl_seconds: int | None = None) -> dict[str, Any]:
    """Record a single-use, expiring approval of a recorded plan, signed by ``by``'s key.

    ``key`` is the approver's private key (:mod:`executor.approvals`); it
    must be the one the grants file names for ``by``, so that a name alone
    -- typed by anyone who can run this -- approves nothing.
    """
    record = rt.ledger.get_plan(plan_hash)
    body = record.plan
    if body.get("kind") == "rehearsal":  # a gated simulation: the connector's roles
        ref = f"the rehearsal on {body['connector']}"
        roles = rt.connectors.config(str(body["connector"])).simulation_approver_roles
        four_eyes, ttl_default = True, 3600
        operation: dict[str, Any] = {"rehearsal": True, "connector": body["connector"]}
    elif body.get("kind") in SIMULATION_GATES:  # issue 16: a simulation's own gate kind
        ref, roles = simulation_gate_roles(rt, body)
        four_eyes, ttl_default = True, 3600
        operation = {"simulation": body["kind"], "connector": body["connector"],
                     "operation_id": body.get("operation_id"), "version": body.get("version")}
    else:
        row = rt.registry.resolve(body["operation_id"], int(body["version"]))
        if row.authorization.kind is not AuthKind.GATE \
                and row.effect_class is not EffectClass.DDL:
            raise UsageError(f"{row.ref} is not gated; it needs no approval")
        ref, roles = row.ref, row.authorization.approver_roles
        four_eyes = row.authorization.four_eyes
        ttl_default = row.authorization.approval_ttl_seconds
        operation = {"operation_id": row.operation_id, "version": row.version}
    rt.grants.check_approver(by, role, roles, environment=body.get("environment"))
    expected = rt.grants.principal(by).approval_key
    if expected is None:
        raise ApprovalNotAuthenticated(
            f"{by!r} has no approval_key in {rt.grants.source}: an administrator adds "
            f"the public key that `capgate approver keygen` printed for {by!r}",
            approver=by, plan_hash=plan_hash)
    if key.public_text != expected:
        raise ApprovalNotAuthenticated(
            f"the key {key.source} is not {by!r}'s (the grants file names another): an "
            "approval is signed by the approver's own key", approver=by,
            plan_hash=plan_hash)
    if four_eyes and by == record.requester:
        raise SelfApproval(
            f"{by!r} requested this plan and cannot approve it: {ref} requires four eyes",
            approver=by, plan_hash=plan_hash)
    ttl = ttl_seconds or ttl_default
    if ttl > rt.approval_ttl_max_seconds or ttl < 1:
        source = "--ttl" if ttl_seconds else f"{ref}'s approval_ttl_seconds"
        raise ApprovalTtlTooLong(
            f"an approval may live 1 to {rt.approval_ttl_max_seconds} s (approval_ttl_max_seconds"
            f"); {source} asks for {ttl} s: approve with a shorter --ttl; nothing was recorded",
            ttl_seconds=ttl, max_seconds=rt.approval_ttl_max_seconds, plan_hash=plan_hash)
    approval = rt.ledger.record_approval(
        plan_hash, by, role, ttl, now=rt.clock(),
        sign=lambda fields: (key.public_text, key.sign(fields)))
    rt.ledger.append(record.case_id, "approval_recorded", {"case_state": {
        "last_approval": {"plan_hash": plan_hash, "by": by, "role": role,
                          "approval_id": approval.approval_id,
                          "requester": record.requester, "signature": approval.signature,
                          "expires_at": approval.expires_at.isoformat()}}})
    return {"plan_hash": plan_hash, "approval_id": approval.approval_id, "by": by,
            "role": role, "expires_at": approval.expires_at.isoformat(), **operation,
            "case": record.case_id, "requester": record.requester}


def approval_problem(rt: Runtime, approval: ApprovalRecord, row: Row) -> str | None:
    """Why ``approval`` cannot be used for ``row`` now (None: it can): signature, role.

    A role held for some environments only must be held in the plan's
    environment (read from the recorded plan only for such an approver).
    """
    environment = plan_environment(rt, approval.plan_hash) \
        if rt.grants.scoped(approval.approver) else None
    return rt.grants.approval_problem(approval, row.authorization.approver_roles, environment)


SIMULATION_GATES = {"simulation": "simulation_approver_roles",
                    "production_simulation": "production_simulation_approver_roles"}
"""Issue 16: a simulation's plan kinds, and the connector setting naming their approvers.

``simulation`` gates a simulation on staging (customer-facing, like a rehearsal
there); ``production_simulation`` is the distinct gate kind of a simulation on
prod, whose roles are two and never the requester's."""


def simulation_gate_roles(rt: Runtime, body: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(what is approved, the roles that may approve it) for a simulation's plan."""
    config = rt.connectors.config(str(body["connector"]))
    roles: tuple[str, ...] = getattr(config, SIMULATION_GATES[str(body["kind"])])
    what = "production simulation" if body["kind"] == "production_simulation" else "simulation"
    return f"the {what} of {body.get('operation_id')} on {body['connector']}", roles


def plan_environment(rt: Runtime, plan_hash: str) -> str | None:
    """The environment a recorded plan names (None: no such plan)."""
    try:
        environment = rt.ledger.get_plan(plan_hash).plan.get("environment")
    except UnknownPlan:
        return None
    return str(environment) if environment is not None else None


def recheck_approval(rt: Runtime, ctx: CallContext) -> None:
    """A resumed retry relies on the approval its intent consumed: is it still good?

    The approval must exist, be unexpired and still verify against the
    current grants (signature, key, role); raises the coded refusal if not.
    """
    if ctx.row.authorization.kind is not AuthKind.GATE:
        return
    used = [a for a in rt.ledger.approvals_for(ctx.plan.plan_hash)
            if a.used_by_intent == ctx.intent_id]
    if not used:
        raise ApprovalRequired(
            f"intent {ctx.intent_id} holds no approval of plan {ctx.plan.plan_hash}; a "
            "retry needs the approval it was prepared with", plan_hash=ctx.plan.plan_hash)
    approval = used[0]
    if approval.expired(rt.clock()):
        raise ApprovalExpired(
            f"the approval {approval.approval_id} intent {ctx.intent_id} relied on has "
            "expired; a retry needs a new approval", plan_hash=ctx.plan.plan_hash,
            approval_id=approval.approval_id)
    problem = approval_problem(rt, approval, ctx.row)
    if problem is not None:
        raise ApprovalNotAuthenticated(
            f"the approval {approval.approval_id} intent {ctx.intent_id} relied on no "
            f"longer holds: {problem}", plan_hash=ctx.plan.plan_hash,
            approval_id=approval.approval_id)


def check_approval(rt: Runtime, ctx: CallContext) -> None:
    """A usable approval of this exact plan exists (consumed later, with ``prepared``).

    Refusals name what is missing; the plan is recorded so that an approver
    can find it by its hash.
    """
    plan = ctx.plan
    approvals = rt.ledger.approvals_for(plan.plan_hash)
    now = rt.clock()
    four_eyes = ctx.row.authorization.four_eyes
    usable = [a for a in approvals if a.used_by_intent is None and a.expires_at > now
              and not (four_eyes and a.approver == ctx.who)]
    if not usable:
        if simulation_of(ctx.idem_key) is None:  # a simulation's step is no promotion
            plan = with_promotion(rt, plan, ctx.row, ctx.inputs, ctx.connector, ctx.case_id)
        rt.ledger.record_plan(plan.plan_hash, ctx.case_id, ctx.who, plan.to_dict())
        details = {"plan_hash": plan.plan_hash, "plan": plan.to_dict(),
                   "approver_roles": list(ctx.row.authorization.approver_roles),
                   "four_eyes": four_eyes}
        if any(a.used_by_intent is None and a.expires_at > now for a in approvals):
            raise SelfApproval(f"the only approval of {plan.plan_hash} is the requester's "
                               "own; four eyes requires another approver", **details)
        if any(a.used_by_intent is None for a in approvals):
            raise ApprovalExpired(f"the approval of plan {plan.plan_hash} has expired",
                                  **details)
        if approvals:
            raise ApprovalUsed(f"the approval of plan {plan.plan_hash} was already used",
                               **details)
        raise ApprovalRequired(
            f"{ctx.row.ref} is gated: approve plan {plan.plan_hash} with "
            f"`capgate approve {plan.plan_hash} --by WHO --role "
            f"{'|'.join(ctx.row.authorization.approver_roles)} --key FILE`", **details)


def with_promotion(rt: Runtime, plan: Plan, row: Row, inputs: Mapping[str, Any],
                   connector: Connector, case: str) -> Plan:
    """The plan, carrying the promotion's grounds on a promotion venue (issue 16).

    The case's simulation evidence -- or the exemption test, or what is missing
    -- goes into the recorded plan, so the approver sees it.  The plan hash is
    unchanged: the grounds are re-checked when the call runs.  Elsewhere the
    plan is returned as it is (its body not even read).
    """
    if not row.is_write or not connector.config.promotes:
        return plan
    section = plan_section(rt, row, inputs, connector, case)
    if section is None:
        return plan
    return Plan(plan.plan_hash, {**plan.body, "promotion": section})
