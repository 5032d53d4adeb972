"""One JSON number is one key: ``1`` and ``1.0`` name the same idempotency and impact key.

RFC 8785 writes both as ``1``, so the request's fingerprint never told them apart;
the keys were printed with Python's ``str`` and did (``...:1`` against ``...:1.0``).
A retry that sent ``1.0`` -- a JSON encoder that writes floats, a client that
re-serialised the request -- then missed the first call's idempotency key and
wrote a second time, and another case sending ``1.0`` walked past the first
case's impact claim on the same row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from executor.call import Executor
from executor.plan import idempotency_key, impact_keys, key_value
from registry import errors
from tests.fix_capgate import table_dump

NOTE = {"author": "jdoe", "body": "Called the holder."}


def _row(executor: Executor, operation_id: str) -> Any:
    return executor.resolve(operation_id, None, None)[0]


@pytest.mark.parametrize(("given", "same_as"), [
    (1.0, 1), (-0.0, 0), (2.0**53, 2**53), (-(2.0**53), -(2**53)),
    ([1.0, [2.0]], [1, [2]]), ((1, 2.0), [1, 2]), ({"a": 3.0}, {"a": 3}),
])
def test_an_integral_float_enters_a_key_as_its_integer(given: Any, same_as: Any) -> None:
    assert key_value(given) == same_as and str(key_value(given)) == str(same_as)


@pytest.mark.parametrize("kept", [1.5, -0.25, 2.0**60, 1e300, True, False, None, "1.0", "x"])
def test_every_other_value_enters_a_key_as_it_always_has(kept: Any) -> None:
    """Beyond 2^53 a float is not an exact integer: it stays a float (and prints as one)."""
    assert str(key_value(kept)) == str(kept) and type(key_value(kept)) is type(kept)


def test_one_number_is_one_idempotency_key_and_one_impact_key(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url)
    row = _row(ex, "policy.add_note")
    whole, floating = {**NOTE, "policy_id": 1}, {**NOTE, "policy_id": 1.0}
    assert idempotency_key(row, floating, "C") == idempotency_key(row, whole, "C") \
        == "C:policy.add_note:1"
    assert impact_keys(row, floating, "dev") == impact_keys(row, whole, "dev") \
        == ["dev/insurance/policy_note/policy_id=1"]


def _notes(url: URL) -> int:
    return sum(1 for r in table_dump(url, "policy_note") if r[1] == 1)


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def any_target(request: pytest.FixtureRequest) -> URL:
    url: URL = request.getfixturevalue({"sqlite": "sqlite_url", "postgresql": "pg_url",
                                        "mariadb": "mariadb_url"}[request.param])
    return url


def test_a_retry_sending_1_0_replays_the_call_that_sent_1(
        gate: Callable[..., Executor], any_target: URL) -> None:
    ex = gate(any_target)
    before = _notes(any_target)
    first = ex.call("policy.add_note", {**NOTE, "policy_id": 1}, case="RETRY", who="agent")
    assert first.status == "applied_verified", first.reason
    again = ex.call("policy.add_note", {**NOTE, "policy_id": 1.0}, case="RETRY", who="agent")
    assert again.replayed and again.status == first.status
    assert again.intent_id == first.intent_id
    assert _notes(any_target) == before + 1  # one note: the retry wrote nothing


def test_a_call_sending_1_0_first_is_replayed_by_one_sending_1(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url)
    before = _notes(sqlite_url)
    first = ex.call("policy.add_note", {**NOTE, "policy_id": 1.0}, case="FLOAT", who="agent")
    assert first.status == "applied_verified", first.reason
    again = ex.call("policy.add_note", {**NOTE, "policy_id": 1}, case="FLOAT", who="agent")
    assert again.replayed and again.intent_id == first.intent_id
    assert _notes(sqlite_url) == before + 1
    # the binds kept what the caller sent; the target took it as the same row
    assert ex.ledger.intents("FLOAT")[first.intent_id]["inputs"]["policy_id"] == 1.0


def test_another_case_sending_1_0_meets_the_claim_on_1(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url, case_claim_seconds=600.0)
    held = ex.call("policy.add_note", {**NOTE, "policy_id": 1}, case="HOLDER", who="agent")
    assert held.status == "applied_verified", held.reason
    before = table_dump(sqlite_url, "policy_note")
    with pytest.raises(errors.ImpactConflict) as caught:
        ex.call("policy.add_note", {**NOTE, "policy_id": 1.0, "body": "Another note."},
                case="OTHER", who="agent")
    assert caught.value.details["case_id"] == "HOLDER"
    assert caught.value.details["impact_key"] == "dev/insurance/policy_note/policy_id=1"
    assert table_dump(sqlite_url, "policy_note") == before


def test_the_target_fence_is_one_row_for_one_number(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    """The fence row is keyed by the impact key: 1 and 1.0 move one row, not two."""
    ex = gate(sqlite_url)
    for n, value in enumerate([1, 1.0, 1]):
        out = ex.call("policy.add_note", {**NOTE, "policy_id": value, "body": f"n{n}"},
                      case=f"F{n}", who="agent")
        assert out.status == "applied_verified", out.reason
    engine = sa.create_engine(sqlite_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            keys = [r[0] for r in conn.execute(sa.text(
                "SELECT impact_key FROM capgate_fence ORDER BY impact_key"))]
    finally:
        engine.dispose()
    assert keys == ["dev/insurance/policy_note/policy_id=1"]
