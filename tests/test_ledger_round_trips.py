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

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import URL

from executor.call import Executor
from executor.ledger import open_ledger
from registry.errors import LedgerError
from tests.fix_capgate import make_executor

NOTE = {"policy_id": 1, "author": "jdoe", "body": "A note."}


class RoundTrips:
    """Round trips of the ledger's driver connections: every pipeline sync and exit, and
    every statement sent outside a pipeline, by the thread that sent it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.on = False
        counter = self
        sync, leave = psycopg.Pipeline.sync, psycopg.Pipeline.__exit__

        def counted_sync(pipeline: Any) -> None:
            if counter.on and counter._ledger(pipeline._conn):
                counter.count += 1
            sync(pipeline)

        def counted_exit(pipeline: Any, *exc: Any) -> None:
            if counter.on and counter._ledger(pipeline._conn):
                counter.count += 1
            leave(pipeline, *exc)

        execute = psycopg.Cursor.execute

        def counted_execute(cursor: Any, *args: Any, **kwargs: Any) -> Any:
            conn = cursor.connection
            if counter.on and counter._ledger(conn) and conn._pipeline is None:
                counter.count += 1
            return execute(cursor, *args, **kwargs)

        monkeypatch.setattr(psycopg.Pipeline, "sync", counted_sync)
        monkeypatch.setattr(psycopg.Pipeline, "__exit__", counted_exit)
        monkeypatch.setattr(psycopg.Cursor, "execute", counted_execute)

    @staticmethod
    def _ledger(conn: Any) -> bool:
        return bool(conn.info.parameter_status("application_name") == "capgate-ledger")

    def during(self, run: Callable[[], Any]) -> int:
        self.count, self.on = 0, True
        try:
            run()
        finally:
            self.on = False
        return self.count


@pytest.fixture
def pg_gate(sqlite_url: URL, pg_ledger_url: URL) -> Iterator[Executor]:
    ex = make_executor(sqlite_url, pg_ledger_url, session_budget=4)
    try:
        yield ex
    finally:
        ex.close()


def test_a_call_costs_the_postgresql_ledger_four_round_trips(
        pg_gate: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepared 2 (every answer, then COMMIT), the claims' re-check before COMMIT 1,
    observed 1 -- it was 5 + 1 + 2 before the checks were deferred and the swap failed."""
    trips = RoundTrips(monkeypatch)
    for policy in (1, 2, 3):  # warm: the case exists, its head is cached, slots seeded
        assert pg_gate.call("policy.add_note", {**NOTE, "policy_id": policy}, case="RT",
                            who="agent").status == "applied_verified"
    seen: dict[str, int] = {}
    from executor import boundaries
    prepared, observed = boundaries.prepared, boundaries.observed

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = trips.count
            try:
                return fn(*args, **kwargs)
            finally:
                seen[name] = seen.get(name, 0) + trips.count - before
        return run

    monkeypatch.setattr(boundaries, "prepared", counting("prepared", prepared))
    monkeypatch.setattr(boundaries, "observed", counting("observed", observed))
    total = trips.during(lambda: pg_gate.call("policy.add_note", {**NOTE, "policy_id": 5},
                                              case="RT", who="agent"))
    assert seen == {"prepared": 2, "observed": 1}, seen
    assert total == 4, (total, seen)


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
        errors: list[BaseException] = []

        def work(n: int) -> None:
            try:
                for i in range(12):
                    (a, b)[n % 2].append("busy", "note", {"thread": n, "i": i})
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
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
        from executor.budget import SessionBudgets
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
