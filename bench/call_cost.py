"""What a collapsed write costs through the public API, against raw psycopg 3 (issue 13).

Both sides do the same database work on the same PostgreSQL target, in the same
process, in the same run:

* **raw**: psycopg 3, one connection kept open, ``UPDATE bench_account SET
  balance = balance + 1 WHERE account_id = %s`` (rowcount checked), the verify
  ``SELECT count(*) ... AND balance >= 0`` (value checked), ``COMMIT``;
* **capgate**: ``capgate.open(capgate.toml)`` and ``Executor.call`` of the row
  ``bench.bump`` declared here (a collapsed ``transactional`` write with that one
  UPDATE, expected count 1, and that one verify, expected value 1; no replay).
  On top of the same work capgate resolves the row, validates the input, checks
  the grant, records ``prepared`` / ``attempt_started`` / ``observed`` in its
  ledger (a SQLite file in WAL with ``synchronous=FULL``, or PostgreSQL), claims
  the idempotency key, the impact key and a session-budget slot, labels the
  session, sets the server-side timeouts, captures the transaction identity and
  inserts the landing marker.  The ledger heads are HMAC-signed
  (``CAPGATE_LEDGER_HMAC_KEY`` is set; ``--no-hmac`` turns it off).

Method: rounds are interleaved -- every round runs ``--round-calls`` calls of each
side, the order of the sides rotated from round to round -- so that drift on
this shared machine hits every side alike.  Each side writes its own row; each
call of a capgate side is in a case of ``--case-calls`` calls (a new case after
that), unless said otherwise.  Wall time is ``time.perf_counter``; CPU is
``time.process_time`` of the calling process (it includes the in-process
SQLite library's own work).

Sections (each can be skipped):

``latency``   p50 / p95 per side and the p50 ratio to raw, SQLite and PostgreSQL
              ledgers; CPU per call in the calling process; and issue 13's
              physical floor, measured as two more sides: one intent row
              committed durably (SQLite WAL + ``synchronous=FULL``, or
              PostgreSQL) and then the raw transaction, with no capgate code;
``growth``    one case of ``--growth-calls`` calls (600+), each capgate call
              followed by one raw call: the cost of call 600 against call 1
              (windows of 10 calls around each, and the same ratio normalised
              by the raw calls next to them);
``workers``   ``--workers`` processes (8), each its own raw connection, its own
              executor over the shared PostgreSQL ledger, its own target row and
              its own cases -- independent agents sharing one ledger; timed
              rounds alternate raw and capgate; throughput raw / capgate;
``counts``    (not timed) the statements each capgate call sends to the target
              and to the ledger, and the ledger's commits, from SQLAlchemy's
              ``before_cursor_execute`` / ``commit`` events.

It needs only PostgreSQL (trust auth; ``--dsn``).  Scratch schemas
``cg13_<random>_{target,ledger}`` are created in that database and dropped at the
end, with the temporary folder holding the SQLite ledger and ``capgate.toml``.
Nothing here imports from ``tests/``.

    .venv/bin/python bench/call_cost.py                # the full run (a few minutes)
    .venv/bin/python bench/call_cost.py --quick        # a short run (about a minute)
    .venv/bin/python bench/call_cost.py --only latency,counts --json out.json

Prints a table per section, the targets of issue 13 with the measured value,
and, as the last line of standard output, one JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
# this folder for _support (which then takes it off again), also in a spawned worker, which
# starts with the parent's path
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from _support import RoundTrips, bench_module  # noqa: E402

import capgate  # noqa: E402
from capgate.executor.target import install_at  # noqa: E402
from capgate.registry.loader import update_lock  # noqa: E402

lean_call = bench_module("lean_call")

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
OPERATION = "bench.bump"
AGENT = "bench-agent"
HMAC_KEY = "capgate-bench-13-hmac-key"

ROW_YAML = """\
format: 1
connectors: {bench: {}}
rows:
  - operation_id: bench.bump
    version: 1
    connector: bench
    description: >
      Add a delta to one account's balance; the balance must stay non-negative.
      The same work as the raw side of bench/call_cost.py: one UPDATE, one verify.
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
RAW_UPDATE = "UPDATE bench_account SET balance = balance + %s WHERE account_id = %s"
RAW_VERIFY = "SELECT count(*) FROM bench_account WHERE account_id = %s AND balance >= 0"
ACCOUNTS = 256

# issue 13's table: (key, what, target, comparison)
TARGETS = [
    ("p50_ratio_sqlite", "collapsed write p50 / raw p50, public API, SQLite ledger", 3.0, "<="),
    ("p50_ratio_pg", "the same, PostgreSQL ledger", 3.5, "<="),
    ("cpu_ms_per_call", "CPU per collapsed call in the calling process (ms)", 0.6, "<="),
    ("growth_ratio", "call 600 of one case against call 1", 1.3, "<="),
    ("workers_ratio", "8 workers, throughput raw / capgate, PostgreSQL ledger", 1.5, "<="),
]


# --------------------------------------------------------------------------- set-up


def with_search_path(dsn: str, schema: str, *, driver: str | None = None) -> str:
    """``dsn`` (a libpq URI) pointed at ``schema``; with ``driver``, a SQLAlchemy URL."""
    url = sa.make_url(dsn)
    if driver is not None:
        url = url.set(drivername=driver)
    url = url.update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False)


def libpq(url: str) -> str:
    """A SQLAlchemy ``postgresql+psycopg://`` URL as the libpq URI psycopg takes."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@dataclass
class Scratch:
    """Scratch schemas in the target database and a temporary folder; dropped at the end."""

    dsn: str
    keep: bool = False
    tag: str = field(default_factory=lambda: f"cg13_{uuid.uuid4().hex[:8]}")
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="capgate-cost-")))

    @property
    def target_schema(self) -> str:
        return f"{self.tag}_target"

    @property
    def ledger_schema(self) -> str:
        return f"{self.tag}_ledger"

    @property
    def target_url(self) -> str:
        """The connector's URL (SQLAlchemy, psycopg 3)."""
        return with_search_path(self.dsn, self.target_schema, driver="postgresql+psycopg")

    @property
    def raw_dsn(self) -> str:
        """The same database and search path, as a libpq URI for raw psycopg."""
        return libpq(self.target_url)

    @property
    def pg_ledger_url(self) -> str:
        return with_search_path(self.dsn, self.ledger_schema, driver="postgresql+psycopg")

    @property
    def sqlite_ledger_url(self) -> str:
        return f"sqlite:///{self.folder / 'ledger.db'}"

    def create(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for schema in (self.target_schema, self.ledger_schema):
                conn.execute(f'CREATE SCHEMA "{schema}"')
            conn.execute(f'CREATE TABLE "{self.target_schema}".bench_account ('
                         "account_id int PRIMARY KEY, balance bigint NOT NULL)")
            conn.execute(f'INSERT INTO "{self.target_schema}".bench_account '
                         f"SELECT g, 1000 FROM generate_series(1, {ACCOUNTS}) g")
        # capgate's own tables in the target (capgate_landed, capgate_fence), created
        # once by a privileged account, as `capgate target install` does
        install_at(self.target_url)
        caps = self.folder / "capabilities"
        caps.mkdir()
        (caps / "bench.yaml").write_text(ROW_YAML, "utf-8")
        update_lock([caps])  # pinned, as `capgate lock` does after a review
        (self.folder / "grants.toml").write_text(
            f'[principals.{AGENT}]\n'
            'grants = [{ connector = "bench", environments = ["dev"], access = "write" }]\n',
            "utf-8")
        for name, ledger in (("sqlite", self.sqlite_ledger_url), ("pg", self.pg_ledger_url)):
            (self.folder / f"capgate-{name}.toml").write_text(
                "[capgate]\n"
                'capabilities = ["capabilities"]\n'
                'grants = "grants.toml"\n'
                f"ledger = {json.dumps(ledger)}\n"
                f'agent = "{AGENT}"\n'
                "\n[connectors.bench]\n"
                f"url = {json.dumps(self.target_url)}\n"
                'environment = "dev"\n'
                "session_budget = 16\n"
                # a new case every few calls on one account: claims per call (issue 17's
                # case-held claims would make each next case ask for a coordination decision)
                "case_claim_seconds = 0\n",
                "utf-8")

    def config(self, ledger: str) -> Path:
        """``capgate.toml`` for ``ledger`` (``"sqlite"`` or ``"pg"``)."""
        return self.folder / f"capgate-{ledger}.toml"

    def drop(self) -> None:
        if self.keep:
            print(f"# kept: schemas {self.target_schema}, {self.ledger_schema}; {self.folder}")
            return
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for schema in (self.target_schema, self.ledger_schema):
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        shutil.rmtree(self.folder, ignore_errors=True)


# --------------------------------------------------------------------------- the sides


class RawSide:
    """Raw psycopg 3: UPDATE (rowcount 1), verify SELECT (value 1), COMMIT."""

    def __init__(self, dsn: str, account: int) -> None:
        self.conn = psycopg.connect(dsn)
        self.account = account

    def call(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute(RAW_UPDATE, (1, self.account))
            if cur.rowcount != 1:
                raise AssertionError(f"raw UPDATE touched {cur.rowcount} rows")
            cur.execute(RAW_VERIFY, (self.account,))
            row = cur.fetchone()
            if row is None or row[0] != 1:
                raise AssertionError(f"raw verify answered {row}")
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()


class FloorSide:
    """The physical floor of issue 13: one local durable commit of an intent, then raw.

    ``sqlite``: a ~300-byte intent row committed to a SQLite file in WAL with
    ``synchronous=FULL`` (the SQLite ledger's settings); ``pg``: the same row
    committed (autocommit) to a table in the PostgreSQL ledger's schema.  Then the
    raw transaction on its own row.  No capgate code runs: this is what a write
    that records its intent durably before it acts cannot go below.
    """

    INTENT = json.dumps({"operation_id": OPERATION, "version": 1, "case": "c" * 20,
                         "intent": "i" * 32, "idempotency_key": "k" * 40,
                         "inputs": {"account_id": 1, "delta": 1, "request": "r1"},
                         "digest": "sha256:" + "d" * 64}, separators=(",", ":"))

    def __init__(self, scratch: Scratch, store: str, account: int) -> None:
        self.raw = RawSide(scratch.raw_dsn, account)
        self.store = store
        if store == "sqlite":
            self.db = sqlite3.connect(scratch.folder / "floor.db", isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("CREATE TABLE IF NOT EXISTS intents "
                            "(seq INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        else:
            dsn = libpq(with_search_path(scratch.dsn, scratch.ledger_schema))
            self.pg = psycopg.connect(dsn, autocommit=True)
            self.pg.execute("CREATE TABLE IF NOT EXISTS floor_intents "
                            "(seq bigserial PRIMARY KEY, body text NOT NULL)")

    def call(self) -> None:
        if self.store == "sqlite":
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("INSERT INTO intents (body) VALUES (?)", (self.INTENT,))
            self.db.execute("COMMIT")
        else:
            self.pg.execute("INSERT INTO floor_intents (body) VALUES (%s)", (self.INTENT,))
        self.raw.call()

    def close(self) -> None:
        self.raw.close()
        if self.store == "sqlite":
            self.db.close()
        else:
            self.pg.close()


class CapgateSide:
    """``capgate.open(config)`` and ``Executor.call("bench.bump", ...)``, the public API.

    ``case_calls``: calls per case before the next case starts (0: one case for all).
    """

    def __init__(self, config: Path, account: int, prefix: str, case_calls: int) -> None:
        self._cm = capgate.open(config)
        self.gate = self._cm.__enter__()
        self.account = account
        self.prefix = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.case_calls = case_calls
        self.n = 0

    def call(self) -> None:
        case = self.prefix if self.case_calls == 0 else f"{self.prefix}-{self.n // self.case_calls}"
        outcome = self.gate.call(OPERATION, {"account_id": self.account, "delta": 1,
                                             "request": f"r{self.n}"},
                                 case=case, who=AGENT)
        self.n += 1
        if outcome.status != "applied_verified":
            raise AssertionError(f"capgate call {self.n}: {outcome.status} {outcome.reason}")

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


# --------------------------------------------------------------------------- statistics


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (``q`` in 0..1) of ``values``."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(q * len(ordered) + 0.999999)))
    return ordered[rank - 1]


@dataclass
class Samples:
    """Per-call wall and CPU times of one side, kept per round."""

    wall: list[list[float]] = field(default_factory=list)
    cpu: list[list[float]] = field(default_factory=list)
    thread_cpu: list[list[float]] = field(default_factory=list)

    def add_round(self, wall: list[float], cpu: list[float], thread_cpu: list[float]) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)
        self.thread_cpu.append(thread_cpu)

    @property
    def all_wall(self) -> list[float]:
        return [x for r in self.wall for x in r]

    @property
    def all_cpu(self) -> list[float]:
        return [x for r in self.cpu for x in r]

    def summary(self) -> dict[str, float]:
        wall, cpu = self.all_wall, self.all_cpu
        thread_cpu = [x for r in self.thread_cpu for x in r]
        return {
            "calls": len(wall),
            "p50_ms": statistics.median(wall) * 1e3,
            "p95_ms": quantile(wall, 0.95) * 1e3,
            "mean_ms": statistics.fmean(wall) * 1e3,
            "cpu_ms_per_call": sum(cpu) / len(cpu) * 1e3,
            "cpu_p50_ms": statistics.median(cpu) * 1e3,
            "thread_cpu_ms_per_call": sum(thread_cpu) / len(thread_cpu) * 1e3,
        }


def timed(call: Callable[[], Any], n: int) -> tuple[list[float], list[float], list[float]]:
    """``n`` calls; each call's wall, process-CPU and calling-thread-CPU seconds."""
    wall: list[float] = []
    cpu: list[float] = []
    thread_cpu: list[float] = []
    perf, proc, thread = time.perf_counter, time.process_time, time.thread_time
    for _ in range(n):
        h0, c0, t0 = thread(), proc(), perf()
        call()
        t1, c1, h1 = perf(), proc(), thread()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
        thread_cpu.append(h1 - h0)
    return wall, cpu, thread_cpu


def interleaved(sides: dict[str, Callable[[], Any]], rounds: int, calls: int,
                warmup: int) -> dict[str, Samples]:
    """Rounds of ``calls`` calls of every side, the order rotated each round."""
    names = list(sides)
    for name in names:
        timed(sides[name], warmup)
    samples = {name: Samples() for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            samples[name].add_round(*timed(sides[name], calls))
    return samples


def paired_ratio(side: Samples, raw: Samples) -> float:
    """Median over rounds of (this side's round p50 / raw's p50 in the same round)."""
    return statistics.median(statistics.median(s) / statistics.median(r)
                             for s, r in zip(side.wall, raw.wall, strict=True))


# --------------------------------------------------------------------------- sections


def section_latency(scratch: Scratch, args: argparse.Namespace) -> dict[str, Any]:
    """p50 / p95 per side and the ratios, one process, interleaved rounds."""
    raw = RawSide(scratch.raw_dsn, account=1)
    sqlite = CapgateSide(scratch.config("sqlite"), 2, "lat-sqlite", args.case_calls)
    pg = CapgateSide(scratch.config("pg"), 3, "lat-pg", args.case_calls)
    floor_sqlite = FloorSide(scratch, "sqlite", 9)
    floor_pg = FloorSide(scratch, "pg", 10)
    lean_sqlite = lean_call.LeanSide(scratch.raw_dsn, "sqlite", scratch.folder, 11,
                                     args.case_calls)
    lean_pg = lean_call.LeanSide(scratch.raw_dsn,
                                 libpq(with_search_path(scratch.dsn, scratch.ledger_schema)),
                                 scratch.folder, 12, args.case_calls)
    try:
        samples = interleaved({"raw": raw.call, "capgate_sqlite": sqlite.call,
                               "capgate_pg": pg.call, "floor_sqlite": floor_sqlite.call,
                               "floor_pg": floor_pg.call, "lean_sqlite": lean_sqlite.call,
                               "lean_pg": lean_pg.call},
                              args.rounds, args.round_calls, args.warmup)
    finally:
        for side in (raw, sqlite, pg, floor_sqlite, floor_pg, lean_sqlite, lean_pg):
            side.close()
    out: dict[str, Any] = {name: s.summary() for name, s in samples.items()}
    base = out["raw"]
    for name in out:
        out[name]["p50_ratio"] = out[name]["p50_ms"] / base["p50_ms"]
        out[name]["p95_ratio"] = out[name]["p95_ms"] / base["p95_ms"]
        out[name]["p50_ratio_paired"] = paired_ratio(samples[name], samples["raw"])
        out[name]["cpu_above_raw_ms"] = out[name]["cpu_ms_per_call"] - base["cpu_ms_per_call"]
    out["method"] = (f"{args.rounds} interleaved rounds x {args.round_calls} calls per side "
                     f"(order rotated), {args.warmup} warm-up calls each; cases of "
                     f"{args.case_calls} calls")
    print(f"\n## latency: {out['method']}")
    print(f"{'side':<36} {'p50 ms':>8} {'p95 ms':>8} {'p50 x':>6} {'p50 x*':>6} {'p95 x':>6}"
          f" {'cpu ms':>7} {'cpu p50':>7}")
    for name, label in (("raw", "raw psycopg"), ("capgate_sqlite", "capgate, SQLite ledger"),
                        ("capgate_pg", "capgate, PostgreSQL ledger"),
                        ("floor_sqlite", "floor: durable SQLite commit + raw"),
                        ("floor_pg", "floor: durable PostgreSQL commit + raw"),
                        ("lean_sqlite", "lean: capgate's work inline, SQLite"),
                        ("lean_pg", "lean: capgate's work inline, PG")):
        s = out[name]
        print(f"{label:<36} {s['p50_ms']:>8.3f} {s['p95_ms']:>8.3f} {s['p50_ratio']:>6.2f}"
              f" {s['p50_ratio_paired']:>6.2f} {s['p95_ratio']:>6.2f}"
              f" {s['cpu_ms_per_call']:>7.3f} {s['cpu_p50_ms']:>7.3f}")
    print("  x: p50 of all calls / raw p50;  x*: median over rounds of the same-round ratio;"
          "  cpu: process CPU per call (mean, median);  floor: one intent row committed"
          " durably, then the raw transaction (no capgate code);  lean: the same ledger and"
          " target work as a capgate call in straight-line Python (bench/lean_call.py)")
    return out


def section_growth(scratch: Scratch, args: argparse.Namespace, ledger: str) -> dict[str, Any]:
    """One case of ``--growth-calls`` calls; each capgate call followed by one raw call."""
    raw = RawSide(scratch.raw_dsn, account=4)
    side = CapgateSide(scratch.config(ledger), 5 if ledger == "sqlite" else 6,
                       f"growth-{ledger}", case_calls=0)
    raw_wall: list[float] = []
    cg_wall: list[float] = []
    cg_cpu: list[float] = []
    try:
        timed(raw.call, args.warmup)
        for _ in range(args.growth_calls):
            w, c, _ = timed(side.call, 1)
            cg_wall += w
            cg_cpu += c
            raw_wall += timed(raw.call, 1)[0]
    finally:
        raw.close()
        side.close()
    n, half = args.growth_calls, 5

    def window(values: list[float], at: int) -> float:  # calls at-5 .. at+4 (1-based)
        lo = max(0, at - 1 - half)
        return statistics.median(values[lo:lo + 2 * half])

    late_at = min(600, n - half)
    early, late = statistics.median(cg_wall[:2 * half]), window(cg_wall, late_at)
    early_raw, late_raw = statistics.median(raw_wall[:2 * half]), window(raw_wall, late_at)
    out = {
        "ledger": ledger, "calls": n,
        "call1_ms": cg_wall[0] * 1e3, "call600_ms": cg_wall[min(599, n - 1)] * 1e3,
        "early_ms": early * 1e3, "late_ms": late * 1e3, "late_at": late_at,
        "ratio": late / early,
        "ratio_raw_normalised": (late / late_raw) / (early / early_raw),
        "early_raw_ms": early_raw * 1e3, "late_raw_ms": late_raw * 1e3,
        "early_cpu_ms": statistics.median(cg_cpu[:2 * half]) * 1e3,
        "late_cpu_ms": window(cg_cpu, late_at) * 1e3,
        "cpu_ratio": window(cg_cpu, late_at) / statistics.median(cg_cpu[:2 * half]),
        "by_100": {str(k): window(cg_wall, k) * 1e3
                   for k in range(100, n - half + 1, 100)},
    }
    label = "SQLite" if ledger == "sqlite" else "PostgreSQL"
    print(f"\n## growth, {label} ledger: one case of {n} calls, each followed by a raw call")
    print(f"  calls 1-10: {out['early_ms']:.2f} ms (cpu {out['early_cpu_ms']:.2f});"
          f" calls {late_at - half}-{late_at + half - 1}: {out['late_ms']:.2f} ms"
          f" (cpu {out['late_cpu_ms']:.2f});  ratio {out['ratio']:.2f},"
          f" normalised by the raw calls beside them {out['ratio_raw_normalised']:.2f},"
          f" CPU ratio {out['cpu_ratio']:.2f}")
    print(f"  single calls: call 1 {out['call1_ms']:.2f} ms, call {min(600, n)} "
          f"{out['call600_ms']:.2f} ms;"
          "  median of 10 around call k: "
          + ", ".join(f"{k}: {v:.1f}" for k, v in out["by_100"].items()))
    return out


def _worker(config: str, dsn: str, lean_ledger: str, account: int, prefix: str,
            case_calls: int, warmup: int, hmac: str | None, barrier: Any, pipe: Any) -> None:
    """A worker process: its own raw connection, executor, lean side, row and cases."""
    if hmac is not None:
        os.environ["CAPGATE_LEDGER_HMAC_KEY"] = hmac
    raw = RawSide(dsn, account)
    cg = CapgateSide(Path(config), account, prefix, case_calls)
    lean = lean_call.LeanSide(dsn, lean_ledger, Path(config).parent, account + 50,
                              case_calls)
    sides = {"raw": raw.call, "capgate": cg.call, "lean": lean.call}
    try:
        for call in sides.values():
            timed(call, warmup)
        pipe.send("ready")
        while True:
            msg = pipe.recv()
            if msg is None:
                break
            kind, seconds = msg
            call = sides[kind]
            barrier.wait()
            lat: list[float] = []
            c0, t0 = time.process_time(), time.perf_counter()
            deadline = t0 + seconds
            now = t0
            while now < deadline:
                call()
                end = time.perf_counter()
                lat.append(end - now)
                now = end
            pipe.send({"start": t0, "end": now, "calls": len(lat), "lat": lat,
                       "cpu": time.process_time() - c0})
    finally:
        raw.close()
        cg.close()
        lean.close()


def section_workers(scratch: Scratch, args: argparse.Namespace) -> dict[str, Any]:
    """``--workers`` processes; timed rounds rotate raw, capgate and lean (PostgreSQL
    ledgers)."""
    ctx = mp.get_context("spawn")
    n = args.workers
    lean_ledger = libpq(with_search_path(scratch.dsn, scratch.ledger_schema))
    lean_call.LeanSide(scratch.raw_dsn, lean_ledger, scratch.folder, 0).close()  # its tables
    barrier = ctx.Barrier(n)
    pipes, procs = [], []
    hmac = None if args.no_hmac else HMAC_KEY
    for w in range(n):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(
            str(scratch.config("pg")), scratch.raw_dsn, lean_ledger, 100 + w, f"w{w}",
            args.case_calls,
            args.warmup, hmac, barrier, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    kinds = ("raw", "capgate", "lean")
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    try:
        for p in pipes:
            if not p.poll(300):
                raise RuntimeError("a worker did not start within 300 s")
            if p.recv() != "ready":
                raise RuntimeError("a worker failed to start")
        for r in range(args.worker_rounds):
            for kind in kinds[r % 3:] + kinds[:r % 3]:
                for p in pipes:
                    p.send((kind, args.worker_seconds))
                res = [p.recv() for p in pipes]
                calls = sum(x["calls"] for x in res)
                wall = max(x["end"] for x in res) - min(x["start"] for x in res)
                lat = [v for x in res for v in x["lat"]]
                rounds[kind].append({"calls": calls, "wall": wall, "tput": calls / wall,
                                     "p50_ms": statistics.median(lat) * 1e3,
                                     "p95_ms": quantile(lat, 0.95) * 1e3,
                                     "cpu_ms_per_call": sum(x["cpu"] for x in res) / calls * 1e3})
    finally:
        for p in pipes:
            with contextlib.suppress(Exception):
                p.send(None)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    tput = {k: statistics.median(x["tput"] for x in v) for k, v in rounds.items()}
    paired = statistics.median(a["tput"] / b["tput"]
                               for a, b in zip(rounds["raw"], rounds["capgate"], strict=True))
    out = {
        "workers": n, "rounds_per_side": len(rounds["raw"]), "seconds_per_round":
        args.worker_seconds, "raw_tput": tput["raw"], "capgate_tput": tput["capgate"],
        "ratio": tput["raw"] / tput["capgate"], "ratio_paired": paired,
        "raw_p50_ms": statistics.median(x["p50_ms"] for x in rounds["raw"]),
        "capgate_p50_ms": statistics.median(x["p50_ms"] for x in rounds["capgate"]),
        "raw_p95_ms": statistics.median(x["p95_ms"] for x in rounds["raw"]),
        "capgate_p95_ms": statistics.median(x["p95_ms"] for x in rounds["capgate"]),
        "raw_cpu_ms_per_call": statistics.median(x["cpu_ms_per_call"] for x in rounds["raw"]),
        "capgate_cpu_ms_per_call": statistics.median(x["cpu_ms_per_call"]
                                                     for x in rounds["capgate"]),
        "lean_tput": tput["lean"], "lean_ratio": tput["raw"] / tput["lean"],
        "lean_p50_ms": statistics.median(x["p50_ms"] for x in rounds["lean"]),
        "lean_p95_ms": statistics.median(x["p95_ms"] for x in rounds["lean"]),
        "lean_cpu_ms_per_call": statistics.median(x["cpu_ms_per_call"] for x in rounds["lean"]),
        "rounds": rounds,
    }
    print(f"\n## {n} worker processes, PostgreSQL ledger: each its own raw connection, "
          f"executor, target row and cases ({args.case_calls} calls a case); "
          f"{out['rounds_per_side']} rounds of {args.worker_seconds:g} s per side, rotated")
    print(f"{'side':<12} {'calls/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'cpu ms':>7}")
    for kind in kinds:
        print(f"{kind:<12} {tput[kind]:>9.0f} {out[kind + '_p50_ms']:>8.2f}"
              f" {out[kind + '_p95_ms']:>8.2f} {out[kind + '_cpu_ms_per_call']:>7.3f}")
    print(f"  throughput raw / capgate: {out['ratio']:.2f} (median of the paired rounds "
          f"{out['ratio_paired']:.2f});  raw / lean (the same work inline, "
          f"bench/lean_call.py): {out['lean_ratio']:.2f}")
    return out


class Counter:
    """Statements and commits per engine, from SQLAlchemy's events (not timed)."""

    WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE")

    def __init__(self) -> None:
        self.engines: dict[int, str] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.statements: dict[str, list[str]] = {}

    def watch(self, engine: sa.Engine, name: str) -> None:
        self.engines[id(engine.pool)] = name
        self.counts.setdefault(name, {"statements": 0, "commits": 0, "write_commits": 0,
                                      "autocommit_writes": 0, "rollbacks": 0})
        self.statements.setdefault(name, [])
        sa.event.listen(engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine, "commit", self._commit)
        sa.event.listen(engine, "rollback", self._rollback)

    def watch_hot(self, backend: Any, name: str) -> None:
        """The ledger's hot path runs on the driver connection (executor/ledger/backends.py:
        ``hot_transaction`` and its ``HotTx``), where SQLAlchemy's events never see it:
        count its statements and commits by wrapping that backend instance's methods."""
        counts = self.counts[name]
        statements = self.statements[name]
        original = backend.hot_transaction
        counter = self

        @contextlib.contextmanager
        def counted(conns: Any, *, durable: bool, write: bool) -> Iterator[Any]:
            with original(conns, durable=durable, write=write) as tx:
                run, run_many = tx.run, tx.run_many
                wrote = False

                def seen(sql: str) -> str:
                    nonlocal wrote
                    counts["statements"] += 1
                    statements.append(" ".join(sql.split())[:90])
                    wrote = wrote or counter._is_write(sql)
                    return sql

                tx.run = lambda sql, params=None: run(seen(sql), params)
                tx.run_many = lambda sql, rows: run_many(seen(sql), rows)
                yield tx
            if write:
                counts["commits"] += 1
                if wrote:
                    counts["write_commits"] += 1

        backend.hot_transaction = counted

    def reset(self) -> None:
        for c in self.counts.values():
            for k in c:
                c[k] = 0
        for s in self.statements.values():
            s.clear()

    def _name(self, conn: sa.Connection) -> str:
        return self.engines.get(id(conn.engine.pool), "other")

    @classmethod
    def _is_write(cls, statement: str) -> bool:
        text = statement.lstrip().upper()
        if text.startswith("WITH"):
            return any(f" {w} " in f" {text} " for w in cls.WRITES)
        return text.startswith(cls.WRITES)

    def _statement(self, conn: sa.Connection, _cursor: Any, statement: str, _params: Any,
                   _context: Any, _many: bool) -> None:
        name = self._name(conn)
        c = self.counts[name]
        c["statements"] += 1
        self.statements[name].append(" ".join(statement.split())[:90])
        if self._is_write(statement):
            if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
                c["autocommit_writes"] += 1
            else:
                conn.info["bench_wrote"] = True

    def _commit(self, conn: sa.Connection) -> None:
        c = self.counts[self._name(conn)]
        c["commits"] += 1
        if conn.info.pop("bench_wrote", False):
            c["write_commits"] += 1

    def _rollback(self, conn: sa.Connection) -> None:
        conn.info.pop("bench_wrote", None)
        self.counts[self._name(conn)]["rollbacks"] += 1


def section_counts(scratch: Scratch, args: argparse.Namespace) -> dict[str, Any]:
    """Statements and ledger commits per call, averaged over ``--count-calls`` calls."""
    out: dict[str, Any] = {}
    n = args.count_calls
    for ledger in ("sqlite", "pg"):
        side = CapgateSide(scratch.config(ledger), 7 if ledger == "sqlite" else 8,
                           f"count-{ledger}", args.case_calls)
        counter = Counter()
        trips = RoundTrips()
        try:
            counter.watch(side.gate.ledger.engine, "ledger")
            counter.watch_hot(side.gate.ledger._backend, "ledger")
            counter.watch(side.gate.connectors.get("bench").engine, "target")
            with trips:
                for _ in range(args.case_calls):  # one whole case first: caches warm
                    side.call()
                counter.reset()
                trips.reset()
                sample: dict[str, list[str]] = {}
                middle = args.case_calls // 2  # a call in the middle of a case, for the record
                for i in range(n):
                    before = {name: len(s) for name, s in counter.statements.items()}
                    side.call()
                    if i == middle:
                        sample = {name: s[before[name]:]
                                  for name, s in counter.statements.items()}
        finally:
            side.close()
        per = {name: {k: v / n for k, v in c.items()} for name, c in counter.counts.items()}
        durable = per["ledger"]["write_commits"] + per["ledger"]["autocommit_writes"]
        out[ledger] = {
            "target_statements": per["target"]["statements"],
            "target_commits": per["target"]["commits"],
            "ledger_statements": per["ledger"]["statements"],
            "ledger_commits": per["ledger"]["commits"],
            "ledger_durable_writes": durable,
            "other_statements": per.get("other", {}).get("statements", 0.0),
            "target_round_trips": trips.target / n,
            "ledger_round_trips": trips.ledger / n if ledger == "pg" else None,
            "calls": n,
            "sample_call": sample,
        }
    print(f"\n## statements per capgate call (mean of {n} calls after one warm case; "
          "SQLAlchemy events and the ledger's driver-level hot path; not timed)")
    print(f"{'ledger':<12} {'to target':>9} {'to ledger':>9} {'ledger commits':>15}"
          f" {'of which wrote':>15} {'target trips':>12} {'ledger trips':>12}")
    for ledger, label in (("sqlite", "SQLite"), ("pg", "PostgreSQL")):
        s = out[ledger]
        trips_text = "-" if s["ledger_round_trips"] is None else f"{s['ledger_round_trips']:.1f}"
        print(f"{label:<12} {s['target_statements']:>9.1f} {s['ledger_statements']:>9.1f}"
              f" {s['ledger_commits']:>15.1f} {s['ledger_durable_writes']:>15.1f}"
              f" {s['target_round_trips']:>12.1f} {trips_text:>12}")
    print("  raw psycopg: 2 statements (UPDATE, SELECT) + COMMIT (psycopg sends BEGIN itself):"
          " 4 round trips.  'ledger commits': write transactions committed (SQLAlchemy events"
          " + the hot path); 'of which wrote': transactions that wrote + autocommit writes"
          " (each a durable commit); 'trips': round trips, counted where psycopg waits for"
          " the server (the SQLite ledger is in-process: none)")
    return out


# --------------------------------------------------------------------------- main


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """issue 13's targets against what was measured in this run."""
    measured: dict[str, float | None] = {
        "p50_ratio_sqlite": results.get("latency", {}).get("capgate_sqlite", {}).get("p50_ratio"),
        "p50_ratio_pg": results.get("latency", {}).get("capgate_pg", {}).get("p50_ratio"),
        "cpu_ms_per_call": None,
        "growth_ratio": None,
        "workers_ratio": results.get("workers", {}).get("ratio"),
    }
    lat = results.get("latency")
    workers = results.get("workers")
    if lat:
        measured["cpu_ms_per_call"] = max(lat["capgate_sqlite"]["cpu_ms_per_call"],
                                          lat["capgate_pg"]["cpu_ms_per_call"])
    growth = results.get("growth")
    if growth:
        measured["growth_ratio"] = max(g["ratio"] for g in growth.values())
    # the same work in straight-line Python (bench/lean_call.py), same rounds: what no
    # structure of capgate's could go below on this machine
    lean: dict[str, float | None] = {"p50_ratio_sqlite": None, "p50_ratio_pg": None,
                                     "cpu_ms_per_call": None,
                                     "workers_ratio": workers["lean_ratio"] if workers else None}
    if lat:
        lean["p50_ratio_sqlite"] = lat["lean_sqlite"]["p50_ratio"]
        lean["p50_ratio_pg"] = lat["lean_pg"]["p50_ratio"]
        lean["cpu_ms_per_call"] = max(lat["lean_sqlite"]["cpu_ms_per_call"],
                                      lat["lean_pg"]["cpu_ms_per_call"])
    out = {}
    for key, what, target, _op in TARGETS:
        value = measured[key]
        out[key] = {"what": what, "target": target, "measured": value,
                    "met": None if value is None else value <= target,
                    "lean": lean.get(key)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="PostgreSQL database (libpq URI) "
                    "holding the target's scratch schema and the PostgreSQL ledger's")
    ap.add_argument("--quick", action="store_true",
                    help="a short run: fewer rounds, shorter worker rounds, growth on the "
                    "SQLite ledger only")
    ap.add_argument("--only", default="latency,growth,workers,counts",
                    help="comma-separated sections to run")
    ap.add_argument("--rounds", type=int, default=20, help="latency: interleaved rounds")
    ap.add_argument("--round-calls", type=int, default=25, help="latency: calls per side a round")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up calls per side, not timed")
    ap.add_argument("--case-calls", type=int, default=10,
                    help="capgate calls per case (latency, workers, counts)")
    ap.add_argument("--growth-calls", type=int, default=610, help="growth: calls in the one case")
    ap.add_argument("--growth-ledgers", default="sqlite,pg", help="growth: ledgers to run it on")
    ap.add_argument("--workers", type=int, default=8, help="workers: processes")
    ap.add_argument("--worker-rounds", type=int, default=6,
                    help="workers: timed rounds per side (alternating)")
    ap.add_argument("--worker-seconds", type=float, default=3.0,
                    help="workers: seconds a round lasts")
    ap.add_argument("--count-calls", type=int, default=20, help="counts: calls counted")
    ap.add_argument("--no-hmac", action="store_true",
                    help="leave CAPGATE_LEDGER_HMAC_KEY unset (unsigned ledger heads)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch schemas and folder")
    ap.add_argument("--json", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.round_calls, args.warmup = 6, 15, 10
        args.worker_rounds, args.worker_seconds = 2, 1.5
        args.growth_ledgers = "sqlite"
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    if not args.no_hmac:
        os.environ["CAPGATE_LEDGER_HMAC_KEY"] = HMAC_KEY

    started = time.time()
    load_before = os.getloadavg()
    with psycopg.connect(args.dsn) as conn:
        server = conn.execute("SHOW server_version").fetchone()
        sync = conn.execute("SHOW synchronous_commit").fetchone()
    info = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "psycopg": psycopg.__version__, "sqlalchemy": sa.__version__,
            "postgresql": server[0] if server else None,
            "synchronous_commit": sync[0] if sync else None,
            "hmac": not args.no_hmac, "load_before": load_before, "quick": args.quick}
    print(f"# capgate call cost (issue 13): {info['when']}, {info['host']}, {info['cpus']} CPUs, "
          f"Python {info['python']}, PostgreSQL {info['postgresql']} "
          f"(synchronous_commit={info['synchronous_commit']}), load average "
          f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")

    scratch = Scratch(args.dsn, keep=args.keep)
    results: dict[str, Any] = {"info": info}
    try:
        scratch.create()
        if "latency" in sections:
            results["latency"] = section_latency(scratch, args)
        if "growth" in sections:
            results["growth"] = {
                ledger: section_growth(scratch, args, ledger)
                for ledger in (x.strip() for x in args.growth_ledgers.split(",")) if ledger}
        if "workers" in sections:
            results["workers"] = section_workers(scratch, args)
        if "counts" in sections:
            results["counts"] = section_counts(scratch, args)
    finally:
        scratch.drop()
    info["load_after"] = os.getloadavg()
    info["seconds"] = time.time() - started
    results["targets"] = verdicts(results)

    print(f"\n## issue 13's targets (load average at the end {info['load_after'][0]:.2f}; "
          f"{info['seconds']:.0f} s)")
    print(f"{'measurement':<60} {'measured':>9} {'target':>7}  met  {'lean':>6}")
    for v in results["targets"].values():
        value = "-" if v["measured"] is None else f"{v['measured']:.2f}"
        met = "-" if v["met"] is None else ("yes" if v["met"] else "no")
        lean = "-" if v["lean"] is None else f"{v['lean']:.2f}"
        print(f"{v['what']:<60} {value:>9} {'<= ' + format(v['target'], 'g'):>7}  {met:<3}"
              f"  {lean:>6}")
    print("  CPU: the larger of the two ledgers' means; growth: the larger of the ledgers run;"
          "  lean: the same work in straight-line Python (bench/lean_call.py), same rounds")
    line = json.dumps(results, default=float, separators=(",", ":"))
    if args.json:
        args.json.write_text(line + "\n", "utf-8")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
