"""The same durable work as a capgate call, in straight-line Python: a bound for issue 13.

The floor sides of ``bench/call_cost.py`` commit one intent row and run the raw
transaction: no check, no chain, no claim.  This side does *everything* a
collapsed capgate call does to its ledger and its target -- with no layer in
between, nothing configurable, one row hard-coded -- so the distance between it
and capgate is what capgate's structure costs, and the distance between it and
raw is what the durable, verified, claimed write costs in Python on this machine
whatever the structure:

* the input checked against the row's types and the call's fingerprint hashed
  (canonical JSON of operation, version and inputs);
* the target transaction opened first, in one round trip: session label, the
  four server-side timeouts, the landing marker inserted, the transaction id read;
* ``prepared``, one durable ledger transaction: the idempotency key claimed
  (refused if taken), the impact key's claim taken with its next token, a
  session-budget slot, the case head compare-and-swapped, the event inserted;
  the event hash-chained (SHA-256 over its canonical text and the previous
  digest), the head HMAC-signed, the snapshot (the open intent) rewritten;
* the UPDATE (count checked) and the verify (value checked), the fence row
  moved to the claim's token (refused if a newer one is there), the claim
  re-read from the ledger (still ours), COMMIT;
* ``observed``, one ledger transaction committed without waiting for the disk
  (as capgate's is for a marker-proven outcome): the event chained and signed,
  the head swapped, the claim and the slot released.

SQLite ledger: WAL, ``synchronous=FULL`` (NORMAL for ``observed``), ``BEGIN
IMMEDIATE``.  PostgreSQL ledger: psycopg, ``prepared``'s statements sent in one
pipeline sync and then COMMIT, ``observed`` with ``synchronous_commit = off``.
Not done here, and done by capgate: resolving the row from a registry, the
grant, the promotion gate, names checked, the outcome object, recovery of a
lost connection, and every refusal's coded error -- none of which needs a round
trip or a disk write.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

OPERATION = "bench.bump"
_KEY = b"capgate-bench-13-lean-hmac-key"
_UPDATE = "UPDATE bench_account SET balance = balance + %s WHERE account_id = %s"
_VERIFY = "SELECT count(*) FROM bench_account WHERE account_id = %s AND balance >= 0"
_OPEN = (
    "WITH s AS MATERIALIZED (SELECT set_config('application_name', %s, true) a,"
    " set_config('statement_timeout', %s, true) b, set_config('lock_timeout', %s, true) c,"
    " set_config('idle_in_transaction_session_timeout', %s, true) d),"
    " m AS (INSERT INTO capgate_landed (intent_id, idem_key, fingerprint, attempt, case_id,"
    " operation_id, landed_at) SELECT %s, %s, %s, 1, %s, %s, %s FROM s RETURNING 1)"
    " SELECT (SELECT count(*) FROM m), pg_current_xact_id()::text FROM s")
_FENCE = (
    "INSERT INTO capgate_fence (key_hash, impact_key, token, intent_id) VALUES (%s, %s, %s, %s)"
    " ON CONFLICT (key_hash) DO UPDATE SET token = excluded.token, intent_id = excluded.intent_id"
    " WHERE capgate_fence.token <= excluded.token RETURNING token")
_TABLES = (
    "CREATE TABLE IF NOT EXISTS lean_events (case_id TEXT NOT NULL, seq INTEGER NOT NULL,"
    " kind TEXT NOT NULL, intent_id TEXT, payload TEXT NOT NULL, prev_digest TEXT NOT NULL,"
    " digest TEXT NOT NULL, recorded_at TEXT NOT NULL, PRIMARY KEY (case_id, seq))",
    "CREATE TABLE IF NOT EXISTS lean_cases (case_id TEXT PRIMARY KEY, head_seq INTEGER NOT NULL,"
    " head_digest TEXT NOT NULL, snapshot TEXT NOT NULL, head_mac TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS lean_keys (idem_key TEXT PRIMARY KEY, intent_id TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS lean_claims (impact_key TEXT PRIMARY KEY, token INTEGER NOT NULL,"
    " intent_id TEXT, expires_at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS lean_slots (slot TEXT PRIMARY KEY, intent_id TEXT NOT NULL)",
)


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _answer(sql: str, cursor: Any, returned: list[Any]) -> None:
    """A ledger statement must touch one row; a ``RETURNING`` one's row is kept."""
    if "RETURNING" in sql:
        returned.append(cursor.fetchone())
        if returned[-1] is None:
            raise AssertionError(f"lean ledger statement refused: {sql}")
    elif cursor.rowcount != 1:
        raise AssertionError(f"lean ledger statement refused: {sql}")


class LeanSide:
    """One account, cases of ``case_calls`` calls; ``ledger`` ``"sqlite"`` (a file under
    ``folder``) or a libpq DSN of the PostgreSQL ledger's schema."""

    def __init__(self, target_dsn: str, ledger: str, folder: Path, account: int,
                 case_calls: int = 10) -> None:
        self.target = psycopg.connect(target_dsn)
        self.pg = ledger != "sqlite"
        if self.pg:
            # autocommit: a read is one round trip; an append is an explicit transaction
            self.pg_ledger = psycopg.connect(ledger, autocommit=True)
            with self.pg_ledger.transaction():
                for sql in _TABLES:
                    self.pg_ledger.execute(sql.replace("REAL", "double precision"))
        else:
            self.db = sqlite3.connect(folder / "lean.db", isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            for sql in _TABLES:
                self.db.execute(sql)
        self.account = account
        self.case_calls = case_calls
        self.prefix = f"lean-{uuid.uuid4().hex[:6]}"
        self.n = 0
        self.heads: dict[str, tuple[int, str]] = {}

    # -- the ledger: one transaction appends one event, with the statements it carries

    def _append(self, case: str, kind: str, intent: str, payload: dict[str, Any],
                extra: list[tuple[str, tuple[Any, ...]]], durable: bool,
                snapshot: dict[str, Any]) -> list[Any]:
        """The event chained, signed and snapshotted, after ``extra``; each statement
        must touch one row; a ``RETURNING`` statement's row is returned, in order."""
        seq, prev = self.heads.get(case, (-1, "sha256:genesis"))
        seq += 1
        text, at = _canon(payload), _now()
        digest = "sha256:" + hashlib.sha256(_canon(
            {"case_id": case, "seq": seq, "kind": kind, "intent_id": intent, "payload": text,
             "prev_digest": prev, "recorded_at": at}).encode()).hexdigest()
        snap = _canon({**snapshot, "head_seq": seq, "head_digest": digest})
        mac = hmac.new(_KEY, digest.encode(), "sha256").hexdigest()
        head: tuple[str, tuple[Any, ...]]
        if seq == 0:
            head = ("INSERT INTO lean_cases VALUES (?, ?, ?, ?, ?)", (case, seq, digest, snap, mac))
        else:
            head = ("UPDATE lean_cases SET head_seq = ?, head_digest = ?, snapshot = ?,"
                    " head_mac = ? WHERE case_id = ? AND head_seq = ? AND head_digest = ?",
                    (seq, digest, snap, mac, case, seq - 1, prev))
        event = ("INSERT INTO lean_events VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                 (case, seq, kind, intent, text, prev, digest, at))
        statements = [*extra, head, event]
        returned = (self._append_pg(statements, durable) if self.pg
                    else self._append_sqlite(statements, durable))
        self.heads[case] = (seq, digest)
        return returned

    def _append_sqlite(self, statements: list[tuple[str, tuple[Any, ...]]],
                       durable: bool) -> list[Any]:
        db = self.db
        returned = []
        if not durable:
            db.execute("PRAGMA synchronous=NORMAL")
        db.execute("BEGIN IMMEDIATE")
        try:
            for sql, binds in statements:
                _answer(sql, db.execute(sql, binds), returned)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        finally:
            if not durable:
                db.execute("PRAGMA synchronous=FULL")
        return returned

    def _append_pg(self, statements: list[tuple[str, tuple[Any, ...]]],
                   durable: bool) -> list[Any]:
        conn = self.pg_ledger
        returned = []
        try:
            with conn.pipeline() as pipe:  # BEGIN and every statement: one round trip
                conn.execute("BEGIN")
                if not durable:
                    conn.execute("SET LOCAL synchronous_commit TO OFF")
                cursors = [conn.execute(sql.replace("?", "%s"), binds)
                           for sql, binds in statements]
                pipe.sync()
                for (sql, _), cur in zip(statements, cursors, strict=True):
                    _answer(sql, cur, returned)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return returned

    def _still_ours(self, impact_key: str, token: int) -> bool:
        sql = "SELECT token, expires_at FROM lean_claims WHERE impact_key = ?"
        row = (self.pg_ledger.execute(sql.replace("?", "%s"), (impact_key,)).fetchone()
               if self.pg else self.db.execute(sql, (impact_key,)).fetchone())
        return row is not None and row[0] == token and row[1] > time.time() + 1

    # -- one call

    def call(self) -> None:
        case = f"{self.prefix}-{self.n // self.case_calls}"
        request = f"r{self.n}"
        self.n += 1
        inputs = {"account_id": self.account, "delta": 1, "request": request}
        if type(inputs["account_id"]) is not int or type(inputs["delta"]) is not int \
                or type(inputs["request"]) is not str:
            raise TypeError("inputs")
        fingerprint = "sha256:" + hashlib.sha256(_canon(
            {"operation_id": OPERATION, "version": 1, "inputs": inputs}).encode()).hexdigest()
        intent, idem = uuid.uuid4().hex, f"{case}:{request}"
        impact_key = f"bench/account/account_id={self.account}"
        cur = self.target.cursor()
        cur.execute(_OPEN, (f"capgate:{intent}", "10000ms", "10000ms", "750ms", intent, idem,
                            fingerprint, case, OPERATION, _now()))
        opened = cur.fetchone()
        if opened is None or opened[0] != 1:
            raise AssertionError("marker")
        prepared = {"operation_id": OPERATION, "version": 1, "inputs": inputs,
                    "idempotency_key": idem, "fingerprint": fingerprint, "attempt": 1,
                    "tx": {"xid": opened[1]}, "impact_keys": [impact_key]}
        (claimed,) = self._append(case, "prepared", intent, prepared, [
            ("INSERT INTO lean_keys VALUES (?, ?)", (idem, intent)),
            # the claim's next token, taken in the transaction (a live holder refuses it)
            ("INSERT INTO lean_claims VALUES (?, COALESCE((SELECT token FROM lean_claims"
             " WHERE impact_key = ?), 0) + 1, ?, ?) ON CONFLICT (impact_key) DO UPDATE"
             " SET token = excluded.token, intent_id = excluded.intent_id,"
             " expires_at = excluded.expires_at WHERE lean_claims.expires_at < ?"
             " RETURNING token", (impact_key, impact_key, intent, time.time() + 30, time.time())),
            ("INSERT INTO lean_slots VALUES (?, ?)", (f"bench:{intent}", intent)),
        ], True, {"intents": {intent: prepared}})
        token = int(claimed[0])
        cur.execute(_UPDATE, (1, self.account))
        if cur.rowcount != 1:
            raise AssertionError("count")
        cur.execute(_VERIFY, (self.account,))
        row = cur.fetchone()
        if row is None or row[0] != 1:
            raise AssertionError("verify")
        cur.execute(_FENCE, (hashlib.sha256(impact_key.encode()).hexdigest(), impact_key,
                             token, intent))
        if cur.fetchone() is None or not self._still_ours(impact_key, token):
            raise AssertionError("fence")
        self.target.commit()
        outcome = {"status": "applied_verified", "counts": [1],
                   "verify": [{"name": "non_negative", "ok": True, "actual": 1}]}
        self._append(case, "observed", intent, {"outcome": outcome}, [
            ("UPDATE lean_claims SET intent_id = NULL, expires_at = 0"
             " WHERE impact_key = ? AND token = ?", (impact_key, token)),
            ("DELETE FROM lean_slots WHERE slot = ?", (f"bench:{intent}",)),
        ], False, {"intents": {}, "last": outcome})

    def close(self) -> None:
        self.target.close()
        if self.pg:
            self.pg_ledger.close()
        else:
            self.db.close()
