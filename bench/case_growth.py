"""What one call's ledger events cost as its case grows (a known shortfall, measured).

A call records three durable events in its case (``prepared``,
``attempt_started``, ``observed``).  Each append rewrites the case's snapshot,
``fold(events)``, which holds every intent the case ever had with its inputs
and outcome record; so the cost of a call grows with the number of calls
already in its case, and a case of N calls costs O(N^2) in all.

For each case length the benchmark times the three appends of one more call
(median of ``--samples`` calls) and, in the same run, the raw driver doing
the same durable work without a snapshot: three INSERTs of the same payloads,
each committed, into a SQLite table on the same disk with the same
``synchronous=FULL``.

    .venv/bin/python bench/case_growth.py [--lengths 10,100,500,1000,2000] [--samples 5]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capgate.executor.ledger import Ledger, open_ledger  # noqa: E402

STATE: dict[str, Any] = {
    "operation_id": "policy.add_note", "version": 1, "row_hash": "sha256:" + "a" * 64,
    "idempotency_key": "k", "fingerprint": "f" * 64, "connector": "insurance",
    "environment": "dev", "who": "claims-agent", "effect_class": "transactional",
    "recovery": "retryable", "plan_hash": "p" * 64, "attempt": 0,
    "inputs": {"policy_id": 1, "author": "jdoe", "body": "Holder asked for a paper schedule."},
}
OUTCOME: dict[str, Any] = {
    "status": "applied", "reason": None,
    "evidence": {"statements": [{"rows": 1}], "verify": [{"name": "note_stored", "ok": True}]},
}


def events() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("prepared", {"request": {"operation_id": "policy.add_note"}, "state": STATE}),
        ("attempt_started", {"state": {"attempt": 1, "tx": {"xid": 1234}}}),
        ("observed", {"outcome": OUTCOME, "state": {"outcome": "applied",
                                                     "outcome_record": OUTCOME}}),
    ]


def one_call(ledger: Ledger, case: str) -> float:
    intent = uuid.uuid4().hex
    t0 = time.perf_counter()
    for kind, payload in events():
        ledger.append(case, kind, payload, intent_id=intent)
    return time.perf_counter() - t0


def one_raw_call(db: sqlite3.Connection, case: str) -> float:
    intent = uuid.uuid4().hex
    t0 = time.perf_counter()
    for kind, payload in events():
        db.execute("INSERT INTO ev (case_id, intent_id, kind, payload) VALUES (?, ?, ?, ?)",
                   (case, intent, kind, json.dumps(payload, sort_keys=True)))
        db.commit()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="10,100,500,1000,2000")
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    with tempfile.TemporaryDirectory(prefix="capgate-case-growth-") as tmp:
        ledger = open_ledger(f"sqlite:///{tmp}/ledger.db", hmac_key=b"bench")
        db = sqlite3.connect(f"{tmp}/raw.db")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE ev (seq INTEGER PRIMARY KEY, case_id TEXT, intent_id TEXT, "
                   "kind TEXT, payload TEXT)")
        case, done = "GROWTH-1", 0
        print(f"{'calls in the case':>18} | {'capgate ms':>10} | {'raw ms':>7} | ratio")
        for length in lengths:
            while done < length - args.samples:
                one_call(ledger, case)
                done += 1
            ours = [one_call(ledger, case) for _ in range(args.samples)]
            raw = [one_raw_call(db, case) for _ in range(args.samples)]
            done += args.samples
            ms, raw_ms = statistics.median(ours) * 1e3, statistics.median(raw) * 1e3
            print(f"{length:>18} | {ms:>10.1f} | {raw_ms:>7.2f} | {ms / raw_ms:>5.1f}")
        snapshot = ledger.snapshot(case) or {}
        size = len(json.dumps(snapshot))
        print(f"snapshot of the case after {done} calls: {size / 1e6:.1f} MB "
              f"({size // max(done, 1)} bytes per call), rewritten by every append")
        ledger.close()
        db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
