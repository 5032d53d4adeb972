"""A case's life beyond its calls: its claims, coordination decisions, holds and close.

The library behind ``capgate case`` (and the MCP server and API):

* :func:`show` -- what the case holds (claims, with tokens and expiry), the
  coordination decisions it takes part in, its registered symptoms and holds;
* :func:`decide` -- a person's coordination decision on an asking case:
  ``wait``, ``hand_over`` or ``override`` (with a reason), signed with their
  approver key.  Handing a key over (or overriding) moves the claim to the
  asking case with a new fencing token, compare-and-swapped against the hold
  that was checked and only while the holding case has no open intent -- so
  the old holder cannot have a write in flight that would land after it;
* :func:`close` / :func:`release` -- give the case's claims back (all, or the
  keys named), refused while the case has open work; undecided requests
  against the released keys are recorded as ``released`` in both ledgers;
* :func:`renew` -- extend the case's claims (every plan or write of the case
  renews them too);
* :func:`resolve_hold` -- a person accepts a changed symptom or re-opens the
  case from it (:mod:`executor.symptoms`), signed.

Who may close or release: an identity that acted in the case (its intents'
callers, its symptom's registrar), or a person signing with their key --
never an agent of another case, which would free targets it is waiting for.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from capgate.executor import budget, coordination, symptoms
from capgate.executor.claims import ClaimStore
from capgate.executor.context import TERMINAL
from capgate.registry.canonical import canonical_bytes
from capgate.registry.errors import (
    DecisionMade,
    DecisionNotAuthenticated,
    HolderBusy,
    NotInCase,
    ReconciliationRequired,
    SelfDecision,
    UnknownCase,
    UnknownDecision,
    UsageError,
)

if TYPE_CHECKING:
    from capgate.executor.approvals import SigningKey
    from capgate.executor.grants import Grants
    from capgate.executor.ledger import Ledger
    from capgate.executor.runtime import HasRuntime

__all__ = ["DECISIONS", "close", "decide", "release", "renew", "resolve_hold", "show", "sign"]

DECISIONS = ("wait", "hand_over", "override")
"""What a person may decide when a case asks for a held target."""


def _now() -> str:
    return datetime.now(UTC).isoformat()


def sign(grants: Grants, by: str, key: SigningKey, fields: Mapping[str, Any]) -> dict[str, Any]:
    """``by``'s signature of a decision: the key must be the one the grants name for them."""
    if not by or not by.strip():
        raise UsageError("say who decides: --by NAME", field="by")
    principal = grants.principal(by)
    if principal.approval_key is None:
        raise DecisionNotAuthenticated(
            f"{by!r} has no approval_key in the grants file ({grants.source}): a decision is "
            "signed by the person who makes it", by=by, problem="no_key")
    if key.public_text != principal.approval_key:
        raise DecisionNotAuthenticated(
            f"the key {key.source} is not {by!r}'s (the grants name another approval_key)",
            by=by, problem="wrong_key")
    statement = {"capgate": "decision/1", **{k: str(v) for k, v in fields.items()}}
    signature = base64.b64encode(key.key.sign(canonical_bytes(statement))).decode()
    return {"signed_by": by, "public_key": key.public_text, "signature": signature,
            "statement": statement}


def _state(ledger: Ledger, case_id: str) -> Mapping[str, Any]:
    state = ledger.verified_snapshot(case_id)
    if state is None:
        raise UnknownCase(f"no case {case_id!r} in the ledger", case_id=case_id)
    return state


def _open_intents(state: Mapping[str, Any]) -> list[str]:
    return sorted(i for i, s in (state.get("intents") or {}).items()
                  if s.get("status") not in TERMINAL)


def show(executor: HasRuntime, case_id: str) -> dict[str, Any]:
    """The case's claims, coordination decisions, symptoms and holds, as recorded."""
    rt = executor.rt
    try:
        state = _state(rt.ledger, case_id)
    except UnknownCase:
        if not ClaimStore(rt.ledger).held_by(case_id):
            raise
        state = {}  # claims without a record: shown, so that a person can release them
    intents = state.get("intents") or {}
    holds = [{"hold": i, **dict(s.get("symptom") or {})} for i, s in intents.items()
             if symptoms.is_hold(s) and s.get("status") not in TERMINAL]
    return {
        "case": case_id,
        "claims": [{k: v for k, v in c.items() if k != "acquired_at"}
                   for c in ClaimStore(rt.ledger).held_by(case_id)],
        "decisions": [{"decision_id": d, **dict(e)} for d, e in coordination.entries(state)],
        "symptoms": [{"impact_key": k, **{f: e.get(f) for f in (
            "operation_id", "version", "digest", "registered_by", "registered_at",
            "writing_intent")}} for k, e in symptoms.entries(state).items()],
        "holds": holds,
        "open_intents": [i for i in _open_intents(state) if not symptoms.is_hold(intents[i])],
        "closed": (state.get("case") or {}).get("closed"),
    }


def decide(executor: HasRuntime, case_id: str, decision_id: str, *, decision: str, by: str,
           key: SigningKey, reason: str = "") -> dict[str, Any]:
    """A person's coordination decision on ``case_id`` (the asking case), signed by ``by``.

    ``wait``: the asking case waits; its calls stay refused while the hold
    lasts.  ``hand_over``: the holding case is done with the keys; they move
    to the asking case.  ``override``: the asking case goes ahead although the
    holder is not done (``reason`` required); the keys move too.  Recorded in
    both cases' ledgers with the person's signature; the asking case's
    ``continuation`` says granted or withheld.
    """
    rt = executor.rt
    ledger = rt.ledger
    if decision not in DECISIONS:
        raise UsageError(f"decision must be one of {', '.join(DECISIONS)}, not {decision!r}",
                         field="decision")
    if decision == "override" and not reason.strip():
        raise UsageError("an override needs the reason it overrides the holder (--reason)",
                         field="reason")
    state = _state(ledger, case_id)
    entry = (state.get("case") or {}).get(coordination.entry_key(decision_id))
    if not isinstance(entry, Mapping):
        raise UnknownDecision(f"case {case_id!r} records no coordination decision "
                              f"{decision_id!r} (`capgate case show {case_id}`)",
                              case=case_id, decision_id=decision_id)
    if entry.get("role") != "asker":
        raise UnknownDecision(
            f"case {case_id!r} holds the target in decision {decision_id}; it is decided on "
            f"the asking case {entry.get('asker_case')!r}", case=case_id,
            decision_id=decision_id, asker_case=entry.get("asker_case"))
    if entry.get("status") != "requested":
        raise DecisionMade(f"coordination decision {decision_id} was already decided "
                           f"({entry.get('decision')} by {entry.get('decided_by')})",
                           decision_id=decision_id, decision=entry.get("decision"))
    if by == entry.get("requested_by"):
        raise SelfDecision(f"{by!r} asked for the held target; another person decides",
                           by=by, decision_id=decision_id)
    proof = sign(rt.grants, by, key, {"decision_id": decision_id, "decision": decision,
                                      "asker_case": case_id,
                                      "holder_case": entry.get("holder_case"),
                                      "reason": reason})
    tokens: dict[str, int] = {}
    within = None
    if decision in ("hand_over", "override"):
        within, tokens = _hand_over(ledger, case_id, entry)
    coordination.record_decision(ledger, entry, decision, decision_id_=decision_id, by=by,
                                 reason=reason, proof=proof, tokens=tokens, within=within)
    return {"case": case_id, "decision_id": decision_id, "decision": decision, "by": by,
            "reason": reason, "keys": list(entry.get("keys") or []), "tokens": tokens,
            "holder_case": entry.get("holder_case")}


def _hand_over(ledger: Ledger, asker: str, entry: Mapping[str, Any]
               ) -> tuple[Callable[[Any], None], dict[str, int]]:
    """Check the hold may change hands now; return the transfer to run in the record's
    transaction and the tokens it gives (HolderBusy when the holder is mid-call or the
    hold changed)."""
    holder = str(entry.get("holder_case"))
    holder_state = ledger.verified_snapshot(holder) or {}
    busy = [i for i in _open_intents(holder_state)
            if not symptoms.is_hold((holder_state.get("intents") or {})[i])]
    if busy:
        raise HolderBusy(
            f"case {holder!r} is in the middle of a call (intent {busy[0]}); a target is "
            "handed over between the holder's calls -- decide again once it settled "
            f"(`capgate resume {holder}` if its executor died)", holder_case=holder,
            intents=busy)
    store = ClaimStore(ledger)
    tokens: dict[str, int] = {}
    plans: list[tuple[str, float | None, int | None]] = []
    for key in entry.get("keys") or []:
        now = store.current(str(key))
        if now is not None and now["case_id"] == holder and now["expires_in"] > 0:
            if now["token"] != entry.get("holder_token"):
                raise HolderBusy(f"case {holder!r} holds {key!r} under another claim "
                                 f"(token {now['token']}, the decision named "
                                 f"{entry.get('holder_token')}): the hold changed",
                                 holder_case=holder, impact_key=key)
            plans.append((str(key), float(now["acquired_at"]), int(now["token"])))
        elif now is not None and now["case_id"] == asker and now["expires_in"] > 0:
            tokens[str(key)] = int(now["token"])  # the asking case holds it already
        elif now is None or now["case_id"] is None or now["expires_in"] <= 0:
            # free meanwhile: it is simply handed on
            plans.append((str(key), None, None if now is None else int(now["token"])))
        else:
            raise HolderBusy(f"{key!r} is held by case {now['case_id']!r} now, not by "
                             f"{holder!r}", holder_case=now["case_id"], impact_key=key)
    ttl = float(entry.get("ttl") or 0.0)
    for key, _, token in plans:
        tokens[key] = (token or 0) + 1

    def transfer(tx: Any) -> None:
        for key, acquired, token in plans:
            moved = store.transfer_on(tx, key, from_case=holder, token=token,
                                      acquired_at=acquired, to_case=asker,
                                      operation_id=str(entry.get("asker_operation") or ""),
                                      ttl=ttl)
            if moved is None or moved != tokens[key]:
                raise HolderBusy(f"case {holder!r} claimed {key!r} again while the decision "
                                 "was being recorded; decide again", holder_case=holder,
                                 impact_key=key)

    return transfer, tokens


def _actors(ledger: Ledger, case_id: str, state: Mapping[str, Any]) -> set[str]:
    """The identities that acted in the case: its calls' callers, its plans' requesters,
    its symptom's registrar."""
    found = {str(s.get("who")) for s in ledger.intents(case_id).values() if s.get("who")}
    found |= {str(e.get("requester")) for k, e in (state.get("case") or {}).items()
              if k.startswith("plan:") and isinstance(e, Mapping) and e.get("requester")}
    found |= {str(e.get("registered_by")) for e in symptoms.entries(state).values()
              if e.get("registered_by")}
    found |= {str(e.get("requested_by")) for _, e in coordination.entries(state)
              if e.get("role") == "asker" and e.get("requested_by")}
    return found


def _may_free(executor: HasRuntime, case_id: str, state: Mapping[str, Any], by: str,
              key: SigningKey | None, what: str) -> dict[str, Any] | None:
    if not by:
        raise UsageError("say who does it: --by NAME (or --as)", field="by")
    if key is not None:
        return sign(executor.rt.grants, by, key, {"case": case_id, "action": what})
    if by in _actors(executor.rt.ledger, case_id, state):
        return None
    raise NotInCase(f"{by!r} did not act in case {case_id!r}; only its own callers, or a "
                    "person signing with their key (--key), may " + what,
                    case=case_id, by=by)


def release(executor: HasRuntime, case_id: str, keys: Sequence[str] | None = None, *,
            by: str, key: SigningKey | None = None, closing: bool = False
            ) -> dict[str, Any]:
    """Give back the case's claims (``keys``, or all): ``claims_released``.

    Refused (ReconciliationRequired) while the case has open work: a claim
    given back under an in-flight write would let another case in before it
    settled.  A key the case claimed again meanwhile (a call that renewed it
    after it was read) is kept and reported.
    """
    rt = executor.rt
    ledger = rt.ledger
    store = ClaimStore(ledger)
    try:
        state = _state(ledger, case_id)
    except UnknownCase:
        # claims the ledger holds for a case it has no record of (taken before a plan
        # was recorded in its case): a person signing with their key may give them back,
        # and the release starts the case's record
        if not store.held_by(case_id):
            raise
        if key is None:
            raise NotInCase(f"case {case_id!r} has no record in the ledger but holds "
                            "claims; a person signing with their key (--as NAME --key "
                            "FILE) may give them back", case=case_id, by=by) from None
        state = {}
    busy = _open_intents(state)
    if busy:
        raise ReconciliationRequired(
            f"case {case_id!r} has {len(busy)} open intent(s) or hold(s); settle them first "
            f"(`capgate resume {case_id}`) -- claims are not given back under open work",
            case=case_id, intents=busy)
    proof = _may_free(executor, case_id, state, by, key,
                      "close the case" if closing else "release its claims")
    held = {c["impact_key"]: c for c in store.held_by(case_id)}
    wanted = sorted(held) if keys is None else sorted(set(keys))
    unknown = [k for k in wanted if k not in held]
    if unknown and not closing:
        raise UsageError(f"case {case_id!r} holds no claim on {', '.join(unknown)} "
                         f"(it holds: {', '.join(sorted(held)) or 'none'})", field="key",
                         case=case_id)
    released: list[str] = []
    kept: list[str] = []
    with ledger.transaction("release a case's impact claims") as tx:
        for k in wanted:
            c = held.get(k)
            if c is not None and store.release_case_on(tx, case_id, k, token=int(c["token"]),
                                                       acquired_at=float(c["acquired_at"])):
                released.append(k)
            elif c is not None:
                kept.append(k)
    at = _now()
    payload: dict[str, Any] = {"claims": {"released": released, "kept": kept, "by": by,
                                          "at": at, "proof": proof}}
    if closing:
        payload["case_state"] = {"closed": {"by": by, "at": at, "released": released}}
    ledger.append(case_id, "case_closed" if closing else "claims_released", payload)
    # undecided asks against what was released: the holder let go before anyone decided
    after = ledger.snapshot(case_id)
    for decision, entry in coordination.open_requests(after, role="holder"):
        if set(entry.get("keys") or []) & set(released):
            asker = ledger.snapshot(str(entry.get("asker_case")))
            asked = (asker or {}).get("case", {}).get(coordination.entry_key(decision))
            if isinstance(asked, Mapping) and asked.get("status") == "requested":
                with contextlib.suppress(DecisionMade):
                    coordination.record_decision(
                        ledger, asked, "released", decision_id_=decision, by=by,
                        reason=f"case {case_id!r} gave the key back", proof=proof,
                        tokens=None, within=None)
    if closing:
        budget.SlotStore(ledger).drop_case(case_id, rt.connectors.names())
    return {"case": case_id, "released": released, "kept": kept, "by": by, "at": at,
            "closed": closing}


def close(executor: HasRuntime, case_id: str, *, by: str,
          key: SigningKey | None = None) -> dict[str, Any]:
    """Close the case: every claim given back, its budget slots dropped, ``case_closed``.

    A later call in the case claims again (the case works on; its record
    shows the close and what followed).
    """
    return release(executor, case_id, None, by=by, key=key, closing=True)


def renew(executor: HasRuntime, case_id: str, seconds: float) -> dict[str, Any]:
    """Extend every unexpired claim of the case to at least ``seconds`` from now."""
    if not seconds > 0:
        raise UsageError("renew by a positive number of seconds", field="seconds")
    _state(executor.rt.ledger, case_id)
    renewed = ClaimStore(executor.rt.ledger).renew_case(case_id, seconds)
    return {"case": case_id, "renewed": renewed, "seconds": seconds}


def resolve_hold(executor: HasRuntime, case_id: str, hold_id: str, *, decision: str,
                 by: str, key: SigningKey, note: str = "") -> dict[str, Any]:
    """A person accepts a changed symptom (``accepted``) or re-opens the case from it
    (``reopened``), signed; the case may continue (see :func:`symptoms.resolve_hold`)."""
    proof = sign(executor.rt.grants, by, key, {"case": case_id, "hold": hold_id,
                                               "decision": decision, "note": note})
    return symptoms.resolve_hold(executor.rt.ledger, case_id, hold_id, decision=decision,
                                 by=by, proof=proof, note=note)
