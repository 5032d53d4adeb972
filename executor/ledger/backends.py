"""What differs between the SQLite and the PostgreSQL ledger, and nothing else.

The ledger itself is written once against SQLAlchemy Core.  The few places where
the two backends must behave differently live here, behind one small class per
backend:

* how an engine is made durable and how a write transaction takes its lock
  (SQLite: WAL, ``synchronous=FULL``, ``BEGIN IMMEDIATE``; PostgreSQL: the
  case row ``SELECT ... FOR UPDATE``);
* how table creation is serialised between processes that open a fresh store
  at the same moment;
* how the event rows and the new chain head are written: SQLite in two
  statements inside its exclusive transaction, PostgreSQL in *one* statement
  (a data-modifying CTE), which is what lets an append cost a single round
  trip there (see :attr:`Backend.single_statement_append`);
* ``INSERT ... ON CONFLICT DO NOTHING``, which needs each dialect's construct;
* where the store may live (SQLite: a file, never memory), row locks in the
  hand-written reads, batch migrations, and append-only tables (the DDL
  snapshots).

Each backend registers itself by naming its dialect (``class SQLiteBackend(Backend,
name="sqlite")``, :mod:`executor.dialects.registration`); :func:`backend_for` is the
one lookup.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.engine import URL, Connection, Engine, make_url

from capgate.executor.cutoff import cutting
from capgate.executor.dialects import engine_name, normalise_url
from capgate.executor.dialects.base import (
    SERVER_KEEPALIVE,
    ConnectCuts,
    shut_down_socket,
    url_setting,
)
from capgate.executor.dialects.registration import Implementations, Registered
from capgate.executor.ledger.schema import cases, events, idempotency
from capgate.registry.errors import LedgerError

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for another process's write lock before failing."""


@dataclass(frozen=True, slots=True)
class LedgerBounds:
    """How long a shared (PostgreSQL) ledger may keep an executor waiting.

    A network partition closes nothing: without bounds, an executor cut off from the
    ledger waits for the kernel's TCP timers, and one cut off in the middle of a
    transaction holds its row locks -- the case head, an idempotency key, a budget
    slot -- while every other executor waits behind it.  Set on the ledger URL
    (``?capgate_wait=15&capgate_read=120&capgate_hold=5&capgate_connect=5``, stripped
    before the driver sees it) or with ``open_ledger(..., bounds=...)``.
    """

    wait_seconds: float = 15.0
    """One ledger operation of the call path -- a transaction with its reconnects --
    unanswered this long: its connection is cut (LedgerError, ``connection_lost``;
    during a call, CG430)."""
    read_seconds: float = 120.0
    """One statement through the store's engine -- a read (``ledger verify``, resume's
    load of many cases, listings), a migration -- unanswered this long: cut.  Longer than
    ``wait_seconds``, so that a large read is never taken for a partition."""
    hold_seconds: float = 5.0
    """A ledger transaction left waiting on its client this long (idle in it, or cut in the
    middle of a message) is ended: by the server (``idle_in_transaction_session_timeout``),
    or by any writer still waiting this long -- for its locks, most likely -- which then
    terminates it from a healthy side session (``end_stuck``), and goes on."""
    connect_seconds: float = 5.0
    """Opening a session (libpq counts whole seconds, at least 2)."""

    _QUERY: ClassVar[dict[str, str]] = {"capgate_wait": "wait_seconds",
                                        "capgate_read": "read_seconds",
                                        "capgate_hold": "hold_seconds",
                                        "capgate_connect": "connect_seconds"}

    def __post_init__(self) -> None:
        for name in ("wait_seconds", "read_seconds", "hold_seconds", "connect_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise LedgerError(f"the ledger's {name} must be a number of seconds > 0, "
                                  f"not {value!r}")

    @classmethod
    def from_url(cls, url: URL) -> tuple[LedgerBounds, URL]:
        """The bounds a URL sets (``capgate_wait`` ...), and the URL without them."""
        given: dict[str, float] = {}
        for key, name in cls._QUERY.items():
            if key in url.query:
                raw = url.query[key]
                text = str(raw[-1] if isinstance(raw, tuple) else raw)
                try:
                    given[name] = float(text)
                except ValueError:
                    raise LedgerError(f"the ledger URL's {key} must be a number of seconds, "
                                      f"not {text!r}") from None
        if not given:
            return cls(), url
        return cls(**given), url.difference_update_query(list(cls._QUERY))


_OPERATION: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "capgate_ledger_operation", default=None)
"""The ``time.monotonic()`` by which the ledger operation this thread is in must be
answered (see :func:`operation`)."""


@contextlib.contextmanager
def operation(seconds: float) -> Iterator[float]:
    """One ledger operation: everything in the block, reconnects included, shares one
    deadline ``seconds`` from now (an operation inside another keeps the outer one)."""
    current = _OPERATION.get()
    if current is not None:
        yield current
        return
    deadline = time.monotonic() + seconds
    token = _OPERATION.set(deadline)
    try:
        yield deadline
    finally:
        _OPERATION.reset(token)


_SILENT_UNTIL: contextvars.ContextVar[float] = contextvars.ContextVar(
    "capgate_ledger_silent_until", default=0.0)
"""``time.monotonic()`` until which this thread opens no new session to the store."""


def operation_left(default: float) -> float:
    """Seconds left in the current ledger operation (``default`` outside one)."""
    deadline = _OPERATION.get()
    return default if deadline is None else deadline - time.monotonic()

_SQLITE_BEGIN_OPTION = "capgate_sqlite_begin"
_PG_DDL_LOCK_KEY = 0x6367_6C65_6467_6572 & 0x7FFF_FFFF_FFFF_FFFF  # "cgledger"


@dataclass(frozen=True, slots=True)
class StoredHead:
    """A case row as read from ``cg_cases``: what the next append must build on."""

    seq: int
    digest: str
    snapshot: str


@dataclass(frozen=True, slots=True)
class NewHead:
    """The case row an append writes, compared-and-swapped against a :class:`StoredHead`."""

    case_id: str
    seq: int
    digest: str
    mac: str | None
    snapshot: str
    updated_at: str


class Backend(Registered):
    """One ledger backend's quirks.  Subclasses set the flags and override the hooks."""

    implementations: ClassVar[Implementations[Backend]] = Implementations("ledger backend")
    drivers: ClassVar[frozenset[str]] = frozenset()
    """The SQLAlchemy drivers the backend runs on (its hot path talks to that driver)."""
    row_lock: ClassVar[str] = ""
    """What a hand-written ``SELECT`` of rows to update adds to lock them (`` FOR UPDATE``)."""
    batch_migrations: ClassVar[bool] = False
    """Whether alembic must migrate by copying tables (SQLite's ALTER TABLE is limited)."""
    single_statement_append: ClassVar[bool] = False
    """True when one statement can write the events and swap the head atomically.

    Then an append needs no explicit transaction: it reads the head (or takes it
    from the process's own cache) and sends one compare-and-swap statement in
    autocommit mode.  A stale head makes the statement write nothing, and the
    ledger falls back to the locked path.  Nothing cached is ever trusted
    without the database checking it.
    """

    failing_swap: ClassVar[bool] = False
    """True when a statement can abort its transaction by itself (PostgreSQL: a division
    by zero), so that a head swap that missed fails instead of answering "0 rows": the
    append then queues COMMIT behind it, one round trip for the whole transaction, and
    the failure comes back as an error :meth:`is_missed_swap` recognises."""

    now_sql: ClassVar[str] = ""
    """The store's clock as epoch seconds (coordination rows compare expiries on it)."""
    greatest: ClassVar[str] = "max"
    skip_locked: ClassVar[str] = ""
    """What a ``SELECT ... LIMIT 1`` of a free row adds to skip rows other writers hold."""

    bounds: LedgerBounds = LedgerBounds()
    """How long the store may keep an executor waiting (set by :func:`backend_for`)."""

    def make_engine(self, url: URL) -> Engine:
        raise NotImplementedError

    def is_connection_lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` (a driver or SQLAlchemy error) means the store's connection is
        gone -- lost, reset, or cut at its deadline -- rather than a refusal of the store."""
        if isinstance(exc, HotDisconnect):
            return True
        return isinstance(exc, sa.exc.DBAPIError) and bool(exc.connection_invalidated)

    def prepare_location(self, url: URL, where: str) -> None:
        """Refuse a store that cannot keep records, and make what it needs (a folder)."""

    def lock_setup(self, conn: Connection, name: str) -> None:
        """Serialise the creation of table ``name`` (and its triggers) with other processes
        doing the same; held until ``conn``'s transaction ends.  Default: nothing needed."""

    def append_only_sql(self, conn: Connection, table: str) -> tuple[str, ...]:
        """The statements that make ``table``'s rows immutable (no UPDATE, no DELETE),
        empty when they are in place already.  ``table`` is capgate's own name."""
        return ()

    def hot_connect(self, url: URL) -> Any:
        """A driver connection for :class:`HotConnections` (one per thread)."""
        raise NotImplementedError

    def hot_transaction(self, conns: HotConnections, *, durable: bool,
                        write: bool) -> contextlib.AbstractContextManager[HotTx]:
        raise NotImplementedError

    def is_unique_violation(self, exc: BaseException) -> bool:
        """A driver error of a hot statement: a unique key refused the row."""
        return False

    def is_driver_error(self, exc: BaseException) -> bool:
        """An error the driver raised (the store refused or failed), not a bug of ours."""
        return False

    def is_missed_swap(self, exc: BaseException) -> bool:
        """The error of a failing head swap that missed (see :attr:`failing_swap`)."""
        return False

    def consistent_read_options(self) -> dict[str, Any]:
        """Execution options for a multi-statement read that must see one snapshot."""
        raise NotImplementedError

    def single_read_options(self) -> dict[str, Any]:
        """Execution options for a read of one statement (no BEGIN/COMMIT needed)."""
        raise NotImplementedError

    def lock_for_ddl(self, conn: Connection) -> None:
        """Serialise table creation with other processes opening the same store."""
        raise NotImplementedError

    def read_head(self, conn: Connection, case_id: str, *, lock: bool) -> StoredHead | None:
        """The case row, row-locked for the rest of the transaction when ``lock``."""
        stmt = sa.select(cases.c.head_seq, cases.c.head_digest, cases.c.snapshot).where(
            cases.c.case_id == case_id
        )
        if lock:
            stmt = self.lock_rows(stmt)
        row = conn.execute(stmt).first()
        if row is None:
            return None
        return StoredHead(int(row.head_seq), str(row.head_digest), str(row.snapshot))

    def lock_rows(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        return stmt

    def insert_ignore(self, table: sa.Table) -> Any:
        """``INSERT ... ON CONFLICT DO NOTHING`` for ``table``.

        Callers add ``RETURNING`` to learn whether the row was inserted: SQLAlchemy
        does not report a reliable rowcount for INSERT.
        """
        raise NotImplementedError

    def write_chain(
        self,
        conn: Connection,
        old: StoredHead | None,
        new: NewHead,
        rows: list[dict[str, Any]],
        claim: dict[str, Any] | None = None,
    ) -> bool:
        """Insert the event rows and swap the head from ``old`` to ``new``.

        Returns False, having written nothing that the caller's rollback would
        not undo, when the head is no longer ``old`` (another writer got there
        first, or the case row appeared meanwhile).  ``claim`` is an
        idempotency row inserted with them (IntegrityError when its key is
        taken).  The portable form runs several statements and relies on the
        caller's transaction for atomicity.
        """
        if old is None:
            created = conn.execute(
                self.insert_ignore(cases).values(
                    case_id=new.case_id,
                    snapshot=new.snapshot,
                    head_seq=new.seq,
                    head_digest=new.digest,
                    head_mac=new.mac,
                    updated_at=new.updated_at,
                )
                .returning(cases.c.case_id)
            ).first()
            if created is None:
                return False
        else:
            swapped = conn.execute(
                sa.update(cases)
                .where(
                    cases.c.case_id == new.case_id,
                    cases.c.head_seq == old.seq,
                    cases.c.head_digest == old.digest,
                    cases.c.snapshot == old.snapshot,
                )
                .values(
                    snapshot=new.snapshot,
                    head_seq=new.seq,
                    head_digest=new.digest,
                    head_mac=new.mac,
                    updated_at=new.updated_at,
                )
            )
            if swapped.rowcount != 1:
                return False
        if claim is not None:
            conn.execute(sa.insert(idempotency).values(**claim))
        conn.execute(sa.insert(events), rows)
        return True


class SQLiteBackend(Backend, name="sqlite"):
    """The embedded default: one file, WAL, ``synchronous=FULL``, ``BEGIN IMMEDIATE``.

    pysqlite's own transaction handling begins lazily and only before DML, so
    a transaction that first reads and then writes can fail with SQLITE_BUSY
    without ever waiting.  We take over BEGIN (the documented SQLAlchemy
    recipe) and make every transaction ``BEGIN IMMEDIATE`` -- it takes the
    write lock up front and waits for it under ``busy_timeout`` -- except the
    read-only ones, which ask for a plain deferred ``BEGIN`` and then read
    one consistent WAL snapshot.
    """

    drivers = frozenset({"sqlite", "sqlite+pysqlite"})
    batch_migrations = True
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    greatest = "max"

    def prepare_location(self, url: URL, where: str) -> None:
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            raise LedgerError(
                "an in-memory SQLite ledger would lose every record at exit; "
                "give a file path (sqlite:///path/ledger.db)",
                ledger=where,
            )
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)

    def append_only_sql(self, conn: Connection, table: str) -> tuple[str, ...]:
        return tuple(
            f"CREATE TRIGGER IF NOT EXISTS {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
            f"BEGIN SELECT RAISE(ABORT, '{table} rows are immutable'); END"
            for verb in ("UPDATE", "DELETE"))

    def hot_connect(self, url: URL) -> Any:
        conn = sqlite3.connect(url.database or "", timeout=SQLITE_BUSY_TIMEOUT_MS / 1000,
                               isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            conn.close()
            raise sqlite3.OperationalError(
                f"the ledger file refuses WAL journaling (journal_mode={mode!r}); put it on "
                "a local file system")
        conn.execute("PRAGMA synchronous = FULL")
        return conn

    @contextlib.contextmanager
    def hot_transaction(self, conns: HotConnections, *, durable: bool,
                        write: bool) -> Iterator[HotTx]:
        conn: sqlite3.Connection = conns.get()
        if not write:
            yield _SQLiteTx(self, conn)
            return
        with conns.write_lock:
            if not durable:
                conn.execute("PRAGMA synchronous = NORMAL")
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    tx = _SQLiteTx(self, conn)
                    yield tx
                    tx.require_settled()
                    conn.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    raise
            finally:
                if not durable:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("PRAGMA synchronous = FULL")

    def is_unique_violation(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError)

    def is_driver_error(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.Error)

    def make_engine(self, url: URL) -> Engine:
        engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

        @sa_event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
                mode = cur.execute("PRAGMA journal_mode = WAL").fetchone()
                if mode is None or str(mode[0]).lower() != "wal":
                    raise sa.exc.InvalidRequestError(
                        f"the ledger file refuses WAL journaling (journal_mode={mode!r}); "
                        "put it on a local file system"
                    )
                cur.execute("PRAGMA synchronous = FULL")
            finally:
                cur.close()

        @sa_event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql(
                conn.get_execution_options().get(_SQLITE_BEGIN_OPTION, "BEGIN IMMEDIATE")
            )

        return engine

    def consistent_read_options(self) -> dict[str, Any]:
        return {_SQLITE_BEGIN_OPTION: "BEGIN"}

    def single_read_options(self) -> dict[str, Any]:
        return {_SQLITE_BEGIN_OPTION: "BEGIN"}

    def lock_for_ddl(self, conn: Connection) -> None:
        # The transaction is already BEGIN IMMEDIATE, and SQLite DDL is transactional.
        return None

    def insert_ignore(self, table: sa.Table) -> Any:
        from sqlalchemy.dialects import sqlite as sqlite_dialect

        return sqlite_dialect.insert(table).on_conflict_do_nothing()


class PostgreSQLBackend(Backend, name="postgresql"):
    """The shared store: psycopg 3, row locks, one-statement appends.

    Sessions are tagged ``application_name=capgate-ledger`` so that a DBA sees
    who holds a lock.
    """

    drivers = frozenset({"postgresql+psycopg"})
    row_lock = " FOR UPDATE"
    single_statement_append = True
    failing_swap = True
    now_sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
    greatest = "GREATEST"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def network_args(self, url: URL) -> dict[str, Any]:
        """libpq settings bounding every wait the driver and the server can bound:
        ``connect_timeout`` (what is left of the operation, at most the bound), client TCP
        keepalive and user timeout, and in the session's ``options`` (no round trip) the
        server's ``idle_in_transaction_session_timeout`` at the hold bound, with the
        server's keepalive.  Settings the URL gives itself win."""
        bounds = self.bounds
        connect = max(2, math.ceil(min(bounds.connect_seconds,
                                       operation_left(bounds.connect_seconds))))
        args: dict[str, Any] = {}
        for key, value in (("connect_timeout", str(connect)), ("keepalives", "1"),
                           ("keepalives_idle", "5"), ("keepalives_interval", "1"),
                           ("keepalives_count", "3"), ("tcp_user_timeout", "10000")):
            if url_setting(url, key) is None:
                args[key] = value
        hold = f"{max(1, int(bounds.hold_seconds * 1000))}ms"
        idle, interval, count = SERVER_KEEPALIVE
        options = url_setting(url, "options") or ""
        extra = [f"-c idle_in_transaction_session_timeout={hold}",
                 f"-c tcp_keepalives_idle={idle}", f"-c tcp_keepalives_interval={interval}",
                 f"-c tcp_keepalives_count={count}"]
        args["options"] = " ".join([options, *(e for e in extra
                                               if e.split("=")[0] not in options)]).strip()
        return args

    def _silent(self) -> None:
        """The store did not answer this thread in time (a cut, a connect timeout): a
        partition is likely, and every follow-up of the failed work -- giving back a budget
        slot, a claim -- would wait its full bound again.  So for the hold bound this
        thread's new sessions fail at once (other threads, other calls, still try)."""
        _SILENT_UNTIL.set(time.monotonic() + self.bounds.hold_seconds)

    def check_reachable(self) -> None:
        """Refuse at once while the store is known silent to this thread (:meth:`_silent`)."""
        left = _SILENT_UNTIL.get() - time.monotonic()
        if left > 0:
            raise HotDisconnect(f"the ledger did not answer in time; not trying again for "
                                f"{left:.1f} s")

    def hot_connect(self, url: URL, *, side: bool = False) -> Any:
        """A session for the call path (``side``: the reaper's, whose failure to connect
        says nothing about the store the calls see: it marks nothing silent)."""
        import psycopg

        if operation_left(1.0) <= 0:
            raise HotDisconnect("the ledger operation's deadline passed before it could "
                                "reconnect")
        self.check_reachable()
        conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        kwargs: dict[str, Any] = {"autocommit": True, **self.network_args(url)}
        if "application_name" not in url.query:
            kwargs["application_name"] = "capgate-ledger"
        try:
            return psycopg.connect(conninfo, **kwargs)
        except psycopg.errors.ConnectionTimeout:
            if not side:
                self._silent()
            raise

    @staticmethod
    def cut(conn: Any) -> bool:
        """Shut a hot connection's socket down (its deadline passed unanswered)."""
        if conn.closed:
            return False
        return shut_down_socket(conn.pgconn.socket)

    @contextlib.contextmanager
    def hot_transaction(self, conns: HotConnections, *, durable: bool,
                        write: bool) -> Iterator[HotTx]:
        """One transaction on this thread's connection, cut when the operation's deadline
        passes unanswered; a write still running after the hold bound (waiting for a lock,
        most likely) has the stuck holders ended from a side session (:meth:`end_stuck`),
        and goes on."""
        conn = conns.get()
        tx = _PgTx(self, conn)
        left = operation_left(self.bounds.wait_seconds)
        with cutting(left, lambda: self.cut(conn)) as cut, \
                (self._reaping(conns.url) if write else contextlib.nullcontext()):
            if not write:
                try:
                    yield tx
                except Exception as exc:
                    if conn.closed or conn.broken or cut.fired:
                        conns.drop()
                        if cut.fired:
                            self._silent()
                        raise HotDisconnect(_lost(exc, cut.fired)) from exc
                    raise
                return
            try:
                with conn.pipeline() as pipeline:
                    tx._pipeline = pipeline
                    conn.execute("BEGIN")
                    if not durable:
                        conn.execute("SET LOCAL synchronous_commit TO OFF")
                    yield tx
                    tx.require_settled()
                    conn.execute("COMMIT")
            except BaseException as exc:
                tx._pipeline = None
                if conn.closed or conn.broken or cut.fired:
                    conns.drop()
                    if cut.fired:
                        self._silent()
                    if isinstance(exc, Exception):
                        raise HotDisconnect(_lost(exc, cut.fired)) from exc
                    raise
                try:
                    # psycopg's own rollback also forgets the statements it believes
                    # prepared: a pipeline aborted by an error skipped their Parse there
                    conn.rollback()
                except Exception:
                    conns.drop()
                    raise
                raise
            finally:
                tx._pipeline = None

    @contextlib.contextmanager
    def _reaping(self, url: URL) -> Iterator[None]:
        """While the block runs: every hold bound, end the stuck holders of this ledger's
        locks from a side session (on a thread of its own: never the waiting one)."""
        from capgate.executor.cutoff import CUTTER

        hold = self.bounds.hold_seconds
        running = threading.Event()
        running.set()

        def reap() -> None:
            if not running.is_set():
                return
            try:
                side = self.hot_connect(url, side=True)
            except Exception:  # the side path is cut too: the client's own cut decides
                return
            try:
                self.end_stuck(side)
            except Exception:
                pass
            finally:
                with contextlib.suppress(Exception):
                    side.close()
            if running.is_set():
                CUTTER.arm(time.monotonic() + hold, spawn)

        def spawn() -> None:
            threading.Thread(target=reap, name="capgate-ledger-reaper", daemon=True).start()

        first = CUTTER.arm(time.monotonic() + hold, spawn)
        try:
            yield
        finally:
            running.clear()
            first.disarm()

    def end_stuck(self, conn: Any) -> int:
        """Terminate the sessions of this ledger that hold its locks while waiting on a
        client that has not spoken for :attr:`LedgerBounds.hold_seconds` -- idle in their
        transaction, or in the middle of a message a partition cut in two (``active``,
        waiting on ``ClientRead``, where no server timeout runs) -- from this healthy
        session.  Only the same database user's sessions holding locks on this very
        ledger's tables qualify; a transaction that was never committed rolls back, and
        its executor learns that its connection was lost.  The number ended."""
        tables = [f"to_regclass('{name}')" for name in _LEDGER_TABLES]
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid))"
            " FROM pg_stat_activity a"
            " WHERE a.pid <> pg_backend_pid() AND a.usename = current_user"
            " AND a.datname = current_database()"
            " AND a.state_change < clock_timestamp() - make_interval(secs => %s)"
            " AND (a.state IN ('idle in transaction', 'idle in transaction (aborted)')"
            "      OR (a.state = 'active' AND a.wait_event = 'ClientRead'))"
            " AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.granted"
            f"            AND l.relation IN ({', '.join(tables)}))",
            (float(self.bounds.hold_seconds),)).fetchone()
        return int(row[0]) if row else 0

    def is_unique_violation(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) == "23505"

    def is_missed_swap(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) == "22012"  # division_by_zero

    def is_driver_error(self, exc: BaseException) -> bool:
        import psycopg

        return isinstance(exc, psycopg.Error)


    def is_connection_lost(self, exc: BaseException) -> bool:
        """Also a client-side failure to reach the store (no SQLSTATE: it never answered)."""
        if super().is_connection_lost(exc):
            return True
        import psycopg

        orig = getattr(exc, "orig", exc)
        return isinstance(orig, psycopg.OperationalError) and orig.sqlstate is None

    def make_engine(self, url: URL) -> Engine:
        connect_args: dict[str, Any] = self.network_args(url)
        if "application_name" not in url.query:
            connect_args["application_name"] = "capgate-ledger"
        engine = sa.create_engine(url, connect_args=connect_args)
        _StatementCuts(self).install(engine)
        ConnectCuts(self.cut, self.bounds.connect_seconds).install(engine)

        @sa_event.listens_for(engine, "do_connect")
        def _reachable(dialect: Any, record: Any, cargs: Any, cparams: Any) -> None:
            import psycopg

            try:
                self.check_reachable()
            except HotDisconnect as exc:
                raise psycopg.OperationalError(str(exc)) from None
            # what is left of the operation bounds the connect, not the default alone
            left = operation_left(self.bounds.connect_seconds)
            cparams["connect_timeout"] = str(max(2, math.ceil(min(
                self.bounds.connect_seconds, max(left, 0.0)))))

        return engine

    def consistent_read_options(self) -> dict[str, Any]:
        return {"isolation_level": "REPEATABLE READ"}

    def single_read_options(self) -> dict[str, Any]:
        return {"isolation_level": "AUTOCOMMIT"}

    def lock_for_ddl(self, conn: Connection) -> None:
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_DDL_LOCK_KEY)))

    def lock_setup(self, conn: Connection, name: str) -> None:
        # many executor processes may start at once
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": name})

    def append_only_sql(self, conn: Connection, table: str) -> tuple[str, ...]:
        if conn.execute(sa.text(
            "SELECT 1 FROM pg_trigger WHERE tgname = :trigger AND tgrelid = to_regclass(:table)"
        ), {"trigger": f"{table}_immutable", "table": table}).first():
            return ()
        return (
            f"CREATE OR REPLACE FUNCTION {table}_immutable() RETURNS trigger LANGUAGE plpgsql "
            f"AS $f$ BEGIN RAISE EXCEPTION '{table} rows are immutable'; END $f$",
            f"CREATE OR REPLACE TRIGGER {table}_immutable BEFORE UPDATE OR DELETE "
            f"ON {table} FOR EACH ROW EXECUTE FUNCTION {table}_immutable()",
        )

    def lock_rows(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        return stmt.with_for_update()

    def insert_ignore(self, table: sa.Table) -> Any:
        # imported here: its asyncpg module alone costs a SQLite ledger's CLI call 25 ms
        from sqlalchemy.dialects import postgresql as pg_dialect

        return pg_dialect.insert(table).on_conflict_do_nothing()

    def write_chain(
        self,
        conn: Connection,
        old: StoredHead | None,
        new: NewHead,
        rows: list[dict[str, Any]],
        claim: dict[str, Any] | None = None,
    ) -> bool:
        """One statement: the head swap gates the event insert (and the key's claim).

        ``WITH head AS (UPDATE cg_cases ... WHERE <old head> RETURNING case_id)
        INSERT INTO cg_events SELECT ... FROM head CROSS JOIN (VALUES ...)``.
        If another writer moved the head, PostgreSQL re-checks the UPDATE's
        WHERE against the committed row, updates nothing, and so inserts
        nothing.  A single statement is atomic on its own, so in autocommit
        mode this is the whole append: one round trip and one commit.

        With ``claim`` a second data-modifying CTE inserts the idempotency row
        from ``head`` too: a taken key raises a unique violation, which undoes
        the whole statement -- head, events and claim -- so a key is owned by
        exactly the intent whose events landed with it.
        """
        params: dict[str, Any] = {
            "case_id": new.case_id,
            "snapshot": new.snapshot,
            "head_seq": new.seq,
            "head_digest": new.digest,
            "head_mac": new.mac,
            "updated_at": new.updated_at,
        }
        if old is None:
            head_sql = (
                "INSERT INTO cg_cases (case_id, snapshot, head_seq, head_digest, head_mac, "
                "updated_at) VALUES (:case_id, :snapshot, :head_seq, :head_digest, "
                "CAST(:head_mac AS TEXT), :updated_at) "
                "ON CONFLICT (case_id) DO NOTHING RETURNING case_id"
            )
        else:
            head_sql = (
                "UPDATE cg_cases SET snapshot = :snapshot, head_seq = :head_seq, "
                "head_digest = :head_digest, head_mac = CAST(:head_mac AS TEXT), "
                "updated_at = :updated_at WHERE case_id = :case_id AND head_seq = :old_seq "
                "AND head_digest = :old_digest AND snapshot = :old_snapshot RETURNING case_id"
            )
            params.update(old_seq=old.seq, old_digest=old.digest, old_snapshot=old.snapshot)
        values = []
        for i, row in enumerate(rows):
            values.append(
                f"(CAST(:seq_{i} AS BIGINT), :kind_{i}, CAST(:intent_{i} AS TEXT), :payload_{i}, "
                f":prev_{i}, :digest_{i}, :at_{i}, CAST(:state_{i} AS TEXT))"
            )
            params.update(
                {
                    f"seq_{i}": row["seq"],
                    f"kind_{i}": row["kind"],
                    f"intent_{i}": row["intent_id"],
                    f"payload_{i}": row["payload"],
                    f"prev_{i}": row["prev_digest"],
                    f"digest_{i}": row["digest"],
                    f"at_{i}": row["recorded_at"],
                    f"state_{i}": row.get("state_digest"),
                }
            )
        claim_sql = ""
        if claim is not None:
            claim_sql = (
                ", claim AS (INSERT INTO cg_idempotency (idem_key, case_id, intent_id, "
                "fingerprint, operation_id, version, created_at) SELECT :c_key, :c_case, "
                ":c_intent, :c_fp, :c_op, CAST(:c_version AS INTEGER), :c_at FROM head "
                "RETURNING idem_key)"
            )
            params.update(c_key=claim["idem_key"], c_case=claim["case_id"],
                          c_intent=claim["intent_id"], c_fp=claim["fingerprint"],
                          c_op=claim["operation_id"], c_version=claim["version"],
                          c_at=claim["created_at"])
        sql = (
            f"WITH head AS ({head_sql}){claim_sql} "
            "INSERT INTO cg_events (case_id, seq, kind, intent_id, payload, prev_digest, digest, "
            "recorded_at, state_digest) SELECT head.case_id, v.seq, v.kind, v.intent_id, "
            "v.payload, v.prev_digest, v.digest, v.recorded_at, v.state_digest FROM head "
            "CROSS JOIN (VALUES "
            + ", ".join(values)
            + ") AS v (seq, kind, intent_id, payload, prev_digest, digest, recorded_at, "
            "state_digest) RETURNING seq"
        )
        inserted = conn.execute(sa.text(sql), params).all()
        return len(inserted) == len(rows)


def backend_for(url: str | URL) -> tuple[Backend, URL]:
    """The backend for a ledger URL, and the URL with capgate's driver pinned.

    Raises LedgerError when the URL cannot be parsed or names a database (or a
    driver) no backend runs on.
    """
    try:
        given = make_url(url)
    except Exception:
        raise LedgerError(
            "the ledger URL cannot be parsed; expected sqlite:///path or postgresql://user@host/db"
        ) from None
    bounds, given = LedgerBounds.from_url(given)
    parsed = normalise_url(given)
    backend = backend_named(parsed.get_backend_name())
    if backend is None or parsed.drivername not in backend.drivers:
        raise LedgerError(
            f"unsupported ledger URL scheme {given.drivername!r}; the ledger runs on "
            "sqlite:///path or postgresql:// (psycopg 3)",
            ledger=given.render_as_string(hide_password=True),
        )
    backend.bounds = bounds
    return backend, parsed


def backend_named(name: str) -> Backend | None:
    """The backend for a dialect name or alias (a connection's ``dialect.name``); None
    when the ledger cannot live in that database."""
    cls = Backend.implementations.get(engine_name(name))
    return cls() if cls is not None else None


# --- hot transactions: the call path's writes, on the driver directly -----------------------
#
# An append sits on every call's path, twice.  Through SQLAlchemy Core it costs a
# compiled-statement cache lookup, an execution context and result wrapping per
# statement (~40 us each); the statements here are fixed strings, so they go to
# the DBAPI connection itself.  Each thread keeps its own connection per store
# (SQLite: a ``sqlite3`` connection in WAL mode; PostgreSQL: a psycopg
# connection in autocommit mode that sends BEGIN/COMMIT itself, in pipeline
# mode so that a transaction's statements share round trips).  SQLAlchemy still
# owns the schema, the migrations and every read that is not on the call path.

_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class HotDisconnect(Exception):
    """The store's connection died in a hot transaction; whether it committed is unknown."""


def _lost(exc: BaseException, cut: bool) -> str:
    if cut:
        return "no answer within the ledger's wait bound: the connection was cut"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


_LEDGER_TABLES = ("cg_cases", "cg_events", "cg_idempotency", "cg_claims", "cg_budget_slots",
                  "cg_plans", "cg_approvals")
"""The ledger's tables whose locks a stuck session may hold (see ``end_stuck``)."""


class _StatementCuts:
    """Engine events on a PostgreSQL store: each statement is cut when it is unanswered
    :attr:`LedgerBounds.read_seconds` after it began."""

    _KEY = "capgate_ledger_cut"

    def __init__(self, backend: PostgreSQLBackend) -> None:
        self.backend = backend

    def install(self, engine: Engine) -> None:
        sa_event.listen(engine, "before_cursor_execute", self.before)
        sa_event.listen(engine, "after_cursor_execute", self.after)
        sa_event.listen(engine, "handle_error", self.error)

    def before(self, conn: Connection, cursor: Any, statement: str, parameters: Any,
               context: Any, executemany: bool) -> None:
        from capgate.executor.cutoff import CUTTER

        raw = conn.connection.driver_connection
        backend = self.backend
        conn.info[self._KEY] = CUTTER.arm(time.monotonic() + backend.bounds.read_seconds,
                                          lambda: backend.cut(raw))

    def after(self, conn: Connection, *_: Any) -> None:
        self._disarm(conn)

    def error(self, context: sa.engine.ExceptionContext) -> None:
        if context.connection is not None:
            self._disarm(context.connection)

    def _disarm(self, conn: Connection) -> None:
        if conn.invalidated or conn.closed:
            return
        cut = conn.info.pop(self._KEY, None)
        if cut is not None and cut.disarm():
            self.backend._silent()


class HotResult:
    """One statement's result: rows and row count, read when asked (PostgreSQL: after a sync)."""

    __slots__ = ("_columns", "_cursor", "_done", "_rowcount", "_rows", "_tx")

    def __init__(self, tx: HotTx, cursor: Any) -> None:
        self._tx = tx
        self._cursor = cursor
        self._done = False
        self._rows: list[tuple[Any, ...]] = []
        self._rowcount = -1
        self._columns: list[str] = []

    def _resolve(self) -> None:
        if self._done:
            return
        self._tx.sync()
        cur = self._cursor
        self._columns = [d[0] for d in cur.description] if cur.description else []
        self._rows = [tuple(r) for r in cur.fetchall()] if cur.description else []
        self._rowcount = int(cur.rowcount)
        self._done = True

    def all(self) -> list[tuple[Any, ...]]:
        self._resolve()
        return self._rows

    def first(self) -> tuple[Any, ...] | None:
        self._resolve()
        return self._rows[0] if self._rows else None

    def mappings(self) -> list[dict[str, Any]]:
        self._resolve()
        return [dict(zip(self._columns, r, strict=True)) for r in self._rows]

    @property
    def rowcount(self) -> int:
        self._resolve()
        return self._rowcount


class HotTx:
    """One write (or read) transaction on a store, statements in ``:name`` style.

    A statement's result is read when asked for (:class:`HotResult`): on
    PostgreSQL that is what lets several statements share one round trip.  A
    writer that needs a result only to decide whether the transaction may
    commit queues the statement and hands the decision to :meth:`defer`; the
    owner of the transaction runs every deferred check, in order, with
    :meth:`settle` before it commits (``Ledger.append``: the ``prepared``
    append's key, budget slot and impact claims, one round trip instead of one
    each).
    """

    backend: Backend
    _deferred: list[Callable[[], None]] | None = None

    def defer(self, check: Callable[[], None]) -> None:
        """Run ``check`` at :meth:`settle` (before COMMIT); it refuses by raising."""
        if self._deferred is None:
            self._deferred = []
        self._deferred.append(check)

    def settle(self) -> None:
        """Every deferred check, in the order given (each may read its results)."""
        checks, self._deferred = self._deferred or [], None
        for check in checks:
            check()

    def require_settled(self) -> None:
        """Before COMMIT: a deferred check never run would commit what it should judge."""
        if self._deferred:
            raise LedgerError(f"{len(self._deferred)} deferred check(s) of this transaction "
                              "were never settled; nothing was committed")

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> HotResult:
        raise NotImplementedError

    def run_many(self, sql: str, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            self.run(sql, row)

    def sync(self) -> None:
        """Send what is queued and wait for its results (PostgreSQL); nothing on SQLite."""


class _SQLiteTx(HotTx):
    def __init__(self, backend: Backend, conn: sqlite3.Connection) -> None:
        self.backend = backend
        self._conn = conn

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> HotResult:
        cur = self._conn.execute(sql, dict(params or {}))
        result = HotResult(self, cur)
        result._resolve()
        return result

    def run_many(self, sql: str, rows: Sequence[Mapping[str, Any]]) -> None:
        self._conn.executemany(sql, [dict(r) for r in rows])


class _PgTx(HotTx):
    def __init__(self, backend: Backend, conn: Any) -> None:
        self.backend = backend
        self._conn = conn
        self._pipeline: Any = None
        self._queued = False

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> HotResult:
        cur = self._conn.cursor()
        cur.execute(_pg_sql(sql), dict(params or {}))
        self._queued = True
        return HotResult(self, cur)

    def run_many(self, sql: str, rows: Sequence[Mapping[str, Any]]) -> None:
        cur = self._conn.cursor()
        cur.executemany(_pg_sql(sql), [dict(r) for r in rows])
        self._queued = True

    def sync(self) -> None:
        """One round trip for everything queued since the last one (none if nothing was)."""
        if self._pipeline is not None and self._queued:
            self._queued = False
            self._pipeline.sync()


@functools.lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """``:name`` placeholders as psycopg's ``%(name)s`` (a literal ``%`` doubled)."""
    return _NAMED.sub(r"%(\1)s", sql.replace("%", "%%"))


class HotConnections:
    """Per-thread driver connections to one store, closed with the ledger.

    A connection is never shared between threads, and a forked child drops its
    parent's (without closing them: the sockets and file handles are the
    parent's).  SQLite writers of one process take a process lock before
    ``BEGIN IMMEDIATE``: SQLite's own busy handler sleeps at least a
    millisecond, the process lock wakes the next writer at once.
    """

    def __init__(self, backend: Backend, url: URL) -> None:
        self.backend = backend
        self.url = url
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.write_lock = threading.RLock()

    def _forked(self) -> None:
        if os.getpid() != self._pid:
            self._local = threading.local()
            with self._lock:
                self._all = []
            self.write_lock = threading.RLock()
            self._pid = os.getpid()

    def get(self) -> Any:
        self._forked()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self.backend.hot_connect(self.url)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def drop(self) -> None:
        """Forget this thread's connection (it died); the next use opens a new one."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._lock:
                if conn in self._all:
                    self._all.remove(conn)
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        if os.getpid() != self._pid:
            return
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._local = threading.local()

    def transaction(self, *, durable: bool = True,
                    write: bool = True) -> contextlib.AbstractContextManager[HotTx]:
        """A transaction: committed when the block ends, rolled back if it raises.

        ``durable=False`` commits without waiting for the disk (SQLite
        ``synchronous=NORMAL`` in WAL mode, PostgreSQL ``synchronous_commit =
        off``): visible to every reader at once and kept through a crash of
        this process; only an operating-system crash or power loss can lose it,
        and then only until the next durable commit, which flushes it too.
        (The backend's own context manager, handed out as it is: one layer less on
        every ledger transaction of a call.)
        """
        return self.backend.hot_transaction(self, durable=durable, write=write)
