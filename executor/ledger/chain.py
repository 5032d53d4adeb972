"""The ledger's pure part: events, digests, the snapshot reducer and chain checks.

Nothing here touches a database.  ``executor.ledger`` stores what this module
computes, and ``verify`` replays stored rows through the same functions, so the
code that wrote a chain and the code that checks it cannot drift apart.

A case's chain is a list of events with ``seq`` 0, 1, 2, ...; each event's
``digest`` is the canonical hash (RFC 8785, SHA-256) of its fields including
``prev_digest``, the digest of the event before it (:data:`GENESIS_DIGEST` for
seq 0).

Format 2 (issue 13).  The case snapshot is ``fold(events)`` over the *open*
intents only, plus the case's own state: an intent that reaches a terminal
status leaves the snapshot (its outcome stays in its events, read by index
when a replay needs it), so appending costs the same on call 600 of a case as
on call 1.  Each event also carries ``state_digest``, the digest of the
snapshot's state after it (:func:`state_digest`), and its own digest covers
it: a process that continues a case checks, in O(1), that the stored snapshot
is the state the chain's head event names (:func:`head_matches`).  Events
written by format 1 have no ``state_digest`` and hash as they always did.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from capgate.registry.canonical import (
    canonical_bytes,
    canonical_hash,
    object_text,
    scalar_text,
)
from capgate.registry.canonical import (
    canonical_text as canonical_text,  # re-exported: the ledger's stored text
)
from capgate.registry.errors import LedgerError

GENESIS_DIGEST: Final = "sha256:" + "0" * 64
"""The ``prev_digest`` of every case's first event (seq 0)."""

TERMINAL_STATUSES: Final = frozenset({"observed", "reconciled", "escalation_resolved"})
"""Intent statuses (last event kinds) after which an intent needs nothing more.

Every other status is open -- ``prepared``, ``attempt_started``, ``escalated``
and any kind this module has never heard of.  Open is the fail-closed default:
an unknown status keeps the case open until ``resume`` settles it, so a new
event kind can never silently let a case continue past an unresolved intent.
Use :func:`is_open_status` rather than testing membership of a list of open
statuses, which could not be complete.
"""

LEDGER_FORMAT: Final = 2
"""The snapshot and event format this code writes (see the module docstring)."""

RESERVED_INTENT_KEYS: Final = frozenset({"status", "last_seq"})
"""Keys the reducer sets on each intent itself; ``payload["state"]`` may not use them."""

FINDING_KINDS: Final = (
    "payload_edited",
    "digest_broken",
    "chain_broken",
    "event_reordered",
    "event_missing",
    "case_missing",
    "head_mismatch",
    "snapshot_mismatch",
    "state_mismatch",
    "mac_mismatch",
    "mac_missing",
    "case_deleted",
    "case_rolled_back",
    "anchor_broken",
)
"""Every ``Finding.kind`` that :func:`check_case` reports, in the order of the chain checks.

* ``payload_edited`` -- an event's content (payload, kind, intent, time, link)
  no longer hashes to its digest, while its successor still names that digest.
* ``digest_broken`` -- an event's stored digest was changed: its content still
  hashes to the value its successor (or the case head) names.
* ``chain_broken`` -- an event's ``prev_digest`` is not the digest of the event
  before it (a forged, replaced or renumbered event).
* ``event_reordered`` -- an intact event sits at another ``seq`` than the one it
  was recorded with (its digest matches only under its original position).
* ``event_missing`` -- a seq is absent: a gap in the chain, or the case head
  names events after the last stored one (the tail was deleted).
* ``case_missing`` -- events exist for a case that has no ``cg_cases`` row.
* ``head_mismatch`` -- the case row's head seq or digest is not the last event's.
* ``snapshot_mismatch`` -- the stored snapshot is not ``fold(events)``.
* ``state_mismatch`` -- an event's ``state_digest`` is not the digest of the state
  the chain folds to at that event (the reducer was bypassed when it was written).
* ``mac_mismatch`` / ``mac_missing`` -- with an HMAC key: the head's MAC is wrong
  or absent, so the chain was rewritten (or written) without the key.
* ``case_deleted`` / ``case_rolled_back`` -- against an anchor (``capgate ledger
  anchor``): a case the anchor names is gone, or its chain no longer holds the
  head the anchor recorded (deleted events, or an older copy restored).
* ``anchor_broken`` -- the anchors recorded in the store do not chain, or one's
  MAC or digest does not hold.
"""


def is_open_status(status: str) -> bool:
    """True unless ``status`` is terminal: unknown statuses count as open (fail closed)."""
    return status not in TERMINAL_STATUSES


def format_time(moment: datetime) -> str:
    """A timezone-aware instant as fixed-width ISO-8601 UTC text (sorts like time)."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise LedgerError(
            f"naive datetime {moment.isoformat()} given; the ledger needs timezone-aware UTC "
            "times (use datetime.now(UTC))"
        )
    # what strftime("%Y-%m-%dT%H:%M:%S.%fZ") prints, at a third of its cost
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def parse_time(text: str) -> datetime:
    """Inverse of :func:`format_time`."""
    return datetime.fromisoformat(text).astimezone(UTC)


@dataclass(frozen=True, slots=True)
class Event:
    """One recorded boundary of a case: what happened, chained to what came before."""

    case_id: str
    seq: int
    """Position in the case's chain, from 0 without gaps."""
    kind: str
    """What happened (``prepared``, ``attempt_started``, ``observed``, ...); for an
    intent event it becomes the intent's status in the snapshot."""
    intent_id: str | None
    """The intent the event belongs to, or None for an event about the case only."""
    payload: Mapping[str, Any] = field(hash=False)
    """Plain JSON data.  ``payload["case_state"]`` and (for intent events)
    ``payload["state"]`` are merged into the snapshot by :func:`apply_event`."""
    prev_digest: str
    """The digest of the event at ``seq - 1`` (:data:`GENESIS_DIGEST` for seq 0)."""
    digest: str
    """:func:`event_digest` of this event's fields."""
    recorded_at: str
    """ISO-8601 UTC text exactly as hashed; :attr:`recorded_time` parses it."""
    state_digest: str | None = None
    """Format 2: :func:`state_digest` of the snapshot after this event (covered by
    ``digest``); None for an event written by format 1."""

    @property
    def recorded_time(self) -> datetime:
        return parse_time(self.recorded_at)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (``capgate ledger show --json``)."""
        return {
            "case_id": self.case_id,
            "seq": self.seq,
            "kind": self.kind,
            "intent_id": self.intent_id,
            "payload": dict(self.payload),
            "prev_digest": self.prev_digest,
            "digest": self.digest,
            "recorded_at": self.recorded_at,
            "state_digest": self.state_digest,
        }


def event_digest(
    *,
    case_id: str,
    seq: int,
    kind: str,
    intent_id: str | None,
    payload: Mapping[str, Any],
    prev_digest: str,
    recorded_at: str,
    state_digest: str | None = None,
) -> str:
    """The canonical hash that chains an event: it covers every field, including the link.

    A format-2 event's ``state_digest`` is covered too; a format-1 event (None)
    hashes exactly as format 1 did, so old chains keep verifying.
    """
    fields: dict[str, Any] = {
        "case_id": case_id,
        "seq": seq,
        "kind": kind,
        "intent_id": intent_id,
        "payload": payload,
        "prev_digest": prev_digest,
        "recorded_at": recorded_at,
    }
    if state_digest is not None:
        fields["state_digest"] = state_digest
    return canonical_hash(fields)


def digest_of(event: Event, *, seq: int | None = None) -> str:
    """Recompute ``event``'s digest (optionally as if it sat at another ``seq``)."""
    return event_digest(
        case_id=event.case_id,
        seq=event.seq if seq is None else seq,
        kind=event.kind,
        intent_id=event.intent_id,
        payload=event.payload,
        prev_digest=event.prev_digest,
        recorded_at=event.recorded_at,
        state_digest=event.state_digest,
    )


def head_mac(key: bytes, head_digest: str) -> str:
    """HMAC-SHA256 of the chain head: rewriting a chain consistently needs the key."""
    return hmac.new(key, head_digest.encode("ascii"), hashlib.sha256).hexdigest()


# Built from parts: a payload (or a snapshot's intents) is serialised once and reused
# for the stored text, the event digest and the state digest.
_object_text = object_text
_scalar = scalar_text


def event_digest_of_text(*, case_id: str, seq: int, kind: str, intent_id: str | None,
                         payload_text: str, prev_digest: str, recorded_at: str,
                         state_digest: str | None = None) -> str:
    """:func:`event_digest`, with the payload already in canonical text (the same bytes)."""
    parts = {"case_id": _scalar(case_id), "seq": _scalar(seq), "kind": _scalar(kind),
             "intent_id": _scalar(intent_id), "payload": payload_text,
             "prev_digest": _scalar(prev_digest), "recorded_at": _scalar(recorded_at)}
    if state_digest is not None:
        parts["state_digest"] = _scalar(state_digest)
    try:
        data = _object_text(parts).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: let the reference implementation judge
        return event_digest(case_id=case_id, seq=seq, kind=kind, intent_id=intent_id,
                            payload=json.loads(payload_text), prev_digest=prev_digest,
                            recorded_at=recorded_at, state_digest=state_digest)
    return "sha256:" + hashlib.sha256(data).hexdigest()


_STATE_KEYS = frozenset({"case_id", "case", "intents", "last", "intent_count",
                         "head_seq", "head_digest"})


def state_parts(state: Mapping[str, Any], before: Mapping[str, Any] | None = None,
                before_parts: Mapping[str, str] | None = None
                ) -> tuple[dict[str, str] | None, str]:
    """The state's members as canonical texts (None for a state of unknown shape), and
    its :func:`state_digest` -- each part serialised once.

    ``before`` / ``before_parts``: the state this one was reduced from and its parts;
    a member :func:`apply_event` carried over unchanged (the same object) keeps its text.
    """
    if set(state) - _STATE_KEYS:
        return None, state_digest(state)

    def text(name: str) -> str:
        value = state.get(name)
        if before is not None and before_parts is not None and name in before_parts \
                and before.get(name) is value:
            return before_parts[name]
        return canonical_text(value)

    parts = {"case_id": _scalar(state["case_id"]), "case": text("case"),
             "intents": text("intents"), "last": text("last"),
             "intent_count": _scalar(state.get("intent_count"))}
    try:
        data = _object_text(parts).encode("utf-8")
    except UnicodeEncodeError:
        return None, state_digest(state)
    return parts, "sha256:" + hashlib.sha256(data).hexdigest()


def snapshot_text(state: Mapping[str, Any], parts: Mapping[str, str] | None) -> str:
    """The snapshot's canonical text, reusing :func:`state_parts` (its head added)."""
    if parts is None:
        return canonical_text(state)
    return _object_text(dict(parts, head_seq=_scalar(state["head_seq"]),
                             head_digest=_scalar(state["head_digest"])))


def normalise_payload_text(payload: Mapping[str, Any], *,
                           intent_id: str | None) -> tuple[dict[str, Any], str]:
    """:func:`normalise_payload`, and the payload's canonical text (serialised once)."""
    if not isinstance(payload, Mapping):
        raise LedgerError(f"an event payload must be a JSON object, not {type(payload).__name__}")
    try:
        text = canonical_text(dict(payload))
        plain: dict[str, Any] = json.loads(text)
    except Exception as exc:
        raise LedgerError(
            f"the event payload is not plain JSON data ({type(exc).__name__}: {exc}); "
            "use dicts, lists, strings, booleans, None and numbers within +/-2**53"
        ) from None
    _check_shape(plain, intent_id)
    return plain, text


def normalise_payload(payload: Mapping[str, Any], *, intent_id: str | None) -> dict[str, Any]:
    """``payload`` as it will read back from storage, checked for what the reducer needs.

    Round-tripping through canonical JSON now (tuples become lists, and anything
    that is not JSON is refused) means the digest we compute is the digest that
    ``verify`` will recompute from the stored text.
    """
    if not isinstance(payload, Mapping):
        raise LedgerError(f"an event payload must be a JSON object, not {type(payload).__name__}")
    try:
        plain: dict[str, Any] = json.loads(canonical_bytes(dict(payload)))
    except Exception as exc:
        raise LedgerError(
            f"the event payload is not plain JSON data ({type(exc).__name__}: {exc}); "
            "use dicts, lists, strings, booleans, None and numbers within +/-2**53"
        ) from None
    _check_shape(plain, intent_id)
    return plain


def _check_shape(payload: Mapping[str, Any], intent_id: str | None) -> None:
    case_state = payload.get("case_state")
    if case_state is not None and not isinstance(case_state, dict):
        raise LedgerError("payload['case_state'] must be a JSON object merged into the case state")
    state = payload.get("state")
    if state is None:
        return
    if intent_id is None:
        raise LedgerError(
            "payload['state'] is intent state, but the event has no intent_id; "
            "pass intent_id=... or use payload['case_state']"
        )
    if not isinstance(state, dict):
        raise LedgerError("payload['state'] must be a JSON object merged into the intent state")
    clash = RESERVED_INTENT_KEYS.intersection(state)
    if clash:
        raise LedgerError(
            f"payload['state'] may not set {sorted(clash)}: the reducer derives them from the "
            "event kind and seq"
        )


def empty_state(case_id: str) -> dict[str, Any]:
    """The snapshot of a case before its first event."""
    return {
        "case_id": case_id,
        "head_seq": -1,
        "head_digest": GENESIS_DIGEST,
        "case": {},
        "intents": {},
        "intent_count": 0,
        "last": None,
    }


ClosedLookup = Callable[[str], Mapping[str, Any] | None]
"""The full state of an intent that already left the snapshot (None: never seen)."""


def apply_event(state: Mapping[str, Any] | None, event: Event,
                closed: ClosedLookup | None = None) -> dict[str, Any]:
    """The snapshot after ``event``; pure, and ``state`` is left untouched.

    * ``head_seq`` / ``head_digest`` become the event's;
    * ``payload["case_state"]`` (a dict) is merged key by key into ``case``;
    * for an intent event, the intent's state gets ``payload["state"]`` merged
      in, ``status`` = the event kind and ``last_seq`` = its seq.  An intent
      whose status becomes terminal leaves ``intents`` (format 2: the snapshot
      holds open intents only); ``last`` names the latest intent event's intent,
      status and outcome.  An event for an intent no longer in the snapshot (a
      re-opening ``changed_outside_case``, a compensation's final ``observed``)
      starts from ``closed(intent_id)``, its full state as its events give it.

    Merges are shallow (a key's new value replaces the old one whole), which
    keeps the reducer obvious to anyone re-implementing it to audit a chain.
    The new state shares unchanged nested values with the old one; neither is
    ever mutated.
    """
    if state is None:
        state = empty_state(event.case_id)
    _check_shape(event.payload, event.intent_id)
    new: dict[str, Any] = dict(state)
    new["head_seq"] = event.seq
    new["head_digest"] = event.digest
    case_state = event.payload.get("case_state")
    if case_state:
        new["case"] = {**state["case"], **case_state}
    if event.intent_id is not None:
        intents = dict(state["intents"])
        prior = intents.get(event.intent_id)
        if prior is None and closed is not None and event.kind != "prepared":
            prior = closed(event.intent_id)  # ("prepared" always starts a new intent)
        if prior is None:
            new["intent_count"] = int(state.get("intent_count") or 0) + 1
        merged = {**(prior or {}), **(event.payload.get("state") or {})}
        merged["status"] = event.kind
        merged["last_seq"] = event.seq
        if is_open_status(event.kind):
            intents[event.intent_id] = merged
        else:
            intents.pop(event.intent_id, None)
        new["intents"] = intents
        new["last"] = {"intent_id": event.intent_id, "status": event.kind,
                       "outcome": merged.get("outcome"),
                       "operation_id": merged.get("operation_id"),
                       "version": merged.get("version"), "at": event.recorded_at}
    return new


def _remember_intent(every: dict[str, dict[str, Any]], event: Event) -> None:
    """Merge ``event`` into its intent's full state in ``every`` (open or closed)."""
    if event.intent_id is None:
        return
    merged = {**every.get(event.intent_id, {}), **(event.payload.get("state") or {})}
    merged["status"] = event.kind
    merged["last_seq"] = event.seq
    every[event.intent_id] = merged


def intent_states(events: Iterable[Event]) -> dict[str, dict[str, Any]]:
    """Every intent's full state (open and closed), folded from its events in order."""
    out: dict[str, dict[str, Any]] = {}
    for event in events:
        _remember_intent(out, event)
    return out


def fold(events: Iterable[Event]) -> dict[str, Any]:
    """The snapshot of a case: :func:`apply_event` over its events in order.

    Raises LedgerError for no events (a case has at least one).
    """
    state: dict[str, Any] | None = None
    every: dict[str, dict[str, Any]] = {}
    for event in events:
        state = apply_event(state, event, every.get)
        _remember_intent(every, event)
    if state is None:
        raise LedgerError("cannot fold an empty chain: a case starts with its first event")
    return state


def state_digest(state: Mapping[str, Any]) -> str:
    """The digest an event records of the state after it: the snapshot without its head.

    The head (seq and digest) is left out -- it names the event itself, whose
    digest covers this value.
    """
    return canonical_hash({"case_id": state["case_id"], "case": state["case"],
                           "intents": state["intents"], "last": state.get("last"),
                           "intent_count": state.get("intent_count")})


def head_matches(snapshot: Mapping[str, Any], head: Event, head_seq: int,
                 head_digest: str) -> str | None:
    """The O(1) continuation check: is ``snapshot`` the state the chain's head names?

    ``head`` is the stored event at the case row's ``head_seq``.  It must
    recompute to its digest, that digest must be the case row's, the snapshot's
    own head fields must agree, and the snapshot must hash to the event's
    ``state_digest``.  Returns None when all hold, else why not.  A format-1
    head event (no ``state_digest``) cannot say: the caller replays the chain.
    """
    if head.seq != head_seq or head.digest != head_digest:
        return f"the head event is seq {head.seq} ({head.digest}), the case row names " \
               f"seq {head_seq} ({head_digest})"
    if digest_of(head) != head.digest:
        return f"the head event (seq {head.seq}) does not hash to its digest"
    if snapshot.get("head_seq") != head_seq or snapshot.get("head_digest") != head_digest:
        return "the snapshot's head is not the case row's"
    if head.state_digest is None:
        return "the head event was written by format 1 and records no state digest"
    if state_digest(snapshot) != head.state_digest:
        return "the snapshot is not the state its head event records"
    return None


# --- verification -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing wrong with one case's chain, as :func:`check_case` sees it."""

    case_id: str
    seq: int | None
    """The event concerned, or None for a finding about the case row as a whole."""
    kind: str
    """One of :data:`FINDING_KINDS`."""
    detail: str
    """What was expected and what was found, for a person."""

    def to_dict(self) -> dict[str, Any]:
        return {"case_id": self.case_id, "seq": self.seq, "kind": self.kind, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class CaseRow:
    """The stored ``cg_cases`` row of a case, as read for verification."""

    snapshot: str
    head_seq: int
    head_digest: str
    head_mac: str | None


def _original_positions(events: Sequence[Event]) -> dict[int, int]:
    """Index -> chain position, found by following ``prev_digest`` links from genesis.

    Links do not depend on ``seq``, so this recovers the order the events were
    recorded in even when their ``seq`` values were swapped.
    """
    by_prev: dict[str, int] = {}
    for i, event in enumerate(events):
        by_prev.setdefault(event.prev_digest, i)
    positions: dict[int, int] = {}
    current = GENESIS_DIGEST
    while current in by_prev and by_prev[current] not in positions:
        i = by_prev[current]
        positions[i] = len(positions)
        current = events[i].digest
    return positions


def check_case(
    case_id: str,
    events: Sequence[Event],
    case: CaseRow | None,
    key: bytes | None,
) -> list[Finding]:
    """Every finding for one case: replay the chain, then compare head, snapshot and MAC.

    ``events`` must be the case's stored events ordered by seq.  Each tamper is
    reported once, under its cause: a deleted event is ``event_missing`` and
    not also a broken link at its successor; an edited digest is
    ``digest_broken`` and not also ``chain_broken``.
    """
    findings: list[Finding] = []

    def report(seq: int | None, kind: str, detail: str) -> None:
        findings.append(Finding(case_id, seq, kind, detail))

    recomputed = [digest_of(e) for e in events]
    positions = _original_positions(events)
    moved: dict[int, int] = {}
    for i, event in enumerate(events):
        pos = positions.get(i)
        if (
            recomputed[i] != event.digest
            and pos is not None
            and pos != event.seq
            and digest_of(event, seq=pos) == event.digest
        ):
            moved[i] = pos

    expected_seq = 0
    prev_digest = GENESIS_DIGEST
    prev_explains_link = False  # the previous event's finding already accounts for this link
    last_digest_broken = False
    for i, event in enumerate(events):
        gap = event.seq > expected_seq
        for missing in range(expected_seq, event.seq):
            report(
                missing,
                "event_missing",
                f"no event with seq {missing}: the chain jumps to seq {event.seq}",
            )
        digest_broken = False
        if i in moved:
            report(
                event.seq,
                "event_reordered",
                f"the event recorded as seq {moved[i]} ({event.kind}) now sits at seq {event.seq}",
            )
        else:
            if recomputed[i] != event.digest:
                if i + 1 < len(events):
                    successor_link: str | None = events[i + 1].prev_digest
                else:
                    successor_link = case.head_digest if case is not None else None
                if successor_link == recomputed[i]:
                    digest_broken = True
                    report(
                        event.seq,
                        "digest_broken",
                        f"stored digest {event.digest} was changed; the event's content "
                        f"hashes to {recomputed[i]}, which its successor names",
                    )
                else:
                    report(
                        event.seq,
                        "payload_edited",
                        f"the event's content hashes to {recomputed[i]}, not to its stored "
                        f"digest {event.digest}: payload, kind, intent, time or link was edited",
                    )
            if event.prev_digest != prev_digest and not gap and not prev_explains_link:
                report(
                    event.seq,
                    "chain_broken",
                    f"prev_digest {event.prev_digest} is not the digest of the event before "
                    f"it ({prev_digest})",
                )
        prev_explains_link = digest_broken or i in moved
        last_digest_broken = digest_broken
        prev_digest = event.digest
        expected_seq = event.seq + 1

    if case is None:
        if events:
            report(None, "case_missing", f"{len(events)} events but no cg_cases row for the case")
            _fold_checking_states(events, recomputed, report, _first_problem(findings))
        return findings

    last_seq = events[-1].seq if events else -1
    if case.head_seq > last_seq:
        for missing in range(last_seq + 1, case.head_seq + 1):
            report(
                missing,
                "event_missing",
                f"the case head is seq {case.head_seq} but the last stored event is "
                f"seq {last_seq}",
            )
    elif case.head_seq < last_seq or (
        case.head_digest != prev_digest and not last_digest_broken
    ):
        report(
            case.head_seq,
            "head_mismatch",
            f"the case head (seq {case.head_seq}, {case.head_digest}) is not the last event "
            f"(seq {last_seq}, {prev_digest})",
        )

    expected_snapshot, why = _fold_checking_states(events, recomputed, report,
                                                   _first_problem(findings))
    if case.snapshot != expected_snapshot:
        report(None, "snapshot_mismatch", why)

    if key is not None:
        if case.head_mac is None:
            report(
                case.head_seq,
                "mac_missing",
                "the case head carries no MAC, but a key is configured: it was written "
                "without the key, or its MAC was removed",
            )
        elif not hmac.compare_digest(case.head_mac, head_mac(key, case.head_digest)):
            report(
                case.head_seq,
                "mac_mismatch",
                "the case head's MAC does not match its digest under the configured key: "
                "the chain was rewritten without the key (or the key is wrong)",
            )
    return findings


def _first_problem(findings: Sequence[Finding]) -> int | None:
    seqs = [f.seq for f in findings if f.seq is not None]
    return min(seqs) if seqs else None


def _fold_checking_states(events: Sequence[Event], recomputed: Sequence[str],
                          report: Callable[[int | None, str, str], None],
                          clean_before: int | None = None) -> tuple[str | None, str]:
    """Fold the chain, checking each format-2 event's ``state_digest`` on the way.

    Returns the canonical text of the final state (None when the events cannot
    be folded) and what to say if the stored snapshot differs from it.  Only
    the chain before the first event already reported (``clean_before``) is
    checked: past a missing, edited or moved event every later state differs,
    and the tamper is reported once, under its cause.
    """
    state: dict[str, Any] | None = None
    every: dict[str, dict[str, Any]] = {}
    try:
        for i, event in enumerate(events):
            state = apply_event(state, event, every.get)
            _remember_intent(every, event)
            if (event.state_digest is not None and recomputed[i] == event.digest
                    and (clean_before is None or event.seq < clean_before)
                    and state_digest(state) != event.state_digest):
                report(event.seq, "state_mismatch",
                       f"the event records state {event.state_digest}, but the chain folds "
                       f"to {state_digest(state)} at seq {event.seq}")
                clean_before = event.seq
    except Exception as exc:
        return None, f"the events cannot be folded ({type(exc).__name__}: {exc})"
    if state is None:
        return None, "the case has no events"
    return canonical_text(state), "the stored snapshot differs from fold(events)"
