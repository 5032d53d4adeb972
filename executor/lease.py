"""Leased transactions (shape B): declared deterministic steps under a deadline.

Only the row's declared steps run inside the lease -- SQL with expected
counts, checks that branch (continue, skip forward to a named step, or abort
with a reason), and *registered* step functions (:mod:`executor.steps`).
There is no way to hand control to a model, a person or another agent while
the transaction is open: the caller gets control back only after COMMIT or
ROLLBACK, and a function step the registry does not know is refused before
anything is recorded or opened.

The deadline is the row's ``timeout.seconds``, counted from the moment the
transaction is open, and it is enforced three times:

1. **The executor's watchdog** (one thread per process).  At the deadline it
   cancels the running statement (``Dialect.cancel_statement``: psycopg
   ``Connection.cancel_safe()``, MariaDB ``KILL QUERY <id>`` from a side
   connection, python-oracledb ``Connection.cancel()``, SQLite ``interrupt()``)
   and the lease rolls back before the next step.  A step stuck in Python (a
   registered function that does not return) cannot be cancelled;
   :data:`ESCALATE_AFTER_SECONDS` later the watchdog terminates the session
   itself (``Dialect.terminate_lease_session``: PostgreSQL
   ``pg_terminate_backend`` on the lease's pid and label, MariaDB ``KILL
   CONNECTION``), so its locks go with it.
2. **The server.**  As for every write (``executor.dialects.base``): the
   statement timeout is the time left (re-armed before a statement that starts
   more than ``REARM_AFTER_SECONDS`` after the last arming; on MariaDB carried
   by each statement itself) and the idle timeout is a constant
   ``IDLE_GRACE_SECONDS``, because the server counts it from the end of the
   last statement.  So a hung executor (SIGSTOP, a partition that delivers
   whole batches) -- whose watchdog is stopped too -- loses its session and its
   row locks within ``Dialect.locks_gone_after_deadline()`` of the deadline
   (1 s; 0.9 s on MariaDB), whether it stopped before, during or after a
   statement.  (A PostgreSQL session whose batch a partition split waits for
   the rest with no timeout: its keepalive ends it; see docs/scaling.md.)  A
   SIGKILLed executor's socket is closed by its kernel: the server rolls back
   at once.  The caller's own wait is cut 1 s past the deadline
   (:mod:`executor.cutoff`), so a partition cannot keep it either.
3. **The ledger.**  ``lease_started`` records the deadline (wall clock and
   epoch) before the first step; ``lease_released`` or ``lease_expired``
   (naming the step that was running at the deadline) follows the COMMIT or
   ROLLBACK, before ``observed``.  A process killed mid-lease cannot write its
   own ``lease_expired``: :func:`sweep_expired_leases` appends it for every
   intent whose recorded deadline has passed, and ``resume`` classifies the
   intent from the target's evidence as usual.

The Python API ``Executor.lease`` runs a leased row and accepts the
registered step functions it expects to run, as names or as the very
function objects registered; an unregistered callable is refused.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from capgate.executor import boundaries
from capgate.executor import outcome as oc
from capgate.executor.claims import ImpactClaims
from capgate.executor.context import CallContext, Rollback
from capgate.executor.dialects.base import (
    DEADLINE_KEY,
    ConnectCuts,
    StatementCuts,
    TxDeadline,
)
from capgate.executor.outcome import Outcome
from capgate.executor.runtime import Runtime
from capgate.executor.steps import require, run_registered
from capgate.executor.transaction import (
    checked,
    counted,
    expect_count,
    run_transaction,
    verify_and_replay,
)
from capgate.registry.errors import AttemptSuperseded, LeaseExpired
from capgate.registry.vocabulary import RollbackReason

if TYPE_CHECKING:
    from capgate.executor.connectors import Connector
    from capgate.executor.ledger import Ledger

__all__ = [
    "ESCALATE_AFTER_SECONDS",
    "Lease",
    "run_leased",
    "sweep_expired_leases",
]

ESCALATE_AFTER_SECONDS = 1.0
"""After the deadline, how long a cancelled lease may take before its session is terminated."""
SWEEP_MARGIN_SECONDS = 2.0
"""A recorded deadline must be this far in the past before the sweeper calls it expired."""


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


# --- the watchdog ---------------------------------------------------------------------


class _Watchdog:
    """One thread per process that runs lease actions at their (monotonic) times."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Lease, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def at(self, when: float, lease: Lease, action: Callable[[], None]) -> None:
        """Run ``action`` at ``when`` (monotonic) unless ``lease`` has finished by then."""
        with self._cv:
            if self._pid != os.getpid():  # forked: the parent's thread does not exist here
                self._heap, self._thread, self._pid = [], None, os.getpid()
            heapq.heappush(self._heap, (when, next(self._seq), lease, action))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="capgate-lease-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                when, _, lease, action = self._heap[0]
                delay = when - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                heapq.heappop(self._heap)
            if lease.state != "running":
                continue  # finished in time: the usual case, nothing to do
            # each action on its own short thread: a slow cancel never delays another lease
            threading.Thread(target=action, name="capgate-lease-fire", daemon=True).start()


_WATCHDOG = _Watchdog()

_SIDE: weakref.WeakKeyDictionary[sa.Engine, sa.Engine] = weakref.WeakKeyDictionary()
_SIDE_LOCK = threading.Lock()


def _side_engine(connector: Connector) -> sa.Engine:
    """A pool-less engine for the watchdog's side connection (KILL, pg_terminate_backend),
    with the connector's settings -- its connect timeout among them: over a cut network
    the side connection must give up too."""
    from capgate.executor.connectors import connector_engine

    with _SIDE_LOCK:
        engine = _SIDE.get(connector.engine)
        if engine is None:
            engine = connector_engine(connector.config, connector.dialect,
                                      poolclass=sa.pool.NullPool)
            StatementCuts(connector.dialect, connector.config.network_timeout).install(engine)
            ConnectCuts(connector.dialect.cut, connector.config.connect_timeout).install(engine)
            _SIDE[connector.engine] = engine
        return engine


# --- one lease ------------------------------------------------------------------------


class Lease:
    """The deadline of one leased transaction, and who enforces it.

    The main thread calls :meth:`enter` before each step and :meth:`finish`
    after the last; the watchdog calls :meth:`fire` at the deadline and
    :meth:`escalate` after it.  One lock orders them: once the lease is
    finished the watchdog does nothing (so a cancel can never hit the COMMIT),
    and once it fired the main thread never reaches COMMIT.
    """

    def __init__(self, ctx: CallContext, conn: sa.Connection) -> None:
        self.ctx = ctx
        self.connector = ctx.connector
        self.dialect = ctx.connector.dialect
        self.timeout = float(ctx.row.timeout.seconds)
        now, now_wall = time.monotonic(), time.time()
        # The lease's deadline is the transaction's: the one the server's timeouts were
        # armed to when it opened (before `prepared` committed).  Counted from here
        # instead, a slow `prepared` would put the lease's deadline after the server's,
        # and a statement the server stopped at the deadline would read as a mere timeout.
        tx = conn.info.get(DEADLINE_KEY)
        self.deadline = tx.deadline if isinstance(tx, TxDeadline) else now + self.timeout
        self.started = self.deadline - self.timeout
        self.started_wall = now_wall - (now - self.started)
        self.deadline_wall = self.started_wall + self.timeout
        self.step: str | None = None
        self.state = "running"
        self.expired = False
        self.step_at_deadline: str | None = None
        self.enforced_by: str | None = None
        self.terminated = False
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        """The watchdog's network actions (cancel, terminate) under way."""
        self._quiet = threading.Event()
        self._quiet.set()
        raw: Any = conn.connection.driver_connection
        self._raw = raw
        self._session: int | None = None
        try:
            self._session = self.dialect.session_id(raw)
        except Exception:  # no id: the watchdog can still cancel in-band
            self._session = None

    # -- the main thread

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def enter(self, conn: sa.Connection, name: str) -> None:
        """Before a step: refuse to start it after the deadline.

        The server's timeouts are re-armed to the time left before every
        statement of the step (``executor.dialects.base.rearm_before_statement``).
        """
        with self._lock:
            self._check_locked(conn)
            self.step = name

    def finish(self, conn: sa.Connection) -> None:
        """After the last step: from here on the watchdog leaves the transaction alone."""
        with self._lock:
            self._check_locked(conn)
            self.state = "done"

    def close(self, conn: sa.Connection | None = None) -> None:
        """The lease is over.  While a cancel or terminate of the watchdog is still
        travelling (a slow or cut network), ``conn`` is closed instead of going back to
        the pool, so that it can never reach the next call on the same session."""
        with self._lock:
            self.state = "done"
            self._raw = None  # the watchdog's queue may hold this lease until its deadline
            busy = not self._quiet.is_set()
        if conn is not None and busy and not conn.invalidated:
            with contextlib.suppress(Exception):
                conn.invalidate()

    def _landed(self) -> None:
        """A network action of the watchdog came back (or failed)."""
        with self._lock:
            self._in_flight -= 1
            if not self._in_flight:
                self._quiet.set()

    def _check_locked(self, conn: sa.Connection) -> None:
        if not self.expired and time.monotonic() >= self.deadline:
            self.expired = True
            self.step_at_deadline = self.step
            self.enforced_by = "deadline_check"
        if self.expired:
            self.state = "done"
            if self.terminated:
                conn.invalidate()  # the watchdog ended the session: nothing to roll back
            raise Rollback(self.reason())

    # -- the watchdog

    def fire(self) -> None:
        """At the deadline: mark the lease expired and cancel the running statement.

        The cancel travels over the network (a cancel request, a side connection) and,
        through a partition, may never arrive: it runs outside the lease's lock, so the
        main thread -- whose own wait the transaction's guard cuts -- is never held by it.
        """
        with self._lock:
            if self.state != "running":
                return
            self.expired = True
            self.step_at_deadline = self.step
            self.enforced_by = "watchdog_cancel"
            self._in_flight += 1
            self._quiet.clear()
        _WATCHDOG.at(self.deadline + ESCALATE_AFTER_SECONDS, self, self.escalate)
        try:
            self._cancel()
        except Exception as exc:  # the server's timeouts still hold
            with self._lock:
                self.errors.append(f"cancel: {type(exc).__name__}: {exc}")
        finally:
            self._landed()

    def escalate(self) -> None:
        """Still running after the cancel: terminate the session, and its locks with it."""
        with self._lock:
            if self.state != "running" or self._session is None:
                return  # finished; or no session id (SQLite, Oracle): nothing to terminate
            self._in_flight += 1
            self._quiet.clear()
        try:
            terminated = self._terminate()
        except Exception as exc:  # the server's timeouts still hold
            with self._lock:
                self.errors.append(f"terminate: {type(exc).__name__}: {exc}")
            return
        finally:
            self._landed()
        with self._lock:
            self.terminated = terminated
            # no such session: the server's own timeout ended it first
            self.enforced_by = "watchdog_terminate" if terminated else "server"

    def _cancel(self) -> None:
        self.dialect.cancel_statement(self._raw, self._session,
                                      lambda: _side_engine(self.connector).connect())

    def _terminate(self) -> bool:
        if self._session is None:
            return False
        with _side_engine(self.connector).connect() as side:
            return self.dialect.terminate_lease_session(side, self._session, self.ctx.tag)

    # -- what it says

    def record(self) -> dict[str, Any]:
        """The lease as ``lease_started`` records it."""
        return {"timeout_seconds": self.timeout, "started_at": _iso(self.started_wall),
                "deadline": _iso(self.deadline_wall), "deadline_epoch": self.deadline_wall,
                "holder": f"{socket.gethostname()}:{os.getpid()}",
                "steps": [s.name for s in self.ctx.row.steps]}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"timeout_seconds": self.timeout,
                               "deadline": _iso(self.deadline_wall), "expired": self.expired}
        if self.expired:
            out.update(step=self.step_at_deadline, enforced_by=self.enforced_by)
        if self.errors:
            out["watchdog_errors"] = list(self.errors)
        return out

    def reason(self, cause: Mapping[str, Any] | None = None) -> dict[str, Any]:
        step = self.step_at_deadline or "(opening)"
        out: dict[str, Any] = {
            "kind": RollbackReason.LEASE_EXPIRED, "code": LeaseExpired.code, "step": step,
            "timeout_seconds": self.timeout,
            "deadline": _iso(self.deadline_wall),
            "overrun_seconds": round(max(0.0, time.monotonic() - self.deadline), 3),
            "enforced_by": self.enforced_by or "server",
            "message": f"the lease of {self.timeout:g} s expired while step {step!r} was "
                       "running; the transaction was rolled back",
        }
        if cause is not None:
            out["cause"] = dict(cause)
        return out


# --- the runner -----------------------------------------------------------------------


def check_steps(ctx: CallContext) -> None:
    """Refuse, before anything is recorded, a row naming a function nobody registered."""
    for step in ctx.row.steps:
        if step.function is not None:
            require(step.function)


def run_leased(rt: Runtime, ctx: CallContext) -> Outcome:
    """Shape B: the row's declared steps in one transaction under its deadline."""
    row = ctx.row
    ctx.connector.dialect.check_lease()  # issue 18: Oracle refuses (LeaseNotEnforceable)
    rt.check_target(ctx.connector, ctx)
    check_steps(ctx)
    leases: list[Lease] = []

    def body(conn: sa.Connection, evidence: dict[str, Any]) -> None:
        current = Lease(ctx, conn)
        leases.append(current)
        _WATCHDOG.at(current.deadline, current, current.fire)
        trace: list[dict[str, Any]] = []
        evidence["steps"] = trace
        counts: list[int] = []
        evidence["counts"] = counts
        try:
            if not ctx.rehearse:
                record = current.record()
                claims = rt.hooks.find(ImpactClaims)
                claim = claims.held(ctx.intent_id) if claims is not None else None
                if claim is not None:
                    record["claims"] = dict(claim.tokens)
                rt.ledger.append(ctx.case_id, "lease_started", {"state": {
                    "lease": record}}, intent_id=ctx.intent_id, attempt=ctx.attempt)
            skip_to: str | None = None
            for step in row.steps:
                if skip_to is not None:
                    if step.name != skip_to:
                        trace.append({"step": step.name, "skipped": True})
                        continue
                    skip_to = None
                current.enter(conn, step.name)
                if step.sql is not None:
                    n = counted(ctx, conn, step.sql, counts)
                    trace.append({"step": step.name, "rows": n})
                    expect_count(n, step.expect_rows, step.sql, {"step": step.name})
                elif step.check is not None and step.expect is not None:
                    result = checked(ctx, conn, step.name, step.check, step.expect)
                    trace.append({"step": step.name, "check": result.to_dict()})
                    if result.ok:
                        continue
                    if step.abort is not None:
                        raise Rollback({"kind": RollbackReason.ABORT, "step": step.name,
                                        "reason": step.abort, "expected": result.expected,
                                        "actual": result.actual})
                    skip_to = step.skip_to
                else:
                    trace.append(run_registered(step.function or "", conn, ctx))
            current.enter(conn, "verify")
            verify_and_replay(ctx, conn, evidence)
            current.finish(conn)
        finally:
            current.close(conn)
            evidence["lease"] = current.summary()

    if not ctx.rehearse:
        boundaries.prepared(rt, ctx)

    def attempt(current: CallContext) -> Outcome:
        nonlocal ctx
        ctx = current  # the steps above run under the attempt's context
        leases.clear()
        result = run_transaction(rt, current, body)
        return _settle(rt, current, leases[0], result) if leases else result

    ctx, result = boundaries.attempts(rt, ctx, attempt)
    if ctx.rehearse:
        return result
    return boundaries.observed(rt, ctx, result)


def _settle(rt: Runtime, ctx: CallContext, current: Lease, result: Outcome) -> Outcome:
    """Name the expiry in the outcome; record ``lease_released`` / ``lease_expired``."""
    reason = dict(result.reason) if result.reason is not None else None
    # an engine whose statements carry their own timeout stops them a little before the
    # deadline (MariaDB: 0.1 s), so that its whole-second idle timeout still ends a stopped
    # executor's session within the deadline + 1 s
    early = max(0.0, -current.dialect.statement_end_after_deadline)
    if result.status == oc.ROLLED_BACK and not current.expired and reason is not None \
            and reason.get("kind") in ("timeout", "database_error") \
            and time.monotonic() >= current.deadline - early:
        # the server's own timeout ended it (e.g. the process was stopped past the deadline)
        current.expired = True
        current.step_at_deadline = current.step
        current.enforced_by = "server"
    evidence = {**result.evidence, "lease": current.summary()}
    if current.expired and result.status == oc.ROLLED_BACK and (
            reason is None or reason.get("kind") != RollbackReason.LEASE_EXPIRED):
        reason = current.reason(reason)
    result = Outcome(**{**result.__dict__, "evidence": evidence, "reason": reason})
    if not ctx.rehearse:
        kind = "lease_expired" if current.expired else "lease_released"
        try:
            rt.ledger.append(ctx.case_id, kind, {"state": {"lease": {
                **current.record(), **current.summary(), "outcome": result.status,
                "ended_at": _iso(time.time())}}}, intent_id=ctx.intent_id, attempt=ctx.attempt)
        except AttemptSuperseded as late:  # woken after resume settled or retried the intent
            boundaries.record_stale(rt, ctx, result, late)
    return result


# --- after a crash --------------------------------------------------------------------


def sweep_expired_leases(ledger: Ledger, *, now: float | None = None,
                         margin: float = SWEEP_MARGIN_SECONDS,
                         case_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Record ``lease_expired`` for every lease whose executor vanished past its deadline.

    A lease still ``lease_started`` after its recorded deadline (plus ``margin``
    for clock skew between machines) belongs to an executor that died or hung:
    the server has already rolled its transaction back or will at its own
    timeout.  The sweeper only records that fact; ``resume`` still decides from
    the target's evidence what landed.  Returns what it recorded.
    """
    moment = time.time() if now is None else now
    ids = list(case_ids) if case_ids is not None else [
        c.case_id for c in ledger.cases(open_only=True)
        if "lease_started" in c.statuses.values()]
    found: list[dict[str, Any]] = []
    for case_id in ids:
        snapshot = ledger.snapshot(case_id) or {}
        for intent_id, state in (snapshot.get("intents") or {}).items():
            if state.get("status") != "lease_started":
                continue
            record = state.get("lease") or {}
            deadline = record.get("deadline_epoch")
            if not isinstance(deadline, int | float) or deadline + margin > moment:
                continue
            entry = {**record, "expired": True, "step": None, "enforced_by": "server",
                     "detected_by": "sweeper", "detected_at": _iso(moment),
                     "note": "the executor recorded nothing after its deadline (killed or "
                             "hung); the server's lease timeouts end such a transaction -- "
                             "what landed is for resume to establish from the target"}
            ledger.append(case_id, "lease_expired", {"state": {"lease": entry}},
                          intent_id=intent_id)
            found.append({"case": case_id, "intent_id": intent_id, **entry})
    return found
