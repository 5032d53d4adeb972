"""PostgreSQL: ``application_name`` tags, ``SET LOCAL`` timeouts, ``pg_xact_status``.

The write transaction's identity -- ``pg_current_xact_id()`` (xid8, wraparound
safe), backend pid and start time, the cluster's system identifier and
timeline -- is read in the same round trip that labels the session and sets
its server-side timeouts.  After a crash, ``pg_xact_status`` answers whether
that exact transaction committed, as long as the server is the same cluster
on the same timeline and the xid is not older than the commit log retains.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.dialects.base import (
    CLIENT_GRACE_SECONDS,
    MARKER_TABLE,
    POLL_SECONDS,
    SERVER_KEEPALIVE,
    Attempt,
    AttemptEvidence,
    Diagnosis,
    Dialect,
    SessionTag,
    TxIdentity,
    first_line,
    shut_down_socket,
    sqlstate,
    url_setting,
)
from capgate.registry.errors import ExtensionMissing, PrivilegeMissing

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


_XACT_STATUS = {"committed": "committed", "aborted": "aborted", "in progress": "in_progress"}
"""``pg_xact_status`` answers as capgate's outcome words."""


def _plpgsql_check_fix(conn: sa.Connection) -> str:
    """What makes plpgsql_check available in ``conn``'s database, as a person runs it."""
    if conn.execute(sa.text("SELECT 1 FROM pg_available_extensions "
                            "WHERE name = 'plpgsql_check'")).first() is not None:
        return "run CREATE EXTENSION plpgsql_check in this database"
    major = int(conn.execute(sa.text("SHOW server_version_num")).scalar() or 0) // 10000
    return (f"install its package on the database server (Debian, Ubuntu: `apt-get install "
            f"postgresql-{major}-plpgsql-check`), then run CREATE EXTENSION plpgsql_check in "
            "this database")


def _ms(seconds: float) -> str:
    return f"{max(1, int(seconds * 1000))}ms"


class PostgresqlDialect(Dialect, name="postgresql", aliases=("postgres",)):
    title: ClassVar[str] = "PostgreSQL"
    driver: ClassVar[str | None] = "postgresql+psycopg"
    url_schemes: ClassVar[frozenset[str]] = frozenset({"postgresql", "postgres"})
    returning_verbs: ClassVar[frozenset[str]] = frozenset({"INSERT", "UPDATE", "DELETE"})
    driver_paramstyle: ClassVar[str] = "pyformat"

    def begin_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                    lock_timeout_s: float | None,
                    marker: dict[str, Any] | None = None) -> TxIdentity:
        settings = {
            "app": tag.text(),
            "st": _ms(timeout_s),
            "lt": _ms(lock_timeout_s if lock_timeout_s is not None else timeout_s),
            # the idle timeout counts from the end of the last statement: it stays small
            # whatever the deadline (see executor.dialects.base.IDLE_GRACE_SECONDS)
            "it": _ms(min(timeout_s, self.idle_grace_seconds)),
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

    def network_args(self, url: URL, connect_timeout: float) -> dict[str, Any]:
        """libpq's own bounds: ``connect_timeout`` (whole seconds, at least 2), client TCP
        keepalive and user timeout, and -- in the session's ``options``, no round trip --
        the server's keepalive on this session (:data:`SERVER_KEEPALIVE`).  The server
        applies no statement or idle timeout while it waits for the rest of a message a
        partition cut in two; its keepalive is what notices the client is gone then.
        Settings the URL gives itself are left as they are."""
        args: dict[str, Any] = {}

        def default(key: str, value: str) -> None:
            if url_setting(url, key) is None:
                args[key] = value

        default("connect_timeout", str(max(2, math.ceil(connect_timeout))))
        default("keepalives", "1")
        default("keepalives_idle", "5")
        default("keepalives_interval", "1")
        default("keepalives_count", "3")
        default("tcp_user_timeout", "10000")
        options = url_setting(url, "options") or ""
        if "tcp_keepalives" not in options:
            idle, interval, count = SERVER_KEEPALIVE
            args["options"] = (
                f"{options} -c tcp_keepalives_idle={idle} -c tcp_keepalives_interval="
                f"{interval} -c tcp_keepalives_count={count} -c tcp_user_timeout="
                f"{(idle + interval * count) * 1000}").strip()
        return args

    def cut(self, raw: Any) -> bool:
        """Shut the libpq connection's socket down: psycopg's wait on it fails at once."""
        if raw.closed:
            return False
        return shut_down_socket(raw.pgconn.socket)

    def arm_deadline(self, raw: Any, left: float) -> None:
        """The statement timeout to the time left (a statement sent before the next
        re-arming ends at most :data:`REARM_AFTER_SECONDS` late), the idle timeout to the
        grace: a stopped executor's locks go by the deadline + 1 s."""
        raw.execute("SELECT set_config('statement_timeout', %s, true),"
                    " set_config('idle_in_transaction_session_timeout', %s, true)",
                    (_ms(left), _ms(min(left, self.idle_grace_seconds))))

    def begin_read(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))
        conn.execute(sa.text(
            "SELECT set_config('application_name', :app, true),"
            " set_config('statement_timeout', :st, true)"
        ), {"app": tag.text(), "st": _ms(timeout_s)})

    def read_many(self, conn: sa.Connection,
                  statements: Sequence[tuple[str, Mapping[str, Any]]],
                  limit: int) -> list[list[Sequence[Any]]]:
        """psycopg's pipeline mode: every statement sent, then every result read once.

        Each text is compiled by SQLAlchemy (its bind syntax and escaping, exactly as
        ``conn.execute(sa.text(...))`` would send it) and run on the same session and
        transaction.  A failing statement fails the batch, as it would fail the loop.
        """
        driver = conn.connection.driver_connection
        if driver is None or not hasattr(driver, "pipeline"):
            return super().read_many(conn, statements, limit)
        compiled = [(sa.text(sql).compile(dialect=conn.dialect), binds)
                    for sql, binds in statements]
        cursors = []
        with driver.pipeline():
            for c, binds in compiled:
                cursor = driver.cursor()
                cursor.execute(c.string, c.construct_params(dict(binds)))
                cursors.append(cursor)
        try:
            return [list(cursor.fetchmany(limit)) for cursor in cursors]
        finally:
            for cursor in cursors:
                cursor.close()

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

    # --- ending a leased transaction -------------------------------------------------

    def session_id(self, raw: Any) -> int | None:
        return int(raw.info.backend_pid)

    def cancel_statement(self, raw: Any, session: int | None,
                         side: Callable[[], AbstractContextManager[sa.Connection]]) -> None:
        """psycopg's cancel request on the session's own connection (``cancel_safe``: 3.2)."""
        safe = getattr(raw, "cancel_safe", None)
        if safe is not None:  # bounded: through a partition the request never arrives
            safe(timeout=CLIENT_GRACE_SECONDS)
        else:
            raw.cancel()

    def terminate_lease_session(self, side: sa.Connection, session: int,
                                tag: SessionTag) -> bool:
        """``pg_terminate_backend`` on the lease's pid, only while it carries the call's label."""
        return bool(side.execute(sa.text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE pid = :pid AND application_name = :app"),
            {"pid": session, "app": tag.text()}).scalar())

    # --- recovery evidence ------------------------------------------------------------

    def server_identity(self, conn: sa.Connection) -> dict[str, Any]:
        """The cluster and its timeline: an xid means something only on both."""
        system_identifier, timeline = conn.execute(_SERVER).one()
        return {"system_identifier": system_identifier, "timeline": timeline}

    def commit_outcome(self, conn: sa.Connection, identity: Mapping[str, Any]) -> str | None:
        """``pg_xact_status`` of the recorded xid8: committed, aborted, in_progress or None."""
        xid = identity.get("xid")
        if not xid:
            return None
        status = conn.execute(sa.text("SELECT pg_xact_status(CAST(:xid AS xid8))"),
                              {"xid": str(xid)}).scalar()
        if status is None:
            return None
        return _XACT_STATUS.get(str(status))

    @staticmethod
    def _on_backend(conn: sa.Connection, identity: Mapping[str, Any], what: str) -> bool | None:
        """``what`` over exactly the recorded backend (pid *and* start time: pids recycle)."""
        pid = identity.get("pid")
        if pid is None:
            return None
        value = conn.execute(sa.text(
            f"SELECT {what} FROM pg_stat_activity WHERE pid = :pid"
            " AND backend_start::text = :start"
        ), {"pid": int(pid), "start": str(identity.get("backend_start"))}).scalar()
        return bool(value)

    def session_alive(self, conn: sa.Connection, identity: Mapping[str, Any]) -> bool | None:
        """Whether the recorded backend still exists (None: no pid recorded)."""
        return self._on_backend(conn, identity, "count(*) > 0")

    def terminate_session(self, conn: sa.Connection, identity: Mapping[str, Any]) -> bool:
        """Terminate exactly the recorded backend; True if it was terminated."""
        return bool(self._on_backend(conn, identity, "pg_terminate_backend(pid)"))

    def attempt_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """``pg_xact_status`` on the recorded xid8, on the same cluster and timeline only.

        An xid still in progress belongs to a session that may commit: with
        ``terminate`` exactly that backend is ended, and the xid asked again until
        it is over or ``wait_seconds`` have passed.
        """
        answers = {a.intent_id: AttemptEvidence() for a in attempts}
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            server = self.server_identity(conn)
            asked: dict[str, Attempt] = {}
            for a in attempts:
                answer, tx = answers[a.intent_id], a.tx
                answer.notes["server_now"] = server
                if not tx.get("xid") or not tx.get("system_identifier"):
                    answer.identity = "unrecorded"
                    answer.notes["commit_outcome"] = "no transaction id recorded"
                    continue
                same = (str(tx.get("system_identifier")) == str(server["system_identifier"])
                        and str(tx.get("timeline")) == str(server["timeline"]))
                answer.identity = "same" if same else "changed"
                if same:
                    asked[a.intent_id] = a
            status = self._xact_status(conn, asked.values())
            deadline = time.monotonic() + max(0.0, wait_seconds)
            terminated: set[str] = set()
            while True:
                busy = [a for i, a in asked.items() if status.get(i) == "in_progress"]
                if not busy:
                    break
                for a in busy:
                    alive = bool(self.session_alive(conn, a.tx))
                    notes = answers[a.intent_id].notes
                    notes["session_alive"] = alive
                    if alive and terminate and a.intent_id not in terminated:
                        notes["terminated_session"] = {
                            "pid": a.tx.get("pid"), "backend_start": a.tx.get("backend_start"),
                            "done": self.terminate_session(conn, a.tx)}
                        terminated.add(a.intent_id)
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_SECONDS)
                status.update(self._xact_status(conn, busy))
            for intent_id, a in asked.items():
                answer = answers[intent_id]
                answer.outcome = status.get(intent_id)
                answer.notes["commit_outcome"] = {"probe": "pg_xact_status",
                                                  "xid": a.tx.get("xid"),
                                                  "answer": answer.outcome}
                if answer.outcome in ("committed", "aborted"):
                    answer.finished = True
                elif answer.outcome == "in_progress":
                    answer.finished = False
        return answers

    def opening_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """The opening labels the session with the call's tag (``application_name``, for
        the transaction only: it reverts when the transaction ends), so a session still
        carrying it is that attempt's, alive in its transaction.  With ``terminate``
        exactly those backends (pid and start time) are ended, then watched until they
        are gone -- a session the partition split mid-batch has no server timeout to
        end it, and waiting alone would never settle it."""
        answers = {a.intent_id: AttemptEvidence(identity="unrecorded") for a in attempts}
        apps = {a.tag.text(): a.intent_id for a in attempts if a.tag is not None}
        if not apps:
            return answers
        query = sa.text(
            "SELECT pid, backend_start::text, application_name, state FROM pg_stat_activity"
            " WHERE application_name IN :apps AND pid <> pg_backend_pid()"
        ).bindparams(sa.bindparam("apps", expanding=True))
        alive: dict[str, list[dict[str, Any]]] = {}
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            deadline = time.monotonic() + max(0.0, wait_seconds)
            ended: set[str] = set()
            while True:
                alive = {}
                for pid, start, app, state in conn.execute(query, {"apps": sorted(apps)}):
                    alive.setdefault(apps[str(app)], []).append(
                        {"pid": int(pid), "backend_start": start, "state": state})
                for intent_id, sessions in alive.items():
                    notes = answers[intent_id].notes
                    notes.setdefault("opening_sessions", sessions)
                    if terminate and intent_id not in ended:
                        notes["terminated_session"] = [
                            {**s, "done": self.terminate_session(conn, s)} for s in sessions]
                        ended.add(intent_id)
                if not alive or time.monotonic() >= deadline:
                    break
                time.sleep(POLL_SECONDS)
        for a in attempts:
            answer = answers[a.intent_id]
            if a.tag is None:
                continue
            answer.finished = a.intent_id not in alive
            answer.notes["opening"] = ("no session of it is alive (application_name "
                                       f"{a.tag.text()!r})") if answer.finished else \
                "a session of it is still alive"
            if not answer.finished:
                answer.notes["session_alive"] = True
        return answers

    def _xact_status(self, conn: sa.Connection, attempts: Iterable[Attempt]) -> dict[str, str]:
        """One batched ``pg_xact_status`` over many xids; per xid when the batch fails.

        A NULL answer (xid older than the commit log keeps) and an error (an xid in
        the future) both leave the intent without an outcome: unknown.
        """
        by_xid: dict[str, list[str]] = {}
        for a in attempts:
            by_xid.setdefault(str(a.tx["xid"]), []).append(a.intent_id)
        out: dict[str, str] = {}
        if not by_xid:
            return out
        answers: dict[str, str | None]
        try:
            rows = conn.execute(sa.text(
                "SELECT u.x, pg_xact_status(CAST(u.x AS xid8))"
                " FROM unnest(CAST(:xids AS text[])) AS u(x)"), {"xids": list(by_xid)}).all()
            answers = {str(x): (_XACT_STATUS.get(str(s)) if s is not None else None)
                       for x, s in rows}
        except sa.exc.DBAPIError:
            answers = {}
            for xid in by_xid:
                try:
                    answers[xid] = self.commit_outcome(conn, {"xid": xid})
                except sa.exc.DBAPIError:
                    answers[xid] = None
        for xid, ids in by_xid.items():
            answer = answers.get(xid)
            if answer is not None:
                for intent_id in ids:
                    out[intent_id] = answer
        return out

    def prepare_ddl_checks(self, conn: sa.Connection) -> str | None:
        """``CREATE EXTENSION plpgsql_check`` where the server has the package; else the
        one command that installs it."""
        if conn.execute(sa.text("SELECT 1 FROM pg_extension WHERE extname = 'plpgsql_check'")
                        ).first() is not None:
            return None
        if conn.execute(sa.text("SELECT 1 FROM pg_available_extensions "
                                "WHERE name = 'plpgsql_check'")).first() is None:
            conn.rollback()
            return _plpgsql_check_fix(conn)
        try:
            conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS plpgsql_check"))
            conn.commit()
        except sa.exc.DBAPIError as exc:
            conn.rollback()
            return (f"CREATE EXTENSION plpgsql_check failed ({first_line(exc)}); a role that "
                    "may create extensions runs it in this database")
        return None

    # --- capgate doctor ---------------------------------------------------------------

    def describe_server(self, conn: sa.Connection) -> str:
        version = conn.execute(sa.text("SHOW server_version")).scalar()
        system = conn.execute(sa.text("SELECT system_identifier FROM pg_control_system()")
                              ).scalar()
        where = conn.execute(sa.text("SELECT current_database(), current_user")).one()
        return f"PostgreSQL {version}, system {system}, database {where[0]}, user {where[1]}"

    _EXCESS_ROLES: ClassVar[dict[str, str]] = {
        "pg_signal_backend": "can cancel and terminate other roles' sessions",
        "pg_read_server_files": "can read any file the server can (COPY FROM, pg_read_file)",
        "pg_write_server_files": "can write any file the server can (COPY TO)",
        "pg_execute_server_program": "can run programs on the server (COPY ... PROGRAM)",
        "pg_write_all_data": "can write every table, whatever the grants say",
    }

    def excess_privileges(self, conn: sa.Connection) -> list[str]:
        """Superuser and the role attributes and predefined roles that reach beyond tables."""
        found: list[str] = []
        attrs = conn.execute(sa.text(
            "SELECT rolsuper, rolcreaterole, rolbypassrls, rolreplication FROM pg_roles "
            "WHERE rolname = current_user")).one()
        for held, what in zip(attrs, (
                "SUPERUSER: bypasses every privilege check",
                "CREATEROLE: can create roles and grant itself their rights",
                "BYPASSRLS: ignores row-level security",
                "REPLICATION: can stream every change of the cluster"), strict=True):
            if held:
                found.append(what)
        members = conn.execute(sa.text(
            "SELECT r.rolname FROM pg_roles r WHERE r.rolname = ANY(:names) "
            "AND pg_has_role(current_user, r.oid, 'MEMBER') ORDER BY r.rolname"),
            {"names": list(self._EXCESS_ROLES)}).scalars().all()
        found += [f"member of {name}: {self._EXCESS_ROLES[name]}" for name in members
                  if not attrs[0]]  # a superuser is a member of every role: said once
        return found

    def diagnose(self, conn: sa.Connection, diagnosis: Diagnosis) -> None:
        """Table privileges, connection limits, and for DDL rows plpgsql_check and CREATE."""

        def scalar(sql: str, **binds: Any) -> Any:
            return conn.execute(sa.text(sql), binds).scalar()

        def has(table: str, privilege: str) -> bool | None:
            if scalar("SELECT to_regclass(:t) IS NOT NULL", t=table) is not True:
                return None
            return bool(scalar("SELECT has_table_privilege(:t, :p)", t=table, p=privilege))

        diagnosis.privileges(has)
        # ending a session: resume terminates exactly the recorded backend, which runs as the
        # connector's own role -- allowed for the same role, for pg_signal_backend, superusers
        if diagnosis.writes:
            diagnosis.ok("resume may end the account's own sessions "
                         "(pg_terminate_backend on a backend of the same role)")
        limits = conn.execute(sa.text(
            "SELECT r.rolconnlimit, d.datconnlimit, current_setting('max_connections')::int "
            "- current_setting('superuser_reserved_connections')::int, r.rolsuper "
            "FROM pg_roles r, pg_database d WHERE r.rolname = current_user "
            "AND d.datname = current_database()")).one()
        diagnosis.session_limit(int(limits[0]), "the role's CONNECTION LIMIT")
        diagnosis.session_limit(int(limits[1]), "the database's CONNECTION LIMIT")
        diagnosis.session_limit(int(limits[2]),
                                "max_connections (less superuser_reserved_connections)")
        if diagnosis.ddl_rows:
            installed = scalar("SELECT extversion FROM pg_extension "
                               "WHERE extname = 'plpgsql_check'")
            if installed is None:
                # a warning, not an error: the rows still run, their compile status is
                # what cannot be verified -- a first run of a new project stays green
                diagnosis.warning(
                    ExtensionMissing.code,
                    f"the DDL rows ({', '.join(diagnosis.ddl_rows)}) are unverifiable here: "
                    "the DDL loop takes compile status from plpgsql_check, which this "
                    "database lacks; " + _plpgsql_check_fix(conn))
            else:
                diagnosis.ok(f"plpgsql_check {installed} is installed (DDL rows)")
            create = scalar("SELECT has_schema_privilege(current_schema(), 'CREATE') "
                            "OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)")
            if not create:
                diagnosis.error(
                    PrivilegeMissing.code,
                    "the DDL rows need CREATE on the schema (to replace stored code); "
                    f"the account lacks it on {scalar('SELECT current_schema()')}")
            else:
                diagnosis.ok("DDL capture (pg_proc, pg_views) and apply (CREATE "
                             "on the schema) are allowed")
