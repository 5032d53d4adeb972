"""The loop's inputs and results: frozen dataclasses with ``to_dict()``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capgate.ddl.catalog import ObjectRef, ObjectStatus
from capgate.ddl.merge import MergeProposal
from capgate.registry.errors import CompensationFailed, DdlError, VerifyFailed
from capgate.registry.errors import lookup as lookup_error
from capgate.registry.vocabulary import Classification, OutcomeStatus

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


PASSED = "passed"
"""Checked, and fine."""
FAILED = "failed"
"""Checked, and broken by (or not restored by) this change: the verify fails."""
WARNING = "warning"
"""Not fine, but not this change's doing: already so before it, or an accepted checker warning."""
UNVERIFIED = "unverified"
"""Nothing could prove it works: read back only (MariaDB), or no checker for its language."""
VERDICTS = (PASSED, WARNING, UNVERIFIED, FAILED)

EXECUTED = "executed"
COMPARED = "compared"


@dataclass(frozen=True)
class Check:
    """One verification check and its verdict -- the same words for apply, ``verify --plan``
    and ``verify OBJECT``."""

    name: str
    object: str
    verdict: str
    """``passed`` | ``warning`` | ``unverified`` | ``failed`` (see ``VERDICTS``)."""
    detail: str = ""
    checked: str = ""
    """What was actually done: ``compiled``, ``executed`` (a smoke call, a fetch, a call),
    ``read back``, ``compared`` (signatures), ``not checked``, ``catalog``."""
    escaped: bool = False
    """The code the check ran left its containment (ended or started a transaction): what
    it wrote may be committed -- the loop escalates instead of recording a rollback."""

    @property
    def passed(self) -> bool:
        """False only for ``failed``; warnings and unverified checks do not fail a verify."""
        return self.verdict != FAILED

    @classmethod
    def of(cls, name: str, obj: str, ok: bool, detail: str = "", checked: str = "") -> Check:
        return cls(name, obj, PASSED if ok else FAILED, detail, checked)

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "object": self.object, "verdict": self.verdict,
               "passed": self.passed, "checked": self.checked, "detail": self.detail}
        if self.escaped:
            out["escaped"] = True
        return out


@dataclass(frozen=True)
class VerifyReport:
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.verdict == FAILED)

    @property
    def escapes(self) -> tuple[Check, ...]:
        """Checks whose code left its containment (see ``Check.escaped``)."""
        return tuple(c for c in self.checks if c.escaped)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(VERDICTS, 0)
        for c in self.checks:
            out[c.verdict] = out.get(c.verdict, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "counts": self.counts(),
                "checks": [c.to_dict() for c in self.checks]}


def judge(name: str, key: str, after: ObjectStatus | None, before: ObjectStatus | None,
          accepted: Sequence[Mapping[str, Any]] = (), *, same_as_before_is_fine: bool = True
          ) -> Check:
    """The one verdict rule for an object (a changed object, a dependent, a recompile).

    * invalid with only errors the row accepts -- ``warning`` (the reason is shown);
    * invalid or missing as it already was before -- ``warning`` when
      ``same_as_before_is_fine`` (dependents, a compensation's restored objects),
      else ``failed`` (a changed object must compile after its own apply);
    * otherwise invalid or missing -- ``failed``;
    * compiled (or uncheckable) and its run check failed -- ``failed``, unless it failed
      the same way before the change (then the run proves nothing either way);
    * its run check ran (a row fetched, a call returned) -- ``passed``, ``executed``;
    * valid by a check that covers it (``ObjectStatus.covers``: plpgsql_check, Oracle's
      status after a recompile) -- ``passed``;
    * anything else -- ``unverified``: nothing proved it works (a view that gave no row, a
      function with arguments ``fmgr_sql_validator`` only planned, a MariaDB routine
      only read back), with what was and was not done.
    """
    if after is None:
        return Check(name, key, FAILED, "not checked: the object could not be read", "")
    detail = f"{after.state} ({after.method})"
    if after.errors:
        detail += ": " + "; ".join(after.errors)
    if after.state in ("valid", "unchecked"):
        run = after.run
        note = ""
        if run in ("error",):
            same = (before is not None and before.run == "error"
                    and before.run_detail == after.run_detail)
            if not same:
                was = ("it ran before the change" if before is not None
                       and before.run in ("ran", "no_row") else
                       "it failed otherwise before" if before is not None
                       and before.run == "error" else "not run before")
                return Check(name, key, FAILED, f"{detail}; ran and failed: {after.run_detail}"
                             f" -- {was}", EXECUTED)
            note = (f"; its run check fails as it did before the change "
                    f"({after.run_detail})")
            run = None
        if run == "ran":
            return Check(name, key, PASSED, f"{detail}; {after.run_detail}", EXECUTED)
        if after.state == "valid" and after.covers:
            extra = f"; {after.run_detail}" if run is not None and after.run_detail else ""
            return Check(name, key, PASSED, detail + note + extra, after.checked)
        why = after.run_detail if run is not None and after.run_detail else \
            "no run check could be made"
        return Check(name, key, UNVERIFIED, f"{detail}{note}; {why}", after.checked)
    if after.state == "invalid" and after.errors:
        reasons = [accepted_reason(after.object, e, accepted) for e in after.errors]
        if all(reasons):
            why = "; ".join(sorted({str(r) for r in reasons}))
            return Check(name, key, WARNING, f"{detail} -- accepted on the row: {why}",
                         after.checked)
    if before is not None and before.state == after.state and same_as_before_is_fine:
        same = set(after.errors) <= set(before.errors) or after.state == "missing"
        if same:
            return Check(name, key, WARNING,
                         f"{detail} -- already {before.state} before the change, with the same "
                         "errors", after.checked)
    was = before.state if before is not None else "unknown"
    return Check(name, key, FAILED, f"{detail} -- {was} before", after.checked)


def accepted_reason(ref: ObjectRef, error: str, accepted: Sequence[Mapping[str, Any]]
                    ) -> str | None:
    """The reason a row gives for accepting ``error`` on ``ref`` (``ddl.accepted_warnings``)."""
    for a in accepted:
        kind, _, name = str(a.get("object", "")).partition(":")
        if kind == ref.kind and name.casefold() == ref.name.casefold() and str(
                a.get("message", "")) in error:
            return str(a.get("reason") or "accepted")
    return None


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
    causes: tuple[str, ...] = ()
    """Why it failed, in words: the action that failed, the object whose live signature
    differs from its snapshot's, or the check that failed (empty when ok)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "causes": list(self.causes),
            "snapshot_ids": dict(self.snapshot_ids),
            "actions": [dict(a) for a in self.actions],
            "live_signatures": dict(self.live_signatures),
            "snapshot_signatures": dict(self.snapshot_signatures),
            "verify": None if self.verify is None else self.verify.to_dict(),
        }


APPLIED_VERIFIED = OutcomeStatus.APPLIED_VERIFIED
ROLLED_BACK = OutcomeStatus.ROLLED_BACK
COMPENSATED = OutcomeStatus.COMPENSATED
COMPENSATION_FAILED = OutcomeStatus.COMPENSATION_FAILED


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
    new_bases: Mapping[str, str] = field(default_factory=dict)
    """After ``applied_verified``: object key -> the snapshot of what was applied, the base of
    the next plan (capgate's own change is never "theirs")."""

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
            "new_bases": dict(self.new_bases),
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


NEXT_ACTION: dict[str, str] = {
    Classification.APPLIED: "record the apply as observed, then verify (capgate ddl verify)",
    Classification.NOT_APPLIED: "nothing landed: the same plan may be applied again",
    Classification.PARTLY_APPLIED:
        "compensate from the snapshots (capgate ddl compensate) or escalate; "
        "never re-apply blindly",
    Classification.UNKNOWN:
        "escalate: the live objects match neither the snapshots nor the new sources",
}


@dataclass(frozen=True)
class RecoveryReport:
    classification: str
    """A :class:`~registry.vocabulary.Classification`: what of the plan landed."""
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
