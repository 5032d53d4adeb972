"""The ledger boundaries of a call: ``prepared``, ``attempt_started``, ``observed``.

Each is durable before the next step runs.  ``prepared`` is one transaction
on the ledger store that also claims the idempotency key, consumes the
approval (gated rows) and runs the hooks' ``within_prepared`` (impact claims):
all of it, or nothing -- an identical call that loses the race for the key
writes nothing at all (``KeyAlreadyClaimed``).

Every event an executing attempt appends for its intent carries its attempt
number, and the ledger refuses it once resume or a person settled the intent
or a newer attempt was recorded (``AttemptSuperseded``): a process that wakes
after others moved on cannot re-open a settled case.  Its late view is kept
as a case-level ``stale_attempt`` event (evidence, not state) by
:func:`record_stale`, and it is told it was superseded.

:func:`attempts` keeps the row's effect-of-timeout contract
(``Row.timeout_action``) after a timeout or a lost connection.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from capgate.executor import context
from capgate.executor import outcome as oc
from capgate.executor.context import CallContext
from capgate.executor.dialects import TxIdentity
from capgate.executor.gates import approval_problem
from capgate.executor.hooks import RetryOutside
from capgate.executor.ledger import KeyClaim
from capgate.executor.outcome import Outcome
from capgate.executor.runtime import Runtime
from capgate.registry.errors import (
    ApprovalRequired,
    AttemptSuperseded,
    CaseConflict,
    LedgerError,
    LedgerUnreachable,
    ReconciliationRequired,
    UnknownPlan,
)

if TYPE_CHECKING:
    from capgate.executor.ledger.backends import HotTx
    from capgate.executor.ledger.store import Guard
from capgate.registry.model import AuthKind
from capgate.registry.vocabulary import RollbackReason

_OUTSIDE_RETRIES = 8

__all__ = ["attempt_started", "attempts", "case_guard", "ledger_unreachable", "observed",
           "prepared", "record_stale", "recording"]


def prepared(rt: Runtime, ctx: CallContext, identity: TxIdentity | None = None) -> None:
    """The intent, durable before anything of the row is sent, with its key, approval and
    claims -- and, with ``identity``, its first attempt and that attempt's transaction.

    The append continues the case only from a state that checks out (O(1), see
    ``Ledger.append_many(continuing=True)``) and only when the case has no open
    intent (ReconciliationRequired) and, with a task, was opened for that task
    (CaseConflict) -- checked inside the transaction, so no other writer can
    slip an intent in between.  Raises KeyAlreadyClaimed (nothing written) when
    an identical call prepared first: its execution is the only one.
    """
    if ctx.resumed:  # a later attempt of an intent prepared before
        return
    row = ctx.row
    claim = None
    if ctx.idem_key is not None and not ctx.rehearse:
        claim = KeyClaim(ctx.idem_key, ctx.intent_id, ctx.fingerprint, row.operation_id,
                         row.version)

    def within(tx: HotTx) -> None:
        """In the `prepared` transaction: the approval, then the hooks (impact keys)."""
        if row.authorization.kind is AuthKind.GATE and not ctx.rehearse:
            try:
                rt.ledger.consume_approval_on(
                    tx, ctx.plan.plan_hash, ctx.intent_id, now=rt.clock(),
                    exclude_approver=ctx.who if row.authorization.four_eyes else None,
                    accept=lambda approval: approval_problem(rt, approval, row))
            except UnknownPlan:
                raise ApprovalRequired(
                    f"{row.ref} is gated: no approval for {ctx.plan.plan_hash}",
                    plan_hash=ctx.plan.plan_hash, plan=ctx.plan.to_dict()) from None
        rt.hooks.within_prepared(ctx, tx)

    state: dict[str, Any] = {
        "operation_id": row.operation_id, "version": row.version,
        "row_hash": row.row_hash, "idempotency_key": ctx.idem_key,
        "fingerprint": ctx.fingerprint, "connector": ctx.connector.name,
        "environment": ctx.connector.environment, "who": ctx.who,
        "effect_class": str(row.effect_class), "recovery": str(row.recovery),
        "plan_hash": ctx.plan.plan_hash, "attempt": 0, "inputs": dict(ctx.inputs)}
    if identity is not None:  # the attempt, recorded with the intent (no second commit)
        state.update(attempt=ctx.attempt, tx=identity.to_dict(),
                     started_at=rt.clock().isoformat())
    payload: dict[str, Any] = {
        "request": {"operation_id": row.operation_id, "version": row.version,
                    "inputs": dict(ctx.inputs), "who": ctx.who,
                    "connector": ctx.connector.name,
                    "environment": ctx.connector.environment},
        "state": state}
    if ctx.task is not None:
        payload["case_state"] = {"task": ctx.task}
    for _ in range(_OUTSIDE_RETRIES):
        try:
            rt.ledger.append(ctx.case_id, "prepared", payload, intent_id=ctx.intent_id,
                             claim=claim, within=within,
                             guard=case_guard(ctx.case_id, ctx.task,
                                              lambda s: rt.hooks.check_case(ctx, s)),
                             continuing=True)
            break
        except RetryOutside as wait:  # e.g. no budget slot free: wait outside, then again
            if identity is not None:
                # the target's transaction is open: never wait inside it (its server
                # would end it as idle); the caller rolls it back, waits, opens again
                raise
            wait.prepare()
        except LedgerError as exc:
            if exc.details.get("connection_lost"):  # the commit of the intent is in doubt
                raise ledger_unreachable(rt, ctx, exc, recorded=None) from exc
            raise
    else:
        raise LedgerError(f"could not record intent {ctx.intent_id} after "
                          f"{_OUTSIDE_RETRIES} tries under contention; retry the call",
                          case_id=ctx.case_id)
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.add(ctx.intent_id)
    rt.hooks.after_prepared(ctx)
    context.at_boundary("after_prepared")
    if identity is not None:
        context.at_boundary("after_attempt_started")


_RECORDED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "capgate_recorded_intents", default=None)
"""The intents whose ``prepared`` committed during the call this thread is making."""


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """A call's span: the intents it records as prepared are collected (see
    :func:`ledger_unreachable`)."""
    recorded: set[str] = set()
    token = _RECORDED.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDED.reset(token)


def ledger_unreachable(rt: Runtime, ctx: CallContext, exc: LedgerError,
                       recorded: bool | None) -> LedgerUnreachable:
    """The call lost its ledger after (``recorded``) or while (None) recording its intent:
    an unknown outcome that says what to run, never a usage error."""
    state = ("was recorded, but the call could not finish recording what became of it"
             if recorded else "may or may not have been recorded")
    return LedgerUnreachable(
        f"the ledger stopped answering during {ctx.row.ref} (intent {ctx.intent_id} of case "
        f"{ctx.case_id!r}): {exc.message}; the intent {state}.  Run `capgate resume "
        f"{ctx.case_id}` once the ledger answers: it establishes from the target what "
        "landed, and retries what did not", case=ctx.case_id, intent_id=ctx.intent_id,
        recorded=recorded, ledger=rt.ledger.url)


def case_guard(case_id: str, task: str | None,
               check: Callable[[Mapping[str, Any] | None], None] | None = None) -> Guard:
    """What a new intent requires of its case: no open intent, and the same task; then
    ``check`` (the hooks' ``check_case``: a registered symptom re-read, issue 17)."""
    def guard(state: Mapping[str, Any] | None) -> None:
        if state is None:
            return
        open_intents = sorted(i for i, s in (state.get("intents") or {}).items()
                              if s.get("status") not in context.TERMINAL)
        if open_intents:
            raise ReconciliationRequired(
                f"case {case_id!r} has {len(open_intents)} unresolved intent(s); "
                f"run `capgate resume {case_id}` first",
                case=case_id, intents=open_intents)
        recorded = (state.get("case") or {}).get("task")
        if task is not None and recorded is not None and recorded != task:
            raise CaseConflict(
                f"case {case_id!r} was opened for task {recorded!r}, not {task!r}; "
                "use a new case for new work", case=case_id, recorded=recorded, task=task)
        if check is not None:
            check(state)
    return guard


def attempt_started(rt: Runtime, ctx: CallContext, identity: TxIdentity) -> None:
    """The transaction's identity, durable before any statement (fenced by the attempt)."""
    rt.ledger.append(ctx.case_id, "attempt_started", {
        "state": {"attempt": ctx.attempt, "tx": identity.to_dict(),
                  "started_at": rt.clock().isoformat()},
    }, intent_id=ctx.intent_id, attempt=ctx.attempt)
    context.at_boundary("after_attempt_started")


def observed(rt: Runtime, ctx: CallContext, result: Outcome) -> Outcome:
    """The outcome, recorded -- unless this attempt was superseded meanwhile.

    The hooks' releases (impact claims, the session's budget slot) ride in the
    same transaction.  An applied outcome whose landing marker committed with
    the data is recorded without waiting for the disk: the marker already
    proves it, and resume rebuilds it from the marker should an operating-system
    crash lose it.  Every other outcome -- a rollback above all, which the
    caller takes as "nothing landed" -- is committed durably.
    """
    record = result.to_dict()
    proven = result.status == oc.APPLIED and ctx.idem_key is not None and not ctx.rehearse
    try:
        rt.ledger.append(ctx.case_id, "observed", {
            "outcome": record,
            "state": {"outcome": result.status, "outcome_record": record},
        }, intent_id=ctx.intent_id, attempt=ctx.attempt,
            within=lambda tx: rt.hooks.within_observed(ctx, tx), durable=not proven)
    except AttemptSuperseded as late:
        record_stale(rt, ctx, result, late)
    rt.hooks.after_observed(ctx)
    context.at_boundary("after_observed")
    return result


def record_stale(rt: Runtime, ctx: CallContext, seen: Outcome | str,
                 superseded: AttemptSuperseded) -> NoReturn:
    """Keep the late attempt's observation as evidence, then raise ``superseded``.

    ``seen`` is what the late attempt observed (an outcome, or a word such as
    ``commit_uncertain`` when it lost its connection around COMMIT).  A late
    attempt that *applied* while the intent is recorded otherwise (resume
    closed it as not applied, or a retry rolled back) must not leave the
    record saying so: the intent is escalated, for a person to decide.
    """
    recorded = superseded.details.get("recorded_outcome") or {}
    late_applied = isinstance(seen, Outcome) and seen.status in (oc.APPLIED, oc.ALREADY_APPLIED)
    rt.ledger.append(ctx.case_id, "stale_attempt", {"stale": {
        "intent_id": ctx.intent_id, "attempt": ctx.attempt,
        "recorded_attempt": superseded.details.get("recorded_attempt"),
        "recorded_status": superseded.details.get("recorded_status"),
        "outcome": seen if isinstance(seen, str) else seen.to_dict()}})
    if late_applied and recorded.get("status") not in (oc.APPLIED, oc.ALREADY_APPLIED):
        rt.ledger.append(ctx.case_id, "escalated", {"state": {"escalation": {
            "kind": RollbackReason.STALE_ATTEMPT_APPLIED, "by": "executor",
            "detail": f"attempt {ctx.attempt} applied after the intent was recorded as "
                      f"{recorded.get('status') or superseded.details.get('recorded_status')}",
            "late_outcome": seen.to_dict() if isinstance(seen, Outcome) else seen}}},
            intent_id=ctx.intent_id)
    raise superseded


def attempts(rt: Runtime, ctx: CallContext, run: Callable[[CallContext], Outcome]
             ) -> tuple[CallContext, Outcome]:
    """``run`` one attempt, then keep the row's effect-of-timeout contract.

    After a timeout or a lost connection the row decides
    (``Row.timeout_action``): ``retry`` runs the next attempt at once (same
    intent, same key; recorded as ``retrying``), ``record`` returns the
    rollback with the contract in its reason, ``reconcile`` leaves the
    intent open as a ``reconciliation_task`` and raises
    ReconciliationRequired.  Returns the context of the last attempt.
    """
    while True:
        result = run(ctx)
        if ctx.rehearse or (action := _timeout_contract(rt, ctx, result)) is None:
            return ctx, result
        if action == "retry":
            ctx = dataclasses.replace(ctx, attempt=ctx.attempt + 1, resumed=True)
            continue
        return ctx, Outcome(**{**result.__dict__, "reason": {
            **(result.reason or {}), "contract": {"action": action,
                                                  "on_timeout": str(ctx.row.timeout.on_timeout),
                                                  "recovery": str(ctx.row.recovery)}}})


def _timeout_contract(rt: Runtime, ctx: CallContext, result: Outcome) -> str | None:
    """The contract's action for a timed-out (or disconnected) attempt; None otherwise."""
    reason = result.reason or {}
    kind = reason.get("kind")
    lost = kind == "database_error" and bool(reason.get("connection_lost"))
    if result.status != oc.ROLLED_BACK or not (kind in ("timeout", "lease_expired") or lost):
        return None
    row = ctx.row
    action = row.timeout_action
    if action == "retry" and ctx.attempt >= row.timeout.attempts:
        action = "record"  # the row's budget of attempts is spent
    contract = {"cause": "connection_lost" if lost else kind, "action": action,
                "on_timeout": str(row.timeout.on_timeout), "recovery": str(row.recovery),
                "safe_to_repeat": row.safe_to_repeat, "attempt": ctx.attempt,
                "attempts": row.timeout.attempts, "reason": dict(reason)}
    try:
        if action == "retry":
            rt.ledger.append(ctx.case_id, "retrying", {"state": {
                "retry_attempt": ctx.attempt + 1, "classification": "not_applied",
                "rule": "timeout contract: rolled back, retryable, safe to repeat",
                "contract": contract}}, intent_id=ctx.intent_id, attempt=ctx.attempt)
        elif action == "reconcile":
            rt.ledger.append(ctx.case_id, "reconciliation_task", {"state": {
                "contract": contract}}, intent_id=ctx.intent_id, attempt=ctx.attempt)
    except AttemptSuperseded as late:  # resume moved on while this attempt ran: evidence
        record_stale(rt, ctx, result, late)
    if action == "reconcile":
        raise ReconciliationRequired(
            f"{row.ref} timed out ({contract['cause']}); its contract (on_timeout: "
            f"unknown) makes the outcome a reconciliation task: run `capgate resume "
            f"{ctx.case_id}` to establish what landed before more work in the case",
            case=ctx.case_id, intent_id=ctx.intent_id, contract=contract)
    return action
