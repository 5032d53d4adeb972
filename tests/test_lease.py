"""Leased transactions (shape B): the deadline, enforced by the watchdog, the server and
the ledger; registered steps only; real processes killed and stopped mid-lease.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from capgate.executor.call import Executor
from capgate.executor.lease import sweep_expired_leases
from capgate.executor.steps import register_step
from capgate.registry import errors
from tests.fix_capgate import table_dump
from tests.fix_db import engine_params
from tests.test_lease_support import lab_registry, spawn, url_text, wait_for_file

CANCEL = {"policy_id": 5, "cancel_date": "2024-06-01", "author": "jdoe",
          "reason": "Car scrapped."}


@pytest.fixture
def lab(gate: Callable[..., Executor], tmp_path: Path) -> Callable[..., Executor]:
    """``lab(target_url, ledger_url=None)``: an executor over the lab rows, schema applied."""

    def make(target: URL, ledger: URL | str | None = None, **opts: Any) -> Executor:
        ex = gate(target, ledger, **opts)
        ex.registry = lab_registry()
        return ex

    return make


@pytest.fixture(params=engine_params("sqlite", "postgresql", "mariadb"))
def any_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[URL]:
    if request.param == "sqlite":
        yield make_url(f"sqlite:///{tmp_path / 'target.db'}")
        return
    yield request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_target(request: pytest.FixtureRequest) -> URL:
    url: URL = request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])
    return url


def kinds(ex: Executor, case: str) -> list[str]:
    return [e.kind for e in ex.ledger.events(case)]


def holder_of(url: URL, policy_id: int) -> str:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return str(conn.execute(sa.text("SELECT holder FROM policy WHERE policy_id = :p"),
                                    {"p": policy_id}).scalar_one())
    finally:
        engine.dispose()


# --- the lease and its record ---------------------------------------------------------


def test_lease_records_its_deadline_and_release(lab: Callable[..., Executor],
                                                any_target: URL) -> None:
    ex = lab(any_target)
    before = time.time()
    out = ex.lease("policy.cancel", CANCEL, case="L-ok", who="agent")
    assert out.status == "applied_verified", out.reason
    assert kinds(ex, "L-ok") == ["prepared", "attempt_started", "lease_started",
                                 "lease_released", "observed"]
    events = ex.ledger.events("L-ok")
    lease = events[2].payload["state"]["lease"]
    assert lease["timeout_seconds"] == 30
    assert before + 30 <= lease["deadline_epoch"] <= time.time() + 30
    assert lease["claims"] == {"dev/insurance/policy/policy_id=5": 1}
    assert events[3].payload["state"]["lease"]["expired"] is False
    assert out.evidence["lease"]["expired"] is False
    assert ex.ledger.verify("L-ok").ok


def test_branch_abort_rolls_back_with_expected_and_actual(lab: Callable[..., Executor],
                                                          any_target: URL) -> None:
    ex = lab(any_target)
    before = {t: table_dump(any_target, t) for t in ("policy", "premium", "policy_note")}
    out = ex.lease("policy.cancel", {**CANCEL, "policy_id": 3}, case="L-abort", who="agent")
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "abort"
    assert out.reason["step"] == "policy_is_active"
    assert out.reason["expected"] == {"rows": 1, "value": "active"}
    assert out.reason["actual"] == {"rows": 1, "value": "lapsed"}
    assert {t: table_dump(any_target, t) for t in before} == before
    assert kinds(ex, "L-abort")[-2:] == ["lease_released", "observed"]


def test_step_running_at_the_deadline_is_cancelled_and_named(
        lab: Callable[..., Executor], any_target: URL) -> None:
    """A statement sleeping in the database (Python on SQLite) past the 1 s deadline."""
    ex = lab(any_target)
    before = table_dump(any_target, "policy")
    seconds = 1.3 if any_target.get_backend_name() == "sqlite" else 4
    started = time.monotonic()
    out = ex.call("lab.slow", {"policy_id": 1, "seconds": seconds, "in_db": True},
                  case="L-slow", who="agent")
    elapsed = time.monotonic() - started
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "lease_expired", out.reason
    assert out.reason["step"] == "slow_step"
    assert out.evidence["lease"]["step"] == "slow_step"
    if any_target.get_backend_name() != "sqlite":
        # the statement was stopped (the watchdog's cancel, or the server's statement
        # timeout armed for the lease, whichever came first), not waited out
        assert out.reason["enforced_by"] in ("watchdog_cancel", "deadline_check", "server")
        assert elapsed < 1 + 1.5, elapsed
    assert table_dump(any_target, "policy") == before
    assert kinds(ex, "L-slow")[-2:] == ["lease_expired", "observed"]
    expired = ex.ledger.events("L-slow")[-2].payload["state"]["lease"]
    assert expired["expired"] is True and expired["step"] == "slow_step"
    assert ex.ledger.verify("L-slow").ok


def test_python_step_past_the_deadline_loses_its_session(lab: Callable[..., Executor],
                                                        server_target: URL) -> None:
    """A step stuck in Python cannot be cancelled: the watchdog terminates the session,
    so the row lock is free about a second after the deadline, long before the step ends."""
    import threading

    ex = lab(server_target)
    result: dict[str, Any] = {}

    def run() -> None:
        result["out"] = ex.call("lab.slow", {"policy_id": 1, "seconds": 3, "in_db": False},
                                case="L-py", who="agent")

    thread = threading.Thread(target=run)
    started = time.monotonic()
    thread.start()
    time.sleep(0.3)
    engine = sa.create_engine(server_target, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            lock_wait = "SET lock_timeout = '5s'" if server_target.get_backend_name() == \
                "postgresql" else "SET SESSION innodb_lock_wait_timeout = 5"
            conn.execute(sa.text(lock_wait))
            conn.execute(sa.text("UPDATE policy SET holder = holder WHERE policy_id = 1"))
            got_lock = time.monotonic() - started
            conn.rollback()
    finally:
        engine.dispose()
    thread.join(10)
    out = result["out"]
    print(f"row lock free {got_lock:.2f} s after the lease began (deadline 1 s)")
    assert got_lock < 1 + 2, got_lock  # deadline + 2 s
    assert got_lock < 2.7  # the Python step was still sleeping
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "lease_expired"
    assert out.reason["step"] == "slow_step"
    # the watchdog terminated the session, or the server's re-armed idle timeout did first
    assert out.reason["enforced_by"] in ("watchdog_terminate", "server")
    assert holder_of(server_target, 1) != "Lease Test"


# --- registered steps only --------------------------------------------------------------


def test_lease_api_takes_registered_steps_only(lab: Callable[..., Executor],
                                               sqlite_url: URL) -> None:
    from capgate.executor.steps import require

    ex = lab(sqlite_url)
    inputs = {"policy_id": 1, "seconds": 0}
    with pytest.raises(errors.UnregisteredStep):
        ex.lease("lab.slow", inputs, case="L-api", who="agent",
                 steps=[lambda conn, ctx: {}])

    def sleep(conn: Any, ctx: Any) -> dict[str, Any]:  # same name, not the registered object
        return {}

    with pytest.raises(errors.UnregisteredStep):
        ex.lease("lab.slow", inputs, case="L-api", who="agent", steps=[sleep])
    with pytest.raises(errors.UnregisteredStep):
        ex.lease("lab.slow", inputs, case="L-api", who="agent", steps=["tests.nope"])
    with pytest.raises(errors.UsageError):
        ex.lease("lab.slow", inputs, case="L-api", who="agent",
                 steps=["tests.sleep", "tests.sleep"])
    with pytest.raises(errors.UsageError):
        ex.lease("policy.add_note", {"policy_id": 1, "author": "a", "body": "b"},
                 case="L-api", who="agent")
    assert ex.ledger.snapshot("L-api") is None  # nothing was recorded
    out = ex.lease("lab.slow", inputs, case="L-api", who="agent",
                   steps=[require("tests.sleep")])
    assert out.status == "applied_verified", out.reason


def test_row_naming_an_unregistered_function_is_refused_before_prepared(
        lab: Callable[..., Executor], sqlite_url: URL) -> None:
    from capgate.registry.loader import validate_texts
    from capgate.registry.registry import Registry
    from tests.test_lease_support import LAB_ROWS

    ex = lab(sqlite_url)
    text = LAB_ROWS.replace("function: tests.sleep", "function: tests.not_registered")
    rows = validate_texts([("lab.yaml", text)])
    rows.raise_for_problems()
    ex.registry = Registry(rows.rows)
    with pytest.raises(errors.UnregisteredStep, match=r"tests\.not_registered"):
        ex.call("lab.slow", {"policy_id": 1, "seconds": 0}, case="L-unreg", who="agent")
    assert ex.ledger.snapshot("L-unreg") is None


def test_register_step_refuses_a_second_function_under_one_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_step("tests.sleep")(lambda conn, ctx: {})


# --- real processes, killed and stopped mid-lease ------------------------------------------


def _hold_in_child(ex: Executor, target: URL, ledger: str, case: str, tmp_path: Path,
                   mode: str) -> tuple[Any, dict[str, Any]]:
    ready = tmp_path / f"{case}.ready"
    proc = spawn("call", {"target": url_text(target), "ledger": ledger, "operation": "lab.hold",
                          "case": case, "inputs": {"policy_id": 1, "mode": mode,
                                                   "ready": str(ready)}})
    info = wait_for_file(ready, proc)
    lease = next(e for e in ex.ledger.events(case) if e.kind == "lease_started")
    return proc, {**info, **lease.payload["state"]["lease"]}


def _lock_row(target: URL, seconds: float) -> float:
    """Take policy 1's row lock in a fresh session; the wall-clock time it was granted."""
    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if target.get_backend_name() == "postgresql":
                conn.execute(sa.text(f"SET lock_timeout = '{int(seconds * 1000)}ms'"))
            else:
                conn.execute(sa.text(f"SET SESSION innodb_lock_wait_timeout = {int(seconds)}"))
            conn.execute(sa.text("UPDATE policy SET holder = holder WHERE policy_id = 1"))
            granted = time.time()
            conn.rollback()
            return granted
    finally:
        engine.dispose()


@pytest.mark.crash
def test_sigkill_mid_lease_releases_locks_and_resume_says_not_applied(
        lab: Callable[..., Executor], server_target: URL, tmp_path: Path) -> None:
    from capgate.executor.recovery.resume import resume

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = lab(server_target, ledger)
    proc, lease = _hold_in_child(ex, server_target, ledger, "L-kill", tmp_path, "sleep")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    granted = _lock_row(server_target, 10)
    assert granted <= lease["deadline_epoch"] + 2, granted - lease["deadline_epoch"]
    # the killed executor wrote no lease_expired: the sweeper records it after the deadline
    assert kinds(ex, "L-kill")[-1] == "lease_started"
    assert sweep_expired_leases(ex.ledger, now=lease["deadline_epoch"] - 1) == []
    swept = sweep_expired_leases(ex.ledger, now=lease["deadline_epoch"] + 3)
    assert [s["case"] for s in swept] == ["L-kill"]
    assert kinds(ex, "L-kill")[-1] == "lease_expired"
    report = resume(ex, "L-kill", act=False)
    assert [i.classification for i in report.intents] == ["not_applied"]
    assert holder_of(server_target, 1) != "Lease Test"
    assert ex.ledger.verify("L-kill").ok


@pytest.mark.crash
def test_sigstop_mid_lease_the_server_releases_the_locks(
        lab: Callable[..., Executor], server_target: URL, tmp_path: Path) -> None:
    """A hung executor keeps its socket open: only the server's re-armed
    idle-in-transaction timeout can free its row locks."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = lab(server_target, ledger)
    proc, lease = _hold_in_child(ex, server_target, ledger, "L-stop", tmp_path, "stop")
    try:
        granted = _lock_row(server_target, 10)
        late = granted - lease["deadline_epoch"]
        print(f"lock granted {late:+.2f} s after the deadline")
        assert late <= 2, late
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    assert out == ""  # it never got to answer


def test_the_lease_deadline_is_the_transactions_even_after_a_slow_attempt_record(
        lab: Callable[..., Executor], server_target: URL,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's timeouts are armed when the transaction opens; the lease counts from
    there too.  With ``attempt_started`` taking 0.6 s of a 1 s lease, a statement the
    server stops at the deadline is still the lease's expiry -- never a plain timeout --
    and the watchdog fires at the transaction's deadline, not 0.6 s after it."""
    from capgate.executor import boundaries

    ex = lab(server_target)
    slow = boundaries.attempt_started

    def slow_attempt_started(*args: Any, **kwargs: Any) -> None:
        slow(*args, **kwargs)
        time.sleep(0.6)

    monkeypatch.setattr(boundaries, "attempt_started", slow_attempt_started)
    started = time.monotonic()
    out = ex.call("lab.slow", {"policy_id": 1, "seconds": 4, "in_db": True},
                  case="L-slow-record", who="agent")
    elapsed = time.monotonic() - started
    assert out.status == "rolled_back"
    assert out.reason is not None and out.reason["kind"] == "lease_expired", out.reason
    assert out.reason["step"] == "slow_step"
    assert elapsed < 1 + 1.5, elapsed
