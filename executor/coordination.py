"""Coordination decisions: a second case touching a held target, recorded in both ledgers.

A case holds the impact keys of its writes and plans (:mod:`executor.claims`,
``case_claim_seconds``).  When another case touches a held key, its call is
refused with :class:`~registry.errors.CoordinationRequired` and a
*coordination decision* is recorded -- in the asking case's chain and in the
holding case's chain, because each case's record must say what happened to
it: who holds, who asks, which key, under which fencing token.

Why the decision lives in the chains (and not in a table of its own): the
chains are what ``ledger verify`` proves and what a person reads with
``capgate ledger show``.  Each case keeps the decisions it is part of in its
case state under ``coordination:<decision id>``, so both the "record once"
rule and the "decide once" rule are checked inside the append that records
them (the append's ``guard`` sees the case state in the same transaction).

The decision id is derived, not drawn: ``(asking case, holding case, key,
holder's token)``.  Every refusal of the same ask against the same hold names
the same decision, so an agent retrying a refused call records nothing new;
a new hold (the key released and claimed again moves the token on) is a new
decision.

Events (case-level, no intent):

* ``coordination_requested`` -- in both chains, ``role`` ``asker`` / ``holder``;
* ``coordination_decided`` -- in both chains: ``wait``, ``hand_over``,
  ``override`` (a person's, signed with their approver key), or ``released``
  (the holder gave the key back before anyone decided);
* ``continuation`` -- in the asker's chain with every decision: ``granted``
  (hand over, override, released) or ``withheld`` (wait).

The person's side (deciding, closing and releasing a case) is
:mod:`executor.cases`.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from capgate.registry.errors import DecisionMade, LedgerError

if TYPE_CHECKING:
    from capgate.executor.ledger import Ledger

__all__ = ["CONTINUATION", "DECIDED", "ENTRY_PREFIX", "REQUESTED", "Recorded", "decision_id",
           "entries", "entry_key", "record_decision", "record_request"]

ENTRY_PREFIX = "coordination:"
"""Case-state key prefix of a decision the case takes part in."""
REQUESTED = "coordination_requested"
DECIDED = "coordination_decided"
CONTINUATION = "continuation"
"""The event every grant or withholding of a case's continuation is recorded as (issue 17)."""


def decision_id(asker_case: str, holder_case: str, impact_key: str, token: int | None) -> str:
    """The decision for this ask against this hold: the same on every refusal of it."""
    digest = hashlib.sha256(
        f"{asker_case}\n{holder_case}\n{impact_key}\n{token}".encode()).hexdigest()
    return "cd-" + digest[:20]


def entry_key(decision: str) -> str:
    return ENTRY_PREFIX + decision


def entries(state: Mapping[str, Any] | None) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(decision id, entry)`` of every coordination decision in a case state."""
    case = (state or {}).get("case") or {}
    for key, value in case.items():
        if key.startswith(ENTRY_PREFIX) and isinstance(value, Mapping):
            yield key[len(ENTRY_PREFIX):], value


class Recorded(Exception):
    """Internal: the case already records this decision (the append is skipped)."""


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _absent(key: str) -> Callable[[Mapping[str, Any] | None], None]:
    def guard(state: Mapping[str, Any] | None) -> None:
        if state is not None and (state.get("case") or {}).get(key) is not None:
            raise Recorded
    return guard


def record_request(ledger: Ledger, details: Mapping[str, Any], *, asker_who: str,
                   asker_operation: str, refused_intent: str | None, ttl: float,
                   via: str) -> str:
    """Record the coordination decision a :class:`CoordinationRequired` names, once per chain.

    ``details`` are the refusal's details (the holder's case, intent,
    operation, token and expiry; the key; the decision id).  Returns the
    decision id.  A chain that already records it is left alone; a ledger
    failure here never hides the refusal itself (the caller suppresses it).
    """
    decision = str(details["decision_id"])
    asker = str(details["requested_by_case"])
    holder = str(details["case_id"])
    key = str(details["impact_key"])
    body = {
        "decision_id": decision, "keys": [key],
        "holder": {"case": holder, "intent_id": details.get("intent_id"),
                   "operation_id": details.get("operation_id"),
                   "process": details.get("holder"), "token": details.get("token"),
                   "expires_in_seconds": round(float(details.get("expires_in") or 0.0), 3)},
        "asker": {"case": asker, "who": asker_who, "operation_id": asker_operation,
                  "refused_intent": refused_intent, "via": via},
        "requested_at": _now(),
    }
    entry = {"status": "requested", "keys": [key], "holder_case": holder, "asker_case": asker,
             "requested_by": asker_who, "asker_operation": asker_operation,
             "holder_token": details.get("token"), "holder_intent": details.get("intent_id"),
             "ttl": float(ttl), "requested_at": body["requested_at"]}
    for case, role in ((asker, "asker"), (holder, "holder")):
        try:
            ledger.append(case, REQUESTED, {
                "coordination": {**body, "role": role},
                "case_state": {entry_key(decision): {**entry, "role": role}}},
                guard=_absent(entry_key(decision)))
        except Recorded:
            continue
    return decision


def _undecided(key: str) -> Callable[[Mapping[str, Any] | None], None]:
    def guard(state: Mapping[str, Any] | None) -> None:
        found = ((state or {}).get("case") or {}).get(key)
        if not isinstance(found, Mapping):
            raise LedgerError(f"the case no longer records decision {key[len(ENTRY_PREFIX):]}")
        if found.get("status") != "requested":
            raise DecisionMade(
                f"coordination decision {key[len(ENTRY_PREFIX):]} was already decided "
                f"({found.get('decision')} by {found.get('decided_by')}); a decision is made "
                "once", decision_id=key[len(ENTRY_PREFIX):], decision=found.get("decision"),
                decided_by=found.get("decided_by"))
    return guard


def record_decision(ledger: Ledger, entry: Mapping[str, Any], decision: str, *,
                    decision_id_: str, by: str, reason: str, proof: Mapping[str, Any] | None,
                    tokens: Mapping[str, int] | None, within: Callable[[Any], None] | None,
                    note: str = "") -> None:
    """Record ``decision`` in the asker's chain (with its continuation), then the holder's.

    The asker's append checks the decision is still undecided (DecisionMade
    otherwise) and runs ``within`` -- the claim's hand-over -- in its own
    transaction: the record and the hand-over commit together or not at all.
    """
    key = entry_key(decision_id_)
    decided_at = _now()
    keys = [str(k) for k in entry.get("keys") or []]
    body: dict[str, Any] = {
            "decision_id": decision_id_, "decision": decision, "by": by, "reason": reason,
            "keys": keys, "holder_case": entry.get("holder_case"),
            "asker_case": entry.get("asker_case"), "tokens": dict(tokens or {}),
            "decided_at": decided_at, "proof": dict(proof) if proof else None}
    if note:
        body["note"] = note
    decided = {"status": "decided", "decision": decision, "decided_by": by,
               "decided_at": decided_at, "reason": reason, "tokens": dict(tokens or {})}
    granted = decision != "wait"
    asker = str(entry["asker_case"])
    holder = str(entry["holder_case"])
    why = {"wait": f"the person decided the case waits for case {holder!r} to finish with "
                   f"{', '.join(keys)}",
           "hand_over": f"case {holder!r} handed {', '.join(keys)} over",
           "override": f"{by} overrode case {holder!r}'s hold: {reason}",
           "released": f"case {holder!r} released {', '.join(keys)} before a "
                       "decision"}[decision]
    ledger.append_many(asker, [
        (DECIDED, {"coordination": {**body, "role": "asker"},
                   "case_state": {key: {**dict(entry), **decided, "role": "asker"}}}, None),
        (CONTINUATION, {"continuation": {
            "decision": "granted" if granted else "withheld", "after": "coordination",
            "decision_id": decision_id_, "why": why, "keys": keys, "at": decided_at}},
         None)], guard=_undecided(key), within=within)
    holder_entry = {**dict(entry), **decided, "role": "holder"}
    with contextlib.suppress(Recorded):  # the holder's chain has it (a retried decision)
        ledger.append(holder, DECIDED, {"coordination": {**body, "role": "holder"},
                                        "case_state": {key: holder_entry}},
                      guard=_not_decided(key))


def _not_decided(key: str) -> Callable[[Mapping[str, Any] | None], None]:
    def guard(state: Mapping[str, Any] | None) -> None:
        found = ((state or {}).get("case") or {}).get(key)
        if isinstance(found, Mapping) and found.get("status") == "decided":
            raise Recorded
    return guard


def open_requests(state: Mapping[str, Any] | None, *, role: str
                  ) -> list[tuple[str, Mapping[str, Any]]]:
    """The case's undecided decisions in which it plays ``role``."""
    return [(d, e) for d, e in entries(state)
            if e.get("role") == role and e.get("status") == "requested"]


def keys_of(found: Sequence[tuple[str, Mapping[str, Any]]]) -> set[str]:
    return {str(k) for _, e in found for k in (e.get("keys") or [])}
