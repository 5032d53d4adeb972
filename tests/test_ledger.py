"""The ledger store on real SQLite files and real PostgreSQL schemas.

Tampering is done the way an attacker or a careless operator would: with SQL
straight against the tables.  Concurrency is tested with real processes
(spawned, so nothing is shared but the database).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime, timedelta
from multiprocessing import get_context
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from capgate.executor.ledger import (
    GENESIS_DIGEST,
    TERMINAL_STATUSES,
    Event,
    Ledger,
    apply_event,
    event_digest,
    fold,
    head_mac,
    is_open_status,
    open_ledger,
    state_digest,
)
from capgate.executor.ledger.chain import canonical_text
from capgate.registry.errors import (
    ApprovalExpired,
    ApprovalRequired,
    ApprovalUsed,
    ConfigError,
    IdempotencyConflict,
    LedgerError,
    LedgerTampered,
    SelfApproval,
    UnknownCase,
    UnknownIntent,
    UnknownPlan,
)

KEY = b"test-ledger-key"
WORKERS = 4
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


# --- fixtures and helpers ------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAPGATE_LEDGER_HMAC_KEY", raising=False)


@pytest.fixture
def ledger(ledger_url: URL) -> Iterator[Ledger]:
    with open_ledger(ledger_url) as led:
        yield led


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPoolExecutor]:
    """Warm spawned workers, shared by the race tests (spawning costs ~1 s each)."""
    with ProcessPoolExecutor(max_workers=WORKERS, mp_context=get_context("spawn")) as ex:
        list(ex.map(_warm, [0.3] * WORKERS))
        yield ex


def _warm(pause: float) -> int:
    import capgate.executor.ledger  # noqa: F401  (import cost paid before any race starts)

    time.sleep(pause)
    return 0


def _url_text(url: URL) -> str:
    return url.render_as_string(hide_password=False)


@contextlib.contextmanager
def raw(url: URL) -> Iterator[Connection]:
    """A plain connection to the store, as a tamperer would open one."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        engine.dispose()


def build_case(led: Ledger, case_id: str = "case-1") -> list[Event]:
    """Six events, two intents, case state: seq 0..5."""
    led.append(case_id, "case_opened", {"case_state": {"task": "T-1"}})
    led.append(case_id, "prepared", {"state": {"op": "a"}, "request": {"x": 1}}, intent_id="i1")
    led.append(case_id, "attempt_started", {"note": "n2", "state": {"attempt": 1}}, intent_id="i1")
    led.append(case_id, "prepared", {"state": {"op": "b"}}, intent_id="i2")
    led.append(case_id, "observed", {"state": {"outcome": "applied_verified"}}, intent_id="i1")
    led.append(case_id, "observed", {"state": {"outcome": "rolled_back"}}, intent_id="i2")
    return led.events(case_id)


def findings(led: Ledger, case_id: str = "case-1") -> list[tuple[str, int | None]]:
    report = led.verify(case_id)
    return sorted(((f.kind, f.seq) for f in report.findings), key=repr)


def forged(event: Event, **changes: Any) -> dict[str, Any]:
    """A self-consistent row for ``event`` with ``changes``: its digest recomputed."""
    fields: dict[str, Any] = {
        "case_id": event.case_id,
        "seq": event.seq,
        "kind": event.kind,
        "intent_id": event.intent_id,
        "payload": dict(event.payload),
        "prev_digest": event.prev_digest,
        "recorded_at": event.recorded_at,
        "state_digest": event.state_digest,
    }
    fields.update(changes)
    row = dict(fields, digest=event_digest(**fields))
    row["payload"] = canonical_text(row["payload"])
    return row


def _update_event(conn: Connection, case_id: str, at_seq: int, **values: Any) -> None:
    sets = ", ".join(f"{k} = :{k}" for k in values)
    conn.execute(
        sa.text(f"UPDATE cg_events SET {sets} WHERE case_id = :at_case AND seq = :at_seq"),
        dict(values, at_case=case_id, at_seq=at_seq),
    )


# --- chain basics ---------------------------------------------------------------


def test_chain_links_from_genesis_and_snapshot_is_the_fold(ledger: Ledger) -> None:
    chain = build_case(ledger)
    assert [e.seq for e in chain] == [0, 1, 2, 3, 4, 5]
    assert chain[0].prev_digest == GENESIS_DIGEST
    for before, after in itertools.pairwise(chain):
        assert after.prev_digest == before.digest
    for e in chain:
        assert e.digest == event_digest(
            case_id=e.case_id,
            seq=e.seq,
            kind=e.kind,
            intent_id=e.intent_id,
            payload=e.payload,
            prev_digest=e.prev_digest,
            recorded_at=e.recorded_at,
            state_digest=e.state_digest,
        )
        assert e.recorded_at.endswith("Z") and e.recorded_time.tzinfo is not None
    snap = ledger.snapshot("case-1")
    assert snap == fold(chain)
    # format 2: the snapshot holds the open intents (none: both observed), the last
    # intent event and the count; each settled intent is read from its events
    assert snap == {
        "case_id": "case-1",
        "head_seq": 5,
        "head_digest": chain[-1].digest,
        "case": {"task": "T-1"},
        "intents": {},
        "intent_count": 2,
        "last": {"intent_id": "i2", "status": "observed", "outcome": "rolled_back",
                 "operation_id": None, "version": None, "at": chain[-1].recorded_at},
    }
    assert ledger.intents("case-1") == {
        "i1": {"status": "observed", "last_seq": 4, "op": "a", "attempt": 1,
               "outcome": "applied_verified"},
        "i2": {"status": "observed", "last_seq": 5, "op": "b", "outcome": "rolled_back"},
    }
    assert ledger.intent("case-1", "i1")["outcome"] == "applied_verified"
    assert all(e.state_digest == state_digest(fold(chain[:e.seq + 1])) for e in chain)
    with raw(ledger_url_of(ledger)) as conn:
        stored = conn.execute(sa.text("SELECT snapshot, head_seq, head_digest, head_mac "
                                      "FROM cg_cases")).one()
    assert stored.snapshot == canonical_text(snap)
    assert (stored.head_seq, stored.head_digest, stored.head_mac) == (5, chain[-1].digest, None)
    report = ledger.verify()
    assert report.ok and report.cases_checked == 1 and report.events_checked == 6
    assert not report.mac_checked
    assert ledger.load_verified("case-1").events == tuple(chain)


def ledger_url_of(led: Ledger) -> URL:
    return led._url  # the test's own store: the fixture URL, password included


def test_append_returns_what_is_stored_and_append_many_is_consecutive(ledger: Ledger) -> None:
    first = ledger.append("c", "opened", {"tuple": (1, 2), "nested": {"b": 1.5, "a": None}})
    assert first.payload == {"tuple": [1, 2], "nested": {"b": 1.5, "a": None}}
    many = ledger.append_many(
        "c",
        [("prepared", {"state": {"k": 1}}, "i"), ("note", {}, None), ("observed", {}, "i")],
    )
    assert [e.seq for e in many] == [1, 2, 3]
    assert many[0].prev_digest == first.digest
    assert ledger.events("c") == [first, *many]
    assert ledger.append_many("c", []) == []
    assert ledger.verify("c").ok


def test_reducer_is_pure_and_merges_shallowly() -> None:
    def ev(seq: int, kind: str, payload: dict[str, Any], intent: str | None = None) -> Event:
        return Event("c", seq, kind, intent, payload, "p", f"d{seq}", "t")

    s0 = apply_event(None, ev(0, "opened", {"case_state": {"a": 1, "b": {"x": 1}}}))
    s1 = apply_event(s0, ev(1, "prepared", {"state": {"k": 1}, "case_state": {"b": {"y": 2}}},
                            "i"))
    s2 = apply_event(s1, ev(2, "escalated", {"state": {"why": "unknown"}}, "i"))
    assert s0 == {"case_id": "c", "head_seq": 0, "head_digest": "d0",
                  "case": {"a": 1, "b": {"x": 1}}, "intents": {}, "intent_count": 0,
                  "last": None}
    assert s1["case"] == {"a": 1, "b": {"y": 2}}  # shallow: a key's value is replaced whole
    assert s2["intents"] == {"i": {"k": 1, "why": "unknown", "status": "escalated",
                                   "last_seq": 2}}
    assert s1["intents"]["i"]["status"] == "prepared"  # earlier states untouched
    # format 2: a settled intent leaves the snapshot; ``last`` and the count remain
    s3 = apply_event(s2, ev(3, "escalation_resolved", {"state": {"by": "p"}}, "i"))
    assert s3["intents"] == {} and s3["intent_count"] == 1
    assert s3["last"]["intent_id"] == "i" and s3["last"]["status"] == "escalation_resolved"
    assert fold([ev(0, "opened", {}), ev(1, "x", {"case_state": {"z": 0}})])["case"] == {"z": 0}
    with pytest.raises(LedgerError):
        fold([])


def test_payloads_are_checked_before_anything_is_written(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="no intent_id"):
        ledger.append("c", "x", {"state": {"a": 1}})
    with pytest.raises(LedgerError, match="may not set"):
        ledger.append("c", "x", {"state": {"status": "observed"}}, intent_id="i")
    with pytest.raises(LedgerError, match="not plain JSON"):
        ledger.append("c", "x", {"when": datetime.now(UTC)})
    with pytest.raises(LedgerError, match="case_state"):
        ledger.append("c", "x", {"case_state": [1]})
    with pytest.raises(LedgerError, match="non-empty"):
        ledger.append("", "x", {})
    assert ledger.events("c") == [] and ledger.snapshot("c") is None


def test_open_cases_and_statuses(ledger: Ledger) -> None:
    ledger.append("done", "prepared", {}, intent_id="a")
    ledger.append("done", "observed", {}, intent_id="a")
    ledger.append("stuck", "prepared", {}, intent_id="a")
    ledger.append("stuck", "escalated", {}, intent_id="a")
    ledger.append("stuck", "prepared", {}, intent_id="b")
    ledger.append("stuck", "reconciled", {}, intent_id="b")
    ledger.append("quiet", "case_opened", {})
    assert [c.case_id for c in ledger.cases()] == ["done", "quiet", "stuck"]
    [stuck] = ledger.cases(open_only=True)
    assert stuck.case_id == "stuck" and stuck.open and stuck.open_intents == ["a"]
    assert stuck.statuses == {"a": "escalated"}  # the snapshot keeps open intents only
    assert ledger.intent("stuck", "b")["status"] == "reconciled"  # a settled one: by index
    assert {"observed", "reconciled", "escalation_resolved"} == TERMINAL_STATUSES
    assert is_open_status("escalated") and is_open_status("some_new_kind")
    assert ledger.intent("stuck", "a")["status"] == "escalated"
    with pytest.raises(UnknownIntent):
        ledger.intent("stuck", "zzz")
    with pytest.raises(UnknownCase):
        ledger.intent("nope", "a")
    with pytest.raises(UnknownCase):
        ledger.verify("nope")
    with pytest.raises(UnknownCase):
        ledger.load_verified("nope")


def test_clock_is_injectable_and_must_be_aware(ledger_url: URL) -> None:
    with open_ledger(ledger_url, clock=lambda: T0) as led:
        assert led.append("c", "x", {}).recorded_at == "2026-01-01T12:00:00.000000Z"
    with open_ledger(ledger_url, clock=lambda: datetime(2026, 1, 1)) as led, pytest.raises(
        LedgerError, match="naive"
    ):
        led.append("c", "x", {})


# --- tampering -------------------------------------------------------------------


def _edit_payload(conn: Connection, chain: list[Event]) -> None:
    _update_event(conn, "case-1", 2, payload=canonical_text({"note": "forged",
                                                             "state": {"attempt": 1}}))


def _edit_snapshot(conn: Connection, chain: list[Event]) -> None:
    snap = fold(chain)
    snap["case"]["task"] = "T-forged"  # (format 2 keeps open intents only: both are settled)
    conn.execute(sa.text("UPDATE cg_cases SET snapshot = :s WHERE case_id = 'case-1'"),
                 {"s": canonical_text(snap)})


def _delete_middle(conn: Connection, chain: list[Event]) -> None:
    conn.execute(sa.text("DELETE FROM cg_events WHERE case_id = 'case-1' AND seq = 2"))


def _delete_last(conn: Connection, chain: list[Event]) -> None:
    conn.execute(sa.text("DELETE FROM cg_events WHERE case_id = 'case-1' AND seq = 5"))


def _swap_seq(conn: Connection, chain: list[Event]) -> None:
    for old, new in ((2, 100), (3, 2), (100, 3)):
        _update_event(conn, "case-1", old, seq=new)


def _break_digest(conn: Connection, chain: list[Event]) -> None:
    _update_event(conn, "case-1", 2, digest="sha256:" + "f" * 64)


def _replace_event(conn: Connection, chain: list[Event]) -> None:
    row = forged(chain[2], payload={"note": "rewritten", "state": {"attempt": 1}})
    _update_event(conn, "case-1", 2, payload=row["payload"], digest=row["digest"])


def _move_head(conn: Connection, chain: list[Event]) -> None:
    conn.execute(sa.text("UPDATE cg_cases SET head_digest = :d WHERE case_id = 'case-1'"),
                 {"d": chain[4].digest})


def _forge_extra_event(conn: Connection, chain: list[Event]) -> None:
    row = forged(chain[5], seq=6, prev_digest=chain[5].digest, kind="observed",
                 intent_id="i3", payload={})
    conn.execute(sa.text("INSERT INTO cg_events (case_id, seq, kind, intent_id, payload, "
                         "prev_digest, digest, recorded_at, state_digest) VALUES (:case_id, "
                         ":seq, :kind, :intent_id, :payload, :prev_digest, :digest, "
                         ":recorded_at, :state_digest)"), row)


def _delete_case_row(conn: Connection, chain: list[Event]) -> None:
    conn.execute(sa.text("DELETE FROM cg_cases WHERE case_id = 'case-1'"))


def _garble_payload(conn: Connection, chain: list[Event]) -> None:
    _update_event(conn, "case-1", 1, payload="{not json")


TAMPERS: dict[str, tuple[Callable[[Connection, list[Event]], None],
                         list[tuple[str, int | None]]]] = {
    "edit_payload": (_edit_payload, [("payload_edited", 2)]),
    "edit_snapshot": (_edit_snapshot, [("snapshot_mismatch", None)]),
    # (format 2: both intents are settled, so the snapshot no longer depends on seq 2)
    "delete_middle_event": (_delete_middle, [("event_missing", 2)]),
    "delete_last_event": (_delete_last, [("event_missing", 5), ("snapshot_mismatch", None)]),
    "swap_two_seqs": (_swap_seq, [("event_reordered", 2), ("event_reordered", 3)]),
    "break_a_digest": (_break_digest, [("digest_broken", 2)]),
    "replace_an_event_consistently": (_replace_event, [("chain_broken", 3)]),
    "move_the_head": (_move_head, [("head_mismatch", 5)]),
    "forge_an_extra_event": (_forge_extra_event,
                             [("head_mismatch", 5), ("snapshot_mismatch", None)]),
    "delete_the_case_row": (_delete_case_row, [("case_missing", None)]),
    "garble_a_payload": (_garble_payload, [("payload_edited", 1)]),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_each_tamper_is_reported_and_blocks_continuing(ledger: Ledger, tamper: str) -> None:
    chain = build_case(ledger)
    ledger.append("other", "opened", {})
    edit, expected = TAMPERS[tamper]
    with raw(ledger_url_of(ledger)) as conn:
        edit(conn, chain)
    assert findings(ledger) == sorted(expected, key=repr)
    everything = ledger.verify()
    assert not everything.ok and everything.kinds("other") == set()
    assert everything.cases_checked == 2
    with pytest.raises(LedgerTampered) as raised:
        ledger.load_verified("case-1")
    assert {f["kind"] for f in raised.value.details["findings"]} == {k for k, _ in expected}
    assert raised.value.code == "CG410"


def test_append_never_heals_an_edited_snapshot(ledger: Ledger) -> None:
    chain = build_case(ledger)
    with raw(ledger_url_of(ledger)) as conn:
        _edit_snapshot(conn, chain)
    ledger.append("case-1", "note", {})  # the writer's cached head is now stale
    assert ("snapshot_mismatch", None) in findings(ledger)


def test_append_refuses_a_case_whose_row_was_deleted(ledger: Ledger) -> None:
    build_case(ledger)
    with raw(ledger_url_of(ledger)) as conn:
        _delete_case_row(conn, [])
    fresh = open_ledger(ledger_url_of(ledger))  # no cached head
    try:
        with pytest.raises(LedgerTampered, match="cg_cases row is missing"):
            fresh.append("case-1", "note", {})
        with pytest.raises(LedgerTampered, match="not JSON"):
            with raw(ledger_url_of(ledger)) as conn:
                _garble_payload(conn, [])
            fresh.events("case-1")
    finally:
        fresh.close()


def test_hmac_detects_a_consistent_rewrite_only_with_the_key(ledger_url: URL) -> None:
    with open_ledger(ledger_url, hmac_key=KEY) as signed:
        chain = build_case(signed)
        assert signed.verify().ok and signed.verify().mac_checked
    # Rewrite history end to end: forge event 1, re-chain every later event, refold.
    rewritten: list[Event] = []
    prev = GENESIS_DIGEST
    for e in chain:
        payload = dict(e.payload)
        if e.seq == 1:
            payload["request"] = {"x": 999}
        row = forged(e, payload=payload, prev_digest=prev)
        rewritten.append(Event(e.case_id, e.seq, e.kind, e.intent_id, payload, prev,
                               row["digest"], e.recorded_at, e.state_digest))
        prev = row["digest"]
    with raw(ledger_url) as conn:
        for e in rewritten:
            _update_event(conn, e.case_id, e.seq, payload=canonical_text(dict(e.payload)),
                          prev_digest=e.prev_digest, digest=e.digest)
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = :s, head_digest = :d"),
                     {"s": canonical_text(fold(rewritten)), "d": prev})
    with open_ledger(ledger_url) as keyless:
        assert keyless.verify().ok  # without the key the rewrite is undetectable
    with open_ledger(ledger_url, hmac_key=KEY) as signed:
        assert findings(signed) == [("mac_mismatch", 5)]
        with raw(ledger_url) as conn:
            conn.execute(sa.text("UPDATE cg_cases SET head_mac = NULL"))
        assert findings(signed) == [("mac_missing", 5)]
        with raw(ledger_url) as conn:  # a forger who has the key can re-sign: by design
            conn.execute(sa.text("UPDATE cg_cases SET head_mac = :m"),
                         {"m": head_mac(KEY, prev)})
        assert signed.verify().ok


def test_hmac_key_from_the_environment(ledger_url: URL, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPGATE_LEDGER_HMAC_KEY", KEY.decode())
    with open_ledger(ledger_url) as led:
        assert led.signed
        led.append("c", "x", {})
    with raw(ledger_url) as conn:
        mac = conn.execute(sa.text("SELECT head_mac, head_digest FROM cg_cases")).one()
    assert mac.head_mac == head_mac(KEY, mac.head_digest)
    with pytest.raises(ConfigError):
        open_ledger(ledger_url, hmac_key=b"")


# --- concurrency across processes ------------------------------------------------


def _append_worker(url: str, case_id: str, writer: int, n: int, start_at: float) -> int:
    time.sleep(max(0.0, start_at - time.time()))
    with open_ledger(url, hmac_key=KEY) as led:
        for i in range(n):
            if i % 4 == 3:
                led.append_many(case_id, [
                    ("step", {"state": {"i": i}, "who": [writer, i]}, f"w{writer}"),
                    ("tick", {"who": [writer, i, "b"]}, None),
                ])
            else:
                led.append(case_id, "step", {"state": {"i": i}, "who": [writer, i]},
                           intent_id=f"w{writer}")
    return writer


def test_concurrent_appends_from_processes_make_one_chain(
    ledger_url: URL, pool: ProcessPoolExecutor
) -> None:
    n = 16
    with open_ledger(ledger_url, hmac_key=KEY) as led:
        start = time.time() + 0.3
        futures = [pool.submit(_append_worker, _url_text(ledger_url), "hot", w, n, start)
                   for w in range(WORKERS)]
        assert sorted(f.result(timeout=60) for f in futures) == list(range(WORKERS))
        chain = led.events("hot")
        per_writer = n + n // 4
        assert [e.seq for e in chain] == list(range(WORKERS * per_writer))
        seen = [tuple(e.payload["who"]) for e in chain]
        assert len(seen) == len(set(seen)) == WORKERS * per_writer  # nothing lost, nothing twice
        for w in range(WORKERS):  # each writer's own events stay in its order
            mine = [e.payload["who"][1] for e in chain if e.payload["who"][0] == w
                    and len(e.payload["who"]) == 2]
            assert mine == list(range(n))
        assert led.verify().ok
        assert led.snapshot("hot") == fold(chain)


def _claim_worker(url: str, writer: int, start_at: float) -> str | None:
    time.sleep(max(0.0, start_at - time.time()))
    with open_ledger(url) as led:
        record = led.claim_idempotency("key-1", case_id="c", intent_id=f"intent-{writer}",
                                       fingerprint="fp", operation_id="op", version=1)
    return None if record is None else record.intent_id


def test_idempotency_claim_race_has_one_winner(
    ledger: Ledger, ledger_url: URL, pool: ProcessPoolExecutor
) -> None:
    start = time.time() + 0.3
    futures = [pool.submit(_claim_worker, _url_text(ledger_url), w, start)
               for w in range(WORKERS)]
    results = [f.result(timeout=60) for f in futures]
    winners = [w for w, r in enumerate(results) if r is None]
    assert len(winners) == 1
    assert {r for r in results if r is not None} == {f"intent-{winners[0]}"}
    stored = ledger.get_idempotency("key-1")
    assert stored is not None and stored.intent_id == f"intent-{winners[0]}"


def test_idempotency_same_request_replays_different_request_conflicts(ledger: Ledger) -> None:
    args: dict[str, Any] = {"case_id": "c", "fingerprint": "fp", "operation_id": "op",
                            "version": 3}
    assert ledger.claim_idempotency("k", intent_id="i1", **args) is None
    again = ledger.claim_idempotency("k", intent_id="i2", **args)
    assert again is not None and again.intent_id == "i1" and again.version == 3
    assert ledger.claim_idempotency("k", intent_id="i1", **args) is None  # i1's own claim
    with pytest.raises(IdempotencyConflict) as raised:
        ledger.claim_idempotency("k", intent_id="i3", **dict(args, fingerprint="other"))
    assert raised.value.details["intent_id"] == "i1"
    assert ledger.get_idempotency("nope") is None


def _consume_worker(url: str, plan_hash: str, writer: int, start_at: float) -> str:
    time.sleep(max(0.0, start_at - time.time()))
    with open_ledger(url) as led:
        try:
            return led.consume_approval(plan_hash, f"intent-{writer}", now=T0).approval_id
        except ApprovalUsed:
            return "used"


@pytest.mark.parametrize("approvals", [1, 2])
def test_approval_consume_race_has_one_winner_per_approval(
    ledger: Ledger, ledger_url: URL, pool: ProcessPoolExecutor, approvals: int
) -> None:
    ledger.record_plan("sha256:plan", "c", "alice", {"op": "x"})
    made = {ledger.record_approval("sha256:plan", f"bob{i}", "dba", 60, now=T0).approval_id
            for i in range(approvals)}
    start = time.time() + 0.3
    futures = [pool.submit(_consume_worker, _url_text(ledger_url), "sha256:plan", w, start)
               for w in range(WORKERS)]
    results = [f.result(timeout=60) for f in futures]
    assert sorted(r for r in results if r != "used") == sorted(made)
    assert results.count("used") == WORKERS - approvals
    stored = ledger.approvals_for("sha256:plan")
    assert all(a.used and a.used_at == T0 for a in stored)
    assert len({a.used_by_intent for a in stored}) == approvals


# --- plans and approvals -----------------------------------------------------------


def test_plans_are_recorded_once_per_hash(ledger: Ledger) -> None:
    first = ledger.record_plan("sha256:p", "c1", "alice", {"statements": ["UPDATE t"]})
    again = ledger.record_plan("sha256:p", "c2", "carol", {"statements": ["UPDATE t"]})
    assert again == first and again.requester == "alice" and again.case_id == "c1"
    assert ledger.get_plan("sha256:p").plan == {"statements": ["UPDATE t"]}
    with pytest.raises(LedgerError, match="different plan content"):
        ledger.record_plan("sha256:p", "c1", "alice", {"statements": ["DELETE t"]})
    with pytest.raises(UnknownPlan):
        ledger.get_plan("sha256:nope")
    with pytest.raises(UnknownPlan):
        ledger.record_approval("sha256:nope", "bob", "dba", 60)


def test_approvals_expire_are_single_use_and_bound_to_their_plan(ledger: Ledger) -> None:
    ledger.record_plan("sha256:p", "c", "alice", {})
    ledger.record_plan("sha256:q", "c", "alice", {})
    with pytest.raises(UnknownPlan):
        ledger.consume_approval("sha256:nope", "i1", now=T0)
    with pytest.raises(ApprovalRequired):
        ledger.consume_approval("sha256:p", "i1", now=T0)
    approval = ledger.record_approval("sha256:p", "bob", "dba", 60, now=T0)
    assert approval.expires_at == T0 + timedelta(seconds=60) and not approval.used
    assert approval.expired(T0 + timedelta(seconds=60))
    with pytest.raises(ApprovalRequired):  # an approval of p says nothing about q
        ledger.consume_approval("sha256:q", "i1", now=T0)
    with pytest.raises(ApprovalExpired):
        ledger.consume_approval("sha256:p", "i1", now=T0 + timedelta(seconds=60))
    used = ledger.consume_approval("sha256:p", "i1", now=T0 + timedelta(seconds=59))
    assert used.approval_id == approval.approval_id and used.used_by_intent == "i1"
    assert ledger.consume_approval("sha256:p", "i1", now=T0 + timedelta(hours=1)) == used
    with pytest.raises(ApprovalUsed):
        ledger.consume_approval("sha256:p", "i2", now=T0)
    ledger.record_approval("sha256:p", "alice", "dba", 60, now=T0)
    with pytest.raises(SelfApproval):
        ledger.consume_approval("sha256:p", "i2", now=T0, exclude_approver="alice")
    assert ledger.consume_approval("sha256:p", "i2", now=T0).approver == "alice"
    with pytest.raises(LedgerError, match="positive"):
        ledger.record_approval("sha256:p", "bob", "dba", 0)
    with pytest.raises(LedgerError, match="naive"):
        ledger.record_approval("sha256:p", "bob", "dba", 60, now=datetime(2026, 1, 1))


# --- opening -----------------------------------------------------------------------


def test_open_refuses_what_is_not_a_durable_store(tmp_path: Any) -> None:
    with pytest.raises(LedgerError, match="in-memory"):
        open_ledger("sqlite://")
    with pytest.raises(LedgerError, match="unsupported ledger URL"):
        open_ledger("mysql+pymysql://root@127.0.0.1/x")
    nested = tmp_path / "a" / "b" / "ledger.db"
    with open_ledger(f"sqlite:///{nested}") as led:
        led.append("c", "x", {})
    assert nested.exists()
    with raw(sa.make_url(f"sqlite:///{nested}")) as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_unreachable_store_error_hides_the_password() -> None:
    with pytest.raises(LedgerError) as raised:
        open_ledger("postgresql://capgate:s3cr3t-pw@127.0.0.1:9/ledger?connect_timeout=2")
    text = json.dumps(raised.value.to_dict()) + str(raised.value)
    assert "s3cr3t-pw" not in text and "***" in text
    assert raised.value.code == "CG411"


def test_two_ledgers_on_one_store_share_nothing_but_the_database(ledger_url: URL) -> None:
    with open_ledger(ledger_url) as a, open_ledger(ledger_url) as b:
        for i in range(5):  # each append finds the other's cached head stale
            a.append("c", "x", {"i": i, "by": "a"})
            b.append("c", "x", {"i": i, "by": "b"})
        assert [e.seq for e in a.events("c")] == list(range(10))
        assert a.verify().ok


# --- faults -------------------------------------------------------------------------


class DroppingProxy:
    """A TCP proxy to PostgreSQL that can drop the connection instead of delivering a reply.

    That is the fault the ledger must survive without recording twice: the
    server committed the append, and the client never heard so.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.drop_next_reply = threading.Event()
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, is_reply: bool) -> None:
        try:
            while data := src.recv(65536):
                if is_reply and self.drop_next_reply.is_set():
                    self.drop_next_reply.clear()
                    self.dropped += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


def test_an_append_whose_reply_is_lost_is_recorded_once(pg_url: URL) -> None:
    proxy = DroppingProxy(pg_url.host or "127.0.0.1", pg_url.port or 5432)
    try:
        with open_ledger(pg_url.set(host="127.0.0.1", port=proxy.port)) as led:
            led.append("c", "opened", {})
            led.append("c", "prepared", {}, intent_id="i")  # the head is now cached
            proxy.drop_next_reply.set()
            event = led.append("c", "observed", {"state": {"outcome": "ok"}}, intent_id="i")
            assert proxy.dropped == 1
            assert event.seq == 2
            assert [e.kind for e in led.events("c")] == ["opened", "prepared", "observed"]
            assert led.events("c")[-1] == event
            assert led.verify().ok
            proxy.drop_next_reply.set()  # the reply to the head read this time: not landed
            assert led.append("c", "note", {}).seq == 3
            assert [e.seq for e in led.events("c")] == [0, 1, 2, 3]
    finally:
        proxy.close()


def test_repeatable_operations_survive_a_killed_session(pg_url: URL) -> None:
    tag = f"cgtest-{uuid.uuid4().hex[:10]}"
    url = pg_url.update_query_dict({"application_name": tag})

    def kill_sessions() -> None:
        with raw(pg_url) as conn:
            killed = conn.execute(sa.text("SELECT count(pg_terminate_backend(pid)) FROM "
                                          "pg_stat_activity WHERE application_name = :t"),
                                  {"t": tag}).scalar_one()
        assert killed >= 1
        time.sleep(0.05)

    with open_ledger(url) as led:
        led.record_plan("sha256:p", "c", "alice", {})
        led.record_approval("sha256:p", "bob", "dba", 60, now=T0)
        kill_sessions()
        assert led.append("c", "opened", {}).seq == 0
        kill_sessions()
        assert [e.seq for e in led.events("c")] == [0]
        kill_sessions()
        assert led.claim_idempotency("k", case_id="c", intent_id="i", fingerprint="f",
                                     operation_id="op", version=1) is None
        assert led.claim_idempotency("k", case_id="c", intent_id="i", fingerprint="f",
                                     operation_id="op", version=1) is None  # ours, again
        kill_sessions()
        assert led.consume_approval("sha256:p", "i", now=T0).used_by_intent == "i"
        kill_sessions()
        assert led.verify().ok
