"""The executor's outcomes and refusals, on SQLite, PostgreSQL and MariaDB targets.

Every test runs against a real database with the example schema; refusals
are checked by code and by what did (not) reach the target.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from executor.call import Executor
from registry import errors
from tests.fix_capgate import KEYS, table_dump
from tests.fix_db import engine_params

NOTE = {"policy_id": 1, "author": "jdoe", "body": "Called the holder."}


def count(ex: Executor, sql: str, **binds: Any) -> int:
    engine = ex.connectors.get("insurance").engine
    with engine.connect() as conn:
        return int(conn.execute(sa.text(sql), binds).scalar_one())


def target(ex: Executor) -> URL:
    return ex.connectors.get("insurance").engine.url


# --- outcomes --------------------------------------------------------------------


def test_read_returns_rows_as_evidence(executor: Executor) -> None:
    out = executor.call("policy.get", {"policy_id": 1}, case="C-read", who="agent")
    assert out.status == "ok"
    assert out.evidence["rows"][0][0] == 1
    assert "holder" in out.evidence["columns"]


def test_read_rows_are_counted_and_capped(executor: Executor) -> None:
    out = executor.call("policy.search_by_holder", {"holder": "Ada Lovelace"}, case="C-cap",
                        who="agent")
    assert out.status == "ok" and out.evidence["count"] == 2
    assert out.evidence["truncated"] is False
    from registry.loader import validate_texts
    from registry.registry import Registry

    capped = LOCKING_ROW.replace("effect_class: transactional", "effect_class: read").replace(
        "shape: collapsed", "max_rows: 1").replace("authorization: {kind: write_grant}",
                                                   "authorization: {kind: read_grant}")
    capped = capped.replace(
        '"UPDATE policy SET holder = holder WHERE policy_id = :policy_id", expect_rows: 1',
        '"SELECT policy_id FROM policy WHERE policy_id >= :policy_id ORDER BY policy_id"')
    result = validate_texts([("capped.yaml", capped)])
    result.raise_for_problems()
    executor.registry = Registry(result.rows)
    out = executor.call("policy.touch", {"policy_id": 1}, case="C-cap", who="agent")
    assert out.evidence["count"] == 1 and out.evidence["truncated"] is True


def test_collapsed_write_applies_verifies_and_records(executor: Executor) -> None:
    before = count(executor, "SELECT count(*) FROM policy_note WHERE policy_id = 1")
    out = executor.call("policy.add_note", NOTE, case="C-ok", who="agent")
    assert out.status == "applied_verified", out.reason
    assert out.evidence["counts"] == [1]
    assert out.evidence["verify"][0]["ok"] is True
    assert ["jdoe", "Called the holder."] in out.evidence["replay"]["rows"]
    assert count(executor, "SELECT count(*) FROM policy_note WHERE policy_id = 1") == before + 1
    assert count(executor, "SELECT count(*) FROM capgate_landed WHERE intent_id = :i",
                 i=out.intent_id) == 1
    events = executor.ledger.events("C-ok")
    # the first attempt is recorded with the intent: one durable commit before the row's
    # statements (issue 13), the transaction's identity included
    assert [e.kind for e in events] == ["prepared", "observed"]
    state = events[0].payload["state"]
    assert state["attempt"] == 1 and state["tx"]["dialect"] == executor.connectors.get(
        "insurance").dialect.name
    assert executor.ledger.verify("C-ok").ok


def test_verify_failure_rolls_back_with_evidence(executor: Executor) -> None:
    url = target(executor)
    before = table_dump(url, "policy_note")
    out = executor.call("policy.add_note", {**NOTE, "policy_id": 9}, case="C-void", who="agent")
    assert out.status == "rolled_back"
    assert out.reason is not None
    assert out.reason["kind"] == "verify" and out.reason["check"] == "policy_not_void"
    assert out.reason["expected"] == {"value": 1} and out.reason["actual"] == {"value": 0}
    assert table_dump(url, "policy_note") == before
    assert count(executor, "SELECT count(*) FROM capgate_landed") == 0


def test_expected_count_mismatch_rolls_back_byte_for_byte(executor: Executor) -> None:
    url = target(executor)
    tables = ["policy", "policy_note", "premium", "cover", "issued_document"]
    before = {t: table_dump(url, t) for t in tables}
    # policy 1 is live: the orphan delete's first statement deletes 1 note, not 2
    out = _approved_purge(executor, 1)
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "count"
    assert out.reason["statement"] == 0 and out.reason["expected"] == 2
    assert {t: table_dump(url, t) for t in tables} == before


def test_five_statement_orphan_delete_is_atomic(executor: Executor) -> None:
    out = _approved_purge(executor, 9)
    assert out.status == "applied_verified", out.reason
    assert out.evidence["counts"] == [2, 3, 2, 1, 1]
    assert count(executor, "SELECT count(*) FROM policy WHERE policy_id = 9") == 0


def test_leased_row_branches_and_aborts(executor: Executor) -> None:
    ok = executor.call("policy.cancel", {"policy_id": 5, "cancel_date": "2024-06-01",
                                         "author": "jdoe", "reason": "Car scrapped."},
                       case="C-lease", who="agent")
    assert ok.status == "applied_verified", ok.reason
    assert any(s.get("skipped") for s in ok.evidence["steps"])
    aborted = executor.call("policy.cancel", {"policy_id": 3, "cancel_date": "2024-08-15",
                                              "author": "jdoe", "reason": "Not active."},
                            case="C-lease2", who="agent")
    assert aborted.status == "rolled_back"
    assert aborted.reason is not None and aborted.reason["kind"] == "abort"
    assert aborted.reason["expected"] != aborted.reason["actual"]


def test_sql_injection_strings_are_stored_verbatim(executor: Executor) -> None:
    evil = "x'); DROP TABLE policy; -- \" /* */ :policy_id \\"
    policies = table_dump(target(executor), "policy")
    out = executor.call("policy.add_note", {**NOTE, "body": evil, "author": "'; DELETE FROM x"},
                        case="C-inj", who="agent")
    assert out.status == "applied_verified", out.reason
    assert count(executor, "SELECT count(*) FROM policy_note WHERE body = :b", b=evil) == 1
    assert table_dump(target(executor), "policy") == policies


def test_idempotent_repeat_returns_recorded_outcome(executor: Executor) -> None:
    first = executor.call("policy.add_note", NOTE, case="C-idem", who="agent")
    again = executor.call("policy.add_note", NOTE, case="C-idem", who="agent")
    assert again.replayed and again.intent_id == first.intent_id
    assert again.status == first.status
    assert count(executor, "SELECT count(*) FROM policy_note WHERE body = :b",
                 b=NOTE["body"]) == 1


# --- refusals -------------------------------------------------------------------


@pytest.mark.parametrize(("op", "version", "error"), [
    ("policy.drop_everything", None, errors.UnknownOperation),
    ("policy.get", 7, errors.UnknownVersion),
    ("policy.cancel", 1, errors.RetiredRow),
])
def test_unlisted_calls_are_refused(executor: Executor, op: str, version: int | None,
                                    error: type[errors.CapgateError]) -> None:
    with pytest.raises(error):
        executor.call(op, {"policy_id": 1}, case="C-x", who="agent", version=version)
    # nothing prepared; an operation without a row is recorded as a capability gap (issue 17)
    kinds = [e.kind for e in executor.ledger.events("C-x")]
    assert kinds == ([] if error is errors.RetiredRow else ["capability_gap"])
    assert not (executor.ledger.snapshot("C-x") or {}).get("intents")


def test_wrong_environment_is_refused(gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url, environment="prod")
    with pytest.raises(errors.EnvironmentNotAllowed) as info:
        ex.call("premium.move_due_date", {"policy_id": 1, "premium_id": 1,
                                          "new_due_date": "2024-12-01"},
                case="C-env", who="agent")
    assert info.value.code == "CG143"


def test_missing_grant_is_refused(executor: Executor) -> None:
    with pytest.raises(errors.NotAuthorized):
        executor.call("policy.add_note", NOTE, case="C-g", who="reader")
    with pytest.raises(errors.NotAuthorized):
        executor.call("policy.get", {"policy_id": 1}, case="C-g", who="nobody")
    assert executor.call("policy.get", {"policy_id": 1}, case="C-g", who="reader").ok


def test_input_contract_violation_names_the_field(executor: Executor) -> None:
    url = target(executor)
    before = table_dump(url, "policy_note")
    with pytest.raises(errors.InputInvalid) as info:
        executor.call("policy.add_note", {**NOTE, "policy_id": "1 OR 1=1"}, case="C-in",
                      who="agent")
    assert info.value.details["field"] == "policy_id"
    with pytest.raises(errors.InputInvalid) as info2:
        executor.call("policy.add_note", {**NOTE, "table": "policy"}, case="C-in", who="agent")
    assert info2.value.details["field"] == "table"
    assert table_dump(url, "policy_note") == before


def test_idempotency_conflict(executor: Executor) -> None:
    executor.call("policy.add_note", NOTE, case="C-ic", who="agent")
    with pytest.raises(errors.IdempotencyConflict):
        executor.call("policy.add_note", {**NOTE, "body": "different"}, case="C-ic",
                      who="agent")


def test_case_reused_for_a_different_task(executor: Executor) -> None:
    executor.call("policy.add_note", NOTE, case="C-task", who="agent", task="TICKET-1")
    assert executor.ledger.snapshot("C-task")["case"]["task"] == "TICKET-1"  # type: ignore[index]
    executor.call("policy.get", {"policy_id": 1}, case="C-task", who="agent", task="TICKET-1")
    with pytest.raises(errors.CaseConflict):
        executor.call("policy.get", {"policy_id": 1}, case="C-task", who="agent",
                      task="TICKET-2")


# --- gates ----------------------------------------------------------------------


def _approved_purge(ex: Executor, policy_id: int, case: str = "C-purge") -> Any:
    with pytest.raises(errors.ApprovalRequired) as info:
        ex.call("policy.purge_orphan", {"policy_id": policy_id}, case=case, who="agent")
    plan_hash = info.value.details["plan_hash"]
    ex.approve(plan_hash, by="bob", role="dba", key=KEYS["bob"])
    return ex.call("policy.purge_orphan", {"policy_id": policy_id}, case=case, who="agent")


def test_gate_requires_approval_then_single_use(executor: Executor) -> None:
    url = target(executor)
    before = table_dump(url, "policy")
    with pytest.raises(errors.ApprovalRequired) as info:
        executor.call("policy.purge_orphan", {"policy_id": 9}, case="C-gate", who="agent")
    assert info.value.exit_code == 4
    plan = info.value.details["plan"]
    assert plan["statements"][0]["expect_rows"] == 2
    assert table_dump(url, "policy") == before  # nothing opened
    executor.approve(info.value.details["plan_hash"], by="bob", role="dba", key=KEYS["bob"])
    out = executor.call("policy.purge_orphan", {"policy_id": 9}, case="C-gate", who="agent")
    assert out.status == "applied_verified"


def test_used_approval_is_not_reused(executor: Executor) -> None:
    out = _approved_purge(executor, 1, case="C-reuse")
    assert out.status == "rolled_back"
    # the one approval went with the one intent that prepared; no second intent gets it
    with pytest.raises(errors.ApprovalUsed):
        executor.ledger.consume_approval(out.evidence.get("plan_hash") or _plan_of(
            executor, "C-reuse"), "another-intent")


def _plan_of(ex: Executor, case: str) -> str:
    (state,) = ex.ledger.intents(case).values()
    return str(state["plan_hash"])


def test_expired_approval(executor: Executor) -> None:
    plan = executor.plan("policy.purge_orphan", {"policy_id": 9}, case="C-exp", who="agent")
    executor.approve(plan.plan_hash, by="bob", role="dba", key=KEYS["bob"], ttl_seconds=60)
    real_clock = executor.clock
    executor.clock = lambda: real_clock() + dt.timedelta(minutes=5)
    with pytest.raises(errors.ApprovalExpired):
        executor.call("policy.purge_orphan", {"policy_id": 9}, case="C-exp", who="agent")


def test_mismatched_plan_is_refused(executor: Executor) -> None:
    plan = executor.plan("policy.purge_orphan", {"policy_id": 9}, case="C-mm", who="agent")
    executor.approve(plan.plan_hash, by="bob", role="dba", key=KEYS["bob"])
    with pytest.raises(errors.ApprovalMismatch):
        executor.call("policy.purge_orphan", {"policy_id": 2}, case="C-mm", who="agent",
                      plan_hash=plan.plan_hash)
    with pytest.raises(errors.ApprovalRequired):  # another plan: its own approval needed
        executor.call("policy.purge_orphan", {"policy_id": 2}, case="C-mm", who="agent")


def test_four_eyes_refuses_self_approval(executor: Executor) -> None:
    plan = executor.plan("policy.purge_orphan", {"policy_id": 9}, case="C-4e", who="alice")
    with pytest.raises(errors.SelfApproval):
        executor.approve(plan.plan_hash, by="alice", role="dba", key=KEYS["alice"])
    with pytest.raises(errors.ApproverLacksRole):
        executor.approve(plan.plan_hash, by="bob", role="underwriting_lead", key=KEYS["bob"])
    with pytest.raises(errors.ApproverLacksRole):
        executor.approve(plan.plan_hash, by="agent", role="dba", key=KEYS["bob"])


def test_plan_performs_no_dml(executor: Executor) -> None:
    url = target(executor)
    before = {t: table_dump(url, t) for t in ("policy", "policy_note")}
    plan = executor.plan("policy.add_note", NOTE, case="C-plan", who="agent")
    assert plan.body["statements"][0]["binds"]["policy_id"] == 1
    assert plan.body["impact_keys"] == ["dev/insurance/policy_note/policy_id=1"]
    assert {t: table_dump(url, t) for t in ("policy", "policy_note")} == before


# --- post-commit and compensation -----------------------------------------------------


def test_compensable_row_applies_with_post_commit_check(executor: Executor) -> None:
    with pytest.raises(errors.ApprovalRequired) as info:
        executor.call("premium.apply_discount", _discount(), case="C-disc", who="agent")
    executor.approve(info.value.details["plan_hash"], by="alice", role="underwriting_lead",
                     key=KEYS["alice"])
    out = executor.call("premium.apply_discount", _discount(), case="C-disc", who="agent")
    assert out.status == "applied_verified", out.reason
    assert all(c["ok"] for c in out.evidence["post_commit"])


def _discount() -> dict[str, Any]:
    from tests.fix_capgate import registry

    row = registry().resolve("premium.apply_discount")
    return dict(row.examples[0].input)


# --- tagging and timeouts ---------------------------------------------------------------


def test_sessions_are_tagged(executor: Executor) -> None:
    sent: list[str] = []
    engine = executor.connectors.get("insurance").engine
    sa.event.listen(engine, "before_cursor_execute",
                    lambda conn, cur, stmt, params, ctx, many: sent.append(stmt))
    out = executor.call("policy.add_note", NOTE, case="C-tag", who="agent")
    dialect = engine.dialect.name
    if dialect == "postgresql":
        assert any("application_name" in s for s in sent)
    elif dialect == "mysql":
        writes = [s for s in sent if "policy_note" in s]
        assert writes and all(s.startswith("/* capgate case=C-tag") for s in writes)
        assert all(out.intent_id in s for s in writes)


LOCKING_ROW = """
format: 1
connectors: {insurance: {}}
rows:
  - operation_id: policy.touch
    version: 1
    connector: insurance
    description: Touch a policy row (test-only), with a short lock timeout.
    input:
      type: object
      additionalProperties: false
      required: [policy_id]
      properties: {policy_id: {type: integer}}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{policy_id}"
    timeout: {seconds: 3, lock_seconds: 0.5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id", expect_rows: 1}
"""


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_url(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])


def test_lock_timeout_is_enforced_by_the_server(gate: Callable[..., Executor],
                                                server_url: URL) -> None:
    from registry.loader import validate_texts
    from registry.registry import Registry

    ex = gate(server_url)
    result = validate_texts([("touch.yaml", LOCKING_ROW)])
    result.raise_for_problems()
    ex.registry = Registry(result.rows)
    holder = sa.create_engine(server_url, poolclass=sa.pool.NullPool)
    with holder.connect() as conn:
        conn.execute(sa.text("SELECT * FROM policy WHERE policy_id = 1 FOR UPDATE")).fetchall()
        out = ex.call("policy.touch", {"policy_id": 1}, case="C-lock", who="agent")
        conn.rollback()
    holder.dispose()
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "timeout", out.reason
    assert out.reason["on_timeout"] == "rolled_back"
    again = ex.call("policy.touch", {"policy_id": 1}, case="C-lock2", who="agent")
    assert again.status == "applied_verified"


def test_reads_are_engine_enforced_read_only(target_url: URL) -> None:
    from executor.dialects import SessionTag, dialect_for
    from executor.dialects.base import vendor_code

    engine = sa.create_engine(target_url, poolclass=sa.pool.NullPool)
    dialect = dialect_for(engine.url.get_backend_name())
    dialect.prepare_engine(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ro_probe (id INTEGER PRIMARY KEY)"))
    with engine.connect() as conn:
        dialect.begin_read(conn, SessionTag("C", "op", "i"), 5)
        with pytest.raises(sa.exc.DBAPIError) as info:
            conn.execute(sa.text("INSERT INTO ro_probe (id) VALUES (1)"))
        assert dialect.is_read_only_violation(info.value), (vendor_code(info.value), info.value)
        conn.rollback()
        dialect.end_read(conn)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM ro_probe")).scalar_one() == 0
    engine.dispose()


def test_ddl_rows_never_run_as_plain_calls(executor: Executor) -> None:
    with pytest.raises(errors.DdlError):
        executor.call("code.policy_overview", {"source": "CREATE VIEW x AS SELECT 1"},
                      case="C-ddl", who="agent")
    assert executor.ledger.snapshot("C-ddl") is None
