"""A call's input check: the compiled contract's quick "valid" never disagrees with jsonschema.

``executor.context.validate_input`` first asks :mod:`registry.fastload.fastschema`'s
compiled form of the row's contract, and only on a False asks jsonschema
(which decides and words the errors).  The quick answer must never accept
what jsonschema refuses: checked here on every example row's contract with
inputs drawn around it, valid and not.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capgate.executor.context import _validator_class, validate_input
from capgate.registry.errors import InputInvalid
from capgate.registry.loader import load_registry
from capgate.registry.model import Row, thaw
from tests.server_support import server_url
from tests.test_init import ROOT

__all__ = ["server_url"]  # the fixture, imported for pytest

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
    # draft 2020-12 with capgate's one amendment: an integral float counts as an integer
    # within +-2^53 only (1e308 is no integer a ledger or a column holds exactly)
    expected = _validator_class()(dict(thaw(row.input))).is_valid(inputs)
    try:
        validate_input(row, inputs)
        accepted = True
    except InputInvalid:
        accepted = False
    assert accepted == expected, (row.ref, inputs)


# --- input edges: a coded input error, never an internal one, and nothing changes ----------

EDGES = {
    "a 5,000-digit integer": {"policy_id": 10**4999},
    "a key with an unpaired surrogate": {"policy_id": 1, "\ud800": 1},
    "a nested key with an unpaired surrogate": {"policy_id": 1, "x": {"\udfff": 2}},
    "1e308 for an integer": {"policy_id": 1e308},
    "2^60 as a float for an integer": {"policy_id": 2.0**60},
}


@pytest.mark.parametrize("name", list(EDGES))
def test_input_edges_are_coded_input_errors(name: str) -> None:
    row = next(r for r in ROWS if r.ref == "policy.get@1")
    with pytest.raises(InputInvalid) as refused:
        validate_input(row, EDGES[name])
    assert refused.value.code == "CG300"
    str(refused.value).encode("utf-8")  # printable: no lone surrogate in the message
    assert refused.value.details["field"]


def test_input_edges_through_every_face(server_url: Any, tmp_path: Any) -> None:
    """The API, the CLI and the MCP server answer CG300 (not CG999) and record nothing."""
    import json

    import anyio

    import capgate
    from tests.server_support import Project, structured

    project = Project(tmp_path, server_url)
    note = {"policy_id": 2, "author": "a", "body": "b"}
    before = project.dump("policy_note")
    with capgate.open(project.config) as ex:
        for inputs in ({**note, "policy_id": 10**4999}, {**note, "\ud800": 1},
                       {**note, "policy_id": 1e308}):
            with pytest.raises(InputInvalid):
                ex.call("policy.add_note", inputs, case="E-1", who="agent")
        assert ex.ledger.snapshot("E-1") is None
    for text in ('{"policy_id": ' + "9" * 5000 + ', "author": "a", "body": "b"}',
                 '{"policy_id": 2, "author": "a", "body": "b", "\\ud800": 1}',
                 '{"policy_id": 1e308, "author": "a", "body": "b"}'):
        ran = project.cli("call", "policy.add_note", "--input", text, "--case", "E-2", "--json")
        assert ran.code == 1, (ran.code, ran.out[:300], ran.err[-500:])
        assert json.loads(ran.out)["code"] == "CG300", ran.out[:300]

    # (over MCP a 5,000-digit number never reaches capgate: the SDK's JSON parser refuses
    # the message as "number out of range" before any handler runs)
    async def main() -> None:
        async with project.stdio() as (session, _):
            for arguments in ({**note, "\ud800": 1}, {**note, "policy_id": 1e308},
                              {**note, "policy_id": 2.0**60}):
                got = structured(await session.call_tool("policy.add_note", arguments))
                assert got["status"] == "refused" and got["error"]["code"] == "CG300", got

    anyio.run(main)
    assert project.dump("policy_note") == before
