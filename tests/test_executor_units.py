"""The executor's pure parts, with no database: plan rendering, expectations, grants,
outcomes.  Each test names an edge the database suites reach only by chance: empty
results, non-BMP text, integers beyond 2**53, nested values, every outcome status.
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from typing import Any

import pytest

from capgate.executor import outcome as oc
from capgate.executor.context import validate_input
from capgate.executor.expectations import evaluate
from capgate.executor.grants import Grants
from capgate.executor.outcome import Outcome, jsonable
from capgate.executor.plan import binds_for, idempotency_key, render
from capgate.registry import errors
from capgate.registry.model import Expect
from tests.fix_capgate import registry

BIG = 2**53 + 1  # the first integer a double cannot hold
SAFE = 2**53 - 1  # the largest a plan's canonical JSON (RFC 8785) accepts
NON_BMP = "\U0001f600 \U00010348 z\u0301"  # emoji, Gothic letter, a combining accent


# --- plan.render -------------------------------------------------------------------------


def _plan(op: str, inputs: dict[str, Any], **kw: Any) -> Any:
    row = registry().resolve(op)
    opts = {"case": "C-1", "requester": "agent", **kw}
    return render(row, inputs, "insurance", "dev", **opts)


def test_render_binds_exactly_the_inputs_and_keeps_the_sql_text() -> None:
    inputs = {"policy_id": SAFE, "author": NON_BMP, "body": "x'); DROP TABLE policy; --"}
    plan = _plan("policy.add_note", inputs)
    (statement,) = plan.body["statements"]
    assert statement["binds"] == {"policy_id": SAFE, "author": NON_BMP,
                                  "body": "x'); DROP TABLE policy; --"}
    assert NON_BMP not in statement["sql"] and str(SAFE) not in statement["sql"]
    assert plan.body["impact_keys"] == [f"dev/insurance/policy_note/policy_id={SAFE}"]
    assert plan.body["inputs"] == inputs and plan.body["inputs"] is not inputs


def test_render_hash_depends_on_every_input_case_and_requester() -> None:
    base = _plan("policy.add_note", {"policy_id": SAFE, "author": "a", "body": NON_BMP})
    same = _plan("policy.add_note", {"body": NON_BMP, "author": "a", "policy_id": SAFE})
    assert base.plan_hash == same.plan_hash and base == same  # key order does not matter
    others = [
        _plan("policy.add_note", {"policy_id": SAFE - 1, "author": "a", "body": NON_BMP}),
        _plan("policy.add_note", {"policy_id": SAFE, "author": "a", "body": NON_BMP + " "}),
        _plan("policy.add_note", {"policy_id": SAFE, "author": "a", "body": NON_BMP}, case="C-2"),
        _plan("policy.add_note", {"policy_id": SAFE, "author": "a", "body": NON_BMP},
              requester="alice"),
    ]
    assert len({base.plan_hash, *(p.plan_hash for p in others)}) == 5


def test_an_integer_beyond_the_canonical_json_domain_is_refused_before_the_plan() -> None:
    """RFC 8785 numbers are doubles: 2**53 + 1 has no canonical form.  The input contract
    (``validate_input``, which every call and plan runs before ``render``) refuses it as
    CG300 naming the field; ``render`` itself, never reached with it, would not hash a
    value it would round."""
    import rfc8785

    row = registry().resolve("policy.add_note")
    inputs = {"policy_id": BIG, "author": "a", "body": "b"}
    with pytest.raises(errors.InputInvalid) as info:
        validate_input(row, inputs, 1 << 20)
    assert info.value.details["field"] == "policy_id"
    assert "2^53" in str(info.value)
    with pytest.raises(rfc8785.IntegerDomainError):
        _plan("policy.add_note", inputs)


def test_render_of_a_read_has_no_impact_keys_and_missing_binds_are_none() -> None:
    plan = _plan("policy.get", {})
    assert plan.body["impact_keys"] == []
    assert all(v is None for s in plan.body["statements"] for v in s["binds"].values())
    assert binds_for("SELECT 1", {"x": 1}) == {}
    assert binds_for("SELECT :a, :b", {"a": {"nested": [1, {"deep": NON_BMP}]}}) == {
        "a": {"nested": [1, {"deep": NON_BMP}]}, "b": None}


def test_idempotency_key_fills_missing_names_with_nothing() -> None:
    row = registry().resolve("policy.add_note")
    key = idempotency_key(row, {"policy_id": BIG}, "C-9")
    assert key is not None and "C-9" in key and str(BIG) in key


# --- expectations.evaluate ---------------------------------------------------------------


def test_value_expectation_on_empty_rows_fails_and_says_none() -> None:
    result = evaluate("empty", Expect.from_dict({"value": 0}), [])
    assert not result.ok and result.actual == {"value": None}
    assert evaluate("empty-null", Expect.from_dict({"value": None}), []).ok is False
    assert evaluate("no-rows", Expect.from_dict({"rows": 0}), []).ok
    assert evaluate("no-columns", Expect.from_dict({"value": 1}), [()]).ok is False


def test_numbers_compare_by_value_not_by_float() -> None:
    assert evaluate("dec", Expect.from_dict({"value": 600}), [[decimal.Decimal("600.00")]]).ok
    assert evaluate("big", Expect.from_dict({"value": BIG}), [[BIG]]).ok
    # a double cannot tell 2**53 + 1 from 2**53: the check must not either way round
    assert not evaluate("big-float", Expect.from_dict({"value": BIG}), [[float(2**53)]]).ok
    assert not evaluate("big-off", Expect.from_dict({"value": BIG}), [[BIG - 1]]).ok
    assert evaluate("text", Expect.from_dict({"value": BIG}), [[str(BIG)]]).ok
    assert not evaluate("not-a-number", Expect.from_dict({"value": 1}), [["one"]]).ok
    assert not evaluate("bool", Expect.from_dict({"value": True}), [[2]]).ok


def test_rows_ranges_and_all_values() -> None:
    rows = [[1, NON_BMP], [2, None]]
    assert evaluate("range", Expect.from_dict({"rows": {"min": 1, "max": 2}}), rows).ok
    assert not evaluate("range", Expect.from_dict({"rows": {"min": 3}}), rows).ok
    ok = evaluate("all", Expect.from_dict({"values": [[1, NON_BMP], [2, None]]}), rows)
    assert ok.ok and ok.to_dict()["actual"] == {"values": [[1, NON_BMP], [2, None]]}
    assert not evaluate("short", Expect.from_dict({"values": [[1, NON_BMP]]}), rows).ok
    assert not evaluate("narrow", Expect.from_dict({"values": [[1], [2]]}), rows).ok
    nested = evaluate("nested", Expect.from_dict({"value": {"a": [1, 2]}}), [[{"a": [1, 2]}]])
    assert nested.ok


# --- grants ------------------------------------------------------------------------------


GRANTS = Grants.from_dict({"principals": {
    "writer": {"grants": [{"connector": "insurance", "environments": ["dev"],
                           "access": "write"}]},
    "reader": {"grants": [{"connector": "*", "environments": ["dev", "prod"],
                           "access": "read"}]},
    "dba_prod": {"roles": [{"role": "dba", "environments": ["prod"]}, "reporting_lead"]},
}}, source="units")


def test_grants_by_connector_environment_and_access() -> None:
    write, read = registry().resolve("policy.add_note"), registry().resolve("policy.get")
    GRANTS.check_call("writer", write, "insurance", "dev")
    GRANTS.check_call("writer", read, "insurance", "dev")  # write includes read
    GRANTS.check_call("reader", read, "other", "prod")  # "*" is any connector
    for who, row, connector, env in [("writer", write, "insurance", "prod"),
                                     ("writer", write, "insurance_code", "dev"),
                                     ("reader", write, "insurance", "dev"),
                                     ("nobody", read, "insurance", "dev"),
                                     ("", read, "insurance", "dev")]:
        with pytest.raises(errors.NotAuthorized) as info:
            GRANTS.check_call(who, row, connector, env)
        assert info.value.details["principal"] == who


def test_scoped_roles_hold_only_where_named() -> None:
    p = GRANTS.principal("dba_prod")
    assert p.holds("dba", "prod") and not p.holds("dba", "dev") and not p.holds("dba", None)
    assert p.holds("reporting_lead", None) and p.role_names == ("reporting_lead", "dba")
    assert GRANTS.scoped("dba_prod") and not GRANTS.scoped("writer")
    GRANTS.check_approver("dba_prod", "dba", ("dba",), "prod")
    with pytest.raises(errors.ApproverLacksRole):
        GRANTS.check_approver("dba_prod", "dba", ("dba",), "dev")
    with pytest.raises(errors.ApproverLacksRole):
        GRANTS.check_approver("dba_prod", "reporting_lead", ("dba",), "prod")


@pytest.mark.parametrize("bad", [
    {"principals": {"x": {"roles": "dba"}}},
    {"principals": {"x": {"roles": [{"role": "dba", "environments": []}]}}},
    {"principals": {"x": {"roles": [""]}}},
])
def test_malformed_grants_are_a_config_error(bad: dict[str, Any]) -> None:
    with pytest.raises(errors.ConfigError):
        Grants.from_dict(bad, source="units")


# --- outcome -----------------------------------------------------------------------------


STATUSES = {oc.APPLIED: (True, 0), oc.READ_OK: (True, 0), oc.ALREADY_APPLIED: (True, 0),
            oc.SIMULATED: (False, 0), oc.ROLLED_BACK: (False, errors.EXIT_REFUSED),
            oc.COMPENSATED: (False, errors.EXIT_REFUSED),
            oc.COMPENSATION_FAILED: (False, errors.EXIT_UNKNOWN),
            "something_new": (False, errors.EXIT_UNKNOWN)}


@pytest.mark.parametrize("status", sorted(STATUSES))
def test_each_status_has_its_ok_and_exit_code_and_round_trips(status: str) -> None:
    out = Outcome(status=status, intent_id="i", case_id="C", operation_id="op", version=2,
                  row_hash="h", idempotency_key=None, fingerprint="f", attempt=3,
                  evidence={"rows": [[BIG, NON_BMP]]},
                  reason={"kind": "verify"} if status == oc.ROLLED_BACK else None)
    assert (out.ok, out.exit_code) == STATUSES[status]
    again = Outcome.from_dict(out.to_dict(), replayed=True)
    assert again.replayed and not out.replayed
    assert again.to_dict() == {**out.to_dict(), "replayed": True}


def test_jsonable_keeps_what_json_can_hold_exactly() -> None:
    moment = dt.datetime(2024, 2, 29, 23, 59, 59, 123456, tzinfo=dt.UTC)
    ident = uuid.UUID(int=BIG)
    value = {1: (BIG, decimal.Decimal("600.00"), decimal.Decimal("0.10")),
             "when": [moment, moment.date(), moment.time()],
             "raw": b"\x00\xff", "id": ident, "nested": {"t": NON_BMP, "d": dt.timedelta(0.5)},
             "floats": [float("nan"), float("inf"), 1.5], "empty": [[], {}, "", None]}
    assert jsonable(value) == {
        "1": [BIG, 600, "0.10"],
        "when": ["2024-02-29T23:59:59.123456+00:00", "2024-02-29", "23:59:59.123456"],
        "raw": "AP8=", "id": str(ident), "nested": {"t": NON_BMP, "d": 43200.0},
        "floats": ["nan", "inf", 1.5], "empty": [[], {}, "", None]}
    assert jsonable(True) is True and jsonable(decimal.Decimal("1E+2")) == 100
