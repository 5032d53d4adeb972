"""The executor: plan, approve and call declared operations -- wiring only.

A call passes these boundaries, each durable in the ledger before the next:

    resolve row - validate input - authorize (grant; approval bound to the plan hash)
    - idempotency (a recorded or running execution answers) - continuation check
    - ledger: prepared (+ idempotency key, approval, impact keys) - open transaction
    - ledger: attempt_started (with the transaction's identity)
    - statements (expected counts) - verify - replay - landing marker - COMMIT | ROLLBACK
    - ledger: observed (outcome + evidence) - post-commit checks (- compensation)

The path runs one way and this module only wires it: the shapes
(:mod:`executor.shapes`, :mod:`executor.lease`) run the transaction
(:mod:`executor.transaction`) between the ledger boundaries
(:mod:`executor.boundaries`), on the :class:`~executor.runtime.Runtime` the
executor owns; impact claims and session budgets are hooks
(:mod:`executor.hooks`) the executor owns too.  No model call, human gate or
agent hop happens between opening the transaction and COMMIT.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from capgate.executor import boundaries, gates, promotion, shapes
from capgate.executor.approvals import SigningKey
from capgate.executor.budget import SessionBudgets
from capgate.executor.claims import ImpactClaims
from capgate.executor.connectors import Connector, Connectors
from capgate.executor.context import (
    CRASH_POINTS,
    TERMINAL,
    CallContext,
    check_names,
    crash_point,
    now_utc,
    validate_input,
    validated_inputs,
)
from capgate.executor.gaps import record_gap
from capgate.executor.grants import Grants
from capgate.executor.hooks import CallHooks, HookSet
from capgate.executor.lease import run_leased
from capgate.executor.ledger import ApprovalRecord, IdempotencyRecord, KeyAlreadyClaimed, Ledger
from capgate.executor.outcome import Outcome
from capgate.executor.plan import Plan, fingerprint, idempotency_key, needs_approval, render
from capgate.executor.returned import ReturnedKeys
from capgate.executor.runtime import (
    APPROVAL_TTL_MAX_SECONDS,
    MAX_REQUEST_BYTES,
    UNLOCKED_ENVIRONMENTS,
    Runtime,
)
from capgate.executor.simulation.records import IDEM_MARK as SIMULATION_MARK
from capgate.executor.sources import LiveSources
from capgate.executor.steps import registered_name, require
from capgate.executor.symptoms import SymptomWatch
from capgate.registry.errors import (
    ApprovalMismatch,
    BudgetExhausted,
    CallerKeyRefused,
    CapgateError,
    CaseConflict,
    DdlError,
    EnvironmentNotAllowed,
    IdempotencyConflict,
    InputInvalid,
    LedgerError,
    ReconciliationRequired,
    RequestInFlight,
    UnknownOperation,
    UnknownVersion,
    UsageError,
)
from capgate.registry.model import AuthKind, EffectClass, Row, Shape
from capgate.registry.registry import Registry

__all__ = ["AWAIT_OWNER_MARGIN_SECONDS", "CRASH_POINTS", "TERMINAL", "Executor",
           "crash_point", "standard_hooks", "validate_input"]

AWAIT_OWNER_MARGIN_SECONDS = 10.0
"""An identical call waits for the owning execution this long past the row's timeout."""


def standard_hooks(ledger: Ledger) -> list[CallHooks]:
    """The hooks every executor has unless told otherwise: session budgets, the symptom
    re-read (issue 17; before the claims, so its read before COMMIT precedes the fence),
    impact claims, and the keys statements return (recorded before COMMIT, issue 16)."""
    return [SessionBudgets(ledger), SymptomWatch(ledger), ImpactClaims(ledger),
            ReturnedKeys(ledger)]


class Executor:
    """Runs declared operations against configured connectors, recording everything."""

    def __init__(self, registry: Registry, connectors: Connectors, ledger: Ledger,
                 grants: Grants, *, clock: Callable[[], dt.datetime] = now_utc,
                 max_request_bytes: int = MAX_REQUEST_BYTES,
                 hooks: Sequence[CallHooks] | None = None,
                 unlocked_environments: Iterable[str] = UNLOCKED_ENVIRONMENTS,
                 sources: LiveSources | None = None,
                 approval_ttl_max_seconds: int = APPROVAL_TTL_MAX_SECONDS):
        self.rt = Runtime(registry, connectors, ledger, grants,
                          HookSet(standard_hooks(ledger) if hooks is None else hooks),
                          clock, max_request_bytes, frozenset(unlocked_environments), sources,
                          approval_ttl_max_seconds)
        self.rt.hooks.attach(self.rt)
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    # --- the parts (the runtime's) -------------------------------------------

    @property
    def registry(self) -> Registry:
        return self.rt.registry

    @registry.setter
    def registry(self, value: Registry) -> None:
        self.rt.registry = value

    @property
    def connectors(self) -> Connectors:
        return self.rt.connectors

    @property
    def ledger(self) -> Ledger:
        return self.rt.ledger

    @property
    def grants(self) -> Grants:
        return self.rt.grants

    @grants.setter
    def grants(self, value: Grants) -> None:
        self.rt.grants = value

    @property
    def clock(self) -> Callable[[], dt.datetime]:
        return self.rt.clock

    @clock.setter
    def clock(self, value: Callable[[], dt.datetime]) -> None:
        self.rt.clock = value

    @property
    def max_request_bytes(self) -> int:
        """Largest request (canonical JSON bytes of the inputs) a call accepts."""
        return self.rt.max_request_bytes

    @max_request_bytes.setter
    def max_request_bytes(self, value: int) -> None:
        self.rt.max_request_bytes = value

    @property
    def hooks(self) -> HookSet:
        return self.rt.hooks

    def refresh(self) -> bool:
        """Re-read the grants, capability files and lock if they changed (a stat each).

        Every call, plan and approval does this first; a server calls it to notice
        a change between calls.  True when anything was swapped (see
        :mod:`executor.sources`).
        """
        return self.rt.refresh()

    @property
    def generation(self) -> int:
        """Grows each time a reload swapped the grants or the registry."""
        return self.rt.sources.generation if self.rt.sources is not None else 0

    def close(self) -> None:
        """Release the connectors' and the ledger's connections."""
        self.connectors.dispose()
        self.ledger.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- resolution, plans and approvals -------------------------------------

    def resolve(self, operation_id: str, version: int | None = None,
                venue: str | None = None, *, pinned: bool = True) -> tuple[Row, Connector]:
        """The row and its connector; the row reaches only its own connector's database.

        Outside the unlocked environments the row must be pinned by the lock
        (``pinned=False``: a rehearsal, which commits nothing).
        """
        return self.rt.resolve(operation_id, version, venue, pinned=pinned)

    def plan(self, operation_id: str, inputs: Mapping[str, Any], *, case: str, who: str,
             version: int | None = None, record: bool = True,
             venue: str | None = None) -> Plan:
        """Render the plan (no DML); record it so an approver can find it by hash.

        On a promotion venue the plan carries the case's simulation evidence (or
        the exemption test), so that the approver sees it (issue 16).  A recorded
        plan of a write is the case's first claim on its target (issue 17,
        case-held claims): another case's hold refuses it with a coordination
        decision, before it is recorded.
        """
        check_names(case, who)
        row, connector = self._resolve_or_gap(operation_id, version, case, who, inputs,
                                              venue)
        inputs, _ = validated_inputs(row, inputs, self.max_request_bytes)
        self.grants.check_call(who, row, connector.name, connector.environment)
        plan = gates.with_promotion(self.rt, render(
            row, inputs, connector.name, connector.environment, case=case, requester=who),
            row, inputs, connector, case)
        if record:
            self._record_plan(plan, CallContext(row, dict(inputs), case, who, connector,
                                                "plan-" + plan.plan_hash[-16:], None, "",
                                                plan))
        return plan

    def _record_plan(self, plan: Plan, ctx: CallContext) -> None:
        """The plan in its case (a ``plan_recorded`` event, with the case-held claim it
        starts, in one transaction), then under its hash for the approver."""
        body = plan.to_dict()
        entry = {"plan_hash": plan.plan_hash, "operation_id": ctx.row.operation_id,
                 "version": ctx.row.version, "requester": ctx.who,
                 "connector": ctx.connector.name, "environment": ctx.connector.environment,
                 "impact_keys": list(body.get("impact_keys") or []),
                 "gated": needs_approval(body)}
        try:
            self.ledger.append(ctx.case_id, "plan_recorded",
                               {"plan": entry, "case_state": {f"plan:{plan.plan_hash}": entry}},
                               within=lambda tx: self.hooks.within_planned(ctx, tx))
        except CapgateError as refused:
            self.hooks.plan_refused(ctx, refused)
            raise
        self.ledger.record_plan(plan.plan_hash, ctx.case_id, ctx.who, body)

    def _resolve_or_gap(self, operation_id: str, version: int | None, case: str, who: str,
                        inputs: Mapping[str, Any], venue: str | None = None, *,
                        pinned: bool = True) -> tuple[Row, Connector]:
        """The row, or the refusal -- recorded as a capability gap when no row answers."""
        try:
            return self.resolve(operation_id, version, venue, pinned=pinned)
        except (UnknownOperation, UnknownVersion, EnvironmentNotAllowed) as gap:
            record_gap(self.ledger, case=case, who=who, operation_id=operation_id,
                       version=version, refusal=gap, inputs=inputs)
            raise

    def approve(self, plan_hash: str, *, by: str, role: str, key: SigningKey,
                ttl_seconds: int | None = None) -> dict[str, Any]:
        """Record a single-use, expiring approval of a recorded plan, signed by ``by``'s key."""
        self.rt.refresh()
        return gates.approve(self.rt, plan_hash, by=by, role=role, key=key,
                             ttl_seconds=ttl_seconds)

    def approval_problem(self, approval: ApprovalRecord, row: Row) -> str | None:
        """Why ``approval`` cannot be used for ``row`` now (None: it can): signature, role."""
        return gates.approval_problem(self.rt, approval, row)

    def recheck_approval(self, ctx: CallContext) -> None:
        """A resumed retry relies on the approval its intent consumed: is it still good?"""
        gates.recheck_approval(self.rt, ctx)

    # --- the call ------------------------------------------------------------
    def call(self, operation_id: str, inputs: Mapping[str, Any], *, case: str, who: str,
             version: int | None = None, key: str | None = None, task: str | None = None,
             plan_hash: str | None = None, rehearse: bool = False,
             venue: str | None = None, simulation: str | None = None) -> Outcome:
        """Run one declared operation; answer with an outcome and its evidence.

        ``venue``: the environment of the connector's instance to run on, when
        one configuration names several (issue 16); None: the connector's own.
        ``simulation``: the simulation cycle's execute step (its own idempotency
        key, never the promotion's; admitted only for a simulation recorded in
        the case, see :mod:`executor.promotion`).
        """
        check_names(case, who, task)
        row, connector = self._resolve_or_gap(operation_id, version, case, who, inputs,
                                              venue, pinned=not rehearse)
        inputs, inputs_text = validated_inputs(row, inputs, self.max_request_bytes)
        self.grants.check_call(who, row, connector.name, connector.environment)
        plan = render(row, inputs, connector.name, connector.environment, case=case,
                      requester=who, inputs_text=inputs_text)
        if plan_hash is not None and plan_hash != plan.plan_hash:
            raise ApprovalMismatch(
                f"the approved plan {plan_hash} is not this call's plan {plan.plan_hash}",
                approved=plan_hash, actual=plan.plan_hash)
        if row.effect_class is EffectClass.DDL:
            raise DdlError(
                f"{row.ref} changes stored code: it runs through the DDL loop "
                f"(`capgate ddl plan` / `capgate ddl apply`), never as a plain call",
                operation_id=row.operation_id, version=row.version)
        fp = fingerprint(row, inputs, connector.name, connector.environment,
                         inputs_text=inputs_text)
        idem = self._key_for(row, inputs, case, key)
        if simulation is not None and idem is not None:  # issue 16: the simulation's own key
            idem = f"{idem}{SIMULATION_MARK}{simulation}"
        if rehearse:
            self._check_case(case, task)  # a rehearsal prepares nothing: check the case here
        elif idem is not None:
            # An execution that owns the key answers first, from the ledger alone: a replay
            # needs no target (reachable or not), sends it nothing -- not the opening batch
            # whose marker the target would refuse -- and for a gated row checks no gate
            # (its plan and approval may be another case's).  A key claimed after this read
            # is still caught, atomically, by `prepared`.
            owner = self.ledger.key_owner(idem)
            if owner is not None:
                return self._follow_owner(owner, row, fp, idem, case)
        ctx = CallContext(row, inputs, case, who, connector, uuid.uuid4().hex, idem, fp, plan,
                          rehearse=rehearse, task=task)
        # The `prepared` transaction is where everything is decided, all or nothing: the
        # idempotency key (an execution that owns it answers for us -- a replay, or a
        # wait for the identical call in flight), the case (no open intent, the same
        # task), the approval, the impact keys and the session's budget slot.  A refusal
        # there records nothing and sends nothing of the row.
        error: BaseException | None = None
        lost: IdempotencyRecord | None = None
        flight = contextlib.ExitStack()
        recorded = flight.enter_context(boundaries.recording())
        try:
            flight.enter_context(self._flying(None if rehearse else idem))
            promotion.check(self.rt, ctx)  # issue 16: a promotion needs simulation evidence
            self.hooks.before_prepared(ctx)
            if row.authorization.kind is AuthKind.GATE and not rehearse:
                gates.check_approval(self.rt, ctx)
            if row.effect_class is EffectClass.READ:
                return shapes.read(self.rt, ctx)
            if row.shape is Shape.LEASED:
                return run_leased(self.rt, ctx)
            return shapes.collapsed(self.rt, ctx)
        except KeyAlreadyClaimed as race:
            lost = race.record  # an identical call prepared first: nothing of ours was sent
        except BudgetExhausted as exc:
            # identical calls arriving together (an MCP server's threads): the one that got
            # a session runs the request, and this one waits for it instead of being refused
            lost = self._owner_soon(idem, ctx) if idem is not None and not rehearse else None
            if lost is None:
                error = exc
                raise
        except LedgerError as exc:
            if ctx.intent_id not in recorded:
                error = exc
                raise  # nothing of the call was recorded: the ledger's own refusal
            # the intent is open and the call cannot finish recording it: an unknown
            # outcome that says what to run (never exit 2, "usage or configuration")
            error = boundaries.ledger_unreachable(self.rt, ctx, exc, recorded=True)
            raise error from exc
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.hooks.after_call(ctx, error)
            flight.close()
        return self._follow_owner(lost, row, fp, idem or lost.idem_key, case)

    def lease(self, operation_id: str, inputs: Mapping[str, Any], *, case: str, who: str,
              steps: Sequence[str | Callable[..., Any]] | None = None,
              version: int | None = None, key: str | None = None,
              task: str | None = None, plan_hash: str | None = None) -> Outcome:
        """Run a leased row: its declared steps, under its deadline, then COMMIT or ROLLBACK.

        ``steps`` names the registered step functions the caller expects the row
        to run, as names or as the registered function objects themselves.  Each
        must be registered (else UnregisteredStep, before anything is recorded)
        and together they must be the row's ``function`` steps in order (else
        UsageError): what runs inside a lease is always the reviewed row, never
        code handed in by the caller.
        """
        row, _ = self._resolve_or_gap(operation_id, version, case, who, inputs)
        if row.shape is not Shape.LEASED:
            raise UsageError(f"{row.ref} is not a leased row (shape {row.shape}); use call()")
        declared = [s.function for s in row.steps if s.function is not None]
        for name in declared:
            require(name)
        if steps is not None:
            offered = [registered_name(s) for s in steps]
            if offered != declared:
                raise UsageError(f"{row.ref} runs the step functions {declared}, not "
                                 f"{offered}; a lease runs exactly the reviewed row's steps",
                                 declared=declared, offered=offered)
        return self.call(operation_id, inputs, case=case, who=who, version=version, key=key,
                         task=task, plan_hash=plan_hash)

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
        if not caller_key or len(caller_key) > 200 or "|" in caller_key:
            # "|" separates the key's parts: a caller key could otherwise pose as one
            # (say, the mark of a simulation's execute step)
            raise InputInvalid("a caller key must be 1 to 200 characters, without '|'",
                               field="key")
        return f"{reviewed}|caller:{caller_key}"

    def _owner_soon(self, idem: str, ctx: CallContext) -> IdempotencyRecord | None:
        """The owner of ``idem``, waiting while an identical call may be about to prepare.

        Such a call is one of this process running the same key, or any call of
        the same case holding a session (another process).  Without one (or
        once they ended without preparing) the answer is None at once: the
        caller's own refusal stands.
        """
        budgets = self.hooks.find(SessionBudgets)
        deadline = time.monotonic() + float(ctx.row.timeout.seconds)
        while True:
            with self._lock:  # before the read: an identical call that ends after this
                others = self._in_flight.get(idem, 0) > 1  # has prepared before the read
            others = others or (budgets is not None
                                and budgets.holds_session(ctx.connector, ctx.case_id))
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
            mine = owner.case_id == case  # another case's ids are not the caller's to see
            raise IdempotencyConflict(
                f"idempotency key {idem!r} was used for a different request "
                + (f"(intent {owner.intent_id} in this case)" if mine else "in another case"),
                key=idem, **({"intent_id": owner.intent_id, "case": owner.case_id} if mine
                             else {}))
        wait = float(row.timeout.seconds) + AWAIT_OWNER_MARGIN_SECONDS
        deadline = time.monotonic() + wait
        pause = 0.005
        while True:
            state = self.ledger.intent(owner.case_id, owner.intent_id)
            record = state.get("outcome_record")
            if state.get("status") in TERMINAL and isinstance(record, dict):
                return Outcome.from_dict(record, replayed=True)
            if owner.case_id != case:  # another case's request, still running: not ours
                raise IdempotencyConflict(
                    f"idempotency key {idem!r} is held by another case's request, still "
                    "running", key=idem)
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
