"""The fast canonical-JSON path gives exactly RFC 8785's bytes, or defers to it."""

from __future__ import annotations

import functools
from typing import Any

import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from capgate.registry.canonical import canonical_bytes

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


_names = st.text(min_size=1, max_size=12)


@functools.cache
def _row() -> Any:
    from capgate.registry.loader import load_registry
    from tests.test_init import ROOT

    return load_registry([ROOT / "capabilities"], check_lock=False).resolve("policy.add_note")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4), _names, _names,
       _names, _names)
def test_hashes_built_from_parts_equal_the_whole_object_hash(
        inputs: dict[str, Any], connector: str, environment: str, case: str,
        requester: str) -> None:
    """The fingerprint and plan hash, built from the inputs' text once, are the hashes of
    the objects they name (what every ledger and approval recorded so far holds)."""
    from capgate.executor.plan import fingerprint, plan_hash
    from capgate.registry.canonical import canonical_hash, canonical_text, scalar_text

    try:
        rfc8785.dumps(inputs)
    except Exception:
        return
    row = _row()
    text = canonical_text(inputs)
    whole_fp = canonical_hash({"operation_id": row.operation_id, "version": row.version,
                               "row_hash": row.row_hash, "inputs": inputs,
                               "connector": connector, "environment": environment})
    whole_plan = canonical_hash({"plan": 2, "row_hash": row.row_hash, "inputs": inputs,
                                 "connector": connector, "environment": environment,
                                 "case": case, "requester": requester})
    for given_text in (None, text):
        assert fingerprint(row, inputs, connector, environment,
                           inputs_text=given_text) == whole_fp
        assert plan_hash(row, inputs, connector, environment, case, requester,
                         inputs_text=given_text) == whole_plan
    for scalar in (connector, 0, 2**53 - 1, -(2**53) + 1, None):
        assert scalar_text(scalar) == canonical_text(scalar)
