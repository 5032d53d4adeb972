"""A call whose inputs are bound to earlier intents' returned values (issue 16).

``call_bound(executor, "claim.settle", {}, [Binding("claim_id", "claim.open",
"claim_id")], case=K, who=W)`` reads the value the case's applied
``claim.open`` returned as ``claim_id`` from the ledger
(:func:`executor.returned.resolve`) -- never a predicted one -- and calls with
it.  An input given both ways is refused.  Once the call has an outcome, the
case records where each bound input came from (``inputs_bound``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from capgate.executor.call import Executor
from capgate.executor.outcome import Outcome
from capgate.executor.returned import Binding, resolve
from capgate.registry.errors import ReturnedValueUnavailable

__all__ = ["call_bound"]


def call_bound(executor: Executor, operation_id: str, inputs: Mapping[str, Any],
               bindings: Sequence[Binding], *, case: str, who: str, **call: Any) -> Outcome:
    """``Executor.call`` with ``bindings`` resolved from the ledger of ``case`` first."""
    resolved = resolve(executor.ledger, case, list(bindings))
    both = sorted(set(resolved) & set(inputs))
    if both:
        raise ReturnedValueUnavailable(
            f"input(s) {', '.join(both)} are given and bound at once; give each one way",
            inputs=both)
    full = {**inputs, **{name: r["value"] for name, r in resolved.items()}}
    outcome = executor.call(operation_id, full, case=case, who=who, **call)
    if resolved and not outcome.replayed:
        executor.ledger.append(case, "inputs_bound", {
            "intent_id": outcome.intent_id, "operation_id": operation_id, "by": who,
            "bindings": [{"input": name, **r} for name, r in sorted(resolved.items())]})
    return outcome
