"""Impact claims in the ledger store: conflicts name the holder, claims expire and are
taken over with a new fencing token, and a stale holder's late write is refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.claims import ClaimStore, set_claims, store_for
from capgate.registry import errors
from tests.fix_capgate import table_dump
from tests.fix_db import engine_params
from tests.test_lease_support import ARRIVED, GATES, lab_registry, lab_schema, spawn, url_text

NOTE = {"policy_id": 1, "author": "jdoe", "body": "Called the holder."}
KEY = "dev/insurance/policy_note/policy_id=1"
LAB_KEY = "dev/lab/counter/target_id=1"


@pytest.fixture
def lab(gate: Callable[..., Executor]) -> Callable[..., Executor]:
    def make(target: URL, ledger: URL | str | None = None, **opts: Any) -> Executor:
        ex = gate(target, ledger, **opts)
        ex.registry = lab_registry()
        return ex

    return make


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_target(request: pytest.FixtureRequest) -> URL:
    url: URL = request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])
    return url


def count(url: URL, sql: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar_one())
    finally:
        engine.dispose()


def test_conflict_names_the_holder_and_records_nothing(lab: Callable[..., Executor],
                                                       sqlite_url: URL,
                                                       ledger_url: URL) -> None:
    ex = lab(sqlite_url, ledger_url)
    store = store_for(ex)
    held = store.acquire([KEY], case_id="CASE-A", intent_id="intent-a",
                         operation_id="cover.add", ttl=30)
    before = table_dump(sqlite_url, "policy_note")
    with pytest.raises(errors.ImpactConflict) as caught:
        ex.call("policy.add_note", NOTE, case="CASE-B", who="agent")
    details, holder = caught.value.details, caught.value.holder
    # the refusal names the key and the wait, never the holding case or its intent (they
    # may be another identity's); the holder travels on the exception for the ledger
    assert set(details) == {"impact_key", "expires_in", "requested_by_case"}
    assert "CASE-A" not in str(caught.value) and "intent-a" not in str(caught.value)
    assert holder["case_id"] == "CASE-A" and holder["intent_id"] == "intent-a"
    assert holder["operation_id"] == "cover.add" and details["impact_key"] == KEY
    assert details["requested_by_case"] == "CASE-B" and details["expires_in"] > 20
    assert caught.value.retryable
    assert ex.ledger.snapshot("CASE-B") is None  # refused before `prepared`
    assert table_dump(sqlite_url, "policy_note") == before
    # reads never claim, and are not blocked by a claim
    assert ex.call("policy.get", {"policy_id": 1}, case="CASE-B", who="agent").status == "ok"
    store.release(held)
    out = ex.call("policy.add_note", NOTE, case="CASE-B", who="agent")
    assert out.status == "applied_verified", out.reason
    row = store.current(KEY)
    assert row is not None and row["case_id"] is None and row["token"] == 2


def test_claims_are_released_after_the_call_and_tokens_only_grow(
        lab: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = lab(sqlite_url)
    store = store_for(ex)
    for i, case in enumerate(["C1", "C2", "C3"], start=1):
        out = ex.call("policy.add_note", {**NOTE, "body": case}, case=case, who="agent")
        assert out.status == "applied_verified", out.reason
        row = store.current(KEY)
        assert row is not None and row["case_id"] is None and row["token"] == i
    rolled = ex.call("policy.add_note", {**NOTE, "policy_id": 9}, case="C4", who="agent")
    assert rolled.status == "rolled_back"
    row = store.current(KEY.replace("=1", "=9"))
    assert row is not None and row["case_id"] is None  # a rollback releases too
    fence = table_dump(sqlite_url, "capgate_fence")
    assert sorted((r[1], r[2]) for r in fence) == [(KEY, 3)]


def test_an_expired_claim_is_taken_over_with_a_new_token(lab: Callable[..., Executor],
                                                         sqlite_url: URL) -> None:
    ex = lab(sqlite_url)
    store = store_for(ex)
    store.acquire([KEY], case_id="DEAD", intent_id="i-dead", operation_id="x", ttl=0.2)
    with pytest.raises(errors.ImpactConflict):
        ex.call("policy.add_note", NOTE, case="LIVE", who="agent")
    time.sleep(0.3)
    out = ex.call("policy.add_note", NOTE, case="LIVE", who="agent")
    assert out.status == "applied_verified", out.reason
    row = store.current(KEY)
    assert row is not None and row["token"] == 2 and row["case_id"] is None


def test_several_keys_are_claimed_all_or_none(lab: Callable[..., Executor],
                                              sqlite_url: URL, ledger_url: URL) -> None:
    ex = lab(sqlite_url, ledger_url)
    store = ClaimStore(ex.ledger)
    store.acquire(["k/2"], case_id="A", intent_id="a", operation_id="x", ttl=30)
    with pytest.raises(errors.ImpactConflict) as caught:
        store.acquire(["k/1", "k/2", "k/3"], case_id="B", intent_id="b", operation_id="y",
                      ttl=30)
    assert caught.value.details["impact_key"] == "k/2"
    assert store.current("k/1") is None and store.current("k/3") is None  # rolled back
    same_case = store.acquire(["k/1", "k/2"], case_id="A", intent_id="a2", operation_id="x",
                              ttl=30)
    # the same case joins its own hold: two calls of one case never fence each other out
    assert same_case.tokens == {"k/1": 1, "k/2": 1}
    assert store.current("k/2")["intent_id"] == "a2"  # the newest claimant releases it
    takeover = store.acquire(["k/2"], case_id="A", intent_id="a3", operation_id="x", ttl=30,
                             takeover=True)  # resume retrying an attempt fences the old one
    assert takeover.tokens == {"k/2": 2}


def _start_gated(ex: Executor, case: str, ref: str, gate: str) -> tuple[threading.Thread,
                                                                           dict[str, Any]]:
    GATES.pop(gate, None)
    ARRIVED.pop(gate, None)
    from tests.test_lease_support import _gate

    _, arrived = _gate(gate)
    result: dict[str, Any] = {}

    def run() -> None:
        result["out"] = ex.call("lab.bump", {"target_id": 1, "call_ref": ref, "gate": gate},
                                case=case, who="agent")

    thread = threading.Thread(target=run)
    thread.start()
    assert arrived.wait(10), "the gated call never reached its step"
    return thread, result


def test_a_stale_holders_late_write_is_refused_by_the_target_fence(
        lab: Callable[..., Executor], server_target: URL) -> None:
    """A pauses past its claim's expiry; B takes the key over and commits; A's COMMIT is
    refused in the target itself, where the fence row already carries B's newer token."""
    ex = lab(server_target)
    lab_schema(server_target)
    thread, result = _start_gated(ex, "STALE-A", "a-1", "fence-target")
    with ex.ledger.engine.begin() as conn:  # A's pause outlived its claim
        conn.execute(sa.text("UPDATE cg_claims SET expires_at = 0"))
    b = ex.call("lab.bump", {"target_id": 1, "call_ref": "b-1"}, case="FRESH-B", who="agent")
    assert b.status == "applied_verified", b.reason
    GATES["fence-target"].set()
    thread.join(20)
    a = result["out"]
    assert a.status == "rolled_back"
    assert a.reason is not None and a.reason["kind"] == "stale_fence"
    assert a.reason["where"] == "target"
    assert a.reason["token"] == 1 and a.reason["current_token"] == 2
    assert a.reason["holder_intent"] == b.intent_id
    assert count(server_target, "SELECT n FROM lab_counter WHERE target_id = 1") == 1
    assert count(server_target, "SELECT count(*) FROM lab_log") == 1
    assert count(server_target, "SELECT count(*) FROM capgate_landed") == 1


def test_a_claim_taken_over_before_commit_is_refused_by_the_ledger_fence(
        lab: Callable[..., Executor], server_target: URL) -> None:
    ex = lab(server_target)
    lab_schema(server_target)
    thread, result = _start_gated(ex, "SLOW-A", "a-2", "fence-ledger")
    with ex.ledger.engine.begin() as conn:
        conn.execute(sa.text("UPDATE cg_claims SET expires_at = 0"))
    store_for(ex).acquire([LAB_KEY], case_id="TAKER-C", intent_id="c", operation_id="lab.bump",
                          ttl=30)
    GATES["fence-ledger"].set()
    thread.join(20)
    a = result["out"]
    assert a.status == "rolled_back"
    assert a.reason is not None and a.reason["kind"] == "stale_fence", a.reason
    assert a.reason["where"] == "ledger" and a.reason["holder_case"] == "TAKER-C"
    assert count(server_target, "SELECT n FROM lab_counter WHERE target_id = 1") == 0
    assert [e.kind for e in ex.ledger.events("SLOW-A")][-1] == "observed"


def test_claims_can_be_switched_off_for_a_baseline(lab: Callable[..., Executor],
                                                   sqlite_url: URL) -> None:
    ex = lab(sqlite_url)
    set_claims(ex, False)
    store_for(ex).acquire([KEY], case_id="A", intent_id="a", operation_id="x", ttl=30)
    out = ex.call("policy.add_note", NOTE, case="B", who="agent")
    assert out.status == "applied_verified"


@pytest.mark.crash
def test_a_crashed_cases_claim_holds_until_resume_takes_it_over(
        lab: Callable[..., Executor], pg_url: URL, tmp_path: Path) -> None:
    from capgate.executor.recovery.resume import resume

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = lab(pg_url, ledger)
    proc = spawn("call", {"target": url_text(pg_url), "ledger": ledger,
                          "operation": "policy.add_note", "case": "CRASHED", "inputs": NOTE,
                          "crash_at": "after_attempt_started"})
    proc.communicate(timeout=30)
    assert proc.returncode == -9
    with pytest.raises(errors.ImpactConflict) as caught:  # the dead executor's claim holds
        ex.call("policy.add_note", NOTE, case="OTHER", who="agent")
    assert caught.value.holder["case_id"] == "CRASHED"
    report = resume(ex, "CRASHED")  # the same case retries, taking its own claim over
    assert [(i.classification, i.action) for i in report.intents] == [
        ("not_applied", "retried")], report.intents
    row = store_for(ex).current(KEY)
    assert row is not None and row["token"] == 2 and row["case_id"] is None
    out = ex.call("policy.add_note", NOTE, case="OTHER", who="agent")
    assert out.status == "applied_verified", out.reason
    assert count(pg_url, "SELECT count(*) FROM policy_note WHERE body = 'Called the holder.'") \
        == 2


def test_two_ledgers_on_one_target_do_not_fence_each_other(
        gate: Callable[..., Executor], sqlite_url: URL, tmp_path: Path) -> None:
    """Fencing tokens compare only within the ledger that issued them."""
    first = gate(sqlite_url, f"sqlite:///{tmp_path / 'a.db'}")
    for i in range(3):  # ledger A's tokens for the key run ahead of ledger B's
        assert first.call("policy.add_note", {"policy_id": 1, "author": "a", "body": f"a{i}"},
                          case=f"A-{i}", who="agent").status == "applied_verified"
    second = gate(sqlite_url, f"sqlite:///{tmp_path / 'b.db'}", schema=False)
    out = second.call("policy.add_note", {"policy_id": 1, "author": "b", "body": "b"},
                      case="B-1", who="agent")
    assert out.status == "applied_verified", out.reason
