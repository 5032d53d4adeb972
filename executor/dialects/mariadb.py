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
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.dialects.base import (
    FENCE_READ,
    FENCE_TABLE,
    FENCE_VALUES,
    MARKER_INSERT,
    Attempt,
    AttemptEvidence,
    Diagnosis,
    Dialect,
    SessionTag,
    TxIdentity,
    chunks,
    first_line,
    opening_by_marker_key,
    tune_keepalive,
    url_setting,
    vendor_code,
)
from capgate.registry.errors import PrivilegeMissing

_GRANT = re.compile(r"^GRANT (?P<privs>.+?) ON (?:(?:PROCEDURE|FUNCTION|PACKAGE(?: BODY)?) )?"
                    r"(?P<scope>\S+) TO ", re.IGNORECASE)


def _session_grants(conn: sa.Connection) -> list[tuple[frozenset[str], str, str]]:
    """``(privileges, database, object)`` of every grant ``SHOW GRANTS`` lists for the session.

    ``SHOW GRANTS`` names the account's own grants *and* its current role's, which
    ``information_schema.*_PRIVILEGES`` does not (there a role's privileges are
    invisible to the account using them).  ``database`` and ``object`` are ``*`` for a
    wildcard, patterns (``app\\_%``) as granted.
    """
    out: list[tuple[frozenset[str], str, str]] = []
    for (line,) in conn.execute(sa.text("SHOW GRANTS")).all():
        m = _GRANT.match(str(line))
        if m is None:
            continue
        privs = frozenset(p.strip().upper() for p in re.sub(r"\([^)]*\)", "", m.group("privs"))
                          .split(","))
        db, _, obj = m.group("scope").partition(".")
        out.append((privs, db.strip("`"), obj.strip("`")))
    return out


def _covers(pattern: str, name: str) -> bool:
    """Whether a grant's database pattern covers ``name``: ``*``, or a name in which ``_``
    and ``%`` are wildcards unless escaped with a backslash (as GRANT reads them)."""
    if pattern == "*":
        return True
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        out.append(".*" if c == "%" else "." if c == "_" else re.escape(c))
        i += 1
    return re.fullmatch("".join(out), name) is not None


def _diagnose_ddl(conn: sa.Connection, diagnosis: Diagnosis, schema: str) -> None:
    """What the DDL loop needs on MariaDB, read from the session's grants (its roles too).

    Apply needs ``CREATE ROUTINE`` and ``ALTER ROUTINE`` (an error without them);
    capture of a routine another account defined needs ``SELECT`` on ``mysql.proc``
    (without it the source reads NULL and capture is refused, CG530); views need
    ``CREATE VIEW``, ``SHOW VIEW`` and ``DROP`` (``CREATE OR REPLACE VIEW``);
    triggers ``TRIGGER``; the run checks and smoke calls ``EXECUTE`` and ``SELECT``.
    """
    grants = _session_grants(conn)

    def held(privilege: str, db: str, obj: str = "*") -> bool:
        return any((privilege in privs or "ALL PRIVILEGES" in privs or "ALL" in privs)
                   and _covers(gdb, db) and gobj in ("*", obj) for privs, gdb, gobj in grants)

    lacking = [p for p in ("CREATE ROUTINE", "ALTER ROUTINE") if not held(p, schema)]
    if lacking:
        diagnosis.error(PrivilegeMissing.code,
                        f"the DDL rows need {' and '.join(lacking)} on {schema} (to replace "
                        "routines); SHOW GRANTS lists neither for the account nor its role")
    notes: list[str] = []
    if not held("SELECT", "mysql", "proc"):
        notes.append("SELECT on mysql.proc (capture of a routine another account defined "
                     "reads NULL without it: CG530)")
    views = [p for p in ("CREATE VIEW", "SHOW VIEW", "DROP") if not held(p, schema)]
    if views:
        notes.append(f"{', '.join(views)} on {schema} (to capture and replace views)")
    if not held("TRIGGER", schema):
        notes.append(f"TRIGGER on {schema} (to replace triggers)")
    runs = [p for p in ("EXECUTE", "SELECT") if not held(p, schema)]
    if runs:
        notes.append(f"{', '.join(runs)} on {schema} (the run checks call functions and "
                     "fetch from views; smoke calls run)")
    for note in notes:
        diagnosis.warning(PrivilegeMissing.code, f"the DDL rows may need {note}")
    if not lacking and not notes:
        diagnosis.ok("DDL capture (SHOW CREATE, mysql.proc), apply (CREATE/ALTER ROUTINE, "
                     "views, triggers) and the run checks (EXECUTE, SELECT) are allowed")
    elif not lacking:
        diagnosis.ok("DDL apply of routines (CREATE/ALTER ROUTINE) is allowed")

_IDENTITY = sa.text(
    "SELECT CONNECTION_ID() AS connection_id, @@server_id AS server_id,"
    " @@hostname AS hostname,"
    " (SELECT UNIX_TIMESTAMP() - VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS"
    "  WHERE VARIABLE_NAME = 'UPTIME') AS server_started"
)


_INNODB_TRX_REFRESH = 0.15
"""MariaDB refreshes its ``INNODB_TRX`` cache only when nobody read it for 100 ms."""


_BOUNDED_VERBS = ("SELECT", "INSERT", "UPDATE", "DELETE", "REPLACE", "WITH")
"""Statements that take ``SET STATEMENT max_statement_time = ... FOR`` (not SET, not
transaction control)."""


def _strip_comment(statement: str) -> str:
    """The statement after its leading ``/* ... */`` comments (the session tag)."""
    text = statement.lstrip()
    while text.startswith("/*"):
        end = text.find("*/")
        if end < 0:
            return text
        text = text[end + 2:].lstrip()
    return text


class MariadbDialect(Dialect, name="mariadb", aliases=("mysql",)):
    title: ClassVar[str] = "MariaDB"
    driver: ClassVar[str | None] = "mysql+pymysql"
    url_schemes: ClassVar[frozenset[str]] = frozenset({"mysql", "mariadb", "mariadb+pymysql"})
    # INSERT ... RETURNING and DELETE ... RETURNING (10.5+); an UPDATE returns nothing
    returning_verbs: ClassVar[frozenset[str]] = frozenset({"INSERT", "DELETE"})
    driver_paramstyle: ClassVar[str] = "pyformat"
    # MariaDB evaluates the assignments left to right: intent_id first, on the old token
    fence_upsert: ClassVar[str] = (
        f"INSERT INTO {FENCE_TABLE} {FENCE_VALUES} ON DUPLICATE KEY UPDATE"
        " intent_id = IF(token <= VALUES(token), VALUES(intent_id), intent_id),"
        " token = GREATEST(token, VALUES(token))")

    def engine_options(self) -> dict[str, Any]:
        return {"pool_recycle": 1800}

    _HOST: ClassVar[re.Pattern[str]] = re.compile(r"[A-Za-z0-9_.%:-]{1,255}")

    def grantee(self, name: str) -> str:
        """A MariaDB account: ``user`` or ``user@host``, each part checked, written
        ``'user'@'host'`` (an account name, not an identifier; ``%`` when no host)."""
        from capgate.registry.errors import InvalidIdentifier

        user, at, host = str(name).partition("@")
        if not self.GRANTEE.fullmatch(user) or (at and not self._HOST.fullmatch(host)):
            raise InvalidIdentifier(
                f"{name!r} is not a plain MariaDB account (USER or USER@HOST: letters, digits, "
                "_ and $ in the user, letters, digits and . % : - _ in the host); nothing was "
                "executed", name=str(name)[:200], dialect=self.name)
        return f"'{user}'@'{host if at else '%'}'"

    def network_args(self, url: URL, connect_timeout: float) -> dict[str, Any]:
        """PyMySQL's ``connect_timeout`` bounds only the TCP connect: the handshake that
        follows reads with ``read_timeout``, so that is set too -- for the handshake alone
        (:meth:`prepare_engine` lifts it once the session is open: a call's statements are
        bounded by its deadline instead).  The socket's keepalive is tuned there as well.
        The server needs nothing per session: its idle timeouts also bound a wait for the
        rest of a packet a partition cut in two."""
        args: dict[str, Any] = {}
        for key in ("connect_timeout", "read_timeout", "write_timeout"):
            if url_setting(url, key) is None:
                args[key] = float(connect_timeout)
        return args

    def prepare_engine(self, engine: sa.Engine) -> None:
        mine = {key for key in ("read_timeout", "write_timeout")
                if url_setting(engine.url, key) is None}

        @sa.event.listens_for(engine, "connect")
        def _opened(dbapi_conn: Any, _record: Any) -> None:
            sock = getattr(dbapi_conn, "_sock", None)
            if sock is None:
                return
            tune_keepalive(sock)
            if "read_timeout" in mine:  # the handshake's bound, not the session's
                dbapi_conn._read_timeout = None
                dbapi_conn._current_timeout = None
                sock.settimeout(None)
            if "write_timeout" in mine:
                dbapi_conn._write_timeout = None

    def cut(self, raw: Any) -> bool:
        """Shut PyMySQL's socket down: its blocked read fails at once (error 2013)."""
        sock = getattr(raw, "_sock", None)
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False

    def sql(self, text: str, tag: SessionTag | None) -> str:
        return tag.comment() + text if tag is not None else text

    # idle_transaction_timeout counts from the end of the last statement and takes
    # whole seconds, 0 meaning never: 1, whatever the deadline (base.IDLE_GRACE_SECONDS)
    idle_grace_seconds: ClassVar[float] = 1.0
    # so each statement of a write transaction carries its own timeout, the time left less
    # this: it ends before the deadline, and a stopped executor's session 0.9 s after it
    statement_end_after_deadline: ClassVar[float] = -0.1

    def statement_deadline(self, statement: str, left: float) -> str | None:
        """``SET STATEMENT max_statement_time = <left - 0.1> FOR <statement>`` for a
        statement that reads or writes rows (MariaDB 10.1+): exact at the moment it is
        sent, at no round trip; the session's own settings are left alone."""
        body = _strip_comment(statement)
        if not body[:8].upper().startswith(_BOUNDED_VERBS):
            return None
        seconds = max(left + self.statement_end_after_deadline, 0.001)
        tag = statement[:len(statement) - len(body)]  # the session tag stays in front
        return f"{tag}SET STATEMENT max_statement_time = {seconds:.3f} FOR {body}"

    def _set_timeouts(self, conn: sa.Connection, timeout_s: float,
                      lock_timeout_s: float | None) -> None:
        conn.exec_driver_sql(
            "SET SESSION max_statement_time = %s, innodb_lock_wait_timeout = %s,"
            " idle_transaction_timeout = %s",
            (float(timeout_s), max(1, math.ceil(lock_timeout_s or timeout_s)),
             int(self.idle_grace_seconds)),
        )

    def arm_deadline(self, raw: Any, left: float) -> None:
        """Statements outside :data:`_BOUNDED_VERBS` (none of a row's) re-arm the session."""
        with raw.cursor() as cursor:
            cursor.execute("SET SESSION max_statement_time = %s, idle_transaction_timeout = %s",
                           (round(max(left + self.statement_end_after_deadline, 0.001), 3),
                            int(self.idle_grace_seconds)))

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

    @staticmethod
    def _same_incarnation(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
        """The server now is the one the attempt ran on, not restarted since (its start
        time, derived from the uptime, within two seconds)."""
        return (recorded.get("server_id") == now["server_id"]
                and recorded.get("hostname") == now["hostname"]
                and abs(int(recorded["server_started"]) - int(now["server_started"])) <= 2)

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

    # --- the fence row ----------------------------------------------------------------

    def move_fence(self, conn: sa.Connection, binds: Mapping[str, Any],
                   tag: SessionTag | None) -> tuple[bool, Any]:
        """The upsert reports no row; the row is ours now (locked by it): is the token ours?"""
        self.execute(conn, self.fence_upsert, binds, tag)
        found = self.execute(conn, FENCE_READ, {"h": binds["h"]}, tag).fetchone()
        moved = found is not None and int(found[0]) == binds["t"] \
            and str(found[1]) == binds["i"]
        return moved, found

    # --- ending a leased transaction --------------------------------------------------

    def session_id(self, raw: Any) -> int | None:
        return int(raw.thread_id())

    def cancel_statement(self, raw: Any, session: int | None,
                         side: Callable[[], AbstractContextManager[sa.Connection]]) -> None:
        """``KILL QUERY <id>`` from a side connection (the session itself is busy)."""
        if session is not None:
            with side() as conn:
                conn.exec_driver_sql("KILL QUERY %s", (session,))

    def terminate_lease_session(self, side: sa.Connection, session: int,
                                tag: SessionTag) -> bool:
        """``KILL CONNECTION <id>`` while the connection is still in ``PROCESSLIST``."""
        alive = side.execute(sa.text(
            "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = :id"),
            {"id": session}).scalar()
        if alive:
            side.exec_driver_sql("KILL CONNECTION %s", (session,))
        return bool(alive)

    # --- recovery evidence ------------------------------------------------------------

    def attempt_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """No commit-outcome API: the recorded connection, on the same server incarnation.

        Finished means: the recorded connection's transaction is gone from
        ``INNODB_TRX`` on two reads a cache period apart.  ``INNODB_TRX`` is a cache
        that MariaDB refreshes only after 100 ms without readers, so one read may
        be stale; a killed thread leaves ``PROCESSLIST`` as soon as its socket is
        closed, before its rollback ends.  A connection that is alive but has no
        transaction (a pooled session, idle after its call rolled back) is not
        killed: its transaction is over.  Only a session with an open transaction
        is terminated -- and never resume's own connection.
        """
        answers = {a.intent_id: AttemptEvidence() for a in attempts}
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            server = self.server_identity(conn)
            watched: dict[str, Attempt] = {}
            for a in attempts:
                answer, tx = answers[a.intent_id], a.tx
                answer.notes["server_now"] = server
                if tx.get("connection_id") is None or tx.get("server_started") is None:
                    answer.identity = "unrecorded"
                    continue
                same = self._same_incarnation(tx, server)
                answer.identity = "same" if same else "changed"
                if same:
                    watched[a.intent_id] = a
            deadline = time.monotonic() + max(0.0, wait_seconds)
            killed_at: dict[str, float] = {}
            idle_since: dict[str, float] = {}
            own = int(conn.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one())
            busy: list[str] = []
            while True:
                alive, open_tx = self._sessions(conn, watched.values())
                if open_tx is None:  # no PROCESS privilege: ask the marker's unique key instead
                    # (a rolled-back insert; a dry run sends none and cannot tell: open)
                    open_tx = self._held_marker_keys(engine, watched, answers) if probe_writes \
                        else {int(a.tx["connection_id"]) for a in watched.values()}
                now = time.monotonic()
                busy = []
                for intent_id, a in watched.items():
                    cid = int(a.tx["connection_id"])
                    notes = answers[intent_id].notes
                    notes["session"] = {"connection_id": cid, "alive": cid in alive,
                                        "open_transaction": cid in open_tx}
                    if cid in open_tx and terminate and intent_id not in killed_at \
                            and cid != own:
                        try:
                            conn.exec_driver_sql("KILL CONNECTION %s", (cid,))
                            notes["terminated_session"] = {"connection_id": cid}
                        except sa.exc.DBAPIError as exc:  # ended meanwhile (1094 unknown thread)
                            notes["terminate_error"] = first_line(exc)
                        killed_at[intent_id] = now
                    if cid in open_tx:
                        idle_since.pop(intent_id, None)
                    elif cid in alive:
                        idle_since.setdefault(intent_id, now)
                    # Only fresh INNODB_TRX reads, a cache period after a kill or after the
                    # connection was first seen without a transaction, settle it.
                    if (cid in open_tx
                            or now - idle_since.get(intent_id, -1e9) < _INNODB_TRX_REFRESH
                            or now - killed_at.get(intent_id, -1e9) < _INNODB_TRX_REFRESH):
                        busy.append(intent_id)
                if not busy or time.monotonic() >= deadline:
                    break
                time.sleep(_INNODB_TRX_REFRESH)
            for intent_id in watched:
                answer = answers[intent_id]
                answer.finished = intent_id not in busy
                if not answer.finished:
                    answer.notes["session_alive"] = True
        return answers

    def opening_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """By the marker's key (:func:`opening_by_marker_key`): MariaDB's own timeouts
        end such a session by its deadline + 0.9 s, even one a partition left between two
        packets, so waiting settles it."""
        return opening_by_marker_key(self.marker_key_state, engine, attempts,
                                     wait_seconds=wait_seconds, probe_writes=probe_writes)

    @staticmethod
    def _sessions(conn: sa.Connection, attempts: Iterable[Attempt]
                  ) -> tuple[set[int], set[int] | None]:
        """Connections alive (``PROCESSLIST``: one's own are visible without privileges) and
        those with an open InnoDB transaction (``INNODB_TRX``; None without PROCESS)."""
        ids = sorted({int(a.tx["connection_id"]) for a in attempts})
        alive: set[int] = set()
        open_tx: set[int] | None = set()
        for numbers in chunks(ids):
            alive.update(int(r[0]) for r in conn.execute(sa.text(
                "SELECT ID FROM information_schema.PROCESSLIST WHERE ID IN :ids"
            ).bindparams(sa.bindparam("ids", expanding=True)), {"ids": numbers}))
            if open_tx is None:
                continue
            try:
                open_tx.update(int(r[0]) for r in conn.execute(sa.text(
                    "SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX"
                    " WHERE trx_mysql_thread_id IN :ids"
                ).bindparams(sa.bindparam("ids", expanding=True)), {"ids": numbers}))
            except sa.exc.DBAPIError as exc:
                if not (vendor_code(exc) == 1227):  # ER_SPECIFIC_ACCESS_DENIED: no PROCESS
                    raise
                open_tx = None
        return alive, open_tx

    def _held_marker_keys(self, engine: sa.Engine, watched: Mapping[str, Attempt],
                          answers: Mapping[str, AttemptEvidence]) -> set[int]:
        """Connections whose transaction still holds their intent's marker key.

        Every recorded attempt inserted its marker when its transaction opened,
        so an open transaction holds the key's index lock: a probe insert of the
        same key waits for it (:meth:`marker_key_state`).  An intent without a key
        cannot be asked this way and counts as open.
        """
        held: set[int] = set()
        with engine.connect() as probe:
            for intent_id, a in watched.items():
                cid = int(a.tx["connection_id"])
                state = self.marker_key_state(probe, a.idem_key) if a.idem_key else "unknown"
                answers[intent_id].notes["marker_key"] = {
                    "probe": "insert of the same key, rolled back", "answer": state}
                if state in ("held", "unknown"):
                    held.add(cid)
        return held

    # --- capgate doctor ---------------------------------------------------------------

    def describe_server(self, conn: sa.Connection) -> str:
        def scalar(sql: str) -> Any:
            return conn.execute(sa.text(sql)).scalar()

        return (f"MariaDB/MySQL {scalar('SELECT VERSION()')}, server_id "
                f"{scalar('SELECT @@server_id')}, database {scalar('SELECT DATABASE()')},"
                f" user {scalar('SELECT CURRENT_USER()')}")

    _EXCESS: ClassVar[dict[str, str]] = {
        "ALL PRIVILEGES": "every privilege on every database",
        "SUPER": "can kill any connection, change global settings, bypass read_only",
        "FILE": "can read and write server files (LOAD_FILE, INTO OUTFILE, LOAD DATA)",
        "CONNECTION ADMIN": "can kill any connection",
        "SHUTDOWN": "can stop the server",
        "CREATE USER": "can create accounts and rename or drop others",
        "READ_ONLY ADMIN": "can write while the server is read only",
    }

    def excess_privileges(self, conn: sa.Connection) -> list[str]:
        """Global privileges beyond the rows' tables, and any grant option (SHOW GRANTS)."""
        found: list[str] = []
        grants = [str(r[0]) for r in conn.execute(sa.text("SHOW GRANTS"))]
        for line in grants:
            head = line.upper()
            m = re.match(r"^GRANT (.+?) ON (\S+) TO ", head)
            if m and m.group(2) in ("*.*", "`*`.`*`"):
                held = [p.strip() for p in m.group(1).split(",")]
                found += [f"{name} on *.*: {what}" for name, what in self._EXCESS.items()
                          if name in held]
            if head.endswith("WITH GRANT OPTION") or " WITH GRANT OPTION" in head:
                target = m.group(2) if m else "a grant"
                found.append(f"GRANT OPTION on {target}: can pass its privileges on to others")
        return list(dict.fromkeys(found))

    def diagnose(self, conn: sa.Connection, diagnosis: Diagnosis) -> None:
        """Grants (global, schema, table), connection limits, and the DDL rows' routines."""

        def scalar(sql: str, **binds: Any) -> Any:
            return conn.execute(sa.text(sql), binds).scalar()

        user, _, host = str(scalar("SELECT CURRENT_USER()")).rpartition("@")
        grantee = f"'{user}'@'{host}'"
        schema = scalar("SELECT DATABASE()")

        def held(privilege: str, table: str | None = None) -> bool:
            if scalar("SELECT count(*) FROM information_schema.USER_PRIVILEGES WHERE "
                      "GRANTEE = :g AND PRIVILEGE_TYPE = :p", g=grantee, p=privilege):
                return True
            if scalar("SELECT count(*) FROM information_schema.SCHEMA_PRIVILEGES WHERE "
                      "GRANTEE = :g AND TABLE_SCHEMA = :s AND PRIVILEGE_TYPE = :p",
                      g=grantee, s=schema, p=privilege):
                return True
            return table is not None and bool(scalar(
                "SELECT count(*) FROM information_schema.TABLE_PRIVILEGES WHERE GRANTEE = :g "
                "AND TABLE_SCHEMA = :s AND TABLE_NAME = :t AND PRIVILEGE_TYPE = :p",
                g=grantee, s=schema, t=table, p=privilege))

        def has(table: str, privilege: str) -> bool | None:
            if not scalar("SELECT count(*) FROM information_schema.TABLES WHERE "
                          "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t", t=table):
                return None
            return held(privilege, table)

        diagnosis.privileges(has)
        if diagnosis.writes:
            diagnosis.ok("resume may end the account's own connections "
                         "(KILL needs no privilege for one's own threads)")
        per_user = scalar("SELECT @@max_user_connections")
        diagnosis.session_limit(int(per_user) or None, "max_user_connections")
        try:
            row_limit = scalar("SELECT max_user_connections FROM mysql.user WHERE "
                               "CONCAT(User, '@', Host) = CURRENT_USER()")
        except Exception:  # mysql.user is not readable by a least-privilege account
            conn.rollback()
            row_limit = None
        if row_limit:
            diagnosis.session_limit(int(row_limit), "the account's MAX_USER_CONNECTIONS")
        diagnosis.session_limit(int(scalar("SELECT @@max_connections")), "max_connections")
        if diagnosis.ddl_rows:
            _diagnose_ddl(conn, diagnosis, str(schema))
