"""The write transaction: open it labelled and armed, run the row's SQL, fence, COMMIT.

One way through, for every shape that writes (collapsed, leased, a
compensation, resume's retry): :func:`run_transaction` opens the session
(through the hooks: a budget slot), begins with the landing marker in the
same round trip where the dialect can, records ``attempt_started`` with the
transaction's identity, runs a ``body`` -- :func:`run_statements` and
:func:`verify_and_replay` for a collapsed row, the declared steps for a
leased one, the compensation statements -- asks the hooks' ``before_commit``
(the impact-claim fence), and commits.  Any count, check or database error
on the way rolls back with its reason; a lost connection around COMMIT is
``OutcomeUnknown`` (resume establishes what landed), never a guess.

:func:`run_checks` runs checks after COMMIT in their own read-only
transaction (post-commit checks, the re-read after a compensation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import sqlalchemy as sa

from capgate.executor import boundaries, context
from capgate.executor import outcome as oc
from capgate.executor.context import CallContext, Rollback
from capgate.executor.cutoff import Cut
from capgate.executor.dialects import TxIdentity
from capgate.executor.dialects.base import CLIENT_GRACE_SECONDS, MARKER_TABLE, TARGET_TABLES
from capgate.executor.effects import record_survivors
from capgate.executor.expectations import CheckResult, evaluate
from capgate.executor.ledger import KeyAlreadyClaimed
from capgate.executor.outcome import Outcome, jsonable
from capgate.executor.plan import binds_for
from capgate.executor.returned import run_returning
from capgate.executor.runtime import Runtime
from capgate.registry.errors import (
    AttemptSuperseded,
    ConnectorUnavailable,
    OutcomeUnknown,
    TransactionSplit,
)
from capgate.registry.excerpt import cut
from capgate.registry.model import Check, ExpectRows, Statement
from capgate.registry.vocabulary import RollbackReason

__all__ = ["Body", "checked", "counted", "db_error_reason", "expect_count", "run_checks",
           "run_statements", "run_transaction", "verify_and_replay"]

Body = Callable[[sa.Connection, dict[str, Any]], None]
"""What runs inside the open transaction: ``body(conn, evidence)``; raises Rollback."""

_MARKER_BY_KEY = (f"SELECT intent_id, case_id, fingerprint, attempt, operation_id, landed_at"
                  f" FROM {MARKER_TABLE} WHERE idem_key = :k")


def counted(ctx: CallContext, conn: sa.Connection, sql: str, counts: list[int]) -> int:
    """One write statement; its count is appended to ``counts`` (the evidence) at once."""
    cursor = ctx.connector.dialect.execute(conn, sql, binds_for(sql, ctx.inputs), ctx.tag)
    n = int(cursor.rowcount)
    counts.append(n)
    return n


def expect_count(n: int, expect_rows: ExpectRows | None, sql: str, where: dict[str, Any]) -> None:
    """A count that does not match rolls back, naming ``where``, the SQL, expected and actual.

    Every write loop (collapsed, compensation, lease steps) ends its statement here.
    """
    if expect_rows is not None and not expect_rows.matches(n):
        raise Rollback({"kind": RollbackReason.COUNT, **where, "sql": sql,
                        "expected": expect_rows.to_value(), "actual": n})


def checked(ctx: CallContext, conn: sa.Connection, name: str, sql: str,
            expect: Any) -> CheckResult:
    """One check query in the open transaction, evaluated against its expectation."""
    cursor = ctx.connector.dialect.execute(conn, sql, binds_for(sql, ctx.inputs), ctx.tag)
    return evaluate(name, expect, cursor.fetchmany(1001))


def run_statements(ctx: CallContext, conn: sa.Connection, evidence: dict[str, Any],
                   statements: Sequence[Statement] | None = None,
                   what: str = "statement") -> None:
    """Statements with their expected counts, in the open transaction (the one loop).

    ``statements`` defaults to the row's own; a compensation passes the row's
    compensation.  Counts go to ``evidence["counts"]``; a count that does not
    match rolls back, naming the statement, expected and actual.
    """
    counts: list[int] = []
    evidence["counts"] = counts
    for i, st in enumerate(ctx.row.statements if statements is None else statements):
        n = counted(ctx, conn, st.sql, counts) if st.returns is None \
            else run_returning(ctx, conn, st, counts, evidence)  # issue 16: returned keys
        expect_count(n, st.expect_rows, st.sql, {what: i, "name": st.name})


def verify_and_replay(ctx: CallContext, conn: sa.Connection, evidence: dict[str, Any]) -> None:
    """Same-session checks before COMMIT: what other sessions cannot see yet."""
    results: list[dict[str, Any]] = []
    evidence["verify"] = results
    for check in ctx.row.verify:
        result = checked(ctx, conn, check.name, check.sql, check.expect)
        results.append(result.to_dict())
        if not result.ok:
            raise Rollback({"kind": RollbackReason.VERIFY, "check": check.name, "sql": check.sql,
                            "expected": result.expected, "actual": result.actual})
    replay = ctx.row.replay
    if replay is not None:
        cap = replay.max_rows or 100
        res = ctx.connector.dialect.execute(conn, replay.sql, binds_for(replay.sql, ctx.inputs),
                                            ctx.tag)
        columns = [d[0] for d in res.description or ()]
        rows = res.fetchmany(cap)
        evidence["replay"] = {"columns": columns, "rows": jsonable([list(r) for r in rows])}
        if replay.expect is not None:
            result = evaluate("replay", replay.expect, rows)
            if not result.ok:
                raise Rollback({"kind": RollbackReason.REPLAY, "sql": replay.sql,
                                "expected": result.expected, "actual": result.actual})


def marker_row(rt: Runtime, ctx: CallContext) -> dict[str, Any] | None:
    """The landing marker, written in the same transaction as the data."""
    if ctx.idem_key is None:
        return None
    return {"intent_id": ctx.intent_id, "idem_key": ctx.idem_key,
            "fingerprint": ctx.fingerprint, "attempt": ctx.attempt,
            "case_id": ctx.case_id, "operation_id": ctx.row.operation_id,
            "landed_at": rt.clock().isoformat()}


@contextlib.contextmanager
def open_write(rt: Runtime, ctx: CallContext
               ) -> Iterator[tuple[sa.Connection, TxIdentity, Cut]]:
    """A labelled write transaction, guarded by its deadline; a pooled connection found
    dead is replaced once.

    The guard (:meth:`Dialect.guard`) cuts the connection when the server has not
    answered :data:`CLIENT_GRACE_SECONDS` past the transaction's deadline: a partition
    then ends the wait, instead of the kernel's TCP timers.  An opening that was cut is
    not tried again: its statements may be running in a session the partition keeps.
    """
    dialect = ctx.connector.dialect
    seconds = float(ctx.row.timeout.seconds) + CLIENT_GRACE_SECONDS
    for attempt in (1, 2):
        conn = rt.connect(ctx.connector, ctx)
        with contextlib.ExitStack() as guarded:
            cut = guarded.enter_context(dialect.guard(conn, seconds))
            try:
                identity = dialect.begin_write(conn, ctx.tag, ctx.row.timeout.seconds,
                                               ctx.row.timeout.lock_seconds,
                                               marker_row(rt, ctx))
            except sa.exc.DBAPIError as exc:
                fired = cut.disarm()
                conn.close()
                if not exc.connection_invalidated:
                    raise  # e.g. the marker's key already landed: the caller reports it
                if fired:
                    raise ConnectorUnavailable(
                        f"connector {ctx.connector.name!r} did not answer the opening of "
                        f"the transaction within its {ctx.row.timeout.seconds:g} s deadline "
                        f"+ {CLIENT_GRACE_SECONDS:g} s: the connection was cut (a network "
                        "partition?); COMMIT was never sent, so nothing of it can commit",
                        connector=ctx.connector.name, connection_cut=True) from None
                if attempt == 1:
                    continue  # a pooled session found dead at once: safe to reopen
                raise ConnectorUnavailable(
                    f"connector {ctx.connector.name!r} could not open a transaction: "
                    f"{str(exc.orig).splitlines()[0] if exc.orig else exc}",
                    connector=ctx.connector.name) from None
            try:
                yield conn, identity, cut
            except BaseException:
                # the session may be gone (terminated by resume, the server's lease
                # timeout, cut by the guard): its rollback failing must not hide what
                # went wrong here
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.rollback()
                raise
            finally:
                dialect.end_deadline(conn)
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.close()
        return


def run_transaction(rt: Runtime, ctx: CallContext, body: Body, *,
                    prepare: bool = False) -> Outcome:
    """Open, label, run ``body``, fence, COMMIT; or ROLLBACK with the reason.

    ``prepare`` (a collapsed call's first attempt): the transaction is opened
    -- session labelled, timeouts armed, landing marker inserted, identity
    read, in one round trip -- *before* ``prepared`` commits, so that one
    durable ledger commit records the intent, its claims and its attempt with
    the transaction's identity, and precedes every statement of the row.  A
    refusal of ``prepared`` (a claimed key, an open intent, a budget, an
    approval) rolls the transaction back: nothing of the row was sent.
    Without ``prepare`` the intent was prepared before, and ``attempt_started``
    records the attempt (resume's retry, a compensation, a lease).
    """
    dialect = ctx.connector.dialect
    evidence: dict[str, Any] = {}
    if not prepare:
        rt.hooks.before_write(ctx)
    with contextlib.ExitStack() as stack:
        try:
            conn, identity, guard = stack.enter_context(open_write(rt, ctx))
        except ConnectorUnavailable as exc:
            if prepare:
                raise  # nothing recorded, nothing can commit: a refusal, not an outcome
            if exc.details.get("connection_cut"):
                return ctx.outcome(oc.ROLLED_BACK, evidence, {
                    "kind": RollbackReason.TIMEOUT, "where": "begin", "connection_cut": True,
                    "message": exc.message, "timeout_seconds": ctx.row.timeout.seconds,
                    "on_timeout": str(ctx.row.timeout.on_timeout),
                    "note": "no answer to the opening of the transaction: COMMIT was never "
                            "sent, so nothing of this attempt can land"})
            return ctx.outcome(oc.ROLLED_BACK, evidence, {
                "kind": RollbackReason.CONNECTION_FAILED, "where": "connect",
                "message": exc.message, "statements_sent": 0,
                "note": "the connection failed before any statement was sent: "
                        "nothing of this call can have landed"})
        except sa.exc.DBAPIError as exc:
            if ctx.idem_key is not None and dialect.is_unique_violation(exc):
                if prepare:
                    owner = rt.ledger.get_idempotency(ctx.idem_key)
                    if owner is not None:  # an identical request landed: its outcome is ours
                        raise KeyAlreadyClaimed(owner) from None
                    boundaries.prepared(rt, ctx)  # landed under another ledger: say so
                return _landed_before(rt, ctx, evidence)
            if prepare:  # (a lock wait, a refusal): the intent is recorded with its reason,
                boundaries.prepared(rt, ctx)  # and the row's timeout contract applies
            return ctx.outcome(oc.ROLLED_BACK, evidence, db_error_reason(ctx, exc, "begin"))
        try:
            if prepare:
                boundaries.prepared(rt, ctx, identity)
            elif not ctx.rehearse:
                boundaries.attempt_started(rt, ctx, identity)
            body(conn, evidence)
            if not ctx.rehearse:
                rt.hooks.before_commit(ctx, conn)  # the impact-claim fence
            dialect.before_commit(conn)  # issue 18: still the transaction opened (Oracle)
        except Rollback as rb:
            _rollback(ctx, conn, evidence)
            return ctx.outcome(oc.ROLLED_BACK, evidence, rb.reason)
        except sa.exc.DBAPIError as exc:
            reason = db_error_reason(ctx, exc, "statement", guard)
            _rollback(ctx, conn, evidence)
            return ctx.outcome(oc.ROLLED_BACK, evidence, reason)
        except TransactionSplit as split:  # issue 18: part of the call committed early
            _rollback(ctx, conn)
            _transaction_split(rt, ctx, split, evidence)
        if ctx.rehearse:
            conn.rollback()
            dialect.reset_session(conn)
            return ctx.outcome(oc.APPLIED, evidence, {"kind": RollbackReason.REHEARSAL_ROLLED_BACK})
        context.at_boundary("before_commit")
        try:
            conn.commit()
        except sa.exc.DBAPIError as exc:
            if exc.connection_invalidated:
                _commit_uncertain(rt, ctx, exc, guard)
            return ctx.outcome(oc.ROLLED_BACK, evidence,
                               db_error_reason(ctx, exc, "commit", guard))
        context.at_boundary("after_commit")
        try:
            dialect.reset_session(conn)
        except sa.exc.DBAPIError:
            conn.invalidate()
    return ctx.outcome(oc.APPLIED, evidence)


def _rollback(ctx: CallContext, conn: sa.Connection,
              evidence: dict[str, Any] | None = None) -> None:
    """Roll back before COMMIT was ever sent: nothing landed, whatever the session's state.

    With ``evidence``, what of the row's expected effects survived the rollback is
    recorded there (issue 16; no round trip for a row that declares none).
    """
    try:
        conn.rollback()
        if conn.invalidated:  # the session is gone (terminated, cut): nothing to reset, and
            return            # touching it would open a new one, over a network maybe cut
        ctx.connector.dialect.reset_session(conn)
    except sa.exc.DBAPIError:
        return  # the session is gone (terminated, timed out): the server rolled it back
    if evidence is not None and ctx.row.expected_effects:
        record_survivors(ctx, conn, evidence)


def _commit_uncertain(rt: Runtime, ctx: CallContext, exc: sa.exc.DBAPIError,
                      cut: Cut | None = None) -> NoReturn:
    """The connection was lost around COMMIT: record that, then say the outcome is unknown.

    ``cut`` fired: the COMMIT was sent and no answer came by the deadline + the grace --
    the server may have committed (a partition dropped its reply) or not.
    """
    error = str(exc.orig).splitlines()[0] if exc.orig else ""
    if cut is not None and cut.fired:
        error = (f"no answer to COMMIT {CLIENT_GRACE_SECONDS:g} s past the "
                 f"{ctx.row.timeout.seconds:g} s deadline: the client cut the connection")
    try:
        rt.ledger.append(ctx.case_id, "commit_uncertain", {
            "state": {"error": error, "connection_cut": bool(cut is not None and cut.fired)},
        }, intent_id=ctx.intent_id, attempt=ctx.attempt)
    except AttemptSuperseded as late:
        boundaries.record_stale(rt, ctx, "commit_uncertain", late)
    raise OutcomeUnknown(
        f"the connection was lost around COMMIT of intent {ctx.intent_id} ({error}); the "
        f"server may have committed: run `capgate resume {ctx.case_id}` to establish what "
        "landed", case=ctx.case_id, intent_id=ctx.intent_id,
        connection_cut=bool(cut is not None and cut.fired)) from None


def _transaction_split(rt: Runtime, ctx: CallContext, split: TransactionSplit,
                       evidence: dict[str, Any]) -> NoReturn:
    """Issue 18: something committed inside the call (the dialect's ``before_commit`` saw
    another transaction).  What ran before it -- the landing marker included -- is
    committed, the rest was rolled back: neither ``applied`` nor ``rolled_back`` is true,
    and the marker would tell resume ``applied``.  The intent escalates for a person
    (resume parks executor escalations), then the caller gets the coded error."""
    if not ctx.rehearse:
        try:
            rt.ledger.append(ctx.case_id, "escalated", {"state": {"escalation": {
                "kind": RollbackReason.TRANSACTION_SPLIT, "by": "executor",
                "classification": "partly_applied",
                "rule": "the transaction was split before COMMIT: part of the call committed",
                "transaction": dict(split.details), "counts": evidence.get("counts")}}},
                intent_id=ctx.intent_id, attempt=ctx.attempt,
                within=lambda tx: rt.hooks.within_observed(ctx, tx))
        except AttemptSuperseded as late:
            boundaries.record_stale(rt, ctx, "transaction_split", late)
        rt.hooks.after_observed(ctx)
    raise split


def _landed_before(rt: Runtime, ctx: CallContext, evidence: dict[str, Any]) -> Outcome:
    """The marker's key is taken in the target: evidence that the key already landed.

    The same request landed under another intent (a second ledger on one
    target, a restored ledger): ``already_applied``, with that marker as
    evidence -- never ``rolled_back`` for an effect that is there.  A
    different request under the key: nothing of ours was sent, so
    ``rolled_back`` with the conflicting marker.
    """
    dialect = ctx.connector.dialect
    with rt.connect(ctx.connector, ctx) as conn:
        try:
            found = conn.execute(sa.text(dialect.sql(_MARKER_BY_KEY, ctx.tag)),
                                 {"k": ctx.idem_key}).mappings().first()
        finally:
            conn.rollback()
    marker = {k: jsonable(v) for k, v in found.items()} if found is not None else None
    evidence = {**evidence, "landing_marker": marker}
    if marker is not None and marker["fingerprint"] == ctx.fingerprint:
        return ctx.outcome(oc.ALREADY_APPLIED, evidence, {
            "kind": RollbackReason.ALREADY_LANDED, "by_intent": marker["intent_id"],
            "by_case": marker["case_id"],
            "message": "this request's idempotency key already landed in the target; "
                       "nothing was executed now"})
    return ctx.outcome(oc.ROLLED_BACK, evidence, {
        "kind": RollbackReason.IDEMPOTENCY_CONFLICT, "where": "begin",
        "by_intent": marker["intent_id"] if marker else None,
        "message": "the idempotency key landed in the target for a different request; "
                   "nothing of this call was sent"})


def db_error_reason(ctx: CallContext, exc: sa.exc.DBAPIError, where: str,
                    guard: Cut | None = None) -> dict[str, Any]:
    """A database error as a rollback reason: timeout, read-only, missing table, or other.

    ``guard`` is the transaction's :class:`~executor.cutoff.Cut`: when it fired, the
    error is the client's own cut at the deadline + the grace (the server never
    answered), a timeout, whatever the driver called it.
    """
    dialect = ctx.connector.dialect
    message = cut(str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc), 500)
    if guard is not None and guard.fired:
        return {"kind": RollbackReason.TIMEOUT, "where": where, "connection_cut": True,
                "message": f"no answer from the server {CLIENT_GRACE_SECONDS:g} s past the "
                           f"{ctx.row.timeout.seconds:g} s deadline: the client cut the "
                           f"connection ({message})",
                "timeout_seconds": ctx.row.timeout.seconds,
                "on_timeout": str(ctx.row.timeout.on_timeout),
                "note": "COMMIT was never sent: nothing of this attempt can commit"}
    if dialect.is_timeout(exc):
        return {"kind": RollbackReason.TIMEOUT, "where": where, "message": message,
                "timeout_seconds": ctx.row.timeout.seconds,
                "on_timeout": str(ctx.row.timeout.on_timeout)}
    if dialect.is_read_only_violation(exc):
        return {"kind": RollbackReason.READ_ONLY_VIOLATION, "where": where, "message": message}
    if dialect.is_undefined_table(exc) and any(t in message for t in TARGET_TABLES):
        ctx.connector.forget_target()
        return {"kind": RollbackReason.TARGET_NOT_INSTALLED, "where": where, "message": message,
                "fix": f"capgate target install {ctx.connector.name}"}
    return {"kind": RollbackReason.DATABASE_ERROR, "where": where, "message": message,
            "connection_lost": bool(exc.connection_invalidated)}


def run_checks(rt: Runtime, ctx: CallContext, checks: Sequence[Check]) -> list[CheckResult]:
    """Run checks in their own read-only transaction (after commit)."""
    dialect = ctx.connector.dialect
    out: list[CheckResult] = []
    with rt.connect(ctx.connector, ctx) as conn, \
            dialect.guard(conn, float(ctx.row.timeout.seconds) + CLIENT_GRACE_SECONDS):
        try:
            dialect.begin_read(conn, ctx.tag, ctx.row.timeout.seconds)
            for check in checks:
                rows = conn.execute(sa.text(dialect.sql(check.sql, ctx.tag)),
                                    binds_for(check.sql, ctx.inputs)).fetchmany(1001)
                out.append(evaluate(check.name, check.expect, rows))
        finally:
            conn.rollback()
            dialect.end_read(conn)
    return out
