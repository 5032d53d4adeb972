"""Where the DDL loop reports what it does: a small sink protocol the ledger can implement.

The loop calls ``sink.record(kind, payload)`` at every boundary (captured,
planned, preflight, apply started -- *before* the DDL on engines whose DDL
commits --, object applied, verified, rolled back, compensation, outcome).
Payloads are plain JSON data.  A sink that raises stops the loop at that
boundary, which is what a ledger that cannot write must do.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

CAPTURED = "ddl.captured"
PLANNED = "ddl.planned"
REFUSED = "ddl.refused"
PREFLIGHT = "ddl.preflight"
APPLY_STARTED = "ddl.apply_started"
OBJECT_APPLIED = "ddl.object_applied"
APPLY_FAILED = "ddl.apply_failed"
VERIFIED = "ddl.verified"
VERIFY_FAILED = "ddl.verify_failed"
COMMITTED = "ddl.committed"
ROLLED_BACK = "ddl.rolled_back"
ROLLBACK_INCOMPLETE = "ddl.rollback_incomplete"
"""A rollback after a failed verify did not bring the snapshots back; compensation follows."""
FAR_SIDE = "ddl.far_side"
COMPENSATION_STARTED = "ddl.compensation_started"
COMPENSATED = "ddl.compensated"
COMPENSATION_FAILED = "ddl.compensation_failed"
OUTCOME = "ddl.outcome"


@runtime_checkable
class DdlEventSink(Protocol):
    """Receives the loop's events, e.g. to append them to the ledger."""

    def record(self, kind: str, payload: dict[str, Any]) -> None: ...


class NullSink:
    """Records nothing."""

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        return None


class ListSink:
    """Keeps events in memory, in order (for the CLI's ``--json`` and for tests)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        self.events.append((kind, json.loads(json.dumps(payload))))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [p for k, p in self.events if k == kind]
