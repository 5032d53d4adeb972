"""Expected effects: what a rollback does not undo, recorded with the outcome that rolled back.

A row declares its ``expected_effects`` -- sequence values consumed, triggers
that call out, autonomous audit rows, queue messages, documents, numbering,
external registrations -- each with its class and how it is observed.  A
rolled-back outcome still records the effects that survived the rollback
(``evidence["survived_rollback"]``): the key values a sequence gave (from the
returned keys, on an engine that does not give them back) and what each
effect's probe finds once the transaction is gone, read on the same session
right after the ROLLBACK.  An effect without a probe is not verifiable after
the fact, and the record says so instead of guessing.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from capgate.executor.context import CallContext
from capgate.executor.expectations import evaluate
from capgate.executor.outcome import jsonable
from capgate.executor.plan import binds_for
from capgate.registry.excerpt import cut

__all__ = ["record_survivors"]


def record_survivors(ctx: CallContext, conn: sa.Connection, evidence: dict[str, Any]) -> None:
    """After a ROLLBACK on ``conn``: record in ``evidence`` what of the row's expected effects
    survived it.  Nothing to do (and no round trip) for a row that declares none."""
    effects = ctx.row.expected_effects
    if not effects:
        return
    by_returned = {e["effect"]: e for e in evidence.get("effects", ())}
    survived: list[dict[str, Any]] = []
    probed = [e for e in effects if e.probe is not None]
    results: dict[str, dict[str, Any]] = {}
    if probed:
        dialect = ctx.connector.dialect
        try:
            dialect.begin_read(conn, ctx.tag, ctx.row.timeout.seconds)
            for e in probed:
                assert e.probe is not None
                rows = conn.execute(sa.text(dialect.sql(e.probe.sql, ctx.tag)),
                                    binds_for(e.probe.sql, ctx.inputs)).fetchmany(101)
                check = evaluate(e.name, e.probe.expect, rows)
                results[e.name] = {"rows": jsonable([list(r) for r in rows[:100]]),
                                   "present": check.ok}
        except sa.exc.DBAPIError as exc:  # the session is gone: say so, never guess
            message = cut(str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc), 300)
            for e in probed:
                results.setdefault(e.name, {"error": message})
        finally:
            try:
                conn.rollback()
                dialect.end_read(conn)
            except sa.exc.DBAPIError:
                pass
    for e in effects:
        item: dict[str, Any] = {"effect": e.name, "class": e.effect_class,
                                "verifiable": e.verifiable}
        if e.name in by_returned:
            seen = by_returned[e.name]
            item.update(values=seen["values"], survived=seen.get("survives_rollback"))
        elif e.name in results:
            found = results[e.name]
            item.update(probe=found, survived=found.get("present"))
        else:
            item.update(survived=None, note=e.unobservable or
                        "not observed: the statement that shows it did not run")
        survived.append(item)
    evidence["survived_rollback"] = survived
