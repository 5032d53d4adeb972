"""Oracle (python-oracledb thin mode): end-to-end tracing attributes, LTXID.

Written against Oracle's documented interfaces and python-oracledb's API;
tested only where an Oracle is reachable (``CAPGATE_TEST_ORACLE_DSN``, or a
``gvenzl/oracle-free`` container): ``tests/test_oracle_executor.py``.

* Sessions: every connection of a connector's engine runs
  ``ALTER SESSION SET NLS_DATE_FORMAT = 'YYYY-MM-DD'`` once, when it is made
  (a SQLAlchemy ``connect`` event installed by :meth:`prepare_engine`).  The
  capability rows bind dates as ISO strings (``'2024-08-15'``) and compare or
  store them against ``DATE`` columns; Oracle converts such a string with the
  session's ``NLS_DATE_FORMAT``, whose default (``DD-MON-RR``) would reject it
  (ORA-01861); client NLS environment variables (``NLS_LANG``,
  ``NLS_DATE_FORMAT``) are a Thick-mode feature, so only the session can say it.
  The seed data itself uses ANSI ``DATE '...'`` literals and needs no setting.
  ``DATE`` values still come back as ``datetime`` (midnight), so evidence shows
  ``2024-07-01T00:00:00`` where PostgreSQL shows ``2024-07-01``.
* Tagging: ``module`` (``capgate``), ``action`` (operation id),
  ``clientinfo`` (intent id) and ``client_identifier`` (case id) are sent with
  the next round trip -- the transaction's first statement -- and show in
  ``V$SESSION`` (and ``SYS_CONTEXT('USERENV', ...)``).  The reset after a call
  is likewise sent with the connection's next round trip, so an idle pooled
  session keeps showing its last call's labels until it is used again.
* Timeouts: ``call_timeout`` bounds every round trip on the client (thin mode
  sends a break; ``DPY-4024`` when the session recovered, ``DPY-4011`` when it
  did not and the connection was closed).  Oracle has no lock timeout for DML
  and no per-transaction idle timeout a session can set for itself (profiles'
  ``IDLE_TIME`` counts minutes; Resource Manager's ``MAX_IDLE_BLOCKER_TIME``
  is DBA configuration), so row-lock waits are bounded by the call timeout
  and the lease is not enforced server-side here.  A timeout *around COMMIT*
  (or ROLLBACK) says nothing about whether the commit landed, so
  :meth:`prepare_engine` marks it a disconnect: the connection is discarded
  and the executor reports the outcome as unknown (for ``resume``), never as
  rolled back.
* Commit outcome: Transaction Guard.  The logical transaction id (``ltxid``)
  is recorded before COMMIT; ``DBMS_APP_CONT.GET_LTXID_OUTCOME`` later says
  whether it committed and whether the user call completed (and, when it did
  not commit, blocks that LTXID from committing later).  It needs a service
  with ``COMMIT_OUTCOME=TRUE`` (otherwise the driver reports no LTXID and
  ``ltxid`` is recorded as None) and ``EXECUTE`` on ``DBMS_APP_CONT``
  (without it the answer is None, unknowable).  An LTXID names a session's
  next commit and is reused after a rollback, so it speaks for our
  transaction only when that session ended (crash, lost connection) before it
  committed anything else -- the case it is asked about; ORA-14950 (the
  session committed later transactions), ORA-14951 (evidence from another
  database incarnation), ORA-14906 (asked on the owning session) and
  ORA-14952 (undeterminable) all mean unknown.
"""

from __future__ import annotations

from typing import Any, ClassVar

import sqlalchemy as sa

from executor.dialects.base import (
    FENCE_TABLE,
    MARKER_TABLE,
    REARM_AFTER_SECONDS,
    Dialect,
    SessionTag,
    TxIdentity,
    sqlstate,
)

NLS_SETUP = "ALTER SESSION SET NLS_DATE_FORMAT = 'YYYY-MM-DD'"

_OUTCOME = sa.text("""
DECLARE
  c BOOLEAN;
  u BOOLEAN;
BEGIN
  DBMS_APP_CONT.GET_LTXID_OUTCOME(HEXTORAW(:ltxid), c, u);
  :committed := CASE WHEN c THEN 1 ELSE 0 END;
  :completed := CASE WHEN u THEN 1 ELSE 0 END;
END;""").bindparams(
    sa.bindparam("ltxid", type_=sa.String()),
    sa.outparam("committed", sa.Integer()),
    sa.outparam("completed", sa.Integer()),
)

# Transaction Guard answers that mean "no evidence": server ahead, client ahead,
# same session, undeterminable
_OUTCOME_UNKNOWN = ("ORA-14950", "ORA-14951", "ORA-14906", "ORA-14952")


def _driver(conn: sa.Connection) -> Any:
    return conn.connection.driver_connection


def _message(exc: BaseException) -> str:
    return str(getattr(exc, "orig", None) or exc)


class OracleDialect(Dialect):
    name: ClassVar[str] = "oracle"
    commit_outcome_probe: ClassVar[bool] = True

    def prepare_engine(self, engine: sa.Engine) -> None:
        """ISO date binds on every new connection; a timeout around COMMIT is a disconnect."""

        def set_nls(dbapi_connection: Any, connection_record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(NLS_SETUP)
            finally:
                cursor.close()

        def timeout_outside_statement(ctx: sa.engine.ExceptionContext) -> None:
            # statement None: COMMIT or ROLLBACK (Oracle sends no BEGIN).  The break the
            # call timeout sent may have arrived before or after the commit completed.
            if ctx.statement is None and not ctx.is_pre_ping \
                    and self.is_timeout(ctx.original_exception):
                ctx.is_disconnect = True
                ctx.invalidate_pool_on_disconnect = False  # only this connection

        sa.event.listen(engine, "connect", set_nls)
        sa.event.listen(engine, "handle_error", timeout_outside_statement)

    def target_ddl(self) -> dict[str, str]:
        return {
            MARKER_TABLE: (
                f"CREATE TABLE {MARKER_TABLE} ("
                " intent_id VARCHAR2(64) NOT NULL PRIMARY KEY,"
                " idem_key VARCHAR2(400) NOT NULL UNIQUE,"
                " fingerprint VARCHAR2(80) NOT NULL,"
                " attempt NUMBER(10) NOT NULL,"
                " case_id VARCHAR2(200) NOT NULL,"
                " operation_id VARCHAR2(64) NOT NULL,"
                " landed_at VARCHAR2(40) NOT NULL)"),
            FENCE_TABLE: (
                f"CREATE TABLE {FENCE_TABLE} (key_hash VARCHAR2(64) NOT NULL PRIMARY KEY,"
                " impact_key VARCHAR2(400) NOT NULL, token NUMBER(19) NOT NULL,"
                " intent_id VARCHAR2(64) NOT NULL)"),
        }

    def is_unique_violation(self, exc: BaseException) -> bool:
        return "ORA-00001" in _message(exc)

    def is_undefined_table(self, exc: BaseException) -> bool:
        # ORA-00942: table or view does not exist -- Oracle also says this when the
        # table exists but the account has no privilege on it
        return "ORA-00942" in _message(exc)

    def is_insufficient_privilege(self, exc: BaseException) -> bool:
        return "ORA-01031" in _message(exc)

    def _tag(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        raw = _driver(conn)
        raw.module = "capgate"
        raw.action = tag.operation_id[:32]
        raw.clientinfo = tag.intent_id[:64]
        raw.client_identifier = tag.case_id[:64]
        raw.call_timeout = max(1, int(timeout_s * 1000))

    def arm_deadline(self, raw: Any, left: float) -> None:
        # no server-side idle timeout a session can set for itself: the call timeout
        # (client side) bounds each round trip to the time left
        raw.call_timeout = max(1, int((left + REARM_AFTER_SECONDS) * 1000))

    def open_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                   lock_timeout_s: float | None) -> TxIdentity:
        # lock_timeout_s: Oracle has no DML lock timeout; the call timeout bounds lock waits
        self.start_deadline(conn, timeout_s)
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
        raw.client_identifier = ""

    def end_read(self, conn: sa.Connection) -> None:
        self.reset_session(conn)

    def is_timeout(self, exc: BaseException) -> bool:
        text = _message(exc)
        # DPY-4024 call timeout (session recovered); DPY-4011 "socket timed out while
        # recovering": the call timeout closed the connection; ORA-01013 user requested
        # cancel; ORA-30006 resource busy (WAIT n); ORA-00054 resource busy (NOWAIT)
        if "DPY-4011" in text and "timed out" in text:
            return True
        return any(code in text for code in ("DPY-4024", "ORA-01013", "ORA-30006", "ORA-00054"))

    def is_read_only_violation(self, exc: BaseException) -> bool:
        return "ORA-01456" in _message(exc) or sqlstate(exc) == "1456"

    def commit_outcome(self, conn: sa.Connection, identity: dict[str, Any]) -> str | None:
        ltxid = identity.get("ltxid")
        if not ltxid:
            return None
        try:
            result = conn.execute(_OUTCOME, {"ltxid": str(ltxid)})
        except sa.exc.DBAPIError as exc:
            text = _message(exc)
            if any(code in text for code in _OUTCOME_UNKNOWN):
                return None
            if "ORA-01031" in text or ("PLS-00201" in text and "DBMS_APP_CONT" in text):
                return None  # no EXECUTE on DBMS_APP_CONT: the outcome is unknowable here
            raise
        out: dict[str, Any] = getattr(result, "out_parameters", None) or {}
        committed, completed = out.get("committed"), out.get("completed")
        if committed is None:
            return None
        if int(committed) == 1:
            return "committed" if completed is not None and int(completed) == 1 \
                else "committed_incomplete"
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
        try:
            conn.execute(sa.text(f"ALTER SYSTEM KILL SESSION '{sid},{serial}' IMMEDIATE"))
        except sa.exc.DatabaseError as exc:
            # ORA-01031 no ALTER SYSTEM privilege; ORA-00030 the session ended meanwhile
            if any(code in _message(exc) for code in ("ORA-01031", "ORA-00030")):
                return False
            raise
        return True
