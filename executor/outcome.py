"""What a call returns: an outcome with evidence, never a bare exception.

``applied_verified`` and ``rolled_back`` are the two answers of a write;
``ok`` answers a read.  ``already_applied`` says the very same request had
already landed under another intent (its landing marker is the evidence) and
nothing was executed now.  ``compensated`` and ``compensation_failed`` follow a
post-commit check that failed.  ``simulated`` closes a simulation's write once it was
torn down and the baseline re-read identical.  A recorded outcome returned again for the same
idempotency key carries ``replayed=True``.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capgate.registry.errors import EXIT_OK, EXIT_REFUSED, EXIT_UNKNOWN
from capgate.registry.vocabulary import OutcomeStatus

APPLIED = OutcomeStatus.APPLIED_VERIFIED
ROLLED_BACK = OutcomeStatus.ROLLED_BACK
READ_OK = OutcomeStatus.OK
COMPENSATED = OutcomeStatus.COMPENSATED
COMPENSATION_FAILED = OutcomeStatus.COMPENSATION_FAILED
ALREADY_APPLIED = OutcomeStatus.ALREADY_APPLIED
SIMULATED = OutcomeStatus.SIMULATED

_EXIT: dict[str, int] = {
    APPLIED: EXIT_OK, READ_OK: EXIT_OK, ALREADY_APPLIED: EXIT_OK, ROLLED_BACK: EXIT_REFUSED,
    COMPENSATED: EXIT_REFUSED, COMPENSATION_FAILED: EXIT_UNKNOWN, SIMULATED: EXIT_OK}


@dataclass(frozen=True)
class Outcome:
    status: str
    intent_id: str
    case_id: str
    operation_id: str
    version: int
    row_hash: str
    idempotency_key: str | None
    fingerprint: str
    attempt: int
    evidence: Mapping[str, Any] = field(default_factory=dict)
    reason: Mapping[str, Any] | None = None
    replayed: bool = False

    @property
    def ok(self) -> bool:
        return self.status in (APPLIED, READ_OK, ALREADY_APPLIED)

    @property
    def exit_code(self) -> int:
        return _EXIT.get(self.status, EXIT_UNKNOWN)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "intent_id": self.intent_id,
            "case": self.case_id,
            "operation_id": self.operation_id,
            "version": self.version,
            "row_hash": self.row_hash,
            "idempotency_key": self.idempotency_key,
            "fingerprint": self.fingerprint,
            "attempt": self.attempt,
            "evidence": dict(self.evidence),
            "reason": dict(self.reason) if self.reason is not None else None,
            "replayed": self.replayed,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, replayed: bool = False) -> Outcome:
        return cls(
            status=d["status"], intent_id=d["intent_id"], case_id=d["case"],
            operation_id=d["operation_id"], version=int(d["version"]), row_hash=d["row_hash"],
            idempotency_key=d.get("idempotency_key"), fingerprint=d["fingerprint"],
            attempt=int(d.get("attempt", 1)), evidence=d.get("evidence") or {},
            reason=d.get("reason"), replayed=replayed,
        )


def jsonable(value: Any) -> Any:
    """Database values as JSON: decimals and dates as text, bytes as base64."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        finite = value == value and value not in (float("inf"), float("-inf"))
        return value if finite else str(value)
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)
