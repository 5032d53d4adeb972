"""Oracle (python-oracledb thin mode): end-to-end tracing attributes, LTXID.

Written against Oracle's documented interfaces and python-oracledb's API;
tested only where an Oracle is reachable (``CAPGATE_TEST_ORACLE_DSN``).

* Tagging: ``module`` / ``action`` / ``clientinfo`` / ``client_identifier`` are
  sent with the next round trip and show in ``V$SESSION``.
* Timeouts: ``call_timeout`` bounds every round trip on the client.  Oracle has
  no per-transaction idle timeout a session can set for itself (profiles'
  ``IDLE_TIME`` counts minutes; Resource Manager's ``MAX_IDLE_BLOCKER_TIME``
  is DBA configuration), so the lease is not enforced server-side here.
* Commit outcome: Transaction Guard.  The logical transaction id (``ltxid``)
  is recorded before COMMIT; ``DBMS_APP_CONT.GET_LTXID_OUTCOME`` later says
  whether it committed and whether the user call completed.  It needs a
  service with ``COMMIT_OUTCOME=TRUE`` and ``EXECUTE`` on ``DBMS_APP_CONT``;
  ORA-14950/14951 (evidence expired or from another database) mean unknown.
"""

from __future__ import annotations

from typing import Any, ClassVar

import sqlalchemy as sa

from executor.dialects.base import MARKER_TABLE, Dialect, SessionTag, TxIdentity, sqlstate

_OUTCOME_BLOCK = """
DECLARE
  c BOOLEAN;
  u BOOLEAN;
BEGIN
  DBMS_APP_CONT.GET_LTXID_OUTCOME(HEXTORAW(:ltxid), c, u);
  :committed := CASE WHEN c THEN 1 ELSE 0 END;
  :completed := CASE WHEN u THEN 1 ELSE 0 END;
END;"""


def _driver(conn: sa.Connection) -> Any:
    return conn.connection.driver_connection


class OracleDialect(Dialect):
    name: ClassVar[str] = "oracle"
    commit_outcome_probe: ClassVar[bool] = True

    def marker_ddl(self) -> list[str]:
        return [
            f"CREATE TABLE {MARKER_TABLE} ("
            " intent_id VARCHAR2(64) NOT NULL PRIMARY KEY,"
            " idem_key VARCHAR2(400) NOT NULL UNIQUE,"
            " fingerprint VARCHAR2(80) NOT NULL,"
            " attempt NUMBER(10) NOT NULL,"
            " case_id VARCHAR2(200) NOT NULL,"
            " operation_id VARCHAR2(64) NOT NULL,"
            " landed_at VARCHAR2(40) NOT NULL)"
        ]

    def ensure_marker_table(self, conn: sa.Connection) -> None:
        try:
            for ddl in self.marker_ddl():
                conn.execute(sa.text(ddl))
        except sa.exc.DatabaseError as exc:
            if "ORA-00955" not in str(exc):  # name is already used by an existing object
                raise

    def _tag(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        raw = _driver(conn)
        raw.module = "capgate"
        raw.action = tag.operation_id[:32]
        raw.clientinfo = tag.intent_id[:64]
        raw.client_identifier = tag.case_id[:64]
        raw.call_timeout = max(1, int(timeout_s * 1000))

    def open_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                   lock_timeout_s: float | None) -> TxIdentity:
        self._tag(conn, tag, timeout_s)
        raw = _driver(conn)
        ltxid = bytes(raw.ltxid or b"").hex()
        return TxIdentity("oracle", {
            "ltxid": ltxid or None,
            "sid": raw.session_id,
            "serial": raw.serial_num,
        })

    def begin_read(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        self._tag(conn, tag, timeout_s)
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))

    def reset_session(self, conn: sa.Connection) -> None:
        raw = _driver(conn)
        raw.call_timeout = 0
        raw.action = ""
        raw.clientinfo = ""

    def end_read(self, conn: sa.Connection) -> None:
        self.reset_session(conn)

    def is_timeout(self, exc: BaseException) -> bool:
        text = str(getattr(exc, "orig", exc))
        # DPY-4024 call timeout; ORA-01013 user requested cancel; ORA-30006 resource busy
        return any(code in text for code in ("DPY-4024", "ORA-01013", "ORA-30006", "ORA-00054"))

    def is_read_only_violation(self, exc: BaseException) -> bool:
        return "ORA-01456" in str(getattr(exc, "orig", exc)) or sqlstate(exc) == "1456"

    def commit_outcome(self, conn: sa.Connection, identity: dict[str, Any]) -> str | None:
        ltxid = identity.get("ltxid")
        if not ltxid:
            return None
        cursor = _driver(conn).cursor()
        try:
            committed = cursor.var(int)
            completed = cursor.var(int)
            cursor.execute(_OUTCOME_BLOCK, ltxid=ltxid, committed=committed,
                           completed=completed)
        except Exception as exc:
            if any(code in str(exc) for code in ("ORA-14950", "ORA-14951", "ORA-14906")):
                return None
            raise
        finally:
            cursor.close()
        if committed.getvalue() == 1:
            return "committed" if completed.getvalue() == 1 else "committed_incomplete"
        return "aborted"

    def session_alive(self, conn: sa.Connection, identity: dict[str, Any]) -> bool | None:
        sid, serial = identity.get("sid"), identity.get("serial")
        if sid is None or serial is None:
            return None
        try:
            found = conn.execute(sa.text(
                "SELECT count(*) FROM v$session WHERE sid = :sid AND serial# = :serial"
            ), {"sid": int(sid), "serial": int(serial)}).scalar_one()
        except sa.exc.DatabaseError:
            return None  # no SELECT on V$SESSION: liveness is unknowable, not "dead"
        return bool(found)

    def terminate_session(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        if not self.session_alive(conn, identity):
            return False
        sid, serial = int(identity["sid"]), int(identity["serial"])
        conn.execute(sa.text(f"ALTER SYSTEM KILL SESSION '{sid},{serial}' IMMEDIATE"))
        return True
