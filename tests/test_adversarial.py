"""Issue 11: every recorded outcome is true, and no gate can be gone around.

Each test here reproduces one fail-open path found by trying capgate as an
adversary would, against real databases, and pins the fix.  The item number
of the issue is in each test's docstring.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.dialects import dialect_for
from capgate.executor.dialects.base import MARKER_TABLE
from capgate.executor.recovery.resume import resume
from capgate.registry import errors
from capgate.sqlfiles import apply_schema
from tests.crash_child import Zygote
from tests.fix_capgate import make_executor, table_dump
from tests.fix_db import engine_params

NOTE = {"policy_id": 1, "author": "jdoe", "body": "Called the holder."}


def _engine_name(url: URL) -> str:
    return {"mysql": "mariadb"}.get(url.get_backend_name(), url.get_backend_name())


def _has_table(url: URL, table: str) -> bool:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        return sa.inspect(engine).has_table(table)
    finally:
        engine.dispose()


@contextlib.contextmanager
def least_privilege(url: URL) -> Iterator[URL]:
    """An account that may read and write the example tables and nothing else (no CREATE)."""
    name = f"cglp_{uuid.uuid4().hex[:10]}"
    password = uuid.uuid4().hex[:16]
    engine_name = _engine_name(url)
    admin = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if engine_name == "postgresql":
                schema = conn.execute(sa.text("SELECT current_schema()")).scalar_one()
                conn.execute(sa.text(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'"))
                conn.execute(sa.text(f'GRANT USAGE ON SCHEMA "{schema}" TO {name}'))
                conn.execute(sa.text(
                    f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" '
                    f"TO {name}"))
                conn.execute(sa.text(
                    f'GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA "{schema}" TO {name}'))
            else:
                db = url.database
                conn.execute(sa.text(f"CREATE USER '{name}'@'%' IDENTIFIED BY '{password}'"))
                conn.execute(sa.text(
                    f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.* TO '{name}'@'%'"))
        yield url.set(username=name, password=password)
    finally:
        with admin.connect() as conn:
            if engine_name == "postgresql":
                conn.execute(sa.text(f"DROP OWNED BY {name}"))
                conn.execute(sa.text(f"DROP ROLE IF EXISTS {name}"))
            else:
                conn.execute(sa.text(f"DROP USER IF EXISTS '{name}'@'%'"))
        admin.dispose()


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_url(request: pytest.FixtureRequest) -> Iterator[URL]:
    from tests.fix_db import FRESH, require_server

    with FRESH[request.param](require_server(request.param)) as url:
        yield url


def _sent_sql(engine: sa.Engine) -> list[str]:
    sent: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    return sent


# --- item 10: no DDL at call time; a least-privilege account can write -----------------------


def test_a_call_never_sends_ddl(executor: Executor) -> None:
    """Item 10: the SQL a write sends to the target holds no CREATE, ALTER or DROP."""
    connector = executor.connectors.get("insurance")
    sent = _sent_sql(connector.engine)
    out = executor.call("policy.add_note", NOTE, case="C-noddl", who="agent")
    assert out.status == "applied_verified", out.reason
    assert sent, "the recorder saw nothing"
    ddl = [s for s in sent if s.lstrip().upper().startswith(("CREATE", "ALTER", "DROP"))
           or "CREATE TABLE" in s.upper()]
    assert ddl == []


def test_missing_target_tables_are_a_coded_refusal_that_records_nothing(
        target_url: URL, tmp_path: Path) -> None:
    """Item 10: without capgate's tables a call is refused (CG305) naming the table and fix."""
    from capgate.executor.dialects.base import FENCE_TABLE
    from capgate.executor.target import install_at

    engine = sa.create_engine(target_url, poolclass=sa.pool.NullPool)
    try:
        apply_schema(engine)
    finally:
        engine.dispose()
    ex = make_executor(target_url, f"sqlite:///{tmp_path / 'ledger.db'}", schema=False)
    try:
        before = table_dump(target_url, "policy_note")
        with pytest.raises(errors.TargetNotInstalled) as info:
            ex.call("policy.add_note", NOTE, case="C-missing", who="agent")
        assert info.value.code == "CG305" and info.value.exit_code == errors.EXIT_USAGE
        assert info.value.details["table"] == MARKER_TABLE
        assert "capgate target install insurance" in info.value.message
        assert ex.ledger.snapshot("C-missing") is None  # nothing recorded
        assert table_dump(target_url, "policy_note") == before
        assert not _has_table(target_url, MARKER_TABLE)  # and nothing created
        assert install_at(target_url) == [MARKER_TABLE, FENCE_TABLE]
        out = ex.call("policy.add_note", NOTE, case="C-missing", who="agent")
        assert out.status == "applied_verified", out.reason
    finally:
        ex.connectors.dispose()
        ex.ledger.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def test_least_privilege_account_writes_and_resumes(server_url: URL, tmp_path: Path,
                                                    zygote: Zygote) -> None:
    """Item 10: an account without CREATE writes once the tables were installed for it."""
    from capgate.executor.target import install_script

    engine = sa.create_engine(server_url, poolclass=sa.pool.NullPool)
    try:
        apply_schema(engine)
    finally:
        engine.dispose()
    with least_privilege(server_url) as app_url:
        # the DBA's script, run by the privileged account: tables and grants
        script = install_script(dialect_for(server_url.get_backend_name()),
                                grant_to=_grantee(app_url))
        admin = sa.create_engine(server_url, poolclass=sa.pool.NullPool)
        try:
            sql = "\n".join(line for line in script.splitlines() if not line.startswith("--"))
            with admin.begin() as conn:
                for statement in filter(None, (s.strip() for s in sql.split(";"))):
                    conn.execute(sa.text(statement))
        finally:
            admin.dispose()
        ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
        ex = make_executor(app_url, ledger, schema=False)
        try:
            out = ex.call("policy.add_note", NOTE, case="C-lp", who="agent")
            assert out.status == "applied_verified", out.reason
            again = ex.call("policy.add_note", NOTE, case="C-lp", who="agent")
            assert again.replayed and again.intent_id == out.intent_id
            # killed before COMMIT, then resumed by the same least-privilege account
            crashed = {**NOTE, "body": "crashed before commit"}
            ended = zygote.run({"target": app_url.render_as_string(hide_password=False),
                                "ledger": ledger, "operation": "policy.add_note",
                                "inputs": crashed, "case": "C-lp2", "who": "agent",
                                "out": str(tmp_path / "out.json"), "crash_at": "before_commit"})
            assert ended.killed, ended
            report = resume(ex, "C-lp2")
            (only,) = report.intents
            assert (only.classification, only.action) == ("not_applied", "retried"), only
            assert only.outcome == "applied_verified"
        finally:
            ex.connectors.dispose()
            ex.ledger.close()


def _grantee(url: URL) -> str:
    """The --grant-to name (a MariaDB account as USER@HOST; the dialect quotes it)."""
    if _engine_name(url) == "mariadb":
        return f"{url.username}@%"
    return str(url.username)


def test_target_install_sql_for_a_dba(target_url: URL) -> None:
    """Item 10: `--sql` prints a script; it is what `install` would create, nothing else."""
    from capgate.executor.dialects.base import FENCE_TABLE
    from capgate.executor.target import install_script

    dialect = dialect_for(target_url.get_backend_name())
    script = install_script(dialect, grant_to="app")
    assert script.count("CREATE TABLE") == 2
    assert MARKER_TABLE in script and FENCE_TABLE in script
    assert "IF NOT EXISTS" not in script
    if dialect.name != "sqlite":
        grantee = "'app'@'%'" if dialect.name == "mariadb" else "app"
        assert f"GRANT SELECT, INSERT ON {MARKER_TABLE} TO {grantee}" in script


# --- item 1: one execution per idempotency key, under concurrency ------------------------------


def _same_call(ex: Executor, case: str, body: str) -> dict[str, Any]:
    """One identical call; what the caller got (an outcome, or a coded refusal)."""
    try:
        out = ex.call("policy.add_note", {**NOTE, "body": body}, case=case, who="agent")
        return {"status": out.status, "intent_id": out.intent_id, "replayed": out.replayed}
    except errors.CapgateError as exc:
        return {"status": "refused", "code": exc.code, "retryable": exc.retryable,
                "message": exc.message}


def _check_one_execution(ex: Executor, case: str, body: str,
                         answers: list[dict[str, Any]]) -> None:
    landed = table_dump(ex.connectors.get("insurance").engine.url, "policy_note")
    assert sum(1 for row in landed if body in row) == 1, "exactly one row landed"
    applied = [a for a in answers if a["status"] == "applied_verified"]
    assert applied, answers
    # never a rolled_back (or an unknown) for an effect that landed
    assert all(a["status"] == "applied_verified"
               or (a["status"] == "refused" and a["code"] == "CG402") for a in answers), answers
    assert len({a["intent_id"] for a in applied}) == 1, "one intent executed"
    assert sum(1 for a in applied if not a["replayed"]) == 1
    intents = ex.ledger.intents(case)  # every intent, settled ones too (read from events)
    assert len(intents) == 1, intents  # the losers recorded nothing
    (state,) = intents.values()
    assert state["status"] == "observed" and state["outcome"] == "applied_verified"
    later = ex.call("policy.add_note", {**NOTE, "body": body}, case=case, who="agent")
    assert later.replayed and later.status == "applied_verified"
    assert not ex.ledger.cases(open_only=True)
    assert ex.ledger.verify().ok


def test_identical_calls_from_eight_threads_execute_once(executor: Executor) -> None:
    """Item 1: 8 simultaneous identical calls in one case -> one execution, one true record."""
    import threading

    body = f"eight threads {uuid.uuid4().hex[:8]}"
    barrier = threading.Barrier(8)
    answers: list[dict[str, Any]] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        answer = _same_call(executor, "C-threads", body)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == 8
    _check_one_execution(executor, "C-threads", body, answers)


def _process_call(target: str, ledger: str, case: str, body: str,
                  start_at: float) -> dict[str, Any]:
    import time

    ex = make_executor(target, ledger, schema=False)
    try:
        ex.ledger.snapshot("warm-up")
        ex.connectors.get("insurance").check_target()
        while time.time() < start_at:
            time.sleep(0.001)
        return _same_call(ex, case, body)
    finally:
        ex.connectors.dispose()
        ex.ledger.close()


def test_identical_calls_from_eight_processes_execute_once(
        target_url: URL, ledger_url: URL, gate: Callable[..., Executor]) -> None:
    """Item 1: the same guarantee across processes sharing one ledger."""
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    ex = gate(target_url, ledger_url)
    body = f"eight processes {uuid.uuid4().hex[:8]}"
    target = target_url.render_as_string(hide_password=False)
    ledger = ledger_url.render_as_string(hide_password=False)
    start_at = time.time() + 6.0
    with ProcessPoolExecutor(max_workers=8, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_process_call, target, ledger, "C-procs", body, start_at)
                   for _ in range(8)]
        answers = [f.result(timeout=180) for f in futures]
    _check_one_execution(ex, "C-procs", body, answers)


def test_a_taken_marker_key_is_evidence_not_a_rollback(target_url: URL,
                                                       gate: Callable[..., Executor],
                                                       tmp_path: Path) -> None:
    """Item 1: a unique violation on the landing marker names who landed the key."""
    first = gate(target_url, f"sqlite:///{tmp_path / 'a.db'}")
    second = gate(target_url, f"sqlite:///{tmp_path / 'b.db'}", schema=False)  # 2nd ledger
    out = first.call("policy.add_note", NOTE, case="C-two", who="agent")
    assert out.status == "applied_verified", out.reason
    again = second.call("policy.add_note", NOTE, case="C-two", who="agent")
    assert again.status == "already_applied" and again.exit_code == 0
    assert again.reason is not None and again.reason["by_intent"] == out.intent_id
    assert again.evidence["landing_marker"]["intent_id"] == out.intent_id
    landed = table_dump(target_url, "policy_note")
    assert sum(1 for row in landed if NOTE["body"] in row) == 1
    recorded = second.ledger.intent("C-two", again.intent_id)
    assert recorded["status"] == "observed" and recorded["outcome"] == "already_applied"
    # a different request under a key that landed elsewhere: nothing of it was sent
    first.call("policy.add_note", {**NOTE, "body": "one"}, case="C-three", who="agent")
    other = second.call("policy.add_note", {**NOTE, "body": "two"}, case="C-three", who="agent")
    assert other.status == "rolled_back" and other.reason is not None
    assert other.reason["kind"] == "idempotency_conflict"
    assert not any("two" in row for row in table_dump(target_url, "policy_note"))


# --- item 12: the call path never trusts an unverified snapshot -------------------------------


def _edit_snapshot(ex: Executor, case: str, edit: Callable[[dict[str, Any]], None]) -> None:
    import json

    from capgate.executor.ledger.schema import cases

    with ex.ledger.engine.begin() as conn:
        text = conn.execute(sa.select(cases.c.snapshot).where(cases.c.case_id == case)
                            ).scalar_one()
        state = json.loads(text)
        edit(state)
        conn.execute(sa.update(cases).where(cases.c.case_id == case)
                     .values(snapshot=json.dumps(state)))


def test_an_edited_snapshot_does_not_let_a_blocked_case_continue(executor: Executor) -> None:
    """Item 12: an open intent marked finished by hand in the snapshot blocks the case."""
    executor.ledger.append("C-edit", "prepared", {"state": {
        "operation_id": "policy.add_note", "version": 1, "attempt": 0,
        "connector": "insurance", "idempotency_key": None}}, intent_id="i-open")
    with pytest.raises(errors.ReconciliationRequired):
        executor.call("policy.add_note", NOTE, case="C-edit", who="agent")

    def finish(state: dict[str, Any]) -> None:
        state["intents"]["i-open"]["status"] = "observed"

    _edit_snapshot(executor, "C-edit", finish)
    before = table_dump(executor.connectors.get("insurance").engine.url, "policy_note")
    fresh = make_executor(executor.connectors.get("insurance").engine.url,
                          executor.ledger.engine.url, schema=False)  # another process's view
    try:
        for ex in (executor, fresh):
            with pytest.raises(errors.LedgerTampered) as info:
                ex.call("policy.add_note", NOTE, case="C-edit", who="agent")
            assert info.value.code == "CG410"
    finally:
        fresh.connectors.dispose()
        fresh.ledger.close()
    assert table_dump(executor.connectors.get("insurance").engine.url, "policy_note") == before


# --- item 14: a stale executor, woken after resume settled its intent, changes nothing ------


@pytest.mark.crash
@pytest.mark.parametrize("operation,point", [
    ("policy.cancel", "after_attempt_started"),    # leased, stopped inside the lease
    ("policy.add_note", "after_attempt_started"),  # collapsed, stopped with the tx open
    ("policy.add_note", "after_prepared"),         # stopped before its attempt began
])
def test_a_woken_stale_executor_cannot_reopen_a_settled_case(
        server_url: URL, operation: str, point: str, gate: Callable[..., Executor],
        zygote: Zygote, tmp_path: Path) -> None:
    """Item 14: SIGSTOP mid-call, resume settles it, SIGCONT: the case stays settled."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(server_url, ledger)
    case = f"STALE-{operation}-{point}"
    tag = uuid.uuid4().hex[:8]
    if operation == "policy.cancel":
        inputs: dict[str, Any] = {"policy_id": 1, "cancel_date": "2024-08-15",
                                  "author": "jdoe", "reason": f"stale {tag}"}
    else:
        inputs = {**NOTE, "body": f"stale {tag}"}
    out = tmp_path / "late.json"
    ended = zygote.run({"target": server_url.render_as_string(hide_password=False),
                        "ledger": ledger, "operation": operation, "inputs": inputs,
                        "case": case, "who": "agent", "out": str(out), "stop_at": point})
    assert ended.stopped, ended
    try:
        report = resume(ex, case)  # terminates the stopped session, retries as attempt 2
        (only,) = report.intents
        assert (only.classification, only.action, only.outcome) == \
            ("not_applied", "retried", "applied_verified"), only
        late = zygote.cont(ended.pid)  # the stale executor wakes and carries on
        ended = None  # type: ignore[assignment]
        assert late.state == "exited", late
        assert late.outcome is not None and late.outcome.get("code") == "CG403", late.outcome
        state = ex.ledger.intent(case, only.intent_id)
        assert state["status"] == "observed" and state["attempt"] == 2, state
        assert state["outcome_record"]["status"] == "applied_verified"
        assert not ex.ledger.cases(open_only=True), "the case stays settled"
        notes = table_dump(server_url, "policy_note")
        assert sum(1 for row in notes if f"stale {tag}" in row) == 1, "exactly one effect"
        again = resume(ex, case)
        assert again.intents == () and again.exit_code == 0
        assert ex.ledger.verify().ok
    finally:
        if ended is not None:
            zygote.kill(ended.pid)


# --- item 13: a hung executor's locks go within the deadline plus one second ------------------

SLOW_ROWS = """
format: 1
connectors: {{insurance: {{}}}}
rows:
  - operation_id: test.lock_then_wait
    version: 1
    connector: insurance
    description: Lock a policy row, then a slow statement (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id, seconds]
      properties: {{policy_id: {{type: integer}}, seconds: {{type: number}}}}
    target: {{system: insurance, object: policy, keys: [policy_id]}}
    effect_class: transactional
    shape: collapsed
    authorization: {{kind: write_grant}}
    environments: [dev]
    idempotency_key: "{{case}}:{{policy_id}}"
    timeout: {{seconds: 3, on_timeout: rolled_back}}
    recovery: retryable
    statements:
      - {{name: lock, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}}
      - {{name: wait, sql: "{sleep}", expect_rows: 1}}
  - operation_id: test.lease_then_wait
    version: 1
    connector: insurance
    description: The same under a lease (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id, seconds]
      properties: {{policy_id: {{type: integer}}, seconds: {{type: number}}}}
    target: {{system: insurance, object: policy, keys: [policy_id]}}
    effect_class: transactional
    shape: leased
    authorization: {{kind: write_grant}}
    environments: [dev]
    idempotency_key: "{{case}}:{{policy_id}}"
    timeout: {{seconds: 3, on_timeout: rolled_back}}
    recovery: retryable
    steps:
      - {{name: lock, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}}
      - {{name: wait, sql: "{sleep}", expect_rows: 1}}
"""
SLEEP = {"postgresql": "UPDATE policy SET holder = holder WHERE policy_id = :policy_id"
                       " AND (SELECT count(*) FROM pg_sleep(:seconds)) = 1",
         "mariadb": "UPDATE policy SET holder = holder WHERE policy_id = :policy_id"
                    " AND SLEEP(:seconds) = 0"}
"""A write that sleeps while it holds the row: a read or a check may not sleep (CG139)."""


# The server's clock when the row lock was granted, read by the statement that waited
# for it -- not by this process after the reply, which a loaded CPU can delay.
# PostgreSQL computes RETURNING after the row is locked; MariaDB evaluates the select
# list of a locking read after InnoDB hands it the row, and SYSDATE(6) is the time of
# evaluation (NOW() would be the statement's start).
_GRANTED_AT = {
    "postgresql": ("UPDATE policy SET holder = holder WHERE policy_id = 1"
                   " RETURNING extract(epoch FROM clock_timestamp())"),
    "mariadb": ("SELECT UNIX_TIMESTAMP(SYSDATE(6)) FROM policy WHERE policy_id = 1"
                " FOR UPDATE"),
}


def _second_writer(url: URL, result: dict[str, float]) -> None:
    """Wait (up to 20 s) for the policy row's lock; note the wall time it was granted."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if _engine_name(url) == "postgresql":
                conn.execute(sa.text("SET lock_timeout = '20s'"))
            else:
                conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 20"))
            granted = conn.execute(sa.text(_GRANTED_AT[_engine_name(url)])).scalar_one()
            result["granted"] = float(granted)
            conn.rollback()
    finally:
        engine.dispose()


def _statement_running(url: URL, needle: str) -> bool:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if _engine_name(url) == "postgresql":
                sql = ("SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                       " AND application_name LIKE 'capgate %' AND query LIKE :q")
            else:
                sql = ("SELECT count(*) FROM information_schema.PROCESSLIST"
                       " WHERE ID <> CONNECTION_ID() AND INFO LIKE '%capgate%'"
                       " AND INFO LIKE :q")
            return bool(conn.execute(sa.text(sql), {"q": f"%{needle}%"}).scalar())
    finally:
        engine.dispose()


@pytest.mark.crash
@pytest.mark.parametrize("operation", ["test.lock_then_wait", "test.lease_then_wait"])
@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_a_stopped_executor_loses_its_locks_by_the_deadline(
        server_url: URL, operation: str, when: str, gate: Callable[..., Executor],
        tmp_path: Path) -> None:
    """Item 13: SIGSTOP before, during or after a statement; the lock goes by the deadline
    plus the engine's bound (``Dialect.locks_gone_after_deadline``: 1 s on PostgreSQL,
    0.9 s on MariaDB, whose idle timeout counts whole seconds)."""
    import datetime as dt
    import json
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from tests.crash_child import ROOT

    engine_name = _engine_name(server_url)
    caps = tmp_path / "slow.yaml"
    caps.write_text(SLOW_ROWS.format(sleep=SLEEP[engine_name]), "utf-8")
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(server_url, ledger)
    case = f"HUNG-{when}"
    spec = {"target": server_url.render_as_string(hide_password=False), "ledger": ledger,
            "operation": operation, "inputs": {"policy_id": 1, "seconds": 2.0},
            "case": case, "who": "agent", "out": str(tmp_path / "out.json"),
            "capabilities": [str(caps)],
            "stop_at": {"before": "after_attempt_started", "after": "before_commit"}.get(when)}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-m", "tests.crash_child", json.dumps(spec)],
                             cwd=ROOT, env=env)
    try:
        if when == "during":  # stop it while its slow statement runs on the server
            needle = "pg_sleep" if engine_name == "postgresql" else "SLEEP("
            for _ in range(400):
                if _statement_running(server_url, needle):
                    break
                time.sleep(0.025)
            time.sleep(0.2)
            os.kill(child.pid, signal.SIGSTOP)
        else:  # the child stops itself at the boundary
            for _ in range(800):
                with open(f"/proc/{child.pid}/stat") as fh:
                    if fh.read().split(") ", 1)[1].startswith("T"):
                        break
                time.sleep(0.025)
        # the attempt's start: on `attempt_started`, or (a collapsed call's first attempt,
        # issue 13) on `prepared`, which records the attempt with the intent
        state = next(s for s in ex.ledger.events(case)
                     if "started_at" in (s.payload.get("state") or {}))
        started = dt.datetime.fromisoformat(state.payload["state"]["started_at"]).timestamp()
        deadline = started + 3.0
        granted: dict[str, float] = {}
        writer = threading.Thread(target=_second_writer, args=(server_url, granted))
        writer.start()
        writer.join(30)
        assert "granted" in granted, "the lock was never released"
        overrun = granted["granted"] - deadline
        bound = dialect_for(server_url).locks_gone_after_deadline()
        assert overrun <= bound, (f"the lock was held {overrun:.2f} s past the deadline"
                                  f" (bound {bound:.2f} s)")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)


def test_the_lease_sweeper_waits_longer_than_any_engine_keeps_a_stopped_lock() -> None:
    """A lease the sweeper calls expired must have lost its locks already (item 13)."""
    from capgate.executor.dialects import dialect_classes
    from capgate.executor.lease import SWEEP_MARGIN_SECONDS

    bounds = {cls.name: cls.locks_gone_after_deadline() for cls in dialect_classes()}
    # MariaDB's idle timeout counts whole seconds (1 s, not 0.75 s): its statements carry
    # their own timeout and end 0.1 s early, so both engines hold a stopped lock <= 1 s
    assert bounds["postgresql"] <= 1.0 and bounds["mariadb"] <= 1.0, bounds
    assert all(bound < SWEEP_MARGIN_SECONDS for bound in bounds.values()), bounds


# --- item 2: `compensated` only when the compensation ran and the restored state says so -----

CHECKED_NOTE = """
format: 1
connectors: {{insurance: {{}}}}
rows:
  - operation_id: test.checked_note
    version: 1
    connector: insurance
    description: A note whose post-commit check always fails (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id, body]
      properties: {{policy_id: {{type: integer}}, body: {{type: string, maxLength: 200}}}}
    target: {{system: insurance, object: policy_note, keys: [policy_id]}}
    effect_class: compensable
    shape: collapsed
    authorization: {{kind: write_grant}}
    environments: [dev]
    idempotency_key: "{{case}}:{{policy_id}}:{{body}}"
    timeout: {{seconds: 5, on_timeout: rolled_back}}
    recovery: reconcile_first
    statements:
      - {{sql: "INSERT INTO policy_note (policy_id, author, body) VALUES (:policy_id, 'qa', :body)",
         expect_rows: 1}}
    post_commit:
      - {{name: seen_twice, sql: "SELECT count(*) FROM policy_note WHERE body = :body",
         expect: {{value: 2}}}}
    compensation:
      - {{sql: "{compensation}", expect_rows: 1}}
    compensation_verify:
      - {{name: gone, sql: "SELECT count(*) FROM policy_note WHERE body = :body",
         expect: {{value: 0}}}}
"""
UNDO = "DELETE FROM policy_note WHERE body = :body"
NO_UNDO = "UPDATE policy_note SET author = author WHERE body = :body"


def _with_rows(ex: Executor, text: str) -> Executor:
    from capgate.registry.loader import validate_texts
    from capgate.registry.registry import Registry

    result = validate_texts([("extra.yaml", text)])
    result.raise_for_problems()
    return Executor(Registry([*ex.registry.rows(include_retired=True), *result.rows]),
                    ex.connectors, ex.ledger, ex.grants)


def _notes_with(ex: Executor, body: str) -> int:
    rows = table_dump(ex.connectors.get("insurance").engine.url, "policy_note")
    return sum(1 for row in rows if body in row)


def test_a_restored_compensation_is_compensated_and_recorded_so(executor: Executor) -> None:
    """Item 2: compensation ran, the re-read confirms: `compensated`, also on replay."""
    ex = _with_rows(executor, CHECKED_NOTE.format(compensation=UNDO))
    body = f"undone {uuid.uuid4().hex[:8]}"
    out = ex.call("test.checked_note", {"policy_id": 1, "body": body}, case="C-comp",
                  who="agent")
    assert out.status == "compensated", out.reason
    assert out.reason is not None and out.reason["restored_checks"][0]["ok"] is True
    assert _notes_with(ex, body) == 0
    again = ex.call("test.checked_note", {"policy_id": 1, "body": body}, case="C-comp",
                    who="agent")
    assert again.replayed and again.status == "compensated"  # never applied_verified
    assert not ex.ledger.cases(open_only=True)
    assert ex.ledger.verify().ok


def test_an_unconfirmed_compensation_escalates(executor: Executor) -> None:
    """Item 2: the compensation committed, the restored state is not there: escalated."""
    ex = _with_rows(executor, CHECKED_NOTE.format(compensation=NO_UNDO))
    body = f"not undone {uuid.uuid4().hex[:8]}"
    out = ex.call("test.checked_note", {"policy_id": 1, "body": body}, case="C-nocomp",
                  who="agent")
    assert out.status == "compensation_failed", out.reason
    assert out.reason is not None and out.reason["restored_checks"][0]["ok"] is False
    assert _notes_with(ex, body) == 1  # the write is still there, and it says so
    [case] = ex.ledger.cases(open_only=True)
    assert case.case_id == "C-nocomp"  # escalated: a person decides
    again = ex.call("test.checked_note", {"policy_id": 1, "body": body}, case="C-nocomp",
                    who="agent")
    assert again.replayed and again.status == "compensation_failed"


def test_a_row_without_compensation_never_claims_compensated(executor: Executor) -> None:
    """Item 2: a post-commit failure with nothing to compensate is never `compensated`."""
    import dataclasses

    ex = _with_rows(executor, CHECKED_NOTE.format(compensation=UNDO))
    row = ex.registry.resolve("test.checked_note")
    bare = dataclasses.replace(row, compensation=(), compensation_verify=())  # built in code
    from capgate.registry.registry import Registry

    ex.registry = Registry([r for r in ex.registry.rows(include_retired=True)
                            if r.operation_id != "test.checked_note"] + [bare])
    body = f"nothing to undo {uuid.uuid4().hex[:8]}"
    out = ex.call("test.checked_note", {"policy_id": 1, "body": body}, case="C-bare",
                  who="agent")
    assert out.status == "compensation_failed", out.reason
    assert _notes_with(ex, body) == 1


# --- items 3 and 4: approvals bind case and requester, and are authenticated ----------------

PURGE = {"policy_id": 9}


def _plan_needed(ex: Executor, case: str, who: str = "agent") -> str:
    with pytest.raises(errors.ApprovalRequired) as info:
        ex.call("policy.purge_orphan", PURGE, case=case, who=who)
    return str(info.value.details["plan_hash"])


def test_an_approval_is_worth_nothing_in_another_case_or_to_another_identity(
        executor: Executor) -> None:
    """Item 3: an approval binds the case and the requester of the plan."""
    from tests.fix_capgate import KEYS

    url = executor.connectors.get("insurance").engine.url
    before = table_dump(url, "policy")
    plan_a = _plan_needed(executor, "C-A")
    executor.approve(plan_a, by="bob", role="dba", key=KEYS["bob"])
    # the same request in case B, by the same agent: its own plan, its own approval needed
    plan_b = _plan_needed(executor, "C-B")
    assert plan_b != plan_a
    # the same request in case A by another identity: likewise
    plan_other = _plan_needed(executor, "C-A", who="other-agent")
    assert plan_other not in (plan_a, plan_b)
    with pytest.raises(errors.ApprovalMismatch):  # pinning A's plan does not help
        executor.call("policy.purge_orphan", PURGE, case="C-B", who="agent", plan_hash=plan_a)
    assert table_dump(url, "policy") == before
    out = executor.call("policy.purge_orphan", PURGE, case="C-A", who="agent")
    assert out.status == "applied_verified", out.reason


def test_approval_required_in_one_case_claims_nothing_for_another(executor: Executor) -> None:
    """Item 3: approval_required in case A leaves nothing that refuses case B (was CG301)."""
    _plan_needed(executor, "C-first")
    with pytest.raises(errors.ApprovalRequired):  # not IdempotencyConflict
        executor.call("policy.purge_orphan", PURGE, case="C-second", who="agent")
    assert executor.ledger.snapshot("C-first") is None  # nothing recorded for the refusal
    assert executor.ledger.get_idempotency("policy.purge_orphan:9") is None


def test_a_name_alone_approves_nothing(executor: Executor, tmp_path: Path) -> None:
    """Item 4: approving in another's name, or with no key, is refused (CG208 / CG900)."""
    from capgate.executor.approvals import generate, load_signing_key
    from tests.fix_capgate import KEYS

    plan = _plan_needed(executor, "C-name")
    with pytest.raises(errors.ApprovalNotAuthenticated):  # bob's key, alice's name
        executor.approve(plan, by="alice", role="dba", key=KEYS["bob"])
    mine = load_signing_key(tmp_path / "mallory.key") if generate(tmp_path / "mallory.key") \
        else None
    assert mine is not None
    with pytest.raises(errors.ApprovalNotAuthenticated):  # a key nobody registered
        executor.approve(plan, by="bob", role="dba", key=mine)
    with pytest.raises(errors.UsageError):
        load_signing_key(None)  # `capgate approve` without --key (and no env)
    assert executor.ledger.approvals_for(plan) == []


def _forge(ex: Executor, plan_hash: str, approver: str, role: str) -> str:
    """An approval row written straight into the store, as an agent with its credentials could."""
    import datetime as dt

    from capgate.executor.ledger.schema import approvals

    approval_id = "apr_" + uuid.uuid4().hex
    now = dt.datetime.now(dt.UTC)
    with ex.ledger.engine.begin() as conn:
        conn.execute(sa.insert(approvals).values(
            approval_id=approval_id, plan_hash=plan_hash, approver=approver, role=role,
            created_at=now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            expires_at=(now + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            used_by_intent=None, used_at=None))
    return approval_id


def test_a_forged_or_altered_approval_is_refused_when_consumed(executor: Executor) -> None:
    """Item 4: the signature is re-checked when the approval is consumed."""
    import datetime as dt

    from capgate.executor.ledger.schema import approvals
    from tests.fix_capgate import KEYS

    url = executor.connectors.get("insurance").engine.url
    before = table_dump(url, "policy")
    plan = _plan_needed(executor, "C-forged")
    _forge(executor, plan, "bob", "dba")
    with pytest.raises(errors.ApprovalNotAuthenticated) as info:
        executor.call("policy.purge_orphan", PURGE, case="C-forged", who="agent")
    assert "not signed" in info.value.message
    # a real approval, then its expiry pushed out by hand: the signature no longer holds
    real = executor.approve(plan, by="bob", role="dba", key=KEYS["bob"], ttl_seconds=60)
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    with executor.ledger.engine.begin() as conn:
        conn.execute(sa.update(approvals).where(approvals.c.approval_id == real["approval_id"])
                     .values(expires_at=later))
    with pytest.raises(errors.ApprovalNotAuthenticated) as info:
        executor.call("policy.purge_orphan", PURGE, case="C-forged", who="agent")
    assert "does not verify" in info.value.message
    assert table_dump(url, "policy") == before
    assert not (executor.ledger.snapshot("C-forged") or {}).get("intents")  # no intent at all


def test_an_approval_whose_key_was_withdrawn_is_refused(executor: Executor) -> None:
    """Item 4: consumption checks the grants as they are now, not as they were."""
    from capgate.executor.grants import Grants, Principal
    from tests.fix_capgate import KEYS

    plan = _plan_needed(executor, "C-withdrawn")
    executor.approve(plan, by="bob", role="dba", key=KEYS["bob"])
    principals = dict(executor.grants.principals)
    principals["bob"] = Principal("bob", ("dba",), (), None)  # the key was withdrawn
    executor.grants = Grants(principals, "tests (bob's key withdrawn)")
    with pytest.raises(errors.ApprovalNotAuthenticated) as info:
        executor.call("policy.purge_orphan", PURGE, case="C-withdrawn", who="agent")
    assert "no approval_key" in info.value.message


@pytest.mark.crash
def test_a_resumed_retry_rechecks_its_approval_and_grants(
        target_url: URL, gate: Callable[..., Executor], zygote: Zygote, tmp_path: Path) -> None:
    """Item 3: resume re-checks the approval a retry relies on, and the caller's grants."""
    from capgate.executor.grants import Grants, Principal
    from tests.fix_capgate import KEYS

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(target_url, ledger)
    plan = _plan_needed(ex, "C-resume-gate")
    ex.approve(plan, by="bob", role="dba", key=KEYS["bob"])
    ended = zygote.run({"target": target_url.render_as_string(hide_password=False),
                        "ledger": ledger, "operation": "policy.purge_orphan", "inputs": PURGE,
                        "case": "C-resume-gate", "who": "agent",
                        "out": str(tmp_path / "out.json"), "crash_at": "after_prepared"})
    assert ended.killed, ended
    principals = dict(ex.grants.principals)
    principals["bob"] = Principal("bob", (), (), principals["bob"].approval_key)  # lost dba
    ex.grants = Grants(principals, "tests (bob lost dba)")
    report = resume(ex, "C-resume-gate")
    (only,) = report.intents
    assert only.action == "escalated" and "CG208" in only.detail, only
    assert any(r for r in table_dump(target_url, "policy") if r[0] == 9), "nothing ran"


# --- item 5: a rehearsal on staging or prod is a gated simulation, and every one is recorded --


def test_a_rehearsal_on_prod_is_a_gated_simulation(target_url: URL, gate: Callable[..., Executor],
                                                   tmp_path: Path) -> None:
    """Item 5: no approval, nothing sent; approved once by another, it runs and is recorded."""
    from capgate.executor.rehearse import rehearse
    from tests.fix_capgate import KEYS

    ex = gate(target_url, environment="prod", simulation_approver_roles=("dba",))
    sent = _sent_sql(ex.connectors.get("insurance").engine)
    with pytest.raises(errors.ApprovalRequired) as info:
        rehearse(ex, who="agent", connectors=["insurance"], case="REH-1")
    assert sent == [], "a statement reached the prod target before the approval"
    plan = info.value.details["plan_hash"]
    assert info.value.details["approver_roles"] == ["dba"]
    with pytest.raises(errors.UsageError):  # prod needs a named case
        rehearse(ex, who="agent", connectors=["insurance"])
    with pytest.raises(errors.SelfApproval):  # never the requester
        ex.approve(_requested_by_alice(ex), by="alice", role="dba", key=KEYS["alice"])
    ex.approve(plan, by="bob", role="dba", key=KEYS["bob"])
    report = rehearse(ex, who="agent", connectors=["insurance"], case="REH-1")
    assert report.ok, report.table()
    kinds = [e.kind for e in ex.ledger.events("REH-1")]
    assert kinds[0] == "approval_recorded" and kinds[1] == "rehearsal_started"
    assert kinds[-1] == "rehearsal_finished"
    started = ex.ledger.events("REH-1")[1].payload
    assert started["who"] == "agent" and started["approvals"][0]["approver"] == "bob"
    recorded = [e.payload for e in ex.ledger.events("REH-1") if e.kind == "rehearsed"]
    assert len(recorded) == len(report.results)
    assert all("counts" in r and "outcome" in r for r in recorded)
    with pytest.raises(errors.ApprovalUsed):  # the approval was single use
        rehearse(ex, who="agent", connectors=["insurance"], case="REH-1")


def _requested_by_alice(ex: Executor) -> str:
    from capgate.executor.rehearse import rehearse

    with pytest.raises(errors.ApprovalRequired) as info:
        rehearse(ex, who="alice", connectors=["insurance"], case="REH-alice")
    return str(info.value.details["plan_hash"])


def test_every_rehearsal_is_recorded(executor: Executor) -> None:
    """Item 5: a dev rehearsal needs no approval, and is recorded all the same."""
    from capgate.executor.rehearse import rehearse

    report = rehearse(executor, who="agent", connectors=["insurance"],
                      operations=["policy.add_note"])
    assert report.ok, report.table()
    case = f"rehearse-{report.run_id}"
    events = executor.ledger.events(case)
    assert events[0].kind == "rehearsal_started"
    assert events[-1].payload["tally"]["passed"] == report.tally()["passed"]
    assert executor.ledger.verify(case).ok


# --- item 6: a dry run writes nothing and kills nothing ---------------------------------------


def _session_alive(url: URL, tx: dict[str, Any]) -> bool:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if _engine_name(url) == "postgresql":
                return bool(conn.execute(sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                    {"p": int(tx["pid"])}).scalar())
            return bool(conn.execute(sa.text(
                "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = :i"),
                {"i": int(tx["connection_id"])}).scalar())
    finally:
        engine.dispose()


@pytest.mark.crash
def test_a_dry_run_resume_kills_no_session(server_url: URL, gate: Callable[..., Executor],
                                           zygote: Zygote, tmp_path: Path) -> None:
    """Item 6: `resume --dry-run` leaves a live (stopped) session alone and records nothing."""
    from capgate.cli import main

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(server_url, ledger)
    case = "DRY-RUN"
    ended = zygote.run({"target": server_url.render_as_string(hide_password=False),
                        "ledger": ledger, "operation": "policy.add_note",
                        "inputs": {**NOTE, "body": "dry run"}, "case": case, "who": "agent",
                        "out": str(tmp_path / "out.json"), "stop_at": "before_commit",
                        # the session must outlive the CLI's start: not the server's
                        # sub-second idle timeout, only resume could end it early
                        "idle_grace_seconds": 30})
    assert ended.stopped, ended
    try:
        (state,) = ex.ledger.snapshot(case)["intents"].values()  # type: ignore[index]
        tx = state["tx"]
        before = len(ex.ledger.events(case))
        config = tmp_path / "capgate.toml"
        config.write_text(
            f'[capgate]\nledger = "{ledger}"\ncapabilities = ["{CAPABILITIES_DIR}"]\n'
            f'[connectors.insurance]\nurl = "{server_url.render_as_string(hide_password=False)}"'
            '\nenvironment = "dev"\n')
        code = main(["resume", case, "--dry-run", "--wait", "0.3", "--json",
                     "--config", str(config)])
        assert code == errors.EXIT_UNKNOWN  # unknown while the session may still commit
        assert _session_alive(server_url, tx), "a dry run terminated the recorded session"
        assert len(ex.ledger.events(case)) == before, "a dry run recorded something"
    finally:
        zygote.kill(ended.pid)


CAPABILITIES_DIR = str(Path(__file__).resolve().parent.parent / "capabilities")


# --- item 7: an unreachable database is a coded refusal that leaves nothing open --------------


def _unreachable(ex: Executor) -> Executor:
    """The same executor, its connectors pointed at a port where nothing listens."""
    from capgate.executor.connectors import ConnectorConfig, Connectors

    configs = {name: ConnectorConfig(name=name, url="postgresql://nobody@127.0.0.1:9/none",
                                     environment="dev")
               for name in ("insurance", "insurance_code")}
    return Executor(ex.registry, Connectors(configs), ex.ledger, ex.grants)


def test_a_read_against_an_unreachable_database_leaves_nothing_open(executor: Executor,
                                                                   tmp_path: Path) -> None:
    """Item 7: CG304 (exit 1), --json honoured, no open intent; the case goes on."""
    import json

    from capgate.cli import main

    down = _unreachable(executor)
    with pytest.raises(errors.ConnectorUnavailable) as info:
        down.call("policy.get", {"policy_id": 1}, case="C-down", who="agent")
    assert info.value.exit_code == errors.EXIT_REFUSED
    with pytest.raises(errors.ConnectorUnavailable):
        down.call("policy.add_note", NOTE, case="C-down", who="agent")
    assert not executor.ledger.cases(open_only=True)
    out = executor.call("policy.get", {"policy_id": 1}, case="C-down", who="agent")
    assert out.status == "ok"  # nothing left to resume
    config = tmp_path / "capgate.toml"
    (tmp_path / "grants.toml").write_text(
        '[principals.agent]\ngrants = [{ connector = "*", environments = ["dev"], '
        'access = "write" }]\n')
    ledger = executor.ledger.engine.url.render_as_string(hide_password=False)
    config.write_text(f'[capgate]\nledger = "{ledger}"\ngrants = "grants.toml"\n'
                      f'capabilities = ["{CAPABILITIES_DIR}"]\n'
                      '[connectors.insurance]\nurl = "postgresql://nobody@127.0.0.1:9/none"\n'
                      'environment = "dev"\n')
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["call", "policy.get", "--input", '{"policy_id": 1}', "--case", "C-cli",
                     "--as", "agent", "--json", "--config", str(config)])
    assert code == errors.EXIT_REFUSED
    assert json.loads(buf.getvalue())["code"] == "CG304"


def test_a_write_whose_connection_fails_before_sending_is_rolled_back(
        executor: Executor) -> None:
    """Item 7: the connection fails before any statement: not applied, exit 1, nothing open.

    A collapsed call opens its transaction before it prepares (issue 13), so it is
    refused with nothing recorded; a leased call prepares first, and then records
    the rollback with the reason.
    """
    from capgate.executor.connectors import Connector

    connector = executor.connectors.get("insurance")
    connector.check_target()  # passed once; now the database goes away
    real_engine = connector.engine
    connector.engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:9/none")
    try:
        with pytest.raises(errors.ConnectorUnavailable) as refused:
            executor.call("policy.add_note", {**NOTE, "body": "never sent"}, case="C-cut",
                          who="agent")
        out = executor.call("policy.cancel", {"policy_id": 1, "cancel_date": "2024-08-15",
                                              "author": "jdoe", "reason": "never sent"},
                            case="C-cut-lease", who="agent")
    finally:
        connector.engine.dispose()
        connector.engine = real_engine
    assert isinstance(connector, Connector)
    assert refused.value.exit_code == errors.EXIT_REFUSED
    assert executor.ledger.snapshot("C-cut") is None, "nothing recorded"
    assert out.status == "rolled_back" and out.exit_code == errors.EXIT_REFUSED
    assert out.reason is not None and out.reason["kind"] == "connection_failed"
    assert not executor.ledger.cases(open_only=True), "nothing left open"


def test_rehearse_against_an_unreachable_target_is_coded(executor: Executor) -> None:
    """Item 16: `rehearse` on a database that does not answer: CG304, nothing recorded."""
    from capgate.executor.rehearse import rehearse

    with pytest.raises(errors.ConnectorUnavailable):
        rehearse(_unreachable(executor), who="agent", connectors=["insurance"], case="R-down")


# --- items 8, 9, 16: inputs at every limit are coded refusals that record nothing -------------


def _refused_before_recording(ex: Executor, inputs: dict[str, Any], case: str,
                              operation: str = "policy.add_note") -> errors.CapgateError:
    with pytest.raises(errors.CapgateError) as info:
        ex.call(operation, inputs, case=case, who="agent")
    assert ex.ledger.snapshot(case) is None, "a refusal recorded something"
    return info.value


def test_integers_beyond_2_53_are_invalid_input(executor: Executor) -> None:
    """Item 8: an integer the canonical JSON layer cannot represent exactly: CG300, exit 1."""
    for big in (2**53, -(2**53), 10**30):
        refused = _refused_before_recording(executor, {**NOTE, "policy_id": big}, "C-big")
        assert refused.code == "CG300" and refused.exit_code == errors.EXIT_REFUSED
        assert refused.details["field"] == "policy_id"
        assert "2^53" in refused.message
    ok = executor.call("policy.add_note", {**NOTE, "policy_id": 1}, case="C-big", who="agent")
    assert ok.status == "applied_verified"


def test_refusals_quote_bounded_excerpts(executor: Executor) -> None:
    """Item 9: a 2.6 MB body is refused with an excerpt and its length, never echoed whole."""
    import json

    from capgate.mcp_server import refusal

    body = "x" * 2_600_000
    executor.max_request_bytes = 50_000_000  # past the size limit: the contract's maxLength
    refused = _refused_before_recording(executor, {**NOTE, "body": body}, "C-huge")
    assert refused.code == "CG300"
    assert "2600000 characters" in refused.message
    text = json.dumps(refused.to_dict())
    assert len(text) < 10_000, len(text)
    row = executor.registry.resolve("policy.add_note")
    reply = json.dumps(refusal(row, "C-huge", refused))
    assert len(reply) < 10_000, len(reply)


def test_inputs_that_would_crash_the_record_are_refused(executor: Executor) -> None:
    """Item 16: a lone surrogate, 100,000-deep nesting: coded refusals, nothing recorded."""
    surrogate = _refused_before_recording(executor, {**NOTE, "body": "\ud800"}, "C-sur")
    assert surrogate.code == "CG300" and surrogate.details["field"] == "body"
    deep: Any = "leaf"
    for _ in range(100_000):
        deep = [deep]
    nested = _refused_before_recording(executor, {**NOTE, "body": deep}, "C-deep")
    assert nested.code == "CG300"


def test_a_request_over_the_configured_size_is_refused(executor: Executor) -> None:
    """Item 16: a 10 MB input on a row without a length bound: CG307, the ledger untouched."""
    import os

    from capgate.executor.ledger.schema import events

    def ledger_rows() -> int:
        with executor.ledger.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(events)).scalar_one())

    ex = _with_rows(executor, CHECKED_NOTE.format(compensation=UNDO).replace(
        "body: {type: string, maxLength: 200}", "body: {type: string}"))
    before = ledger_rows()
    size = os.path.getsize(executor.ledger.url.split("///", 1)[1]) \
        if executor.ledger.backend == "sqlite" else None
    refused = _refused_before_recording(ex, {"policy_id": 1, "body": "y" * 10_000_000},
                                        "C-10mb", operation="test.checked_note")
    assert refused.code == "CG307" and refused.details["size"] > refused.details["limit"]
    assert ledger_rows() == before
    if size is not None:
        assert os.path.getsize(executor.ledger.url.split("///", 1)[1]) < size + 1_000_000


def test_validate_warns_on_unbounded_string_inputs() -> None:
    """Item 16: `validate` names each write input without a declared length (CG160)."""
    from capgate.registry.loader import validate_texts

    result = validate_texts([("u.yaml", CHECKED_NOTE.format(compensation=UNDO).replace(
        "body: {type: string, maxLength: 200}", "body: {type: string}"))])
    assert result.ok
    assert [(w.code, w.field) for w in result.warnings] == [
        ("CG160", "input.properties.body")]


def test_cli_inputs_at_the_limits_are_usage_errors(tmp_path: Path) -> None:
    """Item 16: a missing @file and JSON nested 100,000 deep are CG900 (exit 2), not bugs;
    so is an object naming a key twice (JSON leaves it to the reader, Python keeps the
    last: the request read on the command line would not be the one that ran)."""
    import contextlib
    import io
    import json

    from capgate.cli import main

    config = tmp_path / "capgate.toml"
    config.write_text(f'[capgate]\nledger = "sqlite:///{tmp_path / "l.db"}"\n'
                      f'capabilities = ["{CAPABILITIES_DIR}"]\n'
                      f'[connectors.insurance]\nurl = "sqlite:///{tmp_path / "t.db"}"\n'
                      'environment = "dev"\n')
    duplicated = tmp_path / "twice.json"
    duplicated.write_text('{"policy_id": 1, "nested": {"a": 1, "a": 2}}', "utf-8")
    for raw in (f"@{tmp_path / 'missing.json'}", "[" * 100_000 + "]" * 100_000,
                '{"policy_id": 1, "policy_id": 2}', f"@{duplicated}"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["call", "policy.get", "--input", raw, "--case", "C-cli", "--as",
                         "agent", "--json", "--config", str(config)])
        assert code == errors.EXIT_USAGE, out.getvalue()
        assert json.loads(out.getvalue())["code"] == "CG900"
        if "twice" in raw or raw.startswith("{"):
            assert "twice" in json.loads(out.getvalue())["message"], out.getvalue()
    assert not (tmp_path / "l.db").exists() or True


# --- item 17: the declared effect-of-timeout decides the executor's next action ---------------

TIMEOUT_ROWS = """
format: 1
connectors: {insurance: {}}
rows:
  - operation_id: test.retry_touch
    version: 1
    connector: insurance
    description: Touch a policy; a lock timeout is retried once (test-only).
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
    timeout: {seconds: 5, lock_seconds: 1, on_timeout: rolled_back, attempts: 2}
    recovery: retryable
    statements:
      - {sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id", expect_rows: 1}
  - operation_id: test.unknown_note
    version: 1
    connector: insurance
    description: Touch a policy, then note it; its timeout leaves the outcome unknown.
    input:
      type: object
      additionalProperties: false
      required: [policy_id, body]
      properties: {policy_id: {type: integer}, body: {type: string, maxLength: 80}}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: irreversible
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{policy_id}:{body}"
    timeout: {seconds: 5, lock_seconds: 1, on_timeout: unknown}
    recovery: reconcile_first
    statements:
      - {sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id", expect_rows: 1}
      - {sql: "INSERT INTO policy_note (policy_id, author, body) VALUES (:policy_id, 'qa', :body)",
         expect_rows: 1}
    landed_probe:
      sql: "SELECT count(*) FROM policy_note WHERE body = :body"
      expect: {value: 1}
"""


@contextlib.contextmanager
def _holding_policy_1(url: URL) -> Iterator[sa.Connection]:
    """Another session holds policy 1's row lock (SQLite: the database's write lock)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    conn = engine.connect()
    try:
        if url.get_backend_name() == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.execute(sa.text("UPDATE policy SET holder = holder WHERE policy_id = 1"))
        yield conn
    finally:
        with contextlib.suppress(sa.exc.DBAPIError):
            conn.rollback()
        conn.close()
        engine.dispose()


def test_a_timed_out_safe_retryable_row_is_attempted_again(executor: Executor) -> None:
    """Item 17: rolled back, retryable, safe to repeat, 2 attempts: retried at once, recorded."""
    import threading
    import time

    ex = _with_rows(executor, TIMEOUT_ROWS)
    url = ex.connectors.get("insurance").engine.url
    with _holding_policy_1(url) as holder:
        def release_after_first_attempt() -> None:  # once the retry is recorded, let it in
            for _ in range(1000):
                kinds = {e.kind for e in ex.ledger.events("C-retry")} \
                    if ex.ledger.snapshot("C-retry") else set()
                if "retrying" in kinds:
                    break
                time.sleep(0.01)
            holder.rollback()

        releaser = threading.Thread(target=release_after_first_attempt)
        releaser.start()
        out = ex.call("test.retry_touch", {"policy_id": 1}, case="C-retry", who="agent")
        releaser.join(30)
    assert out.status == "applied_verified", out.reason
    assert out.attempt == 2
    kinds = [e.kind for e in ex.ledger.events("C-retry")]
    # (SQLite: the lock is the database's, attempt 1 never began; the others: attempt 1
    # began and is recorded with the intent, issue 13 -- either way one `prepared`)
    assert kinds == ["prepared", "retrying", "attempt_started", "observed"]
    first = ex.ledger.events("C-retry")[0].payload["state"]
    assert first["attempt"] == (0 if url.get_backend_name() == "sqlite" else 1)
    retry = next(e for e in ex.ledger.events("C-retry") if e.kind == "retrying")
    assert retry.payload["state"]["contract"]["cause"] == "timeout"


def test_attempts_spent_record_the_rollback_with_its_contract(executor: Executor) -> None:
    """Item 17: when the row's attempts are spent the rollback is the recorded outcome."""
    ex = _with_rows(executor, TIMEOUT_ROWS)
    url = ex.connectors.get("insurance").engine.url
    with _holding_policy_1(url):
        out = ex.call("test.retry_touch", {"policy_id": 1}, case="C-spent", who="agent")
    assert out.status == "rolled_back" and out.attempt == 2
    assert out.reason is not None and out.reason["contract"]["action"] == "record"
    assert not ex.ledger.cases(open_only=True)


def test_an_unknown_timeout_becomes_a_reconciliation_task(executor: Executor) -> None:
    """Item 17: on_timeout unknown: the case is held until resume establishes what landed."""
    ex = _with_rows(executor, TIMEOUT_ROWS)
    url = ex.connectors.get("insurance").engine.url
    inputs = {"policy_id": 1, "body": f"maybe {uuid.uuid4().hex[:6]}"}
    with _holding_policy_1(url), pytest.raises(errors.ReconciliationRequired) as info:
        ex.call("test.unknown_note", inputs, case="C-unknown", who="agent")
    assert info.value.details["contract"]["action"] == "reconcile"
    (state,) = ex.ledger.snapshot("C-unknown")["intents"].values()  # type: ignore[index]
    assert state["status"] == "reconciliation_task"
    with pytest.raises(errors.ReconciliationRequired):  # the case is held
        ex.call("policy.add_note", NOTE, case="C-unknown", who="agent")
    report = resume(ex, "C-unknown")
    (only,) = report.intents
    assert only.classification == "not_applied" and only.outcome == "applied_verified", only
    assert _notes_with(ex, inputs["body"]) == 1


def test_the_review_card_and_tool_say_what_a_timeout_means() -> None:
    """Item 17: one line, in the card and in the MCP tool description."""
    from capgate.mcp_server import description_for
    from capgate.registry.loader import validate_texts
    from capgate.registry.review import card

    result = validate_texts([("t.yaml", TIMEOUT_ROWS)])
    result.raise_for_problems()
    retry, unknown = sorted(result.rows, key=lambda r: r.operation_id)
    assert "attempted again at once with the same key (up to 2 attempts)" in card(retry)
    assert "the case is held until `capgate resume`" in card(unknown)
    assert "Timeout: after 5 s (or a lost connection) the outcome is unknown" in \
        description_for(unknown, "insurance", "dev")


# --- item 15: a caller key is refused unless the row accepts one, then combined --------------


def test_a_caller_key_never_replaces_the_reviewed_key(executor: Executor) -> None:
    """Item 15: `--key` on a row that does not accept one is CG308 and records nothing."""
    with pytest.raises(errors.CallerKeyRefused) as info:
        executor.call("policy.add_note", NOTE, case="C-key", who="agent", key="mine-1")
    assert info.value.code == "CG308"
    assert executor.ledger.snapshot("C-key") is None
    for _ in range(3):  # the row's own key allows one comment, whatever the caller says
        executor.call("policy.add_note", NOTE, case="C-key", who="agent")
    assert _notes_with(executor, NOTE["body"]) == 1


def test_an_accepted_caller_key_is_combined_with_the_row_key(executor: Executor) -> None:
    """Item 15: where the row accepts one, the caller key refines the reviewed key."""
    text = CHECKED_NOTE.format(compensation=UNDO).replace(
        "    post_commit:", "    accepts_caller_key: true\n    post_commit:").replace(
        "expect: {value: 2}", "expect: {value: 1}")
    ex = _with_rows(executor, text)
    body = f"keyed {uuid.uuid4().hex[:6]}"
    first = ex.call("test.checked_note", {"policy_id": 1, "body": body}, case="C-ck",
                    who="agent", key="attempt-a")
    assert first.status == "applied_verified", first.reason
    assert first.idempotency_key == f"C-ck:1:{body}|caller:attempt-a"
    again = ex.call("test.checked_note", {"policy_id": 1, "body": body}, case="C-ck",
                    who="agent", key="attempt-a")
    assert again.replayed and again.intent_id == first.intent_id
    other_case = ex.call("test.checked_note", {"policy_id": 1, "body": body + "2"},
                         case="C-ck2", who="agent", key="attempt-a")
    assert other_case.idempotency_key.startswith("C-ck2:")  # type: ignore[union-attr]


# --- item 11: a user's mistake is never an internal error -------------------------------------


def test_user_mistakes_are_coded_never_internal(tmp_path: Path) -> None:
    """Item 11: every mistake below is a CapgateError with its code; none is CG999 (exit 5)."""
    import contextlib
    import io
    import json

    from capgate.cli import main

    db = tmp_path / "t.db"
    config = tmp_path / "capgate.toml"
    (tmp_path / "grants.toml").write_text(
        '[principals.agent]\ngrants = [{ connector = "*", environments = ["dev"], '
        'access = "write" }]\n')
    config.write_text(f'[capgate]\nledger = "sqlite:///{tmp_path / "l.db"}"\n'
                      f'grants = "grants.toml"\ncapabilities = ["{CAPABILITIES_DIR}"]\n'
                      f'[connectors.insurance]\nurl = "sqlite:///{db}"\nenvironment = "dev"\n'
                      f'[connectors.insurance_code]\nurl = "sqlite:///{db}"\n'
                      'environment = "dev"\n')
    engine = sa.create_engine(f"sqlite:///{db}")
    apply_schema(engine)
    engine.dispose()
    common = ["--json", "--config", str(config)]
    mistakes = [
        ["call", "policy.get", "--input", "{", "--case", "C", "--as", "agent"],
        ["call", "policy.get", "--input", "[1]", "--case", "C", "--as", "agent"],
        ["call", "policy.gett", "--input", "{}", "--case", "C", "--as", "agent"],
        ["call", "policy.get@x", "--input", "{}", "--case", "C", "--as", "agent"],
        ["call", "policy.get@99", "--input", "{}", "--case", "C", "--as", "agent"],
        ["call", "policy.add_note", "--input", '{"policy_id": 1}', "--case", "C", "--as",
         "agent"],
        ["call", "policy.add_note", "--input", json.dumps(NOTE), "--case", "C", "--as",
         "nobody"],
        ["call", "policy.add_note", "--input", json.dumps(NOTE), "--case", "C", "--as",
         "agent"],  # capgate's tables are not installed here: CG305
        ["plan", "policy.purge_orphan", "--input", '{"policy_id": "x"}', "--case", "C",
         "--as", "agent"],
        ["approve", "sha256:" + "0" * 64, "--by", "bob", "--role", "dba", "--key",
         str(tmp_path / "no.key")],
        ["resume", "NO-SUCH-CASE"],
        ["ledger", "show", "NO-SUCH-CASE"],
        ["ledger", "verify", "--case", "NO-SUCH-CASE"],
        ["target", "install", "no_such_connector"],
        ["target", "check", "no_such_connector"],
        ["explain", "CG1234"],
        ["ddl", "capture", "function:no_such_function_xyz", "--connector", "insurance_code"],
        ["rehearse", "--connector", "no_such_connector", "--as", "agent"],
        ["show", "no.such.operation"],
        ["validate", str(tmp_path / "missing")],
    ]
    for argv in mistakes:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*argv, *common])
        assert code not in (0, errors.EXIT_INTERNAL), (argv, code, out.getvalue(),
                                                       err.getvalue())
        text = out.getvalue().strip()
        assert text and "CG999" not in text, (argv, text, err.getvalue())
        assert "internal error" not in text + err.getvalue(), (argv, text)
