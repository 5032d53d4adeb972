"""The fast canonical-JSON path gives exactly RFC 8785's bytes, or defers to it."""

from __future__ import annotations

from typing import Any

import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.canonical import canonical_bytes

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_matches_rfc8785(value: Any) -> None:
    try:
        expected = rfc8785.dumps(value)
    except Exception:
        return  # values RFC 8785 rejects (e.g. lone surrogates) are not hashed
    assert canonical_bytes(value) == expected


def test_known_differences_take_the_reference_path() -> None:
    assert canonical_bytes({"a": 1.0, "b": 1e21}) == rfc8785.dumps({"a": 1.0, "b": 1e21})
    keys = {"\U0001f600": 1, "\ufb01": 2}
    assert canonical_bytes(keys) == rfc8785.dumps(keys)
    assert canonical_bytes({"b": [1, "x\n\u2028"], "a": None}) == \
        b'{"a":null,"b":[1,"x\\n\xe2\x80\xa8"]}'
