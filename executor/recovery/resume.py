"""Resume: after a fault, say from evidence what landed, then continue or escalate.

A case whose last boundary is disputed has no authority to continue:
``Executor.call`` refuses it (``ReconciliationRequired``) until ``resume`` has
settled every in-flight intent.  Resume, per case:

1. loads the case *verified* (hash chain, head, snapshot) -- it never acts on
   a record someone edited -- and refuses a task id reused for another task;
2. classifies each in-flight intent as ``applied``, ``not_applied``,
   ``partly_applied`` or ``unknown`` from the target's evidence, strongest
   first (:mod:`executor.recovery.evidence`, batched per connector);
3. records the facts: ``applied`` becomes ``reconciled`` with a synthesised
   outcome record (so an idempotent replay returns it, and nothing runs
   twice); ``not_applied`` under ``never_retry`` becomes ``reconciled`` as not
   applied; ``partly_applied`` and ``unknown`` become ``escalated`` with their
   evidence -- the case stays open, nothing is retried;
4. re-runs the verify checks of the completed steps later work depends on
   (:mod:`executor.recovery.poison`); a target that changed under the case is
   recorded as ``changed_outside_case`` and resume stops there;
5. retries ``not_applied`` intents whose row is ``retryable`` or
   ``reconcile_first`` as the same intent, same idempotency key, attempt
   n+1, through the executor's normal path.  The landing marker's primary key
   (the intent id) and unique idempotency key make a duplicate impossible
   even if two resumes raced.

Every decision is a ledger event carrying its evidence, so an operator can
read why a case did or did not continue.  Finally (issue 17) resume records,
per case, the *recovery point* -- the latest eligible (applied and verified)
step, not merely the latest recorded one (:mod:`executor.recovery.eligibility`)
-- and a ``continuation`` event that grants or withholds continuation and says
why.  A case held by a changed symptom stays held: that is a person's to
decide (``capgate case accept|reopen``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from capgate.executor import gates, shapes, symptoms
from capgate.executor import outcome as oc
from capgate.executor.call import Executor
from capgate.executor.compensate import finish_compensation, record_final, run_compensation
from capgate.executor.context import TERMINAL, CallContext
from capgate.executor.coordination import CONTINUATION
from capgate.executor.ledger import VerifiedCase, intent_states, is_open_status
from capgate.executor.outcome import Outcome
from capgate.executor.plan import fingerprint, render
from capgate.executor.recovery.eligibility import RecoveryPoint, assess
from capgate.executor.recovery.evidence import Facts, Pending, classify, gather
from capgate.executor.recovery.load import load_verified_many, read_snapshots
from capgate.executor.recovery.poison import Dependency, Recheck, dependencies, recheck
from capgate.registry.errors import (
    CapgateError,
    CaseConflict,
    IdempotencyConflict,
    LedgerError,
    UnknownIntent,
    UsageError,
)
from capgate.registry.model import Recovery, Row, Shape
from capgate.registry.vocabulary import Classification, RollbackReason

__all__ = [
    "Classification",
    "IntentReport",
    "ResumeReport",
    "resolve_escalation",
    "resume",
    "resume_many",
]

RESUME_EVENTS = ("reconciled", "retrying", "escalated", "changed_outside_case",
                 "escalation_resolved", "recovery_point", "continuation")
"""The ledger event kinds resume writes (``reconciled`` and ``escalation_resolved`` close)."""


@dataclass(frozen=True)
class IntentReport:
    """What resume found for one intent and what it did about it."""

    case_id: str
    intent_id: str
    operation_id: str | None
    version: int | None
    status: str
    """The intent's status when resume found it."""
    attempt: int
    classification: str
    evidence: Mapping[str, Any]
    action: str
    """``recorded_applied``, ``retried``, ``closed_not_applied``, ``escalated``,
    ``still_escalated``, ``held``, ``retry_failed``, ``awaiting_person``,
    ``skipped_concurrent`` or ``none`` (dry run)."""
    outcome: str | None = None
    """The intent's recorded outcome after resume, when it has one."""
    detail: str = ""
    resolved: bool = False
    """Whether the intent is closed (terminal) after resume."""

    def to_dict(self) -> dict[str, Any]:
        return {"intent_id": self.intent_id, "classification": self.classification,
                "evidence": dict(self.evidence), "action": self.action,
                "case": self.case_id, "operation_id": self.operation_id,
                "version": self.version, "status_found": self.status, "attempt": self.attempt,
                "outcome": self.outcome, "detail": self.detail, "resolved": self.resolved}


@dataclass(frozen=True)
class ResumeReport:
    """The result of one ``resume``: every in-flight intent, and what changed outside."""

    case_ids: tuple[str, ...]
    intents: tuple[IntentReport, ...]
    changed_outside_case: tuple[dict[str, Any], ...] = ()
    elapsed_seconds: float = 0.0
    acted: bool = True
    recovery: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per case: the recovery point and the continuation decision resume recorded."""

    @property
    def resolved(self) -> bool:
        """True when every intent is closed and no completed step's target changed."""
        return all(i.resolved for i in self.intents) and not self.changed_outside_case

    @property
    def exit_code(self) -> int:
        from capgate.registry.errors import EXIT_OK, EXIT_UNKNOWN

        return EXIT_OK if self.resolved else EXIT_UNKNOWN

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.intents:
            out[i.classification] = out.get(i.classification, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        case: str | list[str] = self.case_ids[0] if len(self.case_ids) == 1 else list(
            self.case_ids)
        return {"case": case, "intents": [i.to_dict() for i in self.intents],
                "changed_outside_case": list(self.changed_outside_case),
                "resolved": self.resolved, "exit_code": self.exit_code,
                "dry_run": not self.acted, "elapsed_seconds": round(self.elapsed_seconds, 4),
                "recovery": {k: dict(v) for k, v in self.recovery.items()}}

    def lines(self) -> list[str]:
        """The report for a person, one intent per paragraph."""
        where = self.case_ids[0] if len(self.case_ids) == 1 else f"{len(self.case_ids)} cases"
        out = [f"resume {where}: {len(self.intents)} in-flight intent(s)"
               + ("" if self.acted else " (dry run: nothing recorded or retried)")]
        for i in self.intents:
            op = f"{i.operation_id}@{i.version}" if i.operation_id else "?"
            case = f" case {i.case_id}," if len(self.case_ids) > 1 else ""
            out.append(f"  intent {i.intent_id}{case} {op}, attempt {i.attempt}, "
                       f"found {i.status}")
            out.append(f"    {i.classification}: {i.evidence.get('rule', '')}")
            brief = summarize(i.evidence)
            if brief:
                out.append(f"    evidence: {brief}")
            out.append(f"    action: {i.action}" + (f" -> {i.outcome}" if i.outcome else "")
                       + (f" ({i.detail})" if i.detail else ""))
        for c in self.changed_outside_case:
            failed = [ch["name"] for ch in c.get("checks", []) if not ch.get("ok")]
            out.append(f"  CHANGED OUTSIDE THE CASE: intent {c['intent_id']} "
                       f"{c['operation_id']}@{c['version']} ({c['impact_key']}): "
                       + (f"check(s) {', '.join(failed)} no longer hold" if failed
                          else f"cannot re-check: {c.get('error')}"))
        for case_id, rec in self.recovery.items():
            point = rec.get("recovery_point") or {}
            chosen = point.get("chosen") or {}
            latest = point.get("latest_recorded") or {}
            cont = rec.get("continuation") or {}
            head = f"  {case_id}: " if len(self.case_ids) > 1 else "  "
            out.append(f"{head}recovery point: "
                       + (f"{chosen.get('operation_id')} intent {chosen.get('step')}"
                          if chosen else "none (no eligible step)")
                       + ("" if point.get("chosen_is_latest") or not latest else
                          f" (latest recorded: {latest.get('operation_id')} intent "
                          f"{latest.get('step')}, not eligible: {latest.get('why')})")
                       + f"; continuation {cont.get('decision')}")
        if self.resolved:
            out.append(f"ok: every intent resolved; {where} may continue")
        else:
            open_ = [i for i in self.intents if not i.resolved]
            out.append(f"NOT RESOLVED: {len(open_)} intent(s) open"
                       + (f", {len(self.changed_outside_case)} target(s) changed outside the case"
                          if self.changed_outside_case else "")
                       + "; the case may not continue (see `capgate ledger show`)")
        return out


def summarize(evidence: Mapping[str, Any]) -> str:
    """One line of the evidence that decided, strongest first."""
    parts: list[str] = []
    marker = evidence.get("marker")
    if marker == "present":
        row = evidence.get("marker_row") or {}
        parts.append(f"marker present (attempt {row.get('attempt')}, "
                     f"landed {row.get('landed_at')})")
    elif marker in ("mismatch", "other_intent", "absent", "not_written"):
        parts.append(f"marker {marker}")
    co = evidence.get("commit_outcome")
    probe_detail = evidence.get("commit_outcome_detail")
    if isinstance(probe_detail, Mapping) and probe_detail.get("probe"):
        xid = f"({probe_detail.get('xid')})" if probe_detail.get("xid") else ""
        parts.append(f"{probe_detail['probe']}{xid} = {co or 'no answer'}")
    identity = evidence.get("server_identity")
    server = evidence.get("server_now")
    if identity in ("same", "changed") and isinstance(server, Mapping):
        what = (f"system {server.get('system_identifier')}, timeline {server.get('timeline')}"
                if "system_identifier" in server else
                f"server_id {server.get('server_id')}, started {server.get('server_started')}")
        parts.append(("same server" if identity == "same" else "server CHANGED")
                     + f" ({what})")
    elif identity == "changed":
        parts.append("server CHANGED")
    opening = evidence.get("opening")
    if isinstance(opening, Mapping):
        ended = opening.get("terminated_session")
        parts.append(f"attempt {opening.get('attempt')} (opening unrecorded): "
                     + (f"ended its live session {ended}; " if ended else "")
                     + str(opening.get("opening") or "cannot tell whether a session is alive"))
    if evidence.get("terminated_session"):
        parts.append(f"terminated the recorded session {evidence['terminated_session']}")
    session = evidence.get("session")
    if isinstance(session, Mapping):
        parts.append(f"connection {session.get('connection_id')} "
                     f"{'alive' if session.get('alive') else 'gone'}")
    if evidence.get("write_lock"):
        parts.append(f"write lock {evidence['write_lock']}")
    if evidence.get("probe"):
        parts.append(f"landed probe: {evidence['probe']}")
    if evidence.get("unreachable"):
        parts.append(f"unreachable: {evidence['unreachable']}")
    return "; ".join(parts)


# --- the entry points -------------------------------------------------------------


def resume(executor: Executor, case_id: str, *, task: str | None = None,
           terminate: bool = True, wait_seconds: float = 5.0, act: bool = True) -> ResumeReport:
    """Classify and settle every in-flight intent of one case.

    ``terminate``: when the recorded session may still commit, terminate
    exactly that session (PostgreSQL pid + backend start, MariaDB connection
    id on the same server incarnation) and ask again; otherwise only wait.
    ``wait_seconds``: how long to wait for such a session to end before the
    intent is left ``unknown`` (never ``not_applied``).  ``act=False`` is a
    dry run: classify and re-check, record and retry nothing.

    Raises LedgerTampered when the case does not verify, UnknownCase for an
    unknown case, CaseConflict when ``task`` is not the task the case was
    opened for.
    """
    return resume_many(executor, [case_id], task=task, terminate=terminate,
                       wait_seconds=wait_seconds, act=act)


def resume_many(executor: Executor, case_ids: Sequence[str] | None = None, *,
                task: str | None = None, terminate: bool = True, wait_seconds: float = 5.0,
                act: bool = True) -> ResumeReport:
    """Resume several cases (default: every open case), evidence batched across them.

    A dry run (``act=False``) writes nothing and kills nothing: ``terminate`` is
    ignored, and no probe that would insert even a rolled-back row is sent.
    """
    started = time.monotonic()
    terminate = terminate and act
    ledger = executor.ledger
    if case_ids is None:
        case_ids = [c.case_id for c in ledger.cases(open_only=True)]
    verified = load_verified_many(ledger, case_ids)
    cases = {case_id: _load(verified[case_id], task) for case_id in case_ids}
    rows = _Rows(executor)
    pending = [p for c in cases.values() for p in c.pending]
    facts = gather(executor, pending, terminate=terminate, wait_seconds=wait_seconds,
                   row_of=rows.of_pending, probe_writes=act) if pending else {}
    if act and pending:
        _free_dead_sessions(executor, [p.intent_id for p in pending])
    fresh = read_snapshots(ledger, [c.case_id for c in cases.values() if c.pending]) \
        if act else {}
    batch = _Batch(executor)
    # a case with one in-flight intent (the usual case) closes it in the batch; with
    # more, its events are appended in order, one by one
    settling = [_record(executor, case, facts, rows, fresh.get(case.case_id), act=act,
                        batch=batch if len(case.pending) == 1 else None)
                for case in cases.values()]
    batch.flush()
    # The poisoned resume: before continuing, re-run the checks of the completed steps
    # later work depends on -- for every case at once, one read-only transaction per
    # connector.
    results = recheck(executor, [d for s in settling for d in s.deps])
    by_case: dict[str, list[Recheck]] = {}
    for result in results:
        by_case.setdefault(result.dependency.case_id, []).append(result)
    reports: list[IntentReport] = []
    changed: list[dict[str, Any]] = []
    recovery: dict[str, dict[str, Any]] = {}
    continued: list[tuple[_Settling, list[IntentReport], list[dict[str, Any]]]] = []
    for s in settling:
        done, found = _continue(executor, s, by_case.get(s.case.case_id, []), rows, act=act)
        reports.extend(done)
        changed.extend(found)
        continued.append((s, done, found))
    if act and continued:
        recovery = _record_recoveries(executor, continued, by_case, rows)
    if act:
        closed = [r.intent_id for r in reports if r.action in ("recorded_applied",
                                                               "closed_not_applied")]
        closed += [i for c in cases.values() for i, s in c.intents.items()
                   if str(s.get("status")) in TERMINAL]
        per_call = {i for c in cases.values() for i, s in c.intents.items()
                    if not _case_held(executor, s)}
        _release_claims(executor, [i for i in closed if i in per_call])
    return ResumeReport(tuple(case_ids), tuple(reports), tuple(changed),
                        time.monotonic() - started, act, recovery)


def _case_held(executor: Executor, state: Mapping[str, Any]) -> bool:
    """Whether the intent's connector holds claims for the case (issue 17): then its keys
    stay with the case after resume, and only ``capgate case close`` gives them back."""
    name = state.get("connector")
    if not name:
        return False
    try:
        return executor.connectors.config(str(name)).case_claim_seconds > 0
    except CapgateError:
        return False


def _record_recoveries(executor: Executor,
                       continued: Sequence[tuple[_Settling, list[IntentReport],
                                                 list[dict[str, Any]]]],
                       by_case: Mapping[str, Sequence[Recheck]],
                       rows: _Rows) -> dict[str, dict[str, Any]]:
    """Each case's recovery point and continuation decision, recorded for all cases at once.

    The intents are read back after everything this resume recorded (one read per 500
    cases), and the two events of each case are appended together, 250 cases to a
    commit (``append_each``).  Best effort, as one case's record always was: a case
    whose append fails is left out.
    """
    ledger = executor.ledger
    ids = [s.case.case_id for s, _, _ in continued]
    try:
        states = ledger.intents_many(ids)
    except CapgateError:
        states = {}
    out: dict[str, dict[str, Any]] = {}
    for s, done, found in continued:
        case = s.case
        out[case.case_id] = _recovery_of(executor, case, states.get(case.case_id) or
                                         case.intents, done, found,
                                         by_case.get(case.case_id, []), rows)
    with contextlib.suppress(LedgerError):
        ledger.append_each([item for c in ids for item in (
            (c, "recovery_point", {"recovery_point": out[c]["recovery_point"]}, None),
            (c, CONTINUATION, {"continuation": out[c]["continuation"]}, None))],
            skip=(LedgerError,))
    return out


def _recovery_of(executor: Executor, case: _Case, every: Mapping[str, Mapping[str, Any]],
                 reports: Sequence[IntentReport], changed: Sequence[Mapping[str, Any]],
                 results: Sequence[Recheck], rows: _Rows) -> dict[str, Any]:
    """The case's recovery point and resume's continuation decision (nothing recorded)."""
    rechecked = {r.dependency.intent_id: r.ok for r in results if r.error is None}
    point: RecoveryPoint = assess(((i, s, case.order.get(i, 0)) for i, s in every.items()),
                                  rows.of, rechecked)
    open_ = [r for r in reports if not r.resolved]
    holds = [i for i, s in every.items() if symptoms.is_hold(s)
             and str(s.get("status")) not in TERMINAL]
    decision: dict[str, Any]
    if open_ or changed or holds:
        reasons = [f"intent {r.intent_id}: {r.action}" for r in open_]
        reasons += [f"target changed outside the case: {c.get('impact_key')}" for c in changed]
        reasons += [f"held: the symptom changed outside the case (hold {h})" for h in holds]
        decision = {"decision": "withheld", "after": "resume", "why": "; ".join(reasons)}
    else:
        decision = {"decision": "granted", "after": "resume",
                    "why": "every in-flight intent is settled and the completed steps the "
                           "case depends on still verify"}
    redone = {r.intent_id for r in reports if r.action == "retried"}
    decision.update(retained=point.retained(redone),
                    recovery_point=point.chosen.step if point.chosen else None,
                    at=_now(executor))
    facts = {**point.to_dict(), "retained": point.retained(redone),
             "redone": sorted(redone)}
    return {"recovery_point": facts, "continuation": decision}


def _free_dead_sessions(executor: Executor, intent_ids: Sequence[str]) -> None:
    """Give back the session-budget slots of in-flight intents whose process is gone.

    A killed call never returned its connection to the pool, so its slot would
    count against the connector's budget until it expires -- and resume's own
    retry could find the budget exhausted by the dead.  Only a holder on this
    host whose process no longer exists is freed (a stopped process is alive:
    its session is still open); slots held elsewhere expire on their own.
    """
    from capgate.executor import budget

    with contextlib.suppress(LedgerError):
        budget.slot_store(executor).free_dead(intent_ids)


def _release_claims(executor: Executor, intent_ids: Sequence[str]) -> None:
    """Free the impact keys that closed intents of the resumed cases still hold.

    A call killed before the end of ``Executor.call`` (even after ``observed``)
    never released its claims, so they would block other cases until they
    expire.  Only closed intents are named -- an open one may still be
    settling -- and one statement frees them per 500 intents; a key taken over
    since names another intent and is not touched.
    """
    from capgate.executor import claims

    if not intent_ids or not claims.claims_enabled(executor):
        return
    with contextlib.suppress(LedgerError):
        claims.store_for(executor).release_intents(intent_ids)


# --- loading ---------------------------------------------------------------------


@dataclass
class _Case:
    case_id: str
    intents: dict[str, dict[str, Any]]
    order: dict[str, int]
    pending: list[Pending] = field(default_factory=list)
    parked: list[IntentReport] = field(default_factory=list)
    """Open intents resume does not settle itself (a person's or the DDL loop's)."""

    def open_intents(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.intents.items() if is_open_status(str(v.get("status")))}


def _load(verified: VerifiedCase, task: str | None) -> _Case:
    case_id = verified.case_id
    snapshot = verified.snapshot
    recorded = (snapshot.get("case") or {}).get("task")
    if task is not None and recorded is not None and recorded != task:
        raise CaseConflict(
            f"case {case_id!r} was opened for task {recorded!r}, not {task!r}; a task id "
            "reused for another request is refused -- use a new case for new work",
            case=case_id, recorded=recorded, task=task)
    order: dict[str, int] = {}
    for event in verified.events:
        if event.intent_id is not None and event.intent_id not in order:
            order[event.intent_id] = event.seq
    # every intent of the case, settled ones too (the poisoned-resume recheck needs the
    # applied ones): folded from the verified chain, not from the snapshot (open only)
    intents = intent_states(verified.events)
    case = _Case(case_id, intents, order)
    for intent_id, state in intents.items():
        status = str(state.get("status"))
        if status == "changed_outside_case" and symptoms.is_hold(state):
            hold = Pending(case_id, intent_id, state, order.get(intent_id, 0))
            case.parked.append(_report(hold, Classification.UNKNOWN, {
                "rule": "the case's symptom changed outside the case; a person accepts the "
                        f"new state or re-opens the case: `capgate case accept|reopen "
                        f"{case_id} {intent_id} --by NAME --key FILE`",
                "hold": state.get("symptom")}, "awaiting_person"))
            continue
        if status in TERMINAL or status == "changed_outside_case":
            continue
        p = Pending(case_id, intent_id, state, order.get(intent_id, 0))
        escalation = state.get("escalation")
        if status == "escalated" and not (
                isinstance(escalation, Mapping) and escalation.get("by") == "resume"):
            case.parked.append(_report(p, str((escalation or {}).get("classification")
                                              or Classification.UNKNOWN),
                                       {"rule": "escalated by the executor; a person decides",
                                        "escalation": escalation},
                                       "awaiting_person"))
        elif state.get("effect_class") == "ddl" or status.startswith("ddl."):
            case.parked.append(_report(p, Classification.UNKNOWN,
                                       {"rule": "a DDL intent: reconciled by the DDL loop"},
                                       "awaiting_person"))
        else:
            case.pending.append(p)
    case.pending.sort(key=lambda p: p.order)
    return case


class _Rows:
    """Registry rows by (operation, version), resolved once; None when unresolvable."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.cache: dict[tuple[str, int], Row | None] = {}

    def of(self, operation_id: str, version: int) -> Row | None:
        key = (operation_id, version)
        if key not in self.cache:
            try:
                self.cache[key] = self.executor.registry.resolve(operation_id, version)
            except CapgateError:
                self.cache[key] = None
        return self.cache[key]

    def of_pending(self, p: Pending) -> Row | None:
        op, version = p.state.get("operation_id"), p.state.get("version")
        if not op or version is None:
            return None
        return self.of(str(op), int(version))


# --- settling one case -----------------------------------------------------------


def _evidence(p: Pending, f: Facts, rule: str) -> dict[str, Any]:
    details = dict(f.details)
    out: dict[str, Any] = {
        "rule": rule,
        "attempt": p.attempt,
        "marker": f.marker,
        "marker_row": f.marker_row,
        "commit_outcome": f.outcome,
        "commit_outcome_detail": details.pop("commit_outcome", None),
        "finished": f.finished,
        "server_identity": f.identity,
        "probe": f.probe,
        "unreachable": f.unreachable,
        "tx": p.tx or None,
        **details,
    }
    return {k: v for k, v in out.items() if v is not None}


def _report(p: Pending, classification: str, evidence: Mapping[str, Any], action: str, *,
            outcome: str | None = None, detail: str = "", resolved: bool = False
            ) -> IntentReport:
    version = p.state.get("version")
    return IntentReport(p.case_id, p.intent_id, p.state.get("operation_id"),
                        int(version) if version is not None else None, p.status, p.attempt,
                        str(classification), evidence, action, outcome, detail, resolved)


@dataclass
class _Settling:
    """One case between recording its facts and continuing (or not)."""

    case: _Case
    reports: list[IntentReport]
    retry: list[tuple[Pending, dict[str, Any]]]
    states: dict[str, dict[str, Any]]
    deps: list[Dependency]


class _Batch:
    """``reconciled`` events of many cases, committed together (``Ledger.append_each``).

    Only events nothing else in this resume waits for go here (an applied intent
    without post-commit checks); ``append_each`` keeps each case's events in order.
    """

    def __init__(self, executor: Executor, size: int = 250) -> None:
        self.executor = executor
        self.size = size
        self.items: list[tuple[str, str, Mapping[str, Any], str | None]] = []

    def add(self, case_id: str, kind: str, payload: Mapping[str, Any],
            intent_id: str | None) -> None:
        self.items.append((case_id, kind, payload, intent_id))
        if len(self.items) >= self.size:
            self.flush()

    def flush(self) -> None:
        if self.items:
            items, self.items = self.items, []
            self.executor.ledger.append_each(items, chunk=self.size)


def _record(executor: Executor, case: _Case, facts: Mapping[str, Facts], rows: _Rows,
            fresh: Mapping[str, Any] | None, *, act: bool,
            batch: _Batch | None = None) -> _Settling:
    """Classify the case's in-flight intents; record applied, never_retry and escalations.

    ``fresh`` is the case's snapshot re-read after the evidence was gathered:
    another resume (or a late attempt) may have moved an intent on meanwhile.
    """
    reports: list[IntentReport] = list(case.parked)
    decided: list[tuple[Pending, Classification, dict[str, Any]]] = []
    for p in case.pending:
        classification, rule = classify(p, facts[p.intent_id])
        decided.append((p, classification, _evidence(p, facts[p.intent_id], rule)))
    if not act:
        reports.extend(_report(p, c, ev, "none") for p, c, ev in decided)
        states = {k: dict(v) for k, v in case.intents.items()}
        return _Settling(case, reports, [], states,
                         dependencies(case.case_id, _states(states, case.order), rows.of))

    # the snapshot holds the open intents: one that left it since was settled meanwhile
    still_open = {str(k): dict(v) for k, v in
                  ((fresh or {"intents": case.open_intents()}).get("intents") or {}).items()}
    now_states = {**{k: dict(v) for k, v in case.intents.items()}, **still_open}
    retry: list[tuple[Pending, dict[str, Any]]] = []
    for p, classification, ev in decided:
        current = still_open.get(p.intent_id)
        if current is None or current.get("last_seq") != p.state.get("last_seq"):
            reports.append(_report(p, classification, ev, "skipped_concurrent",
                                   detail="the intent moved on while resume looked; "
                                          "run resume again",
                                   resolved=current is None
                                   or str(current.get("status")) in TERMINAL))
            continue
        recovery = str(p.state.get("recovery") or "")
        if classification is Classification.APPLIED:
            reports.append(_record_applied(executor, p, ev, rows, batch))
        elif classification is Classification.NOT_APPLIED:
            if recovery == str(Recovery.NEVER_RETRY):
                reports.append(_record_not_applied(executor, p, ev))
            elif recovery in (str(Recovery.RETRYABLE), str(Recovery.RECONCILE_FIRST)):
                retry.append((p, ev))
            else:
                reports.append(_escalate(executor, p, Classification.NOT_APPLIED, ev,
                                         f"unknown recovery {recovery!r}: not retried"))
        else:
            reports.append(_escalate(executor, p, classification, ev))
    # The intents as just settled, without reading the case again.
    for r in reports:
        if r.action == "recorded_applied" and r.intent_id in now_states:
            now_states[r.intent_id].update(status="reconciled",
                                           outcome_record={"status": r.outcome})
    return _Settling(case, reports, retry, now_states,
                     dependencies(case.case_id, _states(now_states, case.order), rows.of))


def _continue(executor: Executor, s: _Settling, results: list[Recheck], rows: _Rows, *,
              act: bool) -> tuple[list[IntentReport], list[dict[str, Any]]]:
    """The poisoned resume's verdict for one case, then its retries (if it may continue)."""
    changed = [r for r in results if not r.ok and r.error is None]
    unverifiable = [r for r in results if r.error is not None]
    reported = [r.to_dict() for r in changed + unverifiable]
    if not act:
        return s.reports, reported
    _record_rechecks(executor, s.case.case_id, s.states, results)
    hold = ""
    if changed:
        hold = (f"held: {len(changed)} completed step(s) of the case no longer verify "
                "(target changed outside the case)")
    elif unverifiable:
        hold = f"held: cannot re-check completed steps ({unverifiable[0].error})"
    reports = list(s.reports)
    for p, ev in s.retry:
        if hold:
            reports.append(_report(p, Classification.NOT_APPLIED, ev, "held", detail=hold))
            continue
        reports.append(_retry(executor, p, ev, rows))
    return reports, reported


def _states(intents: Mapping[str, Mapping[str, Any]], order: Mapping[str, int]
            ) -> Iterable[tuple[str, Mapping[str, Any], int]]:
    for intent_id, state in intents.items():
        yield intent_id, state, order.get(intent_id, 0)


def _now(executor: Executor) -> str:
    return executor.clock().isoformat()


def _outcome(p: Pending, status: str, attempt: int, evidence: Mapping[str, Any],
             reason: Mapping[str, Any] | None = None) -> Outcome:
    s = p.state
    return Outcome(status=status, intent_id=p.intent_id, case_id=p.case_id,
                   operation_id=str(s.get("operation_id")), version=int(s.get("version") or 0),
                   row_hash=str(s.get("row_hash") or ""),
                   idempotency_key=p.idem_key, fingerprint=p.fingerprint or "",
                   attempt=attempt, evidence={"reconciled": _decisive(evidence)}, reason=reason)


_DECISIVE = ("rule", "marker", "marker_row", "commit_outcome", "probe", "resolved_by", "note")


def _decisive(evidence: Mapping[str, Any]) -> dict[str, Any]:
    """What an outcome record keeps of the evidence (the event carries all of it)."""
    return {k: evidence[k] for k in _DECISIVE if evidence.get(k) is not None}


def _reconciled(executor: Executor, p: Pending, ev: dict[str, Any], classification: str,
                result: Outcome, batch: _Batch | None = None) -> None:
    """Close the intent with a ``reconciled`` event carrying its synthesised outcome
    (into ``batch`` when given: committed with other cases' events)."""
    state: dict[str, Any] = {"classification": classification, "rule": ev["rule"],
                             "outcome": result.status, "outcome_record": result.to_dict(),
                             "reconciled_at": _now(executor)}
    if p.state.get("escalation"):
        state["escalation"] = None
    payload = {"evidence": ev, "state": state}
    if batch is not None:
        batch.add(p.case_id, "reconciled", payload, p.intent_id)
    else:
        executor.ledger.append(p.case_id, "reconciled", payload, intent_id=p.intent_id)


def _record_applied(executor: Executor, p: Pending, ev: dict[str, Any],
                    rows: _Rows, batch: _Batch | None = None) -> IntentReport:
    marker_attempt = (ev.get("marker_row") or {}).get("attempt")
    result = _outcome(p, oc.APPLIED, int(marker_attempt or p.attempt), ev)
    row = rows.of_pending(p)
    checks = row is not None and bool(row.post_commit) and not p.state.get("compensates")
    # post-commit checks (and a compensation they may start) follow the durable record
    _reconciled(executor, p, ev, "applied", result, None if checks else batch)
    detail = ""
    if checks and row is not None:
        try:
            ctx = _context(executor, p, result.attempt, row)
            final = shapes.post_commit(executor.rt, ctx, result)
            detail = f"post-commit checks: {final.status}"
        except (CapgateError, sa.exc.SQLAlchemyError) as exc:
            detail = f"post-commit checks could not run: {exc}"
    return _report(p, Classification.APPLIED, ev, "recorded_applied", outcome=result.status,
                   detail=detail, resolved=True)


def _record_not_applied(executor: Executor, p: Pending, ev: dict[str, Any]) -> IntentReport:
    reason = {"kind": RollbackReason.NOT_APPLIED, "rule": ev["rule"], "recovery": "never_retry"}
    result = _outcome(p, oc.ROLLED_BACK, p.attempt, ev, reason)
    _reconciled(executor, p, ev, "not_applied", result)
    return _report(p, Classification.NOT_APPLIED, ev, "closed_not_applied",
                   outcome=result.status, detail="recovery never_retry: not retried",
                   resolved=True)


def _escalate(executor: Executor, p: Pending, classification: Classification,
              ev: dict[str, Any], detail: str = "") -> IntentReport:
    previous = p.state.get("escalation")
    if (p.status == "escalated" and isinstance(previous, Mapping)
            and previous.get("classification") == str(classification)
            and previous.get("rule") == ev.get("rule")):
        return _report(p, classification, ev, "still_escalated", detail=detail)
    executor.ledger.append(p.case_id, "escalated", {"evidence": ev, "state": {"escalation": {
        "by": "resume", "classification": str(classification), "rule": ev.get("rule"),
        "detail": detail or None, "at": _now(executor)}}}, intent_id=p.intent_id)
    return _report(p, classification, ev, "escalated",
                   detail=detail or "parked for a person; nothing retried")


def _record_rechecks(executor: Executor, case_id: str, states: Mapping[str, Mapping[str, Any]],
                     results: list[Recheck]) -> None:
    for r in results:
        intent_id = r.dependency.intent_id
        status = str(states.get(intent_id, {}).get("status"))
        if r.error is not None:
            continue
        if not r.ok and status != "changed_outside_case":
            failed = [c for c in r.checks if not c["ok"]]
            executor.ledger.append(case_id, "changed_outside_case", {
                "checks": list(r.checks),
                "state": {"changed_outside_case": {"checks": failed, "at": _now(executor),
                                                   "impact_key": r.dependency.impact_key}},
            }, intent_id=intent_id)
        elif r.ok and status == "changed_outside_case":
            executor.ledger.append(case_id, "reconciled", {
                "checks": list(r.checks),
                "state": {"changed_outside_case": None,
                          "recheck": {"ok": True, "at": _now(executor)}},
            }, intent_id=intent_id)


# --- retrying an intent as attempt n+1 ----------------------------------------------


def _context(executor: Executor, p: Pending, attempt: int, row: Row | None = None
             ) -> CallContext:
    """The recorded intent as a call context, after checking it is still the same request."""
    s = p.state
    resolved_row, connector = executor.resolve(str(s["operation_id"]), int(s["version"]))
    row = row or resolved_row
    if row.row_hash != s.get("row_hash"):
        raise CaseConflict(
            f"intent {p.intent_id} was prepared against {row.ref} with hash {s.get('row_hash')}, "
            f"but the registry now has {row.row_hash}; not retried", case=p.case_id,
            intent_id=p.intent_id)
    if connector.name != s.get("connector") or connector.environment != s.get("environment"):
        raise CaseConflict(
            f"intent {p.intent_id} ran on {s.get('connector')} ({s.get('environment')}), the "
            f"row now resolves to {connector.name} ({connector.environment}); not retried",
            case=p.case_id, intent_id=p.intent_id)
    inputs = dict(s.get("inputs") or {})
    fp = fingerprint(row, inputs, connector.name, connector.environment)
    if fp != s.get("fingerprint"):
        raise CaseConflict(
            f"intent {p.intent_id}: the recorded request no longer has its recorded "
            "fingerprint; not retried", case=p.case_id, intent_id=p.intent_id)
    who = str(s.get("who") or "")
    # the caller's grants and the approval the intent relied on, as they are *now*
    executor.grants.check_call(who, row, connector.name, connector.environment)
    plan = render(row, inputs, connector.name, connector.environment, case=p.case_id,
                  requester=who)
    ctx = CallContext(row, inputs, p.case_id, who, connector, p.intent_id, p.idem_key, fp, plan,
                      attempt=attempt, resumed=True)
    gates.recheck_approval(executor.rt, ctx)
    return ctx


def _retry(executor: Executor, p: Pending, ev: dict[str, Any], rows: _Rows) -> IntentReport:
    # at least 2: the call itself was attempt 1, recorded or not (a process stopped
    # after `prepared` may still wake as attempt 1), and the fence tells them apart
    attempt = max(p.attempt, int(p.state.get("retry_attempt") or 0), 1) + 1
    try:
        ctx = _context(executor, p, attempt)
        if p.idem_key is not None and not p.state.get("compensates"):
            claim = executor.ledger.get_idempotency(p.idem_key)
            if claim is not None and (claim.intent_id != p.intent_id
                                      or claim.fingerprint != ctx.fingerprint):
                raise IdempotencyConflict(
                    f"idempotency key {p.idem_key!r} belongs to intent {claim.intent_id} "
                    f"(case {claim.case_id!r}); intent {p.intent_id} is not retried",
                    key=p.idem_key, intent_id=claim.intent_id)
    except CapgateError as exc:
        return _escalate(executor, p, Classification.NOT_APPLIED, ev,
                         f"not retried: {exc}")
    executor.ledger.append(p.case_id, "retrying", {"evidence": ev, "state": {
        "classification": "not_applied", "rule": ev["rule"], "retry_attempt": attempt,
        "escalation": None}}, intent_id=p.intent_id)
    try:
        if p.state.get("compensates"):
            result = _retry_compensation(executor, ctx, str(p.state["compensates"]))
        elif ctx.row.shape is Shape.LEASED:
            from capgate.executor.lease import run_leased

            result = run_leased(executor.rt, ctx)
        else:
            result = shapes.collapsed(executor.rt, ctx)
    except (CapgateError, sa.exc.SQLAlchemyError) as exc:
        return _report(p, Classification.NOT_APPLIED, ev, "retry_failed",
                       detail=f"attempt {attempt}: {exc}; run resume again")
    return _report(p, Classification.NOT_APPLIED, ev, "retried", outcome=result.status,
                   detail=f"attempt {attempt}, same idempotency key", resolved=True)


def _retry_compensation(executor: Executor, ctx: CallContext, original: str) -> Outcome:
    """A compensation intent again: its statements, then the re-read of the restored state.

    The original intent's recorded outcome becomes ``compensated`` only when
    both held; otherwise ``compensation_failed`` and the compensation escalates.
    """
    from capgate.executor.transaction import run_transaction

    rt = executor.rt
    rt.check_target(ctx.connector, ctx)
    result = run_transaction(rt, ctx, lambda conn, ev: run_compensation(ctx, conn, ev))
    restored, checks = finish_compensation(rt, ctx, result)
    record_final(rt, ctx.case_id, original, ctx.intent_id,
                 oc.COMPENSATED if restored else oc.COMPENSATION_FAILED, checks)
    return result


# --- a person's decision ---------------------------------------------------------------


DECISIONS = ("applied", "not_applied", "accepted")


def resolve_escalation(executor: Executor, case_id: str, intent_id: str, *, by: str,
                       decision: str, note: str = "") -> dict[str, Any]:
    """Record a person's decision on an escalated intent (or a changed target); closes it.

    ``applied`` / ``not_applied``: the person established the outcome of an
    ``escalated`` intent (a synthesised outcome record is stored, so an
    idempotent replay returns it).  ``accepted``: a completed step whose
    target ``changed_outside_case`` is accepted as it now is.
    """
    if decision not in DECISIONS:
        raise UsageError(f"decision must be one of {', '.join(DECISIONS)}, not {decision!r}")
    if not by:
        raise UsageError("say who decides: by=...")
    state = executor.ledger.intent(case_id, intent_id)
    status = str(state.get("status"))
    if symptoms.is_hold(state):
        raise UsageError(f"{intent_id} is a hold of case {case_id!r} (its symptom changed "
                         "outside the case): a person signs the answer -- `capgate case "
                         f"accept|reopen {case_id} {intent_id} --by NAME --key FILE`",
                         case=case_id, intent_id=intent_id)
    if status == "changed_outside_case":
        if decision != "accepted":
            raise UsageError(f"intent {intent_id} changed outside the case: the decision is "
                             "`accepted` (or leave it open)")
    elif status in TERMINAL:
        raise UnknownIntent(f"intent {intent_id} of case {case_id!r} is not open ({status})",
                            case=case_id, intent_id=intent_id)
    elif decision == "accepted":
        raise UsageError(f"intent {intent_id} is {status}: decide `applied` or `not_applied`")
    resolution = {"by": by, "decision": decision, "note": note, "at": _now(executor)}
    new_state: dict[str, Any] = {"resolution": resolution}
    if decision in ("applied", "not_applied"):
        p = Pending(case_id, intent_id, state, 0)
        result = _outcome(p, oc.APPLIED if decision == "applied" else oc.ROLLED_BACK,
                          p.attempt, {"resolved_by": by, "note": note},
                          None if decision == "applied" else {"kind": RollbackReason.NOT_APPLIED,
                                                              "resolved_by": by})
        new_state.update(outcome=result.status, outcome_record=result.to_dict())
    else:
        new_state["changed_outside_case"] = None
    executor.ledger.append(case_id, "escalation_resolved", {"state": new_state},
                           intent_id=intent_id)
    return {"case": case_id, "intent_id": intent_id, **resolution}
