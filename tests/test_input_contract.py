"""A call's input check: the compiled contract's quick "valid" never disagrees with jsonschema.

``executor.context.validate_input`` first asks :mod:`registry.fastload.fastschema`'s
compiled form of the row's contract, and only on a False asks jsonschema
(which decides and words the errors).  The quick answer must never accept
what jsonschema refuses: checked here on every example row's contract with
inputs drawn around it, valid and not.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capgate.executor.context import validate_input
from capgate.registry.errors import InputInvalid
from capgate.registry.loader import load_registry
from capgate.registry.model import Row, thaw
from tests.test_init import ROOT

ROWS: list[Row] = [r for r in load_registry([ROOT / "capabilities"], check_lock=False)
                   .current_rows() if r.input]

_scalars = (st.none() | st.booleans() | st.integers(-2**53 + 1, 2**53 - 1)
            | st.floats(allow_nan=False, allow_infinity=False, width=32)
            | st.text(max_size=12) | st.sampled_from(["", "x" * 300, "2026-12-01",
                                                     "2026-12-01T10:00:00Z", "ok"]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _inputs(row: Row) -> st.SearchStrategy[dict[str, Any]]:
    props = list(dict(thaw(row.input)).get("properties", {}))
    names = st.sampled_from([*props, "extra"]) if props else st.just("extra")
    return st.dictionaries(names, _values, max_size=len(props) + 1)


@pytest.mark.parametrize("row", ROWS, ids=[r.ref for r in ROWS])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_quick_yes_agrees_with_jsonschema(row: Row, data: st.DataObject) -> None:
    inputs = data.draw(_inputs(row))
    expected = jsonschema.Draft202012Validator(dict(thaw(row.input))).is_valid(inputs)
    try:
        validate_input(row, inputs)
        accepted = True
    except InputInvalid:
        accepted = False
    assert accepted == expected, (row.ref, inputs)
