"""Compensation after a failed post-commit check.

A post-commit check runs after COMMIT, so its failure can never be a
rollback: the effect is there.  The row's already-written compensation runs
as a new action with its own intent in the same case -- prepared, attempt,
marker, observed -- so that a crash during compensation is reconciled like
any other write.  ``compensated`` is claimed only when that compensation
committed *and* the row's ``compensation_verify`` checks, re-reading the
restored state after its COMMIT, say so; anything else is
``compensation_failed``: the compensation intent escalates with its evidence
(it stays open, holding the case, until a person decides).  The original
intent's recorded outcome becomes the final one, so a replay of the same
request never says ``applied_verified`` for an effect that was undone.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import sqlalchemy as sa

from capgate.executor import boundaries
from capgate.executor import outcome as oc
from capgate.executor.context import CallContext
from capgate.executor.expectations import CheckResult
from capgate.executor.outcome import Outcome
from capgate.executor.runtime import Runtime
from capgate.executor.transaction import run_checks, run_statements, run_transaction
from capgate.registry.vocabulary import RollbackReason

__all__ = ["compensate", "finish_compensation", "record_final", "run_compensation"]


def compensate(rt: Runtime, ctx: CallContext, applied: Outcome,
               failed: list[CheckResult], evidence: dict[str, Any]) -> Outcome:
    """Run the row's compensation for ``ctx``'s applied effect; the final outcome."""
    comp = dataclasses.replace(
        ctx, intent_id=uuid.uuid4().hex,
        idem_key=f"{ctx.idem_key}#compensation" if ctx.idem_key else None)
    rt.ledger.append(ctx.case_id, "prepared", {
        "request": {"compensates": ctx.intent_id, "operation_id": ctx.row.operation_id,
                    "version": ctx.row.version},
        "state": {"operation_id": ctx.row.operation_id, "version": ctx.row.version,
                  "row_hash": ctx.row.row_hash, "idempotency_key": comp.idem_key,
                  "fingerprint": ctx.fingerprint, "compensates": ctx.intent_id,
                  "connector": ctx.connector.name, "recovery": "reconcile_first",
                  "effect_class": "compensation", "attempt": 0,
                  "inputs": dict(ctx.inputs), "who": ctx.who},
    }, intent_id=comp.intent_id)
    if not ctx.row.compensation:
        # only a row built in code can get here (validation refuses it, CG124): nothing
        # can undo the effect, so nothing may claim it was undone
        result = comp.outcome(oc.ROLLED_BACK, {}, {"kind": RollbackReason.NO_COMPENSATION,
                                                   "message": "the row declares no "
                                                              "compensation; nothing ran"})
    else:
        result = run_transaction(rt, comp, lambda conn, ev: run_compensation(comp, conn, ev))
    restored, checks = finish_compensation(rt, comp, result)
    failures = [f.to_dict() for f in failed]
    comp_evidence = {"intent_id": comp.intent_id, "status": result.status,
                     "evidence": dict(result.evidence), "restored_checks": checks}
    if restored:
        status = oc.COMPENSATED
        reason: dict[str, Any] = {"kind": RollbackReason.POST_COMMIT_FAILED, "checks": failures,
                                  "compensation_intent": comp.intent_id,
                                  "restored_checks": checks}
    else:
        status = oc.COMPENSATION_FAILED
        why = ("the compensation rolled back or did not run" if result.status != oc.APPLIED
               else "the compensation committed but the re-read of the restored state "
                    "does not confirm it")
        reason = {"kind": RollbackReason.COMPENSATION_FAILED, "checks": failures, "why": why,
                  "compensation_intent": comp.intent_id,
                  "compensation": dict(result.reason or {}), "restored_checks": checks}
    final = Outcome(**{**applied.__dict__, "status": status,
                       "evidence": {**evidence, "compensation": comp_evidence},
                       "reason": reason})
    record = final.to_dict()
    # the original intent's recorded outcome is the final one (a replay must not say applied)
    rt.ledger.append(ctx.case_id, "observed", {
        "outcome": record, "after_compensation": comp.intent_id,
        "state": {"outcome": status, "outcome_record": record}}, intent_id=ctx.intent_id)
    rt.ledger.append(ctx.case_id, "post_commit_failed", {
        "case_state": {"last_compensation": {"intent_id": ctx.intent_id,
                                             "status": status}}})
    return final


def finish_compensation(rt: Runtime, comp: CallContext, result: Outcome
                        ) -> tuple[bool, list[dict[str, Any]]]:
    """Record how a compensation attempt ended: observed when restored, else escalated.

    Restored means the compensation committed *and* its ``compensation_verify``
    checks pass on a re-read after COMMIT.  A compensation that is not restored
    never closes: it escalates (a person decides), and stays open, holding the
    case.  Returns (restored, the checks as recorded).
    """
    checks = verify_restored(rt, comp) if result.status == oc.APPLIED else []
    restored = result.status == oc.APPLIED and bool(checks) and all(c["ok"] for c in checks)
    if restored:
        boundaries.observed(rt, comp, result)
    else:
        record = result.to_dict()
        rt.ledger.append(comp.case_id, "escalated", {"outcome": record, "state": {
            "outcome": result.status, "outcome_record": record,
            "escalation": {"kind": RollbackReason.COMPENSATION_FAILED, "by": "executor",
                           "compensation": dict(result.reason or {}),
                           "restored_checks": checks}}},
            intent_id=comp.intent_id, attempt=comp.attempt,
            within=lambda tx: rt.hooks.within_observed(comp, tx))
        rt.hooks.after_observed(comp)
    return restored, checks


def record_final(rt: Runtime, case_id: str, original: str, compensation: str,
                 status: str, checks: list[dict[str, Any]]) -> None:
    """Resume finished a compensation: the original intent's outcome becomes ``status``."""
    state = rt.ledger.intent(case_id, original)
    record = dict(state.get("outcome_record") or {})
    if not record:
        return  # the original was never observed: resume settles it on its own
    record.update(status=status, reason={**(record.get("reason") or {}),
                                         "kind": RollbackReason.POST_COMMIT_FAILED if status ==
                                         oc.COMPENSATED else "compensation_failed",
                                         "compensation_intent": compensation,
                                         "restored_checks": checks}, replayed=False)
    rt.ledger.append(case_id, "observed", {
        "outcome": record, "after_compensation": compensation,
        "state": {"outcome": status, "outcome_record": record}}, intent_id=original)


def run_compensation(ctx: CallContext, conn: sa.Connection, evidence: dict[str, Any]) -> None:
    """The row's compensation statements with their expected counts, in ``conn``'s transaction."""
    run_statements(ctx, conn, evidence, ctx.row.compensation)


def verify_restored(rt: Runtime, ctx: CallContext) -> list[dict[str, Any]]:
    """The row's ``compensation_verify`` checks, after the compensation's COMMIT."""
    if not ctx.row.compensation_verify:
        return []
    results = run_checks(rt, ctx, ctx.row.compensation_verify)
    rt.ledger.append(ctx.case_id, "compensation_verified", {
        "checks": [r.to_dict() for r in results]}, intent_id=None)
    return [r.to_dict() for r in results]
