"""Eight executor processes on one PostgreSQL ledger: with impact claims vs without.

Both sides run the same leased row (``lab.bump`` from ``bench/_support.py``:
a registered step logs the start, a statement bumps the target's counter, a
registered step logs the end, one verify) in 8 worker processes against a
PostgreSQL target, with the ledger on PostgreSQL; leases, budgets, idempotency
and the ledger chain are on in both.  The only difference: impact claims (claim
before ``prepared``, the fence before COMMIT, release after) are switched off
on one side (``executor.claims.set_claims``).  Sides alternate within one run,
each on fresh schemas.

Two workloads:

* ``disjoint`` -- every worker writes its own target: claims never conflict, so
  the ratio is the pure cost of claiming, fencing and releasing;
* ``overlapping`` -- 3 targets for 8 workers: with claims, a worker whose target
  is held gets ImpactConflict and retries (backing off); without them the
  target's row lock serialises the writers inside the database instead.

    .venv/bin/python bench/claims.py [--calls 400] [--rounds 2] [--dsn postgresql://...]

Prints calls per second per side and the ratio with/without claims.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import fresh_pg, pg_url, prepare_lab, run_workers
from sqlalchemy.engine import URL, make_url


def one_run(server: URL, calls: int, workers: int, targets: int, claims: bool,
            dwell_ms: int) -> tuple[float, int]:
    """Calls per second (first start to last finish) and the conflicts seen."""
    with fresh_pg(server) as target, fresh_pg(server) as ledger:
        prepare_lab(target, targets)
        plan = [(1 + i % targets, f"b{i:05d}") for i in range(calls)]
        if targets >= workers:  # disjoint: worker w gets only target w + 1
            plan = [(1 + (i % workers), f"b{i:05d}") for i in range(calls)]
        # budgets stay on, sized so that they never throttle: this measures claims only
        results = run_workers(target, ledger, plan, workers=workers, claims=claims,
                              dwell_ms=dwell_ms, timeout=600,
                              opts={"session_budget": 2 * workers, "budget_wait_seconds": 5})
    applied = sum(len(r["applied"]) for r in results)
    assert applied == calls, f"only {applied} of {calls} calls applied"
    elapsed = max(r["finished"] for r in results) - min(r["started"] for r in results)
    return applied / elapsed, sum(len(r["conflicts"]) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get(
        "CAPGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dwell-ms", type=int, default=0,
                        help="time each call spends inside its lease (registered step)")
    args = parser.parse_args()
    server = pg_url(args.dsn)
    print(f"bench/claims.py: {args.workers} worker processes, {args.calls} leased calls per "
          f"side, PostgreSQL ledger and target ({make_url(args.dsn).host}), "
          f"{args.rounds} round(s), sides alternating, fresh schemas per side")
    print()
    print("| workload | side | calls/s (median) | rounds | conflicts (median) |")
    print("|---|---|---:|---|---:|")
    summary = []
    for name, targets in (("disjoint", args.workers), ("overlapping", 3)):
        rates: dict[bool, list[float]] = {True: [], False: []}
        conflicts: dict[bool, list[int]] = {True: [], False: []}
        for _ in range(args.rounds):
            for claims in (False, True):
                rate, seen = one_run(server, args.calls, args.workers, targets, claims,
                                     args.dwell_ms)
                rates[claims].append(rate)
                conflicts[claims].append(seen)
        for claims in (False, True):
            side = "with claims" if claims else "without claims"
            print(f"| {name} ({targets} targets) | {side} | "
                  f"{statistics.median(rates[claims]):.0f} | "
                  f"{', '.join(f'{r:.0f}' for r in rates[claims])} | "
                  f"{statistics.median(conflicts[claims]):.0f} |")
        summary.append((name, statistics.median(rates[True]) / statistics.median(rates[False])))
    print()
    for name, ratio in summary:
        print(f"ratio with/without claims, {name}: {ratio:.2f}")


if __name__ == "__main__":
    main()
