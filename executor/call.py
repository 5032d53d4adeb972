"""The executor: plan, approve and call declared operations.

A call passes these boundaries, each durable in the ledger before the next:

    resolve row - validate input - authorize (grant; approval bound to the plan hash)
    - continuation check - idempotency - ledger: prepared - open transaction
    - ledger: attempt_started (with the transaction's identity)
    - statements (expected counts) - verify - replay - landing marker - COMMIT | ROLLBACK
    - ledger: observed (outcome + evidence) - post-commit checks (- compensation)

No model call, human gate or agent hop happens between opening the
transaction and COMMIT: the collapsed shape (A) runs it all inside this one
function.  ``CAPGATE_CRASH_AT`` (test-only) names a boundary at which the
process kills itself with SIGKILL, so crash tests hit real boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonschema
import sqlalchemy as sa

from executor import outcome as oc
from executor.approvals import SigningKey
from executor.checks import CheckResult, evaluate
from executor.connectors import Connector, Connectors
from executor.dialects import SessionTag, TxIdentity
from executor.dialects.base import MARKER_TABLE, TARGET_TABLES
from executor.grants import Grants
from executor.ledger import (
    ApprovalRecord,
    IdempotencyRecord,
    KeyAlreadyClaimed,
    KeyClaim,
    Ledger,
)
from executor.outcome import Outcome, jsonable
from executor.plan import Plan, binds_for, fingerprint, idempotency_key, render
from registry.canonical import canonical_hash
from registry.errors import (
    ApprovalExpired,
    ApprovalMismatch,
    ApprovalNotAuthenticated,
    ApprovalRequired,
    ApprovalUsed,
    AttemptSuperseded,
    BudgetExhausted,
    CallerKeyRefused,
    CaseConflict,
    ConnectorUnavailable,
    DdlError,
    IdempotencyConflict,
    InputInvalid,
    OutcomeUnknown,
    ReconciliationRequired,
    RequestInFlight,
    RequestTooLarge,
    SelfApproval,
    UnknownPlan,
    UsageError,
)
from registry.excerpt import bounded, cut, excerpt
from registry.model import AuthKind, EffectClass, Row, Shape
from registry.registry import Registry

_MARKER_BY_KEY = (f"SELECT intent_id, case_id, fingerprint, attempt, operation_id, landed_at"
                  f" FROM {MARKER_TABLE} WHERE idem_key = :k")
CRASH_ENV = "CAPGATE_CRASH_AT"
CRASH_POINTS = ("after_prepared", "after_attempt_started", "before_commit", "after_commit",
                "after_observed")
TERMINAL = frozenset({"observed", "reconciled", "escalation_resolved"})
AWAIT_OWNER_MARGIN_SECONDS = 10.0
"""An identical call waits for the owning execution this long past the row's timeout."""


def crash_point(name: str) -> None:
    """Test-only: die here, hard, when ``CAPGATE_CRASH_AT`` names this boundary."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


MAX_REQUEST_BYTES = 1_048_576
"""Default bound on a request's inputs as recorded (canonical JSON); see RequestTooLarge."""
MAX_INPUT_DEPTH = 64
"""Inputs nested deeper than this are refused before anything else looks at them."""
_SAFE_INT = 2**53 - 1


@lru_cache(maxsize=4096)
def _input_validator(row_hash: str, schema_json: str) -> jsonschema.Draft202012Validator:
    import json

    return jsonschema.Draft202012Validator(json.loads(schema_json))


def _representable(row: Row, inputs: Mapping[str, Any]) -> None:
    """Refuse inputs the ledger cannot record exactly (RFC 8785 JSON), naming the field.

    Integers beyond 2^53, NaN and infinities, strings with lone surrogates,
    non-string keys and nesting deeper than :data:`MAX_INPUT_DEPTH` would
    either change on the way into the record or crash the canonical encoder
    after the intent was half-recorded; they are invalid input instead.
    """
    stack: list[tuple[str, Any, int]] = [("", dict(inputs), 0)]
    while stack:
        where, value, depth = stack.pop()
        problem: str | None = None
        if depth > MAX_INPUT_DEPTH:
            problem = f"nested deeper than {MAX_INPUT_DEPTH} levels"
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not -_SAFE_INT <= value <= _SAFE_INT:
                problem = (f"the integer {excerpt(value, 40)} is beyond 2^53 and cannot be "
                           "recorded exactly (JSON numbers are IEEE-754 doubles); send it as "
                           "a string")
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                problem = f"{value!r} is not a JSON number"
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                problem = "the text holds a lone surrogate (not valid Unicode text)"
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    problem = f"the key {excerpt(key, 40)} is not a string"
                    break
                stack.append((f"{where}.{key}" if where else key, item, depth + 1))
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", item, depth + 1) for i, item in enumerate(value))
        else:
            problem = f"a {type(value).__name__} is not JSON data"
        if problem is not None:
            field = excerpt(where, 80) if len(where) > 80 else (where or "(input)")
            raise InputInvalid(f"input does not satisfy the contract of {row.ref}: "
                               f"{field}: {problem}", field=field,
                               operation_id=row.operation_id, version=row.version)


def validate_input(row: Row, inputs: Mapping[str, Any],
                   max_bytes: int = MAX_REQUEST_BYTES) -> None:
    """Refuse inputs that break the row's contract, naming the field.

    Before the row's JSON Schema: what the ledger could not record exactly
    (:func:`_representable`) and requests over ``max_bytes``.  Messages quote
    offending values as bounded excerpts, never whole.
    """
    import json

    from registry.canonical import canonical_bytes
    from registry.model import thaw

    _representable(row, inputs)
    size = len(canonical_bytes(dict(inputs)))
    if size > max_bytes:
        raise RequestTooLarge(
            f"the request to {row.ref} is {size} bytes of JSON; this executor takes at most "
            f"{max_bytes} (`max_request_bytes`); nothing was recorded",
            size=size, limit=max_bytes, operation_id=row.operation_id)
    validator = _input_validator(row.row_hash, json.dumps(thaw(row.input), sort_keys=True))
    try:
        errors = sorted(validator.iter_errors(dict(inputs)), key=lambda e: list(e.absolute_path))
    except RecursionError:
        raise InputInvalid(f"input does not satisfy the contract of {row.ref}: nested too "
                           "deeply to check", field="(input)",
                           operation_id=row.operation_id, version=row.version) from None
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.absolute_path) or "(input)"
        if first.validator == "additionalProperties" and isinstance(first.instance, dict):
            allowed = set(first.schema.get("properties", {})) if isinstance(
                first.schema, dict) else set()
            extras = sorted(set(first.instance) - allowed)
            prefix = where + "." if where != "(input)" else ""
            where = ", ".join(prefix + e for e in extras) or where
        elif first.validator == "required" and isinstance(first.instance, dict):
            required: Any = first.validator_value
            missing = [r for r in required if r not in first.instance]
            where = ", ".join(missing) or where
        raise InputInvalid(
            f"input does not satisfy the contract of {row.ref}: {excerpt(where, 120)[1:-1]}: "
            f"{_schema_message(first)}",
            field=where, problems=[{"field": ".".join(str(p) for p in e.absolute_path),
                                    "message": _schema_message(e)} for e in errors[:20]],
            operation_id=row.operation_id, version=row.version,
        )


def _schema_message(error: jsonschema.ValidationError) -> str:
    """jsonschema's message without the offending value quoted whole."""
    if error.validator in ("maxLength", "minLength") and isinstance(error.instance, str):
        return (f"{len(error.instance)} characters, "
                f"{'at most' if error.validator == 'maxLength' else 'at least'} "
                f"{error.validator_value} allowed")
    text = error.message
    shown = repr(error.instance)
    if len(shown) > 120 and shown in text:
        text = text.replace(shown, excerpt(error.instance, 60))
    return cut(text, 500)


@dataclass(frozen=True)
class CallContext:
    row: Row
    inputs: Mapping[str, Any]
    case_id: str
    who: str
    connector: Connector
    intent_id: str
    idem_key: str | None
    fingerprint: str
    plan: Plan
    attempt: int = 1
    rehearse: bool = False
    resumed: bool = False  # resume hook (executor/resume.py): already prepared, no 2nd `prepared`
    task: str | None = None
    """The task the case was opened for; recorded on the case by its first ``prepared``."""

    @property
    def tag(self) -> SessionTag:
        return SessionTag(self.case_id, self.row.operation_id, self.intent_id)

    def outcome(self, status: str, evidence: Mapping[str, Any],
                reason: Mapping[str, Any] | None = None) -> Outcome:
        """This call's outcome.  A write's evidence and every reason are bounded
        (``registry.excerpt``): they are recorded and replayed; a read's rows go
        back to its caller whole and are never recorded."""
        if self.row.is_write:
            evidence = bounded(evidence)
        return Outcome(status=status, intent_id=self.intent_id, case_id=self.case_id,
                       operation_id=self.row.operation_id, version=self.row.version,
                       row_hash=self.row.row_hash, idempotency_key=self.idem_key,
                       fingerprint=self.fingerprint, attempt=self.attempt,
                       evidence=evidence, reason=bounded(reason) if reason else reason)


class Rollback(Exception):
    """Internal: a count, check or error that rolls the transaction back."""

    def __init__(self, reason: dict[str, Any]):
        super().__init__(reason.get("kind", "rollback"))
        self.reason = reason


class Executor:
    """Runs declared operations against configured connectors, recording everything."""

    def __init__(self, registry: Registry, connectors: Connectors, ledger: Ledger,
                 grants: Grants, *, clock: Callable[[], dt.datetime] = now_utc,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        self.registry = registry
        self.max_request_bytes = max_request_bytes
        """Largest request (canonical JSON bytes of the inputs) a call accepts."""
        self.connectors = connectors
        self.ledger = ledger
        self.grants = grants
        self.clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    def close(self) -> None:
        """Release the connectors' and the ledger's connections."""
        self.connectors.dispose()
        self.ledger.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- resolution ----------------------------------------------------------

    def resolve(self, operation_id: str, version: int | None = None) -> tuple[Row, Connector]:
        """The row and its connector; the row reaches only its own connector's database."""
        candidate = self.registry.resolve(operation_id, version)
        config = self.connectors.config(candidate.connector)
        row = self.registry.resolve(operation_id, version, config.environment)
        return row, self.connectors.get(row.connector)

    def plan(self, operation_id: str, inputs: Mapping[str, Any], *, case: str, who: str,
             version: int | None = None, record: bool = True) -> Plan:
        """Render the plan (no DML); record it so an approver can find it by hash."""
        row, connector = self.resolve(operation_id, version)
        validate_input(row, inputs, self.max_request_bytes)
        self.grants.check_call(who, row, connector.name, connector.environment)
        plan = render(row, inputs, connector.name, connector.environment, case=case,
                      requester=who)
        if record:
            self.ledger.record_plan(plan.plan_hash, case, who, plan.to_dict())
        return plan

    def approve(self, plan_hash: str, *, by: str, role: str, key: SigningKey,
                ttl_seconds: int | None = None) -> dict[str, Any]:
        """Record a single-use, expiring approval of a recorded plan, signed by ``by``'s key.

        ``key`` is the approver's private key (:mod:`executor.approvals`); it
        must be the one the grants file names for ``by``, so that a name alone
        -- typed by anyone who can run this -- approves nothing.
        """
        record = self.ledger.get_plan(plan_hash)
        body = record.plan
        if body.get("kind") == "rehearsal":  # a gated simulation: the connector's roles
            ref = f"the rehearsal on {body['connector']}"
            roles = self.connectors.config(str(body["connector"])).simulation_approver_roles
            four_eyes, ttl_default = True, 3600
            operation: dict[str, Any] = {"rehearsal": True, "connector": body["connector"]}
        else:
            row = self.registry.resolve(body["operation_id"], int(body["version"]))
            if row.authorization.kind is not AuthKind.GATE \
                    and row.effect_class is not EffectClass.DDL:
                raise UsageError(f"{row.ref} is not gated; it needs no approval")
            ref, roles = row.ref, row.authorization.approver_roles
            four_eyes = row.authorization.four_eyes
            ttl_default = row.authorization.approval_ttl_seconds
            operation = {"operation_id": row.operation_id, "version": row.version}
        self.grants.check_approver(by, role, roles)
        expected = self.grants.principal(by).approval_key
        if expected is None:
            raise ApprovalNotAuthenticated(
                f"{by!r} has no approval_key in {self.grants.source}: an administrator adds "
                f"the public key that `capgate approver keygen` printed for {by!r}",
                approver=by, plan_hash=plan_hash)
        if key.public_text != expected:
            raise ApprovalNotAuthenticated(
                f"the key {key.source} is not {by!r}'s (the grants file names another): an "
                "approval is signed by the approver's own key", approver=by,
                plan_hash=plan_hash)
        if four_eyes and by == record.requester:
            raise SelfApproval(
                f"{by!r} requested this plan and cannot approve it: {ref} requires four eyes",
                approver=by, plan_hash=plan_hash)
        ttl = ttl_seconds or ttl_default
        approval = self.ledger.record_approval(
            plan_hash, by, role, ttl, now=self.clock(),
            sign=lambda fields: (key.public_text, key.sign(fields)))
        self.ledger.append(record.case_id, "approval_recorded", {"case_state": {
            "last_approval": {"plan_hash": plan_hash, "by": by, "role": role,
                              "approval_id": approval.approval_id,
                              "requester": record.requester, "signature": approval.signature,
                              "expires_at": approval.expires_at.isoformat()}}})
        return {"plan_hash": plan_hash, "approval_id": approval.approval_id, "by": by,
                "role": role, "expires_at": approval.expires_at.isoformat(), **operation,
                "case": record.case_id, "requester": record.requester}

    def approval_problem(self, approval: ApprovalRecord, row: Row) -> str | None:
        """Why ``approval`` cannot be used for ``row`` now (None: it can): signature, role."""
        return self.grants.approval_problem(approval, row.authorization.approver_roles)

    def recheck_approval(self, ctx: CallContext) -> None:
        """A resumed retry relies on the approval its intent consumed: is it still good?

        The approval must exist, be unexpired and still verify against the
        current grants (signature, key, role); raises the coded refusal if not.
        """
        if ctx.row.authorization.kind is not AuthKind.GATE:
            return
        used = [a for a in self.ledger.approvals_for(ctx.plan.plan_hash)
                if a.used_by_intent == ctx.intent_id]
        if not used:
            raise ApprovalRequired(
                f"intent {ctx.intent_id} holds no approval of plan {ctx.plan.plan_hash}; a "
                "retry needs the approval it was prepared with", plan_hash=ctx.plan.plan_hash)
        approval = used[0]
        if approval.expired(self.clock()):
            raise ApprovalExpired(
                f"the approval {approval.approval_id} intent {ctx.intent_id} relied on has "
                "expired; a retry needs a new approval", plan_hash=ctx.plan.plan_hash,
                approval_id=approval.approval_id)
        problem = self.approval_problem(approval, ctx.row)
        if problem is not None:
            raise ApprovalNotAuthenticated(
                f"the approval {approval.approval_id} intent {ctx.intent_id} relied on no "
                f"longer holds: {problem}", plan_hash=ctx.plan.plan_hash,
                approval_id=approval.approval_id)

    # --- the call ------------------------------------------------------------

    def call(self, operation_id: str, inputs: Mapping[str, Any], *, case: str, who: str,
             version: int | None = None, key: str | None = None, task: str | None = None,
             plan_hash: str | None = None, rehearse: bool = False) -> Outcome:
        """Run one declared operation; answer with an outcome and its evidence."""
        row, connector = self.resolve(operation_id, version)
        inputs = dict(inputs)
        validate_input(row, inputs, self.max_request_bytes)
        self.grants.check_call(who, row, connector.name, connector.environment)
        plan = render(row, inputs, connector.name, connector.environment, case=case,
                      requester=who)
        if plan_hash is not None and plan_hash != plan.plan_hash:
            raise ApprovalMismatch(
                f"the approved plan {plan_hash} is not this call's plan {plan.plan_hash}",
                approved=plan_hash, actual=plan.plan_hash)
        if row.effect_class is EffectClass.DDL:
            raise DdlError(
                f"{row.ref} changes stored code: it runs through the DDL loop "
                f"(`capgate ddl plan` / `capgate ddl apply`), never as a plain call",
                operation_id=row.operation_id, version=row.version)
        fp = fingerprint(row, inputs, connector.name, connector.environment)
        idem = self._key_for(row, inputs, case, key)
        if idem is not None and not rehearse:
            # one read: a recorded (or running) execution of this key answers for us --
            # a replay, or a wait for the identical call in flight, is no new work
            owner = self.ledger.get_idempotency(idem)
            if owner is not None:
                return self._follow_owner(owner, row, fp, idem, case)
        try:
            self._check_case(case, task)
        except ReconciliationRequired:
            # the open intent may be this very request, prepared by an identical call
            # a moment ago (another process): then its outcome is ours too
            owner = self.ledger.get_idempotency(idem) if idem and not rehearse else None
            if owner is None or owner.case_id != case:
                raise
            return self._follow_owner(owner, row, fp, idem or owner.idem_key, case)
        ctx = CallContext(row, inputs, case, who, connector, uuid.uuid4().hex, idem, fp, plan,
                          rehearse=rehearse, task=task)
        # --- impact claims and session budgets (executor/claims.py, executor/budget.py):
        # the budget slot is reserved before `prepared`; the impact keys (and the
        # approval, and the idempotency key) are claimed in the `prepared` transaction
        # itself: a conflict or an exhausted budget records nothing
        from executor import budget, claims

        error: BaseException | None = None
        lost: IdempotencyRecord | None = None
        flight = contextlib.ExitStack()
        try:
            flight.enter_context(self._flying(None if rehearse else idem))
            budget.reserve(self, ctx)
            # --- end impact claims and session budgets
            if row.authorization.kind is AuthKind.GATE and not rehearse:
                self._check_approval(ctx)
            if row.effect_class is EffectClass.READ:
                return self._read(ctx)
            if row.shape is Shape.LEASED:
                from executor.lease import run_leased

                return run_leased(self, ctx)
            return self._collapsed(ctx)
        except KeyAlreadyClaimed as race:
            lost = race.record  # an identical call prepared first: nothing of ours was sent
        except BudgetExhausted as exc:
            # identical calls arriving together (an MCP server's threads): the one that got
            # a session runs the request, and this one waits for it instead of being refused
            lost = self._owner_soon(idem, ctx) if idem is not None and not rehearse else None
            if lost is None:
                error = exc
                raise
        except BaseException as exc:  # --- impact claims and session budgets: release
            error = exc
            raise
        finally:
            budget.release_unused(self, ctx)
            claims.release_after_call(self, ctx, error)  # --- end
            flight.close()
        return self._follow_owner(lost, row, fp, idem or lost.idem_key, case)

    def lease(self, operation_id: str, inputs: Mapping[str, Any], *, case: str, who: str,
              steps: Sequence[str | Callable[..., Any]] | None = None,
              version: int | None = None, key: str | None = None,
              task: str | None = None, plan_hash: str | None = None) -> Outcome:
        """Run a leased row under its deadline (see :func:`executor.lease.lease`)."""
        from executor.lease import lease  # --- leased API (executor/lease.py)

        return lease(self, operation_id, inputs, case=case, who=who, steps=steps,
                     version=version, key=key, task=task, plan_hash=plan_hash)

    # --- guards --------------------------------------------------------------

    def _check_case(self, case: str, task: str | None) -> None:
        snapshot = self.ledger.verified_snapshot(case)
        if snapshot is None:
            return
        open_intents = [i for i, s in snapshot.get("intents", {}).items()
                        if s.get("status") not in TERMINAL]
        if open_intents:
            raise ReconciliationRequired(
                f"case {case!r} has {len(open_intents)} unresolved intent(s); "
                f"run `capgate resume {case}` first",
                case=case, intents=open_intents)
        recorded = snapshot.get("case", {}).get("task")
        if task is not None and recorded is not None and recorded != task:
            raise CaseConflict(
                f"case {case!r} was opened for task {recorded!r}, not {task!r}; "
                "use a new case for new work", case=case, recorded=recorded, task=task)

    @staticmethod
    def _key_for(row: Row, inputs: Mapping[str, Any], case: str,
                 caller_key: str | None) -> str | None:
        """The idempotency key: the row's reviewed template, plus a caller key it accepts."""
        reviewed = idempotency_key(row, inputs, case)
        if caller_key is None:
            return reviewed
        if not row.accepts_caller_key:
            raise CallerKeyRefused(
                f"{row.ref} takes no caller key: its idempotency key {row.idempotency_key!r} "
                "is part of the reviewed contract (a row may declare accepts_caller_key: "
                "true); nothing was recorded", operation_id=row.operation_id,
                version=row.version)
        if not caller_key or len(caller_key) > 200:
            raise InputInvalid("a caller key must be 1 to 200 characters", field="key")
        return f"{reviewed}|caller:{caller_key}"

    def _owner_soon(self, idem: str, ctx: CallContext) -> IdempotencyRecord | None:
        """The owner of ``idem``, waiting while an identical call may be about to prepare.

        Such a call is one of this process running the same key, or any call of
        the same case holding a session (another process).  Without one (or
        once they ended without preparing) the answer is None at once: the
        caller's own refusal stands.
        """
        from executor.budget import case_holds_session

        deadline = time.monotonic() + float(ctx.row.timeout.seconds)
        while True:
            with self._lock:  # before the read: an identical call that ends after this
                others = self._in_flight.get(idem, 0) > 1  # has prepared before the read
            others = others or case_holds_session(self, ctx.connector, ctx.case_id)
            owner = self.ledger.get_idempotency(idem)
            if owner is not None:
                return owner
            if not others or time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    @contextlib.contextmanager
    def _flying(self, idem: str | None) -> Iterator[None]:
        """Count this process's calls of ``idem`` while they run (see :meth:`_owner_soon`)."""
        if idem is None:
            yield
            return
        with self._lock:
            self._in_flight[idem] = self._in_flight.get(idem, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._in_flight.pop(idem) - 1
                if left:
                    self._in_flight[idem] = left

    def _follow_owner(self, owner: IdempotencyRecord, row: Row, fp: str, idem: str,
                      case: str) -> Outcome:
        """The outcome of the one execution that owns ``idem``: recorded, or waited for.

        Exactly one intent executes per idempotency key (it claims the key with
        its ``prepared`` event).  An identical call that finds the key owned
        returns that intent's outcome (from any case: a key without ``{case}``
        names one effect for good), waiting while it runs in this case; it
        records and sends nothing of its own.  A different request under the
        key, or the same request still running in another case, is refused.
        """
        if owner.fingerprint != fp:
            raise IdempotencyConflict(
                f"idempotency key {idem!r} was used for a different request "
                f"(intent {owner.intent_id} in case {owner.case_id!r})",
                key=idem, intent_id=owner.intent_id, case=owner.case_id)
        wait = float(row.timeout.seconds) + AWAIT_OWNER_MARGIN_SECONDS
        deadline = time.monotonic() + wait
        pause = 0.005
        while True:
            state = ((self.ledger.verified_snapshot(owner.case_id) or {}).get("intents") or {}).get(
                owner.intent_id) or {}
            record = state.get("outcome_record")
            if state.get("status") in TERMINAL and isinstance(record, dict):
                return Outcome.from_dict(record, replayed=True)
            if owner.case_id != case:  # another case's request, still running: not ours
                raise IdempotencyConflict(
                    f"idempotency key {idem!r} is held by case {owner.case_id!r}",
                    key=idem, case=owner.case_id, intent_id=owner.intent_id)
            if time.monotonic() >= deadline:
                raise RequestInFlight(
                    f"the same request (key {idem!r}) is being executed as intent "
                    f"{owner.intent_id} of case {owner.case_id!r}, still {state.get('status')} "
                    f"after {wait:.0f} s; call again for its outcome, or run `capgate resume "
                    f"{owner.case_id}` if its executor died",
                    key=idem, case=owner.case_id, intent_id=owner.intent_id,
                    status=state.get("status"))
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _check_approval(self, ctx: CallContext) -> None:
        """A usable approval of this exact plan exists (consumed later, with ``prepared``).

        Refusals name what is missing; the plan is recorded so that an approver
        can find it by its hash.
        """
        plan = ctx.plan
        approvals = self.ledger.approvals_for(plan.plan_hash)
        now = self.clock()
        four_eyes = ctx.row.authorization.four_eyes
        usable = [a for a in approvals if a.used_by_intent is None and a.expires_at > now
                  and not (four_eyes and a.approver == ctx.who)]
        if not usable:
            self.ledger.record_plan(plan.plan_hash, ctx.case_id, ctx.who, plan.to_dict())
            details = {"plan_hash": plan.plan_hash, "plan": plan.to_dict(),
                       "approver_roles": list(ctx.row.authorization.approver_roles),
                       "four_eyes": four_eyes}
            if any(a.used_by_intent is None and a.expires_at > now for a in approvals):
                raise SelfApproval(f"the only approval of {plan.plan_hash} is the requester's "
                                   "own; four eyes requires another approver", **details)
            if any(a.used_by_intent is None for a in approvals):
                raise ApprovalExpired(f"the approval of plan {plan.plan_hash} has expired",
                                      **details)
            if approvals:
                raise ApprovalUsed(f"the approval of plan {plan.plan_hash} was already used",
                                   **details)
            raise ApprovalRequired(
                f"{ctx.row.ref} is gated: approve plan {plan.plan_hash} with "
                f"`capgate approve {plan.plan_hash} --by WHO --role "
                f"{'|'.join(ctx.row.authorization.approver_roles)} --key FILE`", **details)

    # --- ledger boundaries ---------------------------------------------------

    def _prepared(self, ctx: CallContext) -> None:
        """The intent, durable before anything is sent; it claims the idempotency key too.

        Raises KeyAlreadyClaimed (nothing written) when an identical call
        prepared first: its execution is the only one.
        """
        if ctx.resumed:  # resume hook: a retried attempt of an intent prepared before
            return
        row = ctx.row
        claim = None
        if ctx.idem_key is not None and not ctx.rehearse:
            claim = KeyClaim(ctx.idem_key, ctx.intent_id, ctx.fingerprint, row.operation_id,
                             row.version)
        held: list[Any] = []
        from executor import claims  # --- impact claims

        def within(conn: sa.Connection) -> None:
            """In the `prepared` transaction: the approval and the impact keys."""
            held.clear()
            if row.authorization.kind is AuthKind.GATE and not ctx.rehearse:
                try:
                    self.ledger.consume_approval_on(
                        conn, ctx.plan.plan_hash, ctx.intent_id, now=self.clock(),
                        exclude_approver=ctx.who if row.authorization.four_eyes else None,
                        accept=lambda approval: self.approval_problem(approval, row))
                except UnknownPlan:
                    raise ApprovalRequired(
                        f"{row.ref} is gated: no approval for {ctx.plan.plan_hash}",
                        plan_hash=ctx.plan.plan_hash, plan=ctx.plan.to_dict()) from None
            taken = claims.claim_within_prepared(self, ctx, conn)
            if taken is not None:
                held.append(taken)

        self.ledger.append(ctx.case_id, "prepared", {
            "request": {"operation_id": row.operation_id, "version": row.version,
                        "inputs": dict(ctx.inputs), "who": ctx.who,
                        "connector": ctx.connector.name,
                        "environment": ctx.connector.environment},
            "state": {"operation_id": row.operation_id, "version": row.version,
                      "row_hash": row.row_hash, "idempotency_key": ctx.idem_key,
                      "fingerprint": ctx.fingerprint, "connector": ctx.connector.name,
                      "environment": ctx.connector.environment, "who": ctx.who,
                      "effect_class": str(row.effect_class), "recovery": str(row.recovery),
                      "plan_hash": ctx.plan.plan_hash, "attempt": 0, "inputs": dict(ctx.inputs)},
            **({"case_state": {"task": ctx.task}} if ctx.task is not None else {}),
        }, intent_id=ctx.intent_id, claim=claim, within=within)
        for taken in held:
            claims.remember(self, taken)  # --- end impact claims
        crash_point("after_prepared")

    def _attempt_started(self, ctx: CallContext, identity: TxIdentity) -> None:
        """The transaction's identity, durable before any statement (fenced: see below)."""
        self.ledger.append(ctx.case_id, "attempt_started", {
            "state": {"attempt": ctx.attempt, "tx": identity.to_dict(),
                      "started_at": self.clock().isoformat()},
        }, intent_id=ctx.intent_id, attempt=ctx.attempt)
        crash_point("after_attempt_started")

    def _observed(self, ctx: CallContext, result: Outcome) -> Outcome:
        """The outcome, recorded -- unless this attempt was superseded meanwhile.

        The append is fenced by the attempt number (executor/reconcile_fence.py):
        a late attempt never overwrites what resume or a person decided; it is
        told so (AttemptSuperseded) and its view is kept as evidence.
        """
        record = result.to_dict()
        try:
            self.ledger.append(ctx.case_id, "observed", {
                "outcome": record,
                "state": {"outcome": result.status, "outcome_record": record},
            }, intent_id=ctx.intent_id, attempt=ctx.attempt)
        except AttemptSuperseded as late:
            from executor.reconcile_fence import record_stale

            record_stale(self.ledger, ctx, result, late)
        from executor.claims import release_after_observed  # --- impact claims

        release_after_observed(self, ctx)  # --- end impact claims
        crash_point("after_observed")
        return result

    # --- shapes --------------------------------------------------------------

    def _connect(self, connector: Connector, ctx: CallContext | None = None) -> sa.Connection:
        from executor.budget import connect  # --- session budgets (executor/budget.py)

        try:
            return connect(self, connector, ctx)  # --- end session budgets
        except sa.exc.TimeoutError:
            raise BudgetExhausted(
                f"connector {connector.name!r} has no free session within its budget of "
                f"{connector.config.session_budget}", connector=connector.name,
                budget=connector.config.session_budget) from None
        except sa.exc.DBAPIError as exc:  # refused before any statement was sent
            raise connector.unavailable(exc) from None

    @contextlib.contextmanager
    def _open_write(self, ctx: CallContext) -> Iterator[tuple[sa.Connection, TxIdentity]]:
        """A labelled write transaction; a pooled connection found dead is replaced once."""
        dialect = ctx.connector.dialect
        for attempt in (1, 2):
            conn = self._connect(ctx.connector, ctx)
            try:
                identity = dialect.begin_write(conn, ctx.tag, ctx.row.timeout.seconds,
                                               ctx.row.timeout.lock_seconds,
                                               self._marker_row(ctx))
            except sa.exc.DBAPIError as exc:
                conn.close()
                if not exc.connection_invalidated:
                    raise  # e.g. the marker's key already landed: the caller reports it
                if attempt == 1:
                    continue  # nothing was sent but the opening query: safe to reopen
                raise ConnectorUnavailable(
                    f"connector {ctx.connector.name!r} could not open a transaction: "
                    f"{str(exc.orig).splitlines()[0] if exc.orig else exc}",
                    connector=ctx.connector.name) from None
            try:
                yield conn, identity
            except BaseException:
                # the session may be gone (terminated by resume, the server's lease
                # timeout): its rollback failing must not hide what went wrong here
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.rollback()
                raise
            finally:
                dialect.end_deadline(conn)
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.close()
            return

    def _read(self, ctx: CallContext) -> Outcome:
        row = ctx.row
        dialect = ctx.connector.dialect
        cap = row.max_rows or 1000
        evidence: dict[str, Any] = {"statements": []}
        reason: dict[str, Any] | None = None
        conn = self._connect(ctx.connector, ctx)  # unreachable: ConnectorUnavailable, nothing
        if not ctx.rehearse:                      # recorded and nothing left open
            try:
                self._prepared(ctx)
            except BaseException:
                conn.close()
                raise
        with conn:
            try:
                dialect.begin_read(conn, ctx.tag, row.timeout.seconds)
                for i, st in enumerate(row.statements):
                    cursor = conn.execute(sa.text(dialect.sql(st.sql, ctx.tag)),
                                          binds_for(st.sql, ctx.inputs))
                    columns = list(cursor.keys())
                    fetched = cursor.fetchmany(cap + 1)
                    truncated = len(fetched) > cap
                    rows = [jsonable(list(r)) for r in fetched[:cap]]
                    evidence["statements"].append({"columns": columns, "rows": rows,
                                                   "count": len(rows), "truncated": truncated})
                    if st.expect_rows is not None and not truncated and \
                            not st.expect_rows.matches(len(rows)):
                        reason = {"kind": "count", "statement": i, "name": st.name,
                                  "expected": st.expect_rows.to_value(), "actual": len(rows)}
                        break
            except sa.exc.DBAPIError as exc:
                reason = self._db_error_reason(ctx, exc, "statement")
            finally:
                conn.rollback()
                dialect.end_read(conn)
        if len(evidence["statements"]) == 1:
            evidence = evidence["statements"][0]
        status = oc.READ_OK if reason is None else oc.ROLLED_BACK
        answer = ctx.outcome(status, evidence, reason)
        if not ctx.rehearse:
            # the ledger keeps what was read (counts and a digest), not the rows themselves
            summary = {k: v for k, v in evidence.items() if k not in ("rows", "statements")}
            summary["rows_digest"] = canonical_hash(jsonable(evidence))
            self._observed(ctx, Outcome(**{**answer.__dict__, "evidence": summary}))
        return answer

    def _db_error_reason(self, ctx: CallContext, exc: sa.exc.DBAPIError,
                         where: str) -> dict[str, Any]:
        dialect = ctx.connector.dialect
        message = cut(str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc), 500)
        if dialect.is_timeout(exc):
            return {"kind": "timeout", "where": where, "message": message,
                    "timeout_seconds": ctx.row.timeout.seconds,
                    "on_timeout": str(ctx.row.timeout.on_timeout)}
        if dialect.is_read_only_violation(exc):
            return {"kind": "read_only_violation", "where": where, "message": message}
        if dialect.is_undefined_table(exc) and any(t in message for t in TARGET_TABLES):
            ctx.connector.forget_target()
            return {"kind": "target_not_installed", "where": where, "message": message,
                    "fix": f"capgate target install {ctx.connector.name}"}
        return {"kind": "database_error", "where": where, "message": message,
                "connection_lost": bool(exc.connection_invalidated)}

    def _collapsed(self, ctx: CallContext) -> Outcome:
        connector = ctx.connector
        connector.check_target()
        if not ctx.rehearse:
            self._prepared(ctx)
        ctx, result = self.attempts(ctx, lambda c: self.run_transaction(
            c, lambda conn, ev: self._statements(c, conn, ev)))
        if ctx.rehearse:
            return result
        self._observed(ctx, result)
        if result.status == oc.APPLIED and ctx.row.post_commit:
            return self._post_commit(ctx, result)
        return result

    def attempts(self, ctx: CallContext, run: Callable[[CallContext], Outcome]
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
            if ctx.rehearse or (action := self._timeout_contract(ctx, result)) is None:
                return ctx, result
            if action == "retry":
                ctx = dataclasses.replace(ctx, attempt=ctx.attempt + 1, resumed=True)
                continue
            return ctx, Outcome(**{**result.__dict__, "reason": {
                **(result.reason or {}), "contract": {"action": action,
                                                      "on_timeout": str(ctx.row.timeout.on_timeout),
                                                      "recovery": str(ctx.row.recovery)}}})

    def _timeout_contract(self, ctx: CallContext, result: Outcome) -> str | None:
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
        if action == "retry":
            self.ledger.append(ctx.case_id, "retrying", {"state": {
                "retry_attempt": ctx.attempt + 1, "classification": "not_applied",
                "rule": "timeout contract: rolled back, retryable, safe to repeat",
                "contract": contract}}, intent_id=ctx.intent_id, attempt=ctx.attempt)
        elif action == "reconcile":
            self.ledger.append(ctx.case_id, "reconciliation_task", {"state": {
                "contract": contract}}, intent_id=ctx.intent_id, attempt=ctx.attempt)
            raise ReconciliationRequired(
                f"{row.ref} timed out ({contract['cause']}); its contract (on_timeout: "
                f"unknown) makes the outcome a reconciliation task: run `capgate resume "
                f"{ctx.case_id}` to establish what landed before more work in the case",
                case=ctx.case_id, intent_id=ctx.intent_id, contract=contract)
        return action

    def run_transaction(self, ctx: CallContext,
                        body: Callable[[sa.Connection, dict[str, Any]], None]) -> Outcome:
        """Open, label, run ``body``, add the marker, COMMIT; or ROLLBACK with the reason."""
        connector = ctx.connector
        dialect = connector.dialect
        evidence: dict[str, Any] = {}
        from executor import claims  # --- impact claims: a write reached without call()

        claims.ensure_claimed(self, ctx)  # --- end impact claims
        with contextlib.ExitStack() as stack:
            try:
                conn, identity = stack.enter_context(self._open_write(ctx))
            except ConnectorUnavailable as exc:
                return ctx.outcome(oc.ROLLED_BACK, evidence, {
                    "kind": "connection_failed", "where": "connect",
                    "message": exc.message, "statements_sent": 0,
                    "note": "the connection failed before any statement was sent: "
                            "nothing of this call can have landed"})
            except sa.exc.DBAPIError as exc:
                if ctx.idem_key is not None and dialect.is_unique_violation(exc):
                    return self._landed_before(ctx, evidence)
                return ctx.outcome(oc.ROLLED_BACK, evidence,
                                   self._db_error_reason(ctx, exc, "begin"))
            try:
                if not ctx.rehearse:
                    self._attempt_started(ctx, identity)
                body(conn, evidence)
                if not ctx.rehearse:
                    claims.fence(self, ctx, conn)  # --- impact claims: the fence before COMMIT
            except Rollback as rb:
                try:  # --- lease (executor/lease.py): the server may have ended the session
                    conn.rollback()
                    dialect.reset_session(conn)
                except sa.exc.DBAPIError:
                    pass  # the session is gone; COMMIT was never sent, nothing landed
                return ctx.outcome(oc.ROLLED_BACK, evidence, rb.reason)
            except sa.exc.DBAPIError as exc:
                reason = self._db_error_reason(ctx, exc, "statement")
                try:
                    conn.rollback()
                    dialect.reset_session(conn)
                except sa.exc.DBAPIError:
                    pass  # the connection is gone; COMMIT was never sent, nothing landed
                return ctx.outcome(oc.ROLLED_BACK, evidence, reason)
            if ctx.rehearse:
                conn.rollback()
                dialect.reset_session(conn)
                return ctx.outcome(oc.APPLIED, evidence, {"kind": "rehearsal_rolled_back"})
            crash_point("before_commit")
            try:
                conn.commit()
            except sa.exc.DBAPIError as exc:
                if exc.connection_invalidated:
                    try:
                        self.ledger.append(ctx.case_id, "commit_uncertain", {
                            "state": {"error": str(exc.orig).splitlines()[0]
                                      if exc.orig else ""},
                        }, intent_id=ctx.intent_id, attempt=ctx.attempt)
                    except AttemptSuperseded as late:
                        from executor.reconcile_fence import record_stale

                        record_stale(self.ledger, ctx, "commit_uncertain", late)
                    raise OutcomeUnknown(
                        f"the connection was lost around COMMIT of intent {ctx.intent_id}; "
                        f"run `capgate resume {ctx.case_id}` to establish what landed",
                        case=ctx.case_id, intent_id=ctx.intent_id) from None
                reason = self._db_error_reason(ctx, exc, "commit")
                return ctx.outcome(oc.ROLLED_BACK, evidence, reason)
            crash_point("after_commit")
            try:
                dialect.reset_session(conn)
            except sa.exc.DBAPIError:
                conn.invalidate()
        return ctx.outcome(oc.APPLIED, evidence)

    def _landed_before(self, ctx: CallContext, evidence: dict[str, Any]) -> Outcome:
        """The marker's key is taken in the target: evidence that the key already landed.

        The same request landed under another intent (a second ledger on one
        target, a restored ledger): ``already_applied``, with that marker as
        evidence -- never ``rolled_back`` for an effect that is there.  A
        different request under the key: nothing of ours was sent, so
        ``rolled_back`` with the conflicting marker.
        """
        dialect = ctx.connector.dialect
        with self._connect(ctx.connector, ctx) as conn:
            try:
                found = conn.execute(sa.text(dialect.sql(_MARKER_BY_KEY, ctx.tag)),
                                     {"k": ctx.idem_key}).mappings().first()
            finally:
                conn.rollback()
        marker = {k: jsonable(v) for k, v in found.items()} if found is not None else None
        evidence = {**evidence, "landing_marker": marker}
        if marker is not None and marker["fingerprint"] == ctx.fingerprint:
            return ctx.outcome(oc.ALREADY_APPLIED, evidence, {
                "kind": "already_landed", "by_intent": marker["intent_id"],
                "by_case": marker["case_id"],
                "message": "this request's idempotency key already landed in the target; "
                           "nothing was executed now"})
        return ctx.outcome(oc.ROLLED_BACK, evidence, {
            "kind": "idempotency_conflict", "where": "begin",
            "by_intent": marker["intent_id"] if marker else None,
            "message": "the idempotency key landed in the target for a different request; "
                       "nothing of this call was sent"})

    def _statements(self, ctx: CallContext, conn: sa.Connection,
                    evidence: dict[str, Any]) -> None:
        """Statements with expected counts, then verify and replay, in the open transaction."""
        dialect = ctx.connector.dialect
        counts: list[int] = []
        evidence["counts"] = counts
        for i, st in enumerate(ctx.row.statements):
            n = conn.execute(sa.text(dialect.sql(st.sql, ctx.tag)),
                             binds_for(st.sql, ctx.inputs)).rowcount
            counts.append(n)
            if st.expect_rows is not None and not st.expect_rows.matches(n):
                raise Rollback({"kind": "count", "statement": i, "name": st.name,
                                 "sql": st.sql, "expected": st.expect_rows.to_value(),
                                 "actual": n})
        self.verify_and_replay(ctx, conn, evidence)

    def verify_and_replay(self, ctx: CallContext, conn: sa.Connection,
                          evidence: dict[str, Any]) -> None:
        """Same-session checks before COMMIT: what other sessions cannot see yet."""
        dialect = ctx.connector.dialect
        results: list[dict[str, Any]] = []
        evidence["verify"] = results
        for check in ctx.row.verify:
            rows = conn.execute(sa.text(dialect.sql(check.sql, ctx.tag)),
                                binds_for(check.sql, ctx.inputs)).fetchmany(1001)
            result = evaluate(check.name, check.expect, rows)
            results.append(result.to_dict())
            if not result.ok:
                raise Rollback({"kind": "verify", "check": check.name, "sql": check.sql,
                                 "expected": result.expected, "actual": result.actual})
        replay = ctx.row.replay
        if replay is not None:
            cap = replay.max_rows or 100
            res = conn.execute(sa.text(dialect.sql(replay.sql, ctx.tag)),
                               binds_for(replay.sql, ctx.inputs))
            columns = list(res.keys())
            rows = res.fetchmany(cap)
            evidence["replay"] = {"columns": columns, "rows": jsonable([list(r) for r in rows])}
            if replay.expect is not None:
                result = evaluate("replay", replay.expect, rows)
                if not result.ok:
                    raise Rollback({"kind": "replay", "sql": replay.sql,
                                     "expected": result.expected, "actual": result.actual})

    def _marker_row(self, ctx: CallContext) -> dict[str, Any] | None:
        """The landing marker, written in the same transaction as the data."""
        if ctx.idem_key is None:
            return None
        return {"intent_id": ctx.intent_id, "idem_key": ctx.idem_key,
                "fingerprint": ctx.fingerprint, "attempt": ctx.attempt,
                "case_id": ctx.case_id, "operation_id": ctx.row.operation_id,
                "landed_at": self.clock().isoformat()}

    # --- after commit --------------------------------------------------------

    def _post_commit(self, ctx: CallContext, applied: Outcome) -> Outcome:
        try:
            results = self.run_checks(ctx, ctx.row.post_commit)
        except ConnectorUnavailable as exc:
            # the write committed; only its after-the-fact checks could not run: say so,
            # never a refusal (exit 1) for an effect that landed
            unchecked = {"unchecked": exc.message}
            self.ledger.append(ctx.case_id, "post_commit_unchecked", {
                "intent_id": ctx.intent_id, "error": exc.message}, intent_id=None)
            return Outcome(**{**applied.__dict__,
                              "evidence": {**applied.evidence, "post_commit": unchecked}})
        failed = [r for r in results if not r.ok]
        evidence = {**applied.evidence, "post_commit": [r.to_dict() for r in results]}
        if not failed:
            self.ledger.append(ctx.case_id, "post_commit_checked", {
                "checks": [r.to_dict() for r in results]}, intent_id=None)
            return Outcome(**{**applied.__dict__, "evidence": evidence})
        from executor.compensate import compensate

        return compensate(self, ctx, applied, failed, evidence)

    def run_checks(self, ctx: CallContext, checks: Any) -> list[CheckResult]:
        """Run checks in their own read-only transaction (after commit)."""
        dialect = ctx.connector.dialect
        out: list[CheckResult] = []
        with self._connect(ctx.connector, ctx) as conn:
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
