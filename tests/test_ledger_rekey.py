"""Turning the ledger's HMAC key on, and rotating it: ``Ledger.rekey`` / ``capgate ledger rekey``.

Before, setting ``CAPGATE_LEDGER_HMAC_KEY`` on a ledger written without it -- the README
asks for the key when executors share a ledger -- made every existing case refuse to
continue (CG410, "the head's MAC does not match under the configured key") and
``ledger verify`` report every case as tampered; and a key could never be rotated.  Now
``rekey`` verifies every case and anchor under the previous key (or none), then signs
them with the new one, and records it.  It never blesses what the previous key would
not: a stripped MAC, a MAC of an unknown key, an edited chain -- nothing is written then.
On SQLite and PostgreSQL ledgers, and through the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.ledger import head_mac, open_ledger
from capgate.executor.ledger.store import key_id
from capgate.registry.errors import ConfigError, LedgerTampered

K1, K2, K3 = b"first-key-0123456789", b"second-key-0123456789", b"third-key-0123456789"


def _write(url: URL, key: bytes | None) -> None:
    """Two cases of a few events and an anchor, written under ``key`` (None: unsigned)."""
    with open_ledger(url, hmac_key=key) if key else open_ledger(url) as ledger:
        for case in ("A", "B"):
            for n in range(3):
                ledger.append(case, "note", {"n": n})
        ledger.anchor()


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAPGATE_LEDGER_HMAC_KEY", raising=False)


def test_a_key_turned_on_for_an_unsigned_ledger_signs_every_head_and_anchor(
        ledger_url: URL) -> None:
    _write(ledger_url, None)
    with open_ledger(ledger_url, hmac_key=K1) as ledger:
        with pytest.raises(LedgerTampered, match="MAC"):  # the old dead end
            ledger.append("A", "note", {"n": 3}, continuing=True)
        assert {f.kind for f in ledger.verify().findings} == {"mac_missing", "anchor_broken"}
        report = ledger.rekey(None)
        assert (report.cases, report.anchors, report.key_id) == (2, 1, key_id(K1))
        assert ledger.verify().ok, ledger.verify().findings
        ledger.append("A", "note", {"n": 3}, continuing=True)
        (recorded,) = ledger.events(report.recorded_in)
        assert recorded.kind == "ledger_rekeyed"
        assert recorded.payload["key_id"] == key_id(K1)
        assert recorded.payload["previous_key_id"] is None
        assert key_id(K1) != key_id(K2) and K1.decode() not in json.dumps(recorded.payload)
    with open_ledger(ledger_url, hmac_key=K1) as again:  # a new process: still verifies
        assert again.verify().ok
        assert again.rekey(None).cases == 3  # run again: its own MACs are accepted


def test_a_key_is_rotated_with_the_previous_one_and_only_with_it(ledger_url: URL) -> None:
    _write(ledger_url, K1)
    with open_ledger(ledger_url, hmac_key=K2) as ledger:
        with pytest.raises(LedgerTampered):
            ledger.rekey(K3)  # not the key it was signed with
        with pytest.raises(LedgerTampered, match="nothing was signed"):
            ledger.rekey(None)  # signed heads, no previous key given
    with open_ledger(ledger_url, hmac_key=K1) as old:
        assert old.verify().ok  # the refusals wrote nothing
    with open_ledger(ledger_url, hmac_key=K2) as ledger:
        report = ledger.rekey(K1)
        assert (report.cases, report.anchors) == (2, 1)
        assert ledger.verify().ok
        ledger.append("B", "note", {"n": 3}, continuing=True)
        assert ledger.events(report.recorded_in)[0].payload["previous_key_id"] == key_id(K1)
    with open_ledger(ledger_url, hmac_key=K1) as old:
        assert {f.kind for f in old.verify().findings} >= {"mac_mismatch"}


def _edit(url: URL, sql: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(sql))
    finally:
        engine.dispose()


@pytest.mark.parametrize("edit, previous", [
    # a MAC stripped from one head: with the previous key it is missing ...
    ("UPDATE cg_cases SET head_mac = NULL WHERE case_id = 'A'", K1),
    # ... and without it the other heads' MACs are an unknown key's
    ("UPDATE cg_cases SET head_mac = NULL WHERE case_id = 'A'", None),
    # every MAC stripped (the first step of a whole-chain rewrite)
    ("UPDATE cg_cases SET head_mac = NULL", K1),
])
def test_rekey_never_blesses_what_the_previous_key_would_not(
        ledger_url: URL, edit: str, previous: bytes | None) -> None:
    _write(ledger_url, K1)
    _edit(ledger_url, edit)
    with open_ledger(ledger_url, hmac_key=K2) as ledger:
        with pytest.raises(LedgerTampered) as refused:
            ledger.rekey(previous)
        assert refused.value.details["findings"]
        assert ledger.cases() and not any(c.case_id.startswith("ledger-rekey-")
                                          for c in ledger.cases())
    engine = sa.create_engine(ledger_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:  # no head carries the new key's MAC
            heads = list(conn.execute(sa.text("SELECT head_digest, head_mac FROM cg_cases")))
    finally:
        engine.dispose()
    assert heads and all(mac != head_mac(K2, digest) for digest, mac in heads)
    with open_ledger(ledger_url, hmac_key=K2) as ledger:
        assert not ledger.verify().ok


def test_an_edited_event_refuses_the_rekey(ledger_url: URL) -> None:
    _write(ledger_url, None)
    engine = sa.create_engine(ledger_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE cg_events SET payload = :p"
                                 " WHERE case_id = 'B' AND seq = 1"), {"p": '{"n":9}'})
    finally:
        engine.dispose()
    with open_ledger(ledger_url, hmac_key=K1) as ledger:
        with pytest.raises(LedgerTampered) as refused:
            ledger.rekey(None)
        kinds = {f["kind"] for f in refused.value.details["findings"]}
        assert "payload_edited" in kinds, kinds


def test_rekey_needs_the_new_key(ledger_url: URL) -> None:
    _write(ledger_url, None)
    with open_ledger(ledger_url) as ledger, pytest.raises(ConfigError,
                                                          match="CAPGATE_LEDGER_HMAC_KEY"):
        ledger.rekey(None)


def _cli(project: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "CAPGATE_LEDGER_HMAC_KEY"}
    return subprocess.run([sys.executable, "-m", "capgate", *args], cwd=project,
                          env={**full, **env}, capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_cli_rekeys_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    assert _cli(tmp_path, {}, "init", str(project)).returncode == 0
    note = json.dumps({"policy_id": 1, "author": "jdoe", "body": "one"})
    assert _cli(project, {}, "call", "policy.add_note", "--case", "K-1",
                "--input", note).returncode == 0
    keyed = {"CAPGATE_LEDGER_HMAC_KEY": K1.decode()}
    assert _cli(project, keyed, "ledger", "verify").returncode == 1  # mac_missing
    no_key = _cli(project, {}, "ledger", "rekey")
    assert no_key.returncode == 2 and "CG902" in no_key.stdout + no_key.stderr
    unset = _cli(project, keyed, "ledger", "rekey", "--previous-key-env", "NO_SUCH_VAR_X")
    assert unset.returncode == 2 and "NO_SUCH_VAR_X" in unset.stdout + unset.stderr
    done = _cli(project, keyed, "ledger", "rekey", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["key_id"] == key_id(K1)
    assert _cli(project, keyed, "ledger", "verify").returncode == 0
    again = json.dumps({"policy_id": 2, "author": "jdoe", "body": "two"})
    assert _cli(project, keyed, "call", "policy.add_note", "--case", "K-1",
                "--input", again).returncode == 0
    rotated = {"CAPGATE_LEDGER_HMAC_KEY": K2.decode(), "OLD_LEDGER_KEY": K1.decode()}
    wrong = _cli(project, {**rotated, "OLD_LEDGER_KEY": K3.decode()}, "ledger", "rekey",
                 "--previous-key-env", "OLD_LEDGER_KEY")
    assert wrong.returncode == 1 and "CG410" in wrong.stdout + wrong.stderr
    assert _cli(project, rotated, "ledger", "rekey", "--previous-key-env",
                "OLD_LEDGER_KEY").returncode == 0
    assert _cli(project, {"CAPGATE_LEDGER_HMAC_KEY": K2.decode()},
                "ledger", "verify").returncode == 0


def test_the_previous_key_variable_must_hold_a_key(tmp_path: Path) -> None:
    from capgate.commands.ledger import rekey
    from capgate.config import load_settings

    (tmp_path / "capgate.toml").write_text(
        f'[capgate]\nledger = "sqlite:///{tmp_path / "l.db"}"\n', "utf-8")
    with pytest.raises(ConfigError, match="EMPTY_VAR"):
        rekey(load_settings(tmp_path / "capgate.toml"), "EMPTY_VAR", env={"EMPTY_VAR": ""})


def test_a_case_deleted_since_the_latest_anchor_refuses_the_rekey(ledger_url: URL) -> None:
    """What ``verify`` reports against the anchors is not signed over either."""
    _write(ledger_url, None)
    _edit(ledger_url, "DELETE FROM cg_events WHERE case_id = 'B'")
    _edit(ledger_url, "DELETE FROM cg_cases WHERE case_id = 'B'")
    with open_ledger(ledger_url, hmac_key=K1) as ledger:
        with pytest.raises(LedgerTampered) as refused:
            ledger.rekey(None)
        assert "case_deleted" in {f["kind"] for f in refused.value.details["findings"]}
