"""The executor on Oracle (python-oracledb thin mode).

Runs where an Oracle answers: ``CAPGATE_TEST_ORACLE_DSN`` (a SQLAlchemy or
``oracle://user:pw@host:port/?service_name=...`` URL of a user that may create
users), else a ``gvenzl/oracle-free`` container when a Docker daemon answers;
otherwise every test skips (``CAPGATE_REQUIRE_DBS=oracle`` makes that a failure).
Each test gets a fresh Oracle user with the example schema
(``capabilities/schema/oracle.sql``) and a SQLite ledger.

What needs more than a plain user is granted best-effort through the server's
own (admin) URL and the assertion adapts or skips when the grant is refused:
``SELECT`` on ``V$SESSION`` (the session labels as a DBA sees them) and
``EXECUTE`` on ``DBMS_APP_CONT`` (Transaction Guard's commit outcome).  An
LTXID exists only on a service with ``COMMIT_OUTCOME=TRUE`` (not the default
service of a PDB such as ``FREEPDB1``): without one the LTXID test skips,
unless ``CAPGATE_TEST_ORACLE_TG=1`` says the DSN's service has it, in which
case an empty LTXID fails.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from executor.call import Executor
from executor.dialects import SessionTag
from executor.dialects.base import MARKER_TABLE
from executor.dialects.oracle import OracleDialect
from executor.target import install_at
from tests.fix_capgate import table_dump
from tests.fix_db import require_server

pytestmark = [pytest.mark.oracle]

NOTE = {"policy_id": 1, "author": "jdoe", "body": "Called the holder."}
TABLES = ("policy", "cover", "premium", "document_number", "issued_document", "policy_note",
          "claim", MARKER_TABLE)

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


# --- helpers ---------------------------------------------------------------------------


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


def _dump(url: URL) -> dict[str, list[tuple[Any, ...]]]:
    return {table: table_dump(url, table) for table in TABLES}


def _markers(url: URL, intent_id: str) -> int:
    return int(_scalar(url, f"SELECT count(*) FROM {MARKER_TABLE} WHERE intent_id = :i",
                       i=intent_id))


def _tx(ex: Executor, case: str) -> dict[str, Any]:
    started = [e for e in ex.ledger.events(case) if e.kind == "attempt_started"]
    assert len(started) == 1, [e.kind for e in ex.ledger.events(case)]
    tx: dict[str, Any] = dict(started[0].payload["state"]["tx"])
    return tx


def _service_has_ltxid(url: URL) -> bool:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            raw: Any = conn.connection.driver_connection
            return bool(raw.ltxid)
    finally:
        engine.dispose()


@pytest.fixture
def ora(oracle_url: URL, gate: Callable[..., Executor]) -> Executor:
    """An executor over a fresh Oracle user with the example schema, plus the test rows."""
    from registry.loader import validate_texts
    from registry.registry import Registry
    from tests.fix_capgate import registry

    ex = gate(oracle_url)
    extra = validate_texts([("oracle_rows.yaml", ORACLE_ROWS)])
    extra.raise_for_problems()
    ex.registry = Registry(list(registry().rows()) + list(extra.rows))
    return ex


# --- schema and reads -------------------------------------------------------------------


def test_schema_seeds_and_iso_date_binds(ora: Executor, oracle_url: URL) -> None:
    assert _scalar(oracle_url, "SELECT count(*) FROM premium") == 12
    assert _scalar(oracle_url, "SELECT sum(amount) FROM cover WHERE policy_id = 1") == 250000
    # identity columns continue above the seed rows' explicit ids
    out = ora.call("policy.add_note", NOTE, case="C-ident", who="agent")
    assert out.status == "applied_verified", out.reason
    assert _scalar(oracle_url, "SELECT max(note_id) FROM policy_note") >= 1000
    # dates bound as ISO strings compare against DATE columns (NLS_DATE_FORMAT)
    overdue = ora.call("premium.list_overdue", {"as_of": "2024-08-15"}, case="C-due",
                       who="agent")
    assert overdue.status == "ok", overdue.reason
    assert [r[0] for r in overdue.evidence["rows"]] == [7, 9, 3]


def test_read_runs_in_a_read_only_transaction(ora: Executor) -> None:
    out = ora.call("policy.get", {"policy_id": 1}, case="C-read", who="agent")
    assert out.status == "ok", out.reason
    assert out.evidence["count"] == 1
    assert out.evidence["columns"][:2] == ["policy_id", "holder"]
    assert out.evidence["rows"][0][:2] == [1, "Ada Lovelace"]

    connector = ora.connectors.get("insurance")
    dialect = connector.dialect
    with connector.engine.connect() as conn:
        dialect.begin_read(conn, SessionTag("C-ro", "ro.probe", "i-ro"), 5)
        with pytest.raises(sa.exc.DBAPIError) as info:
            conn.execute(sa.text("UPDATE policy SET holder = holder WHERE policy_id = 1"))
        assert dialect.is_read_only_violation(info.value), info.value  # ORA-01456
        conn.rollback()
        dialect.end_read(conn)


# --- collapsed writes ---------------------------------------------------------------------


def test_collapsed_write_verifies_replays_and_marks(ora: Executor, oracle_url: URL) -> None:
    before = _scalar(oracle_url, "SELECT count(*) FROM policy_note WHERE policy_id = 1")
    out = ora.call("policy.add_note", NOTE, case="C-ok", who="agent")
    assert out.status == "applied_verified", out.reason
    assert out.evidence["counts"] == [1]
    assert out.evidence["verify"][0]["ok"] is True
    assert out.evidence["replay"]["columns"] == ["author", "body"]
    assert ["jdoe", "Called the holder."] in out.evidence["replay"]["rows"]
    assert _scalar(oracle_url, "SELECT count(*) FROM policy_note WHERE policy_id = 1") \
        == before + 1
    assert _markers(oracle_url, out.intent_id) == 1
    assert [e.kind for e in ora.ledger.events("C-ok")] == [
        "prepared", "attempt_started", "observed"]
    assert ora.ledger.verify("C-ok").ok
    # an ISO date string stored into a DATE column
    claim = ora.call("claim.register", {"policy_id": 2, "claim_ref": "CLM-2024-002",
                                        "reported_on": "2024-08-20", "amount": 800},
                     case="C-claim", who="agent")
    assert claim.status == "applied_verified", claim.reason
    stored = _scalar(oracle_url,
                     "SELECT TO_CHAR(reported_on, 'YYYY-MM-DD HH24:MI:SS') FROM claim"
                     " WHERE claim_ref = 'CLM-2024-002'")
    assert stored == "2024-08-20 00:00:00"


def test_verify_failure_rolls_back_byte_for_byte(ora: Executor, oracle_url: URL) -> None:
    ora.connectors.get("insurance").check_target()
    before = _dump(oracle_url)
    out = ora.call("policy.add_note", {"policy_id": 9, "author": "jdoe", "body": "No."},
                   case="C-void", who="agent")
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "verify", out.reason
    assert out.reason["check"] == "policy_not_void"
    assert out.evidence["counts"] == [1]  # the insert ran, then was rolled back
    assert _dump(oracle_url) == before
    assert _markers(oracle_url, out.intent_id) == 0


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


# --- transaction identity and commit outcome ----------------------------------------------


def test_ltxid_is_recorded_before_commit(ora: Executor, oracle_url: URL) -> None:
    out = ora.call("policy.add_note", NOTE, case="C-ltxid", who="agent")
    assert out.status == "applied_verified", out.reason
    tx = _tx(ora, "C-ltxid")
    assert tx["dialect"] == "oracle"
    assert int(tx["sid"]) > 0 and int(tx["serial"]) > 0
    assert "ltxid" in tx
    if not tx["ltxid"]:
        if os.environ.get("CAPGATE_TEST_ORACLE_TG") == "1":
            pytest.fail("CAPGATE_TEST_ORACLE_TG=1 but no LTXID was recorded")
        if _service_has_ltxid(oracle_url):
            pytest.fail("the driver reports an LTXID on this service, but none was recorded")
        pytest.skip("the service has no COMMIT_OUTCOME (Transaction Guard): no LTXID")
    raw = bytes.fromhex(tx["ltxid"])
    assert raw and raw.hex() == tx["ltxid"]


def test_commit_outcome_of_a_committed_intent(ora: Executor, oracle_url: URL) -> None:
    out = ora.call("policy.add_note", NOTE, case="C-outcome", who="agent")
    assert out.status == "applied_verified", out.reason
    tx = _tx(ora, "C-outcome")
    # Transaction Guard is asked about sessions that are gone: end the executor's
    ora.connectors.get("insurance").engine.dispose()
    _grant(oracle_url, "EXECUTE ON SYS.DBMS_APP_CONT")
    executable = bool(_scalar(
        oracle_url, "SELECT count(*) FROM all_objects WHERE owner = 'SYS'"
                    " AND object_name = 'DBMS_APP_CONT' AND object_type = 'PACKAGE'"))
    dialect = OracleDialect()
    engine = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
    dialect.prepare_engine(engine)
    try:
        with engine.connect() as conn:
            answer = dialect.commit_outcome(conn, tx)
            assert dialect.commit_outcome(conn, {"ltxid": None}) is None
    finally:
        engine.dispose()
    if tx.get("ltxid") and executable:
        assert answer == "committed"
    else:
        assert answer is None


# --- timeouts -------------------------------------------------------------------------------


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


def test_row_lock_wait_is_bounded_by_the_call_timeout(ora: Executor, oracle_url: URL) -> None:
    holder = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
    try:
        with holder.connect() as conn:
            conn.execute(sa.text(
                "SELECT holder FROM policy WHERE policy_id = 1 FOR UPDATE")).fetchall()
            started = time.monotonic()
            out = ora.call("ora.touch", {"policy_id": 1}, case="C-lock", who="agent")
            elapsed = time.monotonic() - started
            conn.rollback()
    finally:
        holder.dispose()
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "timeout", out.reason
    assert elapsed < 10, elapsed
    again = ora.call("ora.touch", {"policy_id": 1}, case="C-lock2", who="agent")
    assert again.status == "applied_verified", again.reason


# --- the landing-marker table -----------------------------------------------------------------


def test_target_tables_install_idempotently(oracle_url: URL,
                                            gate: Callable[..., Executor]) -> None:
    for _ in range(2):  # the second install finds both tables and creates nothing
        created = install_at(oracle_url)
    assert created == []
    engine = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
    try:
        assert sa.inspect(engine).has_table(MARKER_TABLE)
    finally:
        engine.dispose()
    # a fresh executor (its own connector, its own once-per-process check) still writes
    ex = gate(oracle_url)
    out = ex.call("policy.add_note", NOTE, case="C-marker", who="agent")
    assert out.status == "applied_verified", out.reason
    assert _markers(oracle_url, out.intent_id) == 1


# --- every example of the capability files ---------------------------------------------------

# Rows whose SQL needs Oracle 23ai (a SELECT without FROM in a verify check).
NEEDS_23AI = {"policy.purge_orphan"}


def test_every_example_rehearses_on_oracle(oracle_url: URL,
                                           gate: Callable[..., Executor]) -> None:
    from executor.rehearse import FAILED, rehearse

    ex = gate(oracle_url)
    engine = ex.connectors.get("insurance").engine
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1 FROM dual"))
    version = int((engine.dialect.server_version_info or (0,))[0])
    report = rehearse(ex, who="agent", connectors=["insurance"])
    failed = [r for r in report.results if r.result not in ("passed", "skipped")]
    if version < 23:
        failed = [r for r in failed if not (r.operation_id in NEEDS_23AI and r.result == FAILED)]
    assert not failed, [(r.ref, r.name, r.result, r.message) for r in failed]
    assert any(r.result == "passed" for r in report.results)
    # nothing stayed behind
    assert _scalar(oracle_url, "SELECT count(*) FROM claim") == 1
    assert _scalar(oracle_url, f"SELECT count(*) FROM {MARKER_TABLE}") == 0
