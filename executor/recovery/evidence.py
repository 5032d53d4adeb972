"""Evidence for ``resume``: what the target database can still say about an attempt.

Strongest evidence first, asked in batches per connector on resume's own
connections:

1. the landing marker (``capgate_landed``), written in the same transaction
   as the data: present with the same fingerprint proves ``applied``;
2. the commit-outcome primitive, only against the same server it was
   recorded on (PostgreSQL ``pg_xact_status`` on the recorded xid8, checked
   against the recorded system identifier and timeline; Oracle Transaction
   Guard's ``GET_LTXID_OUTCOME``);
3. whether the recorded session can still commit (PostgreSQL
   ``pg_stat_activity`` pid + backend start; MariaDB ``PROCESSLIST`` /
   ``INNODB_TRX`` on the same server incarnation; SQLite: whether resume can
   take the database's write lock).  While it can, the answer is never
   ``not_applied``: resume terminates exactly that session (or waits for it)
   and asks again;
4. the row's ``landed_probe``.

Nothing here writes to the target except the termination of exactly the
recorded session.  :func:`classify` turns the facts into a classification;
it is a pure function, so the rules can be read (and tested) in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import sqlalchemy as sa

from executor.call import Executor
from executor.connectors import Connector
from executor.dialects import SessionTag
from executor.dialects.base import MARKER_TABLE, vendor_code
from executor.expectations import evaluate
from executor.outcome import jsonable
from executor.plan import binds_for
from registry.errors import CapgateError
from registry.model import Row

_CHUNK = 500
"""Most ids in one ``IN (...)`` list (Oracle allows 1,000)."""
_POLL = 0.02
"""Seconds between two looks at a session that is ending."""
_INNODB_TRX_REFRESH = 0.15
"""MariaDB refreshes its ``INNODB_TRX`` cache only when nobody read it for 100 ms."""


class Classification(StrEnum):
    """What resume concluded about one in-flight intent."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    PARTLY_APPLIED = "partly_applied"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Pending:
    """One in-flight intent as the ledger recorded it."""

    case_id: str
    intent_id: str
    state: Mapping[str, Any]
    order: int
    """The seq of the intent's first event: its place in the case."""

    @property
    def status(self) -> str:
        return str(self.state.get("status"))

    @property
    def attempt(self) -> int:
        return int(self.state.get("attempt") or 0)

    @property
    def tx(self) -> dict[str, Any]:
        tx = self.state.get("tx")
        return dict(tx) if isinstance(tx, Mapping) else {}

    @property
    def attempted(self) -> bool:
        """Whether an ``attempt_started`` was recorded (statements may have been sent)."""
        return self.attempt > 0 or bool(self.tx)

    @property
    def connector(self) -> str | None:
        value = self.state.get("connector")
        return str(value) if value else None

    @property
    def idem_key(self) -> str | None:
        value = self.state.get("idempotency_key")
        return str(value) if value else None

    @property
    def fingerprint(self) -> str | None:
        value = self.state.get("fingerprint")
        return str(value) if value else None


@dataclass
class Facts:
    """Everything the target said about one intent, before any conclusion."""

    marker: str = "unchecked"
    """``present`` (same intent, same fingerprint), ``mismatch`` (same intent id, other
    fingerprint or case), ``other_intent`` (the idempotency key landed for another
    intent), ``absent``, ``not_written`` (no idempotency key: no marker is written)."""
    marker_row: dict[str, Any] | None = None
    outcome: str | None = None
    """``committed``, ``aborted``, ``in_progress``, ``committed_incomplete`` or None."""
    finished: bool | None = None
    """True when the attempt's transaction can no longer commit; None when unknowable."""
    identity: str = "unchecked"
    """``same`` / ``changed`` server (incarnation, timeline), ``unrecorded``, ``unchecked``."""
    probe: str | None = None
    """``present``, ``absent``, ``partial``, ``error``; None when the row has no probe."""
    unreachable: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def note(self, key: str, value: Any) -> None:
        self.details[key] = jsonable(value)


def classify(pending: Pending, facts: Facts) -> tuple[Classification, str]:
    """The classification and the rule that gave it; ambiguity is always ``unknown``."""
    a, n, p, u = (Classification.APPLIED, Classification.NOT_APPLIED,
                  Classification.PARTLY_APPLIED, Classification.UNKNOWN)
    if facts.marker == "mismatch":
        return u, "a marker for this intent landed with a different request fingerprint"
    if facts.marker == "other_intent":
        return u, "the idempotency key landed for another intent"
    if not pending.attempted:
        if facts.marker == "present":
            return u, "a marker exists for an intent that never recorded an attempt"
        return n, "no attempt_started recorded: nothing was sent to the target"
    if facts.unreachable is not None:
        return u, f"the target is unreachable: {facts.unreachable}"
    if facts.marker == "present":
        if facts.probe in ("absent", "partial"):
            return u, "the marker says the effect landed but the landed probe no longer finds it"
        return a, "landing marker present (same transaction as the data, same fingerprint)"
    if facts.outcome == "committed_incomplete":
        return p, "committed, but the user call did not complete (Transaction Guard)"
    if facts.identity == "changed":
        return u, "the server identity changed since the attempt (failover or restore)"
    if facts.outcome == "committed":
        if facts.marker == "absent":
            return u, "the transaction committed but its landing marker is missing"
        if facts.probe in ("absent", "partial"):
            return u, "the transaction committed but the landed probe does not find the effect"
        return a, "the commit-outcome probe says committed"
    if facts.probe == "partial":
        return p, "the landed probe finds part of the effect"
    if facts.finished is not True:
        if facts.outcome == "in_progress" or facts.details.get("session_alive"):
            return u, "the recorded session may still commit (still in progress)"
        return u, "cannot establish that the attempt's transaction finished"
    if facts.marker == "absent":
        if facts.probe == "present":
            return u, "the marker is absent, yet the landed probe finds the effect"
        if facts.outcome == "aborted":
            return n, "marker absent and the commit-outcome probe says aborted"
        return n, "marker absent and the attempt's transaction is over"
    if facts.outcome == "aborted":
        if facts.probe == "present":
            return u, "the transaction aborted, yet the landed probe finds the effect"
        return n, "the commit-outcome probe says aborted"
    if facts.probe == "present":
        return a, "no marker is written for this row; the landed probe finds the effect"
    if facts.probe == "absent":
        return n, "the transaction is over and the landed probe finds no effect"
    return u, "no marker, no commit outcome and no landed probe for this row"


# --- gathering ------------------------------------------------------------------


RowLookup = Callable[[Pending], Row | None]


def gather(executor: Executor, pending: Sequence[Pending], *, terminate: bool,
           wait_seconds: float, row_of: RowLookup, probe_writes: bool = True
           ) -> dict[str, Facts]:
    """Facts for every pending intent, asked per connector in batches."""
    facts = {p.intent_id: Facts() for p in pending}
    groups: dict[str, list[Pending]] = {}
    for p in pending:
        if p.connector is None:
            facts[p.intent_id].unreachable = "no connector recorded"
            continue
        groups.setdefault(p.connector, []).append(p)
    for name, items in groups.items():
        try:
            connector = executor.connectors.get(name)
            connector.check_target()
            _gather_connector(connector, items, facts, terminate=terminate,
                              wait_seconds=wait_seconds, row_of=row_of,
                              probe_writes=probe_writes)
        except (CapgateError, sa.exc.SQLAlchemyError) as exc:
            reason = _first_line(exc)
            for p in items:
                if facts[p.intent_id].marker != "present":
                    facts[p.intent_id].unreachable = reason
    return facts


def _gather_connector(connector: Connector, items: list[Pending], facts: dict[str, Facts], *,
                      terminate: bool, wait_seconds: float, row_of: RowLookup,
                      probe_writes: bool = True) -> None:
    dialect = connector.dialect.name
    if dialect == "sqlite":
        _sqlite(connector, items, facts, wait_seconds)
    else:
        _set_markers(connector, items, facts)
        open_items = [p for p in items if p.attempted and facts[p.intent_id].marker != "present"]
        if open_items:
            if dialect == "postgresql":
                _postgresql(connector, open_items, facts, terminate, wait_seconds)
            elif dialect == "mariadb":
                _mariadb(connector, open_items, facts, terminate, wait_seconds, probe_writes)
            elif dialect == "oracle":
                _oracle(connector, open_items, facts, terminate, wait_seconds, probe_writes)
            # Re-read: a transaction may have committed between the first look and
            # the moment its session was found finished.
            _set_markers(connector, open_items, facts)
    _probes(connector, [p for p in items if p.attempted], facts, row_of)


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _chunks(values: Sequence[str]) -> Iterable[list[str]]:
    for i in range(0, len(values), _CHUNK):
        yield list(values[i:i + _CHUNK])


_MARKER_COLUMNS = "intent_id, idem_key, fingerprint, attempt, case_id, operation_id, landed_at"
_BY_INTENT = sa.text(
    f"SELECT {_MARKER_COLUMNS} FROM {MARKER_TABLE} WHERE intent_id IN :ids"
).bindparams(sa.bindparam("ids", expanding=True))
_BY_KEY = sa.text(
    f"SELECT {_MARKER_COLUMNS} FROM {MARKER_TABLE} WHERE idem_key IN :keys"
).bindparams(sa.bindparam("keys", expanding=True))


def read_markers(conn: sa.Connection, intent_ids: Sequence[str], keys: Sequence[str]
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Marker rows by intent id and by idempotency key: one query per 500 ids."""
    by_intent: dict[str, dict[str, Any]] = {}
    by_key: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(sorted(set(intent_ids))):
        for row in conn.execute(_BY_INTENT, {"ids": chunk}).mappings():
            by_intent[str(row["intent_id"])] = dict(row)
    for chunk in _chunks(sorted(set(keys))):
        for row in conn.execute(_BY_KEY, {"keys": chunk}).mappings():
            by_key[str(row["idem_key"])] = dict(row)
    return by_intent, by_key


def _apply_markers(items: Iterable[Pending], facts: dict[str, Facts],
                   by_intent: Mapping[str, dict[str, Any]],
                   by_key: Mapping[str, dict[str, Any]]) -> None:
    for p in items:
        f = facts[p.intent_id]
        row = by_intent.get(p.intent_id)
        if row is not None:
            same = row["fingerprint"] == p.fingerprint and row["case_id"] == p.case_id
            f.marker = "present" if same else "mismatch"
            f.marker_row = {k: jsonable(v) for k, v in row.items()}
        elif p.idem_key is not None and p.idem_key in by_key:
            f.marker = "other_intent"
            f.marker_row = {k: jsonable(v) for k, v in by_key[p.idem_key].items()}
        else:
            f.marker = "absent" if p.idem_key is not None else "not_written"
            f.marker_row = None


def _set_markers(connector: Connector, items: Sequence[Pending], facts: dict[str, Facts]) -> None:
    with connector.engine.connect() as conn:
        try:
            by_intent, by_key = read_markers(
                conn, [p.intent_id for p in items], [p.idem_key for p in items if p.idem_key])
        finally:
            conn.rollback()
    _apply_markers(items, facts, by_intent, by_key)


# --- per dialect ----------------------------------------------------------------


def _autocommit(connector: Connector) -> sa.Connection:
    """A connection whose every statement is its own transaction (fresh catalog views)."""
    return connector.engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def _deadline(wait_seconds: float) -> float:
    return time.monotonic() + max(0.0, wait_seconds)


def _postgresql(connector: Connector, items: list[Pending], facts: dict[str, Facts],
                terminate: bool, wait_seconds: float) -> None:
    """``pg_xact_status`` on the recorded xid8, on the same cluster and timeline only."""
    dialect = connector.dialect
    with _autocommit(connector) as conn:
        server = dialect.server_identity(conn)
        asked: dict[str, Pending] = {}
        for p in items:
            f = facts[p.intent_id]
            tx = p.tx
            f.note("server_now", server)
            if not tx.get("xid") or not tx.get("system_identifier"):
                f.identity = "unrecorded"
                f.note("commit_outcome", "no transaction id recorded")
                continue
            same = (str(tx.get("system_identifier")) == str(server["system_identifier"])
                    and str(tx.get("timeline")) == str(server["timeline"]))
            f.identity = "same" if same else "changed"
            if same:
                asked[p.intent_id] = p
        status = _xact_status(conn, dialect, asked.values())
        deadline = _deadline(wait_seconds)
        terminated: set[str] = set()
        while True:
            busy = [p for i, p in asked.items() if status.get(i) == "in_progress"]
            if not busy:
                break
            for p in busy:
                alive = bool(dialect.session_alive(conn, p.tx))
                f = facts[p.intent_id]
                f.note("session_alive", alive)
                if alive and terminate and p.intent_id not in terminated:
                    f.note("terminated_session", {"pid": p.tx.get("pid"),
                                                  "backend_start": p.tx.get("backend_start"),
                                                  "done": dialect.terminate_session(conn, p.tx)})
                    terminated.add(p.intent_id)
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
            status.update(_xact_status(conn, dialect, busy))
        for intent_id, p in asked.items():
            f = facts[intent_id]
            f.outcome = status.get(intent_id)
            f.note("commit_outcome", {"probe": "pg_xact_status", "xid": p.tx.get("xid"),
                                      "answer": f.outcome})
            if f.outcome in ("committed", "aborted"):
                f.finished = True
            elif f.outcome == "in_progress":
                f.finished = False


def _xact_status(conn: sa.Connection, dialect: Any, items: Iterable[Pending]) -> dict[str, str]:
    """One batched ``pg_xact_status`` over many xids; per xid when the batch fails.

    A NULL answer (xid older than the commit log keeps) and an error (an xid in
    the future) both leave the intent without an outcome: unknown.
    """
    by_xid: dict[str, list[str]] = {}
    for p in items:
        by_xid.setdefault(str(p.tx["xid"]), []).append(p.intent_id)
    out: dict[str, str] = {}
    if not by_xid:
        return out
    names = {"committed": "committed", "aborted": "aborted", "in progress": "in_progress"}
    try:
        rows = conn.execute(sa.text(
            "SELECT u.x, pg_xact_status(CAST(u.x AS xid8))"
            " FROM unnest(CAST(:xids AS text[])) AS u(x)"), {"xids": list(by_xid)}).all()
        answers = {str(x): (names.get(str(s)) if s is not None else None) for x, s in rows}
    except sa.exc.DBAPIError:
        answers = {}
        for xid in by_xid:
            try:
                answers[xid] = dialect.commit_outcome(conn, {"xid": xid})
            except sa.exc.DBAPIError:
                answers[xid] = None
    for xid, ids in by_xid.items():
        answer = answers.get(xid)
        if answer is not None:
            for intent_id in ids:
                out[intent_id] = answer
    return out


def _mariadb(connector: Connector, items: list[Pending], facts: dict[str, Facts],
             terminate: bool, wait_seconds: float, probe_writes: bool = True) -> None:
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
    dialect = connector.dialect
    with _autocommit(connector) as conn:
        server = dialect.server_identity(conn)
        watched: dict[str, Pending] = {}
        for p in items:
            f = facts[p.intent_id]
            tx = p.tx
            f.note("server_now", server)
            if tx.get("connection_id") is None or tx.get("server_started") is None:
                f.identity = "unrecorded"
                continue
            same = (tx.get("server_id") == server["server_id"]
                    and tx.get("hostname") == server["hostname"]
                    and abs(int(tx["server_started"]) - int(server["server_started"])) <= 2)
            f.identity = "same" if same else "changed"
            if same:
                watched[p.intent_id] = p
        deadline = _deadline(wait_seconds)
        killed_at: dict[str, float] = {}
        idle_since: dict[str, float] = {}
        own = int(conn.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one())
        busy: list[str] = []
        while True:
            alive, open_tx = _mariadb_sessions(conn, watched.values())
            if open_tx is None:  # no PROCESS privilege: ask the marker's unique key instead
                # (a rolled-back insert; a dry run sends none and cannot tell: open)
                open_tx = _held_marker_keys(connector, watched, facts) if probe_writes \
                    else {int(p.tx["connection_id"]) for p in watched.values()}
            now = time.monotonic()
            busy = []
            for intent_id, p in watched.items():
                cid = int(p.tx["connection_id"])
                facts[intent_id].note("session", {"connection_id": cid, "alive": cid in alive,
                                                  "open_transaction": cid in open_tx})
                if cid in open_tx and terminate and intent_id not in killed_at and cid != own:
                    try:
                        conn.exec_driver_sql("KILL CONNECTION %s", (cid,))
                        facts[intent_id].note("terminated_session", {"connection_id": cid})
                    except sa.exc.DBAPIError as exc:  # ended meanwhile (1094 unknown thread)
                        facts[intent_id].note("terminate_error", _first_line(exc))
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
            f = facts[intent_id]
            f.finished = intent_id not in busy
            if not f.finished:
                f.note("session_alive", True)


def _mariadb_sessions(conn: sa.Connection, items: Iterable[Pending]
                      ) -> tuple[set[int], set[int] | None]:
    """Connections alive (``PROCESSLIST``: one's own are visible without privileges) and
    those with an open InnoDB transaction (``INNODB_TRX``; None without PROCESS)."""
    ids = sorted({int(p.tx["connection_id"]) for p in items})
    alive: set[int] = set()
    open_tx: set[int] | None = set()
    for chunk in _chunks([str(i) for i in ids]):
        numbers = [int(i) for i in chunk]
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


def _held_marker_keys(connector: Connector, watched: Mapping[str, Pending],
                      facts: dict[str, Facts]) -> set[int]:
    """Connections whose transaction still holds their intent's marker key.

    Every recorded attempt inserted its marker when its transaction opened,
    so an open transaction holds the key's index lock: a probe insert of the
    same key waits for it (see ``MariadbDialect.marker_key_state``).  An
    intent without a key cannot be asked this way and counts as open.
    """
    held: set[int] = set()
    dialect: Any = connector.dialect
    with connector.engine.connect() as probe:
        for intent_id, p in watched.items():
            cid = int(p.tx["connection_id"])
            state = dialect.marker_key_state(probe, p.idem_key) if p.idem_key else "unknown"
            facts[intent_id].note("marker_key", {"probe": "insert of the same key, rolled back",
                                                 "answer": state})
            if state in ("held", "unknown"):
                held.add(cid)
    return held


def _oracle(connector: Connector, items: list[Pending], facts: dict[str, Facts],
            terminate: bool, wait_seconds: float, probe_writes: bool = True) -> None:
    """Oracle: Transaction Guard first, then privilege-free proofs that the transaction
    is over (issue 18; the rules live in ``executor/dialects/oracle.py``)."""
    dialect: Any = connector.dialect
    answers = dialect.attempt_evidence(connector.engine, [
        {"intent_id": p.intent_id, "tx": p.tx, "idem_key": p.idem_key,
         "error": p.state.get("error")} for p in items],
        terminate=terminate, wait_seconds=wait_seconds, probe_writes=probe_writes)
    for p in items:
        f, answer = facts[p.intent_id], answers[p.intent_id]
        f.outcome, f.finished, f.identity = (answer["outcome"], answer["finished"],
                                             answer["identity"])
        for key, value in answer["notes"].items():
            f.note(key, value)
        if f.finished is not True and (answer["notes"].get("session") or {}).get("alive"):
            f.note("session_alive", True)


def _sqlite(connector: Connector, items: list[Pending], facts: dict[str, Facts],
            wait_seconds: float) -> None:
    """SQLite: no sessions to ask.  Holding the write lock proves no write is open.

    ``BEGIN IMMEDIATE`` succeeds only when no other connection has a write
    transaction open; the marker read inside that lock is therefore final.
    A writer that is alive (e.g. a stopped process) keeps the lock: unknown.
    """
    dialect = connector.dialect
    tag = SessionTag("resume", "capgate.resume", "evidence")
    with connector.engine.connect() as conn:
        locked = False
        try:
            dialect.begin_write(conn, tag, max(wait_seconds, 0.05), max(wait_seconds, 0.05))
            locked = True
        except sa.exc.OperationalError as exc:
            conn.rollback()
            for p in items:
                facts[p.intent_id].note("write_lock", f"not acquired: {_first_line(exc)}")
                facts[p.intent_id].note("session_alive", True)
        try:
            by_intent, by_key = read_markers(
                conn, [p.intent_id for p in items], [p.idem_key for p in items if p.idem_key])
        finally:
            conn.rollback()
            conn.exec_driver_sql("PRAGMA busy_timeout=5000")
    _apply_markers(items, facts, by_intent, by_key)
    for p in items:
        f = facts[p.intent_id]
        f.identity = "same"
        if locked:
            f.finished = True
            f.note("write_lock", "acquired: no write transaction is open on the target")


def _probes(connector: Connector, items: Sequence[Pending], facts: dict[str, Facts],
            row_of: RowLookup) -> None:
    """Run each row's ``landed_probe`` in one read-only transaction."""
    probed = [(p, row) for p in items if (row := row_of(p)) is not None
              and row.landed_probe is not None and facts[p.intent_id].unreachable is None]
    if not probed:
        return
    dialect = connector.dialect
    tag = SessionTag(probed[0][0].case_id, "capgate.resume", "landed_probe")
    with connector.engine.connect() as conn:
        try:
            dialect.begin_read(conn, tag, 10.0)
            for p, row in probed:
                probe = row.landed_probe
                assert probe is not None
                inputs = dict(p.state.get("inputs") or {})
                f = facts[p.intent_id]
                try:
                    rows = conn.execute(sa.text(dialect.sql(probe.sql, tag)),
                                        binds_for(probe.sql, inputs)).fetchmany(1001)
                except sa.exc.DBAPIError as exc:
                    f.probe = "error"
                    f.note("landed_probe", {"error": _first_line(exc)})
                    conn.rollback()
                    dialect.begin_read(conn, tag, 10.0)
                    continue
                result = evaluate("landed_probe", probe.expect, rows)
                f.probe = "present" if result.ok else ("absent" if _empty(rows) else "partial")
                f.note("landed_probe", {"answer": f.probe, **result.to_dict()})
        finally:
            conn.rollback()
            dialect.end_read(conn)


def _empty(rows: Sequence[Sequence[Any]]) -> bool:
    """No rows, or a first value of zero / NULL: the probe found nothing."""
    if not rows:
        return True
    first = rows[0][0] if len(rows[0]) else None
    if first is None:
        return True
    try:
        return float(first) == 0.0
    except (TypeError, ValueError):
        return False
