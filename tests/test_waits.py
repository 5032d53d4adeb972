"""The wait line: a busy target or a full budget makes a call wait its turn, fairly and
for a bounded time, outside every transaction -- and never lets two cases write one key
at once.

Before it, a call that met another case's claim was refused at once (CG320), a call that
met a full budget waited for a slot with the target's transaction open -- and the server,
seeing that transaction idle, ended it (``terminating connection due to
idle-in-transaction timeout``): a rollback of capgate's own making.  With the defaults
``capgate init`` wrote (a 900 s case-held claim, no budget wait) 4 of 320 calls on 4 hot
targets applied.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor import budget
from capgate.executor.call import Executor
from capgate.executor.claims import ClaimStore, store_for
from capgate.executor.ledger import open_ledger
from capgate.executor.waits import NO_TURN, claim_resource, line_for
from capgate.registry import errors
from tests.fix_capgate import in_threads

ROOT = Path(__file__).resolve().parent.parent
KEY = "dev/insurance/policy_note/policy_id=1"


def note(body: str, policy: int = 1) -> dict[str, Any]:
    return {"policy_id": policy, "author": "waiter", "body": body}


def waiting_turns(ex: Executor, key: str = KEY) -> int:
    with ex.ledger.transaction("test: read the wait line", write=False) as tx:
        row = tx.run(f"SELECT count(*) FROM cg_waits WHERE resource = :r AND expires_at > "
                     f"{ex.ledger.sql_now}", {"r": claim_resource(key)}).first()
    return int(row[0]) if row else 0


def until(what: Callable[[], bool], seconds: float, said: str) -> None:
    """Poll ``what`` (never a fixed sleep); fail with how long it was given."""
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            pytest.fail(f"{said}: not within {seconds} s")
        time.sleep(0.01)


def notes(url: URL) -> list[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [str(r[0]) for r in conn.execute(sa.text(
                "SELECT body FROM policy_note WHERE policy_id = 1 AND author = 'waiter' "
                "ORDER BY note_id"))]
    finally:
        engine.dispose()


# --- fair: first come, first served, across executors sharing the ledger ------------------


@pytest.mark.parametrize("target", ["sqlite", "postgresql"])
def test_waiters_on_a_held_target_write_in_the_order_they_came(
        gate: Callable[..., Executor], sqlite_url: URL, tmp_path: Path, target: str,
        request: pytest.FixtureRequest) -> None:
    url = sqlite_url if target == "sqlite" else request.getfixturevalue("pg_url")
    ledger = f"sqlite:///{tmp_path / 'shared.db'}"
    first = gate(url, ledger, claim_wait_seconds=30)
    waiters = [first] + [gate(url, ledger, schema=False, claim_wait_seconds=30)
                         for _ in range(3)]
    store = store_for(first)
    held = store.acquire([KEY], case_id="HOLDER", intent_id="h", operation_id="x", ttl=60)
    outcomes: dict[int, Any] = {}
    threads = []
    for n, ex in enumerate(waiters):
        def run(n: int = n, ex: Executor = ex) -> None:
            outcomes[n] = ex.call("policy.add_note", note(f"W{n}"), case=f"W-{n}",
                                  who="agent")
        threads.append(threading.Thread(target=run))
        threads[-1].start()
        until(lambda n=n: waiting_turns(first) == n + 1, 60, f"waiter {n} in line")
    assert notes(url) == []  # nobody wrote past the holder
    store.release(held)
    for t in threads:
        t.join(120)
    assert [outcomes[n].status for n in range(4)] == ["applied_verified"] * 4
    assert notes(url) == ["W0", "W1", "W2", "W3"]  # in the order they came
    assert waiting_turns(first) == 0  # each place went with its `prepared`
    assert first.ledger.verify().ok


def test_a_free_key_is_not_taken_past_an_earlier_waiter(ledger_url: URL) -> None:
    """The grant rule itself: a claimer without a turn meets the line's earliest live turn
    (CG320, the waiter counted) and takes the key once that turn has gone."""
    ledger = open_ledger(ledger_url)
    try:
        store, line = ClaimStore(ledger), line_for(ledger)
        # someone held it (a waiter only stands in the line of a claimed key) and let go
        store.release(store.acquire([KEY], case_id="OLD", intent_id="o", operation_id="x",
                                    ttl=30))
        line.stand("w", [claim_resource(KEY)], case_id="W", intent_id="w")
        with pytest.raises(errors.ImpactConflict) as refused:
            store.acquire([KEY], case_id="LATE", intent_id="l", operation_id="x", ttl=30)
        assert refused.value.code == "CG320" and refused.value.details["waiting_before"] == 1
        mine = store.acquire([KEY], case_id="W", intent_id="w", operation_id="x", ttl=30,
                             turn=line.turn_of("w"))
        assert mine.tokens[KEY] >= 1
        store.release(mine)
        line.leave("w")
        late = store.acquire([KEY], case_id="LATE", intent_id="l", operation_id="x", ttl=30,
                             turn=NO_TURN)
        assert late.tokens[KEY] == mine.tokens[KEY] + 1  # a new holder, a new token
    finally:
        ledger.close()


# --- bounded: the wait ends in a coded refusal, leaving nothing --------------------------


def test_a_wait_ends_at_claim_wait_seconds_with_cg320_and_records_nothing(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url, claim_wait_seconds=0.5)
    store = store_for(ex)
    held = store.acquire([KEY], case_id="HOLDER", intent_id="h", operation_id="x", ttl=60)
    started = time.monotonic()
    with pytest.raises(errors.ImpactConflict) as refused:
        ex.call("policy.add_note", note("late"), case="LATE-1", who="agent")
    assert time.monotonic() - started >= 0.5
    assert refused.value.code == "CG320"
    assert "case_id" not in refused.value.details  # another case is never shown
    assert refused.value.holder["case_id"] == "HOLDER"
    assert refused.value.details["waited_seconds"] >= 0.5
    assert "claim_wait_seconds=0.5" in refused.value.message
    assert ex.ledger.snapshot("LATE-1") is None  # nothing prepared, nothing recorded
    assert waiting_turns(ex) == 0  # and its place in line is gone
    assert notes(sqlite_url) == []
    store.release(held)


def test_a_case_held_target_is_waited_for_then_refused_with_its_decision(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    """A case that holds its target across calls (case_claim_seconds > 0) does not give it
    back by itself: the asking case waits its claim_wait_seconds, then gets CG330 and the
    coordination decision recorded in both cases, as before."""
    ex = gate(sqlite_url, case_claim_seconds=60, claim_wait_seconds=0.3)
    assert ex.call("policy.add_note", note("mine"), case="HOLD-1",
                   who="agent").status == "applied_verified"
    with pytest.raises(errors.CoordinationRequired) as refused:
        ex.call("policy.add_note", note("yours"), case="ASK-1", who="agent")
    assert refused.value.details["waited_seconds"] >= 0.3
    decision = refused.value.details["decision_id"]
    for case in ("HOLD-1", "ASK-1"):
        state = ex.ledger.snapshot(case) or {}
        assert any(decision in k for k in (state.get("case") or {})), case


# --- outside the transaction: no rollback of capgate's own making ------------------------


@pytest.mark.postgresql
def test_waiting_for_a_slot_never_leaves_the_targets_transaction_idle(
        gate: Callable[..., Executor], pg_url: URL, tmp_path: Path) -> None:
    """A pooled session, a full budget (another executor holds the only slot for longer
    than the server's idle-in-transaction grace): the call waits, then applies.  It used
    to wait inside its open transaction, which PostgreSQL ended as idle -- rolled back."""
    ledger = f"sqlite:///{tmp_path / 'shared.db'}"
    caller = gate(pg_url, ledger, session_budget=1, budget_wait_seconds=20)
    neighbour = gate(pg_url, ledger, schema=False, session_budget=1)
    assert caller.call("policy.add_note", note("warm"), case="WARM", who="agent"
                       ).status == "applied_verified"  # leaves an idle session in the pool
    connector = neighbour.connectors.get("insurance")
    grace = connector.dialect.idle_grace_seconds
    outcome: list[Any] = []
    with budget.holding(neighbour, connector, 1):
        done = threading.Thread(target=lambda: outcome.append(caller.call(
            "policy.add_note", note("after the wait"), case="WAIT-1", who="agent")))
        done.start()
        line = ("slot:connector:insurance",)
        until(lambda: _turns_for(caller, line[0]) == 1, 60, "the caller in the budget's line")
        time.sleep(grace * 3)  # the neighbour keeps the slot past the server's idle grace
    done.join(60)
    (result,) = outcome
    assert result.status == "applied_verified", result.reason
    assert notes(pg_url)[-1] == "after the wait"


def _turns_for(ex: Executor, resource: str) -> int:
    with ex.ledger.transaction("test: read the wait line", write=False) as tx:
        row = tx.run("SELECT count(*) FROM cg_waits WHERE resource = :r",
                     {"r": resource}).first()
    return int(row[0]) if row else 0


# --- a waiter that died stops holding its place -------------------------------------------


_WAITER = """
import json, sys
from tests.fix_capgate import make_executor
spec = json.loads(sys.argv[1])
ex = make_executor(spec["target"], spec["ledger"], schema=False, claim_wait_seconds=120)
ex.call("policy.add_note", {"policy_id": 1, "author": "waiter", "body": "never"},
        case="DEAD-1", who="agent")
"""


@pytest.mark.crash
def test_a_killed_waiter_gives_its_place_up(gate: Callable[..., Executor], sqlite_url: URL,
                                            tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'shared.db'}"
    ex = gate(sqlite_url, ledger, claim_wait_seconds=60)
    store = store_for(ex)
    held = store.acquire([KEY], case_id="HOLDER", intent_id="h", operation_id="x", ttl=120)
    spec = json.dumps({"target": str(sqlite_url), "ledger": ledger})
    proc = subprocess.Popen([sys.executable, "-c", _WAITER, spec], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        until(lambda: waiting_turns(ex) == 1, 120, "the doomed waiter in line")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    store.release(held)
    # the dead waiter came first; its place lapses (ROW_TTL) and the next one goes
    result = ex.call("policy.add_note", note("alive"), case="ALIVE-1", who="agent")
    assert result.status == "applied_verified"
    assert notes(sqlite_url) == ["alive"]


# --- the defaults init writes, under load ---------------------------------------------------


def test_init_defaults_let_many_one_call_cases_on_hot_targets_apply(tmp_path: Path) -> None:
    """16 threads x 4 calls on 2 hot targets, each call its own case, on the configuration
    `capgate init` writes, untouched: every call applies, each exactly once.  (Before:
    CG330 for every case after the first on a target, CG321 for a full budget.)"""
    from capgate.api import open as open_executor
    from capgate.commands.project import init_project

    init_project(tmp_path / "proj")
    config = tmp_path / "proj" / "capgate.toml"
    outcomes: list[Any] = []
    with open_executor(config, env={}) as gate:
        def work(n: int) -> None:
            for j in range(4):
                outcomes.append(gate.call(
                    "policy.add_note", {"policy_id": (n + j) % 2 + 1, "author": f"a{n}",
                                        "body": f"n{n}-{j}"},
                    case=f"LOAD-{n}-{j}", who="claims-agent"))

        assert in_threads(16, work, timeout=300) == []
        assert gate.ledger.verify().ok
    assert len(outcomes) == 64
    assert {o.status for o in outcomes} == {"applied_verified"}
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'proj' / 'insurance.db'}")
    with engine.connect() as conn:
        bodies = [r[0] for r in conn.execute(sa.text(
            "SELECT body FROM policy_note WHERE body LIKE 'n%-%'"))]
    engine.dispose()
    assert sorted(bodies) == sorted(f"n{n}-{j}" for n in range(16) for j in range(4))
