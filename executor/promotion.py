"""The promotion rule (seed 001 §5): a write on a higher venue is bound to simulation evidence.

A connector whose writes are promotions (``ConnectorConfig.promotes``: staging
and prod unless ``requires_simulation`` says otherwise) refuses a write
(``PromotionRefused``, before anything is recorded) unless its case holds

* a completed simulation -- executed, torn down, baseline re-read identical --
  of the *same row version* (row hash) with inputs of the *same shape*, on a
  *lower* venue (rig < dev < qa < staging < prod), younger than the
  connector's ``simulation_max_age_seconds``; read from the case's verified
  snapshot (an edited one is ``LedgerTampered``) and cross-checked against the
  simulated intent's own recorded outcome; or
* a change that passes the five-point exemption test
  (:mod:`executor.simulation.exemption`), recorded in the case as an
  ``exemption_claimed`` event and in the plan.

The promoting identity must hold, besides its write grant for that
environment, one of the connector's ``promotion_roles`` *for that
environment* when it names some.  :func:`plan_section` is what the plan of such
a write carries -- the evidence, or the exemption test, or what is missing --
so the approver sees it before approving.  The simulation cycle's own execute
step is let through only for a simulation recorded in the case, at that step.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capgate.executor.connectors import ENVIRONMENTS, Connector, venue_rank
from capgate.executor.context import CallContext
from capgate.executor.outcome import SIMULATED
from capgate.executor.runtime import Runtime
from capgate.executor.simulation.exemption import ExemptionTest, exemption_test
from capgate.executor.simulation.records import (
    evidence_entries,
    input_shape,
    simulation_key,
    simulation_of,
)
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import (
    PromoterLacksRole,
    PromotionRefused,
    SimulationStateConflict,
    UnknownIntent,
)
from capgate.registry.model import Row

__all__ = ["PromotionDecision", "check", "decide", "plan_section"]

EXECUTING_STEP = "baseline"
"""The step a simulation is at when its execute call runs (the baseline is captured)."""


@dataclass(frozen=True)
class PromotionDecision:
    """Whether a write here may go ahead, and on what grounds."""

    required: bool
    evidence: Mapping[str, Any] | None = None
    missing: str | None = None
    """``no_evidence``, ``other_row_version``, ``other_input_shape``, ``not_lower``,
    ``stale`` or ``unproven`` (the evidence's intent does not say simulated)."""
    exemption: ExemptionTest | None = None
    seen: tuple[Mapping[str, Any], ...] = field(default=())
    """The case's simulation evidence that was looked at (for the refusal's details)."""

    @property
    def allowed(self) -> bool:
        return not self.required or self.evidence is not None or bool(
            self.exemption and self.exemption.holds)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"required": self.required, "allowed": self.allowed}
        if self.evidence is not None:
            out["evidence"] = dict(self.evidence)
        if self.missing is not None:
            out["missing"] = self.missing
        if self.exemption is not None:
            out["exemption"] = self.exemption.to_dict()
        return out


def _age(rt: Runtime, entry: Mapping[str, Any]) -> float | None:
    try:
        at = dt.datetime.fromisoformat(str(entry.get("completed_at")))
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return (rt.clock() - at).total_seconds()


def _proven(rt: Runtime, case: str, entry: Mapping[str, Any]) -> bool:
    """The evidence's simulated intent says so itself (its own events, hash-checked)."""
    try:
        state = rt.ledger.intent(case, str(entry.get("intent_id")))
    except UnknownIntent:
        return False
    record = state.get("outcome_record")
    return isinstance(record, Mapping) and record.get("status") == SIMULATED \
        and record.get("row_hash") == entry.get("row_hash")


def decide(rt: Runtime, row: Row, inputs: Mapping[str, Any], connector: Connector,
           case: str) -> PromotionDecision:
    """The promotion decision for this request (reads the ledger; writes nothing)."""
    config = connector.config
    if not row.is_write or not config.promotes:
        return PromotionDecision(required=False)
    snapshot = rt.ledger.verified_snapshot(case)
    entries = evidence_entries((snapshot or {}).get("case") or {})
    shape = input_shape(inputs)
    target = venue_rank(connector.environment)
    missing = "no_evidence"
    same_op = [e for e in entries if e.get("operation_id") == row.operation_id]
    if same_op:
        missing = "other_row_version"
    same_row = [e for e in same_op if e.get("row_hash") == row.row_hash]
    if same_row:
        missing = "other_input_shape"
    same_shape = [e for e in same_row if e.get("input_shape") == shape]
    if same_shape:
        missing = "not_lower"
    lower = [e for e in same_shape if str(e.get("environment")) in ENVIRONMENTS
             and venue_rank(str(e.get("environment"))) < target]
    if lower:
        missing = "stale"
    fresh = [e for e in lower if (age := _age(rt, e)) is not None
             and 0 <= age <= config.simulation_max_age_seconds]
    if fresh:
        missing = "unproven"
    for entry in fresh:
        if _proven(rt, case, entry):
            return PromotionDecision(required=True, evidence=entry, seen=tuple(entries))
    history = rt.ledger.intents(case) if snapshot is not None else {}
    test = exemption_test(row, inputs, connector.environment, history)
    return PromotionDecision(required=True, missing=missing, exemption=test,
                             seen=tuple(entries))


def plan_section(rt: Runtime, row: Row, inputs: Mapping[str, Any], connector: Connector,
                 case: str) -> dict[str, Any] | None:
    """What the plan of a promotion shows its approver (None: the write is no promotion)."""
    decision = decide(rt, row, inputs, connector, case)
    if not decision.required:
        return None
    return {"environment": connector.environment,
            "max_age_seconds": connector.config.simulation_max_age_seconds, **decision.to_dict()}


def _check_role(rt: Runtime, ctx: CallContext) -> None:
    roles = ctx.connector.config.promotion_roles
    if not roles:
        return
    principal = rt.grants.principal(ctx.who)
    if not any(principal.holds(role, ctx.connector.environment) for role in roles):
        raise PromoterLacksRole(
            f"{ctx.who!r} holds none of the promotion roles {', '.join(roles)} for "
            f"{ctx.connector.environment!r} ({rt.grants.source}), which a write on connector "
            f"{ctx.connector.name!r} needs; nothing was recorded", principal=ctx.who,
            roles=list(roles), environment=ctx.connector.environment)


def _simulation_step(rt: Runtime, ctx: CallContext, simulation_id: str) -> None:
    """A simulation's execute call: only for a simulation recorded in the case, at its step.

    Exactly the call the simulation would make is admitted: its row version, its
    connector *and venue* (the logical connector has one name on every venue, so
    the name alone would let a prod write pass as a qa simulation's step), its
    requester and its very inputs.
    """
    snapshot = rt.ledger.verified_snapshot(ctx.case_id) or {}
    summary = ((snapshot.get("case") or {}).get(simulation_key(simulation_id)))
    expected = {"row_hash": ctx.row.row_hash, "connector": ctx.connector.name,
                "environment": ctx.connector.environment, "who": ctx.who,
                "step": EXECUTING_STEP}
    if not isinstance(summary, Mapping) or any(summary.get(k) != v
                                               for k, v in expected.items()) \
            or canonical_hash(summary.get("inputs")) != canonical_hash(dict(ctx.inputs)):
        raise SimulationStateConflict(
            f"no simulation {simulation_id!r} of {ctx.row.ref} awaits its execute step in "
            f"case {ctx.case_id!r} on {ctx.connector.name!r}: a write marked as a simulation "
            "runs only inside `capgate simulate`; nothing was recorded",
            simulation_id=simulation_id, case=ctx.case_id)


def check(rt: Runtime, ctx: CallContext) -> None:
    """Refuse, before anything is recorded, a promotion without evidence or exemption."""
    if ctx.rehearse or not ctx.row.is_write:
        return
    simulation_id = simulation_of(ctx.idem_key)
    if simulation_id is not None:
        _simulation_step(rt, ctx, simulation_id)
        return
    if not ctx.connector.config.promotes:
        return
    _check_role(rt, ctx)
    decision = decide(rt, ctx.row, ctx.inputs, ctx.connector, ctx.case_id)
    if decision.evidence is not None:
        return
    test = decision.exemption
    assert test is not None
    if test.holds:
        key = f"exemption:{ctx.plan.plan_hash}"
        snapshot = rt.ledger.snapshot(ctx.case_id) or {}
        if key not in (snapshot.get("case") or {}):
            rt.ledger.append(ctx.case_id, "exemption_claimed", {
                "operation_id": ctx.row.operation_id, "version": ctx.row.version,
                "row_hash": ctx.row.row_hash, "environment": ctx.connector.environment,
                "plan_hash": ctx.plan.plan_hash, "by": ctx.who,
                "case_state": {key: test.to_dict()}})
        return
    failed = "; ".join(f"({p.number}) {p.name}: {p.why}" for p in test.failed)
    raise PromotionRefused(
        f"{ctx.row.ref} on {ctx.connector.name!r} ({ctx.connector.environment}) is a "
        f"promotion and case {ctx.case_id!r} holds no simulation evidence for it "
        f"({decision.missing.replace('_', ' ') if decision.missing else 'none'}); nor is it "
        f"exempt: {failed}. Simulate it on a lower venue first (`capgate simulate "
        f"{ctx.row.operation_id} --case {ctx.case_id}`); nothing was recorded",
        operation_id=ctx.row.operation_id, version=ctx.row.version, case=ctx.case_id,
        environment=ctx.connector.environment, missing=decision.missing,
        exemption=test.to_dict(), evidence_seen=[dict(e) for e in decision.seen])
