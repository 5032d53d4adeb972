"""A peer with durable exactly-once transactions, DBOS Transact, on the same write (issue 13).

DBOS Transact (PyPI ``dbos``, pinned to 3.4.0 in the ``bench`` extra of
pyproject.toml) does the write as a durable workflow with one transaction step:

* ``@DBOS.workflow()`` ``bump_workflow(account)``, started under an explicit
  workflow ID (``SetWorkflowID``: DBOS's idempotency key, as capgate's is the
  row's key);
* its one step is a datasource transaction (``SQLAlchemyDatasource.create`` on
  the same PostgreSQL target; ``@ds.transaction(isolation_level=...)``, in DBOS
  3.x the successor of ``@DBOS.transaction`` / ``DBOS.sql_session``) running the
  same ``UPDATE bench_account SET balance = balance + 1 WHERE account_id = ...``
  (rowcount checked) and the same verify ``SELECT count(*) ... AND balance >= 0``
  (value checked) through ``ds.sql_session()``.  DBOS records the step's output
  in the same transaction (its ``datasource_outputs`` table, in a scratch schema
  of the target database) and the workflow's status and step in its system
  database (a scratch PostgreSQL database, created here and dropped at the end).
  Isolation is READ COMMITTED by default, the same as the raw side's (DBOS's
  own default is SERIALIZABLE: ``--isolation SERIALIZABLE``).

Measured with the method of ``bench/call_cost.py``, in one process and one run:
interleaved rounds (the order of the sides rotated every round) of raw psycopg
3 (UPDATE, verify, COMMIT), DBOS, and capgate through its public API
(``capgate.open`` / ``Executor.call`` of ``bench.bump``, the same UPDATE and
verify) with the PostgreSQL ledger and with the SQLite ledger, so that each
ratio to raw comes from the same run.  Each side writes its own row.  DBOS
runs background threads in this process (its notification listener, queue
and scheduler pollers), so the table gives the calling thread's CPU
(``time.thread_time``) beside the process's; every side's call runs in the
calling thread.  Afterwards, not timed, the statements one DBOS workflow sends
to the target and to its system database (SQLAlchemy events).

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python bench/peers_dbos.py [--quick] [--no-capgate] [--json out.json]

The last line of standard output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from call_cost import (  # the same harness: sides, rounds, statistics
    DEFAULT_DSN,
    HMAC_KEY,
    CapgateSide,
    Counter,
    HelpFormatter,
    RawSide,
    Scratch,
    interleaved,
    paired_ratio,
)

PINNED = "3.4.0"
UPDATE = "UPDATE bench_account SET balance = balance + :delta WHERE account_id = :account_id"
VERIFY = "SELECT count(*) FROM bench_account WHERE account_id = :account_id AND balance >= 0"


class DbosSide:
    """DBOS Transact: a workflow with one datasource transaction step, launched here."""

    def __init__(self, scratch: Scratch, account: int, isolation: str) -> None:
        from dbos import DBOS

        self._dbos = DBOS
        self.dsn = scratch.dsn
        self.system_db = f"{scratch.tag}_dbos_sys"
        self.outputs_schema = f"{scratch.tag}_dbos"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.system_db}"')
        try:
            self._start(scratch, account, isolation)
        except BaseException:
            self.close()
            raise

    def _start(self, scratch: Scratch, account: int, isolation: str) -> None:
        from dbos import DBOS, DBOSConfig, SetWorkflowID, SQLAlchemyDatasource

        system_url = sa.make_url(scratch.dsn).set(database=self.system_db)
        config: DBOSConfig = {
            "name": "capgate-bench-dbos",
            "system_database_url": system_url.render_as_string(hide_password=False),
            "application_version": "bench-13",
            "log_level": "WARNING",
        }
        DBOS(config=config)
        ds = SQLAlchemyDatasource.create(scratch.target_url, schema=self.outputs_schema)
        self.ds = ds

        @ds.transaction(isolation_level=isolation)
        def bump_step(account_id: int) -> int:
            session = ds.sql_session()
            updated = session.execute(sa.text(UPDATE), {"delta": 1, "account_id": account_id})
            if updated.rowcount != 1:
                raise AssertionError(f"DBOS UPDATE touched {updated.rowcount} rows")
            value = session.execute(sa.text(VERIFY), {"account_id": account_id}).scalar_one()
            if value != 1:
                raise AssertionError(f"DBOS verify answered {value}")
            return int(value)

        @DBOS.workflow()
        def bump_workflow(account_id: int) -> int:
            return int(bump_step(account_id))

        DBOS.launch()
        self._workflow = bump_workflow
        self._set_id = SetWorkflowID
        self.account = account
        self.prefix = f"dbos-{uuid.uuid4().hex[:8]}"
        self.n = 0

    def call(self) -> None:
        with self._set_id(f"{self.prefix}-{self.n}"):
            result = self._workflow(self.account)
        self.n += 1
        if result != 1:
            raise AssertionError(f"DBOS workflow answered {result}")

    def engines(self) -> dict[str, sa.Engine]:
        """The engines to count statements on: the target (datasource) and the system database."""
        from dbos._dbos import _get_dbos_instance  # private: for the statement count only

        return {"target": self.ds.engine, "system": _get_dbos_instance()._sys_db.engine}

    def close(self) -> None:
        self._dbos.destroy(destroy_registry=True)
        if hasattr(self, "ds"):
            self.ds.engine.dispose()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.system_db}" WITH (FORCE)')
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.outputs_schema}" CASCADE')


def count_dbos(side: DbosSide, n: int) -> dict[str, Any]:
    """Statements and commits of ``n`` DBOS workflows (not timed)."""
    counter = Counter()
    try:
        for name, engine in side.engines().items():
            counter.watch(engine, name)
    except Exception as exc:  # the private path moved: say so, measure the rest
        return {"error": f"{type(exc).__name__}: {exc}"}
    side.call()
    counter.reset()
    sample: dict[str, list[str]] = {}
    for i in range(n):
        before = {name: len(s) for name, s in counter.statements.items()}
        side.call()
        if i == n // 2:
            sample = {name: s[before[name]:] for name, s in counter.statements.items()}
    per = {name: {k: v / n for k, v in c.items()} for name, c in counter.counts.items()}
    return {"per_call": per, "sample_call": sample, "calls": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--dsn", default=DEFAULT_DSN,
                    help="PostgreSQL (libpq URI): the target's database; the DBOS system "
                    "database is created beside it")
    ap.add_argument("--quick", action="store_true", help="a short run")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    ap.add_argument("--round-calls", type=int, default=25, help="calls per side a round")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up calls per side, not timed")
    ap.add_argument("--case-calls", type=int, default=10, help="capgate calls per case")
    ap.add_argument("--isolation", default="READ COMMITTED",
                    choices=("READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"),
                    help="the DBOS transaction's isolation level")
    ap.add_argument("--no-capgate", action="store_true", help="raw and DBOS only")
    ap.add_argument("--count-calls", type=int, default=20,
                    help="DBOS workflows counted for the statement count")
    ap.add_argument("--keep", action="store_true", help="keep the scratch schemas and folder")
    ap.add_argument("--json", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.round_calls, args.warmup = 6, 15, 10
    os.environ["CAPGATE_LEDGER_HMAC_KEY"] = HMAC_KEY
    logging.getLogger("dbos").setLevel(logging.WARNING)

    dbos_version = version("dbos")
    if dbos_version != PINNED:
        print(f"# warning: dbos {dbos_version} installed, the bench pins {PINNED}")
    load_before = os.getloadavg()
    started = time.time()
    info: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                            "dbos": dbos_version, "isolation": args.isolation,
                            "load_before": load_before, "quick": args.quick}
    print(f"# DBOS Transact {dbos_version} against raw psycopg {psycopg.__version__}"
          f" (and capgate), {info['when']}, {info['cpus']} CPUs, load average "
          f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")

    scratch = Scratch(args.dsn, keep=args.keep)
    results: dict[str, Any] = {"info": info}
    closers: list[Any] = []
    try:
        scratch.create()
        raw = RawSide(scratch.raw_dsn, account=11)
        closers.append(raw)
        dbos_side = DbosSide(scratch, 12, args.isolation)
        closers.append(dbos_side)
        sides: dict[str, Any] = {"raw": raw.call, "dbos": dbos_side.call}
        if not args.no_capgate:
            pg = CapgateSide(scratch.config("pg"), 13, "peer-pg", args.case_calls)
            sqlite = CapgateSide(scratch.config("sqlite"), 14, "peer-sqlite", args.case_calls)
            closers += [pg, sqlite]
            sides |= {"capgate_pg": pg.call, "capgate_sqlite": sqlite.call}
        samples = interleaved(sides, args.rounds, args.round_calls, args.warmup)
        results["counts"] = count_dbos(dbos_side, args.count_calls)
    finally:
        for closer in reversed(closers):
            closer.close()
        scratch.drop()

    out: dict[str, Any] = {name: s.summary() for name, s in samples.items()}
    for name in out:
        out[name]["p50_ratio"] = out[name]["p50_ms"] / out["raw"]["p50_ms"]
        out[name]["p95_ratio"] = out[name]["p95_ms"] / out["raw"]["p95_ms"]
        out[name]["p50_ratio_paired"] = paired_ratio(samples[name], samples["raw"])
    results["latency"] = out
    info["load_after"] = os.getloadavg()
    info["seconds"] = time.time() - started
    method = (f"{args.rounds} interleaved rounds x {args.round_calls} calls per side (order "
              f"rotated), {args.warmup} warm-up calls each; capgate cases of "
              f"{args.case_calls} calls; DBOS isolation {args.isolation}")
    info["method"] = method
    print(f"\n## {method}")
    print(f"{'side':<28} {'p50 ms':>8} {'p95 ms':>8} {'p50 x':>6} {'p50 x*':>6} {'p95 x':>6}"
          f" {'cpu ms':>7} {'thr cpu':>7}")
    labels = {"raw": "raw psycopg", "dbos": f"DBOS {dbos_version} workflow+tx",
              "capgate_pg": "capgate, PostgreSQL ledger",
              "capgate_sqlite": "capgate, SQLite ledger"}
    for name, s in out.items():
        print(f"{labels[name]:<28} {s['p50_ms']:>8.3f} {s['p95_ms']:>8.3f} {s['p50_ratio']:>6.2f}"
              f" {s['p50_ratio_paired']:>6.2f} {s['p95_ratio']:>6.2f}"
              f" {s['cpu_ms_per_call']:>7.3f} {s['thread_cpu_ms_per_call']:>7.3f}")
    print("  x: p50 / raw p50;  x*: median over rounds of the same-round ratio;"
          "  cpu: process CPU per call (DBOS's background threads included);"
          "  thr cpu: the calling thread's")
    compare: dict[str, Any] = {}
    for name in ("capgate_pg", "capgate_sqlite"):
        if name in out:
            compare[name] = out[name]["p50_ratio"] / out["dbos"]["p50_ratio"]
    if compare:
        results["capgate_ratio_over_dbos_ratio"] = compare
        print("  capgate's p50 ratio / DBOS's p50 ratio: "
              + ", ".join(f"{labels[k]} {v:.2f}" for k, v in compare.items())
              + "  (issue 13's target: at most 0.5)")
    counts = results["counts"]
    if "per_call" in counts:
        per = counts["per_call"]
        print(f"  statements per DBOS workflow (mean of {counts['calls']}; not timed): "
              + "; ".join(f"{name}: {c['statements']:.1f} statements, {c['commits']:.1f} "
                          f"commits ({c['write_commits'] + c['autocommit_writes']:.1f} wrote)"
                          for name, c in per.items()))
    else:
        print(f"  statement count skipped: {counts.get('error')}")
    print(f"# load average at the end {info['load_after'][0]:.2f}; {info['seconds']:.0f} s")
    line = json.dumps(results, default=float, separators=(",", ":"))
    if args.json:
        args.json.write_text(line + "\n", "utf-8")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
