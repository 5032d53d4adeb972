"""The shapes a call runs in: a read, and the collapsed write (shape A) with its after-COMMIT.

A read runs in an engine-enforced read-only transaction with a row cap; the
ledger keeps its counts and a digest of the rows, not the rows.  A collapsed
write runs statements, verify and replay in one transaction that commits or
rolls back before the call returns -- no model call, human gate or agent hop
in between -- then its post-commit checks, whose failure runs the row's
compensation (never a rollback claim).  The leased shape (B) is
:mod:`executor.lease`.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from capgate.executor import boundaries
from capgate.executor import outcome as oc
from capgate.executor.compensate import compensate
from capgate.executor.context import CallContext
from capgate.executor.dialects.base import CLIENT_GRACE_SECONDS
from capgate.executor.hooks import RetryOutside
from capgate.executor.outcome import Outcome, jsonable
from capgate.executor.plan import binds_for
from capgate.executor.runtime import Runtime
from capgate.executor.transaction import (
    Body,
    db_error_reason,
    run_checks,
    run_statements,
    run_transaction,
    verify_and_replay,
)
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import ConnectorUnavailable, LedgerError
from capgate.registry.vocabulary import RollbackReason

__all__ = ["collapsed", "post_commit", "read"]


def read(rt: Runtime, ctx: CallContext) -> Outcome:
    """A read row: its statements in a read-only transaction, rows capped."""
    row = ctx.row
    dialect = ctx.connector.dialect
    cap = row.max_rows or 1000
    evidence: dict[str, Any] = {"statements": []}
    reason: dict[str, Any] | None = None
    conn = rt.connect(ctx.connector, ctx)  # unreachable: ConnectorUnavailable, nothing
    if not ctx.rehearse:                   # recorded and nothing left open
        try:
            boundaries.prepared(rt, ctx)
        except BaseException:
            conn.close()
            raise
    with conn, dialect.guard(conn, float(row.timeout.seconds) + CLIENT_GRACE_SECONDS):
        try:
            dialect.begin_read(conn, ctx.tag, row.timeout.seconds)
            for i, st in enumerate(row.statements):
                cursor = conn.execute(sa.text(dialect.sql(st.sql, ctx.tag)),
                                      binds_for(st.sql, ctx.inputs))
                columns = list(cursor.keys())
                fetched = cursor.fetchmany(cap + 1)
                truncated = len(fetched) > cap
                rows = [jsonable(list(r)) for r in fetched[:cap]]
                evidence["statements"].append({"columns": columns, "rows": rows,
                                               "count": len(rows), "truncated": truncated})
                if st.expect_rows is not None and not truncated and \
                        not st.expect_rows.matches(len(rows)):
                    reason = {"kind": RollbackReason.COUNT, "statement": i, "name": st.name,
                              "expected": st.expect_rows.to_value(), "actual": len(rows)}
                    break
        except sa.exc.DBAPIError as exc:
            reason = db_error_reason(ctx, exc, "statement")
        finally:
            conn.rollback()
            dialect.end_read(conn)
    if len(evidence["statements"]) == 1:
        evidence = evidence["statements"][0]
    status = oc.READ_OK if reason is None else oc.ROLLED_BACK
    answer = ctx.outcome(status, evidence, reason)
    if not ctx.rehearse:
        # the ledger keeps what was read (counts and a digest), not the rows themselves
        summary = {k: v for k, v in evidence.items() if k not in ("rows", "statements")}
        summary["rows_digest"] = canonical_hash(jsonable(evidence))
        boundaries.observed(rt, ctx, Outcome(**{**answer.__dict__, "evidence": summary}))
    return answer


_WAITS = 64
"""How many times a call may wait in line and prepare again (each wait is bounded too)."""


def collapsed(rt: Runtime, ctx: CallContext) -> Outcome:
    """Shape A: statements, verify and replay in one transaction; then post-commit checks."""
    rt.check_target(ctx.connector, ctx)
    first = ctx

    def attempt(c: CallContext) -> Outcome:
        # the first attempt records itself with the intent (one durable commit before
        # any statement); a retry under the timeout contract records attempt_started
        body: Body = lambda conn, ev: _statements(c, conn, ev)  # noqa: E731
        if c is not first or c.rehearse or c.resumed:
            return run_transaction(rt, c, body)
        for _ in range(_WAITS):
            try:
                return run_transaction(rt, c, body, prepare=True)
            except RetryOutside as wait:
                # a key another case's call holds, or no free session: the transaction
                # was rolled back (nothing of the row sent, nothing recorded); wait in
                # line outside it -- bounded, a refusal at the end -- then open again
                wait.prepare()
        raise LedgerError(f"intent {c.intent_id} waited in line {_WAITS} times without "
                          "preparing; retry the call", case_id=c.case_id)

    ctx, result = boundaries.attempts(rt, ctx, attempt)
    if ctx.rehearse:
        return result
    return finish(rt, ctx, result)


def finish(rt: Runtime, ctx: CallContext, result: Outcome) -> Outcome:
    """``observed``, then (applied, with post-commit checks) the checks and compensation."""
    boundaries.observed(rt, ctx, result)
    if result.status == oc.APPLIED and ctx.row.post_commit:
        return post_commit(rt, ctx, result)
    return result


def _statements(ctx: CallContext, conn: sa.Connection, evidence: dict[str, Any]) -> None:
    run_statements(ctx, conn, evidence)
    verify_and_replay(ctx, conn, evidence)


def post_commit(rt: Runtime, ctx: CallContext, applied: Outcome) -> Outcome:
    """The row's post-commit checks; a failure runs the compensation (never a rollback)."""
    try:
        results = run_checks(rt, ctx, ctx.row.post_commit)
    except ConnectorUnavailable as exc:
        # the write committed; only its after-the-fact checks could not run: say so,
        # never a refusal (exit 1) for an effect that landed
        unchecked = {"unchecked": exc.message}
        rt.ledger.append(ctx.case_id, "post_commit_unchecked", {
            "intent_id": ctx.intent_id, "error": exc.message}, intent_id=None)
        return Outcome(**{**applied.__dict__,
                          "evidence": {**applied.evidence, "post_commit": unchecked}})
    failed = [r for r in results if not r.ok]
    evidence = {**applied.evidence, "post_commit": [r.to_dict() for r in results]}
    if not failed:
        rt.ledger.append(ctx.case_id, "post_commit_checked", {
            "checks": [r.to_dict() for r in results]}, intent_id=None)
        return Outcome(**{**applied.__dict__, "evidence": evidence})
    return compensate(rt, ctx, applied, failed, evidence)
