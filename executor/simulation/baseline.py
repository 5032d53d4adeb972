"""The baseline: the pre-state a simulation captures before its first write, and re-reads.

What is read: the rows the row's target names -- ``SELECT * FROM object WHERE
key = :key ...`` for each target key, identifiers from the reviewed row, values
bound from the inputs (unless ``simulation.target_baseline: false``) -- plus
the row's declared ``simulation.baseline`` queries.  All of them run in one
engine-enforced read-only transaction, so they see one state.

Each query's result is its columns and its rows as JSON (the executor's
``jsonable``), sorted by their canonical encoding so that row order never
matters, and digested (SHA-256 over RFC 8785 JSON).  The restoration is
verified by reading the same queries again and comparing digests -- the same
bytes, or a mismatch that names both digests and the rows that differ.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from capgate.executor.connectors import Connector
from capgate.executor.dialects import SessionTag
from capgate.executor.outcome import jsonable
from capgate.executor.plan import binds_for
from capgate.executor.runtime import Runtime
from capgate.registry.canonical import canonical_bytes, canonical_hash
from capgate.registry.errors import BaselineUnreadable
from capgate.registry.excerpt import bounded, cut
from capgate.registry.model import Row

__all__ = ["MAX_BASELINE_ROWS", "Baseline", "BaselineRead", "baseline_queries", "compare",
           "read_baseline"]

MAX_BASELINE_ROWS = 10_000
"""More rows than this in one baseline query is refused: narrow the query."""
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def baseline_queries(row: Row, inputs: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, sql) of every baseline query for this request, the target's first."""
    out: list[tuple[str, str]] = []
    spec = row.simulation
    keys = [k for k in row.target.keys if inputs.get(k) is not None]
    wanted = spec.target_baseline if spec is not None else True
    if wanted and keys and _IDENTIFIER.match(row.target.object) \
            and all(_IDENTIFIER.match(k) for k in keys):
        where = " AND ".join(f"{k} = :{k}" for k in keys)
        out.append(("target", f"SELECT * FROM {row.target.object} WHERE {where}"))
    if spec is not None:
        out.extend((q.name, q.sql) for q in spec.baseline)
    return out


@dataclass(frozen=True)
class BaselineRead:
    """One baseline query's result, sorted and digested."""

    name: str
    sql: str
    binds: Mapping[str, Any]
    columns: tuple[str, ...]
    rows: tuple[Any, ...]
    digest: str

    def to_dict(self, *, rows: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "sql": self.sql, "binds": dict(self.binds),
                               "columns": list(self.columns), "count": len(self.rows),
                               "digest": self.digest}
        if rows:
            out["rows"] = bounded([list(r) for r in self.rows])
        return out


@dataclass(frozen=True)
class Baseline:
    reads: tuple[BaselineRead, ...]

    @property
    def digest(self) -> str:
        """One digest over every query's digest, in order."""
        return canonical_hash([[r.name, r.digest] for r in self.reads])

    def to_dict(self, *, rows: bool = True) -> dict[str, Any]:
        return {"digest": self.digest, "queries": [r.to_dict(rows=rows) for r in self.reads]}


def _one(name: str, sql: str, binds: Mapping[str, Any], columns: Sequence[str],
         raw: Sequence[Sequence[Any]]) -> BaselineRead:
    rows = [jsonable(list(r)) for r in raw]
    rows.sort(key=canonical_bytes)
    digest = canonical_hash({"columns": list(columns), "rows": rows})
    return BaselineRead(name, sql, dict(binds), tuple(columns), tuple(rows), digest)


def read_baseline(rt: Runtime, connector: Connector, queries: Sequence[tuple[str, str]],
                  inputs: Mapping[str, Any], tag: SessionTag, timeout_s: float) -> Baseline:
    """Every baseline query, in one read-only transaction (BaselineUnreadable on failure)."""
    dialect = connector.dialect
    reads: list[BaselineRead] = []
    with rt.connect(connector) as conn:
        try:
            dialect.begin_read(conn, tag, timeout_s)
            for name, sql in queries:
                binds = binds_for(sql, inputs)
                try:
                    cursor = conn.execute(sa.text(dialect.sql(sql, tag)), binds)
                except sa.exc.DBAPIError as exc:
                    message = cut(str(exc.orig).strip().splitlines()[0] if exc.orig
                                  else str(exc), 300)
                    raise BaselineUnreadable(
                        f"baseline query {name!r} ({cut(' '.join(sql.split()), 200)}) could "
                        f"not be read on {connector.name!r}: {message}; fix it, or declare the "
                        "baseline (simulation.baseline, simulation.target_baseline: false); "
                        "nothing was written", query=name, connector=connector.name) from None
                raw = cursor.fetchmany(MAX_BASELINE_ROWS + 1)
                if len(raw) > MAX_BASELINE_ROWS:
                    raise BaselineUnreadable(
                        f"baseline query {name!r} returns more than {MAX_BASELINE_ROWS} rows: "
                        "a simulation's baseline must name the rows it can change; nothing "
                        "was written", query=name, connector=connector.name)
                reads.append(_one(name, sql, binds, list(cursor.keys()), raw))
        finally:
            conn.rollback()
            dialect.end_read(conn)
    return Baseline(tuple(reads))


def compare(before: Mapping[str, Any], after: Baseline) -> list[dict[str, Any]]:
    """The queries whose digest differs (empty: restored), each with both digests and the
    rows that are only before or only after (as recorded: bounded)."""
    recorded = {q["name"]: q for q in before.get("queries", ())}
    out: list[dict[str, Any]] = []
    for read in after.reads:
        was = recorded.get(read.name)
        if was is not None and was.get("digest") == read.digest:
            continue
        old_rows = [canonical_bytes(r) for r in (was or {}).get("rows", ())]
        new_rows = [canonical_bytes(list(r)) for r in read.rows]
        out.append({"name": read.name, "before_digest": (was or {}).get("digest"),
                    "after_digest": read.digest,
                    "only_before": bounded([r.decode() for r in old_rows if r not in new_rows]),
                    "only_after": bounded([r.decode() for r in new_rows if r not in old_rows])})
    missing = set(recorded) - {r.name for r in after.reads}
    out.extend({"name": name, "before_digest": recorded[name].get("digest"),
                "after_digest": None} for name in sorted(missing))
    return out
