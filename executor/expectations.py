"""Evaluating a check's expectation against the rows a query returned.

The comparison is deliberately plain: a row count (exact or a range), the
first column of the first row, or all rows.  Database values are normalised
to JSON first (decimals, dates), and numbers compare by value, so ``600.00``
from a NUMERIC column equals ``600`` in the row.
"""

from __future__ import annotations

import decimal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from capgate.executor.outcome import jsonable
from capgate.registry.model import Expect


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    expected: Any
    actual: Any

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "expected": self.expected,
                "actual": self.actual}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a == b)
    number = int | float | decimal.Decimal
    if isinstance(a, number) and isinstance(b, number):
        return decimal.Decimal(str(a)) == decimal.Decimal(str(b))
    if isinstance(a, str) and isinstance(b, int | float | decimal.Decimal):
        return _numeric_text_equals(a, b)
    if isinstance(b, str) and isinstance(a, int | float | decimal.Decimal):
        return _numeric_text_equals(b, a)
    return bool(a == b)


def _numeric_text_equals(text: str, number: Any) -> bool:
    try:
        return decimal.Decimal(text) == decimal.Decimal(str(number))
    except decimal.InvalidOperation:
        return False


def evaluate(name: str, expect: Expect, rows: Sequence[Sequence[Any]]) -> CheckResult:
    """Does ``rows`` meet ``expect``?  Returns expected and actual for the evidence."""
    expected: dict[str, Any] = {}
    actual: dict[str, Any] = {}
    ok = True
    if expect.rows is not None:
        expected["rows"] = expect.rows.to_value()
        actual["rows"] = len(rows)
        ok = ok and expect.rows.matches(len(rows))
    if expect.has_value:
        first = jsonable(rows[0][0]) if rows and len(rows[0]) else None
        expected["value"] = expect.value
        actual["value"] = first
        ok = ok and bool(rows) and _same(first, expect.value)
    if expect.values is not None:
        got = [[jsonable(v) for v in r] for r in rows]
        want = [list(r) for r in expect.values]
        expected["values"] = want
        actual["values"] = got
        ok = ok and len(got) == len(want) and all(
            len(g) == len(w) and all(_same(x, y) for x, y in zip(g, w, strict=True))
            for g, w in zip(got, want, strict=True))
    return CheckResult(name, ok, expected, actual)
