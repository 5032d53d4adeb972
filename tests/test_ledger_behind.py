"""A ledger that lost history (restored from an older backup, edited) against a target that
did not: the target's fence holds a token the ledger never issued.

Before, every write to such a key was rolled back as ``stale_fence`` -- "a newer claim of
this target already wrote; this holder's claim had expired and was taken over" -- which
was false (no newer claim exists; the ledger forgot the ones that wrote), and said
nothing of the writes the ledger no longer records.  Now the rollback says
``ledger_behind`` (CG416) with both tokens; ``capgate target fences`` lists the keys
and the landing markers of their last writers; ``--realign`` raises the ledger's tokens
once a person has looked, and records it.  On real SQLite, PostgreSQL and MariaDB
targets, SQLite and PostgreSQL ledgers, and a SQLite ledger restored from a real file
copy through the CLI.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.claims import store_for
from capgate.executor.fences import LEDGER_BEHIND, OK, fence_report, realign
from tests.fix_db import engine_params

KEY = "dev/insurance/policy_note/policy_id=1"


def _note(ex: Executor, case: str, body: str) -> str:
    out = ex.call("policy.add_note", {"policy_id": 1, "author": "jdoe", "body": body},
                  case=case, who="agent")
    return out.status


def _notes(url: URL) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM policy_note")).scalar_one())
    finally:
        engine.dispose()


@pytest.fixture(params=engine_params("sqlite", "postgresql", "mariadb"))
def any_target(request: pytest.FixtureRequest) -> URL:
    url: URL = request.getfixturevalue({"sqlite": "sqlite_url", "postgresql": "pg_url",
                                        "mariadb": "mariadb_url"}[request.param])
    return url


def test_a_fence_beyond_the_ledgers_tokens_is_reported_as_the_ledger_behind(
        gate: Callable[..., Executor], any_target: URL, ledger_url: URL) -> None:
    ex = gate(any_target, ledger_url)
    for i in range(4):  # four cases one after another: tokens 1..4, the fence at 4
        assert _note(ex, f"B{i}", f"note {i}") == "applied_verified"
    written = [e.intent_id for i in range(4) for e in ex.ledger.events(f"B{i}")
               if e.kind == "prepared"]
    before = _notes(any_target)
    # the ledger loses its last two acquisitions (what a restore of a backup taken two
    # calls ago does to cg_claims); the target keeps its fence at token 4
    with ex.ledger.engine.begin() as conn:
        conn.execute(sa.text("UPDATE cg_claims SET token = 2 WHERE impact_key = :k"),
                     {"k": KEY})
    out = ex.call("policy.add_note", {"policy_id": 1, "author": "jdoe", "body": "after"},
                  case="B9", who="agent")
    assert out.status == "rolled_back"
    assert out.reason is not None
    assert out.reason["kind"] == "ledger_behind", out.reason
    assert out.reason["code"] == "CG416"
    assert out.reason["token"] == 3 and out.reason["ledger_token"] == 3
    assert out.reason["current_token"] == 4
    assert out.reason["holder_intent"] == written[-1]
    assert "behind the target" in out.reason["message"]
    assert "`capgate target fences insurance`" in out.reason["message"]
    assert _notes(any_target) == before  # nothing committed

    store = store_for(ex)
    connector = ex.connectors.get("insurance")
    (row,) = fence_report(store, connector)
    assert (row.impact_key, row.state, row.fence_token, row.ledger_token) == (
        KEY, LEDGER_BEHIND, 4, 3)
    assert row.fence_intent == written[-1]
    assert row.landed is not None and row.landed["case_id"] == "B3"
    assert row.landed["operation_id"] == "policy.add_note"

    moved, case = realign(store, ex.ledger, connector, by="dba-anna")
    assert [m.impact_key for m in moved] == [KEY] and case is not None
    (recorded,) = ex.ledger.events(case)
    assert recorded.kind == "fences_realigned"
    assert recorded.payload["by"] == "dba-anna"
    assert recorded.payload["keys"][0]["fence_token"] == 4
    assert [r.state for r in fence_report(store, connector)] == [OK]
    assert realign(store, ex.ledger, connector, by="dba-anna") == ([], None)  # idempotent

    assert _note(ex, "B10", "after realign") == "applied_verified"
    assert _notes(any_target) == before + 1
    assert ex.ledger.verify().ok


def test_a_genuinely_newer_holder_is_still_a_stale_fence(
        gate: Callable[..., Executor], sqlite_url: URL, ledger_url: URL) -> None:
    """The ledger's token equal to the fence's (a newer claim the ledger issued wrote):
    the usual ``stale_fence``, and the report finds nothing behind."""
    ex = gate(sqlite_url, ledger_url)
    assert _note(ex, "C1", "one") == "applied_verified"
    assert _note(ex, "C2", "two") == "applied_verified"
    rows = fence_report(store_for(ex), ex.connectors.get("insurance"))
    assert [(r.state, r.fence_token, r.ledger_token) for r in rows] == [(OK, 2, 2)]


def test_a_fence_row_of_another_ledger_is_never_realigned(
        gate: Callable[..., Executor], sqlite_url: URL, tmp_path: Path) -> None:
    """Two ledgers on one target keep separate fence rows (tokens are only comparable
    within the ledger that issued them): neither sees the other's as behind."""
    a = gate(sqlite_url, f"sqlite:///{tmp_path / 'a.db'}")
    for i in range(3):
        assert _note(a, f"A{i}", f"a {i}") == "applied_verified"
    b = gate(sqlite_url, f"sqlite:///{tmp_path / 'b.db'}", schema=False)
    rows = fence_report(store_for(b), b.connectors.get("insurance"))
    assert [r.state for r in rows] == ["not_this_ledger"]
    assert realign(store_for(b), b.ledger, b.connectors.get("insurance"), by="x") == ([], None)
    assert _note(b, "B1", "b") == "applied_verified"


def _cli(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capgate", *args], cwd=project,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_ledger_restored_from_a_copy_is_found_and_realigned_through_the_cli(
        tmp_path: Path) -> None:
    """The real thing: `capgate init`, a backup of the SQLite ledger file, three more
    calls, the backup restored.  The next call rolls back as ledger_behind; `target
    fences` exits 1 naming the lost writer; `--realign --by` fixes it and records it."""
    project = tmp_path / "proj"
    assert _cli(tmp_path, "init", str(project)).returncode == 0
    # init's claims last one call (case_claim_seconds = 0), so the cases take turns
    assert "case_claim_seconds = 0 " in (project / "capgate.toml").read_text("utf-8")

    def call(case: str, body: str) -> dict[str, object]:
        done = _cli(project, "call", "policy.add_note", "--json", "--case", case, "--input",
                    json.dumps({"policy_id": 1, "author": "jdoe", "body": body}))
        return dict(json.loads(done.stdout))

    assert call("R1", "one")["status"] == "applied_verified"
    ledger = project / ".capgate" / "ledger.db"
    with sqlite3.connect(ledger) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(ledger, tmp_path / "backup.db")
    written = [call(f"R{i}", f"note {i}") for i in range(2, 5)]
    assert [w["status"] for w in written] == ["applied_verified"] * 3
    for suffix in ("-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.db", ledger)  # the restore

    after = call("R9", "after the restore")
    assert after["status"] == "rolled_back"
    assert isinstance(after["reason"], dict) and after["reason"]["kind"] == "ledger_behind"

    report = _cli(project, "target", "fences", "insurance")
    assert report.returncode == 1, report.stdout + report.stderr
    assert "ledger_behind (target token 4, ledger token 2)" in report.stdout
    assert "of case R4 (policy.add_note" in report.stdout
    assert f"last written by intent {written[-1]['intent_id']}" in report.stdout

    refused = _cli(project, "target", "fences", "insurance", "--realign")
    assert refused.returncode == 2 and "CG900" in refused.stdout + refused.stderr

    fixed = _cli(project, "target", "fences", "insurance", "--realign", "--by", "dba-anna",
                 "--json")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    payload = json.loads(fixed.stdout)
    assert payload["behind"] == 0 and len(payload["realigned"]) == 1
    assert call("R10", "after realign")["status"] == "applied_verified"
    shown = _cli(project, "ledger", "show", str(payload["recorded_in"]))
    assert shown.returncode == 0 and "fences_realigned" in shown.stdout


def test_a_restored_ledger_cannot_spend_an_approval_twice(tmp_path: Path) -> None:
    """A restore also makes an approval consumed since look unused; the second execution
    still meets the request's landing marker in the target and writes nothing."""
    project = tmp_path / "proj"
    assert _cli(tmp_path, "init", str(project)).returncode == 0
    purge = ("call", "policy.purge_orphan", "--json", "--case", "TICKET-2", "--input",
             json.dumps({"policy_id": 9}))
    refused = json.loads(_cli(project, *purge).stdout)
    plan = refused["details"]["plan_hash"]
    assert _cli(project, "approve", plan, "--by", "bob", "--role", "dba", "--key",
                "keys/bob.key").returncode == 0
    ledger = project / ".capgate" / "ledger.db"
    with sqlite3.connect(ledger) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(ledger, tmp_path / "backup.db")  # the approval recorded, not yet used
    first = json.loads(_cli(project, *purge).stdout)
    assert first["status"] == "applied_verified"
    for suffix in ("-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.db", ledger)
    again = json.loads(_cli(project, *purge).stdout)
    assert again["status"] == "already_applied"
    assert again["reason"]["kind"] == "already_landed"
    assert again["reason"]["by_intent"] == first["intent_id"]


def test_fences_on_a_target_without_capgate_tables_says_how_to_install(
        tmp_path: Path) -> None:
    from capgate.executor.claims import ClaimStore
    from capgate.executor.connectors import Connector, ConnectorConfig
    from capgate.executor.ledger import open_ledger
    from capgate.registry.errors import TargetNotInstalled

    sqlite3.connect(tmp_path / "bare.db").close()
    connector = Connector.open(ConnectorConfig(name="bare", url=f"sqlite:///{tmp_path}/bare.db",
                                               environment="dev"))
    try:
        with open_ledger(f"sqlite:///{tmp_path / 'l.db'}") as ledger, \
                pytest.raises(TargetNotInstalled, match="capgate target install bare"):
            fence_report(ClaimStore(ledger), connector)
    finally:
        connector.dispose()
