"""Benchmark the command line's start-up: ``--help``, ``--version`` and one ``capgate call``.

Usage::

    .venv/bin/python bench/startup.py [--runs 9] [--rows 10000]

Every measurement is a new process, as an agent calling through the CLI pays
it: wall time (min and median of ``--runs``) and the CPU time of the child.
It makes two projects with ``capgate init`` in a temporary folder:

* ``examples``: the packaged example registry (17 rows), a read call;
* ``large``: the same plus ``--rows`` generated rows (bench/registry.py's
  generator), the same read call -- once with an empty validation cache
  (``cold``: every file validated and recorded) and then ``warm``.

Targets (issue 12): ``--help`` under 0.25 s; a call on the example registry
under 0.5 s; a call on the large registry, once validated, under 0.5 s.  Also timed:
``capgate mcp`` (stdio) from its start to the ``ready:`` line it prints on stderr
once it answers, on both registries.
Results are printed; they are recorded by hand in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPGATE = [sys.executable, "-m", "capgate"]


def run(args: list[str], cwd: Path, env: dict[str, str],
        command: list[str] | None = None) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one ``capgate`` process (or of ``command``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([*(command or CAPGATE), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"capgate {' '.join(args)} failed: {proc.stderr or proc.stdout}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(label: str, args: list[str], cwd: Path, env: dict[str, str], runs: int,
            command: list[str] | None = None) -> None:
    walls, cpus = [], []
    for _ in range(runs):
        wall, cpu = run(args, cwd, env, command)
        walls.append(wall)
        cpus.append(cpu)
    print(f"{label:<44} wall min {min(walls) * 1000:6.0f} ms  median "
          f"{statistics.median(walls) * 1000:6.0f} ms   cpu median "
          f"{statistics.median(cpus) * 1000:6.0f} ms")


def mcp_ready(cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds until ``capgate mcp`` printed its ready line, the seconds it says it
    took): a stdio server, started as an MCP client starts it, stdin held open."""
    started = time.perf_counter()
    proc = subprocess.Popen([*CAPGATE, "mcp"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    said = ""
    try:
        for line in proc.stderr:
            said += line
            if "ready:" in line:
                wall = time.perf_counter() - started
                reported = float(line.rsplit("started in ", 1)[1].split()[0])
                return wall, reported
        raise SystemExit(f"capgate mcp stopped before it was ready:\n{said}")
    finally:
        proc.kill()
        proc.wait()


def measure_mcp(label: str, cwd: Path, env: dict[str, str], runs: int) -> None:
    walls, said = [], []
    for _ in range(runs):
        wall, reported = mcp_ready(cwd, env)
        walls.append(wall)
        said.append(reported)
    print(f"{label:<44} wall min {min(walls) * 1000:6.0f} ms  median "
          f"{statistics.median(walls) * 1000:6.0f} ms   its ready line: median "
          f"{statistics.median(said) * 1000:6.0f} ms")


def generate(folder: Path, rows: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.spec_from_file_location("bench_registry", HERE / "registry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_registry"] = module
    spec.loader.exec_module(module)
    return int(module.generate(folder, rows, max(1, rows // 500)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--rows", type=int, default=10_000)
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPU(s), load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="capgate-startup-") as tmp:
        root = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
        env["CAPGATE_CACHE_DIR"] = str(root / "cache")
        # A pip-installed wheel has its bytecode compiled at install time; a checkout run
        # with PYTHONDONTWRITEBYTECODE (set in some sandboxes and CI images) compiles every
        # module on every start -- 120 ms of a call that no user pays.  The children write
        # their bytecode under the run's folder (not into the checkout) and reuse it.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
        call = ["call", "policy.get", "--input", '{"policy_id": 1}', "--case", "BENCH-1"]
        # the same run's references: what no capgate code can go below on this machine now
        run(["--version"], root, env)  # compiles the bytecode once, as an install does
        run(["-c", "import sqlalchemy"], root, env, [sys.executable])
        measure("python -c pass (interpreter start)", ["-c", "pass"], root, env, args.runs,
                [sys.executable])
        measure("python -c 'import sqlalchemy'", ["-c", "import sqlalchemy"], root, env,
                args.runs, [sys.executable])
        measure("capgate --help", ["--help"], root, env, args.runs)
        measure("capgate --version", ["--version"], root, env, args.runs)
        run(["init", "examples"], root, env)
        run(call, root / "examples", env)  # records the examples in the cache
        measure("capgate call (example registry, cached)", call, root / "examples", env,
                args.runs)
        measure_mcp("capgate mcp to its ready line (examples)", root / "examples", env,
                    args.runs)
        run(["init", "large"], root, env)
        made = generate(root / "large" / "capabilities" / "generated", args.rows)
        total = made + 17
        cold_env = {**env, "CAPGATE_CACHE_DIR": str(root / "cold-cache")}
        measure(f"capgate call ({total} rows, first: validates)", call, root / "large",
                cold_env, 1)
        measure(f"capgate call ({total} rows, cached)", call, root / "large", cold_env,
                args.runs)
        measure_mcp(f"capgate mcp to its ready line ({total} rows, cached)", root / "large",
                    cold_env, max(1, args.runs // 3))
        off = {**env, "CAPGATE_CACHE": "off"}
        measure(f"capgate call ({total} rows, cache off)", call, root / "large", off,
                max(1, args.runs // 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
