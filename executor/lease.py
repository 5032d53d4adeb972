"""Leased transactions (shape B): declared deterministic steps under a deadline.

Only the row's declared steps run inside the lease -- SQL with expected
counts, and checks that branch (continue, skip forward to a named step, or
abort with a reason).  There is no way to hand control to a model, a person
or another agent while the transaction is open.  The server enforces the
deadline too (the dialect sets statement and idle-in-transaction timeouts
from the row's timeout), so a hung or killed executor cannot hold locks past
it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from executor.checks import evaluate
from executor.outcome import Outcome
from executor.plan import binds_for

if TYPE_CHECKING:
    from executor.call import CallContext, Executor


def run_leased(executor: Executor, ctx: CallContext) -> Outcome:
    from executor.call import Rollback

    row = ctx.row
    ctx.connector.ensure_marker()

    def body(conn: sa.Connection, evidence: dict[str, Any]) -> None:
        dialect = ctx.connector.dialect
        trace: list[dict[str, Any]] = []
        evidence["steps"] = trace
        counts: list[int] = []
        evidence["counts"] = counts
        skip_to: str | None = None
        for step in row.steps:
            if skip_to is not None:
                if step.name != skip_to:
                    trace.append({"step": step.name, "skipped": True})
                    continue
                skip_to = None
            if step.sql is not None:
                n = conn.execute(sa.text(dialect.sql(step.sql, ctx.tag)),
                                 binds_for(step.sql, ctx.inputs)).rowcount
                counts.append(n)
                trace.append({"step": step.name, "rows": n})
                if step.expect_rows is not None and not step.expect_rows.matches(n):
                    raise Rollback({"kind": "count", "step": step.name, "sql": step.sql,
                                    "expected": step.expect_rows.to_value(), "actual": n})
            elif step.check is not None and step.expect is not None:
                rows = conn.execute(sa.text(dialect.sql(step.check, ctx.tag)),
                                    binds_for(step.check, ctx.inputs)).fetchmany(1001)
                result = evaluate(step.name, step.expect, rows)
                trace.append({"step": step.name, "check": result.to_dict()})
                if result.ok:
                    continue
                if step.abort is not None:
                    raise Rollback({"kind": "abort", "step": step.name, "reason": step.abort,
                                    "expected": result.expected, "actual": result.actual})
                skip_to = step.skip_to
            else:
                from executor.steps import run_registered

                trace.append(run_registered(step.function or "", conn, ctx))
        executor.verify_and_replay(ctx, conn, evidence)

    if not ctx.rehearse:
        executor._prepared(ctx)
    result = executor.run_transaction(ctx, body)
    if ctx.rehearse:
        return result
    return executor._observed(ctx, result)
