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

Steps 2 and 3 are each engine's own (``Dialect.attempt_evidence`` in
``executor/dialects``); this module reads the markers before and after them,
runs the probes, and draws the conclusion.

Nothing here writes to the target except the termination of exactly the
recorded session.  :func:`classify` turns the facts into a classification;
it is a pure function, so the rules can be read (and tested) in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from capgate.executor.call import Executor
from capgate.executor.connectors import Connector
from capgate.executor.dialects import SessionTag
from capgate.executor.dialects.base import MARKER_TABLE, Attempt, chunks, first_line
from capgate.executor.expectations import evaluate
from capgate.executor.outcome import jsonable
from capgate.executor.plan import binds_for
from capgate.registry.errors import CapgateError
from capgate.registry.model import Row
from capgate.registry.vocabulary import Classification


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
    def opening(self) -> int | None:
        """The attempt that may have sent its opening batch -- the landing marker's
        insert among it -- without its transaction's identity being recorded; None
        when every attempt that can have sent anything is recorded.

        ``prepared`` without an attempt: a leased call (or a compensation) records its
        attempt only once its transaction is open; ``retrying``: the next attempt is
        named before it opens.  Cut (or killed) in between, the ledger says less than
        the target may hold: resume asks the target (``Dialect.opening_evidence``)
        before it concludes anything.
        """
        if self.status == "retrying":
            retry = int(self.state.get("retry_attempt") or 0)
            return retry if retry > self.attempt else None
        if self.status == "prepared" and not self.tx:
            return max(1, self.attempt)
        return None

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
    opening: str = "unchecked"
    """For an attempt whose opening may have run unrecorded (``Pending.opening``):
    ``none`` (no session of it is alive: ended, or gone), ``alive`` (one may still be,
    or it cannot be told), ``unchecked``."""
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
    opening = pending.opening
    if facts.unreachable is not None and (pending.attempted or opening is not None):
        return u, f"the target is unreachable: {facts.unreachable}"
    if opening is not None and facts.opening != "none" and facts.marker != "present":
        return u, (f"attempt {opening} may have sent its opening batch (its transaction's "
                   "identity was never recorded) and a session of it may still be alive")
    if not pending.attempted:
        if facts.marker == "present":
            return u, "a marker exists for an intent that never recorded an attempt"
        if opening is not None:
            return n, (f"attempt {opening} may have sent its opening batch, but no session "
                       "of it is alive and its marker is absent: nothing of it can land")
        return n, "no attempt_started recorded: nothing was sent to the target"
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
            reason = first_line(exc)
            for p in items:
                if facts[p.intent_id].marker != "present":
                    facts[p.intent_id].unreachable = reason
    return facts


def _gather_connector(connector: Connector, items: list[Pending], facts: dict[str, Facts], *,
                      terminate: bool, wait_seconds: float, row_of: RowLookup,
                      probe_writes: bool = True) -> None:
    _set_markers(connector, items, facts)
    openings = [p for p in items if p.opening is not None
                and facts[p.intent_id].marker != "present"]
    if openings:  # first: a live session of an unrecorded opening is ended or waited for
        answers = connector.dialect.opening_evidence(
            connector.engine, [Attempt(p.intent_id, {}, p.idem_key, None, _tag(p))
                               for p in openings],
            terminate=terminate, wait_seconds=wait_seconds, probe_writes=probe_writes)
        for p in openings:
            f, answer = facts[p.intent_id], answers[p.intent_id]
            f.opening = "none" if answer.finished else "alive"
            f.note("opening", {"attempt": p.opening, **answer.notes})
    open_items = [p for p in items if p.attempted and facts[p.intent_id].marker != "present"]
    if open_items:
        answers = connector.dialect.attempt_evidence(
            connector.engine, [Attempt(p.intent_id, p.tx, p.idem_key, _error_of(p))
                               for p in open_items],
            terminate=terminate, wait_seconds=wait_seconds, probe_writes=probe_writes)
        for p in open_items:
            f, answer = facts[p.intent_id], answers[p.intent_id]
            f.outcome, f.finished, f.identity = answer.outcome, answer.finished, answer.identity
            for key, value in answer.notes.items():
                f.note(key, value)
    if open_items or openings:
        # Re-read: a transaction may have committed between the first look and
        # the moment its session was found finished.
        _set_markers(connector, [*open_items, *(p for p in openings if p not in open_items)],
                     facts)
    _probes(connector, [p for p in items if p.attempted], facts, row_of)


def _tag(p: Pending) -> SessionTag:
    """The label the intent's sessions carried (``CallContext.tag``)."""
    return SessionTag(p.case_id, str(p.state.get("operation_id") or ""), p.intent_id)


def _error_of(p: Pending) -> str | None:
    error = p.state.get("error")
    return str(error) if error else None


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
    for chunk in chunks(sorted(set(intent_ids))):
        for row in conn.execute(_BY_INTENT, {"ids": chunk}).mappings():
            by_intent[str(row["intent_id"])] = dict(row)
    for chunk in chunks(sorted(set(keys))):
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
                    f.note("landed_probe", {"error": first_line(exc)})
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
