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

if TYPE_CHECKING:
    from capgate.executor.approvals import SigningKey
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
