"""SQLite: the embedded default for the demo (and a target in tests).

SQLite has no sessions to label, no commit-outcome API and no server to
enforce a lease; a committed transaction is durable in the file, so the
landing marker alone tells what landed.  ``PRAGMA query_only`` makes reads
engine-enforced read-only; ``BEGIN IMMEDIATE`` takes the write lock up front
so that a busy database fails before any statement runs.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.dialects.base import (
    Attempt,
    AttemptEvidence,
    Diagnosis,
    Dialect,
    SessionTag,
    TxIdentity,
    first_line,
)
from capgate.registry.errors import PrivilegeMissing


class SqliteDialect(Dialect, name="sqlite"):
    title: ClassVar[str] = "SQLite"
    returning_verbs: ClassVar[frozenset[str]] = frozenset({"INSERT", "UPDATE", "DELETE"})
    sequences_survive_rollback: ClassVar[bool] = False  # a rolled-back rowid is reused

    def engine_options(self) -> dict[str, Any]:
        return {}

    def pool_options(self, session_budget: int, db_user_budget: int | None) -> dict[str, Any]:
        return {}  # no server counts sessions: SQLAlchemy's own pool for a file

    @classmethod
    def database_file(cls, url: URL) -> str | None:
        database = url.database
        return database if database and database != ":memory:" else None

    def prepare_engine(self, engine: sa.Engine) -> None:
        @sa.event.listens_for(engine, "connect")
        def _connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(conn: sa.Connection) -> None:
            mode = conn.info.pop("capgate_begin", "BEGIN")
            conn.exec_driver_sql(mode)

    def open_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                   lock_timeout_s: float | None) -> TxIdentity:
        busy = int((lock_timeout_s if lock_timeout_s is not None else timeout_s) * 1000)
        _raw(conn).execute(f"PRAGMA busy_timeout={max(1, busy)}")
        conn.info["capgate_begin"] = "BEGIN IMMEDIATE"
        conn.exec_driver_sql("SELECT 1")  # autobegin now: the write lock is taken up front
        return TxIdentity("sqlite", {})

    def begin_read(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        _raw(conn).execute("PRAGMA query_only=ON")

    def end_read(self, conn: sa.Connection) -> None:
        _raw(conn).execute("PRAGMA query_only=OFF")

    def is_timeout(self, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", exc)
        return isinstance(orig, sqlite3.OperationalError) and "locked" in str(orig)

    def is_read_only_violation(self, exc: BaseException) -> bool:
        return "readonly" in str(getattr(exc, "orig", exc)).replace(" ", "")

    def is_unique_violation(self, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", exc)
        return isinstance(orig, sqlite3.IntegrityError) and "UNIQUE" in str(orig)

    def is_undefined_table(self, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", exc)
        return isinstance(orig, sqlite3.OperationalError) and "no such table" in str(orig)

    def target_grants(self, grantee: str) -> list[str]:
        return []  # SQLite has no accounts: file permissions decide

    # --- ending a leased transaction --------------------------------------------------

    def cancel_statement(self, raw: Any, session: int | None,
                         side: Callable[[], AbstractContextManager[sa.Connection]]) -> None:
        """``sqlite3.Connection.interrupt()``: the running statement stops with an error."""
        raw.interrupt()

    # --- recovery evidence ------------------------------------------------------------

    def attempt_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """No sessions to ask: holding the write lock proves no write is open.

        ``BEGIN IMMEDIATE`` succeeds only when no other connection has a write
        transaction open, so once resume has held it every attempt's transaction is
        over (the markers resume reads after it are final).  A writer that is alive
        (e.g. a stopped process) keeps the lock: unknown.  There is one database
        file, so the server is always the same one.
        """
        answers = {a.intent_id: AttemptEvidence(identity="same") for a in attempts}
        tag = SessionTag("resume", "capgate.resume", "evidence")
        with engine.connect() as conn:
            try:
                self.begin_write(conn, tag, max(wait_seconds, 0.05), max(wait_seconds, 0.05))
            except sa.exc.OperationalError as exc:
                conn.rollback()
                for answer in answers.values():
                    answer.notes["write_lock"] = f"not acquired: {first_line(exc)}"
                    answer.notes["session_alive"] = True
            else:
                for answer in answers.values():
                    answer.finished = True
                    answer.notes["write_lock"] = ("acquired: no write transaction is open on "
                                                  "the target")
            finally:
                conn.rollback()
                conn.exec_driver_sql("PRAGMA busy_timeout=5000")
        return answers

    # --- capgate doctor ---------------------------------------------------------------

    def describe_server(self, conn: sa.Connection) -> str:
        return f"SQLite {conn.execute(sa.text('SELECT sqlite_version()')).scalar()}"

    def diagnose(self, conn: sa.Connection, diagnosis: Diagnosis) -> None:
        """The tables exist; the file (and, for writes, its folder: the journal) is writable."""
        database = conn.engine.url.database or ""

        def has(table: str, privilege: str) -> bool | None:
            if not conn.execute(sa.text(
                    "SELECT count(*) FROM sqlite_master WHERE type IN ('table', 'view') "
                    "AND lower(name) = :t"), {"t": table}).scalar():
                return None
            return privilege == "SELECT" or os.access(database, os.W_OK)

        diagnosis.privileges(has)
        if diagnosis.writes and not os.access(Path(database).parent, os.W_OK):
            diagnosis.error(PrivilegeMissing.code, f"the folder of {database} is not writable: "
                            "SQLite cannot keep its journal")


def _raw(conn: sa.Connection) -> Any:
    """The sqlite3 connection itself, for pragmas that must run outside a transaction."""
    return conn.connection.driver_connection
