"""Oracle (python-oracledb, Thin or Thick mode): labels, identity, commit outcome, liveness.

Written against Oracle's documented interfaces and python-oracledb's API.
What runs here without an Oracle is proven offline (``tests/test_oracle_offline.py``:
every SQL text below parses with sqlglot's Oracle dialect, the driver checks,
the date binds); everything that needs a server runs wherever one answers
(``CAPGATE_TEST_ORACLE_DSN``, or a ``gvenzl/oracle-free`` container):
``tests/test_executor.py`` and ``tests/test_oracle_recovery.py``.

* **Driver.**  python-oracledb 3.0 or later (:data:`MIN_DRIVER`): 2.5 gave the
  Thin mode ``session_id``/``serial_num``, 3.0 its ``ltxid`` -- an older Thin
  driver reports an empty LTXID, and Transaction Guard would silently never be
  asked.  Thin or Thick is what the driver reports (``Connection.thin``,
  ``oracledb.is_thin_mode()``), never guessed from a missing attribute: only
  Thin has ``serial_num``; Thick sessions are identified by what the server
  says in the opening round trip, and their serial number is looked up when
  needed.  Thick mode (network encryption, some wallets) is the connector's
  ``thick_mode`` setting, applied once per process before any connection.
* **Sessions.**  Every connection of a connector runs ``ALTER SESSION DISABLE
  COMMIT IN PROCEDURE`` once, when it is made: a procedure that COMMITs or
  ROLLs BACK inside a call fails (ORA-00034) instead of silently committing
  half of it.  No NLS setting is touched -- legacy PL/SQL may depend on the
  session's own.  Dates are bound as dates instead: inputs a row declares
  ``format: date`` (``date-time``) reach Oracle as ``datetime.date``
  (``datetime``), so a DATE column never meets a string and ``NLS_DATE_FORMAT``
  never decides (:meth:`OracleDialect.prepare_engine`).
* **Tagging.**  ``module`` (``capgate``), ``action`` (operation id),
  ``clientinfo`` (intent id) and ``client_identifier`` (case id) travel with the
  next round trip and show in ``(G)V$SESSION``.  They, the call timeout, the
  date binds and the recorded transaction id are reset when the call ends and
  again whenever a connection goes back to the pool (the pool's ``reset``):
  a pooled session never carries an old call's labels or timeout into the next.
* **Opening a write: one round trip.**  A PL/SQL block inserts the landing
  marker and returns the local transaction id (``DBMS_TRANSACTION.
  LOCAL_TRANSACTION_ID``), the session (``SID``, instance number -- RAC's
  ``INST_ID`` --, ``AUDSID``, ``DBMS_SESSION.UNIQUE_SESSION_ID``) and the
  database (``DB_UNIQUE_NAME``); Thin adds ``serial_num`` and both modes the
  LTXID.  That is the transaction identity recorded before any statement.
* **Before COMMIT** (:meth:`OracleDialect.before_commit`) the local transaction
  id is read again: a different one means something committed in between (DDL
  run by a procedure, a commit that slipped past the session setting), the
  marker and the LTXID would vouch for part of the call only, so the call is
  escalated (``TransactionSplit``), never reported as applied.
* **Timeouts.**  ``call_timeout`` bounds every round trip on the client (Thin:
  ``DPY-4024`` when the session recovered, ``DPY-4011`` when it was closed;
  Thick: ``DPI-1067`` / ``DPI-1080``).  Oracle has no lock timeout for DML and no
  per-transaction idle timeout a session can set, so a *hung* executor (SIGSTOP,
  a partition) keeps its row locks until its session is killed: leased rows are
  refused here (``LeaseNotEnforceable``), and resume kills exactly the recorded
  session.  A timeout -- or an in-doubt distributed commit, ORA-02050 / ORA-02054 --
  *around COMMIT* says nothing about whether the commit landed: the connection
  is treated as lost and the outcome is unknown (``resume``), never rolled back.
* **Commit outcome: Transaction Guard.**  With ``COMMIT_OUTCOME=TRUE`` on the
  service the LTXID recorded before COMMIT is asked through
  ``DBMS_APP_CONT.GET_LTXID_OUTCOME`` (which also blocks an uncommitted LTXID
  from committing later).  Without it -- the default, ``FREEPDB1`` included --
  the driver reports no LTXID; that is detected when each connection is made,
  logged (``capgate.oracle``), recorded with the attempt and reported by
  ``capgate doctor`` (CG916).  ORA-14950 / 14951 / 14906 / 14952 mean unknown.
* **Is the transaction over?**  Without an outcome from Transaction Guard,
  resume proves it without privileges: ``DBMS_SESSION.IS_SESSION_ALIVE`` on
  the recorded unique session id (a session that is gone can commit nothing),
  then -- when the session lives -- ``GV$SESSION`` on the recorded instance
  (RAC) if readable: the session must still carry this intent in
  ``CLIENT_INFO`` and have a transaction (``TADDR``); if ``GV$SESSION`` is not
  readable, a rolled-back insert of the marker's key answers it (an open
  transaction holds the key).  Only a session that is provably still ours, in
  a transaction, is killed (``ALTER SYSTEM KILL SESSION 'sid,serial,@inst'``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.dialects.base import (
    FENCE_READ,
    FENCE_TABLE,
    MARKER_INSERT,
    MARKER_TABLE,
    POLL_SECONDS,
    REARM_AFTER_SECONDS,
    Attempt,
    AttemptEvidence,
    Diagnosis,
    Dialect,
    SessionTag,
    TxIdentity,
    opening_by_marker_key,
    safe_url,
    sqlstate,
)
from capgate.registry.errors import (
    CommitOutcomeUnavailable,
    DriverModeConflict,
    DriverUnsupported,
    LeaseNotEnforceable,
    PrivilegeMissing,
    TransactionSplit,
)

LOG = logging.getLogger("capgate.oracle")

MIN_DRIVER = (3, 0, 0)
"""python-oracledb 2.5 added Thin ``session_id``/``serial_num``; 3.0 Thin ``ltxid``."""

SESSION_SETUP = ("ALTER SESSION DISABLE COMMIT IN PROCEDURE",)
"""Run once on every new connection of a connector (a session setting lasts its life)."""

_MARKER_VALUES = MARKER_INSERT  # the landing marker's INSERT, folded into the opening block
_IDENTITY = """
  :cg_txid := DBMS_TRANSACTION.LOCAL_TRANSACTION_ID(TRUE);
  :cg_sid := SYS_CONTEXT('USERENV', 'SID');
  :cg_inst := SYS_CONTEXT('USERENV', 'INSTANCE');
  :cg_audsid := SYS_CONTEXT('USERENV', 'SESSIONID');
  :cg_usid := DBMS_SESSION.UNIQUE_SESSION_ID;
  :cg_db := SYS_CONTEXT('USERENV', 'DB_UNIQUE_NAME');"""
OPEN_BLOCK = f"BEGIN{_IDENTITY}\nEND;"
"""Open a write transaction (``TRUE``: start one) and say who we are: one round trip."""
OPEN_MARKED_BLOCK = f"BEGIN\n  {_MARKER_VALUES};{_IDENTITY}\nEND;"
"""The same, with the landing marker inserted first (its unique key is the dedup)."""
TXID_NOW = "SELECT DBMS_TRANSACTION.LOCAL_TRANSACTION_ID FROM dual"
DB_NOW = "SELECT SYS_CONTEXT('USERENV', 'DB_UNIQUE_NAME') FROM dual"
OUTCOME_BLOCK = """
DECLARE
  c BOOLEAN;
  u BOOLEAN;
BEGIN
  DBMS_APP_CONT.GET_LTXID_OUTCOME(HEXTORAW(:ltxid), c, u);
  :committed := CASE WHEN c THEN 1 ELSE 0 END;
  :completed := CASE WHEN u THEN 1 ELSE 0 END;
END;"""
ALIVE_BLOCK = """
BEGIN
  :alive := CASE WHEN DBMS_SESSION.IS_SESSION_ALIVE(:usid) THEN 1 ELSE 0 END;
END;"""
"""Privilege-free: whether the recorded session still exists (DBMS_SESSION is PUBLIC)."""
SESSION_BY_SERIAL = (
    'SELECT s."SERIAL#", s.client_info, CASE WHEN s.taddr IS NULL THEN 0 ELSE 1 END'
    " FROM gv$session s WHERE s.inst_id = :inst AND s.sid = :sid"
    ' AND s."SERIAL#" = :serial')
SESSION_BY_AUDSID = (
    'SELECT s."SERIAL#", s.client_info, CASE WHEN s.taddr IS NULL THEN 0 ELSE 1 END'
    " FROM gv$session s WHERE s.inst_id = :inst AND s.sid = :sid AND s.audsid = :audsid")
"""RAC-aware: the session on its own instance; (sid, serial#) or (sid, audsid) is one session."""
IN_DOUBT = "SELECT state FROM dba_2pc_pending WHERE local_tran_id = :txid"
KILL_SESSION = "ALTER SYSTEM KILL SESSION '{sid},{serial},@{inst}' IMMEDIATE"
"""No bind is possible in ALTER SYSTEM: the three values are integers, checked as such."""

SQL_TEXTS: dict[str, str] = {
    "session_setup": SESSION_SETUP[0], "open": OPEN_BLOCK, "open_marked": OPEN_MARKED_BLOCK,
    "txid_now": TXID_NOW, "db_now": DB_NOW, "outcome": OUTCOME_BLOCK, "alive": ALIVE_BLOCK,
    "session_by_serial": SESSION_BY_SERIAL, "session_by_audsid": SESSION_BY_AUDSID,
    "in_doubt": IN_DOUBT, "kill": KILL_SESSION.format(sid=1, serial=2, inst=1),
}
"""Every SQL text this module sends, by name (the offline tests parse each one)."""

_OUT = ("cg_txid", "cg_sid", "cg_inst", "cg_audsid", "cg_usid", "cg_db")


def _opening(marked: bool) -> sa.TextClause:
    return sa.text(OPEN_MARKED_BLOCK if marked else OPEN_BLOCK).bindparams(
        *(sa.outparam(name, sa.String()) for name in _OUT))


_OPEN = _opening(False)
_OPEN_MARKED = _opening(True)
_OUTCOME = sa.text(OUTCOME_BLOCK).bindparams(
    sa.bindparam("ltxid", type_=sa.String()),
    sa.outparam("committed", sa.Integer()),
    sa.outparam("completed", sa.Integer()),
)
_ALIVE = sa.text(ALIVE_BLOCK).bindparams(sa.bindparam("usid", type_=sa.String()),
                                         sa.outparam("alive", sa.Integer()))

# Transaction Guard answers that mean "no evidence": server ahead, client ahead,
# same session, undeterminable
_OUTCOME_UNKNOWN = ("ORA-14950", "ORA-14951", "ORA-14906", "ORA-14952")
# around COMMIT these leave the outcome open: the call timeout's break, an in-doubt
# distributed transaction (ORA-02050 rolled back locally but remote databases may be
# in doubt; ORA-02054 in doubt)
IN_DOUBT_CODES = ("ORA-02050", "ORA-02054")
_NO_VIEW = ("ORA-00942", "ORA-01031", "ORA-41900")

_TXID_KEY = "capgate_oracle_txid"
_DATES_KEY = "capgate_oracle_dates"
_NO_LTXID_KEY = "capgate_oracle_no_ltxid"


# --- the driver -------------------------------------------------------------------------


def version_tuple(version: str) -> tuple[int, ...]:
    """``"3.4.1"`` -> (3, 4, 1); a pre-release suffix (``3.0.0b1``) keeps its numbers."""
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        m = re.match(r"\d+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def driver() -> Any:
    """The python-oracledb module (imported here: only Oracle connectors need it)."""
    import oracledb

    return oracledb


def check_driver(module: Any | None = None) -> str:
    """The driver's mode (``thin``/``thick``) -- refusing a driver older than 3.0.

    ``module`` is the ``oracledb`` module (the real one unless a test passes its own).
    """
    mod = driver() if module is None else module
    version = str(getattr(mod, "__version__", "0"))
    if version_tuple(version) < MIN_DRIVER:
        raise DriverUnsupported(
            f"python-oracledb {version} is installed; capgate needs "
            f"{'.'.join(map(str, MIN_DRIVER))} or later (Thin session_id/serial_num came in "
            "2.5, the Thin LTXID -- Transaction Guard -- in 3.0): pip install -U oracledb",
            driver="python-oracledb", version=version,
            required=".".join(map(str, MIN_DRIVER)))
    return "thin" if mod.is_thin_mode() else "thick"


def enable_thick(options: Mapping[str, Any] | bool, module: Any | None = None) -> str:
    """Switch the process to Thick mode (once, before any connection); the mode after.

    ``options`` is ``True`` or ``{lib_dir, config_dir, driver_name}`` for
    ``oracledb.init_oracle_client``.  A process already in Thin mode (a
    connection was made) cannot switch: python-oracledb refuses, and so do we.
    """
    mod = driver() if module is None else module
    if not mod.is_thin_mode():
        return "thick"  # already initialised (the library decides only once)
    kwargs = dict(options) if isinstance(options, Mapping) else {}
    mod.init_oracle_client(**kwargs)
    return "thick" if not mod.is_thin_mode() else "thin"


@dataclass(frozen=True)
class SessionFacts:
    """What the server says about a recorded session (resume's evidence)."""

    alive: bool | None
    """The session exists (None: nothing could be asked)."""
    ours: bool | None = None
    """Its ``CLIENT_INFO`` still names the intent (None: ``GV$SESSION`` not readable)."""
    in_transaction: bool | None = None
    """It has a transaction (``GV$SESSION.TADDR``); None when not readable."""
    serial: int | None = None
    source: str = ""

    @property
    def may_commit(self) -> bool | None:
        """Whether our transaction may still commit: alive, ours, in a transaction."""
        if self.alive is False or self.ours is False or self.in_transaction is False:
            return False
        if self.alive and self.ours and self.in_transaction:
            return True
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"alive": self.alive, "ours": self.ours, "in_transaction": self.in_transaction,
                "serial": self.serial, "source": self.source}


def _driver(conn: sa.Connection) -> Any:
    return conn.connection.driver_connection


def _message(exc: BaseException) -> str:
    return str(getattr(exc, "orig", None) or exc)


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None and str(value).strip() != "" else None
    except (TypeError, ValueError):
        return None


def convert_dates(parameters: Any, names: Mapping[str, str]) -> Any:
    """ISO strings of the inputs in ``names`` (name -> ``date``/``date-time``) as dates.

    A value that is not a valid ISO date is left as it is: Oracle then refuses
    it with its own error (ORA-01861), which rolls the call back -- capgate never
    guesses a date.  Bind names may reach the driver quoted (reserved words).
    """
    def one(params: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(params)
        for key, value in params.items():
            kind = names.get(str(key).strip('"').lower())
            if kind is None or not isinstance(value, str):
                continue
            try:
                if kind == "date":
                    out[key] = dt.date.fromisoformat(value)
                else:
                    out[key] = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                pass
        return out

    if isinstance(parameters, Mapping):
        return one(parameters)
    if isinstance(parameters, list | tuple) and all(isinstance(p, Mapping) for p in parameters):
        return [one(p) for p in parameters]
    return parameters


# --- the dialect ----------------------------------------------------------------------------


FENCE_MERGE = (
    f"MERGE INTO {FENCE_TABLE} f USING (SELECT :h AS key_hash, :k AS impact_key,"
    " :t AS token, :i AS intent_id FROM dual) s ON (f.key_hash = s.key_hash)"
    " WHEN MATCHED THEN UPDATE SET f.token = s.token, f.intent_id = s.intent_id"
    " WHERE f.token <= s.token"
    " WHEN NOT MATCHED THEN INSERT (key_hash, impact_key, token, intent_id)"
    " VALUES (s.key_hash, s.impact_key, s.token, s.intent_id)")
"""The fence upsert: Oracle has no ``ON CONFLICT``; a MERGE that moved the row counts 1."""

# capgate doctor's read-only checks (written against Oracle's documentation)
ORA_IDENTITY = ("SELECT SYS_CONTEXT('USERENV', 'DB_UNIQUE_NAME'), SYS_CONTEXT('USERENV', "
                "'SERVICE_NAME'), SYS_CONTEXT('USERENV', 'INSTANCE_NAME'), USER FROM dual")
ORA_PRIVS = "SELECT privilege FROM session_privs"
ORA_EXCESS_ROLES: dict[str, str] = {
    "DBA": "every system privilege",
    "IMP_FULL_DATABASE": "can import over any schema",
    "EXP_FULL_DATABASE": "can export every schema",
    "DATAPUMP_IMP_FULL_DATABASE": "can import over any schema",
    "DATAPUMP_EXP_FULL_DATABASE": "can export every schema",
}
"""Roles that hand an account the whole database (least privilege, ``capgate doctor``)."""
ORA_EXCESS_ROLES_SQL = ("SELECT role FROM session_roles WHERE role IN ("
                        + ", ".join(f"'{r}'" for r in ORA_EXCESS_ROLES) + ") ORDER BY role")
ORA_EXCESS_PRIVS_SQL = ("SELECT privilege FROM session_privs WHERE privilege LIKE '% ANY %' "
                        "OR privilege LIKE '% ANY' OR privilege IN ('SYSDBA', 'SYSOPER', "
                        "'SYSBACKUP', 'BECOME USER', 'EXEMPT ACCESS POLICY', 'ALTER USER', "
                        "'ADMINISTER DATABASE TRIGGER') ORDER BY privilege")
ORA_OWNER = ("SELECT owner FROM all_objects WHERE object_name = UPPER(:t) "
             "AND object_type IN ('TABLE', 'VIEW', 'SYNONYM') AND ROWNUM = 1")
ORA_TAB_PRIV = "SELECT count(*) FROM all_tab_privs WHERE table_name = UPPER(:t) AND privilege = :p"
ORA_SESSIONS_PER_USER = ('SELECT "LIMIT" FROM user_resource_limits '
                         "WHERE resource_name = 'SESSIONS_PER_USER'")
ORA_COMMIT_OUTCOME = ("SELECT commit_outcome FROM all_services "
                      "WHERE name = SYS_CONTEXT('USERENV', 'SERVICE_NAME')")
ORA_APP_CONT = ("SELECT count(*) FROM all_objects WHERE owner = 'SYS' "
                "AND object_name = 'DBMS_APP_CONT' AND object_type = 'PACKAGE'")
ORA_GV_SESSION = "SELECT count(*) FROM gv$session WHERE ROWNUM = 1"
ORA_2PC_PENDING = "SELECT count(*) FROM dba_2pc_pending WHERE ROWNUM = 1"
DOCTOR_QUERIES = {"identity": ORA_IDENTITY, "privs": ORA_PRIVS, "owner": ORA_OWNER,
                  "tab_priv": ORA_TAB_PRIV, "sessions_per_user": ORA_SESSIONS_PER_USER,
                  "commit_outcome": ORA_COMMIT_OUTCOME, "app_cont": ORA_APP_CONT,
                  "gv_session": ORA_GV_SESSION, "2pc_pending": ORA_2PC_PENDING,
                  "excess_roles": ORA_EXCESS_ROLES_SQL, "excess_privs": ORA_EXCESS_PRIVS_SQL}
"""Every query ``capgate doctor`` sends to Oracle (the offline tests parse each one)."""


class OracleDialect(Dialect, name="oracle"):
    title: ClassVar[str] = "Oracle"
    driver: ClassVar[str | None] = "oracle+oracledb"
    url_schemes: ClassVar[frozenset[str]] = frozenset({"oracle"})
    connector_settings: ClassVar[frozenset[str]] = frozenset({"thick_mode", "current_schema"})
    ping_sql: ClassVar[str] = "SELECT 1 FROM dual"  # a query needs FROM before 23ai
    fence_upsert: ClassVar[str] = FENCE_MERGE
    # a fresh cursor per statement, as before: python-oracledb keeps a cursor's bind
    # types from one execution to the next, and this cannot be run against Oracle here
    reuse_cursor: ClassVar[bool] = False

    def __init__(self) -> None:
        self.current_schema: str | None = None
        self._label = "(no engine)"
        self._warned = False

    def configure(self, options: Mapping[str, Any]) -> None:
        """``current_schema``: resolve unqualified names in the owner's schema (least privilege)."""
        schema = options.get("current_schema")
        self.current_schema = str(schema) if schema else None

    @classmethod
    def prepare_driver(cls, connector: str, settings: Mapping[str, Any]) -> None:
        """``thick_mode``: switch python-oracledb to Thick mode, once per process and before
        any connection -- refused (DriverModeConflict) once a Thin connection exists."""
        thick = settings.get("thick_mode")
        # the mode is the whole process's: a Thin connector in a process another
        # connector made Thick runs Thick (the dialect reads the mode from each connection)
        if thick and check_driver() == "thin":
            try:
                enable_thick(thick)
            except Exception as exc:  # the driver refuses once a Thin connection exists
                raise DriverModeConflict(
                    f"connector {connector!r} asks for python-oracledb Thick mode, but the "
                    f"process could not switch: {str(exc).splitlines()[0]}",
                    connector=connector) from None

    def prepare_engine(self, engine: sa.Engine) -> None:
        """Check the driver; set up each new session; dates bound as dates; pool resets;
        a timeout or in-doubt error around COMMIT is a lost connection (outcome unknown)."""
        check_driver()
        self._label = safe_url(engine.url)

        def reset(dbapi_connection: Any, connection_record: Any, reset_state: Any) -> None:
            for key in (_TXID_KEY, _DATES_KEY):
                connection_record.info.pop(key, None)
            with contextlib.suppress(Exception):  # a connection already closed: nothing to undo
                self._reset_raw(dbapi_connection)

        def bind_dates(conn: sa.Connection, cursor: Any, statement: str, parameters: Any,
                       context: Any, executemany: bool) -> tuple[str, Any]:
            names = conn.info.get(_DATES_KEY)
            if names:
                parameters = convert_dates(parameters, names)
            return statement, parameters

        sa.event.listen(engine, "connect", self.session_setup)
        sa.event.listen(engine, "reset", reset)
        sa.event.listen(engine, "before_cursor_execute", bind_dates, retval=True)
        sa.event.listen(engine, "handle_error", self.on_error)

    def session_setup(self, dbapi_connection: Any, connection_record: Any) -> None:
        """``connect``: the session settings, and whether Transaction Guard is on.

        A session with no LTXID means the service has no ``COMMIT_OUTCOME``: said once
        per connector (``capgate.oracle`` log, the target without secrets), recorded
        with every attempt, and reported by ``capgate doctor``.
        """
        if self.current_schema:
            dbapi_connection.current_schema = self.current_schema
        cursor = dbapi_connection.cursor()
        try:
            for statement in SESSION_SETUP:
                cursor.execute(statement)
        finally:
            cursor.close()
        try:
            ltxid = bytes(dbapi_connection.ltxid or b"")
        except Exception:  # a Thick client before 12.1 has none to give
            ltxid = b""
        if not ltxid:
            connection_record.info[_NO_LTXID_KEY] = True
            if not self._warned:
                self._warned = True
                LOG.warning(
                    "oracle %s: the service reports no logical transaction id (no "
                    "COMMIT_OUTCOME on the service, Transaction Guard off): after a lost "
                    "connection resume falls back on the landing marker and session "
                    "liveness; `capgate doctor` says how to enable it", self._label)

    def on_error(self, ctx: Any) -> None:
        """``handle_error``: around COMMIT (statement None; Oracle sends no BEGIN) a call
        timeout's break or an in-doubt distributed commit leaves the outcome open: treat
        the connection as lost, so the executor reports unknown and resume decides."""
        if ctx.statement is not None or getattr(ctx, "is_pre_ping", False):
            return
        text = _message(ctx.original_exception)
        if self.is_timeout(ctx.original_exception) or any(c in text for c in IN_DOUBT_CODES):
            ctx.is_disconnect = True
            ctx.invalidate_pool_on_disconnect = False  # only this connection

    def check_lease(self) -> None:
        raise LeaseNotEnforceable(
            "leased rows are refused on Oracle: nothing can end the transaction at its "
            "deadline if the executor hangs (no per-transaction idle timeout a session can "
            "set); use a collapsed row, or run it on PostgreSQL or MariaDB",
            dialect=self.name)

    # --- capgate's tables ---------------------------------------------------------------

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

    # --- errors ---------------------------------------------------------------------------

    def is_unique_violation(self, exc: BaseException) -> bool:
        return "ORA-00001" in _message(exc)

    def is_undefined_table(self, exc: BaseException) -> bool:
        # ORA-00942: table or view does not exist -- Oracle also says this when the
        # table exists but the account has no privilege on it
        return "ORA-00942" in _message(exc)

    def is_insufficient_privilege(self, exc: BaseException) -> bool:
        return "ORA-01031" in _message(exc)

    def is_session_limit(self, exc: BaseException) -> bool:
        # ORA-02391: exceeded simultaneous SESSIONS_PER_USER limit (the user's profile)
        return "ORA-02391" in _message(exc)

    def is_timeout(self, exc: BaseException) -> bool:
        text = _message(exc)
        # Thin: DPY-4024 call timeout (session recovered); DPY-4011 "... timed out"
        # (the call timeout closed the connection).  Thick: DPI-1067 call timeout
        # exceeded; DPI-1080 closed by ORA-3156 (timed out).  ORA-01013 user requested
        # cancel; ORA-30006 resource busy (WAIT n); ORA-00054 resource busy (NOWAIT)
        if "DPY-4011" in text and "timed out" in text:
            return True
        if "DPI-1080" in text and ("3156" in text or "timed out" in text):
            return True
        return any(code in text for code in ("DPY-4024", "DPI-1067", "ORA-01013",
                                             "ORA-30006", "ORA-00054"))

    def is_read_only_violation(self, exc: BaseException) -> bool:
        return "ORA-01456" in _message(exc) or sqlstate(exc) == "1456"

    def budget_user_scope(self, url: URL, connect_args: Mapping[str, Any]) -> str | None:
        """ORA-02391 counts a user's sessions per database: key ``USER@service``.

        The service (``service_name``), else the SID, else the TNS alias or DSN --
        never the host, so RAC nodes, a SCAN address and a VIP of one database
        share one budget.  Oracle folds unquoted user names to upper case.
        """
        user = url.username or connect_args.get("user")
        if not user:
            return None
        service = (url.query.get("service_name") or connect_args.get("service_name")
                   or url.database or connect_args.get("sid"))
        if isinstance(service, tuple):
            service = service[0]
        where = (f"service:{str(service).lower()}" if service else
                 f"dsn:{connect_args.get('dsn') or url.host or 'default'}")
        return f"{str(user).upper()}@{where}"

    # --- sessions -------------------------------------------------------------------------

    def _tag(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        raw = _driver(conn)
        raw.module = "capgate"
        raw.action = tag.operation_id[:32]
        raw.clientinfo = tag.intent_id[:64]
        raw.client_identifier = tag.case_id[:64]
        raw.call_timeout = max(1, int(timeout_s * 1000))
        conn.info[_DATES_KEY] = {name.lower(): kind for name, kind in tag.dates}

    def arm_deadline(self, raw: Any, left: float) -> None:
        # no server-side idle timeout a session can set for itself: the call timeout
        # (client side) bounds each round trip to the time left
        raw.call_timeout = max(1, int((left + REARM_AFTER_SECONDS) * 1000))

    def begin_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                    lock_timeout_s: float | None,
                    marker: dict[str, Any] | None = None) -> TxIdentity:
        """One round trip: the marker, the transaction and who we are (see the module doc).

        ``lock_timeout_s``: Oracle has no DML lock timeout; the call timeout bounds waits.
        """
        self.start_deadline(conn, timeout_s)
        self._tag(conn, tag, timeout_s)
        result = conn.execute(_OPEN_MARKED if marker is not None else _OPEN, dict(marker or {}))
        out: Mapping[str, Any] = getattr(result, "out_parameters", None) or {}
        raw = _driver(conn)
        identity = self.identity_of(raw, out, tag, conn.info.get(_NO_LTXID_KEY, False))
        conn.info[_TXID_KEY] = identity["txid"]
        return TxIdentity("oracle", identity)

    def open_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                   lock_timeout_s: float | None) -> TxIdentity:
        return self.begin_write(conn, tag, timeout_s, lock_timeout_s)

    @staticmethod
    def identity_of(raw: Any, out: Mapping[str, Any], tag: SessionTag,
                    no_ltxid: bool = False) -> dict[str, Any]:
        """The recorded identity: what the opening block said, and what the driver knows.

        Thin or Thick is what the driver reports (``Connection.thin``); only Thin has a
        ``serial_num`` attribute, so only Thin reads it -- Thick's serial number is
        looked up in ``GV$SESSION`` (by ``AUDSID``) when resume needs it.
        """
        thin = bool(raw.thin)
        try:
            ltxid = bytes(raw.ltxid or b"").hex() or None
        except Exception:  # a Thick client before 12.1 has none: never fail the opening
            ltxid = None
        why = None if ltxid else (
            "unavailable: the service has no COMMIT_OUTCOME (Transaction Guard off)"
            if no_ltxid or thin else "unavailable: no LTXID from the Oracle Client")
        return {
            "driver": "thin" if thin else "thick",
            "ltxid": ltxid,
            "commit_outcome": "recorded" if ltxid else why,
            "txid": out.get("cg_txid"),
            "sid": _int(out.get("cg_sid")),
            "serial": int(raw.serial_num) if thin else None,
            "instance": _int(out.get("cg_inst")),
            "audsid": _int(out.get("cg_audsid")),
            "usid": out.get("cg_usid"),
            "db": out.get("cg_db"),
            "client_info": tag.intent_id[:64],
        }

    def before_commit(self, conn: sa.Connection) -> None:
        """The local transaction id must still be the one opened: nothing committed since."""
        opened = conn.info.get(_TXID_KEY)
        if opened is None:
            return
        now = conn.execute(sa.text(TXID_NOW)).scalar()
        if now != opened:
            raise TransactionSplit(
                f"the transaction opened as {opened} is now {now or 'none'}: something in "
                "the statements committed (a procedure, DDL); the work before that point is "
                "committed, the rest was rolled back -- escalated for a person to decide",
                opened=opened, now=now)

    def begin_read(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        self._tag(conn, tag, timeout_s)
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))

    @staticmethod
    def _reset_raw(raw: Any) -> None:
        raw.call_timeout = 0
        raw.action = ""
        raw.clientinfo = ""
        raw.client_identifier = ""

    def reset_session(self, conn: sa.Connection) -> None:
        conn.info.pop(_TXID_KEY, None)
        conn.info.pop(_DATES_KEY, None)
        # client-side attributes only; on a session that is gone the driver raises its own
        # error (not a DBAPIError the caller expects) -- the pool's reset covers it anyway
        with contextlib.suppress(Exception):
            self._reset_raw(_driver(conn))

    def end_read(self, conn: sa.Connection) -> None:
        self.reset_session(conn)

    # --- the fence row ----------------------------------------------------------------

    def move_fence(self, conn: sa.Connection, binds: Mapping[str, Any],
                   tag: SessionTag | None) -> tuple[bool, Any]:
        """The MERGE returns nothing; its row count says whether it moved the row."""
        moved = self.execute(conn, self.fence_upsert, binds, tag).rowcount == 1
        found = None if moved else self.execute(
            conn, FENCE_READ, {"h": binds["h"]}, tag).fetchone()
        return moved, found

    # --- ending a leased transaction ------------------------------------------------------
    # (leased rows are refused here, :meth:`check_lease`; a collapsed call's statements are
    # bounded by the call timeout.  No session id: resume ends sessions, the watchdog not.)

    def cancel_statement(self, raw: Any, session: int | None,
                         side: Callable[[], AbstractContextManager[sa.Connection]]) -> None:
        """python-oracledb ``Connection.cancel()``: the running round trip ends (ORA-01013)."""
        raw.cancel()

    # --- recovery evidence ----------------------------------------------------------------

    def server_identity(self, conn: sa.Connection) -> dict[str, Any]:
        return {"db": conn.execute(sa.text(DB_NOW)).scalar()}

    def commit_outcome(self, conn: sa.Connection, identity: Mapping[str, Any]) -> str | None:
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

    def session_facts(self, conn: sa.Connection, identity: Mapping[str, Any]) -> SessionFacts:
        """The recorded session as the server sees it, RAC-aware (``GV$SESSION.INST_ID``).

        ``GV$SESSION`` when readable: whether the session is still ours (``CLIENT_INFO``)
        and in a transaction (``TADDR``).  Found by ``(INST_ID, SID, SERIAL#)`` (Thin
        records the serial number), its absence proves the session gone.  Found by
        ``AUDSID`` (Thick), its absence proves nothing, so ``DBMS_SESSION.
        IS_SESSION_ALIVE`` (privilege-free) decides alive or gone -- as it does
        whenever ``GV$SESSION`` is not readable.
        """
        sid, inst = _int(identity.get("sid")), _int(identity.get("instance"))
        serial, audsid = _int(identity.get("serial")), _int(identity.get("audsid"))
        if sid is not None and inst is not None and (serial is not None or audsid is not None):
            sql, binds = (SESSION_BY_SERIAL, {"serial": serial}) if serial is not None \
                else (SESSION_BY_AUDSID, {"audsid": audsid})
            try:
                found = conn.execute(sa.text(sql), {"inst": inst, "sid": sid, **binds}).first()
            except sa.exc.DatabaseError as exc:
                if not any(code in _message(exc) for code in _NO_VIEW):
                    raise
            else:
                if found is not None:
                    return SessionFacts(True, ours=found[1] == identity.get("client_info"),
                                        in_transaction=bool(found[2]), serial=_int(found[0]),
                                        source="gv$session")
                if serial is not None:
                    return SessionFacts(False, source="gv$session")
        alive = self._is_session_alive(conn, identity.get("usid"))
        return SessionFacts(alive, source="dbms_session" if alive is not None else "none")

    @staticmethod
    def _is_session_alive(conn: sa.Connection, usid: Any) -> bool | None:
        """``DBMS_SESSION.IS_SESSION_ALIVE`` on the recorded unique session id (PUBLIC)."""
        if not usid:
            return None
        try:
            result = conn.execute(_ALIVE, {"usid": str(usid)})
        except sa.exc.DBAPIError:
            return None
        out: dict[str, Any] = getattr(result, "out_parameters", None) or {}
        return None if out.get("alive") is None else bool(int(out["alive"]))

    def session_alive(self, conn: sa.Connection, identity: dict[str, Any]) -> bool | None:
        """Whether the recorded session may still commit our transaction; None: unknowable."""
        return self.session_facts(conn, identity).may_commit

    def terminate_session(self, conn: sa.Connection, identity: dict[str, Any]) -> bool:
        """Kill exactly the recorded session, on its own instance -- only while it is
        provably still ours (its ``CLIENT_INFO`` names the intent) and in a transaction."""
        facts = self.session_facts(conn, identity)
        if facts.may_commit is not True or facts.serial is None:
            return False
        sid, inst = _int(identity.get("sid")), _int(identity.get("instance"))
        if sid is None or inst is None:
            return False
        try:
            conn.execute(sa.text(KILL_SESSION.format(sid=int(sid), serial=int(facts.serial),
                                                     inst=int(inst))))
        except sa.exc.DatabaseError as exc:
            text = _message(exc)
            if "ORA-00031" in text:  # marked for kill: it ends as soon as it can
                return True
            # ORA-01031 no ALTER SYSTEM privilege; ORA-00030 the session ended meanwhile
            if any(code in text for code in ("ORA-01031", "ORA-00030")):
                return False
            raise
        return True

    def marker_key_state(self, conn: sa.Connection, idem_key: str,
                         wait_seconds: float = 1.0) -> str:
        """Whether a transaction holds ``idem_key`` in ``capgate_landed``, asked without
        privileges: a marker insert with the same key, always rolled back.

        Oracle makes an insert of a key that an open transaction inserted wait for that
        transaction; the call timeout ends the wait.  ``held`` (still open), ``taken``
        (committed), ``free`` (any transaction that inserted it is over, uncommitted).
        """
        raw = _driver(conn)
        raw.call_timeout = max(1, int(wait_seconds * 1000))
        try:
            conn.execute(sa.text(MARKER_INSERT), {
                "intent_id": "probe-" + uuid.uuid4().hex, "idem_key": idem_key,
                "fingerprint": "probe", "attempt": 0, "case_id": "capgate.resume",
                "operation_id": "capgate.resume.probe", "landed_at": "probe"})
            return "free"
        except sa.exc.DBAPIError as exc:
            if self.is_unique_violation(exc):
                return "taken"
            if self.is_timeout(exc):
                return "held"
            raise
        finally:
            with contextlib.suppress(sa.exc.DBAPIError):
                conn.rollback()
            with contextlib.suppress(Exception):
                raw.call_timeout = 0

    def in_doubt_state(self, conn: sa.Connection, txid: str) -> str | None:
        """``DBA_2PC_PENDING.STATE`` of the local transaction: ``resolved`` when it is no
        longer pending, None when the view is not readable."""
        try:
            found = conn.execute(sa.text(IN_DOUBT), {"txid": txid}).scalar()
        except sa.exc.DatabaseError:
            return None
        return "resolved" if found is None else str(found)

    def opening_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """By the marker's key (:func:`opening_by_marker_key`), privilege-free."""
        return opening_by_marker_key(self.marker_key_state, engine, attempts,
                                     wait_seconds=wait_seconds, probe_writes=probe_writes)

    def attempt_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """Resume's facts for Oracle attempts, strongest first (see the module doc):
        Transaction Guard, then privilege-free proofs that the transaction is over."""
        answers: dict[str, AttemptEvidence] = {}
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            db_now = self.server_identity(conn).get("db")
            for attempt in attempts:
                answers[attempt.intent_id] = self._one(
                    engine, conn, attempt, db_now, terminate=terminate,
                    wait_seconds=wait_seconds, probe_writes=probe_writes)
        return answers

    def _one(self, engine: sa.Engine, conn: sa.Connection, attempt: Attempt,
             db_now: Any, *, terminate: bool, wait_seconds: float,
             probe_writes: bool) -> AttemptEvidence:
        tx: dict[str, Any] = dict(attempt.tx or {})
        notes: dict[str, Any] = {"server_now": {"db": db_now}}
        answer = AttemptEvidence(notes=notes)
        if not tx.get("sid") and not tx.get("ltxid"):
            answer.identity = "unrecorded"
            return answer
        if tx.get("db") and db_now and tx["db"] != db_now:
            answer.identity = "changed"  # a failover to another database (Data Guard)
            return answer
        answer.identity = "same"
        error = str(attempt.error or "")
        in_doubt = any(code in error for code in IN_DOUBT_CODES)
        if tx.get("ltxid"):
            try:
                answer.outcome = self.commit_outcome(conn, tx)
            except sa.exc.DBAPIError as exc:
                notes["commit_outcome_error"] = _message(exc).splitlines()[0]
            notes["commit_outcome"] = {"probe": "GET_LTXID_OUTCOME", "answer": answer.outcome}
        else:
            notes["commit_outcome"] = tx.get("commit_outcome") or "no LTXID recorded"
        terminated = False
        deadline = time.monotonic() + max(0.0, wait_seconds)
        while True:
            facts = self.session_facts(conn, tx)
            notes["session"] = facts.to_dict()
            may_commit = facts.may_commit
            if may_commit is None and facts.alive is not False and probe_writes \
                    and attempt.idem_key and answer.outcome is None:
                with engine.connect() as probe:
                    state = self.marker_key_state(probe, attempt.idem_key)
                notes["marker_key"] = {"probe": "insert of the same key, rolled back",
                                       "answer": state}
                may_commit = state == "held"
            if may_commit and terminate and not terminated:
                terminated = self.terminate_session(conn, tx)
                notes["terminated_session"] = {"sid": tx.get("sid"),
                                               "instance": tx.get("instance"),
                                               "done": terminated}
            if answer.outcome in ("committed", "aborted", "committed_incomplete"):
                break  # Transaction Guard decided (and blocked a late commit)
            if may_commit is False:
                answer.finished = True
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_SECONDS)
        if answer.outcome is not None:
            answer.finished = True
        if in_doubt and tx.get("txid"):
            pending = self.in_doubt_state(conn, str(tx["txid"]))
            notes["in_doubt"] = {"error": error.splitlines()[0] if error else "",
                                 "dba_2pc_pending": pending}
            if pending != "resolved":
                answer.finished = None  # the distributed commit may still be resolved
        elif in_doubt:
            answer.finished = None
        if answer.finished is not True and (notes.get("session") or {}).get("alive"):
            notes["session_alive"] = True
        return answer

    # --- capgate doctor ---------------------------------------------------------------

    def describe_server(self, conn: sa.Connection) -> str:
        db, service, instance, user = conn.execute(sa.text(ORA_IDENTITY)).one()
        raw = _driver(conn)
        return f"Oracle {raw.version}, database {db}, service {service}, instance " \
               f"{instance}, user {user}"

    @staticmethod
    def _readable(conn: sa.Connection, sql: str) -> bool:
        """Whether the account may read a view (ORA-00942 / ORA-01031 when not)."""
        try:
            conn.execute(sa.text(sql)).scalar()
            return True
        except sa.exc.DatabaseError:
            conn.rollback()
            return False

    def excess_privileges(self, conn: sa.Connection) -> list[str]:
        """The DBA role (and its kin), administrative privileges and every ``ANY`` system
        privilege held in this session (``SESSION_ROLES``, ``SESSION_PRIVS``).  ``ALTER
        SYSTEM`` is not listed: resume ends a recorded session with it."""
        found = [f"role {r}: {ORA_EXCESS_ROLES[str(r)]}"
                 for r in conn.execute(sa.text(ORA_EXCESS_ROLES_SQL)).scalars()]
        found += [f"{p}: a system privilege beyond the rows' own tables"
                  for p in conn.execute(sa.text(ORA_EXCESS_PRIVS_SQL)).scalars()]
        return found

    def diagnose(self, conn: sa.Connection, diagnosis: Diagnosis) -> None:
        """The driver and its mode, privileges, leases, what resume relies on (GV$SESSION,
        ALTER SYSTEM, DBA_2PC_PENDING), SESSIONS_PER_USER, Transaction Guard, DDL."""

        def scalar(sql: str, **binds: Any) -> Any:
            return conn.execute(sa.text(sql), binds).scalar()

        raw = _driver(conn)
        mode = "Thin" if raw.thin else "Thick"
        diagnosis.ok(f"python-oracledb {driver().__version__}, {mode} mode",
                     driver=driver().__version__, mode=mode.lower())
        privs = {r[0] for r in conn.execute(sa.text(ORA_PRIVS))}
        user = conn.execute(sa.text("SELECT USER FROM dual")).scalar()

        def has(table: str, privilege: str) -> bool | None:
            owner = scalar(ORA_OWNER, t=table)
            if owner is None:
                return None
            if owner == user or f"{privilege} ANY TABLE" in privs:
                return True
            return bool(scalar(ORA_TAB_PRIV, t=table, p=privilege))

        diagnosis.privileges(has)
        if diagnosis.leased_rows:
            diagnosis.warning(
                LeaseNotEnforceable.code,
                f"leased rows are refused on Oracle (nothing ends a hung executor's "
                f"transaction at its deadline): {', '.join(sorted(diagnosis.leased_rows))}",
                rows=sorted(diagnosis.leased_rows))
        # liveness: GV$SESSION (every RAC instance) sees whether the recorded session is
        # still ours and in a transaction; without it resume proves it privilege-free
        if diagnosis.writes:
            if self._readable(conn, ORA_GV_SESSION):
                diagnosis.ok("GV$SESSION is readable: resume sees the recorded session on "
                             "its instance, its CLIENT_INFO tag and its transaction")
            else:
                diagnosis.warning(
                    PrivilegeMissing.code,
                    "GV$SESSION is not readable (GRANT SELECT ON SYS.GV_$SESSION): resume "
                    "falls back on DBMS_SESSION.IS_SESSION_ALIVE and a rolled-back insert "
                    "of the marker's key, and cannot end a session that may still commit")
            if "ALTER SYSTEM" in privs:
                diagnosis.ok("resume may end a recorded session "
                             "(ALTER SYSTEM KILL SESSION, on its own instance)")
            else:
                diagnosis.warning(
                    PrivilegeMissing.code,
                    "without ALTER SYSTEM, resume cannot end a recorded session that may "
                    "still commit; it waits, and answers unknown while the session lives")
            if not self._readable(conn, ORA_2PC_PENDING):
                diagnosis.warning(
                    PrivilegeMissing.code,
                    "DBA_2PC_PENDING is not readable: an in-doubt distributed commit "
                    "(ORA-02050/ORA-02054) stays unknown until a person resolves it")
        limit = scalar(ORA_SESSIONS_PER_USER)
        if limit is not None and str(limit).isdigit():
            # ORA-02391 counts every session of the user in the database: resume's two
            # evidence sessions (never refused by a budget) must fit beside the budget
            diagnosis.session_limit(int(limit), "the profile's SESSIONS_PER_USER", reserve=2)
        else:
            diagnosis.ok(f"the profile's SESSIONS_PER_USER is {limit or 'unknown'}")
        ltxid = bytes(raw.ltxid or b"")
        try:
            outcome = scalar(ORA_COMMIT_OUTCOME)
        except Exception:  # ALL_SERVICES not readable: the driver's LTXID still tells
            conn.rollback()
            outcome = None
        executes = scalar(ORA_APP_CONT)
        if not ltxid:
            diagnosis.warning(
                CommitOutcomeUnavailable.code,
                "the service does not record commit outcomes: no LTXID on this session "
                f"(COMMIT_OUTCOME is {outcome or 'not readable'}); enable it with "
                "DBMS_SERVICE.MODIFY_SERVICE(..., commit_outcome => TRUE) or connect to a "
                "service that has it", commit_outcome=outcome)
        elif not executes:
            diagnosis.warning(
                CommitOutcomeUnavailable.code,
                "the service records commit outcomes but the account may not read them: "
                "GRANT EXECUTE ON DBMS_APP_CONT")
        else:
            diagnosis.ok("Transaction Guard records commit outcomes (LTXID on "
                         "the session, EXECUTE on DBMS_APP_CONT)")
        if diagnosis.ddl_rows:
            if not ({"CREATE PROCEDURE", "CREATE ANY PROCEDURE"} & privs):
                diagnosis.error(PrivilegeMissing.code,
                                "the DDL rows need CREATE PROCEDURE (or CREATE ANY PROCEDURE)")
            else:
                diagnosis.ok("DDL apply (CREATE PROCEDURE) is allowed")
