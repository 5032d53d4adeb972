"""Recovery accounting: the seed's Table 7 columns, counted from the ledger alone.

Seed 003 asks that recovery decisions be evaluated apart from final success:
how much work was attempted, how much of it was the useful final action, how
much was re-executed, and how much validated work each recovery retained.
The ledger holds every fact needed; this module counts them -- from the
verified chain of each case, never from a summary someone could have edited
(a case that does not verify is reported as such and left out of the totals).

Per write intent (reads, holds and the gap register are not actions):

* **attempts** -- the attempts started: the ``prepared`` that carries its
  transaction's identity (a collapsed call's first attempt), each
  ``attempt_started`` (a lease, a timeout-contract retry, resume's retry),
  a DDL plan the loop ran (``ddl_apply_started`` or its ``ddl.*`` events);
* **final** -- ``applied`` when the intent's last recorded outcome is an
  applied effect (``observed``, or resume's ``reconciled`` from the marker,
  or a person's ``escalation_resolved``), ``not_applied`` when it ended
  otherwise, ``unsettled`` while it is open; a compensation's own intent is
  ``compensation``;
* **re-execution overhead** -- attempts beyond the intent's first: work that
  had to run again because an attempt's outcome was lost or rolled back.  An
  intent whose marker proved it landed is reconciled, not retried: 0.

So, per case and in total: ``total_attempts = useful_final_actions +
re_execution_overhead + unsuccessful_final_actions + unsettled_final_actions
+ compensation_actions`` (each intent's last attempt is exactly one of the
final kinds).  **Validated actions retained at recovery** sums, over each
recovery of the case (each ``continuation`` resume recorded), the steps
eligible at that moment (:func:`executor.recovery.eligibility` -- applied and
verified) that the recovery kept: not retried by it (a step resume re-ran is
re-executed work, not retained work), never attempted again afterwards.  A
step whose marker proved it landed is reconciled and counts as retained.  **Decisions** count
``retrying`` (retried), ``reconciled``, ``escalated`` and ``continuation``
events (granted / withheld), plus coordination decisions and holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capgate.executor.ledger.chain import Event
from capgate.executor.ledger.store import Ledger
from capgate.executor.recovery.eligibility import eligible_now
from capgate.registry.errors import LedgerTampered

__all__ = ["CaseStats", "IntentStats", "LedgerStats", "case_stats", "ledger_stats"]

_FINAL_KINDS = ("observed", "reconciled", "escalation_resolved")
_APPLIED = ("applied_verified",)
_TABLE = ("total_attempts", "useful_final_actions", "re_execution_overhead",
          "validated_actions_retained_at_recovery")
_DECISIONS = ("retried", "reconciled", "escalated", "withheld", "granted")


@dataclass(frozen=True)
class IntentStats:
    """One action's accounting."""

    intent_id: str
    operation_id: str | None
    effect_class: str | None
    attempts: int
    final: str
    """``applied``, ``not_applied``, ``unsettled`` or ``compensation``."""
    outcome: str | None
    status: str
    retried: int = 0

    @property
    def overhead(self) -> int:
        return max(0, self.attempts - 1)

    def to_dict(self) -> dict[str, Any]:
        return {"intent_id": self.intent_id, "operation_id": self.operation_id,
                "effect_class": self.effect_class, "attempts": self.attempts,
                "final": self.final, "outcome": self.outcome, "status": self.status,
                "re_execution_overhead": self.overhead, "retried": self.retried}


@dataclass(frozen=True)
class CaseStats:
    """One case's Table 7 columns, decisions and recoveries."""

    case_id: str
    intents: tuple[IntentStats, ...]
    validated_actions_retained_at_recovery: int
    decisions: Mapping[str, int]
    recoveries: tuple[Mapping[str, Any], ...]
    coordination: Mapping[str, int]
    holds: int
    gaps: int
    reads: int

    @property
    def total_attempts(self) -> int:
        return sum(i.attempts for i in self.intents)

    @property
    def useful_final_actions(self) -> int:
        return sum(1 for i in self.intents if i.final == "applied")

    @property
    def re_execution_overhead(self) -> int:
        return sum(i.overhead for i in self.intents)

    def finals(self) -> dict[str, int]:
        out = {"unsuccessful_final_actions": 0, "unsettled_final_actions": 0,
               "compensation_actions": 0}
        for i in self.intents:
            if i.attempts == 0:
                continue  # never attempted: no final action at all
            if i.final == "not_applied":
                out["unsuccessful_final_actions"] += 1
            elif i.final == "unsettled":
                out["unsettled_final_actions"] += 1
            elif i.final == "compensation":
                out["compensation_actions"] += 1
        return out

    def table(self) -> dict[str, int]:
        return {"total_attempts": self.total_attempts,
                "useful_final_actions": self.useful_final_actions,
                "re_execution_overhead": self.re_execution_overhead,
                "validated_actions_retained_at_recovery":
                    self.validated_actions_retained_at_recovery}

    def to_dict(self, *, intents: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"case": self.case_id, "verified": True, **self.table(),
                               **self.finals(), "decisions": dict(self.decisions),
                               "recoveries": [dict(r) for r in self.recoveries],
                               "coordination": dict(self.coordination), "holds": self.holds,
                               "capability_gaps": self.gaps, "reads": self.reads}
        if intents:
            out["intents"] = [i.to_dict() for i in self.intents]
        return out


def case_stats(case_id: str, events: Sequence[Event]) -> CaseStats:
    """Count one case's chain (already verified by the caller)."""
    states: dict[str, dict[str, Any]] = {}
    attempts: dict[str, dict[int, int]] = {}
    """intent -> attempt number -> the seq it started at."""
    retried: dict[str, int] = {}
    redone: dict[str, list[int]] = {}
    """intent -> the seqs at which a recovery (resume) retried it."""
    decisions = dict.fromkeys(_DECISIONS, 0)
    coordination = {"requested": 0, "decided": 0}
    recoveries: list[dict[str, Any]] = []
    eligible_at: list[tuple[int, set[str]]] = []
    points: dict[int, Mapping[str, Any]] = {}
    gaps = 0
    for e in events:
        payload = e.payload
        if e.intent_id is not None:
            state = states.setdefault(e.intent_id, {})
            state.update(payload.get("state") or {})
            state["status"] = e.kind
            started = attempts.setdefault(e.intent_id, {})
            if e.kind == "prepared" and (payload.get("state") or {}).get("tx"):
                started.setdefault(int(state.get("attempt") or 1), e.seq)
            elif e.kind == "attempt_started":
                number = int((payload.get("state") or {}).get("attempt") or len(started) + 1)
                started.setdefault(number, e.seq)
            elif e.kind == "ddl_apply_started" or e.kind.startswith("ddl."):
                started.setdefault(1, e.seq)  # the DDL loop ran the plan: its one attempt
            elif e.kind == "retrying":
                retried[e.intent_id] = retried.get(e.intent_id, 0) + 1
                decisions["retried"] += 1
                if "evidence" in payload:  # resume's retry (the timeout contract's has none)
                    redone.setdefault(e.intent_id, []).append(e.seq)
            elif e.kind == "reconciled":
                decisions["reconciled"] += 1
            elif e.kind == "escalated":
                decisions["escalated"] += 1
            continue
        if e.kind == "continuation":
            cont = payload.get("continuation") or {}
            decision = str(cont.get("decision"))
            if decision in ("granted", "withheld"):
                decisions[decision] += 1
            if cont.get("after") == "resume":
                eligible_at.append((e.seq, {i for i, s in states.items()
                                            if _is_action(s) and eligible_now(s)}))
        elif e.kind == "recovery_point":
            points[e.seq] = payload.get("recovery_point") or {}
        elif e.kind == "coordination_requested":
            coordination["requested"] += 1
        elif e.kind == "coordination_decided":
            coordination["decided"] += 1
        elif e.kind == "capability_gap":
            gaps += 1
    retained_total = 0
    previous = -1
    for seq, eligible in eligible_at:
        # kept: validated before this recovery -- not redone by it, never attempted after it
        kept = {i for i in eligible
                if not any(s > seq for s in attempts.get(i, {}).values())
                and not any(previous < s < seq for s in redone.get(i, []))}
        previous = seq
        retained_total += len(kept)
        point = points.get(seq - 1) or {}
        chosen = point.get("chosen") or {}
        latest = point.get("latest_recorded") or {}
        recoveries.append({"seq": seq, "retained": len(kept),
                           "recovery_point": chosen.get("step"),
                           "latest_recorded": latest.get("step"),
                           "chosen_is_latest": point.get("chosen_is_latest")})
    out: list[IntentStats] = []
    holds = reads = 0
    for intent_id, state in states.items():
        if state.get("hold"):
            holds += 1
            continue
        if state.get("effect_class") == "read":
            reads += 1
            continue
        if "operation_id" not in state and "effect_class" not in state:
            continue  # no prepared event: not an action of this case
        out.append(IntentStats(intent_id, state.get("operation_id"), state.get("effect_class"),
                               len(attempts.get(intent_id, {})), _final(state),
                               _outcome(state), str(state.get("status")),
                               retried.get(intent_id, 0)))
    return CaseStats(case_id, tuple(out), retained_total, decisions, tuple(recoveries),
                     coordination, holds, gaps, reads)


def _is_action(state: Mapping[str, Any]) -> bool:
    return not state.get("hold") and state.get("effect_class") not in (None, "read") \
        and not state.get("compensates")


def _outcome(state: Mapping[str, Any]) -> str | None:
    record = state.get("outcome_record")
    if isinstance(record, Mapping) and record.get("status"):
        return str(record["status"])
    value = state.get("outcome")
    return str(value) if value is not None else None


def _final(state: Mapping[str, Any]) -> str:
    if state.get("compensates"):
        return "compensation"
    if state.get("status") not in _FINAL_KINDS:
        return "unsettled"
    return "applied" if _outcome(state) in _APPLIED else "not_applied"


@dataclass(frozen=True)
class LedgerStats:
    """Every case asked for, their totals, and the cases that did not verify."""

    cases: tuple[CaseStats, ...]
    unverified: tuple[Mapping[str, Any], ...] = field(default=())

    def totals(self) -> dict[str, Any]:
        out: dict[str, Any] = dict.fromkeys(_TABLE, 0)
        finals: dict[str, int] = {}
        decisions = dict.fromkeys(_DECISIONS, 0)
        for c in self.cases:
            for k, v in c.table().items():
                out[k] += v
            for k, v in c.finals().items():
                finals[k] = finals.get(k, 0) + v
            for k, v in c.decisions.items():
                decisions[k] = decisions.get(k, 0) + v
        return {"cases": len(self.cases), **out, **finals, "decisions": decisions,
                "recoveries": sum(len(c.recoveries) for c in self.cases)}

    def to_dict(self, *, intents: bool = True) -> dict[str, Any]:
        return {"cases": [c.to_dict(intents=intents) for c in self.cases],
                "total": self.totals(), "unverified": [dict(u) for u in self.unverified]}


def ledger_stats(ledger: Ledger, case_ids: Sequence[str] | None = None) -> LedgerStats:
    """Count ``case_ids`` (default: every case but the gap register), each verified first.

    A case that does not verify is listed in ``unverified`` with its findings
    and counted nowhere: accounting built on an edited record would be false.
    Raises UnknownCase for a named case the ledger does not have.
    """
    from capgate.executor.gaps import GAPS_CASE

    wanted = list(case_ids) if case_ids is not None else [
        c.case_id for c in ledger.cases() if c.case_id != GAPS_CASE]
    out: list[CaseStats] = []
    bad: list[dict[str, Any]] = []
    for case_id in wanted:
        try:
            verified = ledger.load_verified(case_id)
        except LedgerTampered as exc:
            bad.append({"case": case_id, "error": exc.code, "message": exc.message,
                        "findings": exc.details.get("findings")})
            continue
        out.append(case_stats(case_id, verified.events))
    return LedgerStats(tuple(out), tuple(bad))
