"""After a fault: settle a case's in-flight intents from evidence (``capgate resume``).

Each intent is classified ``applied``, ``not_applied``, ``partly_applied`` or
``unknown`` from the target's evidence and acted on per its row's recovery;
the rest is escalated to a person, whose decision :func:`resolve` records.
The work is :mod:`executor.recovery.resume`'s.
"""

from __future__ import annotations

from typing import Any

from capgate.executor.call import Executor
from capgate.executor.recovery.resume import ResumeReport


def resume(gate: Executor, case: str | None, *, task: str | None = None,
           terminate: bool = True, wait_seconds: float = 5.0, act: bool = True
           ) -> ResumeReport:
    """Classify and settle every in-flight intent of ``case`` (None: of every open case).

    ``task``: refused when the case was opened for another task.  ``terminate``: end a
    recorded session that may still commit (else only wait ``wait_seconds``).  ``act``:
    False classifies and re-checks only; nothing is recorded or retried.
    """
    from capgate.executor.recovery.resume import resume as resume_case
    from capgate.executor.recovery.resume import resume_many

    options: dict[str, Any] = {"task": task, "terminate": terminate,
                               "wait_seconds": wait_seconds, "act": act}
    if case is None:
        return resume_many(gate, None, **options)
    return resume_case(gate, case, **options)


def resolve(gate: Executor, case: str, intent: str, *, by: str, decision: str,
            note: str = "") -> dict[str, Any]:
    """Record a person's ``decision`` (applied, not_applied, accepted) on an escalated intent."""
    from capgate.executor.recovery.resume import resolve_escalation

    return resolve_escalation(gate, case, intent, by=by, decision=decision, note=note)
