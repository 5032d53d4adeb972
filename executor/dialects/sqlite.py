"""SQLite: the embedded default for the demo (and a target in tests).

SQLite has no sessions to label, no commit-outcome API and no server to
enforce a lease; a committed transaction is durable in the file, so the
landing marker alone tells what landed.  ``PRAGMA query_only`` makes reads
engine-enforced read-only; ``BEGIN IMMEDIATE`` takes the write lock up front
so that a busy database fails before any statement runs.
"""

from __future__ import annotations

import sqlite3
from typing import Any, ClassVar

import sqlalchemy as sa

from executor.dialects.base import Dialect, SessionTag, TxIdentity


class SqliteDialect(Dialect):
    returning_verbs: ClassVar[frozenset[str]] = frozenset({"INSERT", "UPDATE", "DELETE"})
    sequences_survive_rollback: ClassVar[bool] = False  # a rolled-back rowid is reused
    name: ClassVar[str] = "sqlite"
    transactional_ddl: ClassVar[bool] = True

    def engine_options(self) -> dict[str, Any]:
        return {}

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


def _raw(conn: sa.Connection) -> Any:
    """The sqlite3 connection itself, for pragmas that must run outside a transaction."""
    return conn.connection.driver_connection
