"""Session budgets: slots in the ledger store, shared by processes, checked before the
database's own cap -- the 7th session of a 6-session user waits or is refused.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor import budget
from capgate.executor.budget import Scope, SlotStore
from capgate.executor.call import Executor
from capgate.executor.ledger import open_ledger
from capgate.registry import errors
from tests.test_lease_support import spawn, url_text, wait_for_file

NOTE = {"policy_id": 1, "author": "jdoe", "body": "Within budget."}


def test_slots_are_shared_refused_with_their_holders_and_expire(ledger_url: URL) -> None:
    ledger = open_ledger(ledger_url)
    try:
        one, two = SlotStore(ledger), SlotStore(ledger)  # two executors, one store
        scope = Scope("connector:test", 2, "connector", "connector 'test'")
        first = one.acquire([scope], wait=0, ttl=30, case_id="A", intent_id="a")
        second = two.acquire([scope], wait=0, ttl=0.3, case_id="B", intent_id="b")
        with pytest.raises(errors.BudgetExhausted) as caught:
            one.acquire([scope], wait=0.1, ttl=30, case_id="C")
        details = caught.value.details
        assert details["budget"] == 2 and details["scope"] == "connector"
        assert sorted(h["case_id"] for h in details["holders"]) == ["A", "B"]
        assert details["waited_seconds"] >= 0.1
        time.sleep(0.35)  # B's holder vanished without releasing: its slot expires
        third = one.acquire([scope], wait=0, ttl=30, case_id="C")
        assert {first.slots[0][1], third.slots[0][1]} == {0, 1}
        first.release()
        first.release()  # exactly once
        fourth = two.acquire([scope], wait=0, ttl=30, case_id="D")
        assert fourth.slots == first.slots
        del second
    finally:
        ledger.close()


def test_a_call_waits_for_a_slot_then_runs(gate: Callable[..., Executor], sqlite_url: URL,
                                           tmp_path: Path) -> None:
    ex = gate(sqlite_url, session_budget=1, budget_wait_seconds=3)
    connector = ex.connectors.get("insurance")
    with budget.holding(ex, connector, 1):
        other = gate(sqlite_url, f"sqlite:///{tmp_path / 'ledger0.db'}", schema=False,
                     session_budget=1, budget_wait_seconds=0)
        with pytest.raises(errors.BudgetExhausted) as caught:
            other.call("policy.add_note", NOTE, case="B-refused", who="agent")
        assert caught.value.details["scope"] == "connector"
        assert other.ledger.snapshot("B-refused") is None  # refused before `prepared`
    out = ex.call("policy.add_note", NOTE, case="B-ok", who="agent")
    assert out.status == "applied_verified"


# --- a real 6-session database user, and processes ------------------------------------------


@pytest.fixture
def capped_user(pg_url: URL) -> Iterator[URL]:
    """``pg_url`` as a fresh role the server itself caps at 6 sessions."""
    role = f"cgb_{uuid.uuid4().hex[:10]}"
    password = uuid.uuid4().hex  # a server that checks passwords (a container) asks for one
    schema = str(pg_url.query["options"]).split("=", 1)[1]
    admin = sa.create_engine(pg_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' CONNECTION LIMIT 6"))
        conn.execute(sa.text(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO {role}'))
        conn.execute(sa.text(f'ALTER DEFAULT PRIVILEGES IN SCHEMA "{schema}" '
                             f"GRANT ALL ON TABLES TO {role}"))
    try:
        yield pg_url.set(username=role, password=password)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
        admin.dispose()


@pytest.fixture
def pg_ledger(pg_ledger_url: URL) -> URL:
    return pg_ledger_url


@pytest.mark.crash
def test_the_seventh_session_of_a_six_session_user_is_refused_or_waits(
        gate: Callable[..., Executor], pg_url: URL, capped_user: URL, pg_ledger: URL,
        tmp_path: Path) -> None:
    gate(pg_url, pg_ledger).connectors.dispose()  # the schema, as the admin
    opts: dict[str, Any] = {"session_budget": 10, "db_user_budget": 6}
    ready = tmp_path / "hold.ready"
    # another executor process: 3 sessions on each of two connectors, one database user
    proc = spawn("hold", {"target": url_text(capped_user), "ledger": url_text(pg_ledger),
                          "opts": opts, "sessions": {"insurance": 3, "insurance_code": 3},
                          "ready": str(ready), "seconds": 2.5})
    try:
        wait_for_file(ready, proc)
        raw = capped_user.set(drivername="postgresql")
        with pytest.raises(psycopg.OperationalError, match="too many connections for role"):
            psycopg.connect(raw.render_as_string(hide_password=False)).close()  # the real cap
        refuse = gate(capped_user, pg_ledger, schema=False, **opts, budget_wait_seconds=0)
        started = time.monotonic()
        with pytest.raises(errors.BudgetExhausted) as caught:
            refuse.call("policy.add_note", NOTE, case="U-refused", who="agent")
        assert time.monotonic() - started < 1.0
        details = caught.value.details
        assert details["scope"] == "db_user" and details["budget"] == 6
        assert len(details["holders"]) == 6
        assert refuse.ledger.snapshot("U-refused") is None
        waiter = gate(capped_user, pg_ledger, schema=False, **opts, budget_wait_seconds=10)
        started = time.monotonic()
        out = waiter.call("policy.add_note", NOTE, case="U-waited", who="agent")
        waited = time.monotonic() - started
        assert out.status == "applied_verified", out.reason
        assert waited > 0.5, waited  # it waited for the other process to let go
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


@pytest.mark.crash
def test_a_killed_holders_slots_free_themselves(gate: Callable[..., Executor], pg_url: URL,
                                                tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(pg_url, ledger, budget_wait_seconds=8)
    ready = tmp_path / "hold.ready"
    proc = spawn("hold", {"target": url_text(pg_url), "ledger": ledger, "margin": 0.5,
                          "opts": {"statement_timeout": 1.0}, "sessions": {"insurance": 6},
                          "ready": str(ready), "seconds": 60})
    wait_for_file(ready, proc)
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    out = ex.call("policy.add_note", NOTE, case="K-after", who="agent")
    assert out.status == "applied_verified", out.reason
    assert time.monotonic() - killed < 1.5 + 1.0  # the slots' expiry: 1 s timeout + 0.5 s
