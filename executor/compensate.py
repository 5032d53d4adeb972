"""Compensation after a failed post-commit check.

A post-commit check runs after COMMIT, so its failure can never be a
rollback: the effect is there.  The row's already-written compensation runs
as a new action with its own intent in the same case -- prepared, attempt,
marker, observed -- so that a crash during compensation is reconciled like
any other write.  A failed compensation is its own outcome and escalates.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from executor import outcome as oc
from executor.checks import CheckResult
from executor.outcome import Outcome
from executor.plan import binds_for

if TYPE_CHECKING:
    from executor.call import CallContext, Executor


def compensate(executor: Executor, ctx: CallContext, applied: Outcome,
               failed: list[CheckResult], evidence: dict[str, Any]) -> Outcome:
    from executor.call import Rollback

    comp = dataclasses.replace(
        ctx, intent_id=uuid.uuid4().hex,
        idem_key=f"{ctx.idem_key}#compensation" if ctx.idem_key else None)
    ledger = executor.ledger
    ledger.append(ctx.case_id, "prepared", {
        "request": {"compensates": ctx.intent_id, "operation_id": ctx.row.operation_id,
                    "version": ctx.row.version},
        "state": {"operation_id": ctx.row.operation_id, "version": ctx.row.version,
                  "row_hash": ctx.row.row_hash, "idempotency_key": comp.idem_key,
                  "fingerprint": ctx.fingerprint, "compensates": ctx.intent_id,
                  "connector": ctx.connector.name, "recovery": "reconcile_first",
                  "effect_class": "compensation", "attempt": 0,
                  "inputs": dict(ctx.inputs), "who": ctx.who},
    }, intent_id=comp.intent_id)

    def body(conn: sa.Connection, ev: dict[str, Any]) -> None:
        dialect = ctx.connector.dialect
        counts: list[int] = []
        ev["counts"] = counts
        for i, st in enumerate(ctx.row.compensation):
            n = conn.execute(sa.text(dialect.sql(st.sql, comp.tag)),
                             binds_for(st.sql, ctx.inputs)).rowcount
            counts.append(n)
            if st.expect_rows is not None and not st.expect_rows.matches(n):
                raise Rollback({"kind": "count", "statement": i, "sql": st.sql,
                                "expected": st.expect_rows.to_value(), "actual": n})

    result = executor.run_transaction(comp, body)
    executor._observed(comp, result)
    failures = [f.to_dict() for f in failed]
    if result.status == oc.APPLIED:
        status = oc.COMPENSATED
        reason: dict[str, Any] = {"kind": "post_commit_failed", "checks": failures,
                  "compensation_intent": comp.intent_id}
    else:
        status = oc.COMPENSATION_FAILED
        reason = {"kind": "compensation_failed", "checks": failures,
                  "compensation_intent": comp.intent_id, "compensation": dict(result.reason or {})}
        ledger.append(ctx.case_id, "escalated", {
            "state": {"escalation": reason}}, intent_id=comp.intent_id)
    evidence = {**evidence, "compensation": {"intent_id": comp.intent_id,
                                             "status": result.status,
                                             "evidence": dict(result.evidence)}}
    final = Outcome(**{**applied.__dict__, "status": status, "evidence": evidence,
                       "reason": reason})
    ledger.append(ctx.case_id, "post_commit_failed", {
        "case_state": {"last_compensation": {"intent_id": ctx.intent_id,
                                             "status": status}}})
    return final
