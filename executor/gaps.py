"""Capability gaps: a request for an operation that has no row is an escalation, recorded.

capgate fails closed: an operation no row declares (or not at that version,
or not for this environment) is refused.  The refusal alone would leave the
DBAs blind to what agents need, so every such request -- through the CLI, the
Python API or the MCP server -- is also recorded as a ``capability_gap``
event with who asked, for what, in which case and through which channel:

* in the asking case's own chain (the case's record shows it asked), and
* in the ledger's gap register, the chain of case :data:`GAPS_CASE`, which
  ``capgate gaps`` lists (one indexed read, and the register verifies like any
  case, so an edited gap is found).

Recording a gap never changes the answer: the caller still gets the coded
refusal, and a ledger that cannot record the gap does not hide it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from capgate.executor import channel
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import CapgateError, LedgerError, UnknownCase
from capgate.registry.excerpt import cut

if TYPE_CHECKING:
    from capgate.executor.ledger import Ledger

__all__ = ["GAPS_CASE", "KIND", "list_gaps", "record_gap"]

GAPS_CASE = "capgate.capability-gaps"
"""The case whose chain is the ledger's register of capability gaps."""
KIND = "capability_gap"


def record_gap(ledger: Ledger, *, case: str | None, who: str, operation_id: str,
               version: int | None, refusal: CapgateError, inputs: Mapping[str, Any] | None,
               via: str | None = None) -> dict[str, Any]:
    """Record the gap in the case's chain and the register; return what was recorded.

    The inputs are not recorded whole (they may be large, or sensitive): their
    field names and a digest say what was asked.
    """
    gap = {"operation_id": _text(operation_id, 200), "version": version,
           "requested_by": _text(who, 200), "case": _text(case, 200) if case else None,
           "via": via or channel.current(),
           "refusal": refusal.code, "message": _text(refusal.message, 500),
           "input_fields": sorted(_text(k, 80) for k in (inputs or {}))[:50],
           "inputs_digest": _digest(inputs) if inputs else None,
           "at": datetime.now(UTC).isoformat()}
    with contextlib.suppress(LedgerError, CapgateError):
        if case and case != GAPS_CASE:
            ledger.append(case, KIND, {"gap": gap})
        ledger.append(GAPS_CASE, KIND, {"gap": gap})
    return gap


def _text(value: Any, limit: int) -> str:
    """Recordable text whatever was asked: a lone surrogate escaped, never refused."""
    return cut(str(value).encode("utf-8", "backslashreplace").decode("utf-8"), limit)


def _digest(inputs: Mapping[str, Any]) -> str | None:
    """The inputs' canonical digest; None for inputs no ledger can hold exactly (an
    integer beyond 2^53, a lone surrogate, nesting too deep): an unknown operation's
    inputs were never checked against any contract, and asking stays a refusal."""
    try:
        return canonical_hash(dict(inputs))
    except (ValueError, TypeError, RecursionError):  # rfc8785's errors are ValueErrors
        return None


def list_gaps(ledger: Ledger) -> list[dict[str, Any]]:
    """Every recorded gap, oldest first, from the verified register (LedgerTampered if edited)."""
    try:
        verified = ledger.load_verified(GAPS_CASE)
    except UnknownCase:
        return []
    return [{"seq": e.seq, "recorded_at": e.recorded_at, **dict(e.payload.get("gap") or {})}
            for e in verified.events if e.kind == KIND]
