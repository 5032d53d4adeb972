"""The fence: a late attempt never overwrites what resume (or a person) decided.

An executor that hung (SIGSTOP, a network partition) may wake after resume
has terminated its session and retried the intent as attempt n+1.  Its own
observation of attempt n -- usually ``rolled_back``, because its session is
gone -- would otherwise become the intent's status and outcome record,
contradicting the effect that attempt n+1 applied.  ``Executor._observed``
asks :func:`superseded` first; a superseded observation is kept as a
case-level ``stale_attempt`` event (evidence, not state), and the late
caller gets the intent's recorded outcome, or ``ReconciliationRequired``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from executor.outcome import Outcome
from registry.errors import ReconciliationRequired

if TYPE_CHECKING:
    from executor.call import CallContext
    from executor.ledger import Ledger

DECIDED = frozenset({"reconciled", "escalation_resolved"})
"""Statuses that only resume or a person write: an old attempt cannot change them."""


def superseded(ledger: Ledger, ctx: CallContext, result: Outcome | None) -> Outcome | None:
    """None when ``ctx``'s attempt is still the intent's latest; else what to return.

    ``result`` is what the late attempt observed (None: it lost its connection
    around COMMIT).  Raises ReconciliationRequired when the intent moved on
    but has no recorded outcome yet.
    """
    snapshot = ledger.snapshot(ctx.case_id) or {}
    state = (snapshot.get("intents") or {}).get(ctx.intent_id)
    if state is None:
        return None
    # ``retry_attempt``: resume decided to retry (event ``retrying``) before the
    # retry's own ``attempt_started`` -- from then on the old attempt is stale too.
    recorded = max(int(state.get("attempt") or 0), int(state.get("retry_attempt") or 0))
    if recorded <= ctx.attempt and state.get("status") not in DECIDED:
        return None
    ledger.append(ctx.case_id, "stale_attempt", {"stale": {
        "intent_id": ctx.intent_id, "attempt": ctx.attempt, "recorded_attempt": recorded,
        "recorded_status": state.get("status"),
        "outcome": result.to_dict() if result is not None else "commit_uncertain"}})
    record = state.get("outcome_record")
    if state.get("status") in DECIDED | {"observed"} and isinstance(record, dict):
        return Outcome.from_dict(record, replayed=True)
    raise ReconciliationRequired(
        f"attempt {ctx.attempt} of intent {ctx.intent_id} was superseded by attempt {recorded} "
        f"while it ran; run `capgate resume {ctx.case_id}`",
        case=ctx.case_id, intent_id=ctx.intent_id, attempt=ctx.attempt)
