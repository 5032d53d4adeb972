"""``bench/lean_call.py`` does the work it claims (issue 13's bound): a bench side that
quietly did less than a capgate call would make the bound a lie.

On real PostgreSQL (the target, and one ledger) and SQLite (the other): after N calls
the balance moved by N, N landing markers are in the target, the fence row holds the
last claim's token, each ledger holds 2N events hash-chained from genesis with every
head HMAC-signed, and every impact claim and budget slot was released.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sqlite3
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench import lean_call
from capgate.executor.target import install_at

CALLS = 23  # three cases of 10 calls: two closed, one part-way


def _libpq(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _bench_target(pg_url: URL) -> str:
    """The bench's account table (account 7 at 1000) and capgate's tables; the libpq DSN."""
    target = _libpq(pg_url)
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_account (account_id int PRIMARY KEY,"
                     " balance bigint NOT NULL)")
        conn.execute("INSERT INTO bench_account VALUES (7, 1000)")
    install_at(pg_url.set(drivername="postgresql+psycopg"))
    return target


def _digest(case: str, seq: int, kind: str, intent: str, payload: str, prev: str,
            at: str) -> str:
    return "sha256:" + hashlib.sha256(lean_call._canon(
        {"case_id": case, "seq": seq, "kind": kind, "intent_id": intent, "payload": payload,
         "prev_digest": prev, "recorded_at": at}).encode()).hexdigest()


@pytest.mark.parametrize("ledger", ["sqlite", "postgresql"])
def test_the_lean_side_records_claims_and_releases_what_a_call_does(
        ledger: str, pg_url: URL, pg_ledger_url: URL, tmp_path: Path) -> None:
    target = _bench_target(pg_url)
    store = "sqlite" if ledger == "sqlite" else _libpq(pg_ledger_url)
    side = lean_call.LeanSide(target, store, tmp_path, 7, case_calls=10)
    try:
        for _ in range(CALLS):
            side.call()
    finally:
        side.close()

    with psycopg.connect(target) as conn:
        assert conn.execute("SELECT balance FROM bench_account").fetchone() == (1000 + CALLS,)
        assert conn.execute("SELECT count(*) FROM capgate_landed").fetchone() == (CALLS,)
        assert conn.execute("SELECT token FROM capgate_fence").fetchall() == [(CALLS,)]

    if ledger == "sqlite":
        db = sqlite3.connect(tmp_path / "lean.db")
        query = db.execute
    else:
        pg = psycopg.connect(store)
        query = pg.execute  # type: ignore[assignment]
    events = query("SELECT case_id, seq, kind, intent_id, payload, prev_digest, digest,"
                   " recorded_at FROM lean_events ORDER BY case_id, seq").fetchall()
    assert len(events) == 2 * CALLS
    heads = {row[0]: row[1:] for row in query(
        "SELECT case_id, head_seq, head_digest, head_mac FROM lean_cases").fetchall()}
    assert len(heads) == 3
    prev: dict[str, str] = {}
    last: dict[str, int] = {}
    for case, seq, kind, intent, payload, prev_digest, digest, at in events:
        assert kind == ("prepared" if seq % 2 == 0 else "observed")
        assert prev_digest == prev.get(case, "sha256:genesis")
        assert digest == _digest(case, seq, kind, intent, payload, prev_digest, at)
        json.loads(payload)
        prev[case], last[case] = digest, seq
    for case, (seq, digest, mac) in heads.items():
        assert (seq, digest) == (last[case], prev[case])
        assert mac == hmac.new(lean_call._KEY, digest.encode(), "sha256").hexdigest()
    assert query("SELECT count(*) FROM lean_keys").fetchone() == (CALLS,)
    assert query("SELECT count(*) FROM lean_slots").fetchone() == (0,)
    assert query("SELECT token, intent_id FROM lean_claims").fetchall() == [(CALLS, None)]
    if ledger != "sqlite":
        pg.close()


def test_the_lean_side_refuses_a_held_impact_claim(pg_url: URL, tmp_path: Path) -> None:
    """A live holder of the impact key makes the next call fail before the target's
    statements run: the claim is taken, not assumed."""
    target = _bench_target(pg_url)
    side = lean_call.LeanSide(target, "sqlite", tmp_path, 7)
    try:
        side.call()
        side.db.execute("UPDATE lean_claims SET intent_id = 'someone', expires_at = 1e12")
        with pytest.raises(AssertionError, match="refused"):
            side.call()
    finally:
        side.close()
    engine = sa.create_engine(pg_url.set(drivername="postgresql+psycopg"))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT balance FROM bench_account")).scalar() == 1001
    engine.dispose()
