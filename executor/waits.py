"""The wait line: a call that finds a target claimed or a session budget full waits its turn.

Two cases never write one impact key at once (:mod:`executor.claims`), and a
connector never opens more sessions than its budget (:mod:`executor.budget`).
Both are decided in the ``prepared`` transaction, all or nothing.  When that
transaction finds a key held by another case's call, or no free slot, the call
does not have to be refused at once: it may wait -- outside every transaction,
holding nothing, the target's transaction rolled back -- for a bounded time
(``claim_wait_seconds``, ``budget_wait_seconds``), then prepare again.

Waiting is *fair* and *bounded*:

* A call that waits takes a **turn**: a number from the store's ``wait_seq``
  counter (``cg_meta``), which only grows, and a row in ``cg_waits`` per
  resource it waits for (``claim:<impact key>``, ``slot:<budget scope>``).
  The row lives ``ROW_TTL`` seconds and is renewed while the call waits, so a
  waiter that died stops holding its place within seconds.
* A free key or slot goes to the **earliest live turn** that wants it: the
  statements that take a key or a slot (the claim upsert, the slot update)
  carry ``NOT EXISTS (an earlier live turn for this resource)`` -- a call that
  has not waited has no turn and comes after every waiter.  So a hot target
  is served in order of arrival, across every process sharing the ledger, and
  a waiter is never overtaken by later calls.  The order is global (one
  counter), so the earliest waiter is first in every line it stands in: no two
  waiters can each hold a place the other needs.
* A call keeps its place in the line of every impact key it has waited for
  until it prepared (those keys are owed to it), and stands in a budget's line
  only while it waits for a slot: a session budget is never held idle for a
  call that is waiting for a key.
* Each wait ends at its limit; the call is then refused with the coded reason
  it waited for (``CG320``/``CG330`` for a key, ``CG321`` for a slot), and its
  rows go.

Nothing here weakens a claim: a key is still taken only by the claim upsert,
in ``prepared``, with a new fencing token when it changes hands; the line only
decides *who may try*.  The call's rows are removed in the transaction that
records ``prepared`` (or when the call ends).
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from capgate.registry.errors import LedgerError

if TYPE_CHECKING:
    from capgate.executor.ledger import Ledger
    from capgate.executor.ledger.backends import HotTx

__all__ = ["NO_TURN", "ROW_TTL", "Ready", "WaitLine", "claim_resource", "earlier_turn_sql",
           "line_for", "slot_resource"]

NO_TURN = 2 ** 62
"""The turn of a call that has not waited: after every waiter."""

ROW_TTL = 5.0
"""How long a waiter's place lives without renewal (seconds, the store's clock)."""

RENEW_EVERY = 1.0
"""How often a waiter renews its places."""

_POLL_FIRST = 0.005
_POLL_MAX = 0.05

Ready = Callable[["HotTx"], bool]
"""Whether a resource is free for the waiting call (its line aside): a read in ``tx``."""


def claim_resource(impact_key: str) -> str:
    return f"claim:{impact_key}"


def slot_resource(scope: str) -> str:
    return f"slot:{scope}"


def earlier_turn_sql(now_sql: str, resource: str = ":wres", turn: str = ":turn") -> str:
    """``TRUE`` when no live turn earlier than ``turn`` waits for ``resource`` (SQL)."""
    return (f"NOT EXISTS (SELECT 1 FROM cg_waits w WHERE w.resource = {resource}"
            f" AND w.seq < {turn} AND w.expires_at > {now_sql})")


@dataclass
class _Turn:
    """One waiting call (or one session's wait outside a call) and its places in line."""

    key: str
    case_id: str | None
    intent_id: str | None
    seq: int | None = None
    rows: set[str] = field(default_factory=set)
    """Resources this turn has a row for (as committed)."""
    owed: set[str] = field(default_factory=set)
    """Impact keys it has waited for: its place there is kept until it prepared."""
    started: dict[str, float] = field(default_factory=dict)
    """kind (``claim``/``slot``) -> when it first waited for one (monotonic)."""
    left_in: int = 0
    """The transaction that already removed its places (``id``)."""


class WaitLine:
    """``cg_waits`` in one ledger store, and this process's waiting calls."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.now_sql = ledger.sql_now
        self._turns: dict[str, _Turn] = {}
        self._lock = threading.Lock()
        self._holder = f"{socket.gethostname()}:{os.getpid()}"
        self._earlier = ("SELECT 1 FROM cg_waits WHERE resource = :r AND seq < :s"
                         f" AND expires_at > {self.now_sql} LIMIT 1")

    # --- what the taking statements need

    def turn_of(self, key: str | None) -> int:
        """The turn to bind as ``:turn`` when ``key`` (an intent id) takes something."""
        if key is None:
            return NO_TURN
        with self._lock:
            turn = self._turns.get(key)
        return turn.seq if turn is not None and turn.seq is not None else NO_TURN

    def waited(self, key: str, kind: str) -> float:
        """Seconds since ``key`` first waited for ``kind`` (0: it has not)."""
        with self._lock:
            turn = self._turns.get(key)
            started = turn.started.get(kind) if turn is not None else None
        return 0.0 if started is None else time.monotonic() - started

    # --- waiting

    def wait(self, key: str, *, kind: str, resources: Mapping[str, Ready], limit: float,
             case_id: str | None = None, intent_id: str | None = None) -> bool:
        """Stand in line for ``resources`` until each is free for this turn (True), or
        until ``limit`` seconds after this call first waited for ``kind`` (False).

        Holds no lock and no transaction while it waits: one short read per poll
        and, every :data:`RENEW_EVERY` seconds, one write renewing its places.
        """
        with self._lock:
            turn = self._turns.setdefault(key, _Turn(key, case_id, intent_id))
            started = turn.started.setdefault(kind, time.monotonic())
            if kind == "claim":
                turn.owed |= set(resources)
            keep = turn.owed | set(resources)
        deadline = started + max(0.0, limit)
        if time.monotonic() >= deadline:  # no wait left (or none allowed): one look, no place
            ready = self._ready(turn.seq if turn.seq is not None else NO_TURN, resources)
            if not ready:
                self.drop(key)
            return ready
        self._enter(turn, keep)
        renewed = time.monotonic()
        pause = _POLL_FIRST
        while True:
            assert turn.seq is not None
            if self._ready(turn.seq, resources):
                return True
            now = time.monotonic()
            if now >= deadline:
                # refused next: its places go now, not when the call ends -- a place held
                # by a call that is no longer waiting would hold back everyone after it
                self.drop(key)
                return False
            if now - renewed >= RENEW_EVERY:
                self._renew(turn)
                renewed = now
            time.sleep(min(pause * (0.5 + random.random()), max(0.0, deadline - now)))
            pause = min(pause * 1.5, _POLL_MAX)

    def stand(self, key: str, resources: list[str], *, case_id: str | None = None,
              intent_id: str | None = None) -> int:
        """Take a place in the line of each of ``resources`` without waiting (its turn)."""
        with self._lock:
            turn = self._turns.setdefault(key, _Turn(key, case_id, intent_id))
            keep = turn.rows | set(resources)
        self._enter(turn, keep)
        assert turn.seq is not None
        return turn.seq

    def _enter(self, turn: _Turn, keep: set[str]) -> None:
        """Take a turn (once) and hold a place for each of ``keep``, and no other."""
        now = self.now_sql
        with self.ledger.transaction("stand in the wait line") as tx:
            if turn.seq is None:
                tx.run("INSERT INTO cg_meta (key, value) VALUES ('wait_seq', '0')"
                       " ON CONFLICT (key) DO NOTHING")
                row = tx.run("UPDATE cg_meta SET value = CAST(CAST(value AS BIGINT) + 1 AS TEXT)"
                             " WHERE key = 'wait_seq' RETURNING value").first()
                assert row is not None
                seq = int(row[0])
                tx.run(f"DELETE FROM cg_waits WHERE expires_at < {now} - 60")
            else:
                seq = turn.seq
            for resource in sorted(turn.rows - keep):
                tx.run("DELETE FROM cg_waits WHERE resource = :r AND seq = :s",
                       {"r": resource, "s": seq})
            for resource in sorted(keep):
                tx.run("INSERT INTO cg_waits (resource, seq, case_id, intent_id, holder,"
                       f" enqueued_at, expires_at) VALUES (:r, :s, :c, :i, :h, {now},"
                       f" {now} + :ttl) ON CONFLICT (resource, seq) DO UPDATE SET"
                       " expires_at = excluded.expires_at",
                       {"r": resource, "s": seq, "c": turn.case_id, "i": turn.intent_id,
                        "h": self._holder, "ttl": ROW_TTL})
        with self._lock:
            turn.seq = seq
            turn.rows = set(keep)

    def _renew(self, turn: _Turn) -> None:
        with self.ledger.transaction("renew places in the wait line") as tx:
            tx.run(f"UPDATE cg_waits SET expires_at = {self.now_sql} + :ttl WHERE seq = :s",
                   {"s": turn.seq, "ttl": ROW_TTL})

    def _ready(self, seq: int, resources: Mapping[str, Ready]) -> bool:
        with self.ledger.transaction("look at the wait line", write=False) as tx:
            for resource, free in resources.items():
                if tx.run(self._earlier, {"r": resource, "s": seq}).first() is not None:
                    return False
                if not free(tx):
                    return False
        return True

    # --- leaving the line

    def leave_on(self, tx: HotTx, key: str) -> None:
        """In the transaction that records ``prepared``: this call's places go with it."""
        with self._lock:
            turn = self._turns.get(key)
            if turn is None or turn.seq is None or not turn.rows or turn.left_in == id(tx):
                return
            turn.left_in = id(tx)  # the budget's and the claims' hook both ask: once
        tx.run("DELETE FROM cg_waits WHERE seq = :s", {"s": turn.seq})

    def prepared(self, key: str) -> None:
        """``prepared`` committed (with :meth:`leave_on`'s delete): forget the turn."""
        with self._lock:
            self._turns.pop(key, None)

    def got(self, key: str, resource: str) -> None:
        """A slot was taken outside ``prepared``: its place in that line goes."""
        with self._lock:
            turn = self._turns.get(key)
            if turn is None or resource not in turn.rows:
                return
        with self.ledger.transaction("leave a wait line") as tx:
            tx.run("DELETE FROM cg_waits WHERE resource = :r AND seq = :s",
                   {"r": resource, "s": turn.seq})
        with self._lock:
            turn.rows.discard(resource)

    def drop(self, key: str) -> None:
        """Every place ``key`` holds goes (its waits so far still count against its limits;
        a later wait takes a new turn, after everyone already in line)."""
        with self._lock:
            turn = self._turns.get(key)
            if turn is None or turn.seq is None:
                return
            seq, turn.seq, turn.rows, turn.owed = turn.seq, None, set(), set()
        try:
            with self.ledger.transaction("leave the wait line") as tx:
                tx.run("DELETE FROM cg_waits WHERE seq = :s", {"s": seq})
        except LedgerError:
            pass  # the places expire on their own within ROW_TTL

    def leave(self, key: str) -> None:
        """The call ended (refused, or done): every place it still holds goes."""
        self.drop(key)
        with self._lock:
            self._turns.pop(key, None)


_LINES: weakref.WeakKeyDictionary[Ledger, WaitLine] = weakref.WeakKeyDictionary()
_LINES_LOCK = threading.Lock()


def line_for(ledger: Ledger) -> WaitLine:
    """The wait line of ``ledger``, one per ledger object (its claims and budgets share it)."""
    with _LINES_LOCK:
        line = _LINES.get(ledger)
        if line is None:
            line = _LINES[ledger] = WaitLine(ledger)
        return line
