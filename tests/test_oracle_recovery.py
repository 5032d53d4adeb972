"""Crashes, resume and liveness on Oracle (issue 18): run wherever an Oracle answers.

The same crash matrix as ``tests/test_crash_matrix.py`` -- a real child process
SIGKILLed at every boundary -- on two Oracle services of one database:

* the default service (``FREEPDB1`` in the container): no ``COMMIT_OUTCOME``, no
  LTXID, so resume proves the transaction is over without privileges
  (``DBMS_SESSION.IS_SESSION_ALIVE`` on the recorded unique session id; a
  rolled-back insert of the marker's key while the session lives);
* the Transaction Guard service (``oracle_tg_url``): ``GET_LTXID_OUTCOME`` on the
  LTXID recorded before COMMIT decides, and blocks a late commit of it.

And an executor that is stopped (SIGSTOP), not dead: it holds its transaction and
its row locks, so resume never answers ``not_applied`` while it lives -- with
``GV$SESSION`` and ``ALTER SYSTEM`` it kills exactly that session (still carrying
the intent in ``CLIENT_INFO``, on its own instance); without them it waits, says
``unknown``, and settles once the process is gone.

Every test here skips where no Oracle answers (``CAPGATE_REQUIRE_DBS=oracle`` makes
that a failure): nothing in this file has run on the machines that wrote it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import CRASH_POINTS, Executor
from capgate.executor.recovery.resume import resume
from capgate.registry.errors import ReconciliationRequired
from tests import test_crash_matrix as matrix
from tests.crash_child import Zygote
from tests.fix_db import require_server

pytestmark = [pytest.mark.oracle, pytest.mark.crash]

NOTE = matrix.NOTE


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def grant(user_url: URL, *privileges: str) -> bool:
    """Best effort: grant the test user what liveness and termination need (admin URL)."""
    admin = sa.create_engine(require_server("oracle").url, poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            for privilege in privileges:
                conn.exec_driver_sql(f"GRANT {privilege} TO {user_url.username}")
        return True
    except sa.exc.DBAPIError:
        return False
    finally:
        admin.dispose()


LIVENESS = ("SELECT ON SYS.GV_$SESSION", "ALTER SYSTEM", "EXECUTE ON SYS.DBMS_APP_CONT")


@pytest.fixture(params=["default_service", "transaction_guard"])
def oracle_target(request: pytest.FixtureRequest) -> URL:
    """A fresh Oracle user on each service: without and with COMMIT_OUTCOME."""
    name = "oracle_url" if request.param == "default_service" else "oracle_tg_url"
    url: URL = request.getfixturevalue(name)
    if request.param == "transaction_guard":
        grant(url, "EXECUTE ON SYS.DBMS_APP_CONT")
    return url


@pytest.mark.parametrize("operation", [NOTE, matrix.ISSUE])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_at_every_boundary_on_oracle(oracle_target: URL, point: str, operation: str,
                                             gate: Callable[..., Executor], zygote: Zygote,
                                             tmp_path: Path) -> None:
    """The matrix's own test, on Oracle: refused, classified from evidence, present once."""
    matrix.test_sigkill_at_every_boundary(oracle_target, point, operation, gate, zygote,
                                          tmp_path)


def _intent(ex: Executor, case: str) -> tuple[str, dict[str, Any]]:
    (intent_id, state), = (ex.ledger.snapshot(case) or {})["intents"].items()
    return intent_id, state


def test_the_attempt_records_who_and_where_before_any_statement(
        oracle_target: URL, gate: Callable[..., Executor], zygote: Zygote,
        tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(oracle_target, ledger)
    case = "ORA-IDENTITY"
    inputs = {"policy_id": 1, "author": "jdoe", "body": "identity"}
    ended = zygote.run(matrix.spec(oracle_target, ledger, NOTE, inputs, case,
                                   tmp_path / "out.json", crash_at="after_attempt_started"))
    assert ended.killed
    intent_id, state = _intent(ex, case)
    tx = state["tx"]
    assert tx["dialect"] == "oracle" and tx["driver"] == "thin"
    assert int(tx["sid"]) > 0 and int(tx["serial"]) > 0 and int(tx["instance"]) >= 1
    assert tx["txid"] and tx["usid"] and tx["db"] and int(tx["audsid"]) != 0
    assert tx["client_info"] == intent_id  # what CLIENT_INFO carried: the session is ours
    if oracle_target.query.get("service_name") == require_server("oracle").tg_service:
        assert tx["ltxid"] and tx["commit_outcome"] == "recorded"
    else:
        assert tx["ltxid"] is None and "COMMIT_OUTCOME" in tx["commit_outcome"]
    report = resume(ex, case)
    (only,) = report.intents
    assert (only.classification, only.action) == ("not_applied", "retried"), only


@pytest.mark.parametrize("privileged", [True, False], ids=["gv_session", "privilege_free"])
def test_a_stopped_executor_is_never_not_applied(oracle_url: URL, privileged: bool,
                                                 gate: Callable[..., Executor],
                                                 zygote: Zygote, tmp_path: Path) -> None:
    if privileged and not grant(oracle_url, *LIVENESS[:2]):
        pytest.skip("the admin URL may not grant GV$SESSION and ALTER SYSTEM")
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(oracle_url, ledger)
    case = f"ORA-ALIVE-{privileged}"
    inputs = {"policy_id": 1, "author": "jdoe", "body": f"alive {uuid.uuid4().hex[:6]}"}
    ended = zygote.run(matrix.spec(oracle_url, ledger, NOTE, inputs, case,
                                   tmp_path / "out.json", stop_at="before_commit"))
    assert ended.stopped
    try:
        with pytest.raises(ReconciliationRequired):
            ex.call(NOTE, {"policy_id": 2, "author": "jdoe", "body": "next"}, case=case,
                    who="agent")
        waited = resume(ex, case, terminate=False, wait_seconds=0.5)
        (only,) = waited.intents
        assert only.classification == "unknown", only
        session = only.evidence.get("session") or {}
        assert session.get("alive") is True
        if privileged:  # GV$SESSION: ours by CLIENT_INFO, in a transaction
            assert session.get("source") == "gv$session"
            assert session.get("ours") is True and session.get("in_transaction") is True
        else:  # privilege-free: alive (IS_SESSION_ALIVE) and holding the marker's key
            assert session.get("source") == "dbms_session"
            assert (only.evidence.get("marker_key") or {}).get("answer") == "held"
        assert matrix.effect_count(ex, NOTE, inputs) == 0, "nothing retried"

        if privileged:
            report = resume(ex, case)  # kills exactly that session, on its instance
            (only,) = report.intents
            assert (only.evidence.get("terminated_session") or {}).get("done") is True
        else:
            still = resume(ex, case, wait_seconds=0.5)  # it may not kill: still unknown
            assert still.intents[0].classification == "unknown"
            assert zygote.kill(ended.pid).killed
            ended = None  # type: ignore[assignment]
            report = resume(ex, case, wait_seconds=10)  # the session is gone: proven over
            (only,) = report.intents
        assert (only.classification, only.action, only.outcome) == \
            ("not_applied", "retried", "applied_verified"), only
        assert matrix.effect_count(ex, NOTE, inputs) == 1
        assert ex.ledger.verify().ok and not ex.ledger.cases(open_only=True)
    finally:
        if ended is not None:
            zygote.kill(ended.pid)


def test_a_session_killed_around_commit_is_settled(oracle_tg_url: URL,
                                                   gate: Callable[..., Executor],
                                                   zygote: Zygote, tmp_path: Path) -> None:
    """The executor's session killed from outside while it commits: Transaction Guard
    answers (aborted: never committed, and blocked from committing later)."""
    grant(oracle_tg_url, "EXECUTE ON SYS.DBMS_APP_CONT")
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(oracle_tg_url, ledger)
    case = "ORA-KILLCONN"
    inputs = {"policy_id": 1, "author": "jdoe", "body": "kill around commit"}
    ended = zygote.run(matrix.spec(oracle_tg_url, ledger, NOTE, inputs, case,
                                   tmp_path / "out.json", stop_at="before_commit"))
    assert ended.stopped
    intent_id, state = _intent(ex, case)
    tx = state["tx"]
    admin = sa.create_engine(require_server("oracle").url, poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            serial = conn.execute(sa.text(
                'SELECT "SERIAL#" FROM gv$session WHERE inst_id = :i AND sid = :s'
                " AND audsid = :a"), {"i": tx["instance"], "s": tx["sid"],
                                      "a": tx["audsid"]}).scalar_one()
            conn.exec_driver_sql(f"ALTER SYSTEM KILL SESSION '{int(tx['sid'])},"
                                 f"{int(serial)},@{int(tx['instance'])}' IMMEDIATE")
    finally:
        admin.dispose()
    after = zygote.cont(ended.pid)  # its COMMIT meets a dead session
    assert after.state == "exited" and after.code == 3, after
    assert ex.ledger.intent(case, intent_id)["status"] == "commit_uncertain"
    report = resume(ex, case)
    (only,) = report.intents
    assert (only.classification, only.action) == ("not_applied", "retried"), only
    assert only.evidence.get("commit_outcome") == "aborted", only.evidence
    assert matrix.effect_count(ex, NOTE, inputs) == 1
