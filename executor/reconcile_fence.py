"""The fence: a late attempt never changes what resume (or a person) decided.

An executor that hung (SIGSTOP, a network partition) may wake after resume
has terminated its session and settled the intent, or retried it as attempt
n+1.  Every event an executing attempt appends for its intent carries its
attempt number, and the ledger refuses it (``AttemptSuperseded``, checked
against the very head the event would be chained to) once the intent was
settled or a newer attempt recorded -- so no late ``lease_expired`` or
``observed`` can re-open a settled case.  The target is fenced as well: a
retry takes the impact claim over with a new fencing token, so the old
attempt's transaction cannot commit.

:func:`record_stale` keeps what the late attempt saw as a case-level
``stale_attempt`` event (evidence, not state) and tells the late process it
was superseded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from registry.errors import AttemptSuperseded

if TYPE_CHECKING:
    from executor.call import CallContext
    from executor.ledger import Ledger
    from executor.outcome import Outcome


def record_stale(ledger: Ledger, ctx: CallContext, seen: Outcome | str,
                 superseded: AttemptSuperseded) -> NoReturn:
    """Keep the late attempt's observation as evidence, then raise ``superseded``.

    ``seen`` is what the late attempt observed (an outcome, or a word such as
    ``commit_uncertain`` when it lost its connection around COMMIT).
    """
    ledger.append(ctx.case_id, "stale_attempt", {"stale": {
        "intent_id": ctx.intent_id, "attempt": ctx.attempt,
        "recorded_attempt": superseded.details.get("recorded_attempt"),
        "recorded_status": superseded.details.get("recorded_status"),
        "outcome": seen if isinstance(seen, str) else seen.to_dict()}})
    raise superseded
