"""The crash matrix: a real process killed at every boundary, on every target.

A child process (forked by the zygote in ``tests/crash_child.py``) runs a
collapsed call and is killed with SIGKILL by the executor's own test hook at
each boundary -- after ``prepared``, after ``attempt_started``, after the
statements but before COMMIT, after COMMIT but before ``observed``, after
``observed`` -- on SQLite, PostgreSQL and MariaDB targets.  Then: the next
call in the case is refused; ``resume`` classifies from evidence; the effect
is present exactly once (counted in the target); replaying the request
executes nothing; the case continues; the ledger verifies.

Also here: the connection killed around COMMIT from a second connection
(``pg_terminate_backend`` / MariaDB ``KILL CONNECTION``), and an old session
still alive (a stopped child holding its transaction open).

``CAPGATE_CRASH_MATRIX_OUT=FILE`` records each cell (JSON lines) for
``docs/crash-matrix.md`` (``python -m tests.crash_child --table FILE``).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import CRASH_POINTS, Executor
from capgate.executor.recovery.resume import resume
from capgate.registry.errors import ReconciliationRequired
from tests.crash_child import Zygote
from tests.fix_db import engine_params

pytestmark = pytest.mark.crash

NOTE = "policy.add_note"
ISSUE = "document.issue"


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def url_text(url: URL | str) -> str:
    return url.render_as_string(hide_password=False) if isinstance(url, URL) else url


def engine_of(url: URL) -> str:
    return {"mysql": "mariadb"}.get(url.get_backend_name(), url.get_backend_name())


def scalar(ex: Executor, sql: str, **binds: Any) -> Any:
    with ex.connectors.get("insurance").engine.connect() as conn:
        return conn.execute(sa.text(sql), binds).scalar_one()


def request(operation: str, tag: str) -> dict[str, Any]:
    if operation == NOTE:
        return {"policy_id": 1, "author": "jdoe", "body": f"note {tag}"}
    return {"policy_id": 1, "series": "POL", "kind": "certificate", "request_ref": f"REQ-{tag}"}


def effect_count(ex: Executor, operation: str, inputs: dict[str, Any]) -> int:
    if operation == NOTE:
        return int(scalar(ex, "SELECT count(*) FROM policy_note WHERE body = :b",
                          b=inputs["body"]))
    return int(scalar(ex, "SELECT count(*) FROM issued_document WHERE request_ref = :r",
                      r=inputs["request_ref"]))


def spec(target: URL, ledger: str, operation: str, inputs: dict[str, Any], case: str,
         out: Path, **extra: Any) -> dict[str, Any]:
    return {"target": url_text(target), "ledger": ledger, "operation": operation,
            "inputs": inputs, "case": case, "who": "agent", "out": str(out), **extra}


def record_cell(**row: Any) -> None:
    path = os.environ.get("CAPGATE_CRASH_MATRIX_OUT")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


EXPECTED = {
    "after_prepared": ("not_applied", "retried"),
    "after_attempt_started": ("not_applied", "retried"),
    "before_commit": ("not_applied", "retried"),
    "after_commit": ("applied", "recorded_applied"),
    "after_observed": (None, None),
}


@pytest.mark.parametrize("operation", [NOTE, ISSUE])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_at_every_boundary(target_url: URL, point: str, operation: str,
                                   gate: Callable[..., Executor], zygote: Zygote,
                                   tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(target_url, ledger)
    case = f"CRASH-{point}"
    inputs = request(operation, uuid.uuid4().hex[:10])
    next_no = int(scalar(ex, "SELECT next_no FROM document_number WHERE series = 'POL'"))

    ended = zygote.run(spec(target_url, ledger, operation, inputs, case, tmp_path / "out.json",
                            crash_at=point))
    assert ended.killed, ended
    landed = effect_count(ex, operation, inputs)
    assert landed == (1 if point in ("after_commit", "after_observed") else 0)

    follow_up = {"policy_id": 2, "author": "jdoe", "body": f"after {point}"}
    if point != "after_observed":
        with pytest.raises(ReconciliationRequired):
            ex.call(NOTE, follow_up, case=case, who="agent")

    report = resume(ex, case)
    classification, action = EXPECTED[point]
    if classification is None:
        assert report.intents == ()
    else:
        (only,) = report.intents
        assert (only.classification, only.action) == (classification, action), only
        assert only.outcome == "applied_verified"
    assert report.resolved and report.exit_code == 0

    assert effect_count(ex, operation, inputs) == 1, "present exactly once"
    again = ex.call(operation, inputs, case=case, who="agent")  # the same request again
    assert again.replayed and again.status == "applied_verified"
    assert effect_count(ex, operation, inputs) == 1, "a replay never duplicates"
    if operation == ISSUE:
        assert scalar(ex, "SELECT next_no FROM document_number WHERE series = 'POL'") == \
            next_no + 1, "exactly one number consumed"
    assert ex.call(NOTE, follow_up, case=case, who="agent").status == "applied_verified"
    assert ex.ledger.verify().ok
    assert not ex.ledger.cases(open_only=True)

    cell = "nothing in flight (observed before the kill)"
    if classification is not None and action is not None:
        cell = (f"**{classification}** ({brief(report.intents[0].evidence)}) → "
                f"{action.replace('_', ' ')}")
    record_cell(target=engine_of(target_url), point=point, operation=operation, cell=cell,
                evidence=report.intents[0].evidence.get("rule") if report.intents else None)


def brief(evidence: Mapping[str, Any]) -> str:
    """The deciding evidence of a matrix cell, in a few words."""
    if "nothing was sent" in evidence["rule"]:
        return "no attempt_started recorded"
    parts = [f"marker {evidence['marker']}"]
    if evidence["marker"] != "present":
        if evidence.get("commit_outcome"):
            parts.append(f"pg_xact_status {evidence['commit_outcome']}")
        if str(evidence.get("write_lock", "")).startswith("acquired"):
            parts.append("write lock free")
        session = evidence.get("session")
        if isinstance(session, dict):
            parts.append("connection " + ("alive" if session.get("alive") else "gone"))
    return ", ".join(parts)


# --- the connection killed around COMMIT from a second connection ---------------------


def kill_backend(ex: Executor, tx: dict[str, Any]) -> None:
    """Terminate exactly the recorded session from a second connection."""
    engine = ex.connectors.get("insurance").engine
    with engine.connect() as conn:
        if tx["dialect"] == "postgresql":
            done = conn.execute(sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE pid = :pid AND backend_start::text = :start"),
                {"pid": tx["pid"], "start": tx["backend_start"]}).scalar()
            assert done
        else:
            conn.exec_driver_sql("KILL CONNECTION %s", (int(tx["connection_id"]),))
        conn.commit()


def server_target(request: pytest.FixtureRequest, engine: str) -> URL:
    url: URL = request.getfixturevalue("pg_url" if engine == "postgresql" else "mariadb_url")
    return url


@pytest.mark.parametrize("engine", engine_params("postgresql", "mariadb"))
@pytest.mark.parametrize("landed", [False, True], ids=["not_landed", "landed"])
def test_connection_killed_around_commit(engine: str, landed: bool,
                                         request: pytest.FixtureRequest,
                                         gate: Callable[..., Executor], zygote: Zygote,
                                         tmp_path: Path) -> None:
    target = server_target(request, engine)
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(target, ledger)
    case = f"KILLCONN-{engine}-{landed}"
    inputs = request_inputs = {"policy_id": 1, "author": "jdoe", "body": f"kill {landed}"}
    point = "after_commit" if landed else "before_commit"
    ended = zygote.run(spec(target, ledger, NOTE, inputs, case, tmp_path / "out.json",
                            stop_at=point))
    assert ended.stopped
    (intent_id, state), = (ex.ledger.snapshot(case) or {})["intents"].items()
    kill_backend(ex, state["tx"])
    if landed:
        zygote.kill(ended.pid)  # the executor never learns it committed
    else:
        after = zygote.cont(ended.pid)  # its COMMIT meets a dead connection
        assert after.state == "exited" and after.code == 3, after
        assert after.outcome is not None and after.outcome["code"] == "CG401"
        assert ex.ledger.intent(case, intent_id)["status"] == "commit_uncertain"
    assert effect_count(ex, NOTE, request_inputs) == (1 if landed else 0)

    report = resume(ex, case)
    (only,) = report.intents
    if landed:
        assert (only.classification, only.action) == ("applied", "recorded_applied")
    else:
        assert (only.classification, only.action) == ("not_applied", "retried")
        assert only.evidence["attempt"] == 1
    if landed:
        assert only.evidence["marker"] == "present"  # the strongest evidence decides alone
    elif engine == "postgresql":
        assert only.evidence["commit_outcome"] == "aborted"
    else:
        assert only.evidence["session"]["alive"] is False
    assert effect_count(ex, NOTE, request_inputs) == 1
    assert ex.ledger.verify().ok and report.exit_code == 0


# --- an old session still alive --------------------------------------------------------


@pytest.mark.parametrize("point", ["after_attempt_started", "before_commit"])
def test_live_session_is_never_not_applied(target_url: URL, point: str,
                                           gate: Callable[..., Executor], zygote: Zygote,
                                           tmp_path: Path) -> None:
    """A stopped executor still holds its transaction: waiting never concludes not_applied."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(target_url, ledger)
    case = f"ALIVE-{point}"
    inputs = {"policy_id": 1, "author": "jdoe", "body": f"alive {point}"}
    # The server's own idle timeout (under a second) would end the stopped session by
    # itself on a slow machine; this test is about resume ending it, so the child's
    # grace is the operation's timeout (5 s) instead.
    ended = zygote.run(spec(target_url, ledger, NOTE, inputs, case, tmp_path / "out.json",
                            stop_at=point, idle_grace_seconds=30))
    assert ended.stopped
    try:
        waited = resume(ex, case, terminate=False, wait_seconds=0.3)
        (only,) = waited.intents
        assert only.classification == "unknown", only
        assert only.action == "escalated" and waited.exit_code == 3
        assert effect_count(ex, NOTE, inputs) == 0, "nothing retried"
        assert [c.case_id for c in ex.ledger.cases(open_only=True)] == [case]
        again = resume(ex, case, terminate=False, wait_seconds=0.1)
        assert again.intents[0].action == "still_escalated"

        engine = engine_of(target_url)
        if engine == "sqlite":
            # No session to terminate: the write lock stays held, the answer stays unknown.
            assert resume(ex, case, wait_seconds=0.3).intents[0].classification == "unknown"
            assert zygote.kill(ended.pid).killed
            ended = None  # type: ignore[assignment]
        report = resume(ex, case)  # terminates exactly the recorded session, then asks again
        (only,) = report.intents
        assert (only.classification, only.action, only.outcome) == \
            ("not_applied", "retried", "applied_verified"), only
        if engine != "sqlite":
            assert only.evidence["terminated_session"]
        assert effect_count(ex, NOTE, inputs) == 1
        if ended is not None:
            # The zombie wakes after resume retried the intent: its late observation of
            # attempt 1 must not overwrite attempt 2's recorded outcome.
            late = zygote.cont(ended.pid)
            ended = None  # type: ignore[assignment]
            assert late.state == "exited", late
            state = ex.ledger.intent(case, only.intent_id)
            assert state["status"] == "observed" and state["attempt"] == 2
            assert state["outcome_record"]["status"] == "applied_verified"
            kinds = [e.kind for e in ex.ledger.events(case)]
            assert "stale_attempt" in kinds, (late, kinds)
        assert effect_count(ex, NOTE, inputs) == 1
        assert ex.ledger.verify().ok
        assert not ex.ledger.cases(open_only=True)
    finally:
        if ended is not None:
            zygote.kill(ended.pid)
