"""Session budgets: capgate waits or refuses before the database would.

A real estate caps sessions per database user (INSIS: 6 per user, ORA-02391
beyond).  Hitting that cap at the server is a surprise in the middle of a
call; capgate checks it first, across every executor sharing the ledger.

Two scopes, each a set of *slots* in the ledger store (``cg_budget_slots``):

* ``connector:NAME`` -- ``ConnectorConfig.session_budget`` slots: the sessions
  capgate has open at once on that connector, in all processes together;
* ``db_user:USER@HOST:PORT`` -- ``ConnectorConfig.db_user_budget`` slots, shared
  by every connector that logs in as that user on that server;
* ``case:CONNECTOR:CASE`` -- ``ConnectorConfig.case_session_budget`` slots (issue
  17): the sessions one case holds at once on the connector, in all processes
  together -- a per-case estate cap, enforced before the system's.  Its slot
  rows are created in the ``prepared`` transaction of the case's first call in
  a process (no transaction of their own) and dropped by ``capgate case close``.

A session takes one slot of each scope before it is opened and gives them back
when the connection is returned (the pool's ``checkin``, which also fires for
a connection that was invalidated).  Taking a slot is one statement::

    UPDATE cg_budget_slots SET ticket = :ticket, ..., expires_at = now + :ttl
    WHERE scope = :scope AND slot = (SELECT slot FROM cg_budget_slots
        WHERE scope = :scope AND slot < :budget AND (ticket IS NULL OR expires_at < now)
        ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED)       -- PostgreSQL
    RETURNING slot

so two processes never take one slot (the row lock; SQLite: ``BEGIN
IMMEDIATE``), and a slot whose holder was killed frees itself when its
expiry -- the call's timeout plus :data:`BUDGET_MARGIN_SECONDS`, on the
store's clock -- passes.  With no free slot the call polls for up to
``budget_wait_seconds`` and then raises :class:`~registry.errors.BudgetExhausted`
naming the scope, the budget and who holds the slots.  ``Executor.call``
reserves its session's slots *before* ``prepared``, so a refusal records
nothing and leaves no open intent.

A connector with a ``db_user_budget`` does not keep idle pooled sessions
(``Connector.open`` uses no pool there): an idle pooled session is still a
session to the server, and would count against the user's cap unseen.

The marker and fence tables are checked once per process and connector
under a slot of their own (:func:`prepare_target`).  Not counted: ``resume``'s
evidence sessions and the lease watchdog's side connection (at a deadline:
MariaDB ``KILL QUERY``, PostgreSQL ``pg_terminate_backend``).  Leave the
database's own cap one session above the budget for those.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from capgate.executor.claims import StoreAccess
from capgate.executor.hooks import CallHooks, HasHooks, RetryOutside
from capgate.executor.waits import NO_TURN, earlier_turn_sql, line_for, slot_resource
from capgate.registry.errors import BudgetExhausted, LedgerError

if TYPE_CHECKING:
    from capgate.executor.connectors import Connector
    from capgate.executor.context import CallContext
    from capgate.executor.ledger import Ledger
    from capgate.executor.ledger.backends import HotResult, HotTx

__all__ = ["BUDGET_MARGIN_SECONDS", "SessionBudgets", "SlotStore", "Ticket", "holding",
           "scopes_for", "slot_store"]

BUDGET_MARGIN_SECONDS = 5.0
"""How long past a call's timeout a slot outlives a holder that vanished."""

_RECORD_KEY = "capgate_budget_ticket"
_HOST = socket.gethostname()


@dataclass(frozen=True)
class Scope:
    """One budget: ``name`` (``connector:…`` / ``db_user:…``), its size, how to say it."""

    name: str
    budget: int
    kind: str
    label: str


def case_scope_name(connector: str, case_id: str) -> str:
    return f"case:{connector}:{case_id}"


def scopes_for(connector: Connector, case_id: str | None = None) -> list[Scope]:
    config = connector.config
    out = [Scope(f"connector:{config.name}", config.session_budget, "connector",
                 f"connector {config.name!r}")]
    if case_id is not None and config.case_session_budget is not None:
        out.append(Scope(case_scope_name(config.name, case_id), config.case_session_budget,
                         "case", f"case {case_id!r} on connector {config.name!r}"))
    url = connector.engine.url
    # issue 18: where the database counts a user's sessions is the dialect's to say
    # (Oracle ORA-02391: per user per database/service, whatever host or RAC node)
    where = connector.dialect.budget_user_scope(url, config.connect_args)
    if config.db_user_budget is not None and where is not None:
        out.append(Scope(f"db_user:{where}", config.db_user_budget, "db_user",
                         f"database user {where.partition('@')[0]!r} on "
                         f"{where.partition('@')[2] or 'localhost'}"))
    return out


@dataclass
class Ticket:
    """The slots one session holds; released exactly once."""

    ticket: str
    slots: tuple[tuple[str, int], ...]
    store: SlotStore
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
        with contextlib.suppress(LedgerError):  # it expires on its own
            self.store.release(self.ticket)


class SlotStore:
    """``cg_budget_slots`` in one ledger store."""

    def __init__(self, ledger: Ledger) -> None:
        self.store = StoreAccess(ledger)
        s = self.store
        lock = s.skip_locked
        # a free slot goes to the earliest live turn in the scope's wait line
        # (executor.waits): a call that has not waited comes after every waiter
        self._take = (
            "UPDATE cg_budget_slots SET ticket = :ticket, case_id = :case_id,"
            f" intent_id = :intent_id, holder = :holder, acquired_at = {s.now_sql},"
            f" expires_at = {s.now_sql} + :ttl"
            " WHERE scope = :scope AND slot = (SELECT slot FROM cg_budget_slots"
            " WHERE scope = :scope AND slot < :n"
            f" AND (ticket IS NULL OR expires_at < {s.now_sql})"
            f" AND {earlier_turn_sql(s.now_sql)}"
            f" ORDER BY slot LIMIT 1{lock}) RETURNING slot"
        )
        self._free = (
            "SELECT 1 FROM cg_budget_slots WHERE scope = :scope AND slot < :n"
            f" AND (ticket IS NULL OR expires_at < {s.now_sql}) LIMIT 1"
        )
        self.line = line_for(ledger)
        self._seed = (
            "INSERT INTO cg_budget_slots (scope, slot, acquired_at, expires_at)"
            " VALUES (:scope, :slot, 0, 0) ON CONFLICT (scope, slot) DO NOTHING"
        )
        self._release = (
            "UPDATE cg_budget_slots SET ticket = NULL, case_id = NULL, intent_id = NULL,"
            " holder = NULL, expires_at = 0 WHERE ticket = :ticket"
        )
        self._holders = (
            "SELECT slot, case_id, intent_id, holder,"
            f" expires_at - {s.now_sql} AS expires_in FROM cg_budget_slots"
            f" WHERE scope = :scope AND slot < :n AND ticket IS NOT NULL"
            f" AND expires_at >= {s.now_sql} ORDER BY slot"
        )
        self._seeded: set[tuple[str, int]] = set()

    def ensure(self, scope: Scope) -> None:
        """The scope's slot rows exist (once per process; outside any other transaction)."""
        self._ensure(scope)

    def _ensure(self, scope: Scope) -> None:
        if (scope.name, scope.budget) in self._seeded:
            return
        with self.store.write("prepare session budget slots") as tx:
            self.seed_on(tx, scope)
        self._seeded.add((scope.name, scope.budget))

    def seeded(self, scope: Scope) -> bool:
        return (scope.name, scope.budget) in self._seeded

    def seed_on(self, tx: HotTx, scope: Scope) -> None:
        """The scope's slot rows, inside the caller's transaction (none already there)."""
        tx.run_many(self._seed, [{"scope": scope.name, "slot": i}
                                 for i in range(scope.budget)])

    def mark_seeded(self, scopes: Sequence[Scope]) -> None:
        """The transaction that seeded ``scopes`` committed."""
        self._seeded.update((s.name, s.budget) for s in scopes)

    def drop_case(self, case_id: str, connectors: Sequence[str]) -> None:
        """Remove a closed case's slot rows (held slots, a session still open, are kept)."""
        with self.store.write("drop a closed case's budget slots") as tx:
            for name in connectors:
                tx.run("DELETE FROM cg_budget_slots WHERE scope = :s AND ticket IS NULL",
                       {"s": case_scope_name(name, case_id)})
        self._seeded = {s for s in self._seeded
                        if not any(s[0] == case_scope_name(n, case_id) for n in connectors)}

    def try_take(self, scope: Scope, ticket: str, *, ttl: float, case_id: str | None,
                 intent_id: str | None, turn: int = NO_TURN) -> int | None:
        self._ensure(scope)
        with self.store.write("take a session budget slot") as tx:
            return self.take_on(tx, scope, ticket, ttl=ttl, case_id=case_id,
                                intent_id=intent_id, turn=turn)

    def take_on(self, tx: HotTx, scope: Scope, ticket: str, *, ttl: float,
                case_id: str | None, intent_id: str | None,
                turn: int = NO_TURN) -> int | None:
        """:meth:`try_take` inside the caller's transaction."""
        row = self.ask_on(tx, scope, ticket, ttl=ttl, case_id=case_id,
                          intent_id=intent_id, turn=turn).first()
        return None if row is None else int(row[0])

    def ask_on(self, tx: HotTx, scope: Scope, ticket: str, *, ttl: float,
               case_id: str | None, intent_id: str | None,
               turn: int = NO_TURN) -> HotResult:
        """:meth:`take_on`, its answer read later: a row ``(slot,)``, or none when no slot
        is free for this turn (the ``prepared`` append reads it with the rest of its
        results)."""
        return tx.run(self._take, {
            "scope": scope.name, "n": scope.budget, "ticket": ticket, "ttl": float(ttl),
            "case_id": case_id, "intent_id": intent_id, "holder": f"{_HOST}:{os.getpid()}",
            "wres": slot_resource(scope.name), "turn": int(turn)})

    def free(self, scope: Scope) -> Callable[[HotTx], bool]:
        """Whether ``scope`` has a free slot (its wait line aside): a read in ``tx``."""
        return lambda tx: tx.run(self._free, {"scope": scope.name,
                                              "n": scope.budget}).first() is not None

    def wait_for(self, scopes: Sequence[Scope], *, key: str, wait: float,
                 case_id: str | None, intent_id: str | None) -> bool:
        """Stand in the wait line of ``scopes`` until each has a slot for this turn (True)
        or ``wait`` seconds after the first wait for a slot (False)."""
        return self.line.wait(key, kind="slot", limit=wait, case_id=case_id,
                              intent_id=intent_id,
                              resources={slot_resource(s.name): self.free(s) for s in scopes})

    def holders(self, scope: Scope) -> list[dict[str, Any]]:
        with self.store.write("read session budget slots") as tx:
            return tx.run(self._holders, {"scope": scope.name, "n": scope.budget}).mappings()

    def release(self, ticket: str) -> None:
        with self.store.write("release session budget slots") as tx:
            self.release_on(tx, ticket)

    def release_on(self, tx: HotTx, ticket: str) -> None:
        tx.run(self._release, {"ticket": ticket})

    def free_dead(self, intent_ids: Sequence[str]) -> None:
        """Free the slots of these intents whose holder is a dead process of this host."""
        with self.store.write("free the budget slots of dead sessions") as tx:
            for i in range(0, len(intent_ids), 500):
                chunk = list(intent_ids[i:i + 500])
                names = ", ".join(f":i{n}" for n in range(len(chunk)))
                rows = tx.run(f"SELECT ticket, holder FROM cg_budget_slots WHERE intent_id IN "
                              f"({names}) AND ticket IS NOT NULL",
                              {f"i{n}": v for n, v in enumerate(chunk)}).all()
                for ticket, holder in rows:
                    if _dead_local(str(holder or "")):
                        self.release_on(tx, str(ticket))

    def acquire(self, scopes: list[Scope], *, wait: float, ttl: float,
                case_id: str | None = None, intent_id: str | None = None) -> Ticket:
        """One slot of every scope, waiting in line up to ``wait`` seconds; else
        BudgetExhausted.

        A call's wait (``intent_id``) counts against the call's one ``wait`` however
        many times it waits for a slot; its place in line stays until it prepared.
        """
        ticket = Ticket(uuid.uuid4().hex, (), self)
        key = intent_id or f"ticket:{ticket.ticket}"
        line = self.line
        taken: list[tuple[str, int]] = []
        try:
            for scope in scopes:
                while True:
                    slot = self.try_take(scope, ticket.ticket, ttl=ttl, case_id=case_id,
                                         intent_id=intent_id, turn=line.turn_of(key))
                    if slot is not None:
                        taken.append((scope.name, slot))
                        line.got(key, slot_resource(scope.name))
                        break
                    if not self.wait_for([scope], key=key, wait=wait, case_id=case_id,
                                         intent_id=intent_id):
                        raise self._exhausted(scope, line.waited(key, "slot"), wait)
        except BaseException:
            if taken:
                ticket.release()
            if intent_id is None:
                line.leave(key)
            raise
        if intent_id is None:
            line.leave(key)
        ticket.slots = tuple(taken)
        return ticket

    def _exhausted(self, scope: Scope, waited: float, wait: float) -> BudgetExhausted:
        holders = self.holders(scope)
        who = ", ".join(sorted({f"{h['case_id']}" for h in holders if h["case_id"]})) or "-"
        return BudgetExhausted(
            f"{scope.label} has no free session within its budget of {scope.budget} "
            f"({len(holders)} held; cases: {who}); waited {waited:.1f} s of "
            f"budget_wait_seconds={wait:g} -- retry later or raise the budget",
            scope=scope.kind, name=scope.name, budget=scope.budget,
            waited_seconds=round(waited, 3), holders=holders)


# --- the executor's hook ----------------------------------------------------------------


def _dead_local(holder: str) -> bool:
    """``host:pid`` names a process of this host that no longer exists."""
    host, _, pid = holder.rpartition(":")
    if host != _HOST or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _ttl(connector: Connector, ctx: CallContext | None) -> float:
    seconds = ctx.row.timeout.seconds if ctx is not None else connector.config.statement_timeout
    return float(seconds) + BUDGET_MARGIN_SECONDS


def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
    ticket = record.record_info.pop(_RECORD_KEY, None)
    if isinstance(ticket, Ticket):
        ticket.release()


@dataclass
class _CallSlot:
    """The slots a call holds for its session, and how they go back."""

    connector: str
    ticket: Ticket
    on_checkin: bool
    """Taken outside ``prepared`` (a new session had to be opened first): the pool's
    checkin gives it back, not ``observed``."""


class SessionBudgets(CallHooks):
    """The executor's session budgets: a hook (see :mod:`executor.hooks`) with its own state.

    A call's session slot is taken in the transaction that records
    ``prepared`` and given back in the one that records ``observed`` -- no
    ledger transaction of its own.  Only when the call would have to open a
    *new* session to its database (none idle in the pool) is the slot taken
    first, waiting up to ``budget_wait_seconds``: a session must never be
    opened beyond the budget.

    * ``before_prepared``: the once-per-process check of capgate's tables (under
      a slot of its own) and the scope rows, outside the ``prepared`` transaction;
    * ``open_session``: a session of a call that is about to prepare, from the
      pool: no slot yet; a session that must be opened: its slots first; any
      other session (post-commit checks, resume, a rehearsal): its own slots,
      given back when the connection returns to its pool;
    * ``within_prepared`` / ``within_observed``: take / give back the call's slot;
      with none free, :class:`~executor.hooks.RetryOutside` waits for one outside
      the transaction and prepares again;
    * ``after_call``: a slot the call still holds goes back.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.store = SlotStore(ledger)
        self._calls: dict[str, _CallSlot] = {}
        self._pending: dict[str, _CallSlot] = {}
        self._seeding: dict[str, list[Scope]] = {}
        self._opened_unslotted: set[str] = set()
        self._lock = threading.Lock()
        self._hooked: weakref.WeakSet[sa.Engine] = weakref.WeakSet()

    def acquire(self, connector: Connector, ctx: CallContext | None = None, *,
                case_id: str | None = None) -> Ticket:
        case = ctx.case_id if ctx is not None else case_id
        return self.store.acquire(
            scopes_for(connector, case), wait=connector.config.budget_wait_seconds,
            ttl=_ttl(connector, ctx), case_id=case,
            intent_id=ctx.intent_id if ctx else None)

    def holds_session(self, connector: Connector, case_id: str) -> bool:
        """Whether a call of ``case_id`` (any process) holds a session slot of ``connector``."""
        return any(h["case_id"] == case_id for scope in scopes_for(connector)
                   for h in self.store.holders(scope))

    def before_prepared(self, ctx: CallContext) -> None:
        if ctx.rehearse:
            return
        if ctx.row.is_write:
            # the once-per-process check of the target's tables, under a slot of its own
            # that goes back before the call takes its own (a budget of 1 would wait for
            # itself)
            self.check_target(ctx.connector, ctx)
        for scope in scopes_for(ctx.connector):  # a case's scope is seeded in `prepared`
            self.store.ensure(scope)

    def check_target(self, connector: Connector, ctx: CallContext | None) -> None:
        """The tables' check opens a session of its own; it is counted like any other."""
        if connector.target_checked:
            return
        ticket = self.acquire(connector, ctx)
        try:
            connector.check_target()
        finally:
            ticket.release()

    def open_session(self, connector: Connector, ctx: CallContext | None,
                     open_: Callable[[], Connection]) -> Connection:
        self._hook(connector)
        if ctx is not None:
            with self._lock:
                held = self._calls.get(ctx.intent_id)
            if held is not None and held.on_checkin and held.ticket.released:
                # the session that carried it went back (a wait in line, then again):
                # that slot went with it, and this session needs its own
                with self._lock:
                    self._calls.pop(ctx.intent_id, None)
                held = None
            if held is not None and held.connector == connector.name:
                return open_()  # the call's own session: its slot is held already
            if held is None and self._before_prepared(ctx) and _idle_in_pool(connector):
                conn = open_()  # a pooled session: the slot comes with `prepared`
                with self._lock:
                    self._opened_unslotted.add(ctx.intent_id)
                return conn
        ticket = self.acquire(connector, ctx)
        try:
            conn = open_()
        except BaseException:
            ticket.release()
            raise
        info: dict[str, Any] | None = conn.connection.record_info
        if ctx is not None and self._before_prepared(ctx):
            with self._lock:  # the call's slot, taken before its new session opened
                self._calls[ctx.intent_id] = _CallSlot(connector.name, ticket, True)
        if info is not None:
            info[_RECORD_KEY] = ticket
        else:  # no pool record to carry it: the slot expires on its own
            ticket.release()
        opened: Connection = conn
        return opened

    def open_for_case(self, connector: Connector, case_id: str) -> Connection:
        """A session outside any call that counts against ``case_id``'s budget (the case's
        other work: a tool holding sessions, the DDL loop); given back at checkin."""
        self._hook(connector)
        ticket = self.acquire(connector, None, case_id=case_id)
        try:
            conn = connector.engine.connect()
        except BaseException:
            ticket.release()
            raise
        info: dict[str, Any] | None = conn.connection.record_info
        if info is not None:
            info[_RECORD_KEY] = ticket
        else:
            ticket.release()
        return conn

    @staticmethod
    def _before_prepared(ctx: CallContext) -> bool:
        """A call's first attempt, whose ``prepared`` is still to come."""
        return not ctx.resumed and not ctx.rehearse

    def within_prepared(self, ctx: CallContext, tx: HotTx) -> None:
        if ctx.rehearse:
            return
        with self._lock:
            if ctx.intent_id in self._calls:
                return
        ticket = Ticket(uuid.uuid4().hex, (), self.store)
        asked: list[tuple[Scope, HotResult]] = []
        seeding: list[Scope] = []
        line = self.store.line
        line.leave_on(tx, ctx.intent_id)  # a call that waited: its places go with this
        turn = line.turn_of(ctx.intent_id)
        for scope in scopes_for(ctx.connector, ctx.case_id):
            if not self.store.seeded(scope):  # a case's first call here: its slot rows
                self.store.seed_on(tx, scope)
                seeding.append(scope)
            asked.append((scope, self.store.ask_on(tx, scope, ticket.ticket,
                                                   ttl=_ttl(ctx.connector, ctx),
                                                   case_id=ctx.case_id,
                                                   intent_id=ctx.intent_id, turn=turn)))

        def settle() -> None:
            """The slots' answers, read with the rest of ``prepared``'s (one round trip)."""
            taken: list[tuple[str, int]] = []
            for scope, answer in asked:
                row = answer.first()
                if row is None:  # none free: wait for one outside, then prepare again
                    raise RetryOutside(lambda: self._wait_for_slot(ctx))
                taken.append((scope.name, int(row[0])))
            ticket.slots = tuple(taken)
            with self._lock:  # may run again (a retried transaction): the last run counts
                self._pending[ctx.intent_id] = _CallSlot(ctx.connector.name, ticket, False)
                self._seeding[ctx.intent_id] = seeding

        tx.defer(settle)

    def _wait_for_slot(self, ctx: CallContext) -> None:
        """No slot free in ``prepared``: wait in line for one, outside every transaction
        and holding nothing (BudgetExhausted after ``budget_wait_seconds``); ``prepared``
        then runs again and takes it -- no later call can take it first."""
        scopes = scopes_for(ctx.connector, ctx.case_id)
        wait = ctx.connector.config.budget_wait_seconds
        if self.store.wait_for(scopes, key=ctx.intent_id, wait=wait, case_id=ctx.case_id,
                               intent_id=ctx.intent_id):
            return
        waited = self.store.line.waited(ctx.intent_id, "slot")
        with self.store.store.ledger.transaction("look at session budget slots",
                                                 write=False) as tx:
            full = [s for s in scopes if not self.store.free(s)(tx)]
        raise self.store._exhausted(full[0] if full else scopes[0], waited, wait)

    def after_prepared(self, ctx: CallContext) -> None:
        self.store.line.prepared(ctx.intent_id)
        with self._lock:
            taken = self._pending.pop(ctx.intent_id, None)
            if taken is not None:
                self._calls[ctx.intent_id] = taken
            seeded = self._seeding.pop(ctx.intent_id, [])
        self.store.mark_seeded(seeded)

    def within_observed(self, ctx: CallContext, tx: HotTx) -> None:
        with self._lock:
            held = self._calls.get(ctx.intent_id)
        if held is not None and not held.on_checkin:
            self.store.release_on(tx, held.ticket.ticket)

    def after_observed(self, ctx: CallContext) -> None:
        with self._lock:
            held = self._calls.pop(ctx.intent_id, None)
        if held is not None and not held.on_checkin:
            with held.ticket.lock:
                held.ticket.released = True  # given back with `observed`

    def after_call(self, ctx: CallContext, error: BaseException | None) -> None:
        with self._lock:
            self._pending.pop(ctx.intent_id, None)
            self._seeding.pop(ctx.intent_id, None)
            self._opened_unslotted.discard(ctx.intent_id)
            held = self._calls.pop(ctx.intent_id, None)
        self.store.line.leave(ctx.intent_id)
        if held is not None and not held.on_checkin:
            held.ticket.release()

    def _hook(self, connector: Connector) -> None:
        engine = connector.engine
        if engine in self._hooked:
            return
        with self._lock:
            if not sa.event.contains(engine, "checkin", _on_checkin):
                sa.event.listen(engine, "checkin", _on_checkin)
            self._hooked.add(engine)


def _idle_in_pool(connector: Connector) -> bool:
    """Whether the connector's pool has a session to hand out without opening one."""
    checkedin = getattr(connector.engine.pool, "checkedin", None)
    return bool(checkedin()) if callable(checkedin) else False


def budgets_of(owner: HasHooks) -> SessionBudgets:
    found = owner.hooks.find(SessionBudgets)
    if found is None:
        raise LookupError("this executor has no session-budgets hook")
    return found


def slot_store(owner: HasHooks) -> SlotStore:
    return budgets_of(owner).store


@contextlib.contextmanager
def holding(owner: HasHooks, connector: Connector, count: int,
            case_id: str | None = None) -> Iterator[list[Connection]]:
    """Hold ``count`` budgeted sessions open (tests, tools): a busy neighbour on demand.

    With ``case_id`` the sessions count against that case's budget too.
    """
    budgets = budgets_of(owner)
    conns: list[Connection] = []
    try:
        for _ in range(count):
            if case_id is None:
                conns.append(budgets.open_session(connector, None, connector.engine.connect))
            else:
                conns.append(budgets.open_for_case(connector, case_id))
            conns[-1].execute(sa.text(connector.dialect.ping_sql))
            conns[-1].rollback()
        yield conns
    finally:
        for conn in conns:
            conn.close()
