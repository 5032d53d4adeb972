"""The loop's inputs and results: frozen dataclasses with ``to_dict()``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddl.catalog import ObjectRef, ObjectStatus
from ddl.errors import CompensationFailed, VerifyFailed
from ddl.merge import MergeProposal
from registry.errors import DdlError
from registry.errors import lookup as lookup_error

# --- inputs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """The new source of one object."""

    source: str
    """A ``CREATE [OR REPLACE] ...`` statement (script terminators are fine)."""
    object: ObjectRef | None = None
    """The object; found from the source's header when None."""
    base_snapshot_id: str | None = None
    """The snapshot the new source was written against; captured now when None."""
    attributes: Mapping[str, str] = field(default_factory=dict)
    """Overrides for the apply session, e.g. MariaDB ``{"sql_mode": "ORACLE"}``."""


@dataclass(frozen=True)
class FarSideStep:
    """A named step on the far side of a database link: recompile a remote dependent, assert."""

    name: str
    link: str
    dependent: ObjectRef
    """The remote dependent, with ``link`` set."""
    assertion: str
    """SQL run on the far side; its first column of the first row is compared with ``expect``."""
    expect: Any = 1
    recompile: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "link": self.link,
            "dependent": self.dependent.key,
            "dependent_object": self.dependent.to_dict(),
            "assertion": self.assertion,
            "expect": self.expect,
            "recompile": self.recompile,
        }


@dataclass(frozen=True)
class SmokeCall:
    """A side-effect-free call that proves the changed code works, declared in the plan."""

    name: str
    sql: str
    expect: Any = None
    """Compared with the first column of the first row (as text when types differ)."""
    binds: Mapping[str, Any] = field(default_factory=dict)
    session: Mapping[str, str] = field(default_factory=dict)
    """Session settings for the call, e.g. MariaDB ``{"sql_mode": "ORACLE"}`` for ``pkg.fn()``."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sql": self.sql, "expect": self.expect,
                "binds": dict(self.binds), "session": dict(self.session)}


# --- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One verification check and its result."""

    name: str
    object: str
    passed: bool
    detail: str = ""
    severity: str = "error"
    """``error`` fails the verify; ``warning`` is reported only (e.g. already invalid before)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "object": self.object, "passed": self.passed,
                "detail": self.detail, "severity": self.severity}


@dataclass(frozen=True)
class VerifyReport:
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks if c.severity == "error")

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed and c.severity == "error")

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": [c.to_dict() for c in self.checks]}


@dataclass(frozen=True)
class StatusChange:
    """An object's status before and after the apply (touched objects and dependents)."""

    object: str
    role: str
    """``changed`` or ``dependent``."""
    before: ObjectStatus | None
    after: ObjectStatus | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": self.object,
            "role": self.role,
            "before": None if self.before is None else self.before.state,
            "after": None if self.after is None else self.after.state,
            "errors_after": [] if self.after is None else list(self.after.errors),
        }


@dataclass(frozen=True)
class ObjectApply:
    key: str
    base_snapshot_id: str
    base_signature: str
    expected_signature: str | None
    applied_signature: str | None
    """The live signature read back right after the DDL (None if the DDL did not run)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": self.key,
            "base_snapshot_id": self.base_snapshot_id,
            "base_signature": self.base_signature,
            "expected_signature": self.expected_signature,
            "applied_signature": self.applied_signature,
        }


@dataclass(frozen=True)
class PreflightResult:
    ok: bool
    live: Mapping[str, str]
    mismatches: tuple[MergeProposal, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "live": dict(self.live),
                "merge": [m.to_dict() for m in self.mismatches]}


@dataclass(frozen=True)
class CompensationReport:
    ok: bool
    snapshot_ids: Mapping[str, str]
    actions: tuple[Mapping[str, Any], ...]
    live_signatures: Mapping[str, str]
    snapshot_signatures: Mapping[str, str]
    verify: VerifyReport | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "snapshot_ids": dict(self.snapshot_ids),
            "actions": [dict(a) for a in self.actions],
            "live_signatures": dict(self.live_signatures),
            "snapshot_signatures": dict(self.snapshot_signatures),
            "verify": None if self.verify is None else self.verify.to_dict(),
        }


APPLIED_VERIFIED = "applied_verified"
ROLLED_BACK = "rolled_back"
COMPENSATED = "compensated"
COMPENSATION_FAILED = "compensation_failed"


@dataclass(frozen=True)
class DdlOutcome:
    """What an apply ended as, with its evidence."""

    outcome: str
    """``applied_verified`` | ``rolled_back`` | ``compensated`` | ``compensation_failed``."""
    plan_hash: str
    dialect: str
    objects: tuple[ObjectApply, ...]
    statuses: tuple[StatusChange, ...]
    verify: VerifyReport | None
    compensation: CompensationReport | None = None
    error: Mapping[str, Any] | None = None
    """The ApplyFailed / VerifyFailed / CompensationFailed that explains a non-success."""
    restored: bool | None = None
    """After a rollback or compensation: whether every live signature equals its snapshot's."""

    @property
    def ok(self) -> bool:
        return self.outcome == APPLIED_VERIFIED

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "plan_hash": self.plan_hash,
            "dialect": self.dialect,
            "objects": [o.to_dict() for o in self.objects],
            "statuses": [s.to_dict() for s in self.statuses],
            "verify": None if self.verify is None else self.verify.to_dict(),
            "compensation": None if self.compensation is None else self.compensation.to_dict(),
            "error": None if self.error is None else dict(self.error),
            "restored": self.restored,
        }

    def raise_for_outcome(self) -> None:
        """Raise the error behind a non-success outcome (ApplyFailed, VerifyFailed, ...)."""
        if self.ok or self.error is None:
            return
        cls = lookup_error(str(self.error.get("code", "CG500")))
        if not issubclass(cls, DdlError):
            cls = CompensationFailed if self.outcome == COMPENSATION_FAILED else VerifyFailed
        raise cls(str(self.error.get("message", self.outcome)),
                  **dict(self.error.get("details") or {}))


@dataclass(frozen=True)
class ObjectRecovery:
    key: str
    state: str
    """``applied`` | ``not_applied`` | ``unchanged`` | ``absent`` | ``unknown``."""
    live_signature: str
    base_signature: str
    expected_signature: str | None
    evidence: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": self.key,
            "state": self.state,
            "live_signature": self.live_signature,
            "base_signature": self.base_signature,
            "expected_signature": self.expected_signature,
            "evidence": self.evidence,
        }


NEXT_ACTION = {
    "applied": "record the apply as observed, then verify (capgate ddl verify)",
    "not_applied": "nothing landed: the same plan may be applied again",
    "partly_applied": "compensate from the snapshots (capgate ddl compensate) or escalate; "
    "never re-apply blindly",
    "unknown": "escalate: the live objects match neither the snapshots nor the new sources",
}


@dataclass(frozen=True)
class RecoveryReport:
    classification: str
    """``applied`` | ``not_applied`` | ``partly_applied`` | ``unknown``."""
    plan_hash: str
    objects: tuple[ObjectRecovery, ...]

    @property
    def next_action(self) -> str:
        return NEXT_ACTION[self.classification]

    def to_dict(self) -> dict[str, Any]:
        return {
            "classification": self.classification,
            "plan_hash": self.plan_hash,
            "next_action": self.next_action,
            "objects": [o.to_dict() for o in self.objects],
        }
