"""The partition soak: hundreds of calls cut off at random protocol messages, then settled.

One warm executor reaches its target (PostgreSQL or MariaDB) and its PostgreSQL ledger
through partition proxies (``tests/fix_partition.py``).  Each call gets a fault at
random -- none; the target or the ledger frozen at a random message of the call; the
reply to the target's or the ledger's COMMIT dropped -- and must return within its
bound (the deadline + the grace when the target is cut, the ledger's wait bound + the
grace when the ledger is).  Then the proxy is healed or reset at random, and resume,
from a healthy path, settles the case.  At the end, per request: 0 duplicates (two
rows), 0 lost (the ledger or the caller says applied, no row), 0 phantoms (a row the
ledger says did not land), 0 unsettled cases.

Marked ``slow`` and ``partition``; ``CAPGATE_PARTITION_SOAK_CALLS`` (default 150 per
target engine) and ``CAPGATE_PARTITION_SOAK_SEED`` (printed) steer it.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.ledger import LedgerBounds, open_ledger
from capgate.executor.recovery.resume import resume
from capgate.registry.loader import validate_texts
from capgate.registry.registry import Registry
from tests.fix_partition import PartitionProxy
from tests.test_partition import GRACE, Running, executor_on, partition_registry, prepare

pytestmark = [pytest.mark.slow, pytest.mark.partition]

DEADLINE = 1.0
BOUNDS = LedgerBounds(wait_seconds=1.5, read_seconds=1.5, hold_seconds=1.0,
                      connect_seconds=2.0)

SOAK_ROW = """
format: 1
connectors: {insurance: {}}
rows:
  - operation_id: part.soak
    version: 1
    connector: insurance
    description: Append a note under a 1 s deadline (the partition soak).
    input:
      type: object
      additionalProperties: false
      required: [policy_id, body]
      properties:
        policy_id: {type: integer}
        body: {type: string}
    target: {system: insurance, object: policy_note, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{body}"
    timeout: {seconds: 1, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {name: insert_note,
         sql: "INSERT INTO policy_note (policy_id, author, body)
               VALUES (:policy_id, 'soak', :body)",
         expect_rows: 1}
    verify:
      - name: noted
        sql: "SELECT count(*) FROM policy_note WHERE body = :body"
        expect: {value: 1}
"""

FAULTS = ("none", "target_freeze", "target_drop_commit", "ledger_freeze",
          "ledger_drop_commit")


def soak_registry() -> Registry:
    result = validate_texts([("soak.yaml", SOAK_ROW)])
    result.raise_for_problems()
    return Registry(list(partition_registry().rows()) + list(result.rows))


def rows_by_body(target: URL) -> Counter[str]:
    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return Counter(str(r[0]) for r in conn.execute(sa.text(
                "SELECT body FROM policy_note WHERE author = 'soak'")))
    finally:
        engine.dispose()


@pytest.fixture(params=["postgresql", "mariadb"])
def soak_target(request: pytest.FixtureRequest) -> URL:
    url: URL = request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])
    prepare(url)
    return url


def test_partition_soak(soak_target: URL, pg_ledger_url: URL,
                        partition_proxy: Callable[..., PartitionProxy]) -> None:
    calls = int(os.environ.get("CAPGATE_PARTITION_SOAK_CALLS", "150"))
    seed = int(os.environ.get("CAPGATE_PARTITION_SOAK_SEED", str(int(time.time()))))
    print(f"partition soak: {calls} calls, seed {seed} (CAPGATE_PARTITION_SOAK_SEED)")
    rng = random.Random(seed)
    target_proxy = partition_proxy(soak_target)
    ledger_proxy = partition_proxy(pg_ledger_url)
    open_ledger(pg_ledger_url, bounds=BOUNDS).close()  # the tables, made healthy
    cut: Executor = executor_on(target_proxy.url(soak_target),
                                open_ledger(ledger_proxy.url(pg_ledger_url), bounds=BOUNDS),
                                connect_timeout=2.0, network_timeout=2.0)
    cut.registry = soak_registry()
    healthy = executor_on(soak_target, open_ledger(pg_ledger_url, bounds=BOUNDS))
    healthy.registry = soak_registry()
    answers: dict[str, tuple[str, str]] = {}  # body -> (fault, what the call said)
    late: list[str] = []
    unsettled: list[str] = []
    tally: Counter[str] = Counter()
    slowest: dict[str, float] = {}
    for n in range(calls):
        fault = rng.choice(FAULTS)
        body = f"soak-{seed}-{n}"
        case = f"S-{seed}-{n}"
        proxy = target_proxy if fault.startswith("target") else ledger_proxy
        if fault.endswith("freeze"):
            proxy.freeze_at(rng.randrange(0, 14 if fault.startswith("target") else 30),
                            after=rng.random() < 0.5)
        elif fault.endswith("drop_commit"):
            proxy.drop_commit_reply()
        run = Running(lambda b=body, c=case: cut.call("part.soak", {"policy_id": 1,
                                                                    "body": b},
                                                      case=c, who="agent"))
        bound = (DEADLINE if fault.startswith("target") else BOUNDS.wait_seconds) + GRACE
        run.thread.join(bound + 30)
        said = (run.result.status if run.error is None and run.result is not None
                else getattr(run.error, "code", type(run.error).__name__))
        if run.thread.is_alive() or (run.elapsed or 0) > bound:
            late.append(f"{body} {fault}: {run.elapsed or 'still running'} s "
                        f"(bound {bound:.1f} s) -> {said}")
        answers[body] = (fault, str(said))
        slowest[fault] = max(slowest.get(fault, 0.0), run.elapsed or float("inf"))
        if os.environ.get("CAPGATE_PARTITION_SOAK_VERBOSE"):
            print(f"  {body} {fault} {run.elapsed and round(run.elapsed, 2)} s: "
                  f"{said} {getattr(run.error, 'message', '')[:300]}")
        tally[f"{fault} -> {said}"] += 1
        for p in (target_proxy, ledger_proxy):  # heal or reset; disarm what did not fire
            if rng.random() < 0.5:
                p.heal()
            else:
                p.reset()
        if healthy.ledger.snapshot(case) is not None:
            for _ in range(3):
                report = resume(healthy, case, wait_seconds=3.0)
                if report.resolved:
                    break
            else:
                unsettled.append(f"{case}: {report.lines()}")
    rows = rows_by_body(soak_target)
    duplicates = {b: k for b, k in rows.items() if k > 1}
    lost: list[str] = []
    phantoms: list[str] = []
    for body, (fault, said) in answers.items():
        owner = healthy.ledger.get_idempotency(f"S-{body.removeprefix('soak-')}:{body}")
        recorded = None
        if owner is not None:
            state = healthy.ledger.intent(owner.case_id, owner.intent_id)
            recorded = (state.get("outcome_record") or {}).get("status")
        landed = rows.get(body, 0) > 0
        applied = recorded in ("applied_verified", "already_applied") or said in (
            "applied_verified", "already_applied")
        if applied and not landed:
            lost.append(f"{body} ({fault}): said {said}, recorded {recorded}, no row")
        if landed and not applied:
            phantoms.append(f"{body} ({fault}): said {said}, recorded {recorded}, a row")
    print("faults and answers:")
    for key, count in sorted(tally.items()):
        print(f"  {count:4d}  {key}")
    print("slowest answer per fault: " + ", ".join(
        f"{fault} {seconds:.2f} s" for fault, seconds in sorted(slowest.items())))
    print(f"duplicates {len(duplicates)}, lost {len(lost)}, phantoms {len(phantoms)}, "
          f"unsettled {len(unsettled)}, late {len(late)} of {calls}")
    healthy.close()
    cut.close()
    assert not duplicates, duplicates
    assert not lost, lost
    assert not phantoms, phantoms
    assert not unsettled, unsettled
    assert not late, late
