"""Network partitions: the deadlines hold when nothing closes.

A partition proxy (``tests/fix_partition.py``) sits between capgate and the
target, or between capgate and a PostgreSQL ledger, and freezes traffic both
ways without closing anything -- at a chosen protocol message, or forwarding
the client's COMMIT and dropping the reply.  Every test here waits with its own
deadline and fails with the measured figure; none sleeps a fixed time.

* a call cut off mid-work returns by its deadline plus the grace, with a coded
  outcome (``rolled_back`` when COMMIT was never sent; ``unknown``, CG401, when
  it was), and resume settles it;
* a leased call cut off returns by its lease's deadline plus the grace;
* a stopped executor's row lock is free by its deadline + 1 s, on both engines;
* a PostgreSQL ledger session cut mid-transaction stops no other executor for
  longer than the ledger's hold bound;
* resume through a cut network answers ``unknown`` for the target it cannot
  reach, in bounded time;
* a ledger lost at the claim check before COMMIT is an unknown-outcome exit (3)
  that names ``capgate resume``;
* resume never says "nothing was sent" while an attempt's opening batch may have
  run: it ends (or waits for) the live session first;
* a replay of an applied request is answered from the ledger, with the target
  cut off, and sends nothing to it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from capgate.executor.call import Executor
from capgate.executor.connectors import ConnectorConfig, Connectors
from capgate.executor.ledger import LedgerBounds, open_ledger
from capgate.executor.recovery.resume import resume
from capgate.registry import errors
from capgate.registry.loader import validate_texts
from capgate.registry.registry import Registry
from tests.fix_capgate import GRANTS, install_target, registry
from tests.fix_db import engine_params
from tests.fix_partition import PartitionProxy, wait_until
from tests.test_lease_support import lab_registry, lab_schema, spawn, url_text, wait_for_file

DEADLINE = 2.0
"""The partition rows' timeout (seconds)."""
GRACE = 1.5
"""What a call may take past its deadline (docs/scaling.md): the client cuts the
connection 1 s after the deadline, and the outcome is recorded within 0.5 s more."""

PARTITION_ROWS = """
format: 1
connectors: {insurance: {}}
rows:
  - operation_id: part.note
    version: 1
    connector: insurance
    description: Append a note to a policy, under a 2 s deadline (test-only).
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
    timeout: {seconds: 2, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - {name: insert_note,
         sql: "INSERT INTO policy_note (policy_id, author, body)
               VALUES (:policy_id, 'partition', :body)",
         expect_rows: 1}

  - operation_id: part.lease
    version: 1
    connector: insurance
    description: Lock a policy and append a note, in a 2 s lease (test-only).
    input:
      type: object
      additionalProperties: false
      required: [policy_id, body]
      properties:
        policy_id: {type: integer}
        body: {type: string}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: leased
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{body}"
    timeout: {seconds: 2, on_timeout: rolled_back}
    recovery: retryable
    steps:
      - {name: lock_policy, sql: "UPDATE policy SET holder = holder WHERE policy_id = :policy_id",
         expect_rows: 1}
      - {name: add_note,
         sql: "INSERT INTO policy_note (policy_id, author, body)
               VALUES (:policy_id, 'partition', :body)",
         expect_rows: 1}
"""


def partition_registry() -> Registry:
    result = validate_texts([("partition.yaml", PARTITION_ROWS)])
    result.raise_for_problems()
    return Registry(list(lab_registry().rows()) + list(result.rows))


def executor_on(target: URL | str, ledger: URL | str, **opts: Any) -> Executor:
    """An executor over the partition rows (schema not applied: see :func:`prepare`)."""
    opts.setdefault("case_claim_seconds", 0.0)
    url = make_url(target).render_as_string(hide_password=False)
    connectors = Connectors({name: ConnectorConfig(name=name, url=url, environment="dev",
                                                   **opts)
                             for name in ("insurance", "insurance_code")})
    ledger_store = ledger if not isinstance(ledger, str | URL) else open_ledger(ledger)
    ex = Executor(registry(), connectors, ledger_store, GRANTS)  # type: ignore[arg-type]
    ex.registry = partition_registry()
    return ex


def prepare(target: URL) -> None:
    """The example schema, capgate's tables and the lab tables in ``target``."""
    from capgate.sqlfiles import apply_schema

    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    try:
        apply_schema(engine)
        install_target(engine)
    finally:
        engine.dispose()
    lab_schema(target)


def notes(target: URL, body: str) -> int:
    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM policy_note WHERE body = :b"),
                                    {"b": body}).scalar_one())
    finally:
        engine.dispose()


@dataclass
class Running:
    """A call running in a thread: its answer or error, and how long it took."""

    work: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    elapsed: float | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as exc:  # reported to the test
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - self.started

    def returned_within(self, bound: float, what: str) -> float:
        """Wait for it with a deadline; fail with the measured figure."""
        self.thread.join(bound + 0.5)
        if self.thread.is_alive():
            raise AssertionError(f"{what}: still running {time.monotonic() - self.started:.1f} "
                                 f"s after it started (bound {bound:.1f} s)")
        assert self.elapsed is not None
        assert self.elapsed <= bound, f"{what}: returned after {self.elapsed:.2f} s " \
                                      f"(bound {bound:.1f} s)"
        return self.elapsed


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def target(request: pytest.FixtureRequest) -> URL:
    url: URL = request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])
    prepare(url)
    return url


def is_pg(url: URL) -> bool:
    return url.get_backend_name() == "postgresql"


def marker_sent(m: Any) -> bool:
    """The opening batch's landing-marker insert (PostgreSQL: in the opening statement)."""
    return bool(m.sql) and "capgate_landed" in m.sql and "INSERT" in m.sql.upper()


# --- a call cut off returns by its deadline ------------------------------------------------


def test_a_call_cut_off_after_its_insert_returns_by_its_deadline(
        target: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    """Frozen after the row's INSERT was sent: no COMMIT was ever sent, so the call is
    ``rolled_back`` (the connection cut at the deadline), by the deadline + the grace."""
    proxy = partition_proxy(target)
    ex = executor_on(proxy.url(target), f"sqlite:///{tmp_path / 'ledger.db'}")
    ex.connectors.get("insurance").check_target()
    trigger = proxy.freeze_when(lambda m: m.mentions("INSERT INTO policy_note"), after=True)
    run = Running(lambda: ex.call("part.note", {"policy_id": 1, "body": "cut-1"},
                                  case="P-cut", who="agent"))
    try:
        trigger.fired.wait(10)
        assert trigger.fired.is_set()
        elapsed = run.returned_within(DEADLINE + GRACE, "a call frozen after its INSERT")
    finally:
        proxy.reset()
    assert run.error is None, run.error
    out = run.result
    print(f"returned {out.status} after {elapsed:.2f} s (deadline {DEADLINE:g} s)")
    assert out.status == "rolled_back", out.reason
    assert out.reason["kind"] == "timeout" and out.reason.get("connection_cut") is True, \
        out.reason
    assert notes(target, "cut-1") == 0
    assert [e.kind for e in ex.ledger.events("P-cut")][-1] == "observed"
    ex.close()


def test_a_commit_whose_reply_is_dropped_is_unknown_and_resume_settles_it(
        target: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    """The sharpest partition: the COMMIT reaches the server, its answer never comes back.
    The call says ``unknown`` (CG401, exit 3) by its deadline + the grace; resume, from a
    healthy path, finds the marker and records ``applied``: exactly one row."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    proxy = partition_proxy(target)
    ex = executor_on(proxy.url(target), ledger)
    ex.connectors.get("insurance").check_target()
    trigger = proxy.drop_commit_reply()
    run = Running(lambda: ex.call("part.note", {"policy_id": 1, "body": "cut-2"},
                                  case="P-commit", who="agent"))
    try:
        trigger.fired.wait(10)
        assert trigger.fired.is_set()
        elapsed = run.returned_within(DEADLINE + GRACE, "a call whose COMMIT reply was dropped")
    finally:
        proxy.heal()
    print(f"answered {type(run.error).__name__} after {elapsed:.2f} s")
    assert isinstance(run.error, errors.OutcomeUnknown), run.error
    assert run.error.exit_code == 3 and "capgate resume P-commit" in run.error.message
    healthy = executor_on(target, ledger)
    report = resume(healthy, "P-commit")
    assert [i.classification for i in report.intents] == ["applied"], report.to_dict()
    assert notes(target, "cut-2") == 1
    healthy.close()
    ex.close()


def test_a_leased_call_cut_off_returns_by_its_lease_deadline(
        target: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    """The watchdog's cancel and terminate travel over the cut network too: the client's
    own cut ends the wait, and the lease says ``lease_expired`` by its deadline + grace."""
    proxy = partition_proxy(target)
    ex = executor_on(proxy.url(target), f"sqlite:///{tmp_path / 'ledger.db'}")
    ex.connectors.get("insurance").check_target()
    trigger = proxy.freeze_when(lambda m: m.mentions("UPDATE policy SET holder"), after=True)
    run = Running(lambda: ex.call("part.lease", {"policy_id": 1, "body": "cut-3"},
                                  case="P-lease", who="agent"))
    try:
        trigger.fired.wait(10)
        assert trigger.fired.is_set()
        elapsed = run.returned_within(DEADLINE + GRACE, "a leased call frozen mid-lease")
    finally:
        proxy.reset()
    assert run.error is None, run.error
    out = run.result
    print(f"returned {out.status} after {elapsed:.2f} s: {out.reason}")
    assert out.status == "rolled_back"
    assert out.reason["kind"] == "lease_expired", out.reason
    assert notes(target, "cut-3") == 0
    ex.close()


# --- a stopped executor's locks (SIGSTOP) ------------------------------------------------------


def _grant_time(target: URL, deadline_epoch: float, bound: float) -> float:
    """Poll policy 1's row lock (a short lock wait each time) until it is granted; the wall
    clock time it was.  Fails with the measured figure past ``deadline_epoch + bound``."""
    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if is_pg(target):
                conn.execute(sa.text("SET lock_timeout = '100ms'"))
            else:
                conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
            while True:
                try:
                    conn.execute(sa.text("UPDATE policy SET holder = holder "
                                         "WHERE policy_id = 1"))
                    granted = time.time()
                    conn.rollback()
                    return granted
                except sa.exc.DBAPIError:
                    conn.rollback()
                late = time.time() - deadline_epoch
                if late > bound:
                    raise AssertionError(f"the stopped executor's row lock still held "
                                         f"{late:+.2f} s after its deadline (bound {bound} s)")
    finally:
        engine.dispose()


def _sleeping(target: URL, case: str) -> bool:
    """Whether the child's sleeping statement is running on the server now."""
    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    sql = ("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE "
           f"'%pg_sleep%' AND application_name LIKE '%{case}%'"
           if is_pg(target) else
           "SELECT count(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE '%SLEEP(%' "
           "AND ID <> CONNECTION_ID() AND DB = DATABASE()")
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar_one()) > 0
    finally:
        engine.dispose()


@pytest.mark.crash
def test_a_stopped_executors_lock_is_free_by_its_deadline_plus_one_second(
        target: URL, tmp_path: Path) -> None:
    """SIGSTOP while a statement runs into the deadline (the worst moment to stop): the
    server's statement timeout ends it, then its idle timeout the session -- the lock is
    free by the deadline + 1 s on both engines."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ready = tmp_path / "ready"
    case = f"P-stop-{uuid.uuid4().hex[:8]}"
    proc = spawn("call", {"target": url_text(target), "ledger": ledger,
                          "operation": "lab.hold_sleeping", "case": case,
                          "inputs": {"policy_id": 1, "ready": str(ready), "seconds": 30}})
    try:
        wait_for_file(ready, proc)
        wait_until("the sleeping statement on the server", lambda: _sleeping(target, case), 10)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.time()
        ex = executor_on(target, ledger)
        lease = next(e for e in ex.ledger.events(case) if e.kind == "lease_started")
        deadline = float(lease.payload["state"]["lease"]["deadline_epoch"])
        granted = _grant_time(target, deadline, bound=1.0)
        print(f"stopped {deadline - stopped:.2f} s before its deadline; lock free "
              f"{granted - deadline:+.3f} s after the deadline")
        assert granted - deadline <= 1.0
        ex.close()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


# --- resume through a cut network ------------------------------------------------------------


def test_resume_through_a_cut_network_answers_unknown_in_bounded_time(
        target: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    proxy = partition_proxy(target)
    ex = executor_on(proxy.url(target), ledger, connect_timeout=2.0)
    ex.connectors.get("insurance").check_target()
    trigger = proxy.drop_commit_reply()
    run = Running(lambda: ex.call("part.note", {"policy_id": 1, "body": "cut-4"},
                                  case="P-resume", who="agent"))
    try:
        trigger.fired.wait(10)
        run.returned_within(DEADLINE + GRACE, "the call")
        # still frozen: a fresh executor's resume through the same cut network
        fresh = executor_on(proxy.url(target), ledger, connect_timeout=2.0)
        resumed = Running(lambda: resume(fresh, "P-resume", wait_seconds=1.0))
        elapsed = resumed.returned_within(2.0 + 1.0 + 3.0, "resume through a cut network")
        assert resumed.error is None, resumed.error
        report = resumed.result
        print(f"resume answered after {elapsed:.2f} s: "
              f"{[(i.classification, i.evidence.get('rule')) for i in report.intents]}")
        assert [i.classification for i in report.intents] == ["unknown"]
        assert "unreachable" in str(report.intents[0].evidence.get("rule"))
        assert report.exit_code == 3
        fresh.close()
    finally:
        proxy.reset()
    healthy = executor_on(target, ledger)
    report = resume(healthy, "P-resume")
    assert [i.classification for i in report.intents] == ["applied"], report.to_dict()
    assert notes(target, "cut-4") == 1
    healthy.close()
    ex.close()


# --- a replay needs only the ledger --------------------------------------------------------------


def test_a_replay_is_answered_from_the_ledger_with_the_target_cut_off(
        target: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    inputs = {"policy_id": 1, "body": "replayed-1"}
    first = executor_on(target, ledger)
    assert first.call("part.note", inputs, case="P-replay", who="agent").status == \
        "applied_verified"
    first.close()
    proxy = partition_proxy(target)
    proxy.freeze()
    fresh = executor_on(proxy.url(target), ledger, connect_timeout=2.0)  # a new process's view
    try:
        run = Running(lambda: fresh.call("part.note", inputs, case="P-replay", who="agent"))
        elapsed = run.returned_within(1.5, "a replay with the target cut off")
    finally:
        proxy.reset()
    assert run.error is None, run.error
    print(f"replayed after {elapsed:.2f} s")
    assert run.result.status == "applied_verified" and run.result.replayed
    assert proxy.sent == []  # nothing -- not even a connection's startup -- reached the target
    assert notes(target, "replayed-1") == 1
    fresh.close()


def test_a_replay_sends_nothing_to_the_target(target: URL, tmp_path: Path,
                                              sent_sql: Callable[[Executor], Any]) -> None:
    """No opening batch (and no duplicate-key error in the server's log) for a replay."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = executor_on(target, ledger)
    inputs = {"policy_id": 1, "body": "replayed-2"}
    assert ex.call("part.note", inputs, case="P-replay2", who="agent").status == \
        "applied_verified"
    sent = sent_sql(ex)
    again = ex.call("part.note", inputs, case="P-replay2", who="agent")
    assert again.replayed and again.status == "applied_verified"
    assert sent == [], sent
    ex.close()


# --- resume and an opening batch that ran -------------------------------------------------


def test_resume_ends_the_live_session_of_an_unrecorded_opening_before_it_decides(
        target: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    """A leased call cut inside its opening batch: the marker INSERT ran, the session holds
    its transaction, the ledger has ``prepared`` and nothing more.  Resume from elsewhere
    must not say "nothing was sent": it ends (or waits for) that live session, then decides
    -- and the request is applied exactly once, not closed ``rolled_back``."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    proxy = partition_proxy(target)
    ex = executor_on(proxy.url(target), ledger)
    ex.connectors.get("insurance").check_target()
    if is_pg(target):
        # the opening statement executed, its Sync held: the session stays in its
        # transaction, holding the marker's key, with no server timeout running
        seen: list[Any] = []

        def split(m: Any) -> bool:
            if marker_sent(m):
                seen.append(m)
            return bool(seen) and m.kind == "S" and m.conn == seen[0].conn
        trigger = proxy.freeze_when(split)
    else:
        trigger = proxy.freeze_when(marker_sent, after=True)
    run = Running(lambda: ex.call("part.lease", {"policy_id": 1, "body": "opening-1"},
                                  case="P-open", who="agent"))
    try:
        assert trigger.fired.wait(10)
        healthy = executor_on(target, ledger)
        report = resume(healthy, "P-open", wait_seconds=3.0)
    finally:
        proxy.reset()
    run.thread.join(30)
    print(report.lines())
    (intent,) = report.intents
    assert "nothing was sent" not in str(intent.evidence.get("rule")), intent.evidence
    assert intent.action != "closed_not_applied"
    assert intent.outcome != "rolled_back", intent.to_dict()
    if intent.action != "retried":  # it could not end the session: unknown, never a guess
        assert intent.classification == "unknown"
        report = resume(healthy, "P-open")
    assert notes(target, "opening-1") == 1
    assert healthy.ledger.snapshot("P-open") is not None
    healthy.close()
    ex.close()


# --- the ledger behind the partition (PostgreSQL) ------------------------------------------


BOUNDS = LedgerBounds(wait_seconds=3.0, read_seconds=3.0, hold_seconds=1.0,
                      connect_seconds=2.0)
"""Small bounds, so the tests wait seconds, not the defaults' tens of seconds."""


def _first_sync_after(word: str) -> Callable[[Any], bool]:
    """A predicate for the Sync that ends the first batch in which ``word`` was sent: the
    batch's statements have run, and the server waits for the rest with no timeout."""
    seen: list[Any] = []

    def match(m: Any) -> bool:
        if not seen and m.mentions(word):
            seen.append(m)
        return bool(seen) and m.kind == "S" and m.conn == seen[0].conn
    return match


@pytest.mark.parametrize("where", ["before_commit", "mid_batch"])
def test_a_ledger_cut_mid_transaction_stops_no_other_executor_for_long(
        target: URL, pg_ledger_url: URL, partition_proxy: Callable[..., PartitionProxy],
        where: str) -> None:
    """Executor A is cut from the ledger inside the transaction of its ``prepared`` event
    (where it claims its idempotency key, its impact key and its budget slot).
    ``before_commit``: the server has run it all and the session is idle in its
    transaction; ``mid_batch``: the batch's Sync never arrives, so the session is
    ``active`` with no server timeout running.  Another executor's calls on the same and
    on another ticket, and a resume, each return within the hold bound + 1.5 s; A itself
    answers CG430 (exit 3) within its wait bound."""
    proxy = partition_proxy(pg_ledger_url)
    a = executor_on(target, open_ledger(proxy.url(pg_ledger_url), bounds=BOUNDS))
    warm = a.call("part.note", {"policy_id": 3, "body": "ledger-warm"}, case="T-0",
                  who="agent")  # the process's once-only set-up, done before the cut
    assert warm.status == "applied_verified", warm.reason
    if where == "before_commit":
        seen: list[Any] = []

        def commit_of_prepared(m: Any) -> bool:
            if m.mentions("INSERT INTO cg_idempotency"):
                seen.append(m)
            return bool(seen) and m.is_commit
        trigger = proxy.freeze_when(commit_of_prepared)
    else:
        trigger = proxy.freeze_when(_first_sync_after("INSERT INTO cg_idempotency"))
    run_a = Running(lambda: a.call("part.note", {"policy_id": 1, "body": "ledger-a"},
                                   case="T-1", who="agent"))
    b: Executor | None = None
    try:
        assert trigger.fired.wait(10), "A never reached the ledger transaction"
        b = executor_on(target, open_ledger(pg_ledger_url, bounds=BOUNDS))
        for case, body in (("T-2", "ledger-b-other"), ("T-1", "ledger-b-same")):
            call = Running(lambda c=case, t=body: b.call(  # type: ignore[union-attr]
                "part.note", {"policy_id": 1, "body": t}, case=c, who="agent"))
            elapsed = call.returned_within(BOUNDS.hold_seconds + 1.5,
                                           f"another executor's call on {case}")
            assert call.error is None, call.error
            assert call.result.status == "applied_verified", call.result.reason
            print(f"{case}: applied after {elapsed:.2f} s (hold {BOUNDS.hold_seconds:g} s)")
        resumed = Running(lambda: resume(b, "T-2"))  # type: ignore[arg-type]
        resumed.returned_within(BOUNDS.hold_seconds + 1.5, "a resume from elsewhere")
        elapsed_a = run_a.returned_within(BOUNDS.wait_seconds + GRACE,
                                          "the executor cut from its ledger")
    finally:
        proxy.reset()
    print(f"A answered {type(run_a.error).__name__} after {elapsed_a:.2f} s")
    assert isinstance(run_a.error, errors.LedgerUnreachable), run_a.error
    assert run_a.error.exit_code == 3 and "capgate resume T-1" in run_a.error.message
    assert b is not None
    assert notes(target, "ledger-a") == 0
    assert notes(target, "ledger-b-other") == notes(target, "ledger-b-same") == 1
    b.close()
    a.close()


def test_a_ledger_lost_at_the_claim_check_is_an_unknown_outcome(
        target: URL, pg_ledger_url: URL, partition_proxy: Callable[..., PartitionProxy]
        ) -> None:
    """The ledger is reset at the impact-claim check just before COMMIT: the intent is
    recorded and open, nothing was committed.  The caller gets CG430, exit 3, naming
    ``capgate resume`` -- not CG411 (exit 2, "usage or configuration") -- and resume
    applies it exactly once."""
    proxy = partition_proxy(pg_ledger_url)
    a = executor_on(target, open_ledger(proxy.url(pg_ledger_url), bounds=BOUNDS))
    a.connectors.get("insurance").check_target()
    trigger = proxy.freeze_when(lambda m: m.mentions("SELECT 1 FROM cg_claims"))
    run = Running(lambda: a.call("part.note", {"policy_id": 1, "body": "claim-check"},
                                 case="T-claim", who="agent"))
    try:
        assert trigger.fired.wait(10), "the call never reached its claim check"
        proxy.reset()
        run.returned_within(BOUNDS.wait_seconds + GRACE, "a call whose ledger was reset")
    finally:
        proxy.reset()
    error = run.error
    assert isinstance(error, errors.CapgateError), error
    print(f"{error.code} (exit {error.exit_code}): {error.message}")
    assert error.code == "CG430" and error.exit_code == 3
    assert "capgate resume T-claim" in error.message and error.details["recorded"] is True
    assert notes(target, "claim-check") == 0
    healthy = executor_on(target, open_ledger(pg_ledger_url, bounds=BOUNDS))
    report = resume(healthy, "T-claim")
    assert [(i.classification, i.action) for i in report.intents] == [
        ("not_applied", "retried")], report.to_dict()
    assert notes(target, "claim-check") == 1
    healthy.close()
    a.close()


# --- a batch split by the partition (the server side) -------------------------------------------


def _session_alive(target: URL, case: str) -> bool:
    """Whether the server still has a session of the call in ``case`` (its label)."""
    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if is_pg(target):
                sql = ("SELECT count(*) FROM pg_stat_activity "
                       f"WHERE application_name LIKE '%{case}%'")
            else:  # the call's session holds the policy row: does a transaction?
                sql = ("SELECT count(*) FROM information_schema.INNODB_TRX t JOIN "
                       "information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
                       "WHERE p.DB = DATABASE() AND p.ID <> CONNECTION_ID()")
            return int(conn.execute(sa.text(sql)).scalar_one()) > 0
    finally:
        engine.dispose()


def test_a_split_batch_on_mariadb_loses_its_session_by_the_deadline_plus_one_second(
        mariadb_url: URL, partition_proxy: Callable[..., PartitionProxy],
        tmp_path: Path) -> None:
    """MariaDB reads a command under the session's idle timeout, whether it waits for the
    next packet or for the rest of one: a partition between two packets of a leased call
    leaves a session the server ends by the deadline + 1 s."""
    prepare(mariadb_url)
    proxy = partition_proxy(mariadb_url)
    ex = executor_on(proxy.url(mariadb_url), f"sqlite:///{tmp_path / 'ledger.db'}")
    ex.connectors.get("insurance").check_target()
    trigger = proxy.freeze_when(lambda m: m.mentions("INSERT INTO policy_note"))
    started = time.monotonic()
    run = Running(lambda: ex.call("part.lease", {"policy_id": 1, "body": "split-m"},
                                  case="P-split-m", who="agent"))
    try:
        assert trigger.fired.wait(10)
        wait_until("the split session's end",
                             lambda: not _session_alive(mariadb_url, "P-split-m"),
                             DEADLINE + 1.0 + 1.0)
        late = time.monotonic() - started - DEADLINE
        print(f"the session ended {late:+.2f} s after the deadline")
        assert late <= 1.0
        run.returned_within(DEADLINE + GRACE + 1.0, "the split call")
    finally:
        proxy.reset()
    ex.close()


def test_a_split_batch_on_postgresql_outlives_its_deadline_but_never_commits(
        pg_url: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    """What holds on PostgreSQL when a partition splits a batch between its messages (here
    between a statement's Bind and its Execute): the server applies no statement or idle
    timeout while it waits for the rest, so -- behind a proxy, whose kernel answers the
    server's keepalive probes -- the session outlives the deadline, holding its locks (the
    figure is printed).  The call still returns by its deadline + the grace, ``rolled_back``
    (COMMIT was never sent), and the session can never commit: when the partition heals, the
    server gets the rest of the batch and the client's end of stream, and rolls it back.  On
    a real network the keepalive capgate asks for on every session ends it about 4 s after
    the last packet (``SERVER_KEEPALIVE``; see the next test)."""
    prepare(pg_url)
    proxy = partition_proxy(pg_url)
    ex = executor_on(proxy.url(pg_url), f"sqlite:///{tmp_path / 'ledger.db'}")
    ex.connectors.get("insurance").check_target()
    seen: list[Any] = []

    def execute_of_insert(m: Any) -> bool:  # its Parse and Bind sent, its Execute held
        if m.mentions("INSERT INTO policy_note"):
            seen.append(m)
        return bool(seen) and m.kind == "E" and m.conn == seen[0].conn
    trigger = proxy.freeze_when(execute_of_insert)
    started = time.monotonic()
    run = Running(lambda: ex.call("part.lease", {"policy_id": 1, "body": "split-p"},
                                  case="P-split-p", who="agent"))
    try:
        assert trigger.fired.wait(10)
        run.returned_within(DEADLINE + GRACE, "the split call")
        assert run.error is None and run.result.status == "rolled_back", run.error
        alive = _session_alive(pg_url, "P-split-p")
        print(f"{time.monotonic() - started - DEADLINE:+.2f} s after the deadline the split "
              f"session is {'still alive' if alive else 'gone'} (behind the proxy)")
        proxy.heal()
        _, took = wait_until("the split session's end once healed",
                             lambda: not _session_alive(pg_url, "P-split-p"), 5.0)
        print(f"healed: the session ended {took:.2f} s later")
    finally:
        proxy.reset()
    assert notes(pg_url, "split-p") == 0
    ex.close()


def test_every_postgresql_session_asks_the_server_for_keepalive(pg_url: URL) -> None:
    """What ends a split batch's session on a real network: the server's keepalive, set
    per session through libpq's options (no round trip), and libpq's own on the client."""
    from capgate.executor.dialects.base import SERVER_KEEPALIVE

    ex = executor_on(pg_url, open_ledger(pg_url.set(), bounds=BOUNDS), connect_timeout=3)
    try:
        with ex.connectors.get("insurance").engine.connect() as conn:
            got = [conn.execute(sa.text(f"SHOW {name}")).scalar_one() for name in
                   ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")]
        assert [int(v.rstrip("s")) for v in got] == list(SERVER_KEEPALIVE)
        with ex.ledger.engine.connect() as conn:
            idle = conn.execute(sa.text("SHOW idle_in_transaction_session_timeout")).scalar()
        assert idle == "1s", idle
    finally:
        ex.close()


# --- the partition matrix (docs/crash-matrix.md) ----------------------------------------------


def _after(word: str, kind: str) -> Callable[[Any], bool]:
    """The first ``kind`` message on the connection after one mentioning ``word``."""
    seen: list[Any] = []

    def match(m: Any) -> bool:
        if not seen and m.mentions(word):
            seen.append(m)
            return False
        return bool(seen) and m.conn == seen[0].conn and (
            m.kind == kind or (kind == "commit" and m.is_commit))
    return match


BOUNDARIES: dict[str, tuple[str, str, Callable[[], Callable[[Any], bool]]]] = {
    # name: (side, fault, the predicate's factory)
    "target: the opening unanswered": ("target", "after", lambda: marker_sent),
    "target: the statement unanswered": (
        "target", "after", lambda: lambda m: m.mentions("INSERT INTO policy_note")),
    "target: COMMIT held (never reaches the server)": (
        "target", "before", lambda: lambda m: m.is_commit),
    "target: COMMIT's reply dropped": ("target", "drop", lambda: lambda m: m.is_commit),
    "ledger: `prepared` unanswered": (
        "ledger", "before", lambda: _after("INSERT INTO cg_idempotency", "commit")),
    "ledger: `prepared` COMMIT's reply dropped": (
        "ledger", "drop", lambda: _after("INSERT INTO cg_idempotency", "commit")),
    "ledger: the claim check unanswered": (
        "ledger", "before", lambda: lambda m: m.mentions("SELECT 1 FROM cg_claims")),
    "ledger: `observed` COMMIT's reply dropped": (
        "ledger", "drop", lambda: _after("UPDATE cg_claims SET case_id = NULL", "commit")),
}


@pytest.mark.slow
@pytest.mark.partition
@pytest.mark.parametrize("heal", ["healed", "reset"])
@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_partition_matrix(target: URL, pg_ledger_url: URL, boundary: str, heal: str,
                          partition_proxy: Callable[..., PartitionProxy]) -> None:
    """One call cut off at each boundary, on each engine: what it answers and by when,
    then -- the partition healed or reset -- what resume concludes from a healthy path.
    The effect is in the target exactly as the ledger finally says.  With
    ``CAPGATE_PARTITION_MATRIX_OUT=FILE`` each cell is written (JSON lines) for the table
    in docs/crash-matrix.md."""
    import json

    side, fault, factory = BOUNDARIES[boundary]
    target_proxy = partition_proxy(target)
    ledger_proxy = partition_proxy(pg_ledger_url)
    cut = executor_on(target_proxy.url(target),
                      open_ledger(ledger_proxy.url(pg_ledger_url), bounds=BOUNDS),
                      connect_timeout=2.0, network_timeout=2.0)
    warm = cut.call("part.note", {"policy_id": 3, "body": "matrix-warm"}, case="M-0",
                    who="agent")
    assert warm.status == "applied_verified", warm.reason
    proxy = target_proxy if side == "target" else ledger_proxy
    match = factory()
    trigger = (proxy.drop_reply_when(match) if fault == "drop"
               else proxy.freeze_when(match, after=fault == "after"))
    body = f"matrix-{uuid.uuid4().hex[:8]}"
    run = Running(lambda: cut.call("part.note", {"policy_id": 1, "body": body}, case="M-1",
                                   who="agent"))
    bound = (DEADLINE if side == "target" else BOUNDS.wait_seconds) + GRACE
    try:
        assert trigger.fired.wait(10), f"the call never reached {boundary}"
        elapsed = run.returned_within(bound, boundary)
    finally:
        (proxy.heal if heal == "healed" else proxy.reset)()
    answer = (run.result.status if run.error is None else
              f"{run.error.code} (exit {run.error.exit_code})"
              if isinstance(run.error, errors.CapgateError) else repr(run.error))
    healthy = executor_on(target, open_ledger(pg_ledger_url, bounds=BOUNDS))
    concluded = "nothing in flight"
    if healthy.ledger.snapshot("M-1") is not None:
        report = resume(healthy, "M-1", wait_seconds=3.0)
        assert report.resolved, report.lines()
        if report.intents:
            (i,) = report.intents
            concluded = f"{i.classification}: {i.evidence.get('rule')} -> {i.action}"
    owner = healthy.ledger.get_idempotency(f"M-1:{body}")
    recorded = None
    if owner is not None:
        recorded = (healthy.ledger.intent(owner.case_id, owner.intent_id)
                    .get("outcome_record") or {}).get("status")
    rows = notes(target, body)
    print(f"{boundary} [{heal}]: {answer} after {elapsed:.2f} s; resume: {concluded}; "
          f"recorded {recorded}, rows {rows}")
    assert rows == (1 if recorded == "applied_verified" else 0), (recorded, rows)
    out = os.environ.get("CAPGATE_PARTITION_MATRIX_OUT")
    if out:
        with open(out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"engine": "mariadb" if not is_pg(target) else "postgresql",
                                 "boundary": boundary, "heal": heal, "answer": answer,
                                 "elapsed": round(elapsed, 2), "bound": bound,
                                 "resume": concluded, "recorded": recorded,
                                 "rows": rows}) + "\n")
    healthy.close()
    cut.close()


# --- the bounds themselves (no server) ----------------------------------------------------


def test_the_ledger_url_carries_its_bounds_and_the_driver_never_sees_them() -> None:
    from capgate.executor.ledger.backends import backend_for

    backend, url = backend_for("postgresql://u@h/db?capgate_wait=4&capgate_hold=2"
                               "&capgate_read=30&application_name=x")
    assert backend.bounds == LedgerBounds(wait_seconds=4, read_seconds=30, hold_seconds=2)
    assert dict(url.query) == {"application_name": "x"}
    args = backend.network_args(url)  # type: ignore[attr-defined]
    assert "-c idle_in_transaction_session_timeout=2000ms" in args["options"]
    with pytest.raises(errors.LedgerError, match="capgate_hold"):
        backend_for("postgresql://u@h/db?capgate_hold=soon")
    with pytest.raises(errors.LedgerError, match="hold_seconds"):
        backend_for("postgresql://u@h/db?capgate_hold=0")


def test_a_connection_keeps_its_own_options_and_gets_the_servers_keepalive() -> None:
    from capgate.executor.dialects import dialect_for

    url = make_url("postgresql+psycopg://u@h/db?options=-csearch_path%3Dx&keepalives_idle=9")
    args = dialect_for(url).network_args(url, 3.5)
    assert args["options"].startswith("-csearch_path=x -c tcp_keepalives_idle=")
    assert "keepalives_idle" not in args  # the URL's own setting wins
    assert args["connect_timeout"] == "4"  # whole seconds, rounded up


def test_a_mariadb_statement_carries_the_time_left_behind_its_session_tag() -> None:
    from capgate.executor.dialects import dialect_for

    dialect = dialect_for("mysql+pymysql://u@h/db")
    tagged = "/* capgate case=C op=o intent=i */ UPDATE policy SET x = 1"
    assert dialect.statement_deadline(tagged, 2.0) == (
        "/* capgate case=C op=o intent=i */ SET STATEMENT max_statement_time = 1.900 FOR "
        "UPDATE policy SET x = 1")
    assert dialect.statement_deadline("SELECT 1", -5.0) == \
        "SET STATEMENT max_statement_time = 0.001 FOR SELECT 1"
    assert dialect.statement_deadline("START TRANSACTION", 2.0) is None
    assert dialect.locks_gone_after_deadline() <= 1.0


def test_capgate_call_cut_off_answers_exit_3_by_its_deadline(
        pg_url: URL, partition_proxy: Callable[..., PartitionProxy], tmp_path: Path) -> None:
    """The command line alike: ``capgate call`` whose COMMIT reply is dropped exits 3 (the
    outcome unknown, CG401, naming resume) by its deadline + the grace, after its own
    start-up; ``capgate resume`` then records it applied."""
    import json
    import subprocess
    import sys

    from tests.fix_capgate import CAPABILITIES
    from tests.test_resume import write_config

    prepare(pg_url)
    caps = tmp_path / "caps"
    caps.mkdir()
    (caps / "partition.yaml").write_text(PARTITION_ROWS, "utf-8")
    proxy = partition_proxy(pg_url)
    config = write_config(tmp_path, proxy.url(pg_url), f"sqlite:///{tmp_path / 'ledger.db'}")
    text = config.read_text("utf-8").replace(
        f"capabilities = [{json.dumps(str(CAPABILITIES))}]",
        f"capabilities = [{json.dumps(str(CAPABILITIES))}, {json.dumps(str(caps))}]")
    config.write_text(text, "utf-8")
    trigger = proxy.drop_commit_reply()
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "capgate", "call", "part.note", "--case", "P-cli", "--input",
         json.dumps({"policy_id": 1, "body": "cli-1"}), "--json", "--config", str(config)],
        capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.monotonic() - started
    proxy.heal()
    assert trigger.fired.is_set(), done.stderr
    print(f"capgate call: exit {done.returncode} after {elapsed:.2f} s")
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "CG401" in done.stdout + done.stderr and "capgate resume P-cli" in \
        done.stdout + done.stderr
    assert elapsed <= DEADLINE + GRACE + 3.0, elapsed  # 3 s: the interpreter's start-up
    healthy = executor_on(pg_url, f"sqlite:///{tmp_path / 'ledger.db'}")
    assert [i.classification for i in resume(healthy, "P-cli").intents] == ["applied"]
    assert notes(pg_url, "cli-1") == 1
    healthy.close()
