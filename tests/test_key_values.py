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

from capgate.executor.call import Executor
from capgate.executor.plan import idempotency_key, impact_keys, key_value
from capgate.registry import errors
from tests.fix_capgate import table_dump

NOTE = {"author": "jdoe", "body": "Called the holder."}


def _row(executor: Executor, operation_id: str) -> Any:
    return executor.resolve(operation_id, None, None)[0]


@pytest.mark.parametrize(("given", "same_as"), [
    (1.0, 1), (-0.0, 0), (2.0**53, 2**53), (-(2.0**53), -(2**53)),
    (2.0**60, 1152921504606847000),  # RFC 8785's digits for that double, read back
    ([1.0, [2.0]], [1, [2]]), ((1, 2.0), [1, 2]), ({"a": 3.0}, {"a": 3}),
])
def test_an_integral_float_enters_a_key_as_its_integer(given: Any, same_as: Any) -> None:
    assert key_value(given) == same_as and str(key_value(given)) == str(same_as)


@pytest.mark.parametrize("kept", [1.5, -0.25, 1e300, True, False, None, "1.0", "x", 7,
                                  float("inf"), float("-inf")])
def test_every_other_value_enters_a_key_as_it_always_has(kept: Any) -> None:
    """From 1e21 RFC 8785 writes an exponent: such a float reads back as a float."""
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


@pytest.mark.parametrize(("first", "retry"), [(1, 1.0), (1.0, 1)])
def test_a_retry_sending_the_same_number_otherwise_replays_the_call(
        gate: Callable[..., Executor], any_target: URL, first: Any, retry: Any) -> None:
    ex = gate(any_target)
    before = _notes(any_target)
    done = ex.call("policy.add_note", {**NOTE, "policy_id": first}, case="RETRY", who="agent")
    assert done.status == "applied_verified", done.reason
    again = ex.call("policy.add_note", {**NOTE, "policy_id": retry}, case="RETRY", who="agent")
    assert again.replayed and again.status == done.status
    assert again.intent_id == done.intent_id
    assert _notes(any_target) == before + 1  # one note: the retry wrote nothing
    # the intent records the JSON number, and every attempt binds that
    recorded = ex.ledger.intents("RETRY")[done.intent_id]["inputs"]["policy_id"]
    assert recorded == 1 and type(recorded) is int


def test_another_case_sending_1_0_meets_the_claim_on_1(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url, case_claim_seconds=600.0)
    held = ex.call("policy.add_note", {**NOTE, "policy_id": 1}, case="HOLDER", who="agent")
    assert held.status == "applied_verified", held.reason
    before = table_dump(sqlite_url, "policy_note")
    with pytest.raises(errors.ImpactConflict) as caught:
        ex.call("policy.add_note", {**NOTE, "policy_id": 1.0, "body": "Another note."},
                case="OTHER", who="agent")
    assert caught.value.holder["case_id"] == "HOLDER"
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


def test_every_attempt_binds_the_number_the_intent_records(
        gate: Callable[..., Executor], sqlite_url: URL,
        sent_sql: Callable[[Executor], Any]) -> None:
    """A resumed retry binds the recorded inputs (canonical JSON: ``1.0`` is ``1``), so the
    first attempt binds those too -- ``:amount / 3`` must compute the same on each."""
    ex = gate(sqlite_url)
    sent = sent_sql(ex)
    out = ex.call("policy.add_note", {**NOTE, "policy_id": 1.0}, case="BINDS", who="agent")
    assert out.status == "applied_verified", out.reason
    inserts = [params for sql, params in sent if "INSERT INTO policy_note" in sql]
    assert inserts, sent
    bound = [v for params in inserts
             for v in (params.values() if isinstance(params, dict) else params)
             if isinstance(v, int | float) and not isinstance(v, bool)]
    assert bound == [1] and type(bound[0]) is int, inserts


FREE_TEXT_ROW = """
format: 1
connectors: {{db: {{}}}}
rows:
  - operation_id: t.rename
    version: 1
    connector: db
    description: Rename a holder (test-only).
    input:
      type: object
      additionalProperties: false
      required: [holder, region, name]
      properties:
        holder: {holder}
        region: {region}
        name: {{type: string, maxLength: 40}}
    target: {{system: db, object: holder, keys: [holder], dimensions: {{account: region}}}}
    effect_class: transactional
    shape: collapsed
    authorization: {{kind: write_grant}}
    environments: [dev]
    idempotency_key: "{{case}}:{{holder}}"
    timeout: {{seconds: 1, on_timeout: rolled_back}}
    recovery: retryable
    statements:
      - sql: UPDATE holder SET name = :name WHERE holder = :holder AND region = :region
        expect_rows: 1
"""


@pytest.mark.parametrize(("holder", "region", "warned"), [
    ("{type: string, maxLength: 40}", "{type: string, maxLength: 8}",
     ["input.properties.holder", "input.properties.region"]),
    ("{type: [string, integer], maxLength: 40}", "{type: integer}",
     ["input.properties.holder"]),
    ('{type: string, pattern: "^[A-Z0-9-]{1,40}$"}', "{type: string, enum: [EU, US]}", []),
    ("{type: integer}", "{const: EU}", []),
])
def test_validate_warns_on_a_free_text_target_key(holder: str, region: str,
                                                  warned: list[str]) -> None:
    """CG161: keys compare exactly in capgate, by collation in the database (MariaDB's
    default ignores case and trailing spaces): a key input should say its one spelling."""
    from capgate.registry.loader import validate_texts

    result = validate_texts([("k.yaml", FREE_TEXT_ROW.format(holder=holder, region=region))])
    assert result.ok, result.problems
    assert sorted(w.field for w in result.warnings if w.code == "CG161") == warned
