"""The executor's outcomes and refusals, on SQLite, PostgreSQL, MariaDB and Oracle targets.

Every test runs against a real database with the example schema; refusals
are checked by code and by what did (not) reach the target.  Oracle runs wherever
one answers (``CAPGATE_TEST_ORACLE_DSN``, or a container when Docker answers;
``CAPGATE_REQUIRE_DBS=oracle`` makes its absence a failure); what only Oracle has
(Transaction Guard, session labels, procedures that commit, ORA-02391...) is at the
end, on ``oracle_url``.  Crashes and resume on Oracle: ``tests/test_oracle_recovery.py``;
what is proven without an Oracle: ``tests/test_oracle_offline.py``.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.dialects import SessionTag
from capgate.executor.dialects.base import MARKER_TABLE
from capgate.executor.dialects.oracle import OracleDialect
from capgate.executor.target import install_at
from capgate.registry import errors
from tests.fix_capgate import KEYS, SentSql, table_dump
from tests.fix_db import engine_params, require_server

NOTE = {"policy_id": 1, "author": "jdoe", "body": "Called the holder."}
TABLES = ("policy", "cover", "premium", "document_number", "issued_document", "policy_note",
          "claim", MARKER_TABLE)


def count(ex: Executor, sql: str, **binds: Any) -> int:
    engine = ex.connectors.get("insurance").engine
    with engine.connect() as conn:
        return int(conn.execute(sa.text(sql), binds).scalar_one())


def target(ex: Executor) -> URL:
    return ex.connectors.get("insurance").engine.url


def engine_of(ex: Executor) -> str:
    return ex.connectors.get("insurance").dialect.name


def _dump(url: URL) -> dict[str, list[tuple[Any, ...]]]:
    return {table: table_dump(url, table) for table in TABLES}


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
    from capgate.registry.loader import validate_texts
    from capgate.registry.registry import Registry

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
    assert out.evidence["replay"]["columns"] == ["author", "body"]
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


def test_verify_failure_rolls_back_byte_for_byte(executor: Executor) -> None:
    url = target(executor)
    executor.connectors.get("insurance").check_target()  # capgate's tables, before the dump
    before = _dump(url)
    out = executor.call("policy.add_note", {**NOTE, "policy_id": 9}, case="C-void", who="agent")
    assert out.status == "rolled_back"
    assert out.reason is not None
    assert out.reason["kind"] == "verify" and out.reason["check"] == "policy_not_void"
    assert out.reason["expected"] == {"value": 1} and out.reason["actual"] == {"value": 0}
    assert out.evidence["counts"] == [1]  # the insert ran, then was rolled back
    assert _dump(url) == before
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
    if engine_of(executor) == "oracle":
        # no DML lock timeout, and a killed session's row locks outlive it: refused
        # before anything is recorded
        with pytest.raises(errors.LeaseNotEnforceable) as info:
            executor.call("policy.cancel", {"policy_id": 5, "cancel_date": "2024-06-01",
                                            "author": "jdoe", "reason": "Car scrapped."},
                          case="C-lease", who="agent")
        assert info.value.code == "CG326"
        assert list(executor.ledger.events("C-lease")) == []
        return
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


def _texts(value: Any) -> list[str]:
    """Every string inside bind parameters (a dict, a sequence of them, nested)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _texts(v)]
    return []


def test_inputs_travel_as_bind_values_only(executor: Executor,
                                           sent_sql: Callable[[Executor], SentSql]) -> None:
    probe = "bind-probe 'Ω' \U0001f600 ); -- " + uuid.uuid4().hex
    author = "author-" + uuid.uuid4().hex
    sent = sent_sql(executor)
    out = executor.call("policy.add_note", {**NOTE, "author": author, "body": probe},
                        case="C-bind", who="agent")
    assert out.status == "applied_verified", out.reason
    assert sent, "the recorder saw nothing"
    assert [s for s, _ in sent if probe in s or author in s] == []
    bound = [t for _, params in sent for t in _texts(params)]
    assert probe in bound and author in bound  # the insert, the verify, the replay
    assert count(executor, "SELECT count(*) FROM policy_note WHERE body = :b", b=probe) == 1


def test_a_refused_call_sends_no_sql_to_the_target(
        executor: Executor, sent_sql: Callable[[Executor], SentSql]) -> None:
    sent = sent_sql(executor)
    with pytest.raises(errors.NotAuthorized):
        executor.call("policy.add_note", NOTE, case="C-refused", who="reader")
    with pytest.raises(errors.InputInvalid):
        executor.call("policy.add_note", {**NOTE, "policy_id": "1; DROP TABLE policy"},
                      case="C-refused", who="agent")
    with pytest.raises(errors.UnknownOperation):
        executor.call("policy.drop_everything", {"policy_id": 1}, case="C-refused",
                      who="agent")
    assert sent == []
    # the recorder does see a call that goes ahead
    assert executor.call("policy.get", {"policy_id": 1}, case="C-allowed", who="agent").ok
    assert any("policy" in s for s, _ in sent)


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


@pytest.fixture(params=engine_params("postgresql", "mariadb", "oracle"))
def server_url(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url",
                                    "oracle": "oracle_url"}[request.param])


def test_lock_timeout_is_enforced_by_the_server(gate: Callable[..., Executor],
                                                server_url: URL) -> None:
    from capgate.registry.loader import validate_texts
    from capgate.registry.registry import Registry

    ex = gate(server_url)
    result = validate_texts([("touch.yaml", LOCKING_ROW)])
    result.raise_for_problems()
    ex.registry = Registry(result.rows)
    holder = sa.create_engine(server_url, poolclass=sa.pool.NullPool)
    with holder.connect() as conn:
        conn.execute(sa.text("SELECT * FROM policy WHERE policy_id = 1 FOR UPDATE")).fetchall()
        started = time.monotonic()
        out = ex.call("policy.touch", {"policy_id": 1}, case="C-lock", who="agent")
        conn.rollback()
    holder.dispose()
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "timeout", out.reason
    assert out.reason["on_timeout"] == "rolled_back"
    # Oracle has no DML lock timeout: the call's timeout (3 s) bounds the wait there
    assert time.monotonic() - started < 10
    again = ex.call("policy.touch", {"policy_id": 1}, case="C-lock2", who="agent")
    assert again.status == "applied_verified"


def test_reads_are_engine_enforced_read_only(target_url: URL) -> None:
    from capgate.executor.dialects import dialect_for
    from capgate.executor.dialects.base import vendor_code

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


def test_target_tables_install_idempotently(target_url: URL,
                                            gate: Callable[..., Executor]) -> None:
    ex = gate(target_url)  # the schema, and capgate's tables
    assert install_at(target_url) == []  # a second install finds them and creates nothing
    engine = sa.create_engine(target_url, poolclass=sa.pool.NullPool)
    try:
        assert sa.inspect(engine).has_table(MARKER_TABLE)
    finally:
        engine.dispose()
    out = ex.call("policy.add_note", NOTE, case="C-marker", who="agent")
    assert out.status == "applied_verified", out.reason
    assert count(ex, f"SELECT count(*) FROM {MARKER_TABLE} WHERE intent_id = :i",
                 i=out.intent_id) == 1


# Test-only rows: the session's labels seen from inside the write (SYS_CONTEXT, always
# readable; V$SESSION, needs a grant), a statement that outlives the call timeout, and a
# plain row update for lock waits.
ORACLE_ROWS = """
format: 1
connectors: {insurance: {}}
rows:
  - operation_id: ora.session_tags
    version: 1
    connector: insurance
    description: >
      Touch a policy row and replay the session's labels as the session itself
      reports them (SYS_CONTEXT USERENV), inside the write (test-only).
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
    idempotency_key: "{case}:{operation_id}:{policy_id}"
    timeout: {seconds: 10, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {name: touch, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}
    replay:
      sql: >
        SELECT SYS_CONTEXT('USERENV', 'MODULE') AS tag_module,
               SYS_CONTEXT('USERENV', 'ACTION') AS tag_action,
               SYS_CONTEXT('USERENV', 'CLIENT_INFO') AS tag_client_info,
               SYS_CONTEXT('USERENV', 'CLIENT_IDENTIFIER') AS tag_client_id
        FROM dual
      expect: {rows: 1}

  - operation_id: ora.session_view
    version: 1
    connector: insurance
    description: >
      Touch a policy row and replay the session's own V$SESSION line (MODULE,
      ACTION, CLIENT_INFO, CLIENT_IDENTIFIER), inside the write (test-only).
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
    idempotency_key: "{case}:{operation_id}:{policy_id}"
    timeout: {seconds: 10, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {name: touch, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}
    replay:
      sql: >
        SELECT module, action, client_info, client_identifier FROM v$session
        WHERE sid = SYS_CONTEXT('USERENV', 'SID')
      expect: {rows: 1}

  - operation_id: ora.slow
    version: 1
    connector: insurance
    description: >
      Rename a policy's holder, then sleep in the database for longer than the
      row's 1 s timeout (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id, seconds]
      properties:
        policy_id: {type: integer}
        seconds: {type: number}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{operation_id}:{policy_id}"
    timeout: {seconds: 1, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {name: rename, sql: "UPDATE policy SET holder = 'Slow call' WHERE policy_id = :policy_id",
         expect_rows: 1}
      - {name: sleep, sql: "BEGIN DBMS_SESSION.SLEEP(:seconds); END;",
         expect_rows: {min: 0, max: 1}}

  - operation_id: ora.call_proc
    version: 1
    connector: insurance
    description: >
      Call a test procedure of the target schema (one that commits inside, or runs
      DDL): the session refuses the commit, or the executor sees the split (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id, proc]
      properties:
        policy_id: {type: integer}
        proc: {type: string, enum: [commit_note, ddl_note]}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{operation_id}:{policy_id}:{proc}"
    timeout: {seconds: 10, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: call
        sql: >
          BEGIN IF :proc = 'commit_note' THEN commit_note(:policy_id);
          ELSE ddl_note(:policy_id); END IF; END;
        expect_rows: {min: 0, max: 1}

  - operation_id: ora.touch
    version: 1
    connector: insurance
    description: Touch a policy row within 2 s (test-only); waits on its row lock.
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
    idempotency_key: "{case}:{operation_id}:{policy_id}"
    timeout: {seconds: 2, lock_seconds: 1, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {name: touch, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}
"""


# --- Oracle only: what no other engine has ----------------------------------------------------


def _grant(user_url: URL, privilege: str) -> bool:
    """Best effort: grant ``privilege`` to the test user through the admin URL."""
    admin = sa.create_engine(require_server("oracle").url, poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"GRANT {privilege} TO {user_url.username}")
        return True
    except sa.exc.DBAPIError:
        return False
    finally:
        admin.dispose()


def _scalar(url: URL, sql: str, **binds: Any) -> Any:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql), binds).scalar()
    finally:
        engine.dispose()


def _markers(url: URL, intent_id: str) -> int:
    return int(_scalar(url, f"SELECT count(*) FROM {MARKER_TABLE} WHERE intent_id = :i",
                       i=intent_id))


def _tx(ex: Executor, case: str) -> dict[str, Any]:
    """The attempt's transaction identity: recorded with the intent (``prepared``) since
    issue 13's one durable commit, in ``attempt_started`` for a retry."""
    found = [e.payload["state"]["tx"] for e in ex.ledger.events(case)
             if e.kind in ("prepared", "attempt_started") and "tx" in e.payload.get("state", {})]
    assert len(found) == 1, [e.kind for e in ex.ledger.events(case)]
    tx: dict[str, Any] = dict(found[0])
    return tx


@pytest.fixture
def ora(oracle_url: URL, gate: Callable[..., Executor]) -> Executor:
    """An executor over a fresh Oracle user with the example schema, plus the test rows."""
    from capgate.registry.loader import validate_texts
    from capgate.registry.registry import Registry
    from tests.fix_capgate import registry

    ex = gate(oracle_url)
    extra = validate_texts([("oracle_rows.yaml", ORACLE_ROWS)])
    extra.raise_for_problems()
    ex.registry = Registry(list(registry().rows()) + list(extra.rows))
    return ex


# --- Oracle: schema, dates -----------------------------------------------------------------


def _nls_date_format(url: URL, engine: sa.Engine | None = None) -> Any:
    sql = "SELECT value FROM nls_session_parameters WHERE parameter = 'NLS_DATE_FORMAT'"
    own = engine is None
    engine = engine or sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar()
    finally:
        if own:
            engine.dispose()


def test_schema_seeds_and_dates_bound_as_dates(ora: Executor, oracle_url: URL) -> None:
    assert _scalar(oracle_url, "SELECT count(*) FROM premium") == 12
    assert _scalar(oracle_url, "SELECT sum(amount) FROM cover WHERE policy_id = 1") == 250000
    # identity columns continue above the seed rows' explicit ids
    out = ora.call("policy.add_note", NOTE, case="C-ident", who="agent")
    assert out.status == "applied_verified", out.reason
    assert _scalar(oracle_url, "SELECT max(note_id) FROM policy_note") >= 1000
    # as_of is declared format: date: it reaches Oracle as a DATE, whatever the session's
    # NLS_DATE_FORMAT -- which capgate leaves exactly as the database set it
    overdue = ora.call("premium.list_overdue", {"as_of": "2024-08-15"}, case="C-due",
                       who="agent")
    assert overdue.status == "ok", overdue.reason
    assert overdue.version == 2
    assert [r[0] for r in overdue.evidence["rows"]] == [7, 9, 3]
    plain = _nls_date_format(oracle_url)
    assert _nls_date_format(oracle_url, ora.connectors.get("insurance").engine) == plain
    moved = ora.call("premium.move_due_date", {"premium_id": 6, "due_date": "2024-04-01"},
                     case="C-move", who="agent")
    assert moved.status == "applied_verified", moved.reason
    assert _scalar(oracle_url, "SELECT TO_CHAR(due_date, 'YYYY-MM-DD') FROM premium"
                               " WHERE premium_id = 6") == "2024-04-01"
    # an ISO date string stored into a DATE column, at midnight
    claim = ora.call("claim.register", {"policy_id": 2, "claim_ref": "CLM-2024-002",
                                        "reported_on": "2024-08-20", "amount": 800},
                     case="C-claim", who="agent")
    assert claim.status == "applied_verified", claim.reason
    stored = _scalar(oracle_url,
                     "SELECT TO_CHAR(reported_on, 'YYYY-MM-DD HH24:MI:SS') FROM claim"
                     " WHERE claim_ref = 'CLM-2024-002'")
    assert stored == "2024-08-20 00:00:00"


# --- Oracle: the session's labels -------------------------------------------------------------


def test_session_is_tagged_with_case_operation_and_intent(ora: Executor,
                                                         oracle_url: URL) -> None:
    out = ora.call("ora.session_tags", {"policy_id": 1}, case="C-tag", who="agent")
    assert out.status == "applied_verified", out.reason
    assert out.evidence["replay"]["rows"] == [
        ["capgate", "ora.session_tags", out.intent_id, "C-tag"]]

    # the same labels in V$SESSION, as a DBA sees them (needs SELECT on V_$SESSION)
    _grant(oracle_url, "SELECT ON SYS.V_$SESSION")
    seen = ora.call("ora.session_view", {"policy_id": 2}, case="C-view", who="agent")
    if seen.status != "applied_verified":
        message = str((seen.reason or {}).get("message", ""))
        if any(code in message for code in ("ORA-00942", "ORA-01031", "ORA-41900")):
            pytest.skip(f"V$SESSION is not readable by the test user: {message}")
        pytest.fail(f"ora.session_view: {seen.reason}")
    assert seen.evidence["replay"]["rows"] == [
        ["capgate", "ora.session_view", seen.intent_id, "C-view"]]


# --- Oracle: transaction identity and commit outcome -------------------------------------


def test_without_commit_outcome_no_ltxid_is_recorded_and_why(ora: Executor) -> None:
    out = ora.call("policy.add_note", NOTE, case="C-noltxid", who="agent")
    assert out.status == "applied_verified", out.reason
    tx = _tx(ora, "C-noltxid")
    assert tx["dialect"] == "oracle" and tx["driver"] == "thin"
    assert int(tx["sid"]) > 0 and int(tx["serial"]) > 0 and int(tx["instance"]) >= 1
    assert tx["txid"] and tx["usid"] and tx["db"]
    if tx["ltxid"]:
        pytest.skip("this DSN's default service has COMMIT_OUTCOME (Transaction Guard on)")
    assert "COMMIT_OUTCOME" in tx["commit_outcome"]


def test_ltxid_is_recorded_before_commit(oracle_tg_url: URL,
                                         gate: Callable[..., Executor]) -> None:
    ex = gate(oracle_tg_url)
    out = ex.call("policy.add_note", NOTE, case="C-ltxid", who="agent")
    assert out.status == "applied_verified", out.reason
    tx = _tx(ex, "C-ltxid")
    assert tx["ltxid"] and tx["commit_outcome"] == "recorded"
    raw = bytes.fromhex(tx["ltxid"])
    assert raw and raw.hex() == tx["ltxid"]


def test_commit_outcome_of_a_committed_intent(oracle_tg_url: URL,
                                              gate: Callable[..., Executor]) -> None:
    ex = gate(oracle_tg_url)
    out = ex.call("policy.add_note", NOTE, case="C-outcome", who="agent")
    assert out.status == "applied_verified", out.reason
    tx = _tx(ex, "C-outcome")
    # Transaction Guard is asked about sessions that are gone: end the executor's
    ex.connectors.get("insurance").engine.dispose()
    if not _grant(oracle_tg_url, "EXECUTE ON SYS.DBMS_APP_CONT"):
        pytest.skip("the admin URL may not grant EXECUTE ON DBMS_APP_CONT")
    dialect = OracleDialect()
    engine = sa.create_engine(oracle_tg_url, poolclass=sa.pool.NullPool)
    dialect.prepare_engine(engine)
    try:
        with engine.connect() as conn:
            assert dialect.commit_outcome(conn, tx) == "committed"
            assert dialect.commit_outcome(conn, {"ltxid": None}) is None
    finally:
        engine.dispose()


# --- Oracle: pool resets, procedures that commit --------------------------------------------


def test_labels_and_call_timeout_are_reset_on_return_to_the_pool(ora: Executor) -> None:
    out = ora.call("ora.session_tags", {"policy_id": 1}, case="C-reset", who="agent")
    assert out.status == "applied_verified", out.reason
    engine = ora.connectors.get("insurance").engine
    with engine.connect() as conn:  # the pooled session the call used
        raw: Any = conn.connection.driver_connection
        assert raw.call_timeout == 0
        labels = conn.execute(sa.text(
            "SELECT SYS_CONTEXT('USERENV', 'CLIENT_INFO'), SYS_CONTEXT('USERENV', 'ACTION'),"
            " SYS_CONTEXT('USERENV', 'CLIENT_IDENTIFIER') FROM dual")).one()
        assert tuple(labels) == (None, None, None), labels
        conn.rollback()


PROCEDURES = (
    "CREATE OR REPLACE PROCEDURE commit_note(p NUMBER) AS BEGIN"
    " INSERT INTO policy_note (policy_id, author, body) VALUES (p, 'proc', 'committed inside');"
    " COMMIT; END;",
    "CREATE OR REPLACE PROCEDURE ddl_note(p NUMBER) AS BEGIN"
    " INSERT INTO policy_note (policy_id, author, body) VALUES (p, 'proc', 'before ddl');"
    " EXECUTE IMMEDIATE 'CREATE TABLE split_probe (x NUMBER)'; END;",
)


def test_a_procedure_that_commits_is_refused(ora: Executor, oracle_url: URL) -> None:
    engine = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            for ddl in PROCEDURES:
                conn.exec_driver_sql(ddl)
    finally:
        engine.dispose()
    out = ora.call("ora.call_proc", {"policy_id": 1, "proc": "commit_note"}, case="C-proc",
                   who="agent")
    assert out.status == "rolled_back", out
    assert "ORA-00034" in str((out.reason or {}).get("message")), out.reason
    assert _scalar(oracle_url, "SELECT count(*) FROM policy_note WHERE author = 'proc'") == 0
    assert _markers(oracle_url, out.intent_id) == 0


def test_ddl_inside_a_call_never_reports_applied(ora: Executor, oracle_url: URL) -> None:
    """Refused by the session (ORA-00034), or seen before COMMIT (CG327, escalated):
    never ``applied_verified`` for a call whose transaction was split."""
    from capgate.executor.recovery.resume import resume
    from capgate.registry.errors import TransactionSplit

    engine = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            for ddl in PROCEDURES:
                conn.exec_driver_sql(ddl)
    finally:
        engine.dispose()
    try:
        out = ora.call("ora.call_proc", {"policy_id": 1, "proc": "ddl_note"}, case="C-ddl",
                       who="agent")
    except TransactionSplit as split:
        assert split.code == "CG327"
        (state,) = (ora.ledger.snapshot("C-ddl") or {})["intents"].values()
        assert state["status"] == "escalated"
        assert state["escalation"]["kind"] == "transaction_split"
        assert state["escalation"]["classification"] == "partly_applied"
        (parked,) = resume(ora, "C-ddl").intents
        assert parked.action == "awaiting_person"
        return
    # the session refused the DDL's commit (ORA-00034 as documented, or another ORA-): rolled
    # back, and the procedure's insert before it did not land
    assert out.status == "rolled_back", out
    assert "ORA-" in str((out.reason or {}).get("message")), out.reason
    assert _scalar(oracle_url, "SELECT count(*) FROM policy_note WHERE author = 'proc'") == 0


def test_a_split_transaction_is_seen_before_commit(oracle_url: URL,
                                                   gate: Callable[..., Executor]) -> None:
    """The detector itself: a COMMIT sent inside an open write changes the local
    transaction id, and ``before_commit`` refuses to vouch for it."""
    from capgate.registry.errors import TransactionSplit

    gate(oracle_url)  # the schema
    dialect = OracleDialect()
    engine = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
    dialect.prepare_engine(engine)
    try:
        with engine.connect() as conn:
            tag = SessionTag("C-split", "ora.split", "i-split")
            identity = dialect.begin_write(conn, tag, 10, None)
            assert identity.values["txid"]
            dialect.before_commit(conn)  # nothing committed yet
            conn.exec_driver_sql("COMMIT")  # what DDL or a procedure's COMMIT would do
            conn.execute(sa.text("UPDATE policy SET holder = holder WHERE policy_id = 1"))
            with pytest.raises(TransactionSplit):
                dialect.before_commit(conn)
            conn.rollback()
    finally:
        engine.dispose()


# --- Oracle: least privilege, the database's session limit, doctor ----------------------------


def _admin() -> sa.Engine:
    return sa.create_engine(require_server("oracle").url, poolclass=sa.pool.NullPool,
                            isolation_level="AUTOCOMMIT")


def test_a_least_privilege_account_writes_after_install(oracle_url: URL,
                                                        gate: Callable[..., Executor],
                                                        tmp_path: Any) -> None:
    """The owner installs capgate's tables once; the calling account has CREATE SESSION,
    the rows' DML and the target's grants -- no CREATE TABLE -- and writes."""
    import uuid

    from capgate.executor.connectors import ConnectorConfig, Connectors
    from capgate.executor.ledger import open_ledger
    from tests.fix_capgate import GRANTS, registry

    gate(oracle_url)  # schema and capgate's tables, installed as the owner
    owner = str(oracle_url.username).upper()
    app, password = f"CGA_{uuid.uuid4().hex[:10]}".upper(), uuid.uuid4().hex[:16]
    admin = _admin()
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE USER {app} IDENTIFIED BY "{password}"')
            conn.exec_driver_sql(f"GRANT CREATE SESSION TO {app}")
        owner_engine = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
        try:
            with owner_engine.begin() as conn:
                for table in ("policy", "policy_note"):
                    conn.exec_driver_sql(f"GRANT SELECT, INSERT, UPDATE ON {table} TO {app}")
                for statement in OracleDialect().target_grants(app):
                    conn.exec_driver_sql(statement)
        finally:
            owner_engine.dispose()
        app_url = oracle_url.set(username=app, password=password)
        connectors = Connectors({"insurance": ConnectorConfig(
            "insurance", app_url.render_as_string(hide_password=False), "dev",
            current_schema=owner)})
        ex = Executor(registry(), connectors, open_ledger(f"sqlite:///{tmp_path}/l.db"), GRANTS)
        try:
            out = ex.call("policy.add_note", NOTE, case="C-least", who="agent")
            assert out.status == "applied_verified", out.reason
            with connectors.get("insurance").engine.connect() as conn:
                privs = {r[0] for r in conn.execute(sa.text("SELECT privilege FROM session_privs"))}
            assert "CREATE TABLE" not in privs and "CREATE ANY TABLE" not in privs
        finally:
            connectors.dispose()
            ex.ledger.close()
        assert _markers(oracle_url, out.intent_id) == 1
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP USER {app} CASCADE")
        admin.dispose()


def test_the_database_session_limit_is_the_budget_error(oracle_url: URL,
                                                        gate: Callable[..., Executor]) -> None:
    import uuid

    from capgate.registry.errors import BudgetExhausted

    gate(oracle_url)
    profile = f"CGP_{uuid.uuid4().hex[:8]}".upper()
    admin = _admin()
    try:
        with admin.connect() as conn:
            enforced = conn.execute(sa.text(
                "SELECT value FROM v$parameter WHERE name = 'resource_limit'")).scalar()
            if str(enforced).upper() != "TRUE":
                admin.dispose()
                pytest.skip("RESOURCE_LIMIT is FALSE: SESSIONS_PER_USER is not enforced here")
            conn.exec_driver_sql(f"CREATE PROFILE {profile} LIMIT SESSIONS_PER_USER 2")
            conn.exec_driver_sql(f"ALTER USER {oracle_url.username} PROFILE {profile}")
    except sa.exc.DBAPIError as exc:
        admin.dispose()
        pytest.skip(f"the admin URL may not create a profile: {exc.orig}")
    holders = [sa.create_engine(oracle_url, poolclass=sa.pool.NullPool) for _ in range(2)]
    held = []
    try:
        for engine in holders:
            conn = engine.connect()
            conn.execute(sa.text("SELECT 1 FROM dual"))
            held.append(conn)
        ex = gate(oracle_url, schema=False)
        with pytest.raises(BudgetExhausted) as info:
            ex.call("policy.add_note", NOTE, case="C-limit", who="agent")
        assert info.value.code == "CG321" and "ORA-02391" in info.value.message
        assert list(ex.ledger.events("C-limit")) == []  # refused before anything was recorded
    finally:
        for conn in held:
            conn.close()
        for engine in holders:
            engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"ALTER USER {oracle_url.username} PROFILE DEFAULT")
            conn.exec_driver_sql(f"DROP PROFILE {profile}")
        admin.dispose()


@pytest.mark.oracle  # its fixture is asked for by name, which collection cannot see
@pytest.mark.parametrize("service", ["default", "transaction_guard"])
def test_doctor_reports_what_oracle_needs(service: str, request: pytest.FixtureRequest,
                                          gate: Callable[..., Executor],
                                          tmp_path: Any) -> None:
    from pathlib import Path

    from capgate.commands.doctor import run_doctor

    url: URL = request.getfixturevalue("oracle_url" if service == "default"
                                       else "oracle_tg_url")
    gate(url)
    if service == "transaction_guard":
        _grant(url, "EXECUTE ON SYS.DBMS_APP_CONT")
    root = Path(__file__).resolve().parent.parent
    config = tmp_path / "capgate.toml"
    config.write_text(f"""[capgate]
capabilities = ["{root / 'capabilities'}"]
ledger = "sqlite:///{tmp_path / 'ledger.db'}"

[connectors.insurance]
url = "{url.render_as_string(hide_password=False)}"
environment = "dev"
session_budget = 2
""", "utf-8")
    report = run_doctor(config, {})
    mine = [f for f in report.findings if f.subject == "connector insurance"]
    text = "\n".join(f.render() for f in mine)
    assert any("python-oracledb" in f.message and "Thin mode" in f.message for f in mine), text
    assert any("SESSIONS_PER_USER" in f.message for f in mine), text
    assert any("GV$SESSION" in f.message for f in mine), text
    assert any(f.code == "CG326" and "policy.cancel" in f.message for f in mine), text
    outcome = [f for f in mine if f.code == "CG916" or "Transaction Guard" in f.message]
    if service == "default":
        assert any(f.code == "CG916" and "COMMIT_OUTCOME" in f.message for f in outcome), text
    else:
        assert any(f.severity == "ok" and "Transaction Guard" in f.message
                   for f in outcome), text


# --- Oracle: timeouts ------------------------------------------------------------------------


def test_call_timeout_rolls_back_a_long_statement(ora: Executor, oracle_url: URL) -> None:
    ora.connectors.get("insurance").check_target()
    before = _dump(oracle_url)
    started = time.monotonic()
    out = ora.call("ora.slow", {"policy_id": 1, "seconds": 8}, case="C-slow", who="agent")
    elapsed = time.monotonic() - started
    assert out.status == "rolled_back"
    assert out.reason is not None
    message = str(out.reason.get("message", ""))
    if "PLS-00201" in message or "PLS-00302" in message:
        pytest.skip(f"DBMS_SESSION.SLEEP is not available (Oracle 18c+): {message}")
    assert out.reason["kind"] == "timeout", out.reason
    assert out.reason["on_timeout"] == "rolled_back"
    assert any(code in message for code in ("DPY-4024", "DPY-4011", "ORA-01013")), message
    assert elapsed < 7, f"the call timeout did not cut the 8 s sleep short ({elapsed:.1f} s)"
    assert out.evidence["counts"] == [1]  # the rename ran, then was rolled back
    assert _dump(oracle_url) == before
    assert _markers(oracle_url, out.intent_id) == 0
    # the connector is usable afterwards, its session's call timeout reset
    again = ora.call("policy.add_note", NOTE, case="C-after-slow", who="agent")
    assert again.status == "applied_verified", again.reason



# --- Oracle: every example of the capability files -------------------------------------------


def test_every_example_rehearses_on_oracle(oracle_url: URL,
                                          gate: Callable[..., Executor]) -> None:
    """Every current example row runs on Oracle 19c+ (no 23ai-only SQL: CG170 sees to it);
    the leased row is refused (CG326), as it must be there."""
    from capgate.executor.rehearse import rehearse

    ex = gate(oracle_url)
    report = rehearse(ex, who="agent", connectors=["insurance"])
    refused = [r for r in report.results if r.operation_id == "policy.cancel"
               and r.result != "skipped"]  # the retired version is skipped as everywhere
    assert refused and all("CG326" in " ".join(r.problems) for r in refused), refused
    failed = [r for r in report.results if r.result not in ("passed", "skipped")
              and r.operation_id != "policy.cancel"]
    assert not failed, [(r.ref, r.name, r.result, r.message) for r in failed]
    assert any(r.result == "passed" for r in report.results)
    # nothing stayed behind
    assert _scalar(oracle_url, "SELECT count(*) FROM claim") == 1
    assert _scalar(oracle_url, f"SELECT count(*) FROM {MARKER_TABLE}") == 0
