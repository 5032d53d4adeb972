"""MariaDB: a leading SQL comment tags each statement; session timeouts.

MariaDB has no session label a DBA can read besides the statement text, so
every statement carries ``/* capgate case=… op=… intent=… */``, visible in
``SHOW PROCESSLIST``.  The lease is enforced by the server through
``max_statement_time``, ``innodb_lock_wait_timeout`` and
``idle_transaction_timeout`` (so a hung executor cannot hold row locks).
There is no commit-outcome API: the landing marker is the evidence, and the
connection id together with the server's start time tells whether the old
session may still be alive.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, ClassVar

import sqlalchemy as sa

from executor.dialects.base import (
    MARKER_INSERT,
    REARM_AFTER_SECONDS,
    Dialect,
    SessionTag,
    TxIdentity,
    vendor_code,
)

_IDENTITY = sa.text(
    "SELECT CONNECTION_ID() AS connection_id, @@server_id AS server_id,"
    " @@hostname AS hostname,"
    " (SELECT UNIX_TIMESTAMP() - VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS"
    "  WHERE VARIABLE_NAME = 'UPTIME') AS server_started"
)


class MariadbDialect(Dialect):
    # INSERT ... RETURNING and DELETE ... RETURNING (10.5+); an UPDATE returns nothing
    returning_verbs: ClassVar[frozenset[str]] = frozenset({"INSERT", "DELETE"})
    driver_paramstyle: ClassVar[str] = "pyformat"
    name: ClassVar[str] = "mariadb"
    server_side_lease: ClassVar[bool] = True

    def engine_options(self) -> dict[str, Any]:
        return {"pool_recycle": 1800}

    def sql(self, text: str, tag: SessionTag | None) -> str:
        return tag.comment() + text if tag is not None else text

    def _set_timeouts(self, conn: sa.Connection, timeout_s: float,
                      lock_timeout_s: float | None) -> None:
        # idle_transaction_timeout counts from the end of the last statement and takes
        # whole seconds: 1, whatever the deadline (executor.dialects.base.IDLE_GRACE_SECONDS)
        conn.exec_driver_sql(
            "SET SESSION max_statement_time = %s, innodb_lock_wait_timeout = %s,"
            " idle_transaction_timeout = 1",
            (float(timeout_s), max(1, math.ceil(lock_timeout_s or timeout_s))),
        )

    def arm_deadline(self, raw: Any, left: float) -> None:
        with raw.cursor() as cursor:
            cursor.execute("SET SESSION max_statement_time = %s, idle_transaction_timeout = 1",
                           (round(left + REARM_AFTER_SECONDS, 3),))

    def open_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                   lock_timeout_s: float | None) -> TxIdentity:
        self.start_deadline(conn, timeout_s)
        self._set_timeouts(conn, timeout_s, lock_timeout_s)
        conn.exec_driver_sql(self.sql("START TRANSACTION", tag))
        row = conn.execute(_IDENTITY).mappings().one()
        return TxIdentity("mariadb", {
            "connection_id": int(row["connection_id"]),
            "server_id": int(row["server_id"]),
            "hostname": str(row["hostname"]),
            "server_started": int(row["server_started"]),
        })

    def begin_read(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        conn.exec_driver_sql("SET SESSION max_statement_time = %s", (float(timeout_s),))
        conn.exec_driver_sql(self.sql("START TRANSACTION READ ONLY", tag))

    def end_read(self, conn: sa.Connection) -> None:
        self.reset_session(conn)

    def reset_session(self, conn: sa.Connection) -> None:
        conn.exec_driver_sql(
            "SET SESSION max_statement_time = DEFAULT, innodb_lock_wait_timeout = DEFAULT,"
            " idle_transaction_timeout = DEFAULT"
        )

    def is_timeout(self, exc: BaseException) -> bool:
        # 1969 statement timeout, 1205 lock wait timeout, 3024 max_execution_time
        return vendor_code(exc) in (1969, 1205, 3024)

    def is_read_only_violation(self, exc: BaseException) -> bool:
        return vendor_code(exc) in (1792, 1290)

    def is_unique_violation(self, exc: BaseException) -> bool:
        return vendor_code(exc) == 1062  # ER_DUP_ENTRY

    def is_undefined_table(self, exc: BaseException) -> bool:
        return vendor_code(exc) == 1146  # ER_NO_SUCH_TABLE

    def is_insufficient_privilege(self, exc: BaseException) -> bool:
        # ER_TABLEACCESS_DENIED_ERROR, ER_COLUMNACCESS_DENIED_ERROR, ER_DBACCESS_DENIED_ERROR,
        # ER_SPECIFIC_ACCESS_DENIED_ERROR
        return vendor_code(exc) in (1142, 1143, 1044, 1227)

    def server_identity(self, conn: sa.Connection) -> dict[str, Any]:
        row = conn.execute(_IDENTITY).mappings().one()
        return {"server_id": int(row["server_id"]), "hostname": str(row["hostname"]),
                "server_started": int(row["server_started"])}

    def _same_server(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        now = self.server_identity(conn)
        started = identity.get("server_started")
        return (
            now["server_id"] == identity.get("server_id")
            and now["hostname"] == identity.get("hostname")
            and started is not None
            and abs(now["server_started"] - int(started)) <= 2
        )

    def session_alive(self, conn: sa.Connection, identity: dict[str, Any]) -> bool | None:
        cid = identity.get("connection_id")
        if cid is None:
            return None
        if not self._same_server(conn, identity):
            return False  # the server restarted: that session and its transaction are gone
        found = conn.execute(sa.text(
            "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = :cid"
        ), {"cid": int(cid)}).scalar_one()
        return bool(found)

    def open_transaction(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        """Whether the recorded connection still has an InnoDB transaction open."""
        cid = identity.get("connection_id")
        if cid is None or not self._same_server(conn, identity):
            return False
        found = conn.execute(sa.text(
            "SELECT count(*) FROM information_schema.INNODB_TRX"
            " WHERE trx_mysql_thread_id = :cid"
        ), {"cid": int(cid)}).scalar_one()
        return bool(found)

    def marker_key_state(self, conn: sa.Connection, idem_key: str) -> str:
        """Whether a transaction holds ``idem_key`` in ``capgate_landed``, asked without PROCESS.

        ``INNODB_TRX`` needs the PROCESS privilege; a least-privilege account
        can still find out by trying to insert a marker row with the same
        key in a transaction of its own (always rolled back): InnoDB makes
        the insert wait for an open transaction that inserted that key.
        Answers ``held`` (a transaction that inserted it is still open),
        ``taken`` (a committed marker has it) or ``free`` (no transaction
        holds it: any that inserted it is over and did not commit).
        """
        conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
        try:
            conn.execute(sa.text(MARKER_INSERT), {
                "intent_id": "probe-" + uuid.uuid4().hex, "idem_key": idem_key,
                "fingerprint": "probe", "attempt": 0, "case_id": "capgate.resume",
                "operation_id": "capgate.resume.probe", "landed_at": "probe"})
            return "free"
        except sa.exc.DBAPIError as exc:
            code = vendor_code(exc)
            if code == 1062:  # ER_DUP_ENTRY
                return "taken"
            if code == 1205:  # ER_LOCK_WAIT_TIMEOUT: an open transaction holds the key
                return "held"
            raise
        finally:
            conn.rollback()
            conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = DEFAULT")

    def terminate_session(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        if not self.session_alive(conn, identity):
            return False
        conn.exec_driver_sql("KILL CONNECTION %s", (int(identity["connection_id"]),))
        return True

    def cancel_statement(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        if not self.session_alive(conn, identity):
            return False
        conn.exec_driver_sql("KILL QUERY %s", (int(identity["connection_id"]),))
        return True
