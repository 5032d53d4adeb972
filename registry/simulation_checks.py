"""Row checks of the simulation-first fields (issue 16): ``returns`` and ``expected_effects``.

A statement's ``returns: {table, key}`` drives what the executor records and
what a simulation's teardown removes, so it must say exactly what the SQL
does: one INSERT, UPDATE or DELETE of ``table`` (parsed with sqlglot, as every
other check), without a ``RETURNING`` clause of its own -- each dialect adds
the one it supports -- and no two statements may return the same name.  An
expected effect observed by a returned value must name one of those keys.
An effect is observed exactly one way (``CG104``).  The findings are ``CG680``
and ``CG681`` (:mod:`registry.errors`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from capgate.registry.errors import Problem
from capgate.registry.fastload.yamlpos import Path
from capgate.registry.model import leading_keyword
from capgate.registry.rules import (
    EFFECT_NAMES_NO_RETURN,
    INVALID_VALUE,
    RETURNS_MISMATCH,
)


class _Located(Protocol):
    """A row being checked (``registry.checks.RowContext``: not imported, no cycle)."""

    row: Mapping[str, Any]

    def at(self, path: Path, code: str, message: str, *, key: bool = False) -> Problem: ...

_WRITES = {"INSERT": "Insert", "UPDATE": "Update", "DELETE": "Delete"}


def written_table(sql: str) -> tuple[str | None, str | None]:
    """(the statement's kind, the table it writes), or (None, why) when it is not one write.

    Parsed with sqlglot in every dialect the checks know, first that parses wins.
    """
    import sqlglot
    from sqlglot import exp

    last = "unparseable"
    for dialect in (None, "postgres", "mysql", "sqlite", "oracle"):
        try:
            trees = [t for t in sqlglot.parse(sql, read=dialect) if t is not None]
        except (sqlglot.errors.SqlglotError, RecursionError) as exc:
            last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            continue
        if len(trees) != 1:
            return None, f"is {len(trees)} statements, not one"
        tree = trees[0]
        kind = type(tree).__name__
        if kind not in _WRITES.values():
            return None, f"is a {tree.key.upper()} statement, not an INSERT, UPDATE or DELETE"
        if tree.find(exp.Returning) is not None:
            return None, "has a RETURNING clause of its own (the dialect adds the one it supports)"
        node: Any = tree.this
        if isinstance(node, exp.Schema):
            node = node.this
        if not isinstance(node, exp.Table):
            return None, "writes no plain table"
        return kind.upper(), node.name
    return None, f"cannot be parsed: {last}"


def simulation_problems(ctx: _Located) -> list[Problem]:
    """CG680 for a ``returns`` that does not fit its statement, CG681 for an effect naming
    a value no statement returns."""
    row = ctx.row
    out: list[Problem] = []
    returned: set[str] = set()
    for i, st in enumerate(row.get("statements", ())):
        spec: Mapping[str, Any] | None = st.get("returns")
        if not spec:
            continue
        path = ("statements", i, "returns")
        if row["effect_class"] == "read":
            out.append(ctx.at(path, RETURNS_MISMATCH.code,
                              "a read returns rows, not keys: only a write "
                              "statement declares `returns`"))
            continue
        kind, table = written_table(st["sql"])
        if kind is None:
            out.append(ctx.at(path, RETURNS_MISMATCH.code, f"the statement {table}"))
        elif leading_keyword(st["sql"]) != kind:
            out.append(ctx.at(path, RETURNS_MISMATCH.code,
                              f"the statement is an {kind} but does not begin "
                              f"with {kind} (write it as a plain {kind})"))
        elif (table or "").lower() != spec["table"].lower():
            out.append(ctx.at(("statements", i, "returns", "table"), RETURNS_MISMATCH.code,
                              f"the statement writes {table!r}, not {spec['table']!r}"))
        if spec["key"] in returned:
            out.append(ctx.at(("statements", i, "returns", "key"), RETURNS_MISMATCH.code,
                              f"another statement already returns {spec['key']!r}: each "
                              "returned name is one value of the outcome"))
        returned.add(spec["key"])
    for i, effect in enumerate(row.get("expected_effects", ())):
        ways = [k for k in ("probe", "returned", "unobservable") if k in effect]
        if len(ways) != 1:
            out.append(ctx.at(("expected_effects", i), INVALID_VALUE.code,
                              "an expected effect is observed exactly one way -- `probe` (a "
                              "query that finds it), `returned` (a value a statement returns) "
                              "or `unobservable` (why nothing can see it); found "
                              f"{' and '.join(ways) or 'none'}"))
        name = effect.get("returned")
        if name is not None and name not in returned:
            out.append(ctx.at(("expected_effects", i, "returned"), EFFECT_NAMES_NO_RETURN.code,
                              f"no statement returns {name!r} (returned: "
                              f"{', '.join(sorted(returned)) or 'none'})"))
    return out
