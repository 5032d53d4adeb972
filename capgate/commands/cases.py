"""A case's claims, coordination decisions, symptoms and holds (``capgate case ...``).

Most of these commands are one function of :mod:`executor.cases` and are
that function itself, re-exported so that every command of the group is found
here; what the face adds (the default renewal, symptoms read through the
executor's runtime) is defined here.  A person's decision is signed with
their approver key (``executor.approvals.load_signing_key``), like an approval.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capgate.executor.call import Executor
from capgate.executor.cases import close, decide, release, resolve_hold, show

__all__ = ["checkpoint", "close", "decide", "release", "renew", "resolve_hold", "show",
           "symptom"]


def renew(gate: Executor, case: str, seconds: float | None = None) -> dict[str, Any]:
    """Extend the case's claims by ``seconds`` from now.

    Default: the largest ``case_claim_seconds`` of the configured connectors, so that
    a renewal lasts as long as a first claim on any of them would.
    """
    from capgate.executor import cases

    if seconds is None:
        seconds = max((gate.connectors.config(n).case_claim_seconds
                       for n in gate.connectors.names()), default=0.0)
    return cases.renew(gate, case, float(seconds))


def symptom(gate: Executor, case: str, operation: str, inputs: Mapping[str, Any], *,
            who: str, version: int | None = None) -> dict[str, Any]:
    """Register the symptom ``case`` starts from: the row's symptom query, read now.

    It is read again before the fix and at the send (:func:`checkpoint`).
    """
    from capgate.executor import symptoms

    return symptoms.register(gate.rt, case, operation, dict(inputs), who=who, version=version)


def checkpoint(gate: Executor, case: str, *, name: str = "send", who: str) -> dict[str, Any]:
    """Re-read the case's symptoms at checkpoint ``name``; ``held`` when one changed."""
    from capgate.executor import symptoms

    return symptoms.checkpoint(gate.rt, case, name=name, who=who)
