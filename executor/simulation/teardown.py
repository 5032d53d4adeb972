"""The teardown, derived from the write log: exactly the set written, nothing else.

What a simulation wrote is known from two things the row already declares,
never from a teardown authored afterwards:

* the keys an INSERT returned (``returns: {table, key}``): the teardown
  deletes exactly those rows, one statement per key with an expected count of
  one -- so a row a concurrent writer added meanwhile (another key) is never
  touched, and a key that is gone rolls the teardown back instead of deleting
  something else;
* the row's ``compensation``, already written and reviewed, for every other
  write statement (an UPDATE, a DELETE).

A write statement covered by neither cannot be torn down: the row cannot be
simulated (``TeardownUnderivable``), and it fails exemption point 3.  The
compensation runs first (it undoes the updates in the order its author wrote),
then the returned keys are deleted, last statement first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capgate.registry.errors import TeardownUnderivable
from capgate.registry.model import ExpectRows, Returns, Row, Statement

__all__ = ["TeardownPlan", "derive", "underivable", "write_statements"]


def write_statements(row: Row) -> list[tuple[str, str]]:
    """(name, sql) of every statement that writes: a collapsed row's statements, a
    leased row's SQL steps."""
    if row.steps:
        return [(s.name, s.sql) for s in row.steps if s.sql]
    return [(s.name or f"#{i + 1}", s.sql) for i, s in enumerate(row.statements)]


def underivable(row: Row) -> list[str]:
    """The write statements no teardown covers (empty: the teardown can be derived)."""
    if row.compensation:
        return []
    covered = {s.name or f"#{i + 1}" for i, s in enumerate(row.statements)
               if s.returns is not None and s.verb == "INSERT"}
    return [name for name, _ in write_statements(row) if name not in covered]


@dataclass(frozen=True)
class TeardownPlan:
    """What the teardown will run: the row's compensation, then the returned keys' deletes."""

    compensation: tuple[Statement, ...]
    deletes: tuple[tuple[str, Returns], ...]
    """(statement name, what it returns) for each INSERT whose keys are deleted, last first."""

    def statements(self, returned: Mapping[str, Any]) -> tuple[list[Statement], dict[str, Any]]:
        """The statements for the keys actually returned, and the binds they take.

        Each returned key is deleted on its own (``DELETE FROM table WHERE key =
        :capgate_teardown_N``, expected count 1); table and key are identifiers
        of the reviewed row, the values are bound.
        """
        out = list(self.compensation)
        binds: dict[str, Any] = {}
        for _, ret in self.deletes:
            for value in returned.get(ret.key) or ():
                name = f"capgate_teardown_{len(binds)}"
                binds[name] = value
                out.append(Statement(f"DELETE FROM {ret.table} WHERE {ret.key} = :{name}",
                                     ExpectRows(1, 1), name=f"teardown_{ret.key}"))
        return out, binds

    def to_dict(self) -> dict[str, Any]:
        return {"compensation": [{"name": s.name, "sql": s.sql,
                                  "expect_rows": s.expect_rows.to_value()
                                  if s.expect_rows else None} for s in self.compensation],
                "delete_returned": [{"statement": name, "table": r.table, "key": r.key}
                                    for name, r in self.deletes]}


def derive(row: Row) -> TeardownPlan:
    """The teardown of ``row``'s effect, or TeardownUnderivable naming what it cannot cover."""
    missing = underivable(row)
    if missing:
        raise TeardownUnderivable(
            f"{row.ref} cannot be torn down from its write log: statement(s) "
            f"{', '.join(missing)} neither return the keys they insert (`returns`) nor are "
            "covered by a written `compensation`; nothing ran", operation_id=row.operation_id,
            version=row.version, statements=missing)
    deletes = tuple((s.name or f"#{i + 1}", s.returns) for i, s in enumerate(row.statements)
                    if s.returns is not None and s.verb == "INSERT")
    return TeardownPlan(tuple(row.compensation), tuple(reversed(deletes)))
