"""PostgreSQL: ``application_name`` tags, ``SET LOCAL`` timeouts, ``pg_xact_status``.

The write transaction's identity -- ``pg_current_xact_id()`` (xid8, wraparound
safe), backend pid and start time, the cluster's system identifier and
timeline -- is read in the same round trip that labels the session and sets
its server-side timeouts.  After a crash, ``pg_xact_status`` answers whether
that exact transaction committed, as long as the server is the same cluster
on the same timeline and the xid is not older than the commit log retains.
"""

from __future__ import annotations

from typing import Any, ClassVar

import sqlalchemy as sa

from executor.dialects.base import (
    IDLE_GRACE_SECONDS,
    MARKER_TABLE,
    REARM_AFTER_SECONDS,
    Dialect,
    SessionTag,
    TxIdentity,
    sqlstate,
)

_IDENTITY_COLUMNS = (
    " pg_current_xact_id()::text AS xid,"
    " pg_backend_pid() AS pid,"
    " (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())::text"
    "   AS backend_start,"
    " (SELECT system_identifier FROM pg_control_system())::text AS system_identifier,"
    " (SELECT timeline_id FROM pg_control_checkpoint()) AS timeline"
)
_SETTINGS = (
    "set_config('application_name', :app, true) AS app,"
    " set_config('statement_timeout', :st, true) AS st,"
    " set_config('lock_timeout', :lt, true) AS lt,"
    " set_config('idle_in_transaction_session_timeout', :it, true) AS it,"
)
_XID_ONLY = " pg_current_xact_id()::text AS xid"
_SESSION_KEY = "capgate:pg_session"
"""``conn.info`` key of the session's constant identity (pid, start, cluster, timeline)."""


def _begin_with_marker(identity: str) -> str:
    """One round trip opens the transaction: settings, identity and the landing marker.

    The settings are taken in a CTE evaluated first, so the marker insert already
    runs under the transaction's timeouts.
    """
    return (f"WITH s AS MATERIALIZED (SELECT {_SETTINGS} 1 AS one),"
            f" m AS (INSERT INTO {MARKER_TABLE} (intent_id, idem_key, fingerprint, attempt,"
            "   case_id, operation_id, landed_at) SELECT :intent_id, :idem_key, :fingerprint,"
            "   :attempt, :case_id, :operation_id, :landed_at FROM s RETURNING 1)"
            f" SELECT (SELECT count(*) FROM m) AS marked, {identity} FROM s")


_BEGIN_WITH_MARKER = _begin_with_marker(_IDENTITY_COLUMNS)
_BEGIN_WITH_MARKER_XID = _begin_with_marker(_XID_ONLY)
_BEGIN_XID = f"SELECT {_SETTINGS}{_XID_ONLY}"
_BEGIN_WRITE = sa.text(
    "SELECT set_config('application_name', :app, true),"
    " set_config('statement_timeout', :st, true),"
    " set_config('lock_timeout', :lt, true),"
    " set_config('idle_in_transaction_session_timeout', :it, true),"
    " pg_current_xact_id()::text AS xid,"
    " pg_backend_pid() AS pid,"
    " (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())::text"
    "   AS backend_start,"
    " (SELECT system_identifier FROM pg_control_system())::text AS system_identifier,"
    " (SELECT timeline_id FROM pg_control_checkpoint()) AS timeline"
)
_SERVER = sa.text(
    "SELECT (SELECT system_identifier FROM pg_control_system())::text,"
    " (SELECT timeline_id FROM pg_control_checkpoint())"
)


def _ms(seconds: float) -> str:
    return f"{max(1, int(seconds * 1000))}ms"


class PostgresqlDialect(Dialect):
    returning_verbs: ClassVar[frozenset[str]] = frozenset({"INSERT", "UPDATE", "DELETE"})
    driver_paramstyle: ClassVar[str] = "pyformat"
    name: ClassVar[str] = "postgresql"
    transactional_ddl: ClassVar[bool] = True
    commit_outcome_probe: ClassVar[bool] = True
    server_side_lease: ClassVar[bool] = True

    def begin_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                    lock_timeout_s: float | None,
                    marker: dict[str, Any] | None = None) -> TxIdentity:
        settings = {
            "app": tag.text(),
            "st": _ms(timeout_s),
            "lt": _ms(lock_timeout_s if lock_timeout_s is not None else timeout_s),
            # the idle timeout counts from the end of the last statement: it stays small
            # whatever the deadline (see executor.dialects.base.IDLE_GRACE_SECONDS)
            "it": _ms(min(timeout_s, IDLE_GRACE_SECONDS)),
        }
        self.start_deadline(conn, timeout_s)
        if not conn.in_transaction():
            conn.begin()  # SQLAlchemy's record of the transaction; psycopg sends BEGIN itself
        # The session's pid, start time, cluster and timeline are constant for the life of
        # the connection: read once per pooled connection, then only the xid.  (A standby
        # promoted under an open connection makes the cached timeline the old one: resume
        # then sees a changed timeline and answers `unknown` -- never a wrong `applied`.)
        session = conn.info.get(_SESSION_KEY)
        if marker is not None:
            sql = _BEGIN_WITH_MARKER if session is None else _BEGIN_WITH_MARKER_XID
            cursor = self.execute(conn, sql, {**settings, **marker}, tag)
        else:
            cursor = self.execute(conn, _BEGIN_WRITE.text if session is None else _BEGIN_XID,
                                  settings, tag)
        row = dict(zip([d[0] for d in cursor.description], cursor.fetchone(), strict=True))
        if session is None:
            session = {k: row[k] for k in ("pid", "backend_start", "system_identifier",
                                           "timeline")}
            conn.info[_SESSION_KEY] = session
        return self._identity({**session, "xid": row["xid"]})

    def open_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                   lock_timeout_s: float | None) -> TxIdentity:
        return self.begin_write(conn, tag, timeout_s, lock_timeout_s)

    @staticmethod
    def _identity(row: Any) -> TxIdentity:
        return TxIdentity("postgresql", {
            "xid": row["xid"],
            "pid": row["pid"],
            "backend_start": row["backend_start"],
            "system_identifier": row["system_identifier"],
            "timeline": row["timeline"],
        })

    def arm_deadline(self, raw: Any, left: float) -> None:
        raw.execute("SELECT set_config('statement_timeout', %s, true),"
                    " set_config('idle_in_transaction_session_timeout', %s, true)",
                    (_ms(left + REARM_AFTER_SECONDS), _ms(min(left, IDLE_GRACE_SECONDS))))

    def begin_read(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))
        conn.execute(sa.text(
            "SELECT set_config('application_name', :app, true),"
            " set_config('statement_timeout', :st, true)"
        ), {"app": tag.text(), "st": _ms(timeout_s)})

    def is_timeout(self, exc: BaseException) -> bool:
        # 57014 query_canceled (statement_timeout), 55P03 lock_not_available (lock_timeout)
        return sqlstate(exc) in ("57014", "55P03")

    def is_read_only_violation(self, exc: BaseException) -> bool:
        return sqlstate(exc) == "25006"

    def is_unique_violation(self, exc: BaseException) -> bool:
        return sqlstate(exc) == "23505"

    def is_undefined_table(self, exc: BaseException) -> bool:
        return sqlstate(exc) == "42P01"

    def is_insufficient_privilege(self, exc: BaseException) -> bool:
        return sqlstate(exc) == "42501"

    def server_identity(self, conn: sa.Connection) -> dict[str, Any]:
        system_identifier, timeline = conn.execute(_SERVER).one()
        return {"system_identifier": system_identifier, "timeline": timeline}

    def commit_outcome(self, conn: sa.Connection, identity: dict[str, Any]) -> str | None:
        xid = identity.get("xid")
        if not xid:
            return None
        status = conn.execute(sa.text("SELECT pg_xact_status(CAST(:xid AS xid8))"),
                              {"xid": str(xid)}).scalar()
        if status is None:
            return None
        return {"committed": "committed", "aborted": "aborted",
                "in progress": "in_progress"}.get(str(status))

    @staticmethod
    def _on_backend(conn: sa.Connection, identity: dict[str, Any], what: str) -> bool | None:
        """``what`` over exactly the recorded backend (pid *and* start time: pids recycle)."""
        pid = identity.get("pid")
        if pid is None:
            return None
        value = conn.execute(sa.text(
            f"SELECT {what} FROM pg_stat_activity WHERE pid = :pid"
            " AND backend_start::text = :start"
        ), {"pid": int(pid), "start": str(identity.get("backend_start"))}).scalar()
        return bool(value)

    def session_alive(self, conn: sa.Connection, identity: dict[str, Any]) -> bool | None:
        return self._on_backend(conn, identity, "count(*) > 0")

    def terminate_session(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        return bool(self._on_backend(conn, identity, "pg_terminate_backend(pid)"))

    def cancel_statement(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        return bool(self._on_backend(conn, identity, "pg_cancel_backend(pid)"))
