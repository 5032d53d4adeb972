"""The small protocol every dialect implements, and its shared defaults.

Capabilities are questions with a ``check=`` switch (psycopg style): with
``check=True`` a missing feature raises ``NotSupported`` naming the dialect,
so code that needs one says so instead of guessing.  Everything else that
differs by engine is a method here with the conservative default, overridden
in the engine's own module: nothing outside ``executor/dialects`` asks which
engine it is talking to (``tests/test_engine_boundaries.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from capgate.executor.cutoff import CUTTER, Cut
from capgate.executor.dialects.registration import Implementations, Registered, package_modules
from capgate.registry.errors import NotSupported

SECRET_KEY = re.compile(r"pass(word|wd)?|secret|token|credential", re.IGNORECASE)
"""Query or ``connect_args`` keys that carry a secret (``wallet_password``, ``access_token``)."""


def safe_url(url: str | URL) -> str:
    """The URL as it may be printed, logged or put in a plan: the password and every
    secret query value hidden (a driver takes ``?wallet_password=`` in the query too)."""
    parsed = make_url(url)
    hidden = {k: "***" for k in parsed.query if SECRET_KEY.search(k)}
    if hidden:
        parsed = parsed.update_query_dict(hidden)
    return parsed.render_as_string(hide_password=True)


_USERINFO = re.compile(r"(?P<head>://[^/?#@\s]*?:)(?P<secret>[^/?#\s]*)(?P<at>@)")
_QUERY_VALUE = re.compile(r"(?P<key>[?&;][^=&;#\s]+=)(?P<value>[^&;#\s]*)")


def safe_url_text(text: str) -> str:
    """``text`` (a URL, perhaps one that does not parse) as it may be printed: the password
    and every secret query value hidden.  A URL that parses goes through
    :func:`safe_url`; one that does not is redacted as text -- everything between
    ``user:`` and the last ``@`` before the host, and each secret query value -- so that
    a typo in a port never prints the password beside it."""
    try:
        return safe_url(text)
    except Exception:  # an unparseable URL is redacted as text below
        pass
    hidden = _USERINFO.sub(lambda m: f"{m['head']}***{m['at']}", text)
    return _QUERY_VALUE.sub(
        lambda m: m["key"] + ("***" if SECRET_KEY.search(m["key"].strip("?&;=")) else m["value"]),
        hidden)


MARKER_TABLE = "capgate_landed"
FENCE_TABLE = "capgate_fence"
TARGET_TABLES = (MARKER_TABLE, FENCE_TABLE)
"""capgate's own tables in a target database (installed once by `capgate target install`)."""
MARKER_INSERT = (
    f"INSERT INTO {MARKER_TABLE} (intent_id, idem_key, fingerprint, attempt, case_id,"
    " operation_id, landed_at) VALUES (:intent_id, :idem_key, :fingerprint, :attempt,"
    " :case_id, :operation_id, :landed_at)"
)
FENCE_VALUES = "(key_hash, impact_key, token, intent_id) VALUES (:h, :k, :t, :i)"
FENCE_UPSERT = (
    f"INSERT INTO {FENCE_TABLE} {FENCE_VALUES} ON CONFLICT (key_hash) DO UPDATE"
    f" SET token = excluded.token, intent_id = excluded.intent_id"
    f" WHERE {FENCE_TABLE}.token <= excluded.token RETURNING token"
)
"""Move a key's fence row to our token, or leave a newer one alone (PostgreSQL, SQLite).

One statement per key, an upsert rather than UPDATE-then-INSERT: on InnoDB an
UPDATE of a missing row takes a gap lock, and two first-time writers of
different keys would deadlock on their INSERTs."""
FENCE_READ = f"SELECT token, intent_id FROM {FENCE_TABLE} WHERE key_hash = :h"


DEADLINE_KEY = "capgate_deadline"
"""Where a write transaction's :class:`TxDeadline` lives (``Connection.info``) while open."""
REARM_AFTER_SECONDS = 0.25
"""Re-arm the server's timeouts before a statement when the last arming is older than this."""
IDLE_GRACE_SECONDS = 0.75
"""How long the server lets a write transaction sit idle before it ends the session.

Held small and constant, because the server counts an idle period from the end of
the last statement, which the executor cannot know in advance: a stopped
executor's transaction then ends at most this long after its last statement, and
its statements end by the deadline (their timeout is the time left), so its locks
go within the deadline plus :data:`REARM_AFTER_SECONDS` plus this."""


@dataclass
class TxDeadline:
    """The deadline of one open write transaction, and when the server was last armed."""

    deadline: float
    """``time.monotonic()`` at which the transaction must be over."""
    armed_at: float
    """``time.monotonic()`` of the last arming (the opening counts as one)."""

    @classmethod
    def starting_now(cls, seconds: float) -> TxDeadline:
        now = time.monotonic()
        return cls(now + float(seconds), now)

    def left(self) -> float:
        return self.deadline - time.monotonic()


CLIENT_GRACE_SECONDS = 1.0
"""How long past a write transaction's deadline the client waits for the server's answer
before it cuts the connection (:mod:`executor.cutoff`).

The server stops a statement at the deadline (its statement timeout is the time left), so
an answer that has not come a second later will not come: the network is cut.  A call
therefore returns by its deadline plus this, plus the few milliseconds its outcome takes
to record (:data:`RETURN_GRACE_SECONDS`)."""
RETURN_GRACE_SECONDS = 1.5
"""What a call may take past its deadline when the target stops answering (documented in
``docs/scaling.md``): the cut at :data:`CLIENT_GRACE_SECONDS`, then the outcome recorded."""
CUT_KEY = "capgate_cut"
"""Where the :class:`~executor.cutoff.Cut` guarding a connection's transaction lives
(``Connection.info``) while it is armed; a statement outside one arms its own."""
CONNECT_TIMEOUT_SECONDS = 5.0
"""Default bound on opening a session (a connector's ``connect_timeout``)."""
NETWORK_TIMEOUT_SECONDS = 10.0
"""Default bound on one statement outside a call's transaction (a connector's
``network_timeout``): resume's evidence, capgate's own checks of its tables."""
SERVER_KEEPALIVE = (2, 1, 2)
"""TCP keepalive a server is asked to keep on capgate's sessions where it can be set per
session (PostgreSQL ``tcp_keepalives_idle``, ``_interval``, ``_count``): a client cut off
by a partition is declared gone about 4 s after its last packet -- even while the server
waits for the rest of a message, where no statement or idle timeout runs."""

POLL_SECONDS = 0.02
"""Seconds between two looks at a session that is ending (resume's evidence)."""
IN_LIST_CHUNK = 500
"""Most values in one ``IN (...)`` list (Oracle allows 1,000)."""


def chunks(values: Sequence[Any]) -> Iterator[list[Any]]:
    """``values`` in lists of at most :data:`IN_LIST_CHUNK`, for ``IN (...)`` binds."""
    for i in range(0, len(values), IN_LIST_CHUNK):
        yield list(values[i:i + IN_LIST_CHUNK])


def shut_down_socket(fd: int) -> bool:
    """Shut the socket behind file descriptor ``fd`` down both ways (the descriptor stays
    the driver's to close): every read blocked on it returns at once."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:  # not connected any more
        return False
    finally:
        sock.close()


def tune_keepalive(sock: socket.socket, idle: int = 5, interval: int = 1, count: int = 3,
                   user_timeout_ms: int = 10_000) -> None:
    """TCP keepalive and user timeout on a client socket a driver opened (Linux options;
    skipped where the platform has none)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                            ("TCP_KEEPCNT", count), ("TCP_USER_TIMEOUT", user_timeout_ms)):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def url_setting(url: URL, key: str) -> str | None:
    """A URL query setting as one string (the last, if given twice); None when absent."""
    value = url.query.get(key)
    if value is None:
        return None
    return str(value[-1] if isinstance(value, tuple) else value)


def first_line(exc: BaseException) -> str:
    """The driver's own message, first line only (no SQL text, no parameters)."""
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return lines[0] if lines else type(orig).__name__


_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


_CURSOR_KEY = "capgate_cursor"


def _session_cursor(fairy: Any, raw: Any) -> Any:
    """The pooled connection's one driver cursor for :meth:`Dialect.execute`, made once.

    A new cursor per statement costs as much client CPU as a fifth of the round trip
    (psycopg copies its adapters into each); every caller reads its result before the
    next statement, so one cursor per session serves them all.  It is kept with the
    driver connection it belongs to: a connection replaced after a disconnect gets its
    own, and a cursor found closed is replaced.  What the last statement returned stays
    in the client with the pooled session until its next statement: one result per
    pooled session, as large as that statement's answer.
    """
    held = fairy.info.get(_CURSOR_KEY)
    if held is not None and held[0] is raw and not _closed(held[1]):
        return held[1]
    cursor = raw.cursor()
    fairy.info[_CURSOR_KEY] = (raw, cursor)
    return cursor


def _closed(cursor: Any) -> bool:
    """A cursor someone closed (psycopg says so; PyMySQL drops its connection)."""
    return bool(getattr(cursor, "closed", False)) or getattr(cursor, "connection", True) is None


@functools.lru_cache(maxsize=4096)
def _pyformat(text: str) -> str:
    """``:name`` binds as ``%(name)s`` (psycopg, PyMySQL), a literal ``%`` doubled."""
    return _NAMED.sub(r"%(\1)s", text.replace("%", "%%"))


def rearm_before_statement(conn: Any, cursor: Any, statement: str, parameters: Any,
                           context: Any, executemany: bool) -> tuple[str, Any]:
    """``before_cursor_execute`` (``retval=True``): keep the server's timeouts on the time
    left; returns the statement to send.

    Installed on every connector engine.  Acts only inside a write transaction (one
    with a :class:`TxDeadline`).  An engine that can bound one statement in its own
    text (MariaDB ``SET STATEMENT max_statement_time = ... FOR``) gets the time left
    written into each statement (:meth:`Dialect.statement_deadline`, no round trip).
    Otherwise the session's timeouts are re-armed when the last arming is older than
    :data:`REARM_AFTER_SECONDS` -- in a collapsed call that is never, as all its
    statements follow the opening within milliseconds.  It covers every statement
    sent in the transaction, registered step functions included.
    """
    tx = conn.info.get(DEADLINE_KEY)
    if tx is None:
        return statement, parameters
    dialect = conn.info.get(DEADLINE_KEY + ":dialect")
    if dialect is None:
        return statement, parameters
    now = time.monotonic()
    bounded = dialect.statement_deadline(statement, tx.deadline - now)
    if bounded is not None:
        return bounded, parameters
    if now - tx.armed_at > REARM_AFTER_SECONDS:
        tx.armed_at = now
        dialect.arm_deadline(conn.connection.driver_connection, max(tx.deadline - now, 0.001))
    return statement, parameters


def before_statement(conn: sa.Connection, cursor: Any, statement: str, parameters: Any
                     ) -> tuple[str, Any]:
    """Run the engine's ``before_cursor_execute`` listeners as SQLAlchemy does, for a
    statement sent on the driver's own cursor: each may replace the statement (the
    per-statement deadline), and every one sees it."""
    for listener in conn.dispatch.before_cursor_execute:
        statement, parameters = listener(conn, cursor, statement, parameters, None, False)
    return statement, parameters


_STATEMENT_CUT = "capgate_statement_cut"


@contextlib.contextmanager
def _guarded(dialect: Dialect, conn: sa.Connection, seconds: float) -> Iterator[Cut]:
    raw = conn.connection.driver_connection
    cut = CUTTER.arm(time.monotonic() + max(0.0, seconds), lambda: dialect.cut(raw))
    conn.info[CUT_KEY] = cut
    try:
        yield cut
    finally:
        cut.disarm()
        if not (conn.invalidated or conn.closed):
            conn.info.pop(CUT_KEY, None)


class StatementCuts:
    """Engine events: a statement outside a guarded transaction is cut after ``seconds``.

    ``before_cursor_execute`` arms a cut for the statement unless the connection's
    transaction is guarded already (:meth:`Dialect.guard`); ``after_cursor_execute`` and
    ``handle_error`` disarm it.  (:meth:`Dialect.execute`, which sends a call's statements
    on the driver's cursor, disarms it itself.)
    """

    def __init__(self, dialect: Dialect, seconds: float) -> None:
        self.dialect = dialect
        self.seconds = seconds

    def install(self, engine: sa.Engine) -> None:
        sa.event.listen(engine, "before_cursor_execute", self.before)
        sa.event.listen(engine, "after_cursor_execute", self.after)
        sa.event.listen(engine, "handle_error", self.error)

    def before(self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
               executemany: bool) -> None:
        info = conn.info
        if CUT_KEY in info:
            return
        raw = conn.connection.driver_connection
        dialect = self.dialect
        info[_STATEMENT_CUT] = CUTTER.arm(time.monotonic() + self.seconds,
                                          lambda: dialect.cut(raw))

    def after(self, conn: Any, *_: Any) -> None:
        disarm_statement_cut(conn)

    def error(self, context: sa.engine.ExceptionContext) -> None:
        if context.connection is not None:
            disarm_statement_cut(context.connection)


class ConnectCuts:
    """Pool events: a new session that is not ready within ``seconds`` is cut.

    The driver's own connect timeout bounds its handshake; SQLAlchemy then sends the
    first session's set-up queries (server version, type information) with its events
    off, where no statement cut runs.  ``connect`` (run first: ``insert=True``) arms a cut
    on the new driver connection, ``checkout`` disarms it once the session is handed out.
    """

    _KEY = "capgate_connect_cut"

    def __init__(self, cut: Callable[[Any], object], seconds: float) -> None:
        self.cut = cut
        self.seconds = seconds

    def install(self, engine: sa.Engine) -> None:
        sa.event.listen(engine, "connect", self.connected, insert=True)
        sa.event.listen(engine, "checkout", self.checked_out)

    def connected(self, dbapi_connection: Any, record: Any) -> None:
        cut = self.cut
        record.info[self._KEY] = CUTTER.arm(time.monotonic() + self.seconds,
                                            lambda: cut(dbapi_connection))

    def checked_out(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        armed = record.info.pop(self._KEY, None)
        if armed is not None:
            armed.disarm()


def disarm_statement_cut(conn: sa.Connection) -> bool:
    """Disarm the statement's cut (True: it had fired -- the connection was cut)."""
    if conn.invalidated or conn.closed:
        return False
    cut = conn.info.pop(_STATEMENT_CUT, None)
    return cut.disarm() if cut is not None else False


@dataclass(frozen=True)
class SessionTag:
    """Who is writing and why, as shown to a DBA looking at the server."""

    case_id: str
    operation_id: str
    intent_id: str
    dates: frozenset[tuple[str, str]] = frozenset()
    """``(input, "date" | "date-time")`` for each input the row declares with that
    ``format``: a dialect that must bind them as dates (Oracle, where a string meets a
    DATE through ``NLS_DATE_FORMAT``) can."""

    def text(self, limit: int = 63) -> str:
        """``capgate INTENT CASE OPERATION``, cut at ``limit`` (PostgreSQL keeps 63 bytes of
        ``application_name``): the intent id first, so that it is always whole -- resume
        finds a session whose opening was never recorded by it."""
        raw = f"capgate {self.intent_id} {self.case_id} {self.operation_id}"
        return _SAFE.sub("_", raw)[:limit]

    def comment(self) -> str:
        """A leading SQL comment; the text can never close the comment early."""
        return f"/* capgate case={_SAFE.sub('_', self.case_id)} " \
               f"op={_SAFE.sub('_', self.operation_id)} intent={self.intent_id} */ "


_SAFE = re.compile(r"[^A-Za-z0-9_.:@ -]")


@dataclass(frozen=True)
class TxIdentity:
    """What identifies a transaction after the fact (recorded before COMMIT)."""

    dialect: str
    values: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"dialect": self.dialect, **self.values}


@dataclass(frozen=True)
class Attempt:
    """One recorded attempt, as resume asks the target about it (read from the ledger)."""

    intent_id: str
    tx: Mapping[str, Any]
    """The transaction's identity, recorded before COMMIT (:meth:`TxIdentity.to_dict`)."""
    idem_key: str | None = None
    """The landing marker's key; None when the row writes no marker."""
    error: str | None = None
    """The error recorded with the attempt (an in-doubt commit names itself in it)."""
    tag: SessionTag | None = None
    """The call's session label (case, operation, intent): what an opening whose
    identity was never recorded leaves on the server (:meth:`Dialect.opening_evidence`)."""


@dataclass
class AttemptEvidence:
    """What the target says about one attempt's transaction, before any conclusion."""

    outcome: str | None = None
    """``committed``, ``aborted``, ``in_progress``, ``committed_incomplete``; None: no answer."""
    finished: bool | None = None
    """True when the attempt's transaction can no longer commit; None when unknowable."""
    identity: str = "unchecked"
    """``same`` / ``changed`` server (incarnation, timeline), ``unrecorded``, ``unchecked``."""
    notes: dict[str, Any] = field(default_factory=dict)
    """What was asked and answered, for the operator (``session``, ``terminated_session`` ...)."""


class Diagnosis(Protocol):
    """Where a dialect's read-only checks of a live target report (``capgate doctor``).

    The face implements it for one connector: the dialect asks its catalog what
    the connector's rows need and says what it found, without knowing how the
    findings are shown.
    """

    @property
    def writes(self) -> bool:
        """Whether any of the connector's rows writes (resume may need to end a session)."""
        ...

    @property
    def ddl_rows(self) -> Sequence[str]:
        """The connector's DDL rows."""
        ...

    @property
    def leased_rows(self) -> Sequence[str]:
        """The connector's leased rows."""
        ...

    def ok(self, message: str, **details: Any) -> None: ...

    def warning(self, code: str, message: str, **details: Any) -> None: ...

    def error(self, code: str, message: str, **details: Any) -> None: ...

    def privileges(self, has: Callable[[str, str], bool | None]) -> None:
        """Check every (table, privilege) the rows need; ``has`` answers None for no table."""
        ...

    def session_limit(self, limit: int | None, what: str, reserve: int = 0) -> None:
        """Compare a limit on the account's sessions with the connector's budget."""
        ...


class Dialect(Registered):
    """Defaults are the conservative answers: no probe, no server-side lease, no liveness."""

    implementations: ClassVar[Implementations[Dialect]] = Implementations(
        "dialect", module_of=lambda name: f"capgate.executor.dialects.{name}",
        modules=package_modules("capgate.executor.dialects"))
    title: ClassVar[str] = "generic"
    """The engine's name as people write it (``PostgreSQL``), for messages."""
    driver: ClassVar[str | None] = None
    """The SQLAlchemy driver capgate pins for this engine (``postgresql+psycopg``)."""
    url_schemes: ClassVar[frozenset[str]] = frozenset()
    """The URL schemes a user may write that get :attr:`driver` (``postgres``, ``mariadb``)."""
    connector_settings: ClassVar[frozenset[str]] = frozenset()
    """Connector settings only this engine takes (Oracle ``thick_mode``, ``current_schema``)."""
    ping_sql: ClassVar[str] = "SELECT 1"
    """The cheapest statement that proves a session answers."""

    def check_lease(self) -> None:
        """Refuse a leased row (``LeaseNotEnforceable``) where nothing can end it on time.

        Called before a leased call records anything.  The default accepts:
        PostgreSQL and MariaDB arm server-side timeouts, and SQLite has no
        server whose locks could outlive the executor's process.
        """

    # --- returned keys (issue 16) --------------------------------------------

    returning_verbs: ClassVar[frozenset[str]] = frozenset()
    """The statements this engine can make return a key (``RETURNING``): none by default."""
    sequences_survive_rollback: ClassVar[bool] = True
    """Whether a key an INSERT drew from a sequence or identity stays consumed after a
    ROLLBACK (PostgreSQL, MariaDB and Oracle: yes; SQLite reuses the rowid)."""

    # --- a hung executor's locks ------------------------------------------------

    idle_grace_seconds: ClassVar[float] = IDLE_GRACE_SECONDS
    """The idle timeout this engine arms on a write transaction (see
    :data:`IDLE_GRACE_SECONDS`); an engine whose setting counts coarser says so."""
    statement_end_after_deadline: ClassVar[float] = REARM_AFTER_SECONDS
    """How long past the deadline a statement of a write transaction can still run: the
    statement timeout is armed to the time left, and re-armed only when the last arming
    is :data:`REARM_AFTER_SECONDS` old, so a statement sent just before the next
    re-arming may end that much late.  Negative where each statement carries its own
    timeout, ended that early (MariaDB, whose idle timeout counts whole seconds)."""

    @classmethod
    def locks_gone_after_deadline(cls) -> float:
        """Seconds past its deadline by which a stopped executor's transaction is over.

        Its last statement ends by the deadline plus :attr:`statement_end_after_deadline`,
        and the server ends the idle session :attr:`idle_grace_seconds` after it: 1 s on
        PostgreSQL, 0.9 s on MariaDB.  (PostgreSQL also releases a transaction's locks
        the moment its statement is stopped.)  The lease sweeper's margin must not be
        shorter than this.
        """
        return cls.statement_end_after_deadline + cls.idle_grace_seconds

    def statement_deadline(self, statement: str, left: float) -> str | None:
        """``statement`` carrying its own timeout of (about) ``left`` seconds, or None
        where the engine has no such form (the session's timeout is re-armed instead)."""
        return None

    def has_returning(self, verb: str, *, check: bool = False) -> bool:
        """Whether an ``verb`` (INSERT, UPDATE, DELETE) statement can return its keys here."""
        ok = verb in self.returning_verbs
        if not ok and check:
            raise NotSupported(
                f"{self.name} cannot return the keys of an {verb} statement (no RETURNING "
                "for it here); drop `returns` from the row or run it on another engine",
                dialect=self.name, verb=verb)
        return ok

    def returning_sql(self, sql: str, key: str) -> str:
        """``sql`` with the clause that returns column ``key`` (an identifier of the row)."""
        return f"{sql.rstrip().rstrip(';').rstrip()} RETURNING {key}"

    def returned(self, cursor: Any) -> tuple[int, list[Any]]:
        """(the statement's count, the key values it returned), read from its cursor.

        With ``RETURNING`` every affected row returns one value, so the count is
        the number of rows read (sqlite3's ``rowcount`` is only right once they
        are all read; this never depends on it).
        """
        rows = cursor.fetchall()
        return len(rows), [r[0] for r in rows]

    def configure(self, options: Mapping[str, Any]) -> None:
        """Connector settings the dialect applies to its sessions (Oracle ``current_schema``).

        Called once by ``Connector.open`` before the engine exists; the default
        takes none.
        """

    # --- engines and sessions ------------------------------------------------

    def engine_options(self) -> dict[str, Any]:
        # No pre-ping (a round trip per call): the executor retries the opening of a
        # transaction once on a connection that turns out to be dead instead.
        return {"pool_recycle": 1800}

    def pool_options(self, session_budget: int, db_user_budget: int | None) -> dict[str, Any]:
        """``create_engine`` pool options for a connector with these budgets.

        A server counts an idle pooled session against the database user's cap, so a
        connector with a ``db_user_budget`` keeps none (executor/budget.py); otherwise
        the pool holds at most ``session_budget`` sessions.
        """
        if db_user_budget is not None:
            return {"poolclass": sa.pool.NullPool}
        return {"pool_size": session_budget, "max_overflow": 0}

    @classmethod
    def prepare_driver(cls, connector: str, settings: Mapping[str, Any]) -> None:
        """Set the driver up for the whole process before its first connection, from the
        connector's :attr:`connector_settings` (Oracle's ``thick_mode``).  Default: none."""

    @classmethod
    def database_file(cls, url: URL) -> str | None:
        """The local file ``url``'s database lives in; None for a server's database."""
        return None

    def prepare_engine(self, engine: sa.Engine) -> None:
        """Install event hooks (e.g. SQLite pragmas)."""

    # --- the network: connect timeout, keepalive, the client-side cut --------------

    def network_args(self, url: URL, connect_timeout: float) -> dict[str, Any]:
        """Driver ``connect_args`` bounding the network waits the driver can bound itself:
        opening a session within ``connect_timeout`` seconds, TCP keepalive and user
        timeout on the client's socket, and what the server may keep per session.
        ``url`` is the connection's (its own settings win).  Default: none."""
        return {}

    def cut(self, raw: Any) -> bool:
        """Shut the driver connection ``raw``'s socket down, from another thread, so that a
        read blocked on it fails at once as a lost connection (see :mod:`executor.cutoff`);
        True if there was a socket to cut.  Default: nothing to cut (no network, or a driver
        that bounds its own round trips, as python-oracledb's ``call_timeout``)."""
        return False

    def target_ddl(self) -> dict[str, str]:
        """``CREATE TABLE`` for each of capgate's tables in a target, by table name.

        Run once by a privileged account (``capgate target install``), never by a
        call: a least-privilege account need not be able to create tables.
        """
        return {
            MARKER_TABLE: (
                f"CREATE TABLE {MARKER_TABLE} ("
                " intent_id VARCHAR(64) NOT NULL PRIMARY KEY,"
                " idem_key VARCHAR(400) NOT NULL UNIQUE,"
                " fingerprint VARCHAR(80) NOT NULL,"
                " attempt INTEGER NOT NULL,"
                " case_id VARCHAR(200) NOT NULL,"
                " operation_id VARCHAR(64) NOT NULL,"
                " landed_at VARCHAR(40) NOT NULL)"),
            FENCE_TABLE: (
                f"CREATE TABLE {FENCE_TABLE} (key_hash VARCHAR(64) NOT NULL PRIMARY KEY,"
                " impact_key VARCHAR(400) NOT NULL, token BIGINT NOT NULL,"
                " intent_id VARCHAR(64) NOT NULL)"),
        }

    GRANTEE: ClassVar[re.Pattern[str]] = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")
    """A role or user name given on the command line (``--grant-to``): a plain identifier."""

    def grantee(self, name: str) -> str:
        """``name`` as it goes into a GRANT: checked against the identifier rules, then
        quoted by the dialect's SQLAlchemy identifier preparer (where quoting is needed).

        A name from the command line is never pasted into SQL as typed: one carrying a
        quote, a semicolon, a space or a comment is refused (``InvalidIdentifier``)
        before anything is sent.
        """
        from capgate.registry.errors import InvalidIdentifier

        if not isinstance(name, str) or not self.GRANTEE.fullmatch(name):
            raise InvalidIdentifier(
                f"{name!r} is not a plain {self.title} role or user name (letters, digits, "
                "_ and $, starting with a letter or _, at most 63 characters); nothing was "
                "executed", name=str(name)[:200], dialect=self.name)
        return self.quote_identifier(name)

    def quote_identifier(self, name: str) -> str:
        """``name`` quoted as this engine's SQLAlchemy dialect quotes an identifier."""
        driver = self.driver or self.name
        sa_dialect = make_url(f"{driver}://").get_dialect()()
        return str(sa_dialect.identifier_preparer.quote(name))

    def target_grants(self, grantee: str) -> list[str]:
        """What a calling account needs on capgate's tables (``--grant-to``); ``grantee``
        comes from :meth:`grantee` (checked and quoted)."""
        return [f"GRANT SELECT, INSERT ON {MARKER_TABLE} TO {grantee}",
                f"GRANT SELECT, INSERT, UPDATE ON {FENCE_TABLE} TO {grantee}"]

    def probe_table_sql(self, table: str) -> str:
        """A query that reads nothing but fails if ``table`` is missing or unreadable."""
        return f"SELECT 1 FROM {table} WHERE 1 = 0"

    def sql(self, text: str, tag: SessionTag | None) -> str:
        """The SQL as sent; dialects without a session label prefix a comment."""
        return text

    driver_paramstyle: ClassVar[str] = "named"
    """How the driver takes binds: ``named`` (``:name``: sqlite3, python-oracledb) or
    ``pyformat`` (``%(name)s``: psycopg, PyMySQL)."""

    reuse_cursor: ClassVar[bool] = True
    """:meth:`execute` runs every statement of a session on one driver cursor."""

    def execute(self, conn: sa.Connection, text: str, params: Mapping[str, Any],
                tag: SessionTag | None = None) -> Any:
        """Run one statement of a row on the driver's own cursor; the cursor is returned.

        A call's statements go straight to the driver (SQLAlchemy would compile,
        cache-look-up and wrap each one).  The server's timeouts are re-armed
        first, as :func:`rearm_before_statement` does for statements sent through
        SQLAlchemy; a driver error is raised as SQLAlchemy's ``DBAPIError``, the
        connection invalidated when the driver says it is gone -- exactly what
        the same statement through SQLAlchemy would raise.
        """
        native = _pyformat(text) if self.driver_paramstyle == "pyformat" else text
        sql = self.sql(native, tag)
        fairy = conn.connection
        raw = fairy.driver_connection
        assert raw is not None, "a statement on a closed connection"
        cursor = _session_cursor(fairy, raw) if self.reuse_cursor else raw.cursor()
        binds = dict(params)
        # SQLAlchemy's own statement event still fires (the engine's re-arming listener,
        # and whatever instrumentation a user attached): the statement is still seen
        try:
            # inside the try: re-arming the timeouts is a round trip of its own, and it
            # meets a terminated session first (issue 11 item 14: a woken stale executor)
            try:
                sql, binds = before_statement(conn, cursor, sql, binds)
                cursor.execute(sql, binds)
            finally:
                if CUT_KEY not in fairy.info:
                    disarm_statement_cut(conn)
        except Exception as exc:
            dbapi = conn.dialect.loaded_dbapi
            if not isinstance(exc, dbapi.Error):
                raise
            gone = bool(conn.dialect.is_disconnect(exc, fairy.dbapi_connection, cursor))
            if gone:
                conn.invalidate(exc)
            raise sa.exc.DBAPIError.instance(sql, binds, exc, dbapi.Error,
                                              connection_invalidated=gone,
                                              dialect=conn.dialect) from exc
        return cursor

    def begin_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                    lock_timeout_s: float | None,
                    marker: dict[str, Any] | None = None) -> TxIdentity:
        """Start the write transaction, label it, set server timeouts, return its identity.

        ``marker`` (the landing-marker row) is inserted in the same transaction; where
        it is placed inside the transaction does not matter, so dialects that can fold
        it into the opening round trip do.
        """
        identity = self.open_write(conn, tag, timeout_s, lock_timeout_s)
        if marker is not None:
            self.insert_marker(conn, tag, marker)
        return identity

    def open_write(self, conn: sa.Connection, tag: SessionTag, timeout_s: float,
                   lock_timeout_s: float | None) -> TxIdentity:
        raise NotImplementedError

    def start_deadline(self, conn: sa.Connection, timeout_s: float) -> None:
        """Remember the transaction's deadline on the connection (see :class:`TxDeadline`).

        Called before the opening round trip, which arms the server with the full
        timeout; later statements are re-armed to the time left.
        """
        conn.info[DEADLINE_KEY] = TxDeadline.starting_now(timeout_s)
        conn.info[DEADLINE_KEY + ":dialect"] = self

    @staticmethod
    def end_deadline(conn: sa.Connection) -> None:
        """The transaction is over: no more re-arming on this pooled connection.

        An invalidated connection is left alone: touching its ``info`` would open a new
        session (over a network that may be cut), and a new session starts with none.
        """
        if conn.invalidated or conn.closed:
            return
        conn.info.pop(DEADLINE_KEY, None)
        conn.info.pop(DEADLINE_KEY + ":dialect", None)

    def guard(self, conn: sa.Connection, seconds: float) -> AbstractContextManager[Cut]:
        """Cut ``conn``'s socket if the block has not ended ``seconds`` from now (see
        :mod:`executor.cutoff`): a transaction's guard, under which no statement arms
        its own."""
        return _guarded(self, conn, seconds)

    def arm_deadline(self, raw: Any, left: float) -> None:
        """Arm the server: statement timeout to ``left``, idle timeout to the grace.

        ``raw`` is the DBAPI connection (this runs inside SQLAlchemy's
        ``before_cursor_execute``).  Dialects without server-side timeouts do
        nothing.
        """

    def insert_marker(self, conn: sa.Connection, tag: SessionTag,
                      marker: dict[str, Any]) -> None:
        conn.execute(sa.text(self.sql(MARKER_INSERT, tag)), marker)

    def begin_read(self, conn: sa.Connection, tag: SessionTag, timeout_s: float) -> None:
        """Start an engine-enforced read-only transaction."""
        raise NotImplementedError

    def end_read(self, conn: sa.Connection) -> None:
        """Undo session state a read left behind (before the connection returns to the pool)."""

    def read_many(self, conn: sa.Connection,
                  statements: Sequence[tuple[str, Mapping[str, Any]]],
                  limit: int) -> list[list[Sequence[Any]]]:
        """Run read statements in the open transaction; each one's first ``limit`` rows.

        Resume re-runs the verify checks of a thousand settled intents at once: one
        round trip each is most of that time where the driver could send them all
        together.  Here one by one; an engine whose driver pipelines overrides it.
        """
        return [list(conn.execute(sa.text(sql), dict(binds)).fetchmany(limit))
                for sql, binds in statements]

    def reset_session(self, conn: sa.Connection) -> None:
        """Undo session-level settings after a write (before the pool reuses the connection)."""

    def before_commit(self, conn: sa.Connection) -> None:
        """The last look before COMMIT: raise ``TransactionSplit`` if the transaction is not
        the one opened (something in the statements committed).  Default: nothing to check.
        """

    # --- errors --------------------------------------------------------------

    def is_timeout(self, exc: BaseException) -> bool:
        return False

    def is_read_only_violation(self, exc: BaseException) -> bool:
        return False

    def is_undefined_table(self, exc: BaseException) -> bool:
        """The statement named a table that does not exist (or, on Oracle, is not visible)."""
        return False

    def is_unique_violation(self, exc: BaseException) -> bool:
        """A unique key refused the row (for the landing marker: the key already landed)."""
        return False

    def is_insufficient_privilege(self, exc: BaseException) -> bool:
        """The account lacks a privilege the statement needs."""
        return False

    def is_session_limit(self, exc: BaseException) -> bool:
        """The database refused a new session because its per-user limit is reached."""
        return False

    def budget_user_scope(self, url: URL, connect_args: Mapping[str, Any]) -> str | None:
        """Where the database counts a user's sessions: the ``db_user`` budget's key.

        Default ``USER@HOST:PORT`` (a server's own per-user limit); None when the
        URL names no user.
        """
        user = url.username or connect_args.get("user")
        if not user:
            return None
        return f"{user}@{url.host or 'localhost'}:{url.port or ''}"

    # --- the fence row (executor/claims.py) ---------------------------------

    fence_upsert: ClassVar[str] = FENCE_UPSERT
    """The statement that moves one key's fence row to ``:t`` unless a newer token holds it."""

    def move_fence(self, conn: sa.Connection, binds: Mapping[str, Any],
                   tag: SessionTag | None) -> tuple[bool, Any]:
        """Move the fence row of ``binds["h"]`` to token ``binds["t"]`` in the write's
        transaction: (moved, the row ``(token, intent_id)`` that kept it when not).

        Default: the upsert returns the token when it moved the row (``RETURNING``);
        only a refused move costs a second statement, to say who holds the key.
        """
        moved = self.execute(conn, self.fence_upsert, binds, tag).fetchone() is not None
        found = None if moved else self.execute(
            conn, FENCE_READ, {"h": binds["h"]}, tag).fetchone()
        return moved, found

    # --- ending a leased transaction (executor/lease.py) --------------------

    def session_id(self, raw: Any) -> int | None:
        """The server's id of the session on driver connection ``raw``, by which a side
        connection can end it; None where there is none to use (no server, or none that
        capgate may end)."""
        return None

    def cancel_statement(self, raw: Any, session: int | None,
                         side: Callable[[], AbstractContextManager[sa.Connection]]) -> None:
        """Cancel the statement running on ``raw`` now, from another thread (the lease's
        watchdog at the deadline).  ``session`` is :meth:`session_id`'s answer; ``side``
        opens a connection of its own where the cancel must come from one.  Default:
        nothing (the server's timeouts still hold)."""

    def terminate_lease_session(self, side: sa.Connection, session: int,
                                tag: SessionTag) -> bool:
        """End session ``session`` (its transaction and its locks with it) from ``side``,
        while it is still the call labelled ``tag`` where the engine can tell; True if it
        was ended, False when it was already gone."""
        return False

    # --- recovery evidence (executor/recovery/evidence.py) ------------------

    def attempt_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """What the target says about each attempt's transaction, by intent id.

        Asked for attempts whose landing marker is not present: whether the
        transaction committed (a commit-outcome probe), whether it is over (the
        recorded session is gone, or holds nothing), on the same server it was
        recorded on.  With ``terminate`` a session that may still commit is ended
        -- exactly that session -- and asked again for up to ``wait_seconds``;
        ``probe_writes`` allows a rolled-back insert of the marker's key where
        nothing else can tell.  Default: nothing can be told (``unknown``).
        """
        return {a.intent_id: AttemptEvidence() for a in attempts}

    def opening_evidence(self, engine: sa.Engine, attempts: Sequence[Attempt], *,
                         terminate: bool, wait_seconds: float,
                         probe_writes: bool = True) -> dict[str, AttemptEvidence]:
        """Whether an attempt that may have sent its opening batch -- its transaction's
        identity never recorded (a leased call cut inside its opening, a retry cut
        before ``attempt_started``) -- has a session still alive, by intent id.

        ``finished`` True: no session of the intent is alive (any that was has been
        ended, with ``terminate``, and waited for up to ``wait_seconds``); None: it
        cannot be told, and the answer stays ``unknown`` -- never "nothing was sent".
        Default: what :meth:`attempt_evidence` says without an identity (SQLite's write
        lock tells; elsewhere nothing does).
        """
        return self.attempt_evidence(engine, attempts, terminate=terminate,
                                     wait_seconds=wait_seconds, probe_writes=probe_writes)

    # --- capgate doctor ------------------------------------------------------

    def describe_server(self, conn: sa.Connection) -> str:
        """One line saying which server, database and account ``conn`` reached."""
        return self.name

    def diagnose(self, conn: sa.Connection, diagnosis: Diagnosis) -> None:
        """Read-only checks of what the connector's rows need here: privileges, session
        limits, what resume relies on, extensions.  Default: none."""

    def excess_privileges(self, conn: sa.Connection) -> list[str] | None:
        """What the account holds beyond what capgate's rows could need, each with what it
        allows (``SUPERUSER: bypasses every privilege check``) -- read-only catalog
        queries; empty when nothing.  The doctor reports them (least privilege).
        Default None: this engine has no accounts to ask about (SQLite)."""
        return None

    def prepare_ddl_checks(self, conn: sa.Connection) -> str | None:
        """In a database ``capgate init`` just set up (a privileged account): create what
        the DDL loop's checks need where the server has it (an extension).  None: ready;
        else the one thing a person must do first (its package is not installed).
        Default: nothing is needed."""
        return None


def opening_by_marker_key(key_state: Callable[[sa.Connection, str], str], engine: sa.Engine,
                          attempts: Sequence[Attempt], *, wait_seconds: float,
                          probe_writes: bool = True) -> dict[str, AttemptEvidence]:
    """:meth:`Dialect.opening_evidence` for an engine that can ask an open transaction's
    hold on a key without privileges (``key_state``: a rolled-back insert of the same
    key waits for it; ``held``, ``taken`` or ``free``).  The opening inserted the
    landing marker, so while its transaction is open it holds the key: asked again
    until ``wait_seconds`` pass.  Without a key, or in a dry run (no probe insert), it
    cannot be told."""
    answers = {a.intent_id: AttemptEvidence(identity="unrecorded") for a in attempts}
    asked = [a for a in attempts if a.idem_key and probe_writes]
    if not asked:
        return answers
    deadline = time.monotonic() + max(0.0, wait_seconds)
    with engine.connect() as probe:
        for a in asked:
            assert a.idem_key is not None
            answer = answers[a.intent_id]
            while True:
                state = key_state(probe, a.idem_key)
                if state != "held" or time.monotonic() >= deadline:
                    break
            answer.notes["marker_key"] = {"probe": "insert of the same key, rolled back",
                                          "answer": state}
            answer.finished = state != "held"
            answer.notes["opening"] = ("no open transaction holds its marker's key"
                                       if answer.finished else
                                       "an open transaction still holds its marker's key")
            if not answer.finished:
                answer.notes["session_alive"] = True
    return answers


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE / vendor code of a DBAPI error wrapped by SQLAlchemy, if any."""
    orig = getattr(exc, "orig", exc)
    for attr in ("sqlstate", "pgcode"):
        value = getattr(orig, attr, None)
        if value:
            return str(value)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return str(args[0])
    return None


def vendor_code(exc: BaseException) -> int | None:
    """The vendor's numeric error code (MariaDB ``1205``), if the driver gives one."""
    orig = getattr(exc, "orig", exc)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None
