"""What a call costs the PostgreSQL ledger in round trips (issue 13), and the two devices
that brought it down: deferred checks and a head swap that fails when it missed.

``prepared`` queues the idempotency key's claim, the session-budget slot, the impact
claims, the head swap and the event, reads every answer after one round trip, and
commits with a second; ``observed`` (the hooks' releases, the swap, the event, COMMIT)
is one round trip.  The decisions are still taken in their old order -- a key that an
identical call owns answers before a refusal of anything else -- and a swap that missed
a moved head still retries on the head as it is.  On real PostgreSQL and SQLite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench._support import RoundTrips
from capgate.executor.call import Executor
from capgate.executor.ledger import open_ledger
from capgate.registry.errors import LedgerError
from tests.fix_capgate import in_threads, make_executor

NOTE = {"policy_id": 1, "author": "jdoe", "body": "A note."}


@pytest.fixture
def pg_gate(sqlite_url: URL, pg_ledger_url: URL) -> Iterator[Executor]:
    ex = make_executor(sqlite_url, pg_ledger_url, session_budget=4)
    try:
        yield ex
    finally:
        ex.close()


def test_a_call_costs_the_postgresql_ledger_five_round_trips(
        pg_gate: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The idempotency key's owner 1 (read before anything reaches the target: a replay
    is answered from the ledger alone, issue 37), prepared 2 (every answer, then COMMIT),
    the claims' re-check before COMMIT 1, observed 1 -- it was 5 + 1 + 2 before the checks
    were deferred and the swap failed.
    Counted with the bench's own counter (``bench/_support.py``), so this is also what
    ``bench/call_cost.py`` prints."""
    for policy in (1, 2, 3):  # warm: the case exists, its head is cached, slots seeded
        assert pg_gate.call("policy.add_note", {**NOTE, "policy_id": policy}, case="RT",
                            who="agent").status == "applied_verified"
    seen: dict[str, int] = {}
    from capgate.executor import boundaries
    prepared, observed = boundaries.prepared, boundaries.observed
    with RoundTrips() as trips:

        def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                before = trips.ledger
                try:
                    return fn(*args, **kwargs)
                finally:
                    seen[name] = seen.get(name, 0) + trips.ledger - before
            return run

        monkeypatch.setattr(boundaries, "prepared", counting("prepared", prepared))
        monkeypatch.setattr(boundaries, "observed", counting("observed", observed))
        pg_gate.call("policy.add_note", {**NOTE, "policy_id": 5}, case="RT", who="agent")
    assert seen == {"prepared": 2, "observed": 1}, seen
    assert trips.ledger == 5, (trips.ledger, seen)


def test_a_stale_cached_head_misses_its_swap_and_appends_on_the_stored_one(
        pg_ledger_url: URL) -> None:
    """Two ledgers on one store: each caches the head it wrote; the other's appends make
    it stale; the failing swap misses, and the append is taken again on the stored head."""
    with open_ledger(pg_ledger_url) as a, open_ledger(pg_ledger_url) as b:
        for i in range(6):
            writer = (a, b)[i % 2]
            writer.append("shared", "note", {"n": i})
        events = a.events("shared")
        assert [e.payload["n"] for e in events] == list(range(6))
        assert [e.seq for e in events] == list(range(6))
        assert a.verify("shared").findings == () and b.verify("shared").findings == ()


def test_appends_from_eight_threads_and_two_ledgers_never_fork(pg_ledger_url: URL) -> None:
    with open_ledger(pg_ledger_url) as a, open_ledger(pg_ledger_url) as b:

        def work(n: int) -> None:
            for i in range(12):
                (a, b)[n % 2].append("busy", "note", {"thread": n, "i": i})

        assert in_threads(8, work) == []
        events = a.events("busy")
        assert len(events) == 96 and [e.seq for e in events] == list(range(96))
        assert a.verify("busy").findings == ()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_deferred_check_never_settled_refuses_the_commit(
        store: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = f"sqlite:///{tmp_path / 'l.db'}" if store == "sqlite" \
        else request.getfixturevalue("pg_ledger_url")
    with open_ledger(url) as led:
        with pytest.raises(LedgerError, match="never settled"), \
                led._hot.transaction() as tx:
            tx.run("INSERT INTO cg_idempotency (idem_key, case_id, intent_id, fingerprint, "
                   "operation_id, version, created_at) VALUES ('k', 'c', 'i', 'f', 'o', 1, "
                   "'2026-01-01T00:00:00Z')")
            tx.defer(lambda: None)
        assert led.get_idempotency("k") is None  # nothing was committed


def test_an_identical_call_answers_before_a_full_budget(sqlite_url: URL,
                                                        pg_ledger_url: URL) -> None:
    """The key's claim is read after the budget's slot now: a call whose identical twin
    owns the key follows it even when no slot is free, as it did when the key came first."""
    ex = make_executor(sqlite_url, pg_ledger_url, session_budget=1, budget_wait_seconds=0)
    try:
        first = ex.call("policy.add_note", NOTE, case="TWIN", who="agent")
        assert first.status == "applied_verified", first.reason
        from capgate.executor.budget import SessionBudgets
        budgets = ex.hooks.find(SessionBudgets)
        assert budgets is not None
        connector = ex.connectors.get("insurance")
        ticket = budgets.acquire(connector, None, case_id="OTHER")  # the only slot, held
        try:
            again = ex.call("policy.add_note", NOTE, case="TWIN", who="agent")
        finally:
            ticket.release()
        assert again.status == first.status
        assert again.intent_id == first.intent_id  # the owner's outcome, not a new call
    finally:
        ex.close()


_CHILD = r'''
import json, sys, time
from tests.fix_capgate import make_executor
from capgate.registry.errors import CapgateError
spec = json.loads(sys.argv[1])
ex = make_executor(spec["target"], spec["ledger"], schema=False)
try:
    while time.time() < spec["start_at"]:
        time.sleep(0.001)
    try:
        out = ex.call("policy.add_note", spec["inputs"], case=spec["case"], who="agent")
        print(json.dumps({"status": out.status, "intent": out.intent_id}))
    except CapgateError as exc:
        print(json.dumps({"error": exc.code, "message": exc.message}))
finally:
    ex.close()
'''


def test_eight_processes_open_one_new_case_at_once(sqlite_url: URL,
                                                  pg_ledger_url: URL) -> None:
    """Eight different first calls of one new case from eight processes at once: whatever
    each is told -- applied, or a coded refusal (the case has an intent in flight, or the
    key was used for another request) -- none is told the ledger was tampered with, and
    the case verifies.  (The executor's session budget queues them, so this path never
    met the ledger-level race of two appends creating one case, which
    test_appends_from_eight_threads_and_two_ledgers_never_fork catches.)"""
    import json
    import subprocess
    import sys
    import time

    make_executor(sqlite_url, pg_ledger_url).close()  # the schema, once
    root = Path(__file__).resolve().parent.parent
    start_at = time.time() + 2.0
    procs = [subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps({
            "target": sqlite_url.render_as_string(hide_password=False),
            "ledger": pg_ledger_url.render_as_string(hide_password=False),
            "start_at": start_at, "case": "NEW-CASE",
            "inputs": {**NOTE, "policy_id": (1, 2, 3, 5)[n % 4], "body": f"note {n}"}})],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for n in range(8)]
    answers = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        answers.append(json.loads(out.strip().splitlines()[-1]))
    # every child answered with an outcome or a coded refusal (anything else: exit != 0);
    # which refusals depends on timing (an intent in flight CG400, the key taken CG301,
    # a budget wait that ran out on a slow machine) -- never CG410
    assert not [a for a in answers if a.get("error") == "CG410"], answers
    outcomes = [a for a in answers if "status" in a]
    applied = [a for a in outcomes if a["status"] == "applied_verified"]
    # (a rollback is a truthful outcome too: the SQLite target's write lock can time out)
    assert applied and {a["status"] for a in outcomes} <= {"applied_verified", "rolled_back"}
    with open_ledger(pg_ledger_url) as led:
        assert led.verify("NEW-CASE").findings == ()
        prepared = [e for e in led.events("NEW-CASE") if e.kind == "prepared"]
        assert len(prepared) == len(outcomes)
    engine = sa.create_engine(sqlite_url, poolclass=sa.pool.NullPool)
    try:  # what each outcome says is what the target holds: one note per applied call
        with engine.connect() as conn:
            written = conn.execute(sa.text(
                "SELECT count(*) FROM policy_note WHERE body LIKE 'note %'")).scalar_one()
    finally:
        engine.dispose()
    assert written == len(applied), (written, answers)


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_four_ledgers_sixteen_threads_every_kind_of_append(
        store: str, tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ledger objects (as four processes would be) on one store, HMAC key set, four
    threads each: single appends, multi-event appends and bulk appends over overlapping
    cases, new and old.  Nothing forks, nothing is lost, nothing is refused as tampered,
    and every case verifies under the key."""
    monkeypatch.setenv("CAPGATE_LEDGER_HMAC_KEY", "round-trips-key")
    url = f"sqlite:///{tmp_path / 'l.db'}" if store == "sqlite" \
        else request.getfixturevalue("pg_ledger_url")
    ledgers = [open_ledger(url) for _ in range(4)]
    cases = [f"case-{c}" for c in range(5)]

    def work(n: int) -> None:
        led = ledgers[n % 4]
        for i in range(10):
            case = cases[(n + i) % len(cases)]
            if i % 3 == 0:
                led.append(case, "note", {"n": n, "i": i})
            elif i % 3 == 1:
                led.append_many(case, [("note", {"n": n, "i": i, "part": 0}, None),
                                       ("note", {"n": n, "i": i, "part": 1}, None)])
            else:
                led.append_each([(c, "note", {"n": n, "i": i, "bulk": c}, None)
                                 for c in cases[:3]])

    try:
        errors = in_threads(16, work)
        assert errors == [], errors[:3]
        expected = 16 * (4 * 1 + 3 * 2) + 16 * 3 * 3  # singles, pairs, bulk x 3 cases
        total = 0
        for case in cases:
            events = ledgers[0].events(case)
            assert [e.seq for e in events] == list(range(len(events)))
            assert ledgers[0].verify(case).findings == ()
            total += len(events)
        assert total == expected
    finally:
        for led in ledgers:
            led.close()
