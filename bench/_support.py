"""What the benchmarks share, with nothing from ``tests/``: a bench is not a test run.

``bench/claims.py`` once imported ``tests.fix_capgate``, ``tests.fix_db`` and
``tests.test_lease_support``: a change to a test fixture changed (or broke) what a
benchmark measured, and the benchmarks needed the test tree on the path.  This
module has its own copies of the little they need:

* ``LAB_ROW``: the leased row ``lab.bump`` (a registered step logs the start, a
  statement bumps the target's counter, a registered step logs the end, one verify);
* ``fresh_pg``: a PostgreSQL schema of its own, dropped afterwards;
* ``prepare_lab``: capgate's tables and the lab tables in a target;
* ``run_workers``: ``lab.bump`` calls in worker processes (this file, run as
  ``python bench/_support.py worker SPEC_JSON``), retrying impact conflicts;
* ``RoundTrips``: round trips to the target and to a PostgreSQL ledger, counted where
  psycopg waits for the server (``bench/call_cost.py`` prints them, and
  ``tests/test_ledger_round_trips.py`` asserts them with the same counter).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# the repository first, and not this folder: bench/registry.py would shadow the package
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.engine import URL, make_url  # noqa: E402

from capgate.executor.call import Executor  # noqa: E402
from capgate.executor.connectors import ConnectorConfig, Connectors  # noqa: E402
from capgate.executor.context import CallContext  # noqa: E402
from capgate.executor.grants import Grants  # noqa: E402
from capgate.executor.ledger import open_ledger  # noqa: E402
from capgate.executor.steps import register_step, registered_steps  # noqa: E402
from capgate.executor.target import install_at  # noqa: E402
from capgate.registry.loader import validate_texts  # noqa: E402
from capgate.registry.registry import Registry  # noqa: E402


def bench_module(name: str) -> types.ModuleType:
    """``bench/<name>.py``, loaded from its file: this folder is not on the path (above),
    and a spawned worker re-imports its parent's main module with the parent's path."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


CONNECTOR = "lab"
LAB_ROW = """
format: 1
connectors: {lab: {}}
rows:
  - operation_id: lab.bump
    version: 1
    connector: lab
    description: Count one unit of work on a lab target and log when it ran (bench-only).
    input:
      type: object
      additionalProperties: false
      required: [target_id, call_ref]
      properties:
        target_id: {type: integer}
        call_ref: {type: string}
        dwell_ms: {type: integer}
    target: {system: lab, object: counter, keys: [target_id]}
    effect_class: transactional
    shape: leased
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{call_ref}"
    timeout: {seconds: 10, on_timeout: rolled_back}
    recovery: retryable
    steps:
      - {name: log_start, function: bench.log_start}
      - {name: bump, sql: "UPDATE lab_counter SET n = n + 1 WHERE target_id = :target_id",
         expect_rows: 1}
      - {name: log_end, function: bench.log_end}
    verify:
      - name: logged_once
        sql: "SELECT count(*) FROM lab_log WHERE call_ref = :call_ref AND ended IS NOT NULL"
        expect: {value: 1}
"""

LAB_DDL = [
    "CREATE TABLE lab_counter (target_id INTEGER NOT NULL PRIMARY KEY, n INTEGER NOT NULL)",
    "CREATE TABLE lab_log (call_ref VARCHAR(64) NOT NULL PRIMARY KEY, target_id INTEGER NOT NULL,"
    " case_id VARCHAR(64) NOT NULL, pid INTEGER NOT NULL, started DOUBLE PRECISION NOT NULL,"
    " ended DOUBLE PRECISION)",
]

GRANTS = Grants.from_dict({"principals": {"agent": {"grants": [
    {"connector": CONNECTOR, "environments": ["dev"], "access": "write"}]}}}, source="bench")

if "bench.log_start" not in registered_steps():

    @register_step("bench.log_start")
    def log_start(conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
        conn.execute(sa.text(
            "INSERT INTO lab_log (call_ref, target_id, case_id, pid, started)"
            " VALUES (:r, :t, :c, :p, :s)"),
            {"r": ctx.inputs["call_ref"], "t": ctx.inputs["target_id"], "c": ctx.case_id,
             "p": os.getpid(), "s": time.time()})
        dwell = int(ctx.inputs.get("dwell_ms") or 0)
        if dwell:
            time.sleep(dwell / 1000)
        return {}

    @register_step("bench.log_end")
    def log_end(conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
        conn.execute(sa.text("UPDATE lab_log SET ended = :e WHERE call_ref = :r"),
                     {"e": time.time(), "r": ctx.inputs["call_ref"]})
        return {}


# --- places ---------------------------------------------------------------------------


def pg_url(dsn: str) -> URL:
    """A ``postgresql://`` DSN with the driver capgate uses (psycopg 3)."""
    return make_url(dsn).set(drivername="postgresql+psycopg")


def url_text(url: URL | str) -> str:
    return make_url(url).render_as_string(hide_password=False)


@contextlib.contextmanager
def fresh_pg(server: URL) -> Iterator[URL]:
    """A schema of its own on ``server`` (first on the search path), dropped afterwards."""
    schema = f"cgb_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        query = dict(server.query)
        query["options"] = f"-csearch_path={schema}"
        yield server.set(query=query)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def prepare_lab(url: URL | str, targets: int) -> None:
    """capgate's tables (as ``capgate target install`` makes them) and the lab tables,
    with ``targets`` counters at 0."""
    install_at(url)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            for ddl in LAB_DDL:
                conn.execute(sa.text(ddl))
            conn.execute(sa.text("INSERT INTO lab_counter (target_id, n) VALUES (:t, 0)"),
                         [{"t": t} for t in range(1, targets + 1)])
    finally:
        engine.dispose()


def lab_executor(target: URL | str, ledger: URL | str, **opts: Any) -> Executor:
    """An executor with the one lab row; claims last a call (``case_claim_seconds=0``):
    every call is a case of its own."""
    result = validate_texts([("lab.yaml", LAB_ROW)])
    result.raise_for_problems()
    opts.setdefault("case_claim_seconds", 0.0)
    connectors = Connectors({CONNECTOR: ConnectorConfig(
        name=CONNECTOR, url=url_text(target), environment="dev", **opts)})
    return Executor(Registry(result.rows), connectors, open_ledger(ledger), GRANTS)


# --- worker processes -----------------------------------------------------------------


def _worker(spec: Mapping[str, Any]) -> int:
    from capgate.executor.claims import set_claims
    from capgate.registry.errors import BudgetExhausted, ImpactConflict

    ex = lab_executor(spec["target"], spec["ledger"], **spec.get("opts", {}))
    set_claims(ex, bool(spec.get("claims", True)))
    rng = random.Random(spec.get("seed", 0))
    applied: list[dict[str, Any]] = []
    conflicts: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    # warm up (connections, marker and fence tables) before the common start
    ex.connectors.get(CONNECTOR).check_target()
    ex.ledger.snapshot("warm-up")
    start_at = float(spec.get("start_at", 0))
    while time.time() < start_at:
        time.sleep(0.005)
    started = time.time()
    for target_id, ref in spec["calls"]:
        inputs = {"target_id": target_id, "call_ref": ref, "dwell_ms": spec.get("dwell_ms", 0)}
        pause = 0.004
        for _ in range(2000):
            try:
                out = ex.call("lab.bump", inputs, case=f"case-{ref}", who="agent")
            except ImpactConflict as exc:
                conflicts.append({"ref": ref, "target": target_id,
                                  "holder_case": exc.details.get("case_id")})
                time.sleep(rng.uniform(0.5, 1.5) * pause)  # back off: leave the CPU to holders
                pause = min(pause * 2, 0.05)
                continue
            except BudgetExhausted as exc:
                other.append({"ref": ref, "error": exc.code})
                time.sleep(rng.uniform(0.01, 0.05))
                continue
            applied.append({"ref": ref, "target": target_id, "status": out.status})
            break
    finished = time.time()
    print(json.dumps({"worker": spec.get("worker"), "applied": applied, "conflicts": conflicts,
                      "other": other, "started": started, "finished": finished}))
    ex.connectors.dispose()
    ex.ledger.close()
    return 0


def run_workers(target: URL | str, ledger: URL | str, calls: Sequence[Sequence[Any]], *,
                workers: int = 8, claims: bool = True, dwell_ms: int = 0,
                opts: Mapping[str, Any] | None = None, timeout: float = 120.0
                ) -> list[dict[str, Any]]:
    """Run ``calls`` ((target_id, ref) pairs) round-robin over ``workers`` processes,
    started together; each prints what it did as JSON."""
    start_at = time.time() + 1.5
    procs = []
    for w in range(workers):
        spec = {"target": url_text(target), "ledger": url_text(ledger), "worker": w,
                "calls": [list(c) for c in calls[w::workers]], "claims": claims,
                "dwell_ms": dwell_ms, "seed": w, "start_at": start_at,
                "opts": dict(opts or {"budget_wait_seconds": 5.0})}
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(spec)],
            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results



class RoundTrips:
    """Round trips per driver connection, counted where psycopg waits for the server.

    Outside a pipeline, ``psycopg.Connection.wait`` runs one exchange with the server
    (a statement, BEGIN, COMMIT); in a pipeline (the PostgreSQL ledger's
    transactions), statements are only queued and each ``sync`` -- and the exit,
    which syncs -- is the round trip.  The ledger's connections are told apart by
    their ``application_name`` (``capgate-ledger``).
    """

    def __init__(self) -> None:
        self.ledger = 0
        self.target = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _count(self, conn: Any) -> None:
        if conn.info.parameter_status("application_name") == "capgate-ledger":
            self.ledger += 1
        else:
            self.target += 1

    def __enter__(self) -> RoundTrips:
        import psycopg

        counter = self
        wait, sync = psycopg.Connection.wait, psycopg.Pipeline.sync
        leave = psycopg.Pipeline.__exit__

        def counted_wait(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if conn._pipeline is None:
                counter._count(conn)
            return wait(conn, *args, **kwargs)

        def counted_sync(pipeline: Any) -> None:
            counter._count(pipeline._conn)
            sync(pipeline)

        def counted_exit(pipeline: Any, *exc: Any) -> None:
            counter._count(pipeline._conn)
            leave(pipeline, *exc)

        self._saved = [(psycopg.Connection, "wait", wait), (psycopg.Pipeline, "sync", sync),
                       (psycopg.Pipeline, "__exit__", leave)]
        for (owner, name, _), patched in zip(
                self._saved, (counted_wait, counted_sync, counted_exit), strict=True):
            setattr(owner, name, patched)  # counted, then put back at the end
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)

    def reset(self) -> None:
        self.ledger = self.target = 0

if __name__ == "__main__":
    mode, raw = sys.argv[1], sys.argv[2]
    raise SystemExit({"worker": _worker}[mode](json.loads(raw)))
