"""Reading a case: ``capgate cases``, ``capgate ledger show`` and its HTML view, ``resume``.

The ledger stores each boundary of a call as a hash-chained event with a JSON
payload made for machines.  A person asks other questions -- what is this
case doing, who did what when, why did that write roll back, what did resume
decide -- so this module turns events into

* one row per case (:func:`case_rows`): its state and its last outcome;
* a timeline (:func:`timeline`): time, actor, event, intent and a one-line
  summary cut between words, never inside one (``--json`` has everything);
* a self-contained HTML page (:func:`render_html`): the intents and their
  attempts on a timeline, approvals, evidence, reconciliation decisions and
  DDL signatures before and after -- one file with its style inline and no
  script, that any browser opens offline;
* ``capgate resume``'s report (:func:`resume_lines`): per in-flight intent
  what was found, the evidence that decided, strongest first, and the action.

Every value shown comes from the events as recorded; nothing here talks to a
target.  All text is escaped: inputs are user data.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capgate.executor.ledger import Event, Ledger
from capgate.executor.ledger.chain import TERMINAL_STATUSES

#: outcome status -> the colour class used by the HTML view (and its legend).
OUTCOME_CLASS = {
    "ok": "good", "applied_verified": "good", "compensated": "warn",
    "rolled_back": "bad", "compensation_failed": "bad", "unknown": "warn",
}
RESUME_KINDS = ("reconciled", "retrying", "escalated", "escalation_resolved",
                "changed_outside_case")


def clip(text: str, width: int) -> str:
    """``text`` on one line, at most ``width`` characters, cut between words only.

    A word longer than the room left is dropped whole, with an ellipsis: a
    reader never sees half of an identifier or of a number.
    """
    words = text.split()
    out: list[str] = []
    used = 0
    for word in words:
        extra = len(word) + (1 if out else 0)
        if used + extra > width and out:
            return " ".join(out) + " …"
        out.append(word)
        used += extra
    return " ".join(out)


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    """The mappings in ``value`` when it is a list (payloads differ by executor and loop)."""
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def compact(value: Any) -> str:
    """JSON on one line (the form every value is shown in: never a Python repr)."""
    return json.dumps(value, ensure_ascii=False, default=str, separators=(", ", ": "))


# --- cases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseRow:
    """One case as ``capgate cases`` lists it."""

    case_id: str
    state: str
    """``open`` (an intent awaits ``resume``), ``escalated`` (a person must decide),
    ``changed`` (a target changed under the case), ``holding`` (no open work, but it
    holds impact claims: ``capgate case release`` gives them back) or ``closed``."""
    events: int
    updated_at: str
    intents: int
    last_operation: str | None
    last_outcome: str | None
    last_at: str | None
    open_intents: list[str] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    """The impact claims the case holds now (``holding`` when it has no open work)."""

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case_id, "state": self.state,
                "open": self.state not in ("closed", "holding"),
                "events": self.events, "updated_at": self.updated_at, "intents": self.intents,
                "last_operation": self.last_operation, "last_outcome": self.last_outcome,
                "last_at": self.last_at, "open_intents": self.open_intents,
                "claims": self.claims}


def case_state(intents: Mapping[str, Mapping[str, Any]]) -> str:
    statuses = {str(i.get("status")) for i in intents.values()}
    if "escalated" in statuses:
        return "escalated"
    if "changed_outside_case" in statuses:
        return "changed"
    if any(s not in TERMINAL_STATUSES for s in statuses):
        return "open"
    return "closed"


def case_rows(ledger: Ledger, *, open_only: bool = False) -> list[CaseRow]:
    """Every case (or the open ones) with its state, last outcome and the impact claims it
    holds, newest first; a case that holds claims without a record is listed too."""
    from capgate.executor.claims import ClaimStore

    held = ClaimStore(ledger).held_by_cases()
    out = []
    for summary in ledger.cases(open_only=open_only):
        snapshot = ledger.snapshot(summary.case_id) or {}
        intents: Mapping[str, Mapping[str, Any]] = snapshot.get("intents", {})  # open ones
        last = snapshot.get("last")
        last_op = last_outcome = last_at = None
        if isinstance(last, Mapping):
            last_op = f"{last.get('operation_id')}@{last.get('version')}"
            last_outcome = str(last.get("outcome") or last.get("status"))
            last_at = str(last.get("at") or "") or None
        claims = [_claim(c) for c in held.pop(summary.case_id, [])]
        state = case_state(intents) if intents else ("open" if summary.open else "closed")
        out.append(CaseRow(
            case_id=summary.case_id, state="holding" if state == "closed" and claims else state,
            events=summary.head_seq + 1, updated_at=summary.updated_at.isoformat(),
            intents=int(snapshot.get("intent_count") or len(intents)), last_operation=last_op,
            last_outcome=last_outcome, last_at=last_at, open_intents=summary.open_intents,
            claims=claims))
    if not open_only:
        for case_id, claims in held.items():  # claims of a case with no record
            out.append(CaseRow(case_id=case_id, state="holding", events=0, updated_at="",
                               intents=0, last_operation=None, last_outcome=None,
                               last_at=None, claims=[_claim(c) for c in claims]))
    out.sort(key=lambda r: r.updated_at, reverse=True)
    return out


def _claim(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"impact_key": row["impact_key"], "token": int(row["token"]),
            "operation_id": row.get("operation_id"),
            "expires_in": round(float(row["expires_in"]), 1)}


def cases_text(rows: Sequence[CaseRow]) -> str:
    if not rows:
        return "no cases"
    head = f"{'CASE':<24} {'STATE':<9} {'EVENTS':>6}  {'UPDATED':<19}  LAST OUTCOME"
    lines = [head]
    for r in rows:
        last = f"{r.last_operation} {r.last_outcome}" if r.last_operation else "-"
        lines.append(f"{r.case_id:<24} {r.state:<9} {r.events:>6}  {r.updated_at[:19]:<19}  "
                     f"{last}")
        if r.open_intents:
            lines.append(f"{'':<24} awaiting `capgate resume {r.case_id}`: "
                         + ", ".join(r.open_intents))
        if r.claims:
            lines.append(f"{'':<24} holds {len(r.claims)} claim(s): " + ", ".join(
                f"{c['impact_key']} ({c['expires_in']:.0f} s left)" for c in r.claims)
                + f"; `capgate case release {r.case_id}` gives them back")
    return "\n".join(lines)


# --- a plan, as its approver reads it -------------------------------------------------------


def _sql(text: str) -> str:
    return " ".join(str(text).split())


def plan_lines(body: Mapping[str, Any]) -> list[str]:
    """What a plan will do, in lines: the row, target and keys, every statement's SQL with
    its bound values and expected count, the verify checks, replay, compensation, and who
    must approve.  ``capgate plan``, ``plan show``, ``approve`` and the HTML view share it."""
    if "statements" not in body and "steps" not in body:  # a DDL, rehearsal, simulation plan
        rest = {k: v for k, v in body.items() if k != "plan_hash"}
        return [f"  {line}" for line in json.dumps(rest, indent=2, default=str).splitlines()]
    lines = [f"  {body.get('operation_id')}@{body.get('version')} on {body.get('connector')} "
             f"({body.get('environment')}), {body.get('effect_class')}"
             f"{'/' + str(body['shape']) if body.get('shape') else ''}; "
             f"row {body.get('row_hash')}",
             f"  inputs: {compact(body.get('inputs'))}",
             f"  target: {compact(body.get('target'))}",
             f"  impact keys: {', '.join(body.get('impact_keys') or []) or '-'}"]
    for i, st in enumerate(_dicts(body.get("statements")) + _dicts(body.get("steps"))):
        check = st.get("check") if isinstance(st.get("check"), Mapping) else None
        sql = st.get("sql") or (check or {}).get("sql") or ""
        what = f"step {st.get('name')}" if st.get("name") else f"statement {i + 1}"
        if st.get("function"):
            lines.append(f"  [{i + 1}] {what}: registered step function {st['function']}")
            continue
        lines.append(f"  [{i + 1}] {_sql(sql)}")
        binds = st.get("binds") if not check else check.get("binds")
        expect = st.get("expect_rows") if not check else check.get("expect")
        lines.append(f"      binds {compact(binds or {})}; expect {compact(expect)}")
    for c in _dicts(body.get("verify")):
        lines.append(f"  verify {c.get('name')}: {_sql(c.get('sql') or '')}")
        lines.append(f"      binds {compact(c.get('binds') or {})}; "
                     f"expect {compact(c.get('expect'))}")
    replay = body.get("replay")
    if isinstance(replay, Mapping):
        lines.append(f"  replay: {_sql(replay.get('sql') or '')}")
    for c in _dicts(body.get("compensation")):
        lines.append(f"  compensation: {_sql(c.get('sql') or '')}; "
                     f"binds {compact(c.get('binds') or {})}")
    for c in _dicts(body.get("post_commit")):
        lines.append(f"  after commit {c.get('name')}: {_sql(c.get('sql') or '')}")
    auth = body.get("authorization") or {}
    if isinstance(auth, Mapping) and auth.get("kind") == "gate":
        lines.append(f"  approval needed from: {', '.join(auth.get('approver_roles') or [])}"
                     f"{' (four eyes: not the requester)' if auth.get('four_eyes') else ''}")
    return lines


def shown_plan_text(shown: Mapping[str, Any]) -> str:
    """``capgate plan show`` (and what ``approve`` prints before it asks)."""
    lines = [f"plan {shown['plan_hash']}  ({shown['status']})",
             f"  case {shown['case']}, requested by {shown['requester']}, recorded "
             f"{shown['created_at']}"]
    lines += plan_lines(shown["plan"])
    if shown.get("approval_ttl_seconds"):
        lines.append(f"  an approval of it lasts {shown['approval_ttl_seconds']} s "
                     "(--ttl shortens it) and is used once")
    for a in _dicts(shown.get("approvals")):
        state = (f"used by intent {a['used_by_intent']}" if a.get("used_by_intent")
                 else "expired" if a.get("expired") else "unused")
        lines.append(f"  approved by {a['approver']} as {a['role']} at {a['created_at']}, "
                     f"until {a['expires_at']}: {state}")
    return "\n".join(lines)


# --- the timeline ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One event for a person: when, who, what, about which intent, in one line."""

    seq: int
    at: str
    actor: str
    kind: str
    intent_id: str | None
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "at": self.at, "actor": self.actor, "kind": self.kind,
                "intent_id": self.intent_id, "summary": self.summary}


def _reason(reason: Mapping[str, Any] | None) -> str:
    if not reason:
        return ""
    kind = reason.get("kind")
    if kind == "verify":
        return (f"verify {reason.get('check')} expected {compact(reason.get('expected'))}, "
                f"got {compact(reason.get('actual'))}")
    if kind in ("count", "expect_rows", "statement"):
        return (f"{reason.get('statement') or reason.get('name') or 'a statement'} affected "
                f"{compact(reason.get('actual'))}, expected {compact(reason.get('expected'))}")
    return " ".join(f"{k}={compact(v)}" for k, v in reason.items() if k != "sql")


def _outcome_line(outcome: Mapping[str, Any]) -> str:
    status = str(outcome.get("status"))
    parts = [status]
    why = _reason(outcome.get("reason"))
    if why:
        parts.append(f"({why})")
    evidence = outcome.get("evidence") or {}
    if isinstance(evidence, Mapping):
        if "counts" in evidence:
            parts.append(f"counts {compact(evidence['counts'])}")
        checks = _dicts(evidence.get("verify"))
        if checks and not why:
            passed = sum(1 for c in checks if c.get("ok"))
            parts.append(f"verify {passed}/{len(checks)} ok")
        if "count" in evidence:
            parts.append(f"{evidence['count']} row(s)")
    if outcome.get("replayed"):
        parts.append("(recorded outcome replayed)")
    return " ".join(parts)


def _generic(payload: Mapping[str, Any]) -> str:
    items = [(k, v) for k, v in payload.items() if k not in ("state", "case_state")]
    return " ".join(f"{k}={v if isinstance(v, str) else compact(v)}" for k, v in items)


def starts_attempt(event: Event) -> bool:
    """The event begins an attempt (a collapsed call's ``prepared`` records its first)."""
    if event.kind in ("attempt_started", "retrying", "lease_started", "ddl.apply_started"):
        return True
    state = event.payload.get("state")
    return event.kind == "prepared" and isinstance(state, Mapping) and "tx" in state


def attempts(events: Sequence[Event]) -> int:
    """How many attempts an intent's events record: distinct attempt numbers of the events
    that run one (``prepared`` with its transaction, ``attempt_started``).  ``retrying``
    announces the attempt its ``attempt_started`` then records, and a lease's
    ``lease_started`` belongs to an attempt already counted: counted once, not twice."""
    numbers: set[int] = set()
    unnumbered = 0
    for e in events:
        if not starts_attempt(e) or e.kind in ("retrying", "lease_started") \
                or e.kind.startswith("ddl."):
            continue
        state = e.payload.get("state")
        number = state.get("attempt") if isinstance(state, Mapping) else None
        if isinstance(number, int):
            numbers.add(number)
        else:
            unnumbered += 1
    return len(numbers) + unnumbered


def summarise(event: Event, who: str | None, operation: str | None) -> str:
    """One line about one event (untruncated; :func:`timeline` clips it)."""
    p = event.payload
    state = p.get("state") if isinstance(p.get("state"), Mapping) else {}
    assert isinstance(state, Mapping)
    kind = event.kind
    if kind == "prepared":
        request = p.get("request") if isinstance(p.get("request"), Mapping) else {}
        assert isinstance(request, Mapping)
        if "objects" in request and not request.get("inputs"):
            return f"{operation or '?'} replace {compact(request['objects'])}"
        line = f"{operation or '?'} inputs {compact(request.get('inputs', {}))}"
        if isinstance(state.get("tx"), Mapping):  # the first attempt, recorded with it
            line += f"; attempt {state.get('attempt')} on {state['tx'].get('dialect', '?')}"
        return line
    if kind == "attempt_started":
        tx = state.get("tx") or {}
        ident = " ".join(f"{k} {v}" for k, v in tx.items() if k != "dialect")
        return f"{operation or ''} attempt {state.get('attempt')} on {tx.get('dialect', '?')}" + (
            f" ({ident})" if ident else "")
    if kind in ("observed", "escalated") and isinstance(p.get("outcome"), Mapping):
        return f"{operation or ''} {_outcome_line(p['outcome'])}".strip()
    if kind == "approval_recorded":
        approval = (p.get("case_state") or {}).get("last_approval") or {}
        return (f"approved plan {approval.get('plan_hash')} as {approval.get('role')}, "
                f"single use, expires {approval.get('expires_at')}")
    if kind == "reconciled" and "classification" in state:
        return (f"{operation or ''} {state.get('classification')}: {state.get('rule')} -> "
                f"{state.get('outcome')}").strip()
    if kind == "escalated" and isinstance(state.get("escalation"), Mapping):
        esc = state["escalation"]
        return (f"{operation or ''} {esc.get('classification')}: {esc.get('rule')}; parked for "
                "a person").strip()
    if kind == "retrying":
        evidence = p.get("evidence") if isinstance(p.get("evidence"), Mapping) else {}
        assert isinstance(evidence, Mapping)
        return (f"{operation or ''} not_applied: {evidence.get('rule')} -> retried with the "
                "same idempotency key").strip()
    if kind == "escalation_resolved":
        return f"{operation or ''} decided: {_generic(state)}".strip()
    if kind == "changed_outside_case" and isinstance(p.get("changed"), list):
        parts = []
        for c in _dicts(p.get("changed")):
            actor = c.get("actor") if isinstance(c.get("actor"), Mapping) else {}
            assert isinstance(actor, Mapping)
            declared = actor.get("declared") if isinstance(actor.get("declared"), Mapping) \
                else {}
            other = actor.get("capgate") if isinstance(actor.get("capgate"), Mapping) else {}
            assert isinstance(declared, Mapping) and isinstance(other, Mapping)
            by = declared.get("who") or other.get("case")
            parts.append(f"{c.get('impact_key')}" + (f" by {by}" if by else ""))
        return f"symptom changed outside the case: {', '.join(parts)}; held for a person"
    if kind == "changed_outside_case":
        failed = [str(c.get("name")) for c in _dicts(p.get("checks")) if not c.get("ok")]
        return f"{operation or ''} target changed outside the case: {', '.join(failed)}"
    issue17 = _case_summary(kind, p)
    if issue17 is not None:
        return issue17
    if kind == "ddl.object_applied":
        return f"{p.get('object')} now {p.get('applied_signature')}"
    if kind == "ddl.captured":
        return f"{p.get('object')} captured at {p.get('signature')}"
    return _generic(p)


def _case_summary(kind: str, p: Mapping[str, Any]) -> str | None:
    """Issue 17's case-level events: coordination, continuation, recovery point, gaps."""
    def part(name: str) -> Mapping[str, Any]:
        value = p.get(name)
        return value if isinstance(value, Mapping) else {}

    if kind in ("coordination_requested", "coordination_decided"):
        c = part("coordination")
        holder = c.get("holder") if isinstance(c.get("holder"), Mapping) else {}
        asker = c.get("asker") if isinstance(c.get("asker"), Mapping) else {}
        assert isinstance(holder, Mapping) and isinstance(asker, Mapping)
        keys = ", ".join(str(k) for k in c.get("keys") or [])
        if kind == "coordination_requested":
            return (f"{c.get('decision_id')}: case {asker.get('case')} ({asker.get('who')}) "
                    f"asks for {keys}, held by case {holder.get('case')} (token "
                    f"{holder.get('token')}); a person decides")
        return (f"{c.get('decision_id')}: {c.get('decision')} by {c.get('by')}"
                + (f" ({c.get('reason')})" if c.get("reason") else "") + f" -- {keys}")
    if kind == "continuation":
        c = part("continuation")
        return f"continuation {c.get('decision')} after {c.get('after')}: {c.get('why')}"
    if kind == "recovery_point":
        r = part("recovery_point")
        chosen = r.get("chosen") if isinstance(r.get("chosen"), Mapping) else None
        latest = r.get("latest_recorded") if isinstance(r.get("latest_recorded"), Mapping) \
            else None
        return ("recovery point " + (f"{chosen.get('step')}" if chosen else "none")
                + f" ({r.get('eligible')} eligible)"
                + ("" if r.get("chosen_is_latest") or latest is None else
                   f"; latest recorded {latest.get('step')} not eligible: {latest.get('why')}"))
    if kind == "capability_gap":
        g = part("gap")
        return (f"capability gap: {g.get('operation_id')} asked by {g.get('requested_by')} via "
                f"{g.get('via')} ({g.get('refusal')})")
    if kind in ("symptom_registered", "symptom_updated"):
        s = part("symptom")
        return f"{kind.replace('_', ' ')}: {s.get('impact_key') or compact(s.get('digests'))}"
    if kind in ("case_closed", "claims_released"):
        c = part("claims")
        return f"{kind.replace('_', ' ')} by {c.get('by')}: {compact(c.get('released'))}"
    return None


def actor_of(event: Event, who: str | None) -> str:
    p = event.payload
    coordination = p.get("coordination")
    if isinstance(coordination, Mapping):
        if event.kind == "coordination_decided" and coordination.get("by"):
            return str(coordination["by"])
        asker = coordination.get("asker")
        if isinstance(asker, Mapping) and asker.get("who"):
            return str(asker["who"])
    claims = p.get("claims")
    if isinstance(claims, Mapping) and claims.get("by"):
        return str(claims["by"])
    if event.kind == "changed_outside_case" and isinstance(p.get("changed"), list):
        return "capgate"  # the re-read before the fix or at a checkpoint, not resume
    symptom = p.get("symptom")
    if event.kind == "symptom_registered" and isinstance(symptom, Mapping) \
            and symptom.get("registered_by"):
        return str(symptom["registered_by"])
    if event.kind == "approval_recorded":
        return str(((p.get("case_state") or {}).get("last_approval") or {}).get("by") or "?")
    state = p.get("state") if isinstance(p.get("state"), Mapping) else {}
    assert isinstance(state, Mapping)
    escalation = state.get("escalation")
    if event.kind in RESUME_KINDS:
        if isinstance(escalation, Mapping) and escalation.get("by"):
            return str(escalation["by"])
        resolution = state.get("resolution") or state.get("decision")
        if isinstance(resolution, Mapping) and resolution.get("by"):
            return str(resolution["by"])
        return "resume"
    if p.get("by"):
        return str(p["by"])
    return who or "capgate"


def timeline(events: Sequence[Event]) -> list[Entry]:
    """The case's events as entries, each with its actor and a full one-line summary."""
    who: dict[str, str] = {}
    operation: dict[str, str] = {}
    out = []
    for e in events:
        request = e.payload.get("request")
        state = e.payload.get("state")
        if e.intent_id and isinstance(request, Mapping):
            who[e.intent_id] = str(request.get("who") or "")
            operation[e.intent_id] = f"{request.get('operation_id')}@{request.get('version')}"
        elif e.intent_id and isinstance(state, Mapping) and state.get("operation_id"):
            operation.setdefault(e.intent_id,
                                 f"{state.get('operation_id')}@{state.get('version')}")
            if state.get("who"):
                who.setdefault(e.intent_id, str(state["who"]))
        w = who.get(e.intent_id or "")
        op = operation.get(e.intent_id or "")
        out.append(Entry(e.seq, e.recorded_at, actor_of(e, w), e.kind, e.intent_id,
                         summarise(e, w, op)))
    return out


def timeline_text(case_id: str, entries: Sequence[Entry], width: int = 100) -> str:
    # the event column as wide as the widest kind shown (coordination_requested, ...)
    kind = max([18, *(len(e.kind) for e in entries)])
    lines = [f"case {case_id}: {len(entries)} event(s)",
             f"{'SEQ':>4}  {'TIME (UTC)':<19}  {'ACTOR':<14} {'EVENT':<{kind}} {'INTENT':<8}  "
             "SUMMARY"]
    for e in entries:
        at = e.at.replace("T", " ")[:19]
        intent = (e.intent_id or "-")[:8]
        lines.append(f"{e.seq:>4}  {at:<19}  {clip(e.actor, 14):<14} {e.kind:<{kind}} "
                     f"{intent:<8}  {clip(e.summary, width)}")
    lines.append("(intent ids are shown by their first 8 characters; --json has every field)")
    return "\n".join(lines)


# --- the HTML view -------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#1d2330;
background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ccd;
padding-bottom:4px}
.meta{color:#555}.mono,code,td.mono{font-family:ui-monospace,Menlo,Consolas,monospace;
font-size:12.5px}
table{border-collapse:collapse;margin:6px 0}th,td{border:1px solid #d5d9e3;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f1f3f8}
.good{color:#1b5e20}.bad{color:#b71c1c}.warn{color:#a65c00}
.pill{display:inline-block;border-radius:9px;padding:0 8px;font-weight:600;color:#fff}
.pill.good{background:#2e7d32}.pill.bad{background:#c62828}.pill.warn{background:#ef8f00}
.pill.none{background:#78849e}
svg text{font:12px system-ui,sans-serif;fill:#1d2330}
details{margin:2px 0}pre{white-space:pre-wrap;word-break:break-word;margin:4px 0}
"""

_FILL = {"good": "#2e7d32", "bad": "#c62828", "warn": "#ef8f00", "none": "#78849e"}


def _e(value: Any) -> str:
    return html.escape(value if isinstance(value, str) else compact(value), quote=True)


@dataclass
class _Intent:
    intent_id: str
    operation: str = "?"
    who: str = ""
    inputs: Any = None
    events: list[Event] = field(default_factory=list)
    outcome: Mapping[str, Any] | None = None
    status: str = ""


def _intents(events: Sequence[Event], snapshot: Mapping[str, Any] | None
             ) -> dict[str, _Intent]:
    found: dict[str, _Intent] = {}
    for e in events:
        if not e.intent_id:
            continue
        it = found.setdefault(e.intent_id, _Intent(e.intent_id))
        it.events.append(e)
        request = e.payload.get("request")
        if isinstance(request, Mapping):
            it.operation = f"{request.get('operation_id')}@{request.get('version')}"
            it.who = str(request.get("who") or "")
            it.inputs = request.get("inputs")
        outcome = e.payload.get("outcome")
        if isinstance(outcome, Mapping):
            it.outcome = outcome
        state = e.payload.get("state")
        if isinstance(state, Mapping) and isinstance(state.get("outcome_record"), Mapping):
            it.outcome = state["outcome_record"]
        if isinstance(state, Mapping) and it.operation == "?" and state.get("operation_id"):
            it.operation = f"{state.get('operation_id')}@{state.get('version')}"
            it.who = str(state.get("who") or it.who)
        it.status = e.kind
    for intent_id, it in found.items():
        snap = ((snapshot or {}).get("intents") or {}).get(intent_id)
        if isinstance(snap, Mapping):
            it.status = str(snap.get("status") or it.status)
    return found


def _outcome_class(status: str | None) -> str:
    return OUTCOME_CLASS.get(status or "", "none")


def _svg(events: Sequence[Event], intents: Mapping[str, _Intent]) -> str:
    """Lanes: the case, then one per intent; x is the event's place in the chain."""
    lanes = ["(case)", *intents]
    left, step, lane_h, top = 230, 34, 34, 30
    width = left + step * (len(events) + 1) + 20
    height = top + lane_h * len(lanes) + 10
    out = [f'<svg width="{width}" height="{height}" '
           f'role="img" aria-label="timeline of {len(events)} events">']
    for n, e in enumerate(events):
        x = left + step * n + step // 2
        out.append(f'<text x="{x}" y="16" text-anchor="middle" class="seq">{e.seq}</text>')
    for row, lane in enumerate(lanes):
        y = top + lane_h * row + lane_h // 2
        label = "case events" if lane == "(case)" else (
            f"{intents[lane].operation} {lane[:8]}")
        out.append(f'<g class="lane" data-intent="{_e(lane)}">')
        out.append(f'<text x="8" y="{y + 4}">{_e(label)}</text>')
        out.append(f'<line x1="{left}" y1="{y}" x2="{width - 10}" y2="{y}" stroke="#d5d9e3"/>')
        mine = [(n, e) for n, e in enumerate(events)
                if (e.intent_id or "(case)") == lane]
        start: int | None = None
        for n, e in mine:
            x = left + step * n + step // 2
            if starts_attempt(e):
                start = x
            cls = "none"
            outcome = e.payload.get("outcome")
            state = e.payload.get("state")
            if isinstance(outcome, Mapping):
                cls = _outcome_class(str(outcome.get("status")))
            elif isinstance(state, Mapping) and state.get("outcome"):
                cls = _outcome_class(str(state.get("outcome")))
            elif e.kind in ("escalated", "changed_outside_case", "commit_uncertain"):
                cls = "warn"
            if start is not None and (cls != "none" or e.kind == "observed"):
                out.append(f'<rect class="attempt {cls}" x="{start}" y="{y - 5}" '
                           f'width="{max(x - start, 2)}" height="10" rx="4" '
                           f'fill="{_FILL[cls]}" opacity="0.35"/>')
                start = None
            shape = "circle"
            if e.kind == "approval_recorded":
                shape = "diamond"
            title = f"#{e.seq} {e.kind} {e.recorded_at}"
            if shape == "diamond":
                out.append(f'<path class="event approval" d="M{x} {y - 8} L{x + 8} {y} L{x} '
                           f'{y + 8} L{x - 8} {y} Z" fill="#5b3cc4"><title>{_e(title)}</title>'
                           "</path>")
            else:
                radius = 8 if cls != "none" else 6
                out.append(f'<circle class="event {cls}" data-kind="{_e(e.kind)}" cx="{x}" '
                           f'cy="{y}" r="{radius}" fill="{_FILL[cls]}"><title>{_e(title)}'
                           "</title></circle>")
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def ddl_objects(events: Sequence[Event]) -> list[dict[str, str]]:
    """Each stored-code object a case changed: signatures before and after, and the outcome.

    Before: the snapshot's signature (the outcome's ``base_signature``, else the
    live signature preflight read, else a capture in the case); after: the
    applied signature (or what a compensation restored).
    """
    found: dict[str, dict[str, str]] = {}

    def entry(name: str) -> dict[str, str]:
        return found.setdefault(name, {"object": name, "before": "-", "after": "-",
                                       "snapshot": "-", "outcome": "-"})

    for e in events:
        p = e.payload
        if e.kind == "ddl.captured" and p.get("object"):
            item = entry(str(p["object"]))
            if item["before"] == "-" and item["after"] == "-":  # a capture after the apply
                item["before"] = str(p.get("signature"))       # is the next base, not this one
        elif e.kind == "ddl.preflight" and isinstance(p.get("live"), Mapping):
            for name, sig in p["live"].items():
                if entry(str(name))["before"] == "-":
                    entry(str(name))["before"] = str(sig)
        elif e.kind == "ddl.object_applied" and p.get("object"):
            item = entry(str(p["object"]))
            item["after"] = str(p.get("applied_signature"))
            item["snapshot"] = str(p.get("snapshot_id") or "-")
        outcome = p.get("outcome")
        if isinstance(outcome, Mapping) and isinstance(outcome.get("evidence"), Mapping):
            for obj in _dicts(outcome["evidence"].get("objects")):
                if not obj.get("object"):
                    continue
                item = entry(str(obj["object"]))
                item["before"] = str(obj.get("base_signature") or item["before"])
                item["after"] = str(obj.get("applied_signature") or item["after"])
                item["snapshot"] = str(obj.get("base_snapshot_id") or item["snapshot"])
                item["outcome"] = str(outcome.get("status"))
    return list(found.values())


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>"
                   for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _pill(status: str | None) -> str:
    return f'<span class="pill {_outcome_class(status)}">{_e(status or "-")}</span>'


def render_html(case_id: str, events: Sequence[Event], snapshot: Mapping[str, Any] | None,
                *, verified: bool | None = None,
                plans: Sequence[Mapping[str, Any]] = ()) -> str:
    """The case as one self-contained HTML page (inline style, inline SVG, no script).

    ``plans``: the case's plans waiting for an approval (``capgate plan show`` form),
    each shown in full -- what an approver would sign.
    """
    intents = _intents(events, snapshot)
    entries = timeline(events)
    state = case_state((snapshot or {}).get("intents") or {}) if snapshot else "unknown"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>capgate case {_e(case_id)}</title>",
             '<meta name="viewport" content="width=device-width,initial-scale=1">',
             f"<style>{_CSS}</style></head><body>",
             f'<h1>Case <span class="mono" id="case-id">{_e(case_id)}</span></h1>',
             f'<p class="meta">state <b id="case-state">{_e(state)}</b> · {len(events)} '
             f"event(s) · {len(intents)} intent(s)"]
    if events:
        parts.append(f" · {_e(events[0].recorded_at)} → {_e(events[-1].recorded_at)}")
    if verified is not None:
        parts.append(" · chain " + ('<b class="good" id="chain">verified</b>' if verified
                                    else '<b class="bad" id="chain">DOES NOT VERIFY</b>'))
    parts.append("</p>")

    parts.append('<section id="timeline"><h2>Timeline</h2>')
    parts.append('<p class="meta">x: the event\'s place in the hash chain (seq); a bar is an '
                 'attempt from its start to its outcome; ◆ an approval. Colours: '
                 f'{_pill("applied_verified")} {_pill("rolled_back")} {_pill("unknown")}</p>')
    parts.append(_svg(events, intents))
    parts.append("</section>")

    parts.append('<section id="intents"><h2>Intents</h2>')
    parts.append(_table(
        ["intent", "operation", "by", "inputs", "attempts", "status", "outcome"],
        [[f'<span class="mono">{_e(i.intent_id)}</span>', _e(i.operation), _e(i.who),
          f'<span class="mono">{_e(compact(i.inputs))}</span>',
          _e(str(attempts(i.events))),
          _e(i.status), _pill(str(i.outcome.get("status")) if i.outcome else None)]
         for i in intents.values()], "intents"))
    parts.append("</section>")

    waiting = [p for p in plans if p.get("status") != "used"]
    parts.append('<section id="plans"><h2>Plans waiting for an approval</h2>')
    if waiting:
        for p in waiting:
            parts.append(f'<div class="plan" data-plan="{_e(p.get("plan_hash"))}">'
                         f'<p><span class="mono">{_e(p.get("plan_hash"))}</span> '
                         f'<b>{_e(p.get("status"))}</b></p>'
                         f'<pre>{_e(shown_plan_text(p))}</pre></div>')
    else:
        parts.append("<p>none</p>")
    parts.append("</section>")

    approvals = [e for e in events if e.kind == "approval_recorded"]
    parts.append('<section id="approvals"><h2>Approvals</h2>')
    if approvals:
        rows = []
        for e in approvals:
            a = (e.payload.get("case_state") or {}).get("last_approval") or {}
            rows.append([_e(e.recorded_at), _e(a.get("by")), _e(a.get("role")),
                         f'<span class="mono">{_e(a.get("plan_hash"))}</span>',
                         _e(a.get("expires_at"))])
        parts.append(_table(["at", "by", "role", "plan", "expires"], rows, "approvals"))
    else:
        parts.append("<p>none</p>")
    parts.append("</section>")

    parts.append('<section id="evidence"><h2>Evidence</h2>')
    for i in intents.values():
        if not i.outcome:
            continue
        o = i.outcome
        ev = o.get("evidence") or {}
        parts.append(f'<div class="evidence" data-intent="{_e(i.intent_id)}">'
                     f"<h3>{_e(i.operation)} <span class=\"mono\">{_e(i.intent_id[:8])}</span> "
                     f"{_pill(str(o.get('status')))}</h3>")
        if o.get("reason"):
            parts.append(f'<p class="bad reason">why: {_e(_reason(o["reason"]))}</p>')
        if isinstance(ev, Mapping):
            if "counts" in ev:
                parts.append(f"<p>rows affected per statement: "
                             f'<span class="mono">{_e(compact(ev["counts"]))}</span></p>')
            checks = _dicts(ev.get("verify"))
            if checks:
                parts.append(_table(
                    ["check", "expected", "actual", "ok"],
                    [[_e(c.get("name")), f'<span class="mono">{_e(compact(c.get("expected")))}'
                      "</span>", f'<span class="mono">{_e(compact(c.get("actual")))}</span>',
                      '<b class="good">yes</b>' if c.get("ok") else '<b class="bad">no</b>']
                     for c in checks], "checks"))
            replay = ev.get("replay")
            if isinstance(replay, Mapping) and replay.get("rows") is not None:
                parts.append("<p>replay (what the consuming query returned):</p>")
                parts.append(_table([str(c) for c in replay.get("columns") or []],
                                    [[_e(compact(v) if not isinstance(v, str) else v)
                                      for v in r] for r in replay["rows"]], "replay"))
            rest = {k: v for k, v in ev.items() if k not in ("counts", "verify", "replay")}
            if rest:
                parts.append(f'<details><summary>more evidence</summary><pre>'
                             f"{_e(json.dumps(rest, indent=2, default=str))}</pre></details>")
        parts.append("</div>")
    parts.append("</section>")

    decisions = [e for e in events if e.kind in RESUME_KINDS]
    parts.append('<section id="reconciliation"><h2>Reconciliation decisions</h2>')
    if decisions:
        rows = []
        for e in decisions:
            entry = next(x for x in entries if x.seq == e.seq)
            evidence = e.payload.get("evidence")
            rows.append([_e(e.recorded_at), _e(entry.actor), _e(e.kind),
                         f'<span class="mono">{_e((e.intent_id or "-")[:8])}</span>',
                         _e(entry.summary),
                         (f"<details><summary>evidence</summary><pre>"
                          f"{_e(json.dumps(evidence, indent=2, default=str))}</pre></details>"
                          if evidence else "")])
        parts.append(_table(["at", "by", "decision", "intent", "summary", "evidence"], rows,
                            "decisions"))
    else:
        parts.append("<p>none: no intent needed reconciling</p>")
    parts.append("</section>")

    parts.append('<section id="ddl"><h2>DDL signatures</h2>')
    ddl_rows = [[_e(o["object"]), f'<span class="mono">{_e(o["before"])}</span>',
                 f'<span class="mono">{_e(o["after"])}</span>',
                 f'<span class="mono">{_e(o["snapshot"])}</span>', _e(o["outcome"])]
                for o in ddl_objects(events)]
    if ddl_rows:
        parts.append(_table(["object", "before (snapshot)", "after (applied)", "snapshot",
                             "outcome"], ddl_rows, "ddl"))
    else:
        parts.append("<p>none: this case changed no stored code</p>")
    parts.append("</section>")

    parts.append('<section id="events"><h2>Every event</h2>')
    parts.append(_table(
        ["seq", "time", "actor", "event", "intent", "summary"],
        [[_e(str(x.seq)), _e(x.at), _e(x.actor), _e(x.kind),
          f'<span class="mono">{_e((x.intent_id or "-")[:8])}</span>',
          f"{_e(x.summary)}<details><summary>payload</summary><pre>"
          f"{_e(json.dumps(dict(e.payload), indent=2, default=str))}</pre></details>"]
         for x, e in zip(entries, events, strict=True)], "events"))
    parts.append("</section></body></html>")
    return "\n".join(parts)


# --- the resume report -----------------------------------------------------------------


def _text(value: Any) -> str:
    """A value for a person: strings as they are, everything else as JSON -- never a repr."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)


#: evidence keys in the order they weigh (strongest first), with how to say each
_EVIDENCE_ORDER = ("marker", "marker_row", "commit_outcome", "commit_outcome_detail",
                   "server_identity", "server_now", "terminated_session", "session",
                   "write_lock", "probe", "unreachable")


def evidence_line(evidence: Mapping[str, Any]) -> str:
    """The evidence that decided, strongest first, on one line of ``key: value`` parts."""
    parts: list[str] = []
    marker = evidence.get("marker")
    if marker == "present":
        row = evidence.get("marker_row") or {}
        parts.append(f"marker present (attempt {_text(row.get('attempt'))}, landed "
                     f"{_text(row.get('landed_at'))})")
    elif marker is not None:
        parts.append(f"marker {_text(marker)}")
    detail = evidence.get("commit_outcome_detail")
    if isinstance(detail, Mapping) and detail.get("probe"):
        xid = f"({_text(detail['xid'])})" if detail.get("xid") else ""
        parts.append(f"{_text(detail['probe'])}{xid} = "
                     f"{_text(evidence.get('commit_outcome') or 'no answer')}")
    elif evidence.get("commit_outcome"):
        parts.append(f"commit outcome {_text(evidence['commit_outcome'])}")
    identity = evidence.get("server_identity")
    server = evidence.get("server_now")
    if identity in ("same", "changed"):
        said = "same server" if identity == "same" else "server CHANGED"
        parts.append(said + (f" {_text(server)}" if isinstance(server, Mapping) else ""))
    for key in ("terminated_session", "session", "write_lock", "probe", "unreachable"):
        if evidence.get(key) not in (None, "", {}, []):
            parts.append(f"{key.replace('_', ' ')}: {_text(evidence[key])}")
    for key, value in evidence.items():  # what a newer executor adds is shown too
        if key not in _EVIDENCE_ORDER and key not in ("rule", "finished", "attempt") \
                and value not in (None, "", {}, []):
            parts.append(f"{key.replace('_', ' ')}: {_text(value)}")
    return "; ".join(parts)


def resume_lines(report: Mapping[str, Any]) -> list[str]:
    """``capgate resume``'s report for a person, from its JSON form (one intent a paragraph)."""
    case = report.get("case")
    intents = list(report.get("intents") or [])
    several = not isinstance(case, str)
    where = case if isinstance(case, str) else f"{len(case or [])} cases"
    out = [f"resume {where}: {len(intents)} in-flight intent(s)"
           + (" (dry run: nothing recorded or retried)" if report.get("dry_run") else "")]
    for i in intents:
        op = f"{i.get('operation_id')}@{i.get('version')}" if i.get("operation_id") else "?"
        in_case = f" case {i.get('case')}," if several else ""
        out.append(f"  intent {i.get('intent_id')}{in_case} {op}, attempt {i.get('attempt')}, "
                   f"found {i.get('status_found')}")
        evidence = i.get("evidence") or {}
        out.append(f"    {i.get('classification')}: {_text(evidence.get('rule', ''))}")
        brief = evidence_line(evidence)
        if brief:
            out.append(f"    evidence: {brief}")
        out.append(f"    action: {i.get('action')}"
                   + (f" -> {i.get('outcome')}" if i.get("outcome") else "")
                   + (f" ({_text(i.get('detail'))})" if i.get("detail") else ""))
    for c in report.get("changed_outside_case") or []:
        failed = [ch.get("name") for ch in c.get("checks", []) if not ch.get("ok")]
        out.append(f"  CHANGED OUTSIDE THE CASE: intent {c.get('intent_id')} "
                   f"{c.get('operation_id')}@{c.get('version')} ({_text(c.get('impact_key'))}): "
                   + (f"check(s) {', '.join(map(str, failed))} no longer hold" if failed
                      else f"cannot re-check: {_text(c.get('error'))}"))
    for case_id, rec in (report.get("recovery") or {}).items():
        point = rec.get("recovery_point") or {}
        chosen = point.get("chosen") or {}
        latest = point.get("latest_recorded") or {}
        cont = rec.get("continuation") or {}
        head = f"  {case_id}: " if several else "  "
        out.append(f"{head}recovery point: "
                   + (f"{chosen.get('operation_id')} intent {chosen.get('step')}" if chosen
                      else "none (no eligible step)")
                   + ("" if point.get("chosen_is_latest") or not latest else
                      f" (latest recorded {latest.get('operation_id')} intent "
                      f"{latest.get('step')} is not eligible: {_text(latest.get('why'))})")
                   + f"; continuation {cont.get('decision')}")
    if report.get("resolved"):
        out.append(f"ok: every intent resolved; {where} may continue")
    else:
        open_ = [i for i in intents if not i.get("resolved")]
        changed = report.get("changed_outside_case") or []
        out.append(f"NOT RESOLVED: {len(open_)} intent(s) open"
                   + (f", {len(changed)} target(s) changed outside the case" if changed else "")
                   + "; the case may not continue (see `capgate ledger show`)")
    return out
