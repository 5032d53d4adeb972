"""The durable, hash-chained ledger: every boundary of every call, per case.

Why it exists: capgate must be able to say, after any crash, what it intended,
what it attempted and what it observed -- and an operator must be able to trust
that record.  So each boundary is an *event* appended to a per-case chain (each
event carries its predecessor's digest, see :mod:`executor.ledger.chain`), and
the case's *snapshot* (``fold(events)``) is rewritten in the same local
transaction, so the two can never disagree unless someone edits the store by
hand -- which :meth:`Ledger.verify` then reports instead of loading.

Two backends, one code path (SQLAlchemy Core; quirks in
:mod:`executor.ledger.backends`):

* SQLite (the embedded default): a file in WAL mode with ``synchronous=FULL``;
  writers serialise on ``BEGIN IMMEDIATE``.
* PostgreSQL (shared between processes and machines, psycopg 3): writers
  serialise on the case row (compare-and-swap, or ``SELECT ... FOR UPDATE``
  after a lost race); the primary key on ``(case_id, seq)`` makes a forked
  chain impossible even if that logic were wrong.

Round trips on PostgreSQL, because an append sits on the hot path of every
call (three appends per call): an append whose case head this process last
wrote, read (:meth:`Ledger.snapshot`) or verified is *one* statement in
autocommit mode -- one round trip, one commit.  Otherwise it reads the head
first (two).  After a lost race it takes the row lock (four more: BEGIN,
SELECT FOR UPDATE, the write, COMMIT).  The process-local head cache is never
trusted: the write only lands if the stored head (seq, digest and snapshot
text) is still exactly the cached one, so a stale cache costs a round trip,
never a fork, and an edited snapshot is carried forward for ``verify`` to
find, never silently repaired.  On SQLite every append is one ``BEGIN
IMMEDIATE`` transaction in-process; its cost is the WAL fsync.

A lost connection is not a lost append.  If the reply to an append never
arrives, the append retries on a fresh connection, and every retry first looks
for the digest of what it already sent (each attempt's digest is unique, since
it covers ``recorded_at``): an event is recorded once, never twice, even when
the server committed and the client never heard.  Reads and the repeatable
writes below are simply re-run after a disconnect.

The same store keeps idempotency claims, plans and approvals, whose
single-use and first-writer-wins rules are enforced by unique keys and
conditional updates, so they hold across processes too.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Final, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from capgate.executor.ledger.backends import (
    Backend,
    HotConnections,
    HotDisconnect,
    HotResult,
    HotTx,
    LedgerBounds,
    NewHead,
    StoredHead,
    backend_for,
    operation,
)
from capgate.executor.ledger.chain import (
    FINDING_KINDS,
    GENESIS_DIGEST,
    RESERVED_INTENT_KEYS,
    TERMINAL_STATUSES,
    CaseRow,
    ClosedLookup,
    Event,
    Finding,
    apply_event,
    canonical_text,
    check_case,
    digest_of,
    empty_state,
    event_digest,
    event_digest_of_text,
    fold,
    format_time,
    head_mac,
    head_matches,
    intent_states,
    is_open_status,
    normalise_payload_text,
    parse_time,
    snapshot_text,
    state_digest,
    state_parts,
)
from capgate.executor.ledger.migrate import (
    MigrationReport,
    check_revision,
    current_revision,
    stamp_head,
)
from capgate.executor.ledger.migrate import upgrade as upgrade_tables
from capgate.executor.ledger.schema import (
    HEAD_REVISION,
    anchors,
    approval_proofs,
    approvals,
    cases,
    events,
    idempotency,
    metadata,
    plans,
)
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import (
    AnchorMismatch,
    ApprovalExpired,
    ApprovalNotAuthenticated,
    ApprovalRequired,
    ApprovalUsed,
    AttemptSuperseded,
    CapgateError,
    ConfigError,
    IdempotencyConflict,
    LedgerError,
    LedgerNotMigrated,
    LedgerTampered,
    SelfApproval,
    UnknownCase,
    UnknownIntent,
    UnknownPlan,
)
from capgate.registry.excerpt import excerpt
from capgate.registry.names import name_problem

__all__ = [
    "FINDING_KINDS",
    "GENESIS_DIGEST",
    "HMAC_KEY_ENV",
    "RESERVED_INTENT_KEYS",
    "TERMINAL_STATUSES",
    "Anchor",
    "ApprovalRecord",
    "CaseSummary",
    "Event",
    "Finding",
    "IdempotencyRecord",
    "KeyAlreadyClaimed",
    "KeyClaim",
    "Ledger",
    "PlanRecord",
    "RekeyReport",
    "VerifiedCase",
    "VerifyReport",
    "apply_event",
    "digest_of",
    "empty_state",
    "event_digest",
    "fold",
    "head_mac",
    "intent_states",
    "is_open_status",
    "open_ledger",
    "state_digest",
]

HMAC_KEY_ENV: Final = "CAPGATE_LEDGER_HMAC_KEY"
"""Environment variable holding the chain-head HMAC key (utf-8) when none is passed."""

_MAX_ATTEMPTS = 8
_RECONNECTS = 3
_HEAD_CACHE_SIZE = 4096
_CHUNK = 500
"""Most case ids in one ``IN (...)`` list."""

EventSpec = tuple[str, Mapping[str, Any], str | None]
"""``(kind, payload, intent_id)`` for :meth:`Ledger.append_many`."""
_Spec = tuple[str, dict[str, Any], str | None, str]
"""An EventSpec normalised: ``(kind, payload, intent_id, payload as canonical text)``."""
Guard = Callable[[Mapping[str, Any] | None], None]
"""Sees the case state an append follows (None: a new case); refuses by raising."""


@dataclass(frozen=True, slots=True)
class KeyClaim:
    """An idempotency key to claim atomically with the events of an append.

    The claim row and the events commit together or not at all: an intent
    owns its key exactly when its ``prepared`` event exists, so no claim is
    ever left behind by a call that was refused before it prepared, and two
    identical calls racing each other can never both prepare.
    """

    key: str
    intent_id: str
    fingerprint: str
    operation_id: str
    version: int


class KeyAlreadyClaimed(Exception):
    """Internal: the append's idempotency key is owned by another intent; nothing was written.

    ``record`` names the owner.  The executor turns this into a replay of the
    owner's outcome, a wait for it, or a refusal -- never a second execution.
    """

    def __init__(self, record: IdempotencyRecord) -> None:
        super().__init__(f"idempotency key {record.idem_key!r} is owned by {record.intent_id}")
        self.record = record


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _reconnecting(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run an idempotent operation again when it failed only because a connection died.

    SQLAlchemy invalidates the whole pool on a disconnect (a server restart, a
    failover), so the second run gets a fresh connection.  Only operations that
    are safe to repeat wear this: reads, and writes whose repetition returns
    what the first run did (claims, plan records, approval consumption).
    """

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        store = args[0]
        assert isinstance(store, Ledger)
        with operation(store._backend.bounds.wait_seconds):  # the tries share one deadline
            for attempt in range(_RECONNECTS):
                try:
                    return method(*args, **kwargs)
                except LedgerError as err:
                    if not err.details.get("connection_lost") or attempt == _RECONNECTS - 1:
                        raise
        raise AssertionError("unreachable")

    return run


# --- results ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaseSummary:
    """One case as ``capgate ledger show`` and ``resume`` list it."""

    case_id: str
    head_seq: int
    head_digest: str
    updated_at: datetime
    statuses: Mapping[str, str] = field(hash=False)
    """Open intent id -> status (its last event kind); the snapshot holds open intents only."""
    open: bool
    """True when any intent is not in :data:`TERMINAL_STATUSES` (or the snapshot is unreadable)."""

    @property
    def open_intents(self) -> list[str]:
        return sorted(i for i, s in self.statuses.items() if is_open_status(s))


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :meth:`Ledger.verify` found.  It lists tampering; it never raises for it."""

    cases_checked: int
    events_checked: int
    findings: tuple[Finding, ...]
    mac_checked: bool
    """Whether an HMAC key was configured, so that whole-chain rewrites were detectable."""

    @property
    def ok(self) -> bool:
        return not self.findings

    def kinds(self, case_id: str | None = None) -> set[str]:
        """The finding kinds, optionally for one case (handy for assertions and summaries)."""
        return {f.kind for f in self.findings if case_id is None or f.case_id == case_id}

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "cases_checked": self.cases_checked,
            "events_checked": self.events_checked,
            "mac_checked": self.mac_checked,
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass(frozen=True, slots=True)
class VerifiedCase:
    """A case whose chain, head, snapshot (and MAC, with a key) verified just now."""

    case_id: str
    events: tuple[Event, ...]
    snapshot: Mapping[str, Any] = field(hash=False)

    @property
    def head_seq(self) -> int:
        return self.events[-1].seq

    @property
    def head_digest(self) -> str:
        return self.events[-1].digest


@dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    """The first claim of an idempotency key: which intent owns its outcome."""

    idem_key: str
    case_id: str
    intent_id: str
    fingerprint: str
    operation_id: str
    version: int
    created_at: datetime


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """A plan as first recorded under its hash."""

    plan_hash: str
    case_id: str
    requester: str
    plan: Mapping[str, Any] = field(hash=False)
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ApprovalRecord:
    """One single-use, expiring approval of one plan hash."""

    approval_id: str
    plan_hash: str
    approver: str
    role: str
    created_at: datetime
    expires_at: datetime
    used_by_intent: str | None
    used_at: datetime | None
    public_key: str | None = None
    """The key that signed it (``ed25519:...``); None for an unsigned approval."""
    signature: str | None = None
    expires_text: str = ""
    """``expires_at`` exactly as stored (and signed)."""

    @property
    def used(self) -> bool:
        return self.used_by_intent is not None

    def expired(self, now: datetime) -> bool:
        return now >= self.expires_at


# --- opening ------------------------------------------------------------------


def open_ledger(
    url: str | URL,
    *,
    hmac_key: bytes | None = None,
    clock: Callable[[], datetime] | None = None,
    migrating: bool = False,
    bounds: LedgerBounds | None = None,
) -> Ledger:
    """Open (creating its tables if missing) the ledger store at ``url``.

    A store whose tables are of another revision is refused
    (LedgerNotMigrated) unless ``migrating`` (``capgate ledger migrate``, which
    then calls :meth:`Ledger.migrate`).

    ``url`` is a SQLAlchemy URL: ``sqlite:///path/ledger.db`` (the parent
    folder is created) or ``postgresql://...`` (driven by psycopg 3).  With
    ``hmac_key`` None, the key is read from ``CAPGATE_LEDGER_HMAC_KEY`` (utf-8);
    without a key, heads are not signed and ``verify`` cannot detect a chain
    rewritten consistently end to end.  ``clock`` (tests) returns aware UTC
    datetimes for ``recorded_at`` and record times.

    Raises LedgerError (the URL shown without its password) when the store
    cannot be reached or prepared, ConfigError for an unusable key.
    """
    backend, parsed = backend_for(url)
    if bounds is not None:  # (the URL's capgate_* settings otherwise; LedgerBounds)
        backend.bounds = bounds
    key = _resolve_key(hmac_key)
    where = parsed.render_as_string(hide_password=True)
    backend.prepare_location(parsed, where)
    try:
        engine = backend.make_engine(parsed)
    except Exception as exc:
        raise LedgerError(
            f"cannot open the ledger at {where}: {_describe(exc, parsed)}", ledger=where
        ) from None
    try:
        with engine.begin() as conn:
            backend.lock_for_ddl(conn)
            revision = current_revision(conn)
            if revision is None:  # an empty database: the current tables, stamped
                metadata.create_all(conn, checkfirst=True)
                stamp_head(conn)
                revision = HEAD_REVISION
    except Exception as exc:
        engine.dispose()
        raise LedgerError(
            f"cannot open the ledger at {where}: {_describe(exc, parsed)}; check that the "
            "database is reachable and the user may create tables",
            ledger=where,
        ) from None
    if not migrating:
        try:
            check_revision(revision, where)
        except LedgerNotMigrated:
            engine.dispose()
            raise
    return Ledger(engine, backend, parsed, key=key, clock=clock)


def _resolve_key(hmac_key: bytes | None) -> bytes | None:
    if hmac_key is None:
        raw = os.environ.get(HMAC_KEY_ENV, "")
        return raw.encode("utf-8") if raw else None
    if not isinstance(hmac_key, bytes) or not hmac_key:
        raise ConfigError(
            "the ledger HMAC key must be non-empty bytes; pass None to read "
            f"{HMAC_KEY_ENV} or to run without signed heads"
        )
    return hmac_key


def _describe(exc: BaseException, url: URL) -> str:
    """A one-line reason for ``exc``, without SQL text and without the URL's password."""
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    text = f"{type(orig).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if url.password:
        text = text.replace(str(url.password), "***")
    return text


# --- the store ----------------------------------------------------------------


class Ledger:
    """A ledger store.  Thread-safe; open one per process with :func:`open_ledger`."""

    def __init__(
        self,
        engine: Engine,
        backend: Backend,
        url: URL,
        *,
        key: bytes | None,
        clock: Callable[[], datetime] | None,
    ) -> None:
        self._engine = engine
        self._backend = backend
        self._url = url
        self._key = key
        self._clock = clock or (lambda: datetime.now(UTC))
        self._read_one = engine.execution_options(**backend.single_read_options())
        self._read_many = engine.execution_options(**backend.consistent_read_options())
        self._write_one = (
            engine.execution_options(isolation_level="AUTOCOMMIT")
            if backend.single_statement_append
            else engine
        )
        self._hot = HotConnections(backend, url)
        self._head_sql = _HEAD + backend.row_lock
        """The case row's read on an append, locked where the store has row locks."""
        self._swap_sql = _SWAP_HEAD_OR_FAIL if backend.failing_swap else _SWAP_HEAD
        """An append's head swap: one that fails when it missed, where the store can."""
        self._heads: OrderedDict[str, StoredHead] = OrderedDict()
        self._verified: OrderedDict[str, StoredHead] = OrderedDict()
        self._states: OrderedDict[str, tuple[str, dict[str, Any], dict[str, str] | None]] = \
            OrderedDict()
        """case -> (snapshot text, its parsed state, its parts' texts): the state an append
        just built, so the next append on that head neither parses nor re-serialises it."""
        self._heads_lock = threading.Lock()
        self._pid = os.getpid()

    # -- housekeeping

    @property
    def url(self) -> str:
        """Where the store is, with any password hidden."""
        return self._url.render_as_string(hide_password=True)

    @property
    def backend(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._backend.name

    @property
    def engine(self) -> Engine:
        """The store's engine, for the coordination tables kept in the same store.

        Impact claims and session budgets (``executor.claims``, ``executor.budget``)
        live in ``cg_claims`` / ``cg_budget_slots`` next to the chain, so that
        every executor sharing this ledger shares them too.
        """
        return self._engine

    @property
    def signed(self) -> bool:
        """Whether chain heads are signed (and verified) with an HMAC key."""
        return self._key is not None

    def close(self) -> None:
        """Release the store's connections."""
        self._hot.close()
        self._engine.dispose()

    def transaction(self, action: str, *, durable: bool = True,
                    write: bool = True) -> contextlib.AbstractContextManager[HotTx]:
        """A transaction on the store's driver connection (claims, budgets: see backends).

        Driver errors become LedgerError naming ``action``.
        """
        return self._hot_guarded(action, durable=durable, write=write)

    @contextlib.contextmanager
    def _hot_guarded(self, action: str, *, durable: bool, write: bool) -> Iterator[HotTx]:
        with self._guard(action), self._hot.transaction(durable=durable, write=write) as tx:
            yield tx

    @property
    def sql_now(self) -> str:
        """The store's clock as epoch seconds, in its SQL (coordination expiries)."""
        return self._backend.now_sql

    @property
    def sql_greatest(self) -> str:
        return self._backend.greatest

    @property
    def sql_skip_locked(self) -> str:
        return self._backend.skip_locked

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r}, signed={self.signed})"

    @contextlib.contextmanager
    def _guard(self, action: str) -> Iterator[None]:
        """Turn driver errors into LedgerError; let capgate's own errors through.

        The block is one ledger operation (``backends.operation``): a PostgreSQL store
        that has not answered it within the bounds' ``wait_seconds`` is cut, and a
        LedgerError whose connection was lost says so (``connection_lost``).
        """
        if os.getpid() != self._pid:  # a forked child must not share pooled sockets
            self._engine.dispose(close=False)
            with self._heads_lock:
                self._heads.clear()
            self._pid = os.getpid()
        try:
            with operation(self._backend.bounds.wait_seconds):
                yield
        except CapgateError:
            raise
        except HotDisconnect as exc:
            raise LedgerError(
                f"could not {action} in the ledger at {self.url}: the connection was lost "
                f"({str(exc).splitlines()[0] if str(exc) else 'no reply'})", ledger=self.url,
                connection_lost=True,
            ) from exc
        except sa.exc.SQLAlchemyError as exc:
            raise LedgerError(
                f"could not {action} in the ledger at {self.url}: {_describe(exc, self._url)}",
                ledger=self.url, connection_lost=self._backend.is_connection_lost(exc),
            ) from exc
        except Exception as exc:
            if not self._backend.is_driver_error(exc):
                raise
            raise LedgerError(
                f"could not {action} in the ledger at {self.url}: {_describe(exc, self._url)}",
                ledger=self.url,
            ) from exc

    def _now(self, now: datetime | None = None) -> datetime:
        moment = now if now is not None else self._clock()
        format_time(moment)  # refuses naive datetimes
        return moment.astimezone(UTC)

    # -- head cache (process-local, always re-checked by the database)

    def _cached_head(self, case_id: str) -> StoredHead | None:
        with self._heads_lock:
            return self._heads.get(case_id)

    def _remember(self, case_id: str, head: StoredHead | None, *,
                  base: StoredHead | None = None, verified: bool = False) -> None:
        """Cache ``head``; it counts as verified when ``verified`` or when it was built on
        ``base`` and ``base`` was the verified head (our own append on a verified state)."""
        with self._heads_lock:
            if head is None:
                self._heads.pop(case_id, None)
                return
            self._heads[case_id] = head
            self._heads.move_to_end(case_id)
            while len(self._heads) > _HEAD_CACHE_SIZE:
                self._heads.popitem(last=False)
            if verified or (base is not None and self._verified.get(case_id) == base):
                self._verified[case_id] = head
                self._verified.move_to_end(case_id)
                while len(self._verified) > _HEAD_CACHE_SIZE:
                    self._verified.popitem(last=False)

    # -- appending

    def append(
        self,
        case_id: str,
        kind: str,
        payload: Mapping[str, Any],
        *,
        intent_id: str | None = None,
        claim: KeyClaim | None = None,
        within: Within | None = None,
        attempt: int | None = None,
        guard: Guard | None = None,
        durable: bool = True,
        continuing: bool = False,
    ) -> Event:
        """Record one event at the end of the case's chain (creating the case on seq 0).

        The event row, the new snapshot and the new head commit together or not
        at all; concurrent writers to one case (any process, any machine) are
        serialised, never forked.  With ``claim`` the idempotency key is claimed
        in the same transaction (KeyAlreadyClaimed: another intent owns it, and
        nothing was written).  ``within`` runs in that transaction too, after
        the claim and before the event (the executor's impact claims and
        approval consumption): whatever it raises undoes everything.  It may
        run more than once (a lost race is retried); each run but the
        committed one was rolled back.  ``attempt`` fences an executing attempt
        of ``intent_id``: the append is refused (AttemptSuperseded, nothing
        written) once resume or a person settled the intent or a newer attempt
        was recorded -- checked against the head the event is chained to, so
        no late event of a stale process can re-open a settled case.  ``guard``
        sees the case state the event follows (None: a new case), inside the
        transaction, and refuses by raising: the executor's "no open intent"
        check runs there, so it cannot race another writer.  Returns the event
        as stored.
        """
        fence = (intent_id, attempt) if attempt is not None and intent_id is not None else None
        return self.append_many(case_id, [(kind, payload, intent_id)], claim=claim,
                                within=within, fence=fence, guard=guard, durable=durable,
                                continuing=continuing)[0]

    def append_many(self, case_id: str, items: Sequence[EventSpec], *,
                    claim: KeyClaim | None = None,
                    within: Within | None = None,
                    fence: tuple[str, int] | None = None,
                    guard: Guard | None = None,
                    durable: bool = True,
                    continuing: bool = False) -> list[Event]:
        """Record several events, consecutively and atomically, in one transaction.

        ``durable=False`` commits without waiting for the disk (see
        :meth:`HotConnections.transaction`): for events whose loss in an
        operating-system crash is recovered from evidence (an ``observed``
        whose landing marker proves it).  ``continuing``: the events continue
        the case from its stored state, so that state is checked first, in
        O(1) (:func:`~executor.ledger.chain.head_matches`, and the head's MAC
        with a key) unless it is the head this process last verified or wrote
        on a verified state; LedgerTampered when it does not hold.
        """
        _check_id("case_id", case_id)
        specs: list[_Spec] = []
        for kind, payload, intent_id in items:
            _check_id("kind", kind)
            if intent_id is not None:
                _check_id("intent_id", intent_id)
            plain, text = normalise_payload_text(payload, intent_id=intent_id)
            specs.append((kind, plain, intent_id, text))
        if not specs:
            return []
        tried: dict[str, list[Event]] = {}
        with self._guard(f"append to case {case_id!r}"):
            for reconnect in range(_RECONNECTS):
                suspect = tried if reconnect else None
                try:
                    for _ in range(_MAX_ATTEMPTS):
                        written = self._append_once(case_id, specs, tried, suspect, claim,
                                                    within, fence, guard, durable, continuing)
                        if written is not None:
                            return written
                    raise LedgerError(
                        f"could not append to case {case_id!r} after {_MAX_ATTEMPTS} attempts "
                        "under contention; retry the call", case_id=case_id)
                except HotDisconnect as exc:
                    # The connection died; the write may have landed.  Try again on a
                    # fresh connection: every attempt first looks for what we already sent.
                    self._remember(case_id, None)
                    last_error: HotDisconnect = exc
        raise LedgerError(
            f"lost the connection to the ledger at {self.url} {_RECONNECTS} times while "
            f"appending to case {case_id!r} ({last_error}); whether the last attempt landed "
            f"is unknown: read `capgate ledger show {case_id}` before retrying",
            case_id=case_id,
            outcome="unknown",
            connection_lost=True,
        )

    def append_each(self, items: Sequence[tuple[str, str, Mapping[str, Any], str | None]], *,
                    chunk: int = 250, continuing: bool = True,
                    skip: tuple[type[Exception], ...] = ()) -> list[Event]:
        """Events of many cases -- ``(case_id, kind, payload, intent_id)`` -- committed
        together, ``chunk`` cases to a transaction; a case's events in the order given.

        For a writer that settles many cases at once (resume closing a thousand
        applied intents): each case's events are exactly what :meth:`append_many`
        would record (the same chain, snapshot and head, each case verified before
        it is continued), but one durable commit covers a chunk instead of one per
        case.  ``continuing`` as for :meth:`append_many` (by default every case is
        verified before it is continued, in O(1), unless this process verified its
        head last).  When anything in a chunk's transaction goes wrong (a head
        moved, a connection lost, a case that does not check out), the whole chunk
        is rolled back and its cases are appended one by one, each with its own
        errors -- so the outcome is never worse than appending them separately.
        ``skip``: errors of these types (one by one, after a chunk failed) leave that
        case's events out instead of raising, for events a writer records best effort.
        """
        by_case: dict[str, list[EventSpec]] = {}
        for case_id, kind, payload, intent_id in items:
            by_case.setdefault(case_id, []).append((kind, payload, intent_id))
        order = list(by_case)
        out: list[Event] = []
        for start in range(0, len(order), max(1, chunk)):
            part = order[start:start + max(1, chunk)]
            specs: list[tuple[str, list[_Spec]]] = []
            for case_id in part:
                _check_id("case_id", case_id)
                built: list[_Spec] = []
                for kind, payload, intent_id in by_case[case_id]:
                    _check_id("kind", kind)
                    if intent_id is not None:
                        _check_id("intent_id", intent_id)
                    plain, text = normalise_payload_text(payload, intent_id=intent_id)
                    built.append((kind, plain, intent_id, text))
                specs.append((case_id, built))
            try:
                with self._guard("append to many cases"):
                    out.extend(self._append_each_tx(specs, check=continuing))
                continue
            except (CapgateError, HotDisconnect, _HeadMoved, _ClaimLost):
                pass  # (a case that does not check out, a lost connection, a moved head)
            except Exception as exc:  # a driver error (a unique violation: an edited store)
                if not self._backend.is_driver_error(exc):
                    raise
            for case_id in part:  # one by one, errors and all
                try:
                    out.extend(self.append_many(case_id, by_case[case_id],
                                                continuing=continuing))
                except skip:
                    continue
        return out

    def _append_each_tx(self, specs: Sequence[tuple[str, list[_Spec]]], *,
                        check: bool) -> list[Event]:
        """The chunk of :meth:`append_each` in one transaction; raises on any trouble."""
        done: list[tuple[str, StoredHead | None, NewHead, HotResult]] = []
        written_all: list[Event] = []
        with self._hot.transaction(durable=True) as tx:
            # every head in one read, the case rows locked in one order (PostgreSQL: two
            # batches never deadlock); then every head swap and event insert sent
            # together (pipelined on PostgreSQL), their results read once at the end
            ordered = sorted(specs, key=lambda s: s[0])
            heads = self._read_heads(tx, [case_id for case_id, _ in ordered], check=check)
            for case_id, case_specs in ordered:
                head = heads.get(case_id)
                new, written, rows = self._build(case_id, head, case_specs, None,
                                                 self._closed_in(tx, case_id))
                if head is None:
                    result = tx.run(_CREATE_CASE, _head_params(new))
                else:
                    result = tx.run(_SWAP_HEAD, {**_head_params(new), "old_seq": head.seq,
                                                 "old_digest": head.digest,
                                                 "old_snapshot": head.snapshot})
                tx.run_many(_INSERT_EVENT, rows)
                done.append((case_id, head, new, result))
                written_all.extend(written)
            for _, head, _, result in done:
                ok = result.first() is not None if head is None else result.rowcount == 1
                if not ok:
                    raise _HeadMoved
        for case_id, head, new, _ in done:
            self._remember(case_id, StoredHead(new.seq, new.digest, new.snapshot), base=head,
                           verified=head is None)
        return written_all

    def _append_once(
        self,
        case_id: str,
        specs: list[_Spec],
        tried: dict[str, list[Event]],
        suspect: dict[str, list[Event]] | None,
        claim: KeyClaim | None,
        within: Within | None,
        fence: tuple[str, int] | None,
        guard: Guard | None,
        durable: bool,
        continuing: bool,
    ) -> list[Event] | None:
        """One transaction; None when the head moved under a cached head (try again).

        With a head this process wrote or read last (and, when ``continuing``,
        verified), the transaction builds on it without reading it: the head
        update compares-and-swaps it, and a head that moved meanwhile makes the
        attempt roll back and read it.  SQLite writers hold the file's write
        lock (``BEGIN IMMEDIATE``); PostgreSQL writers lock the case row.
        """
        cached = None if suspect else self._cached_head(case_id)
        if cached is not None and continuing and not self._is_verified(case_id, cached):
            cached = None
        try:
            written = self._append_tx(case_id, specs, tried, suspect, claim, within, fence,
                                      guard, durable, continuing, cached)
        except _HeadMoved:
            self._remember(case_id, None)  # another writer moved it: read it, then again
            return None
        except _CreateRaced:
            # Two writers created the case at once (PostgreSQL: no row to lock yet): the
            # other one's row is there now, so this one continues it.  With no row, events
            # exist without their case -- the store was edited.
            with self._hot.transaction(write=False) as tx:
                if tx.run(_HEAD, {"case_id": case_id}).first() is None:
                    raise self._damaged(tx, case_id) from None
            self._remember(case_id, None)
            return None
        except _ClaimLost as lost:
            owner = self.get_idempotency(lost.key)
            if owner is None:
                return None  # released meanwhile (never: a claim is kept for good); again
            raise KeyAlreadyClaimed(owner) from None
        except Exception as exc:
            if self._backend.is_missed_swap(exc):
                self._remember(case_id, None)  # the failing swap missed: read it, then again
                return None
            if not self._backend.is_unique_violation(exc):
                raise
            if cached is not None:  # the head moved on past the cached one: read it, again
                self._remember(case_id, None)
                return None
            # an event at a seq the locked head says is free: the store was edited
            with self._hot.transaction(write=False) as tx:
                raise self._damaged(tx, case_id) from None
        return written

    def _append_tx(
        self,
        case_id: str,
        specs: list[_Spec],
        tried: dict[str, list[Event]],
        suspect: dict[str, list[Event]] | None,
        claim: KeyClaim | None,
        within: Within | None,
        fence: tuple[str, int] | None,
        guard: Guard | None,
        durable: bool,
        continuing: bool,
        cached: StoredHead | None,
    ) -> list[Event]:
        creating: list[bool] = []  # set when no case row was there: this append creates it
        with self._creation_raced(creating), self._hot.transaction(durable=durable) as tx:
            if cached is not None:
                head: StoredHead | None = cached
            else:
                head = self._read_head(tx, case_id, check=continuing)
                landed = _landed_hot(tx, case_id, suspect)
                if landed is not None:
                    return landed
            if head is None:
                creating.append(True)
            # The key's claim, the hooks' statements (budget slot, impact claims), the head
            # swap and the events are queued, and their results read together (PostgreSQL:
            # one round trip for them all); the decisions are taken in the order they
            # always were -- a key another intent owns answers first, whatever else refuses.
            claimed = tx.run(_CLAIM_KEY, self._claim_row(case_id, claim)) \
                if claim is not None else None

            def key_first() -> None:
                if claim is not None and claimed is not None and claimed.first() is None:
                    raise _ClaimLost(claim.key)

            try:
                if guard is not None:  # before anything is claimed: a refusal claims nothing
                    try:
                        guard(self._state_of(case_id, head.snapshot)[0] if head else None)
                    except CapgateError:
                        if cached is not None:
                            raise _HeadMoved from None  # refuse only on the stored state
                        raise
                if within is not None:
                    within(tx)
                new, written, rows = self._build(case_id, head, specs, fence,
                                                 self._closed_in(tx, case_id))
                tried[new.digest] = written
                if head is None:
                    created = tx.run(_CREATE_CASE, _head_params(new))
                else:
                    swapped = tx.run(self._swap_sql, {**_head_params(new),
                                                      "old_seq": head.seq,
                                                      "old_digest": head.digest,
                                                      "old_snapshot": head.snapshot})
                tx.run_many(_INSERT_EVENT, rows)
                key_first()
                tx.settle()
            except Exception as exc:  # a refusal (the guard's, a hook's): a lost key first
                if not isinstance(exc, _HeadMoved | HotDisconnect) \
                        and not self._backend.is_driver_error(exc):
                    key_first()  # an identical call prepared first: its execution answers
                raise
            if head is None:
                ok = created.first() is not None
            else:  # a failing swap that missed aborts the transaction (see _append_once)
                ok = self._backend.failing_swap or swapped.rowcount == 1
            if not ok:
                raise _HeadMoved
        self._remember(case_id, StoredHead(new.seq, new.digest, new.snapshot), base=head,
                       verified=head is None)
        return written

    @contextlib.contextmanager
    def _creation_raced(self, creating: list[bool]) -> Iterator[None]:
        """A key refused while the append creates its case is :class:`_CreateRaced`:
        another writer created the case meanwhile, or the store lost the case row
        (:meth:`_append_once` tells which)."""
        try:
            yield
        except Exception as exc:
            if creating and self._backend.is_unique_violation(exc):
                raise _CreateRaced from exc
            raise

    def _read_heads(self, tx: HotTx, case_ids: Sequence[str], *,
                    check: bool) -> dict[str, StoredHead]:
        """Several case rows in one read (locked on PostgreSQL), each verified when
        ``check`` unless it is the head this process verified last (see :meth:`_read_head`)."""
        names = {f"c{i}": case_id for i, case_id in enumerate(case_ids)}
        sql = (f"SELECT case_id, head_seq, head_digest, snapshot, head_mac FROM cg_cases"
               f" WHERE case_id IN ({', '.join(':' + n for n in names)}) ORDER BY case_id")
        sql += tx.backend.row_lock
        heads: dict[str, StoredHead] = {}
        for row in tx.run(sql, names).all():
            case_id = str(row[0])
            head = StoredHead(int(row[1]), str(row[2]), str(row[3]))
            if check and not self._is_verified(case_id, head):
                self._check_head(tx, case_id, head, row[4])
            self._remember(case_id, head, verified=check)
            heads[case_id] = head
        return heads

    def _read_head(self, tx: HotTx, case_id: str, *, check: bool) -> StoredHead | None:
        """The case row (locked on PostgreSQL), verified when ``check`` and not trusted."""
        row = tx.run(self._head_sql, {"case_id": case_id}).first()
        if row is None:
            return None
        head = StoredHead(int(row[0]), str(row[1]), str(row[2]))
        if check and not self._is_verified(case_id, head):
            self._check_head(tx, case_id, head, row[3])
        self._remember(case_id, head, verified=check)
        return head

    def _check_head(self, tx: HotTx, case_id: str, head: StoredHead,
                    mac: str | None) -> None:
        """The O(1) continuation check, inside the append's own transaction."""
        found = tx.run(_HEAD_EVENT, {"case_id": case_id, "seq": head.seq}).first()
        event = _event_from_values(found) if found is not None else None
        state = _parse_snapshot(case_id, head.snapshot)
        if event is not None and event.state_digest is None:
            why = self._format1_problem(tx, case_id, head, mac)  # a migrated format-1 head
        else:
            why = "the head event is missing" if event is None else head_matches(
                state, event, head.seq, head.digest)
        if why is None and self._key is not None and (
                mac is None or not hmac.compare_digest(mac, head_mac(self._key, head.digest))):
            why = "the head's MAC does not match under the configured key"
        if why is not None:
            raise LedgerTampered(
                f"case {case_id!r} cannot be continued: {why}; run `capgate ledger verify "
                f"--case {case_id}` and do not continue the case until the cause is "
                "understood", case_id=case_id,
                findings=[Finding(case_id, head.seq, "snapshot_mismatch", why).to_dict()])

    def _format1_problem(self, tx: HotTx, case_id: str, head: StoredHead,
                         mac: str | None) -> str | None:
        """A head written by format 1 records no state digest: replay the chain once."""
        chain = [_event_from_values(r) for r in tx.run(_CASE_EVENTS, {"case_id": case_id}).all()]
        findings = check_case(case_id, chain, CaseRow(head.snapshot, head.seq, head.digest, mac),
                              self._key)
        return None if not findings else ", ".join(sorted({f.kind for f in findings}))

    def _is_verified(self, case_id: str, head: StoredHead) -> bool:
        with self._heads_lock:
            return self._verified.get(case_id) == head

    @staticmethod
    def _closed_in(tx: HotTx, case_id: str) -> ClosedLookup:
        """A closed intent's full state, from its events by index, in ``tx``."""
        def lookup(intent_id: str) -> dict[str, Any] | None:
            rows = tx.run(_INTENT_EVENTS, {"case_id": case_id, "intent_id": intent_id}).all()
            return intent_states([_event_from_values(r) for r in rows]).get(intent_id)
        return lookup

    def _claim_row(self, case_id: str, claim: KeyClaim | None) -> dict[str, Any] | None:
        if claim is None:
            return None
        return {"idem_key": claim.key, "case_id": case_id, "intent_id": claim.intent_id,
                "fingerprint": claim.fingerprint, "operation_id": claim.operation_id,
                "version": int(claim.version), "created_at": format_time(self._now())}

    def _damaged(self, tx: HotTx, case_id: str) -> LedgerTampered:
        """The error for an event key that exists although the case head says it cannot."""
        row = tx.run(_HEAD, {"case_id": case_id}).first()
        if row is None:
            finding = Finding(
                case_id, None, "case_missing", "events exist but the cg_cases row is missing"
            )
        else:
            finding = Finding(
                case_id,
                int(row[0]) + 1,
                "head_mismatch",
                f"an event with seq {int(row[0]) + 1} exists beyond the case head "
                f"(seq {row[0]})",
            )
        return LedgerTampered(
            f"cannot append to case {case_id!r}: {finding.detail}; run `capgate ledger verify "
            f"--case {case_id}` and do not continue the case until the cause is understood",
            case_id=case_id,
            findings=[finding.to_dict()],
        )

    def _build(
        self,
        case_id: str,
        head: StoredHead | None,
        specs: list[_Spec],
        fence: tuple[str, int] | None = None,
        closed: ClosedLookup | None = None,
        guard: Callable[[Mapping[str, Any] | None], None] | None = None,
    ) -> tuple[NewHead, list[Event], list[dict[str, Any]]]:
        """The events, rows and new head that follow ``head``: pure computation.

        ``closed`` gives the full state of an intent no longer in the snapshot
        (the fence of a settled intent, an event re-opening one).  ``guard``
        sees the state the events will follow and may refuse by raising.
        """
        recorded_at = format_time(self._clock())
        parts: dict[str, str] | None = None
        if head is None:
            _check_new_case_id(case_id)
            state: dict[str, Any] | None = None
            seq, prev = 0, GENESIS_DIGEST
        else:
            state, parts = self._state_of(case_id, head.snapshot)
            seq, prev = head.seq + 1, head.digest
        if guard is not None:
            guard(state)
        if fence is not None:
            _check_fence(case_id, state, *fence, closed=closed)
        written: list[Event] = []
        rows: list[dict[str, Any]] = []
        for kind, payload, intent_id, text in specs:
            draft = Event(case_id, seq, kind, intent_id, payload, prev, "", recorded_at)
            before = state
            try:
                state = apply_event(state, draft, closed)
            except (LedgerError, KeyError, TypeError, AttributeError) as exc:
                raise LedgerTampered(
                    f"the snapshot of case {case_id!r} has not the reducer's shape ({exc}); run "
                    f"`capgate ledger verify --case {case_id}`",
                    case_id=case_id,
                ) from None
            parts, after = state_parts(state, before, parts)
            digest = event_digest_of_text(
                case_id=case_id,
                seq=seq,
                kind=kind,
                intent_id=intent_id,
                payload_text=text,
                prev_digest=prev,
                recorded_at=recorded_at,
                state_digest=after,
            )
            state["head_digest"] = digest
            event = Event(case_id, seq, kind, intent_id, payload, prev, digest, recorded_at,
                          after)
            written.append(event)
            rows.append(
                {
                    "case_id": case_id,
                    "seq": seq,
                    "kind": kind,
                    "intent_id": intent_id,
                    "payload": text,
                    "prev_digest": prev,
                    "digest": digest,
                    "recorded_at": recorded_at,
                    "state_digest": after,
                }
            )
            seq, prev = seq + 1, digest
        last = written[-1]
        assert state is not None
        new = NewHead(
            case_id=case_id,
            seq=last.seq,
            digest=last.digest,
            mac=head_mac(self._key, last.digest) if self._key is not None else None,
            snapshot=snapshot_text(state, parts),
            updated_at=recorded_at,
        )
        self._keep_state(case_id, new.snapshot, state, parts)
        return new, written, rows

    def _state_of(self, case_id: str, text: str) -> tuple[dict[str, Any], dict[str, str] | None]:
        """The state a stored snapshot holds (and its parts' texts, when this process built
        it): from the cache when ``text`` is exactly the snapshot last built, else parsed.

        The state is shared, never mutated: :func:`apply_event` returns a new one.
        """
        with self._heads_lock:
            kept = self._states.get(case_id)
        if kept is not None and kept[0] == text:
            return kept[1], kept[2]
        return _parse_snapshot(case_id, text), None

    def _keep_state(self, case_id: str, text: str, state: dict[str, Any],
                    parts: dict[str, str] | None) -> None:
        with self._heads_lock:
            self._states[case_id] = (text, state, parts)
            self._states.move_to_end(case_id)
            while len(self._states) > _HEAD_CACHE_SIZE:
                self._states.popitem(last=False)

    # -- reading

    @_reconnecting
    def events(self, case_id: str, intent_id: str | None = None) -> list[Event]:
        """The case's events in seq order (empty for an unknown case).

        With ``intent_id``, only that intent's events (read by index).  Raises
        LedgerTampered if a stored payload is not JSON.
        """
        with self._guard(f"read case {case_id!r}"), self._read_one.connect() as conn:
            return _read_events(conn, case_id, intent_id)

    @_reconnecting
    def snapshot(self, case_id: str) -> dict[str, Any] | None:
        """The stored snapshot of the case (a fresh copy), or None for an unknown case.

        This is the fast read the executor uses; it is not verified -- use
        :meth:`load_verified` before continuing a case after a fault.
        """
        with self._guard(f"read case {case_id!r}"), self._read_one.connect() as conn:
            row = conn.execute(
                sa.select(cases.c.head_seq, cases.c.head_digest, cases.c.snapshot).where(
                    cases.c.case_id == case_id
                )
            ).first()
        if row is None:
            return None
        try:
            state: dict[str, Any] = json.loads(row.snapshot)
        except ValueError:
            raise LedgerTampered(
                f"the snapshot of case {case_id!r} is not JSON; run `capgate ledger verify "
                f"--case {case_id}`",
                case_id=case_id,
            ) from None
        self._remember(case_id, StoredHead(int(row.head_seq), row.head_digest, row.snapshot))
        return state

    @_reconnecting
    def verified_snapshot(self, case_id: str) -> dict[str, Any] | None:
        """The case's snapshot, trusted only after it verified (None for an unknown case).

        The executor continues a case from this, never from :meth:`snapshot`:
        a snapshot edited by hand (say, an open intent marked finished) raises
        LedgerTampered instead of letting the case continue.  One statement
        reads the case row and its head event together; the check is O(1)
        whatever the case's length (:func:`~executor.ledger.chain.head_matches`:
        the head event recomputes to the head digest, and the snapshot hashes
        to the state digest that event records; with a key, the head's MAC).
        A head this process last verified or wrote on a verified state needs no
        recomputation.  A case whose head event format 1 wrote is replayed once
        (:meth:`load_verified`).
        """
        with self._guard(f"read case {case_id!r}"), self._read_one.connect() as conn:
            row = conn.execute(_HEAD_WITH_EVENT, {"case_id": case_id}).first()
        if row is None:
            return None
        stored = StoredHead(int(row.head_seq), row.head_digest, row.snapshot)
        with self._heads_lock:
            trusted = self._verified.get(case_id) == stored
        if trusted:
            self._remember(case_id, stored)
            return _parse_snapshot(case_id, stored.snapshot)
        state = _parse_snapshot(case_id, stored.snapshot)
        head = _event_from_row(row) if row.seq is not None else None
        if head is not None and head.state_digest is None:
            return dict(self.load_verified(case_id).snapshot)  # a format-1 head
        why = "the head event is missing" if head is None else head_matches(
            state, head, stored.seq, stored.digest)
        if why is None and self._key is not None and (
                row.head_mac is None
                or not hmac.compare_digest(row.head_mac, head_mac(self._key, stored.digest))):
            why = "the head's MAC does not match under the configured key"
        if why is not None:
            raise LedgerTampered(
                f"case {case_id!r} cannot be continued: {why}; run `capgate ledger verify "
                f"--case {case_id}` and do not continue the case until the cause is "
                "understood", case_id=case_id,
                findings=[Finding(case_id, stored.seq, "snapshot_mismatch", why).to_dict()])
        self._remember(case_id, stored, verified=True)
        return state

    def intent(self, case_id: str, intent_id: str) -> dict[str, Any]:
        """One intent's full state (``status``, ``last_seq``, merged state), open or closed.

        An open intent is read from the snapshot; a closed one from its events,
        by index -- the one way every reader (idempotent replay, the resume
        fence, the poisoned-resume recheck, ``ledger show``, DDL replay) gets a
        settled intent's outcome.  Those events must hash to their digests
        (LedgerTampered otherwise); that they still belong to the chain is what
        ``verify`` establishes.
        """
        state = self.snapshot(case_id)
        if state is None:
            raise UnknownCase(f"no case {case_id!r} in the ledger", case_id=case_id)
        found = (state.get("intents") or {}).get(intent_id)
        if found is not None:
            return dict(found)
        own = self.events(case_id, intent_id)
        edited = [e.seq for e in own if digest_of(e) != e.digest]
        if edited:  # a naive edit of a settled outcome; a consistent rewrite is verify's
            raise LedgerTampered(
                f"the events of intent {intent_id} in case {case_id!r} (seq "
                f"{', '.join(map(str, edited))}) do not hash to their digests; run `capgate "
                f"ledger verify --case {case_id}`", case_id=case_id, intent_id=intent_id,
                findings=[Finding(case_id, seq, "payload_edited", "read by index").to_dict()
                          for seq in edited])
        folded = intent_states(own).get(intent_id)
        if folded is None:
            raise UnknownIntent(
                f"case {case_id!r} has no intent {intent_id!r}",
                case_id=case_id,
                intent_id=intent_id,
            )
        return folded

    def outcome_of(self, case_id: str, intent_id: str) -> dict[str, Any] | None:
        """The recorded outcome of a settled intent (None while it is open or has none)."""
        state = self.intent(case_id, intent_id)
        record = state.get("outcome_record")
        if is_open_status(str(state.get("status"))) or not isinstance(record, dict):
            return None
        return dict(record)

    def intents(self, case_id: str) -> dict[str, dict[str, Any]]:
        """Every intent of the case, open and closed, folded from its events (O(events))."""
        return intent_states(self.events(case_id))

    @_reconnecting
    def intents_many(self, case_ids: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
        """:meth:`intents` of many cases, their events read in chunks of 500 cases.

        Resume records a recovery point for each of a thousand cases it settled; one
        read per case was most of its time.  LedgerTampered as :meth:`events`.
        """
        wanted = list(dict.fromkeys(case_ids))
        out: dict[str, dict[str, dict[str, Any]]] = {}
        with self._guard("read cases"), self._read_one.connect() as conn:
            for i in range(0, len(wanted), _CHUNK):
                chains = _read_chains(conn, wanted[i:i + _CHUNK], _tampered_event)
                out.update((c, intent_states(chain)) for c, chain in chains.items())
        return out

    @_reconnecting
    def cases(self, open_only: bool = False) -> list[CaseSummary]:
        """Every case (or only the open ones), ordered by case id.

        A case is open when any of its intents has a status outside
        :data:`TERMINAL_STATUSES` -- ``escalated`` and unknown kinds included --
        or when its snapshot cannot be read (fail closed).
        """
        with self._guard("list cases"), self._read_one.connect() as conn:
            rows = conn.execute(
                sa.select(
                    cases.c.case_id,
                    cases.c.head_seq,
                    cases.c.head_digest,
                    cases.c.snapshot,
                    cases.c.updated_at,
                ).order_by(cases.c.case_id)
            ).all()
        out = []
        for row in rows:
            try:
                intents = json.loads(row.snapshot).get("intents", {})
                statuses = {str(i): str(v.get("status")) for i, v in intents.items()}
                is_open = any(is_open_status(s) for s in statuses.values())
            except (ValueError, AttributeError):
                statuses, is_open = {}, True
            if open_only and not is_open:
                continue
            out.append(
                CaseSummary(
                    case_id=row.case_id,
                    head_seq=int(row.head_seq),
                    head_digest=row.head_digest,
                    updated_at=parse_time(row.updated_at),
                    statuses=statuses,
                    open=is_open,
                )
            )
        return out

    # -- verification

    @_reconnecting
    def verify(self, case_id: str | None = None, *, anchor: Anchor | None = None
               ) -> VerifyReport:
        """Replay one case's chain, or every case's, and report what does not hold.

        Checks, per case: each digest recomputes, each link names the event
        before it, seq runs from 0 without gaps, the case row's head is the last
        event, each format-2 event's state digest is the state the chain folds
        to there, the snapshot equals ``fold(events)``, and with a key the head's
        MAC.  Over the whole ledger (no ``case_id``), the anchors recorded in the
        store chain and hold, and every case the latest one names still holds
        the head it recorded -- a case deleted, or restored to an older copy,
        is found.  ``anchor`` (one exported by ``capgate ledger anchor``) is
        checked the same way, and must be one this store recorded.  Tampering
        is reported as findings, never raised; an unknown ``case_id`` raises
        UnknownCase.
        """
        findings: list[Finding] = []
        n_cases = n_events = 0
        chains: dict[str, list[Event]] = {}
        with self._guard("verify"), self._read_many.connect() as conn, conn.begin():
            for cid, chain, case in self._read_cases(conn, case_id):
                n_cases += 1
                n_events += len(chain)
                findings.extend(check_case(cid, chain, case, self._key))
                if case_id is None or anchor is not None:
                    chains[cid] = chain
            if case_id is None or anchor is not None:
                recorded = _read_anchors(conn)
                findings.extend(_check_anchor_chain(recorded, self._key))
                if anchor is not None:
                    findings.extend(_check_exported(anchor, recorded, self._key))
                    if _anchor_problem(anchor, self._key) is None:  # else it says nothing
                        findings.extend(_check_heads(anchor, chains, case_id))
                elif recorded:
                    findings.extend(_check_heads(recorded[-1], chains, case_id))
        if case_id is not None and n_cases == 0:
            raise UnknownCase(f"no case {case_id!r} in the ledger", case_id=case_id)
        return VerifyReport(n_cases, n_events, tuple(findings), self._key is not None)

    # -- anchors

    def anchor(self) -> Anchor:
        """Record the ledger-wide head: every case's head, digested, chained, MAC'd.

        Export the result (``capgate ledger anchor --out FILE``) to somewhere the
        ledger's writers cannot rewrite: ``verify(anchor=...)`` then finds a case
        deleted, or rolled back to an older validly signed state, since.
        """
        with self._guard("record an anchor"), self._engine.begin() as conn:
            self._backend.lock_for_ddl(conn)  # one anchor at a time
            heads = {str(r.case_id): (int(r.head_seq), str(r.head_digest))
                     for r in conn.execute(sa.select(cases.c.case_id, cases.c.head_seq,
                                                     cases.c.head_digest))}
            n_events = int(conn.execute(sa.select(sa.func.count()).select_from(events))
                           .scalar_one())
            recorded = _read_anchors(conn)
            prev = recorded[-1] if recorded else None
            made = _make_anchor(
                anchor_seq=(prev.anchor_seq + 1) if prev else 0,
                created_at=format_time(self._now()), n_events=n_events, heads=heads,
                prev_digest=prev.digest if prev else GENESIS_DIGEST, key=self._key)
            conn.execute(sa.insert(anchors).values(
                anchor_seq=made.anchor_seq, created_at=made.created_at, cases=len(heads),
                events=made.events, heads_digest=made.heads_digest,
                heads=canonical_text({k: list(v) for k, v in made.heads.items()}),
                prev_digest=made.prev_digest, digest=made.digest, mac=made.mac))
        return made

    @_reconnecting
    def anchors(self) -> list[Anchor]:
        """The anchors recorded in this store, oldest first."""
        with self._guard("read anchors"), self._read_one.connect() as conn:
            return _read_anchors(conn)

    # -- migrations

    def migrate(self) -> MigrationReport:
        """Upgrade the store's tables to the revision this code writes (one transaction)."""
        with self._guard("migrate"), self._engine.begin() as conn:
            self._backend.lock_for_ddl(conn)
            report = upgrade_tables(conn, key=self._key)
        with self._heads_lock:
            self._heads.clear()
            self._verified.clear()
        return report

    def rekey(self, previous: bytes | None) -> RekeyReport:
        """Sign every case head and every anchor with this ledger's key: a key turned on
        for a ledger written without one, or a key rotated (``previous`` the old one).

        Without it, turning ``CAPGATE_LEDGER_HMAC_KEY`` on made every existing case
        refuse to continue (CG410, "the head's MAC does not match") and ``verify``
        report each as tampered, and a key could never be rotated.  Every case is
        verified first -- its chain, snapshot and state digests, and its head's MAC
        under ``previous`` (None: the heads must carry no MAC at all, or one of this
        key already, so that a MAC stripped or made by an unknown key is never
        blessed) -- and the anchors' chain likewise; any finding refuses the whole
        re-key (LedgerTampered, nothing written).  Then, in the same transaction,
        each head is re-signed by a compare-and-swap on its seq and digest (a case
        that moved meanwhile refuses it all: stop the writers, run again), and each
        anchor's MAC.  A case deleted or rolled back since the latest anchor refuses
        it too, as it fails ``verify``.  The re-key is recorded in a case of its own,
        with the keys' ids (an HMAC of a fixed text, never the key).  Exported anchor
        files keep their old MACs: export a new anchor afterwards.
        """
        key = self._key
        if key is None:
            raise ConfigError(f"re-keying signs with the ledger's key: set {HMAC_KEY_ENV} "
                              "to the new key (and give the old one, if any, as the previous)")
        findings: list[Finding] = []
        with self._guard("re-key the ledger"), self._engine.begin() as conn:
            self._backend.lock_for_ddl(conn)
            heads: list[tuple[str, CaseRow]] = []
            chains: dict[str, list[Event]] = {}
            for cid, chain, case in self._read_cases(conn, None):
                chains[cid] = chain
                findings.extend(check_case(cid, chain, case, None))  # all but the MAC
                if case is None:
                    continue
                why = _rekey_mac_problem(case.head_mac, case.head_digest, key, previous)
                if why is not None:
                    findings.append(Finding(
                        cid, case.head_seq,
                        "mac_missing" if case.head_mac is None else "mac_mismatch",
                        f"the head {why}"))
                heads.append((cid, case))
            recorded = _read_anchors(conn)
            findings.extend(_check_anchor_chain(recorded, None))  # all but the MACs
            if recorded:  # and no case deleted or rolled back since the latest one
                findings.extend(_check_heads(recorded[-1], chains, None))
            for a in recorded:
                why = _rekey_mac_problem(a.mac, a.digest, key, previous)
                if why is not None:
                    findings.append(Finding(_LEDGER, a.anchor_seq, "anchor_broken",
                                            f"anchor {a.anchor_seq}: {why}"))
            if findings:
                named = ", ".join(sorted({f.case_id for f in findings})[:5])
                raise LedgerTampered(
                    f"{len(findings)} finding(s) in {named}: the ledger was not re-keyed, "
                    "nothing was signed; run `capgate ledger verify` (with the previous key "
                    "set) and settle them first",
                    findings=[f.to_dict() for f in findings])
            for cid, case in heads:
                moved = conn.execute(
                    sa.update(cases).where(cases.c.case_id == cid,
                                           cases.c.head_seq == case.head_seq,
                                           cases.c.head_digest == case.head_digest)
                    .values(head_mac=head_mac(key, case.head_digest)))
                if moved.rowcount != 1:
                    raise LedgerError(
                        f"case {cid!r} moved while the ledger was being re-keyed; nothing was "
                        "signed: stop the ledger's writers and run it again", case_id=cid)
            for a in recorded:
                conn.execute(sa.update(anchors).where(anchors.c.anchor_seq == a.anchor_seq,
                                                      anchors.c.digest == a.digest)
                             .values(mac=head_mac(key, a.digest)))
        with self._heads_lock:
            self._heads.clear()
            self._verified.clear()
        case_id = f"ledger-rekey-{self._now().strftime('%Y%m%dT%H%M%S%fZ')}"
        self.append(case_id, "ledger_rekeyed", {
            "cases": len(heads), "anchors": len(recorded), "key_id": key_id(key),
            "previous_key_id": key_id(previous) if previous is not None else None})
        return RekeyReport(len(heads), len(recorded), case_id, key_id(key))

    @_reconnecting
    def revision(self) -> str | None:
        """The store's table revision (``capgate doctor``, ``ledger migrate``)."""
        with self._guard("read the revision"), self._read_one.connect() as conn:
            return current_revision(conn)

    @_reconnecting
    def load_verified(self, case_id: str) -> VerifiedCase:
        """The case's events and snapshot, after verifying them in one consistent read.

        Raises LedgerTampered (findings in ``details["findings"]``) when anything
        fails to verify, UnknownCase when there is no such case.  The executor
        calls this before continuing a case, so that it never acts on a record
        someone edited.
        """
        with (
            self._guard(f"verify case {case_id!r}"),
            self._read_many.connect() as conn,
            conn.begin(),
        ):
            loaded = list(self._read_cases(conn, case_id))
        if not loaded:
            raise UnknownCase(f"no case {case_id!r} in the ledger", case_id=case_id)
        _, chain, case = loaded[0]
        return self._verified_case(case_id, chain, case)

    @_reconnecting
    def load_verified_many(self, case_ids: Sequence[str]) -> dict[str, VerifiedCase]:
        """Every case of ``case_ids``, verified, in a few reads instead of one per case.

        Resume of a thousand open cases reads their rows and events in chunks of
        500 in one consistent read and runs the same chain check as
        :meth:`load_verified` (with the MAC, when a key is set) on each.
        LedgerTampered / UnknownCase exactly as :meth:`load_verified`.
        """
        wanted = list(dict.fromkeys(case_ids))
        out: dict[str, VerifiedCase] = {}
        with self._guard("verify cases"), self._read_many.connect() as conn, conn.begin():
            for i in range(0, len(wanted), _CHUNK):
                chunk = wanted[i:i + _CHUNK]
                rows = {r.case_id: CaseRow(r.snapshot, int(r.head_seq), r.head_digest,
                                           r.head_mac)
                        for r in conn.execute(sa.select(cases).where(
                            cases.c.case_id.in_(chunk)))}
                chains = _read_chains(conn, chunk, _unreadable_event)
                for case_id in chunk:
                    out[case_id] = self._verified_case(case_id, chains[case_id],
                                                       rows.get(case_id))
        return out

    def _verified_case(self, case_id: str, chain: list[Event],
                       case: CaseRow | None) -> VerifiedCase:
        if case is None and not chain:
            raise UnknownCase(f"no case {case_id!r} in the ledger", case_id=case_id)
        findings = check_case(case_id, chain, case, self._key)
        if findings or case is None:
            kinds = ", ".join(sorted({f.kind for f in findings})) or "case_missing"
            raise LedgerTampered(
                f"case {case_id!r} does not verify ({kinds}); run `capgate ledger verify "
                f"--case {case_id}` and do not continue the case until the cause is "
                "understood",
                case_id=case_id,
                findings=[f.to_dict() for f in findings],
            )
        self._remember(case_id, StoredHead(case.head_seq, case.head_digest, case.snapshot),
                       verified=True)
        return VerifiedCase(case_id, tuple(chain), _parse_snapshot(case_id, case.snapshot))

    @_reconnecting
    def snapshots(self, case_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored snapshots of many cases (unverified: resume's fast re-read)."""
        out: dict[str, dict[str, Any]] = {}
        wanted = list(dict.fromkeys(case_ids))
        with self._guard("read cases"), self._read_one.connect() as conn:
            for i in range(0, len(wanted), _CHUNK):
                for r in conn.execute(sa.select(cases.c.case_id, cases.c.snapshot)
                                      .where(cases.c.case_id.in_(wanted[i:i + _CHUNK]))):
                    out[r.case_id] = _parse_snapshot(r.case_id, r.snapshot)
        return out

    def _read_cases(
        self, conn: Connection, case_id: str | None
    ) -> Iterator[tuple[str, list[Event], CaseRow | None]]:
        """Each case with its events, including orphan events and event-less case rows."""
        case_q = sa.select(cases)
        event_q = sa.select(events).order_by(events.c.case_id, events.c.seq)
        if case_id is not None:
            case_q = case_q.where(cases.c.case_id == case_id)
            event_q = event_q.where(events.c.case_id == case_id)
        rows_by_case = {
            row.case_id: CaseRow(row.snapshot, int(row.head_seq), row.head_digest, row.head_mac)
            for row in conn.execute(case_q)
        }
        seen: set[str] = set()
        current: str | None = None
        chain: list[Event] = []
        for row in conn.execute(event_q):
            if row.case_id != current:
                if current is not None:
                    seen.add(current)
                    yield current, chain, rows_by_case.get(current)
                current, chain = row.case_id, []
            chain.append(_event_from_row(row) or _unreadable_event(row))
        if current is not None:
            seen.add(current)
            yield current, chain, rows_by_case.get(current)
        for cid in sorted(set(rows_by_case) - seen):
            yield cid, [], rows_by_case[cid]

    # -- idempotency

    @_reconnecting
    def claim_idempotency(
        self,
        key: str,
        *,
        case_id: str,
        intent_id: str,
        fingerprint: str,
        operation_id: str,
        version: int,
    ) -> IdempotencyRecord | None:
        """Claim ``key`` for this intent; None means the claim is ours (now or already).

        Exactly one claimer of a key wins, across processes (a unique key and
        ``INSERT ... ON CONFLICT DO NOTHING``, so no error ever aborts a
        surrounding PostgreSQL transaction).  A loser gets the winner's record
        when the request fingerprint is the same -- the caller then returns the
        recorded outcome of ``record.intent_id`` and executes nothing -- and
        IdempotencyConflict when it differs: the same key for a different
        request is refused, never silently treated as a replay.
        """
        for name, value in (("key", key), ("case_id", case_id), ("intent_id", intent_id)):
            _check_id(name, value)
        values = {
            "idem_key": key,
            "case_id": case_id,
            "intent_id": intent_id,
            "fingerprint": fingerprint,
            "operation_id": operation_id,
            "version": int(version),
            "created_at": format_time(self._now()),
        }
        with self._guard("claim an idempotency key"):
            for _ in range(_MAX_ATTEMPTS):
                with self._write_one.begin() as conn:
                    inserted = conn.execute(
                        self._backend.insert_ignore(idempotency)
                        .values(**values)
                        .returning(idempotency.c.idem_key)
                    ).first()
                    if inserted is not None:
                        return None
                    existing = _idempotency_record(conn, key)
                if existing is not None:
                    break
            else:
                raise LedgerError(f"could not claim idempotency key {key!r}; retry", key=key)
        if existing.fingerprint == fingerprint and existing.intent_id == intent_id:
            return None  # our own claim, seen again (a retry after a lost reply)
        if existing.fingerprint != fingerprint:
            raise IdempotencyConflict(
                f"idempotency key {key!r} was already used by intent {existing.intent_id!r} "
                f"(case {existing.case_id!r}, {existing.operation_id} v{existing.version}) for "
                "a different request; use a new key for a new request",
                key=key,
                case_id=existing.case_id,
                intent_id=existing.intent_id,
                operation_id=existing.operation_id,
                version=existing.version,
                fingerprint=existing.fingerprint,
                requested_fingerprint=fingerprint,
            )
        return existing

    @_reconnecting
    def key_owner(self, key: str) -> IdempotencyRecord | None:
        """:meth:`get_idempotency` on the call path: one statement on this thread's own
        connection (PostgreSQL: one round trip, none of a pooled session's set-up)."""
        with self._hot_guarded("read an idempotency key", durable=True, write=False) as tx:
            row = tx.run(_KEY_OWNER, {"k": key}).first()
        if row is None:
            return None
        return IdempotencyRecord(idem_key=str(row[0]), case_id=str(row[1]),
                                 intent_id=str(row[2]), fingerprint=str(row[3]),
                                 operation_id=str(row[4]), version=int(row[5]),
                                 created_at=parse_time(str(row[6])))

    @_reconnecting
    def get_idempotency(self, key: str) -> IdempotencyRecord | None:
        """The claim of ``key``, or None if nobody claimed it."""
        with self._guard("read an idempotency key"), self._read_one.connect() as conn:
            return _idempotency_record(conn, key)

    # -- plans and approvals

    @_reconnecting
    def record_plan(
        self, plan_hash: str, case_id: str, requester: str, plan: Mapping[str, Any]
    ) -> PlanRecord:
        """Record a plan under its hash; recording the same plan again returns the first record.

        The first recording wins: a later call with the same hash returns the
        stored record (whose ``requester`` and ``case_id`` may differ from the
        caller's -- compare them where four eyes matter).  Different plan
        content under one hash is refused with LedgerError.
        """
        for name, value in (("plan_hash", plan_hash), ("case_id", case_id)):
            _check_id(name, value)
        _check_id("requester", requester)
        try:
            plan_text = canonical_text(dict(plan))
        except Exception as exc:
            raise LedgerError(f"the plan is not plain JSON data ({exc})") from None
        with self._guard("record a plan"), self._write_one.begin() as conn:
            conn.execute(
                self._backend.insert_ignore(plans).values(
                    plan_hash=plan_hash,
                    case_id=case_id,
                    requester=requester,
                    plan=plan_text,
                    created_at=format_time(self._now()),
                )
            )
            row = conn.execute(sa.select(plans).where(plans.c.plan_hash == plan_hash)).one()
        if row.plan != plan_text:
            raise LedgerError(
                f"plan hash {plan_hash!r} is already recorded with different plan content; a "
                "plan hash names exactly one plan -- recompute it",
                plan_hash=plan_hash,
            )
        return _plan_record(row)

    @_reconnecting
    def get_plan(self, plan_hash: str) -> PlanRecord:
        """The recorded plan; UnknownPlan if none has this hash."""
        with self._guard("read a plan"), self._read_one.connect() as conn:
            row = conn.execute(sa.select(plans).where(plans.c.plan_hash == plan_hash)).first()
        if row is None:
            raise UnknownPlan(f"no plan with hash {plan_hash!r} was recorded", plan_hash=plan_hash)
        return _plan_record(row)

    @_reconnecting
    def recorded_plans(self, *, case_id: str | None = None, unused: bool = True,
                       limit: int = 1000) -> list[PlanRecord]:
        """Recorded plans, newest first: of ``case_id`` (all cases when None); with
        ``unused``, only those no intent has consumed an approval of yet."""
        query = sa.select(plans)
        if case_id is not None:
            query = query.where(plans.c.case_id == case_id)
        if unused:
            query = query.where(~sa.exists().where(
                approvals.c.plan_hash == plans.c.plan_hash,
                approvals.c.used_by_intent.is_not(None)))
        query = query.order_by(plans.c.created_at.desc(), plans.c.plan_hash).limit(limit)
        with self._guard("read recorded plans"), self._read_one.connect() as conn:
            rows = conn.execute(query).all()
        return [_plan_record(row) for row in rows]

    def record_approval(
        self,
        plan_hash: str,
        approver: str,
        role: str,
        ttl_seconds: float,
        now: datetime | None = None,
        *,
        sign: Callable[[Mapping[str, str]], tuple[str, str]] | None = None,
    ) -> ApprovalRecord:
        """Record one single-use approval of a recorded plan, expiring after ``ttl_seconds``.

        Who may approve (roles, four eyes, the key) is the caller's decision,
        made before this; the ledger refuses only an unknown plan (UnknownPlan)
        and a non-positive TTL.  ``sign`` receives the approval's fields
        (``approval_id``, ``plan_hash``, ``approver``, ``role``, ``expires_at``)
        and returns ``(public_key, signature)``, stored with it in one
        transaction.
        """
        _check_id("approver", approver)
        _check_id("role", role)
        if not ttl_seconds > 0:
            raise LedgerError(f"an approval needs a positive ttl_seconds, not {ttl_seconds!r}")
        created = self._now(now)
        values = {
            "approval_id": "apr_" + uuid.uuid4().hex,
            "plan_hash": plan_hash,
            "approver": approver,
            "role": role,
            "created_at": format_time(created),
            "expires_at": format_time(created + timedelta(seconds=ttl_seconds)),
            "used_by_intent": None,
            "used_at": None,
        }
        with self._guard("record an approval"), self._engine.begin() as conn:
            if conn.execute(
                sa.select(plans.c.plan_hash).where(plans.c.plan_hash == plan_hash)
            ).first() is None:
                raise UnknownPlan(
                    f"no plan with hash {plan_hash!r} was recorded; run `capgate plan` first",
                    plan_hash=plan_hash,
                )
            conn.execute(sa.insert(approvals).values(**values))
            if sign is not None:
                public_key, signature = sign({k: str(values[k]) for k in (
                    "approval_id", "plan_hash", "approver", "role", "expires_at")})
                conn.execute(sa.insert(approval_proofs).values(
                    approval_id=values["approval_id"], public_key=public_key,
                    signature=signature))
                values.update(public_key=public_key, signature=signature)
        return _approval_record(values)

    @_reconnecting
    def approvals_for(self, plan_hash: str) -> list[ApprovalRecord]:
        """Every approval of the plan, oldest first."""
        with self._guard("read approvals"), self._read_one.connect() as conn:
            rows = conn.execute(_approvals_of(plan_hash)).all()
        return [_approval_record(dict(row._mapping)) for row in rows]

    @_reconnecting
    def consume_approval(
        self,
        plan_hash: str,
        intent_id: str,
        now: datetime | None = None,
        *,
        exclude_approver: str | None = None,
        accept: Callable[[ApprovalRecord], str | None] | None = None,
    ) -> ApprovalRecord:
        """Use one valid approval of ``plan_hash`` for ``intent_id``; exactly one consumer wins.

        Picks the oldest unused, unexpired approval and marks it used with a
        conditional UPDATE (``... WHERE used_by_intent IS NULL``); a consumer
        that loses the race tries the next one.  Calling again for the same
        intent returns the approval it already consumed (a retried attempt of
        one intent needs no second approval).

        ``exclude_approver`` (four eyes: the requester) makes that person's
        approvals unusable here.

        Raises UnknownPlan (no such plan), ApprovalRequired (the plan has no
        approval at all), SelfApproval (the only valid approvals are by
        ``exclude_approver``), ApprovalExpired (an unused approval exists but
        every unused one has expired) or ApprovalUsed (every approval is used).
        """
        _check_id("intent_id", intent_id)
        with self.transaction("consume an approval") as tx:
            return self.consume_approval_on(tx, plan_hash, intent_id, now,
                                            exclude_approver=exclude_approver, accept=accept)

    def consume_approval_on(
        self,
        tx: HotTx,
        plan_hash: str,
        intent_id: str,
        now: datetime | None = None,
        *,
        exclude_approver: str | None = None,
        accept: Callable[[ApprovalRecord], str | None] | None = None,
    ) -> ApprovalRecord:
        """:meth:`consume_approval` inside the caller's transaction on this store.

        ``accept`` says why an approval cannot be trusted (None: it can); the
        executor passes the signature and role check against current grants.
        Approvals it rejects are never used: when every valid one is rejected
        the answer is ApprovalNotAuthenticated with the reasons.

        The executor consumes the approval in the transaction that records the
        intent's ``prepared`` event, so that an approval is used exactly when an
        intent that relies on it exists -- a call refused in that transaction
        (another intent owns its idempotency key, a target is claimed) burns
        nothing.
        """
        _check_id("intent_id", intent_id)
        moment = format_time(self._now(now))
        for _ in range(_MAX_ATTEMPTS):
            rows = [_Row(m) for m in tx.run(_APPROVALS_OF, {"plan_hash": plan_hash}).mappings()]
            for row in rows:
                if row.used_by_intent == intent_id:
                    return _approval_record(row.values)
            valid = [r for r in rows if r.used_by_intent is None and r.expires_at > moment]
            usable = [r for r in valid if r.approver != exclude_approver]
            if accept is not None and usable:
                rejected = {r.approval_id: accept(_approval_record(r.values)) for r in usable}
                trusted = [r for r in usable if rejected[r.approval_id] is None]
                if not trusted:
                    raise ApprovalNotAuthenticated(
                        f"no approval of plan {plan_hash} is proven to come from its "
                        f"approver: {'; '.join(f'{i}: {why}' for i, why in rejected.items())}",
                        plan_hash=plan_hash, rejected=rejected)
                usable = trusted
            if valid and not usable:
                raise SelfApproval(
                    f"the only valid approvals of plan {plan_hash} are by "
                    f"{exclude_approver!r}, who may not approve their own plan (four "
                    "eyes); ask another approver",
                    plan_hash=plan_hash,
                    approver=exclude_approver,
                )
            if not usable:
                raise self._no_approval(tx, plan_hash, rows)
            won = tx.run(_USE_APPROVAL, {"approval_id": usable[0].approval_id,
                                         "intent_id": intent_id, "moment": moment}).rowcount
            if won == 1:
                values = dict(usable[0].values)
                values.update(used_by_intent=intent_id, used_at=moment)
                return _approval_record(values)
        raise LedgerError(
            f"could not consume an approval of plan {plan_hash!r} under contention; retry",
            plan_hash=plan_hash,
        )

    def _no_approval(
        self, tx: HotTx, plan_hash: str, rows: Sequence[_Row]
    ) -> CapgateError:
        if not rows:
            if tx.run("SELECT plan_hash FROM cg_plans WHERE plan_hash = :plan_hash",
                      {"plan_hash": plan_hash}).first() is None:
                return UnknownPlan(
                    f"no plan with hash {plan_hash!r} was recorded; run `capgate plan` first",
                    plan_hash=plan_hash,
                )
            return ApprovalRequired(
                f"plan {plan_hash} has no approval; ask an approver to run `capgate approve "
                f"{plan_hash} --by WHO --role ROLE --key FILE`",
                plan_hash=plan_hash,
            )
        used = sum(1 for r in rows if r.used_by_intent is not None)
        if used < len(rows):
            return ApprovalExpired(
                f"every unused approval of plan {plan_hash} has expired; ask for a new approval",
                plan_hash=plan_hash,
                expired=len(rows) - used,
                used=used,
            )
        return ApprovalUsed(
            f"every approval of plan {plan_hash} was already used (approvals are single use); "
            "ask for a new approval",
            plan_hash=plan_hash,
            used=used,
        )


# --- the attempt fence ----------------------------------------------------------

SETTLED_BY_RESUME: Final = frozenset({"reconciled", "escalation_resolved", "escalated"})
"""Statuses only resume or a person write: an executing attempt never follows them.

(Resume's ``retrying`` is fenced by number instead: it records the retry's attempt,
and every older attempt is refused from then on.)"""


def _check_fence(case_id: str, state: Mapping[str, Any] | None, intent_id: str,
                 attempt: int, *, closed: ClosedLookup | None = None) -> None:
    """Refuse an executing attempt's event once its intent moved on without it.

    The snapshot holds open intents only: an intent not in it was settled (its
    full state comes from ``closed``, its events by index) -- or never existed.
    """
    current = ((state or {}).get("intents") or {}).get(intent_id)
    if current is None and closed is not None:
        current = closed(intent_id)
    if current is None:
        return
    recorded = max(int(current.get("attempt") or 0), int(current.get("retry_attempt") or 0))
    status = str(current.get("status"))
    if recorded > attempt or status in SETTLED_BY_RESUME or status in TERMINAL_STATUSES:
        raise AttemptSuperseded(
            f"attempt {attempt} of intent {intent_id} was superseded: the case {case_id!r} "
            f"records it as {status} (attempt {recorded}); nothing of this attempt is "
            "recorded any more", case=case_id, intent_id=intent_id, attempt=attempt,
            recorded_attempt=recorded, recorded_status=status,
            recorded_outcome=current.get("outcome_record"))


def _parse_snapshot(case_id: str, text: str) -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads(text)
    except ValueError:
        raise LedgerTampered(
            f"the snapshot of case {case_id!r} is not JSON; run `capgate ledger verify "
            f"--case {case_id}`",
            case_id=case_id,
            findings=[Finding(case_id, None, "snapshot_mismatch", "unreadable").to_dict()],
        ) from None
    if not isinstance(state, dict):
        raise LedgerTampered(
            f"the snapshot of case {case_id!r} is not a JSON object; run `capgate ledger "
            f"verify --case {case_id}`", case_id=case_id)
    return state


# --- row helpers --------------------------------------------------------------


class _Row:
    """A row as a mapping with attribute access (the hot path's approvals)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = dict(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


_APPROVALS_OF = (
    "SELECT a.approval_id, a.plan_hash, a.approver, a.role, a.created_at, a.expires_at, "
    "a.used_by_intent, a.used_at, p.public_key, p.signature FROM cg_approvals a "
    "LEFT OUTER JOIN cg_approval_proofs p ON p.approval_id = a.approval_id "
    "WHERE a.plan_hash = :plan_hash ORDER BY a.created_at, a.approval_id")
_USE_APPROVAL = ("UPDATE cg_approvals SET used_by_intent = :intent_id, used_at = :moment "
                 "WHERE approval_id = :approval_id AND used_by_intent IS NULL "
                 "AND expires_at > :moment")


class _HeadMoved(Exception):
    """Internal: the cached head was not the stored one; the attempt rolled back."""


class _CreateRaced(Exception):
    """Internal: an append that created the case met a key already taken (rolled back)."""


class _ClaimLost(Exception):
    """Internal: the idempotency key is another intent's; the attempt rolled back."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


Within = Callable[[HotTx], None]
"""Runs inside an append's transaction (claims, approval consumption); raises to undo it."""

_EVENT_COLUMNS = ("case_id, seq, kind, intent_id, payload, prev_digest, digest, recorded_at, "
                  "state_digest")
_HEAD = ("SELECT head_seq, head_digest, snapshot, head_mac FROM cg_cases "
         "WHERE case_id = :case_id")
_HEAD_EVENT = f"SELECT {_EVENT_COLUMNS} FROM cg_events WHERE case_id = :case_id AND seq = :seq"
_CASE_EVENTS = f"SELECT {_EVENT_COLUMNS} FROM cg_events WHERE case_id = :case_id ORDER BY seq"
_INTENT_EVENTS = (f"SELECT {_EVENT_COLUMNS} FROM cg_events WHERE case_id = :case_id "
                  "AND intent_id = :intent_id ORDER BY seq")
_INSERT_EVENT = (f"INSERT INTO cg_events ({_EVENT_COLUMNS}) VALUES (:case_id, :seq, :kind, "
                 ":intent_id, :payload, :prev_digest, :digest, :recorded_at, :state_digest)")
_CREATE_CASE = ("INSERT INTO cg_cases (case_id, snapshot, head_seq, head_digest, head_mac, "
                "updated_at) VALUES (:case_id, :snapshot, :head_seq, :head_digest, :head_mac, "
                ":updated_at) ON CONFLICT (case_id) DO NOTHING RETURNING case_id")
_SWAP_HEAD = ("UPDATE cg_cases SET snapshot = :snapshot, head_seq = :head_seq, "
              "head_digest = :head_digest, head_mac = :head_mac, updated_at = :updated_at "
              "WHERE case_id = :case_id AND head_seq = :old_seq AND head_digest = :old_digest "
              "AND snapshot = :old_snapshot")
_SWAP_HEAD_OR_FAIL = f"WITH swapped AS ({_SWAP_HEAD} RETURNING 1) SELECT 1 / count(*) FROM swapped"
""":data:`_SWAP_HEAD` that fails (division by zero) when it missed: see
:attr:`~executor.ledger.backends.Backend.failing_swap`."""
_CLAIM_KEY = ("INSERT INTO cg_idempotency (idem_key, case_id, intent_id, fingerprint, "
              "operation_id, version, created_at) VALUES (:idem_key, :case_id, :intent_id, "
              ":fingerprint, :operation_id, :version, :created_at) "
              "ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key")
_LANDED = "SELECT digest FROM cg_events WHERE case_id = :case_id AND digest = :digest"
_KEY_OWNER = ("SELECT idem_key, case_id, intent_id, fingerprint, operation_id, version, "
              "created_at FROM cg_idempotency WHERE idem_key = :k")


def _head_params(new: NewHead) -> dict[str, Any]:
    return {"case_id": new.case_id, "snapshot": new.snapshot, "head_seq": new.seq,
            "head_digest": new.digest, "head_mac": new.mac, "updated_at": new.updated_at}


def _event_from_values(row: Sequence[Any]) -> Event:
    """An Event from a row of :data:`_EVENT_COLUMNS` (a payload that is not a JSON object
    is kept as text under ``unreadable_payload``: it will not verify)."""
    try:
        payload = json.loads(row[4])
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        payload = {"unreadable_payload": str(row[4])}
    return Event(str(row[0]), int(row[1]), str(row[2]), row[3], payload, str(row[5]),
                 str(row[6]), str(row[7]), row[8])


def _landed_hot(tx: HotTx, case_id: str,
                tried: dict[str, list[Event]] | None) -> list[Event] | None:
    """The events of an earlier attempt of this append that reached the store, if any.

    Only asked after a lost connection.  Every attempt's last digest is unique
    (it covers ``recorded_at``), so finding one proves that attempt committed
    and that retrying would record the events twice.  Read after the head
    (under its lock), so an attempt that commits later could only do so on
    the head just read, and then our own write fails and the next round finds it.
    """
    for digest, written in (tried or {}).items():
        if tx.run(_LANDED, {"case_id": case_id, "digest": digest}).first() is not None:
            return written
    return None


_HEAD_WITH_EVENT = sa.select(
    cases.c.head_seq, cases.c.head_digest, cases.c.snapshot, cases.c.head_mac,
    events.c.case_id, events.c.seq, events.c.kind, events.c.intent_id, events.c.payload,
    events.c.prev_digest, events.c.digest, events.c.recorded_at, events.c.state_digest,
).select_from(cases.outerjoin(
    events, sa.and_(events.c.case_id == cases.c.case_id, events.c.seq == cases.c.head_seq)
)).where(cases.c.case_id == sa.bindparam("case_id"))
"""The case row and its head event, in one statement (the O(1) continuation check)."""


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise LedgerError(f"{name} must be a non-empty string, not {value!r}")


def _check_new_case_id(case_id: str) -> None:
    """A new case's id is a short line of printable text (:mod:`registry.names`).

    Checked where a case is created, whoever creates it (a call, the DDL loop, a
    coordination record); a case created before the rule keeps being readable,
    resumable and verifiable.
    """
    problem = name_problem(case_id)
    if problem is not None:
        raise LedgerError(f"cannot open case {excerpt(case_id, 60)}: a case id {problem}",
                          field="case_id")


def _event_from_row(row: Any) -> Event | None:
    """An Event from a ``cg_events`` row, or None when its payload is not a JSON object."""
    try:
        payload = json.loads(row.payload)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    return Event(
        case_id=row.case_id,
        seq=int(row.seq),
        kind=row.kind,
        intent_id=row.intent_id,
        payload=payload,
        prev_digest=row.prev_digest,
        digest=row.digest,
        recorded_at=row.recorded_at,
        state_digest=row.state_digest,
    )


def _unreadable_event(row: Any) -> Event:
    """Stand-in for an event whose payload text is not a JSON object: it will not verify."""
    return Event(
        case_id=row.case_id,
        seq=int(row.seq),
        kind=row.kind,
        intent_id=row.intent_id,
        payload={"unreadable_payload": str(row.payload)},
        prev_digest=row.prev_digest,
        digest=row.digest,
        recorded_at=row.recorded_at,
        state_digest=row.state_digest,
    )


def _read_events(conn: Connection, case_id: str, intent_id: str | None = None) -> list[Event]:
    """A case's events in seq order (only one intent's, by index, with ``intent_id``).

    Raises LedgerTampered when a stored payload is not a JSON object.
    """
    stmt = sa.select(events).where(events.c.case_id == case_id)
    if intent_id is not None:
        stmt = stmt.where(events.c.intent_id == intent_id)
    return [_event_from_row(row) or _tampered_event(row)
            for row in conn.execute(stmt.order_by(events.c.seq))]


def _tampered_event(row: Any) -> Event:
    """A reader that must not go on past an event whose payload is not JSON refuses here."""
    raise LedgerTampered(
        f"event {row.seq} of case {row.case_id!r} has a payload that is not JSON; run "
        f"`capgate ledger verify --case {row.case_id}`",
        case_id=row.case_id,
        seq=int(row.seq),
    )


def _read_chains(conn: Connection, case_ids: Sequence[str],
                 unreadable: Callable[[Any], Event]) -> dict[str, list[Event]]:
    """The events of each of ``case_ids`` (one chunk, one query), in seq order; a payload
    that is not JSON goes to ``unreadable`` (a stand-in that will not verify, or a refusal)."""
    chains: dict[str, list[Event]] = {c: [] for c in case_ids}
    for row in conn.execute(sa.select(events).where(events.c.case_id.in_(list(case_ids)))
                            .order_by(events.c.case_id, events.c.seq)):
        chains[row.case_id].append(_event_from_row(row) or unreadable(row))
    return chains


def _idempotency_record(
    conn: Connection, key: str, lock: Callable[[sa.Select[Any]], sa.Select[Any]] | None = None
) -> IdempotencyRecord | None:
    stmt = sa.select(idempotency).where(idempotency.c.idem_key == key)
    row = conn.execute(lock(stmt) if lock is not None else stmt).first()
    if row is None:
        return None
    return IdempotencyRecord(
        idem_key=row.idem_key,
        case_id=row.case_id,
        intent_id=row.intent_id,
        fingerprint=row.fingerprint,
        operation_id=row.operation_id,
        version=int(row.version),
        created_at=parse_time(row.created_at),
    )


def _plan_record(row: sa.Row[Any]) -> PlanRecord:
    return PlanRecord(
        plan_hash=row.plan_hash,
        case_id=row.case_id,
        requester=row.requester,
        plan=json.loads(row.plan),
        created_at=parse_time(row.created_at),
    )


def _approvals_of(plan_hash: str) -> sa.Select[Any]:
    """A plan's approvals with their proofs, oldest first."""
    return (sa.select(approvals, approval_proofs.c.public_key, approval_proofs.c.signature)
            .select_from(approvals.outerjoin(
                approval_proofs, approval_proofs.c.approval_id == approvals.c.approval_id))
            .where(approvals.c.plan_hash == plan_hash)
            .order_by(approvals.c.created_at, approvals.c.approval_id))


def _approval_record(values: Mapping[str, Any]) -> ApprovalRecord:
    used_at = values["used_at"]
    return ApprovalRecord(
        approval_id=values["approval_id"],
        plan_hash=values["plan_hash"],
        approver=values["approver"],
        role=values["role"],
        created_at=parse_time(values["created_at"]),
        expires_at=parse_time(values["expires_at"]),
        used_by_intent=values["used_by_intent"],
        used_at=parse_time(used_at) if used_at is not None else None,
        public_key=values.get("public_key"),
        signature=values.get("signature"),
        expires_text=str(values["expires_at"]),
    )


# --- anchors --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Anchor:
    """The ledger-wide head at one moment: every case's head, digested and chained."""

    anchor_seq: int
    created_at: str
    events: int
    heads: Mapping[str, tuple[int, str]] = field(hash=False)
    """case id -> (head seq, head digest) when the anchor was recorded."""
    heads_digest: str
    prev_digest: str
    """The digest of the anchor before it (GENESIS_DIGEST for the first)."""
    digest: str
    mac: str | None

    @property
    def cases(self) -> int:
        return len(self.heads)

    def to_dict(self) -> dict[str, Any]:
        return {"format": "capgate-ledger-anchor/1", "anchor_seq": self.anchor_seq,
                "created_at": self.created_at, "cases": self.cases, "events": self.events,
                "heads_digest": self.heads_digest, "prev_digest": self.prev_digest,
                "digest": self.digest, "mac": self.mac,
                "heads": {k: list(v) for k, v in sorted(self.heads.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "the anchor") -> Anchor:
        """An exported anchor, read back; AnchorMismatch names what is wrong with it."""
        try:
            if data.get("format") != "capgate-ledger-anchor/1":
                raise ValueError(f"format {data.get('format')!r}")
            heads = {str(k): (int(v[0]), str(v[1])) for k, v in dict(data["heads"]).items()}
            return cls(int(data["anchor_seq"]), str(data["created_at"]), int(data["events"]),
                       heads, str(data["heads_digest"]), str(data["prev_digest"]),
                       str(data["digest"]), None if data.get("mac") is None else str(data["mac"]))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise AnchorMismatch(f"{where} is not a capgate ledger anchor ({exc})",
                                 where=where) from None


def _heads_digest(heads: Mapping[str, tuple[int, str]]) -> str:
    return canonical_hash(sorted([k, v[0], v[1]] for k, v in heads.items()))


def _anchor_digest(anchor_seq: int, created_at: str, n_events: int, heads_digest: str,
                   prev_digest: str, n_cases: int) -> str:
    return canonical_hash({"anchor_seq": anchor_seq, "created_at": created_at,
                           "cases": n_cases, "events": n_events,
                           "heads_digest": heads_digest, "prev_digest": prev_digest})


def _rekey_mac_problem(mac: str | None, digest: str, key: bytes,
                       previous: bytes | None) -> str | None:
    """Why :meth:`Ledger.rekey` may not re-sign a head's or an anchor's ``mac`` (None: it
    may): it must be the previous key's, absent when no previous key is given, or the
    new key's already (a re-run)."""
    if mac is not None and hmac.compare_digest(mac, head_mac(key, digest)):
        return None
    if previous is None:
        return None if mac is None else \
            "is signed under a key not given: pass the previous key to re-key"
    if mac is None:
        return "carries no MAC, but the previous key was given"
    if hmac.compare_digest(mac, head_mac(previous, digest)):
        return None
    return "carries a MAC that is not the previous key's"


def key_id(key: bytes) -> str:
    """A key's public name: an HMAC of a fixed text under it (tells keys apart, reveals
    nothing of them)."""
    return hmac.new(key, b"capgate ledger key id", "sha256").hexdigest()[:16]


@dataclass(frozen=True)
class RekeyReport:
    """What :meth:`Ledger.rekey` signed, and where it recorded that."""

    cases: int
    anchors: int
    recorded_in: str
    key_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "anchors": self.anchors, "recorded_in": self.recorded_in,
                "key_id": self.key_id}


def _make_anchor(*, anchor_seq: int, created_at: str, n_events: int,
                 heads: Mapping[str, tuple[int, str]], prev_digest: str,
                 key: bytes | None) -> Anchor:
    hd = _heads_digest(heads)
    digest = _anchor_digest(anchor_seq, created_at, n_events, hd, prev_digest, len(heads))
    return Anchor(anchor_seq, created_at, n_events, dict(heads), hd, prev_digest, digest,
                  head_mac(key, digest) if key is not None else None)


def _read_anchors(conn: Connection) -> list[Anchor]:
    out: list[Anchor] = []
    for r in conn.execute(sa.select(anchors).order_by(anchors.c.anchor_seq)):
        try:
            heads = {str(k): (int(v[0]), str(v[1])) for k, v in json.loads(r.heads).items()}
        except (ValueError, TypeError, AttributeError, IndexError):
            heads = {}
        out.append(Anchor(int(r.anchor_seq), r.created_at, int(r.events), heads,
                          r.heads_digest, r.prev_digest, r.digest, r.mac))
    return out


_LEDGER = "(ledger)"
"""The ``case_id`` of a finding about the ledger as a whole (its anchors)."""


def _anchor_problem(a: Anchor, key: bytes | None) -> str | None:
    if _heads_digest(a.heads) != a.heads_digest:
        return "its case heads do not hash to its heads digest"
    if _anchor_digest(a.anchor_seq, a.created_at, a.events, a.heads_digest, a.prev_digest,
                      len(a.heads)) != a.digest:
        return "its fields do not hash to its digest"
    if key is not None and (a.mac is None or not hmac.compare_digest(a.mac,
                                                                     head_mac(key, a.digest))):
        return "its MAC does not match under the configured key"
    return None


def _check_anchor_chain(recorded: Sequence[Anchor], key: bytes | None) -> list[Finding]:
    findings: list[Finding] = []
    prev = GENESIS_DIGEST
    for i, a in enumerate(recorded):
        why = _anchor_problem(a, key)
        if why is None and a.anchor_seq != i:
            why = f"it sits at position {i} (an anchor before it was deleted)"
        if why is None and a.prev_digest != prev:
            why = "it does not chain to the anchor before it"
        if why is not None:
            findings.append(Finding(_LEDGER, a.anchor_seq, "anchor_broken",
                                    f"anchor {a.anchor_seq}: {why}"))
        prev = a.digest
    return findings


def _check_exported(anchor: Anchor, recorded: Sequence[Anchor],
                    key: bytes | None) -> list[Finding]:
    why = _anchor_problem(anchor, key)
    if why is None:
        same = [a for a in recorded if a.anchor_seq == anchor.anchor_seq]
        if not same or same[0].digest != anchor.digest:
            why = "this store no longer records it (its anchors were deleted or rewritten)"
    if why is None:
        return []
    return [Finding(_LEDGER, anchor.anchor_seq, "anchor_broken",
                    f"the exported anchor {anchor.anchor_seq}: {why}")]


def _check_heads(anchor: Anchor, chains: Mapping[str, Sequence[Event]],
                 only: str | None) -> list[Finding]:
    """Every case the anchor names still holds the head it recorded."""
    findings: list[Finding] = []
    for case_id, (seq, digest) in sorted(anchor.heads.items()):
        if only is not None and case_id != only:
            continue
        chain = chains.get(case_id)
        if not chain:
            findings.append(Finding(case_id, None, "case_deleted",
                                    f"anchor {anchor.anchor_seq} ({anchor.created_at}) recorded "
                                    f"this case at seq {seq}; it is gone from the ledger"))
            continue
        at = next((e for e in chain if e.seq == seq), None)
        if at is None or at.digest != digest:
            last = chain[-1].seq
            findings.append(Finding(
                case_id, seq, "case_rolled_back",
                f"anchor {anchor.anchor_seq} ({anchor.created_at}) recorded head seq {seq} "
                f"({digest}); the chain now ends at seq {last} and "
                + ("lacks that event" if at is None else f"holds {at.digest} there")))
    return findings
