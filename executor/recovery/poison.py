"""The poisoned resume: re-run the checks of completed steps before continuing.

A case's later work depends on what its earlier, applied steps left in the
target.  Before resume lets a case continue, it re-runs the ``verify`` checks
of those steps in an engine-enforced read-only transaction (one per
connector).  A check that no longer holds means the target changed under the
case -- by another case, a person, a restore -- and resume reports it instead
of continuing.

Which steps: every applied intent of the case whose row declares verify
checks, keeping only the latest applied write per impact key (environment,
system, object, key values) -- a later write of the same case to the same
target legitimately supersedes what an earlier one verified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from capgate.executor import outcome as oc
from capgate.executor.call import Executor
from capgate.executor.dialects import SessionTag
from capgate.executor.expectations import evaluate
from capgate.executor.plan import binds_for, impact_keys
from capgate.registry.errors import CapgateError
from capgate.registry.model import Row


@dataclass(frozen=True)
class Dependency:
    """A completed step of the case whose checks later work relies on."""

    case_id: str
    intent_id: str
    row: Row
    inputs: Mapping[str, Any]
    connector: str
    impact_key: str
    order: int


@dataclass(frozen=True)
class Recheck:
    """The verify checks of one completed step, run again now."""

    dependency: Dependency
    checks: tuple[dict[str, Any], ...]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(c["ok"] for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        d = self.dependency
        return {"intent_id": d.intent_id, "operation_id": d.row.operation_id,
                "version": d.row.version, "impact_key": d.impact_key,
                "checks": list(self.checks), "error": self.error, "ok": self.ok}


def applied(state: Mapping[str, Any]) -> bool:
    """Whether an intent's recorded outcome is an applied write."""
    record = state.get("outcome_record")
    return isinstance(record, Mapping) and record.get("status") == oc.APPLIED


def dependencies(case_id: str, intents: Iterable[tuple[str, Mapping[str, Any], int]],
                 row_of: Callable[[str, int], Row | None]) -> list[Dependency]:
    """The applied steps to re-check: the latest applied write per impact key."""
    latest: dict[str, Dependency] = {}
    for intent_id, state, order in intents:
        if not applied(state) or state.get("compensates") or state.get("effect_class") in (
                "ddl", "compensation"):
            continue
        row = row_of(str(state.get("operation_id")), int(state.get("version") or 0))
        if row is None or not row.is_write:
            continue
        inputs = dict(state.get("inputs") or {})
        env = str(state.get("environment") or "")
        key = f"{state.get('connector')}|{impact_keys(row, inputs, env)[0]}"
        dep = Dependency(case_id, intent_id, row, inputs, str(state.get("connector")), key, order)
        if key not in latest or latest[key].order < order:
            latest[key] = dep
    return sorted((d for d in latest.values() if d.row.verify), key=lambda d: d.order)


def recheck(executor: Executor, deps: list[Dependency]) -> list[Recheck]:
    """Run the verify checks of ``deps`` again, read-only, one transaction per connector."""
    out: list[Recheck] = []
    by_connector: dict[str, list[Dependency]] = {}
    for d in deps:
        by_connector.setdefault(d.connector, []).append(d)
    for name, items in by_connector.items():
        try:
            connector = executor.connectors.get(name)
            dialect = connector.dialect
            cases = {d.case_id for d in items}
            tag = SessionTag(items[0].case_id if len(cases) == 1 else f"{len(cases)} cases",
                             "capgate.resume", "recheck")
            with connector.engine.connect() as conn:
                try:
                    dialect.begin_read(conn, tag, 10.0)
                    # every check of every dependency sent together (pipelined where the
                    # driver can), then each evaluated against its own rows
                    answers = iter(dialect.read_many(conn, [
                        (dialect.sql(check.sql, tag), binds_for(check.sql, d.inputs))
                        for d in items for check in d.row.verify], 1001))
                    for d in items:
                        results = [evaluate(check.name, check.expect, next(answers)).to_dict()
                                   for check in d.row.verify]
                        out.append(Recheck(d, tuple(results)))
                finally:
                    conn.rollback()
                    dialect.end_read(conn)
        except (CapgateError, sa.exc.SQLAlchemyError) as exc:
            orig = getattr(exc, "orig", None) or exc
            reason = (str(orig).strip().splitlines() or [type(exc).__name__])[0]
            done = {r.dependency.intent_id for r in out}
            out.extend(Recheck(d, (), error=reason) for d in items if d.intent_id not in done)
    return out
