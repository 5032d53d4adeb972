"""Collapsed single-row update with one verify: capgate against raw psycopg.

Both sides do the same database work on the same PostgreSQL target in the same
run: UPDATE one row (expected count 1), SELECT a verify check, COMMIT.  capgate
additionally resolves the row, validates the input, records prepared /
attempt_started / observed in its ledger (SQLite file or PostgreSQL), labels
the session, sets server-side timeouts, captures the transaction identity and
inserts the landing marker.  Every call is in a case of 10 calls.

    .venv/bin/python bench/collapsed_call.py [--calls 400] [--dsn postgresql://postgres@127.0.0.1/test]

Prints p50/p99 latency and throughput (1 and 8 concurrent callers, processes)
and their ratios to raw psycopg.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capgate.executor.call import Executor  # noqa: E402
from capgate.executor.connectors import ConnectorConfig, Connectors  # noqa: E402
from capgate.executor.grants import Grants  # noqa: E402
from capgate.executor.ledger import open_ledger  # noqa: E402
from capgate.executor.target import install_at  # noqa: E402
from capgate.registry.loader import validate_texts  # noqa: E402
from capgate.registry.registry import Registry  # noqa: E402

ROW = """
format: 1
connectors: {bench: {}}
rows:
  - operation_id: account.bump
    version: 1
    connector: bench
    description: Add a delta to one account's balance; the balance must stay non-negative.
    input:
      type: object
      additionalProperties: false
      required: [account_id, delta, request]
      properties:
        account_id: {type: integer}
        delta: {type: integer}
        request: {type: string}
    target: {system: bench, object: account, keys: [account_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{request}"
    timeout: {seconds: 10, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {sql: "UPDATE bench_account SET balance = balance + :delta WHERE account_id = :account_id",
         expect_rows: 1}
    verify:
      - name: non_negative
        sql: SELECT count(*) FROM bench_account WHERE account_id = :account_id AND balance >= 0
        expect: {value: 1}
"""
UPDATE = "UPDATE bench_account SET balance = balance + %s WHERE account_id = %s"
VERIFY = "SELECT count(*) FROM bench_account WHERE account_id = %s AND balance >= 0"
ACCOUNTS = 64


def setup(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.bench_account (account_id int PRIMARY KEY,"
                     " balance bigint NOT NULL)")
        conn.execute(f"INSERT INTO {schema}.bench_account SELECT g, 1000 FROM"
                     f" generate_series(1, {ACCOUNTS}) g")
    # capgate's own tables in the target, installed once as `capgate target install` does
    # (a call never runs DDL: without them every call is refused with CG305)
    url = sa.engine.make_url(schema_dsn(dsn, schema)).set(drivername="postgresql+psycopg")
    install_at(url.render_as_string(hide_password=False))


def schema_dsn(dsn: str, schema: str) -> str:
    sep = "&" if "?" in dsn else "?"
    return f"{dsn}{sep}options=-csearch_path%3D{schema}"


def raw_worker(dsn: str, calls: int, worker: int, out: Any) -> None:
    latencies = []
    with psycopg.connect(dsn) as conn:
        for i in range(calls):
            account = worker * 8 + i % 8 + 1
            t0 = time.perf_counter()
            with conn.cursor() as cur:
                cur.execute(UPDATE, (1, account))
                assert cur.rowcount == 1
                cur.execute(VERIFY, (account,))
                row = cur.fetchone()
                assert row is not None and row[0] == 1
            conn.commit()
            latencies.append(time.perf_counter() - t0)
    out.put(latencies)


def capgate_worker(dsn: str, ledger_url: str, calls: int, worker: int, out: Any) -> None:
    result = validate_texts([("bench.yaml", ROW)])
    result.raise_for_problems()
    grants = Grants.from_dict({"principals": {"bench": {"grants": [
        {"connector": "bench", "environments": ["dev"], "access": "write"}]}}})
    url = sa.engine.make_url(dsn).set(drivername="postgresql+psycopg")
    connectors = Connectors({"bench": ConnectorConfig(
        name="bench", url=url.render_as_string(hide_password=False), environment="dev",
        session_budget=16, case_claim_seconds=0.0)})  # new cases on one account: per call
    ex = Executor(Registry(result.rows), connectors, open_ledger(ledger_url), grants)
    run = uuid.uuid4().hex[:8]
    latencies = []
    ex.call("account.bump", {"account_id": worker * 8 + 1, "delta": 0, "request": "warm"},
            case=f"warm-{run}-{worker}", who="bench")
    for i in range(calls):
        account = worker * 8 + i % 8 + 1  # each worker its own accounts: no claim conflicts
        t0 = time.perf_counter()
        outcome = ex.call("account.bump", {"account_id": account, "delta": 1,
                                           "request": f"r{i}"},
                          case=f"bench-{run}-{worker}-{i // 10}", who="bench")
        latencies.append(time.perf_counter() - t0)
        assert outcome.status == "applied_verified", outcome.reason
    ex.connectors.dispose()
    ex.ledger.close()
    out.put(latencies)


def run(kind: str, workers: int, calls: int, dsn: str, ledger_url: str = "") -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for w in range(workers):
        if kind == "raw":
            p = ctx.Process(target=raw_worker, args=(dsn, calls, w, out))
        else:
            p = ctx.Process(target=capgate_worker, args=(dsn, ledger_url, calls, w, out))
        procs.append(p)
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    latencies: list[float] = []
    for _ in procs:
        latencies.extend(out.get(timeout=600))
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    latencies.sort()
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "throughput": len(latencies) / sum(latencies) * workers if workers == 1
        else len(latencies) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    schema = "capgate_bench"
    setup(args.dsn, schema)
    dsn = schema_dsn(args.dsn, schema)
    tmp = Path(tempfile.mkdtemp(prefix="capgate-bench-"))
    ledger_schema = "capgate_bench_ledger"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {ledger_schema} CASCADE")
        conn.execute(f"CREATE SCHEMA {ledger_schema}")
    pg_ledger = schema_dsn(args.dsn.replace("postgresql://", "postgresql+psycopg://"),
                           ledger_schema)
    print(f"# collapsed update + verify, {args.calls} calls per worker, PostgreSQL "
          f"{args.dsn.split('@')[-1]}")
    print(f"{'workers':>7} {'side':<22} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9}"
          f" {'p50 x':>6} {'p99 x':>6} {'tput x':>6}")
    for workers in (1, 8):
        calls = args.calls if workers == 1 else max(50, args.calls // 4)
        raw = run("raw", workers, calls, dsn)
        print(f"{workers:>7} {'raw psycopg':<22} {raw['p50_ms']:>8.3f} {raw['p99_ms']:>8.3f}"
              f" {raw['throughput']:>9.0f}")
        for name, ledger in (("capgate, SQLite ledger", f"sqlite:///{tmp}/ledger-{workers}.db"),
                             ("capgate, PG ledger", pg_ledger)):
            res = run("capgate", workers, calls, dsn, ledger)
            print(f"{workers:>7} {name:<22} {res['p50_ms']:>8.3f} {res['p99_ms']:>8.3f}"
                  f" {res['throughput']:>9.0f} {res['p50_ms'] / raw['p50_ms']:>6.2f}"
                  f" {res['p99_ms'] / raw['p99_ms']:>6.2f}"
                  f" {raw['throughput'] / res['throughput']:>6.2f}")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.execute(f"DROP SCHEMA IF EXISTS {ledger_schema} CASCADE")


if __name__ == "__main__":
    main()
