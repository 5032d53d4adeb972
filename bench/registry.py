"""Benchmark the capability registry: load and validate 10,000 rows; time ``resolve``.

Usage::

    .venv/bin/python bench/registry.py [--rows 10000] [--files 20] [--repeat 3] [--profile]

Generates varied rows (every effect class, both shapes, gates, compensation,
leased steps, verify/replay/probe queries, retired versions; binds, names and
SQL differ row to row) into several files in a temporary directory, pins them
in a ``capabilities.lock``, then measures:

* ``load+validate``: ``load_registry([dir])`` -- YAML with positions, JSON
  Schema, every semantic check (SQL parsed with sqlglot), the lock rules, the
  frozen dataclasses.  Target: under 2 s.  Measured as the loader runs by
  default (files checked in one forked worker per CPU) and in one process
  (``workers=1``); CPU time includes the workers'.  Each repetition starts
  from cold SQL caches (the parent's are cleared; workers start empty), so a
  repetition cannot profit from the one before.
* ``baseline``: ``yaml.safe_load`` + ``jsonschema`` validation of each file and
  nothing else -- the floor a located, checked load is compared with.
* ``resolve``: ``Registry.resolve`` over a shuffled mix of current-version,
  explicit-version and environment-checked calls.  Target: under 20 us a call.

Results are printed; they are recorded by hand in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import platform
import pstats
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This file is called registry.py too: `python bench/registry.py` puts bench/ first on
# sys.path, where `import registry` would find this script instead of the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import jsonschema  # noqa: E402
import yaml  # noqa: E402

from capgate.registry import checks  # noqa: E402
from capgate.registry.errors import CapgateError  # noqa: E402
from capgate.registry.fastload.parallel import PARALLEL_MIN_CHARS, worker_count  # noqa: E402
from capgate.registry.fastload.yamlpos import load_located  # noqa: E402
from capgate.registry.loader import load_registry, update_lock  # noqa: E402
from capgate.registry.registry import Registry  # noqa: E402
from capgate.registry.schema import file_schema, schema_problems  # noqa: E402

TABLES = ["policy", "cover", "premium", "claim", "document", "party", "invoice", "payment",
          "endorsement", "broker", "note", "schedule"]
COLUMNS = ["status", "amount", "holder", "starts_on", "ends_on", "code", "reference", "note",
           "currency", "limit_amount", "deductible", "region"]
ENVS = ["dev", "qa", "staging", "prod"]


# --- generation ------------------------------------------------------------------------------


def _contract(rng: random.Random, names: list[str]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for name in names:
        kind = rng.choice(["integer", "string", "number"])
        spec: dict[str, Any] = {"type": kind}
        if kind == "integer":
            spec["minimum"] = rng.choice([0, 1])
        elif kind == "string":
            spec["maxLength"] = rng.choice([16, 64, 200])
        props[name] = spec
    return {"type": "object", "additionalProperties": False, "required": list(names),
            "properties": props}


def _where(rng: random.Random, key: str, extra: list[str], alias: str = "") -> str:
    parts = [f"{alias}id = :{key}"] + [f"{alias}{c} = :{c}_in" for c in extra]
    if rng.random() < 0.3:
        parts.append(f"{alias}{rng.choice(COLUMNS)} IS NOT NULL")
    return " AND ".join(parts)


def make_row(rng: random.Random, op: str, version: int, connector: str) -> dict[str, Any]:
    table = rng.choice(TABLES)
    key = f"{table}_id"
    extra = rng.sample(COLUMNS, rng.randint(0, 3))
    inputs = [key] + [f"{c}_in" for c in extra]
    effect = rng.choices(["read", "transactional", "compensable", "irreversible", "ddl"],
                         weights=[35, 35, 12, 12, 6])[0]
    envs = sorted(rng.sample(ENVS, rng.randint(1, 4)), key=ENVS.index)
    row: dict[str, Any] = {
        "operation_id": op,
        "version": version,
        "connector": connector,
        "description": f"{effect} on {table} ({', '.join(inputs)}), generated row {op}@{version}.",
        "input": _contract(rng, inputs),
        "target": {"system": connector, "object": table, "keys": [key]},
        "effect_class": effect,
        "environments": envs,
        "timeout": {"seconds": rng.choice([1, 2.5, 5, 30]),
                    "on_timeout": rng.choice(["rolled_back", "unknown"])},
        "recovery": rng.choice(["retryable", "reconcile_first", "never_retry"]),
    }
    where = _where(rng, key, extra)
    cols = ", ".join(rng.sample(COLUMNS, rng.randint(1, 4)))
    if effect == "read":
        row["authorization"] = {"kind": "read_grant"}
        row["max_rows"] = rng.choice([1, 10, 100, 1000])
        sql = rng.choice([
            f"SELECT id, {cols} FROM {table} WHERE {where}",
            f"SELECT t.id, count(*) AS n FROM {table} t JOIN cover c ON c.{key} = t.id "
            f"WHERE {_where(rng, key, extra, 't.')} GROUP BY t.id",
            f"WITH x AS (SELECT id, {cols} FROM {table} WHERE {where}) SELECT * FROM x",
        ])
        row["statements"] = [{"name": "fetch", "sql": sql}]
        return row
    gated = rng.random() < 0.3 or effect == "ddl"
    row["authorization"] = (
        {"kind": "gate", "approver_roles": rng.sample(["dba", "underwriter", "lead"], 2),
         "four_eyes": rng.random() < 0.5}
        if gated else {"kind": "write_grant"}
    )
    row["idempotency_key"] = "{case}:{" + key + "}"
    if effect == "ddl":
        row["input"] = _contract(rng, ["source"])
        row["target"] = {"system": connector, "object": f"{table}_fn"}
        row["idempotency_key"] = "{case}:{operation_id}:{version}"
        row["ddl"] = {"objects": [{"type": rng.choice(["function", "procedure", "view"]),
                                   "name": f"{table}_{rng.choice(COLUMNS)}_fn"}]}
        return row
    sets = ", ".join(f"{c} = :{c}_in" for c in extra) or f"{rng.choice(COLUMNS)} = NULL"
    statements = [
        {"name": "change", "sql": f"UPDATE {table} SET {sets} WHERE id = :{key}",
         "expect_rows": 1},
    ]
    for i in range(rng.randint(0, 3)):
        child = rng.choice(TABLES)
        statements.insert(0, {
            "name": f"child_{i}",
            "sql": f"DELETE FROM {child} WHERE {key} = :{key}",
            "expect_rows": {"min": 0, "max": rng.choice([10, 100])},
        })
    shape = "leased" if effect == "irreversible" and rng.random() < 0.6 else "collapsed"
    row["shape"] = shape
    if shape == "collapsed":
        row["statements"] = statements
    else:
        row["steps"] = [
            {"name": "exists", "check": f"SELECT count(*) FROM {table} WHERE id = :{key}",
             "expect": {"value": 1}, "otherwise": {"abort": "no such row"}},
            *({"name": s["name"], "sql": s["sql"], "expect_rows": s["expect_rows"]}
              for s in statements),
            {"name": "record", "function": "record_number"},
        ]
    if rng.random() < 0.6:
        row["verify"] = [{"name": "changed",
                          "sql": f"SELECT count(*) FROM {table} WHERE id = :{key}",
                          "expect": {"value": 1}}]
    if rng.random() < 0.4:
        row["replay"] = {"sql": f"SELECT id, {cols} FROM {table} WHERE id = :{key}",
                         "max_rows": 1}
    if effect == "compensable":
        row["compensation"] = [{"sql": f"UPDATE {table} SET status = 'restored' "
                                       f"WHERE id = :{key}", "expect_rows": {"min": 0, "max": 1}}]
        row["compensation_verify"] = [{
            "name": "restored",
            "sql": f"SELECT count(*) FROM {table} WHERE id = :{key} AND status = 'restored'",
            "expect": {"value": 1}}]
    if effect in ("compensable", "irreversible"):
        row["landed_probe"] = {"sql": f"SELECT count(*) FROM {table} WHERE id = :{key}",
                               "expect": {"rows": 1}}
    _keep_timeout_contract(rng, row)
    if rng.random() < 0.3:
        n = len(statements) if shape == "collapsed" else None
        example: dict[str, Any] = {"name": "typical", "input": {
            name: (1 if spec["type"] != "string" else "x")
            for name, spec in row["input"]["properties"].items()}}
        if n:
            example["expect_rows"] = [0] * (n - 1) + [1]
        row["examples"] = [example]
    return row


def _keep_timeout_contract(rng: random.Random, row: dict[str, Any]) -> None:
    """Make a write row's effect-of-timeout contract one the executor can keep (CG126-128).

    An irreversible effect is never undone by a rollback (``on_timeout: unknown``);
    a retryable non-transactional row must be safe to repeat, so about half of
    them say they are idempotent and the rest reconcile first.
    """
    effect = row["effect_class"]
    if effect == "irreversible":
        row["timeout"]["on_timeout"] = "unknown"
    if row["recovery"] == "retryable" and effect in ("irreversible", "compensable"):
        if rng.random() < 0.5:
            row["idempotent"] = True
        else:
            row["recovery"] = "reconcile_first"


def generate(directory: Path, n_rows: int, n_files: int, seed: int = 7) -> int:
    """Write ``n_rows`` rows over ``n_files`` files; return the number of rows written."""
    rng = random.Random(seed)
    per_file = -(-n_rows // n_files)
    written = 0
    for f in range(n_files):
        connector = f"db{f % 5}"
        rows: list[dict[str, Any]] = []
        while len(rows) < per_file and written < n_rows:
            op = f"{rng.choice(TABLES)}{f}.op{len(rows)}"
            versions = rng.choices([1, 2, 3], weights=[70, 20, 10])[0]
            for v in range(1, versions + 1):
                if len(rows) >= per_file or written >= n_rows:
                    break
                row = make_row(rng, op, v, connector)
                if v < versions and rng.random() < 0.5:
                    row["retired"] = True
                rows.append(row)
                written += 1
        doc = {"format": 1,
               "connectors": {connector: {"description": f"generated {connector}"}},
               "rows": rows}
        text = f"# generated by bench/registry.py: {len(rows)} rows\n" + yaml.dump(
            doc, Dumper=yaml.CSafeDumper, sort_keys=False, width=100)
        (directory / f"caps_{f:03d}.yaml").write_text(text, "utf-8")
    return written


# --- measuring -------------------------------------------------------------------------------


def _clear_caches() -> None:
    checks.binds_of.cache_clear()
    checks.writing_reason.cache_clear()


@dataclass
class Timing:
    """Wall and CPU seconds of each run; CPU counts the worker processes too."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.wall) if self.wall else float("nan")

    @property
    def median(self) -> float:
        return statistics.median(self.wall) if self.wall else float("nan")

    @property
    def best_cpu(self) -> float:
        return self.cpu[self.wall.index(self.best)] if self.wall else float("nan")

    def runs(self) -> str:
        return ", ".join(f"{t:.3f}" for t in self.wall)


def _cpu_now() -> float:
    """CPU seconds of this process and of its finished children (the load's workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(repeat: int, fn: Callable[[], Any], before: Callable[[], Any] = lambda: None) -> Timing:
    """Run ``fn`` ``repeat`` times from cold SQL caches, after an untimed ``before``.

    On a shared machine other processes stretch the wall time; the CPU time
    (this process and the load's worker processes) shows what the work costs.
    """
    timing = Timing()
    for _ in range(repeat):
        before()
        _clear_caches()
        gc.collect()
        t0, c0 = time.perf_counter(), _cpu_now()
        fn()
        timing.wall.append(time.perf_counter() - t0)
        timing.cpu.append(_cpu_now() - c0)
    return timing


# The baseline parses with the same YAML parser the loader uses (libyaml when PyYAML has it).
BASELINE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def baseline(directory: Path) -> int:
    """``yaml.safe_load`` + jsonschema validation of each file, nothing else."""
    validator = jsonschema.Draft202012Validator(file_schema())
    n = 0
    for path in sorted(directory.glob("*.yaml")):
        doc = yaml.load(path.read_text("utf-8"), Loader=BASELINE_LOADER)
        validator.validate(doc)
        n += len(doc["rows"])
    return n


def phases(directory: Path) -> dict[str, float]:
    """Where a cold load+validate spends its CPU time, phase by phase.

    CPU time (``time.process_time``), with the cyclic GC paused as the loader
    pauses it, so that the phases add up on a machine shared with others.
    """
    texts = [(str(p), p.read_text("utf-8")) for p in sorted(directory.glob("*.yaml"))]
    _clear_caches()
    gc.collect()
    out: dict[str, float] = {}
    gc.disable()
    try:
        t0 = time.process_time()
        for source, text in texts:
            load_located(text, source)
        out["yaml, every position (a file with findings)"] = time.process_time() - t0
        t0 = time.process_time()
        located = [load_located(text, source, positions="rows")[0] for source, text in texts]
        out["yaml, row positions (a clean file)"] = time.process_time() - t0
        t0 = time.process_time()
        for loc, (source, _) in zip(located, texts, strict=True):
            assert loc is not None and not schema_problems(loc, source)
        out["json schema (file, fast path)"] = time.process_time() - t0
        sqls = {sql for loc in located if loc is not None for row in loc.data["rows"]
                for _, sql, must_read in checks._sql_sites(row) if must_read}
        t0 = time.process_time()
        for sql in sqls:
            checks.writing_reason(sql)
        out[f"sqlglot: {len(sqls)} read-only queries"] = time.process_time() - t0
        del located
    finally:
        gc.enable()
    gc.collect()
    t0 = time.process_time()
    load_registry([directory], workers=1)  # the SQL verdicts are cached now
    out["whole load in one process, SQL verdicts cached"] = time.process_time() - t0
    return out


def time_resolve(registry: Registry, calls: int, seed: int = 11) -> float:
    rng = random.Random(seed)
    current = registry.current_rows()
    plan: list[tuple[str, int | None, str | None]] = []
    for _ in range(10_000):
        row = rng.choice(current)
        how = rng.random()
        if how < 0.4:
            plan.append((row.operation_id, None, None))
        elif how < 0.7:
            plan.append((row.operation_id, row.version, None))
        else:
            plan.append((row.operation_id, None, rng.choice(row.environments)))
    resolve = registry.resolve
    rounds = max(1, calls // len(plan))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            for op, version, env in plan:
                resolve(op, version, env)
        best = min(best, (time.perf_counter() - t0) / (rounds * len(plan)))
    return best


def time_refusals(registry: Registry, calls: int = 20_000) -> float:
    ops = [f"no.such{i}" for i in range(100)]
    t0 = time.perf_counter()
    for i in range(calls):
        with contextlib.suppress(CapgateError):
            registry.resolve(ops[i % 100])
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline-repeat", type=int, default=1)
    parser.add_argument("--resolve-calls", type=int, default=1_000_000)
    parser.add_argument("--profile", action="store_true", help="cProfile one load, top 25")
    args = parser.parse_args(argv)

    loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"python {platform.python_version()} on {platform.machine()}, "
          f"{platform.system()} {platform.release()}, {os.cpu_count()} cpus, "
          f"load average {loadavg:.2f}; PyYAML libyaml: {yaml.__with_libyaml__}")
    with tempfile.TemporaryDirectory(prefix="capgate-bench-") as tmp:
        directory = Path(tmp)
        t0 = time.perf_counter()
        n = generate(directory, args.rows, args.files)
        size = sum(p.stat().st_size for p in directory.glob("*.yaml"))
        print(f"generated {n} rows in {args.files} files ({size / 1e6:.1f} MB) "
              f"in {time.perf_counter() - t0:.2f} s")
        update_lock([directory])
        print(f"locked {len(load_registry([directory]))} rows")

        if args.profile:
            _clear_caches()
            profiler = cProfile.Profile()
            profiler.enable()
            load_registry([directory])
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)

        holder: list[Registry] = []

        def load(workers: int | None) -> Callable[[], None]:
            def run() -> None:
                holder.append(load_registry([directory], workers=workers))
            return run

        # The previous registry is freed before each load, outside the timed part.
        parallel = timed(args.repeat, load(None), before=holder.clear)
        serial = timed(args.repeat, load(1), before=holder.clear)
        registry = holder[-1]
        base = timed(args.baseline_repeat, lambda: baseline(directory))
        split = phases(directory)
        per_call = time_resolve(registry, args.resolve_calls)
        refusal = time_refusals(registry)

    workers = worker_count([("", "x" * PARALLEL_MIN_CHARS)] * args.files)
    print()
    print(f"load+validate {n} rows, {workers} processes (the default here: the caller and "
          f"{workers - 1} forked workers): "
          f"best {parallel.best:.3f} s, median {parallel.median:.3f} s wall; "
          f"{parallel.best_cpu:.3f} s cpu in all processes (runs: {parallel.runs()})  "
          f"target < 2 s  {'OK' if parallel.median < 2 else 'OVER'}")
    print(f"load+validate {n} rows in one process (CAPGATE_LOAD_WORKERS=1): "
          f"best {serial.best:.3f} s, median {serial.median:.3f} s wall; "
          f"{serial.best_cpu:.3f} s cpu (runs: {serial.runs()})")
    print(f"  = {parallel.best / n * 1e6:.0f} us per row; "
          "cpu time of the parts of a cold load in one process:")
    for name, seconds in split.items():
        print(f"    {name:<48} {seconds:.3f} s cpu")
    if base.wall:
        print(f"baseline yaml.safe_load ({BASELINE_LOADER.__name__}) + jsonschema only: "
              f"best {base.best:.3f} s wall, {base.best_cpu:.3f} s cpu (runs: {base.runs()})")
        print(f"  ratio load+validate / baseline: {parallel.best / base.best:.2f} wall "
              f"({workers} processes), {serial.best / base.best:.2f} wall (one process)")
    print(f"resolve: {per_call * 1e6:.2f} us per call  target < 20 us  "
          f"{'OK' if per_call < 20e-6 else 'OVER'}")
    print(f"resolve refusal (unknown operation, raise + catch): {refusal * 1e6:.2f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
