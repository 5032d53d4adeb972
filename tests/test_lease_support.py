"""Shared by the lease, claims, budget and many-executor suites (no tests of its own).

* ``LAB_ROWS``: test-only capability rows (leased) over the example schema and two lab
  tables (``lab_counter``, ``lab_log``), and the registered step functions they name;
* ``lab_executor``: an executor over those rows plus ``capabilities/``;
* child processes, run as ``python -m tests.test_lease_support MODE SPEC_JSON``:

  ``call``   one call (a leased row that pauses inside a step, for SIGKILL/SIGSTOP);
  ``hold``   hold N budgeted sessions open until killed or ``seconds`` pass;
  ``worker`` run a list of ``lab.bump`` calls, retrying impact conflicts, and print
             what happened as JSON (the many-executors test; bench/ has its own copy).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from capgate.executor.call import Executor
from capgate.executor.context import CallContext
from capgate.executor.steps import register_step, registered_steps

ROOT = Path(__file__).resolve().parent.parent

LAB_ROWS = """
format: 1
connectors: {insurance: {}}
rows:
  - operation_id: lab.hold
    version: 1
    connector: insurance
    description: Lock a policy row, then pause inside a registered step (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id]
      properties:
        policy_id: {type: integer}
        mode: {type: string, enum: [sleep, stop]}
        ready: {type: string}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: leased
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{policy_id}"
    timeout: {seconds: 3, on_timeout: rolled_back}
    recovery: never_retry
    steps:
      - {name: lock_policy, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}
      - {name: pause, function: tests.pause}

  - operation_id: lab.hold_sleeping
    version: 1
    connector: insurance
    description: Lock a policy row, then sleep in the database past the 3 s lease (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id]
      properties:
        policy_id: {type: integer}
        seconds: {type: number}
        ready: {type: string}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: leased
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{policy_id}"
    timeout: {seconds: 3, on_timeout: rolled_back}
    recovery: never_retry
    steps:
      - {name: lock_policy, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}
      - {name: sleep_in_db, function: tests.announce_and_sleep}

  - operation_id: lab.slow
    version: 1
    connector: insurance
    description: Change a policy, then run a step that outlives the 1 s lease (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id]
      properties:
        policy_id: {type: integer}
        seconds: {type: number}
        in_db: {type: boolean}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: leased
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{policy_id}"
    timeout: {seconds: 1, on_timeout: rolled_back}
    recovery: never_retry
    steps:
      - {name: rename_holder,
         sql: "UPDATE policy SET holder = 'Lease Test' WHERE policy_id = :policy_id",
         expect_rows: 1}
      - {name: slow_step, function: tests.sleep}
      - {name: after_slow, sql: "UPDATE policy SET status = status WHERE policy_id = :policy_id",
         expect_rows: 1}

  - operation_id: lab.bump
    version: 1
    connector: insurance
    description: Count one unit of work on a lab target and log when it ran (test-only).
    input:
      type: object
      additionalProperties: false
      required: [target_id, call_ref]
      properties:
        target_id: {type: integer}
        call_ref: {type: string}
        dwell_ms: {type: integer}
        gate: {type: string}
    target: {system: lab, object: counter, keys: [target_id]}
    effect_class: transactional
    shape: leased
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{call_ref}"
    timeout: {seconds: 10, on_timeout: rolled_back}
    recovery: retryable
    steps:
      - {name: log_start, function: tests.log_start}
      - {name: bump, sql: "UPDATE lab_counter SET n = n + 1 WHERE target_id = :target_id",
         expect_rows: 1}
      - {name: log_end, function: tests.log_end}
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

# --- registered step functions (reviewed test code) -----------------------------------

GATES: dict[str, threading.Event] = {}
"""Process-local gates a ``lab.bump`` step waits on (``gate`` input), for fence tests."""
ARRIVED: dict[str, threading.Event] = {}


def _gate(name: str) -> tuple[threading.Event, threading.Event]:
    return GATES.setdefault(name, threading.Event()), ARRIVED.setdefault(name, threading.Event())


if "tests.pause" not in registered_steps():

    @register_step("tests.pause")
    def pause(conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
        """Tell the parent we hold the lock, then hang (sleep, or SIGSTOP ourselves)."""
        ready = ctx.inputs.get("ready")
        if ready:
            tmp = f"{ready}.tmp"
            Path(tmp).write_text(json.dumps({"pid": os.getpid(), "at": time.time()}))
            os.replace(tmp, ready)
        if ctx.inputs.get("mode") == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        return {}

    @register_step("tests.announce_and_sleep")
    def announce_and_sleep(conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
        """Tell the parent we hold the lock, then sleep in the database (the parent stops
        us while the statement runs)."""
        ready = ctx.inputs.get("ready")
        if ready:
            tmp = f"{ready}.tmp"
            Path(tmp).write_text(json.dumps({"pid": os.getpid(), "at": time.time()}))
            os.replace(tmp, ready)
        seconds = float(ctx.inputs.get("seconds") or 30)
        sleep = "SELECT pg_sleep(:s)" if ctx.connector.dialect.name == "postgresql" \
            else "SELECT SLEEP(:s)"
        conn.execute(sa.text(sleep), {"s": seconds})
        return {"slept": seconds}

    @register_step("tests.sleep")
    def sleep(conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
        """Outlive the lease: a statement that sleeps in the database, or Python that sleeps."""
        seconds = float(ctx.inputs["seconds"])
        dialect = ctx.connector.dialect.name
        if ctx.inputs.get("in_db") and dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})
        elif ctx.inputs.get("in_db") and dialect == "mariadb":
            conn.execute(sa.text("SELECT SLEEP(:s)"), {"s": seconds})
        else:
            time.sleep(seconds)
        return {"slept": seconds}

    @register_step("tests.log_start")
    def log_start(conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
        conn.execute(sa.text(
            "INSERT INTO lab_log (call_ref, target_id, case_id, pid, started)"
            " VALUES (:r, :t, :c, :p, :s)"),
            {"r": ctx.inputs["call_ref"], "t": ctx.inputs["target_id"], "c": ctx.case_id,
             "p": os.getpid(), "s": time.time()})
        gate = ctx.inputs.get("gate")
        if gate:
            wait, arrived = _gate(str(gate))
            arrived.set()
            wait.wait(30)
        dwell = int(ctx.inputs.get("dwell_ms") or 0)
        if dwell:
            time.sleep(dwell / 1000)
        return {}

    @register_step("tests.log_end")
    def log_end(conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
        conn.execute(sa.text("UPDATE lab_log SET ended = :e WHERE call_ref = :r"),
                     {"e": time.time(), "r": ctx.inputs["call_ref"]})
        return {}


# --- executors ------------------------------------------------------------------------


def lab_registry() -> Any:
    from capgate.registry.loader import validate_texts
    from capgate.registry.registry import Registry
    from tests.fix_capgate import registry

    result = validate_texts([("lab.yaml", LAB_ROWS)])
    result.raise_for_problems()
    return Registry(list(registry().rows()) + list(result.rows))


def lab_executor(target: URL | str, ledger: URL | str, *, schema: bool = False,
                 **opts: Any) -> Executor:
    from tests.fix_capgate import make_executor

    ex = make_executor(target, ledger, schema=schema, **opts)
    ex.registry = lab_registry()
    return ex


def lab_schema(url: URL | str, targets: int = 3) -> None:
    """The example schema's lab tables, with ``targets`` counters at 0."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            for ddl in LAB_DDL:
                conn.execute(sa.text(ddl))
            conn.execute(sa.text("INSERT INTO lab_counter (target_id, n) VALUES (:t, 0)"),
                         [{"t": t} for t in range(1, targets + 1)])
    finally:
        engine.dispose()


def url_text(url: URL | str) -> str:
    return make_url(url).render_as_string(hide_password=False)


# --- child processes ------------------------------------------------------------------


def spawn(mode: str, spec: Mapping[str, Any], **popen: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.test_lease_support", mode,
                             json.dumps(spec)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def wait_for_file(path: Path, proc: subprocess.Popen[str], timeout: float = 20.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"child ended early ({proc.returncode}): {out}\n{err}")
        time.sleep(0.02)
    raise AssertionError(f"child never wrote {path}")


def _child_call(spec: Mapping[str, Any]) -> int:
    from capgate.registry.errors import CapgateError

    if spec.get("crash_at"):  # the executor's own test hook: SIGKILL at that boundary
        os.environ["CAPGATE_CRASH_AT"] = str(spec["crash_at"])
    ex = lab_executor(spec["target"], spec["ledger"], **spec.get("opts", {}))
    try:
        out = ex.call(spec["operation"], spec["inputs"], case=spec["case"], who="agent")
        print(json.dumps(out.to_dict(), default=str))
    except CapgateError as exc:
        print(json.dumps({"status": "failed", **exc.to_dict()}, default=str))
    return 0


def _child_hold(spec: Mapping[str, Any]) -> int:
    from capgate.executor import budget

    if "margin" in spec:
        budget.BUDGET_MARGIN_SECONDS = float(spec["margin"])
    ex = lab_executor(spec["target"], spec["ledger"], **spec.get("opts", {}))
    held: list[Any] = []
    for name, count in spec["sessions"].items():  # "case": they count against its budget too
        held.append(budget.holding(ex, ex.connectors.get(name), int(count), spec.get("case")))
    for h in held:
        h.__enter__()
    Path(spec["ready"]).write_text(json.dumps({"pid": os.getpid()}))
    time.sleep(float(spec.get("seconds", 60)))
    for h in reversed(held):
        h.__exit__(None, None, None)
    return 0


def _child_worker(spec: Mapping[str, Any]) -> int:
    from capgate.executor.claims import set_claims
    from capgate.registry.errors import BudgetExhausted, ImpactConflict

    ex = lab_executor(spec["target"], spec["ledger"], **spec.get("opts", {}))
    set_claims(ex, bool(spec.get("claims", True)))
    rng = random.Random(spec.get("seed", 0))
    applied: list[dict[str, Any]] = []
    conflicts: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    # warm up (connections, marker and fence tables) before the common start
    ex.connectors.get("insurance").check_target()
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
                conflicts.append({"ref": ref, "target": target_id, "at": time.time(),
                                  "holder_case": exc.holder.get("case_id"),
                                  "holder_intent": exc.holder.get("intent_id"),
                                  "key": exc.details.get("impact_key")})
                time.sleep(rng.uniform(0.5, 1.5) * pause)  # back off: leave the CPU to holders
                pause = min(pause * 2, 0.05)
                continue
            except BudgetExhausted as exc:
                other.append({"ref": ref, "error": exc.code})
                time.sleep(rng.uniform(0.01, 0.05))
                continue
            applied.append({"ref": ref, "target": target_id, "status": out.status,
                            "intent": out.intent_id, "reason": out.reason})
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
    """Run ``calls`` ((target_id, ref) pairs) round-robin over ``workers`` processes."""
    start_at = time.time() + 1.5
    procs = []
    for w in range(workers):
        spec = {"target": url_text(target), "ledger": url_text(ledger), "worker": w,
                "calls": [list(c) for c in calls[w::workers]], "claims": claims,
                "dwell_ms": dwell_ms, "seed": w, "start_at": start_at,
                "opts": dict(opts or {"budget_wait_seconds": 5.0})}
        procs.append(spawn("worker", spec))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main(argv: Sequence[str]) -> int:
    mode, raw = argv[0], argv[1]
    spec = json.loads(raw)
    return {"call": _child_call, "hold": _child_hold, "worker": _child_worker}[mode](spec)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
