"""The DDL loop for stored code (``capgate ddl ...``).

The commands are :class:`ddl.service.DdlService`'s methods -- capture, plan,
apply, verify, compensate, snapshots, export -- on a service made by
:func:`service` from an open executor.  What the face adds is here:
``recover`` (settle an intent, or only classify it) and the list of the
standing prohibitions.
"""

from __future__ import annotations

from typing import Any

from capgate.ddl.catalog import Progress
from capgate.ddl.service import DdlService
from capgate.executor.call import Executor


def service(gate: Executor, *, progress: Progress | None = None) -> DdlService:
    """The DDL loop on ``gate``'s rows, connectors, grants and ledger.

    ``progress(done, total, label)`` is told how a sweep over many objects goes.
    """
    return DdlService(gate, progress=progress)


def recover(svc: DdlService, case: str, intent: str, *, who: str = "resume",
            dry_run: bool = False) -> dict[str, Any]:
    """After a crash: classify an open DDL intent and record, as ``who``, what that settles.

    ``dry_run``: classify only, record nothing (``action`` is ``none``).
    """
    if dry_run:
        classification, evidence = svc.classify(case, intent)
        return {"case": case, "intent_id": intent, "classification": classification,
                "evidence": evidence, "action": "none", "resolved": False}
    from capgate.ddl.service import settle_ddl_intent

    return settle_ddl_intent(svc.executor, case, intent, who=who)


def prohibitions() -> list[dict[str, Any]]:
    """The standing prohibitions, each with its code, name and summary."""
    from capgate.ddl.prohibitions import PROHIBITIONS

    return [p.to_dict() for p in PROHIBITIONS]
