"""Eight executor processes, one PostgreSQL ledger, three overlapping targets.

Every call is a leased ``lab.bump``: it logs when it started, bumps its target's
counter, logs when it ended.  With impact claims no two cases may be inside a
write on one target at once, so per target the logged intervals never overlap;
every refusal is an ImpactConflict naming a real holder; nothing is lost or
done twice; and every case's chain verifies.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.claims import key_hash
from capgate.executor.ledger import open_ledger
from tests.fix_capgate import make_executor
from tests.fix_db import engine_params
from tests.test_lease_support import lab_schema, run_workers

CALLS = 200
TARGETS = 3


@pytest.fixture
def pg_ledger(pg_ledger_url: URL) -> URL:
    return pg_ledger_url


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_target(request: pytest.FixtureRequest) -> URL:
    url: URL = request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])
    return url


def rows(url: URL, sql: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def overlaps(log: list[tuple[Any, ...]]) -> list[tuple[str, str]]:
    """Pairs of calls on one target whose [started, ended] intervals intersect."""
    found = []
    by_target: dict[int, list[tuple[float, float, str]]] = {}
    for ref, target, started, ended in log:
        by_target.setdefault(int(target), []).append((float(started), float(ended), str(ref)))
    for spans in by_target.values():
        spans.sort()
        for (_, end_a, ref_a), (start_b, _, ref_b) in itertools.pairwise(spans):
            if start_b < end_a:
                found.append((ref_a, ref_b))
    return found


def prepare(target: URL, ledger: URL) -> None:
    ex = make_executor(target, ledger)  # the example schema
    try:
        lab_schema(target, TARGETS)
        for name in ("insurance", "insurance_code"):
            ex.connectors.get(name).check_target()
    finally:
        ex.connectors.dispose()
        ex.ledger.close()


@pytest.mark.slow
def test_eight_executors_never_write_one_target_at_once(server_target: URL,
                                                        pg_ledger: URL) -> None:
    prepare(server_target, pg_ledger)
    calls = [(1 + (i * 7 + i // 3) % TARGETS, f"r{i:03d}") for i in range(CALLS)]
    results = run_workers(server_target, pg_ledger, calls, workers=8, dwell_ms=3)
    applied = [a for r in results for a in r["applied"]]
    conflicts = [c for r in results for c in r["conflicts"]]
    assert not [o for r in results for o in r["other"]]

    # every call applied exactly once; nothing lost, nothing twice
    assert len(applied) == CALLS
    assert [a for a in applied if a["status"] != "applied_verified"] == []
    assert sorted(a["ref"] for a in applied) == sorted(ref for _, ref in calls)
    per_target = Counter(t for t, _ in calls)
    counters = dict(rows(server_target, "SELECT target_id, n FROM lab_counter"))
    assert {int(k): int(v) for k, v in counters.items()} == dict(per_target)
    log = rows(server_target, "SELECT call_ref, target_id, started, ended FROM lab_log")
    assert len(log) == CALLS and all(r[3] is not None for r in log)
    assert rows(server_target, "SELECT count(*) FROM capgate_landed") == [(CALLS,)]

    # no target written by two cases at once
    assert overlaps(log) == []

    # every conflict was reported, naming a real holder of that very target
    assert conflicts, "8 workers on 3 targets must have collided"
    writers = {t: {f"case-{a['ref']}" for a in applied if a["target"] == t}
               for t in per_target}
    for c in conflicts:
        assert c["holder_case"] != f"case-{c['ref']}"
        assert c["holder_case"] in writers[c["target"]], c
        assert c["key"] == f"dev/lab/counter/target_id={c['target']}"

    # the shared ledger verifies, no case is left open, every claim is free again
    ledger = open_ledger(pg_ledger)
    try:
        report = ledger.verify()
        assert report.ok, report.to_dict()
        assert not ledger.cases(open_only=True)
        assert len(ledger.cases()) == CALLS
    finally:
        ledger.close()
    claims = rows(pg_ledger, "SELECT impact_key, token, case_id FROM cg_claims")
    assert all(case is None for _, _, case in claims)
    # the target's fence rows carry each key's last token
    fence = {h: t for h, t in rows(server_target, "SELECT key_hash, token FROM capgate_fence")}
    ((ledger_id,),) = rows(pg_ledger, "SELECT value FROM cg_meta WHERE key = 'ledger_id'")
    assert {key_hash(f"{ledger_id}\n{k}"): t for k, t, _ in claims} == fence
    # one token per successful acquisition: a refused claim takes none
    assert sum(int(t) for _, t, _ in claims) == CALLS
    print(f"{len(conflicts)} conflicts over {CALLS} calls")


@pytest.mark.slow
def test_the_overlap_detector_sees_overlap_without_claims(pg_url: URL,
                                                          pg_ledger: URL) -> None:
    """The same workload with claims switched off overlaps: the detector is not vacuous."""
    prepare(pg_url, pg_ledger)
    calls = [(1 + i % TARGETS, f"n{i:03d}") for i in range(24)]
    results = run_workers(pg_url, pg_ledger, calls, workers=8, claims=False, dwell_ms=100)
    assert sum(len(r["applied"]) for r in results) == 24
    assert not any(r["conflicts"] for r in results)
    log = rows(pg_url, "SELECT call_ref, target_id, started, ended FROM lab_log")
    assert overlaps(log), "without claims, writers on one target run at the same time"
    counters = dict(rows(pg_url, "SELECT target_id, n FROM lab_counter"))
    assert sum(int(v) for v in counters.values()) == 24  # row locks still serialise the bump
