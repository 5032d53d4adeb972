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
import functools
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.engine import URL, Connection, Engine, make_url

from capgate.executor.dialects import engine_name, normalise_url
from capgate.executor.dialects.registration import Implementations, Registered
from capgate.executor.ledger.schema import cases, events, idempotency
from capgate.registry.errors import LedgerError

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for another process's write lock before failing."""

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

    def make_engine(self, url: URL) -> Engine:
        raise NotImplementedError

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

    def hot_connect(self, url: URL) -> Any:
        import psycopg

        conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        kwargs: dict[str, Any] = {"autocommit": True}
        if "application_name" not in url.query:
            kwargs["application_name"] = "capgate-ledger"
        return psycopg.connect(conninfo, **kwargs)

    @contextlib.contextmanager
    def hot_transaction(self, conns: HotConnections, *, durable: bool,
                        write: bool) -> Iterator[HotTx]:
        conn = conns.get()
        tx = _PgTx(self, conn)
        if not write:
            yield tx
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
            if conn.closed or conn.broken:
                conns.drop()
                if isinstance(exc, Exception):
                    raise HotDisconnect(str(exc)) from exc
                raise
            try:
                # psycopg's own rollback also forgets the statements it believes prepared:
                # a pipeline aborted by an error skipped their Parse on the server
                conn.rollback()
            except Exception:
                conns.drop()
            raise
        finally:
            tx._pipeline = None

    def is_unique_violation(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) == "23505"

    def is_missed_swap(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) == "22012"  # division_by_zero

    def is_driver_error(self, exc: BaseException) -> bool:
        import psycopg

        return isinstance(exc, psycopg.Error)


    def make_engine(self, url: URL) -> Engine:
        connect_args: dict[str, Any] = {}
        if "application_name" not in url.query:
            connect_args["application_name"] = "capgate-ledger"
        return sa.create_engine(url, connect_args=connect_args)

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
    parsed = normalise_url(given)
    backend = backend_named(parsed.get_backend_name())
    if backend is None or parsed.drivername not in backend.drivers:
        raise LedgerError(
            f"unsupported ledger URL scheme {given.drivername!r}; the ledger runs on "
            "sqlite:///path or postgresql:// (psycopg 3)",
            ledger=given.render_as_string(hide_password=True),
        )
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
