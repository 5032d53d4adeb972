"""What a simulation leaves in the ledger: one event per step, and the case's evidence.

Each step of the cycle is a case event (``simulation_planned``,
``simulation_baseline``, ``simulation_executed``, ``simulation_observed``,
``simulation_torn_down``, then ``simulation_restored`` or
``simulation_escalated``) carrying its evidence, and rewrites the
simulation's summary in the case state under ``simulation:ID`` -- so the
summary is part of the verified snapshot, and an edited one stops the case
(``LedgerTampered``) instead of vouching for a promotion.  A restored
simulation also writes its *evidence* under ``simulated:ROW_HASH:SHAPE:ENV``:
what :mod:`executor.promotion` looks for, in the same ledger, whatever
configuration (and venue) wrote it.

The input *shape* is the structure of the inputs -- each name and its JSON
type, recursively -- not their values: a simulation on qa with policy 1 is
evidence for the same change on prod with policy 4711.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capgate.executor.ledger import Ledger
from capgate.executor.ledger.store import Guard
from capgate.registry.canonical import canonical_hash

__all__ = ["EVIDENCE_PREFIX", "FINAL_STEPS", "SIMULATION_PREFIX", "evidence_entries",
           "evidence_key", "in_progress", "input_shape", "record_step", "simulation_key",
           "simulation_of", "summaries"]

SIMULATION_PREFIX = "simulation:"
EVIDENCE_PREFIX = "simulated:"
IDEM_MARK = "|simulation:"
"""How a simulation's execute step marks its idempotency key (never the promotion's key)."""


def simulation_key(simulation_id: str) -> str:
    return f"{SIMULATION_PREFIX}{simulation_id}"


def evidence_key(row_hash: str, shape: str, environment: str) -> str:
    return f"{EVIDENCE_PREFIX}{row_hash}:{shape}:{environment}"


def simulation_of(idem_key: str | None) -> str | None:
    """The simulation id a call's idempotency key carries (None: not a simulation's call)."""
    if idem_key is None or IDEM_MARK not in idem_key:
        return None
    return idem_key.rsplit(IDEM_MARK, 1)[1]


def _shape(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {"object": {str(k): _shape(v) for k, v in value.items()}}
    if isinstance(value, list | tuple):
        items = {canonical_hash(_shape(v)): _shape(v) for v in value}
        return {"array": [items[k] for k in sorted(items)]}
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if value is None:
        return "null"
    return "string"


def input_shape(inputs: Mapping[str, Any]) -> str:
    """The digest of the inputs' structure (names and JSON types), not of their values."""
    return canonical_hash(_shape(dict(inputs)))


def record_step(ledger: Ledger, case: str, kind: str, summary: Mapping[str, Any],
                payload: Mapping[str, Any] | None = None,
                evidence: Mapping[str, Any] | None = None, *,
                guard: Guard | None = None) -> None:
    """Append the step's event; the summary (and, once restored, the evidence) ride in it.

    ``guard`` sees the case state inside the append's transaction and refuses by
    raising (the first step: no other simulation in progress in the case).
    """
    case_state: dict[str, Any] = {simulation_key(str(summary["simulation_id"])): dict(summary)}
    if evidence is not None:
        case_state[evidence_key(str(evidence["row_hash"]), str(evidence["input_shape"]),
                                str(evidence["environment"]))] = dict(evidence)
    ledger.append(case, kind, {"simulation_id": summary["simulation_id"],
                               "by": summary.get("who"), **(payload or {}),
                               "case_state": case_state}, guard=guard)


FINAL_STEPS = frozenset({"restored", "rolled_back", "escalated", "abandoned"})
"""The steps after which a simulation needs nothing more."""


def in_progress(case_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The case's simulations that have not ended (at most one runs per case)."""
    return [s for s in summaries(case_state) if s.get("step") not in FINAL_STEPS]


def evidence_entries(case_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every simulation evidence the case holds (restored simulations), newest first."""
    found = [dict(v) for k, v in case_state.items()
             if k.startswith(EVIDENCE_PREFIX) and isinstance(v, Mapping)]
    return sorted(found, key=lambda e: str(e.get("completed_at")), reverse=True)


def summaries(case_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every simulation of the case (its summary as last recorded), oldest first."""
    found = [dict(v) for k, v in case_state.items()
             if k.startswith(SIMULATION_PREFIX) and isinstance(v, Mapping)]
    return sorted(found, key=lambda s: str(s.get("started_at")))
