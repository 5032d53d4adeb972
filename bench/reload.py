"""What looking at the files before every call costs, and what a reload costs.

A long-lived executor (the MCP server, a Python caller's) stats the grants
file, the capability files and the lock before every call
(``executor.sources.LiveSources``), and re-reads what changed.  Measured here,
in one process and one run:

* ``check``: ``LiveSources.refresh`` when nothing changed -- the stat of every
  file and folder -- per call, for the example capabilities (4 files) and for a
  generated registry of ``--rows`` rows in ``--files`` files (bench/registry.py's
  generator), against ``Registry.resolve`` of the same registry (the lookup
  every call does anyway) and against a whole read call (``policy.get`` through
  ``capgate.open`` on a SQLite target, refresh included) in the same run;
* ``reload``: the swap after one capability file changed (the others come from
  the validation cache), and after the grants file changed.

    .venv/bin/python bench/reload.py [--rows 10000] [--files 20] [--checks 20000]

Prints a table; results are recorded by hand in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import HERE, bench_module

ROOT = HERE.parent


class _Target:
    registry: Any
    grants: Any


def per_call_us(fn: Any, calls: int) -> float:
    """The median over five rounds of ``calls`` calls, in microseconds per call."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--checks", type=int, default=20_000)
    args = parser.parse_args(argv)

    import capgate
    from capgate.executor.grants import Grants
    from capgate.executor.sources import RACY_SECONDS, LiveSources
    from capgate.registry.loader import update_lock
    from capgate.sqlfiles import apply_schema

    out: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="cg-reload-") as tmp:
        base = Path(tmp)
        os.environ["CAPGATE_CACHE_DIR"] = str(base / "cache")
        grants = base / "grants.toml"
        grants.write_text('[principals.agent]\ngrants = [{ connector = "*", environments = '
                          '["dev"], access = "write" }]\n')

        # the example project: 4 files and a lock, a SQLite target
        caps = base / "capabilities"
        shutil.copytree(ROOT / "capabilities", caps)
        import sqlalchemy as sa

        engine = sa.create_engine(f"sqlite:///{base / 'target.db'}")
        apply_schema(engine)
        from capgate.executor.dialects import dialect_for
        from capgate.executor.target import install

        install(engine, dialect_for("sqlite"))
        engine.dispose()
        (base / "capgate.toml").write_text(
            f'[capgate]\ncapabilities = ["capabilities"]\ngrants = "grants.toml"\n'
            f'ledger = "sqlite:///{base / "ledger.db"}"\n'
            f'[connectors.insurance]\nurl = "sqlite:///{base / "target.db"}"\n'
            'environment = "dev"\ncase_claim_seconds = 0\n')
        small = LiveSources([str(caps)], str(grants))
        target = _Target()
        target.registry, target.grants = small.load_registry(), small.load_grants()
        racy = per_call_us(lambda: small.refresh(target), 200)
        out.append(("check within 2 s of a write (contents compared too), example files",
                    racy, "us"))
        time.sleep(RACY_SECONDS + 0.2)  # then the steady state: a stat per file and folder
        check_small = per_call_us(lambda: small.refresh(target), args.checks)
        out.append(("check, example capabilities (4 files + lock + grants)", check_small, "us"))
        with capgate.open(base / "capgate.toml") as ex:
            n = [0]

            def read() -> None:
                n[0] += 1
                ex.call("policy.get", {"policy_id": 1}, case=f"R-{n[0] // 50}", who="agent")

            for _ in range(50):
                read()
            call_us = per_call_us(read, 200)
        out.append(("a read call through capgate.open (SQLite), refresh included", call_us,
                    "us"))

        # a generated registry
        big = base / "big"
        big.mkdir()
        generator = bench_module("registry")
        generator.generate(big, args.rows, args.files)
        update_lock([big])
        sources = LiveSources([str(big)], str(grants))
        target.registry, target.grants = sources.load_registry(), sources.load_grants()
        time.sleep(RACY_SECONDS + 0.2)
        check_big = per_call_us(lambda: sources.refresh(target), args.checks)
        out.append((f"check, {args.rows:,} rows in {args.files} files (+ lock + grants)",
                    check_big, "us"))
        registry = target.registry
        ops = [r.operation_id for r in registry.current_rows()][:1000]
        i = [0]

        def resolve() -> None:
            i[0] = (i[0] + 1) % len(ops)
            registry.resolve(ops[i[0]])

        resolve_us = per_call_us(resolve, args.checks)
        out.append(("Registry.resolve, same registry (the lookup a call does anyway)",
                    resolve_us, "us"))

        # a reload: one capability file changed, then the grants file
        first = sorted(big.glob("caps_*.yaml"))[0]
        text = first.read_text()
        first.write_text(text.replace("# generated", "# edited, generated", 1))
        start = time.perf_counter()
        assert sources.refresh(target)
        out.append(("reload after one capability file changed", (time.perf_counter() - start)
                    * 1e3, "ms"))
        grants.write_text(grants.read_text().replace('"write"', '"read"'))
        start = time.perf_counter()
        assert sources.refresh(target)
        out.append(("reload after the grants file changed", (time.perf_counter() - start) * 1e3,
                    "ms"))
        assert isinstance(target.grants, Grants) and target.grants.failure is None

    width = max(len(name) for name, _, _ in out)
    for name, value, unit in out:
        print(f"{name:<{width}}  {value:10.1f} {unit}")
    print(f"check / read call: {check_small / call_us:.2%} (example capabilities); "
          f"check / resolve, {args.rows:,} rows: {check_big / resolve_us:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
