"""The words capgate records: outcome statuses, what landed, why a write rolled back.

Each is a ``StrEnum`` defined here once, at the lowest layer, so that the
executor (``executor.outcome``), the DDL loop (``ddl.results``), recovery and
the ledger's readers spell them the same way.  A member *is* its string: it
compares equal to the text read back from a ledger, serialises to the same
canonical JSON (``registry.canonical``) and needs no conversion at the edges.
"""

from __future__ import annotations

from enum import StrEnum


class OutcomeStatus(StrEnum):
    """The answer of one call (and of one DDL plan's apply)."""

    APPLIED_VERIFIED = "applied_verified"
    """The write committed and every declared check held (or was proven after the commit)."""
    ROLLED_BACK = "rolled_back"
    """Nothing of this call stayed: the reason says why (a :class:`RollbackReason`)."""
    OK = "ok"
    """A read answered."""
    COMPENSATED = "compensated"
    """A post-commit check failed, the compensation ran and a re-read says the state is restored."""
    COMPENSATION_FAILED = "compensation_failed"
    """A post-commit check failed and the restoration was not shown: escalated with evidence."""
    ALREADY_APPLIED = "already_applied"
    """The very same request had landed under another intent; nothing was executed now."""
    SIMULATED = "simulated"
    """A simulation's write, torn down from its write log with the baseline re-read identical."""


class Classification(StrEnum):
    """What recovery concluded landed of one in-flight intent or plan -- never a guess."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    PARTLY_APPLIED = "partly_applied"
    UNKNOWN = "unknown"


class RollbackReason(StrEnum):
    """The ``kind`` of a ``rolled_back`` (or escalated) outcome's reason."""

    COUNT = "count"
    """A statement touched another number of rows than its row declares."""
    VERIFY = "verify"
    """A verify check inside the transaction did not hold."""
    REPLAY = "replay"
    """The replay statement of an at-most-once row found the effect already there."""
    CONNECTION_FAILED = "connection_failed"
    """The target could not be reached; nothing was sent."""
    REHEARSAL_ROLLED_BACK = "rehearsal_rolled_back"
    """A rehearsal ran the write and rolled it back on purpose."""
    TRANSACTION_SPLIT = "transaction_split"
    """The write's statements did not stay in one transaction."""
    ALREADY_LANDED = "already_landed"
    """The landing marker shows the key landed under another intent."""
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    """The key is held by another request with other inputs."""
    TIMEOUT = "timeout"
    """The statement or transaction ran past its deadline and the database stopped it."""
    READ_ONLY_VIOLATION = "read_only_violation"
    """A read row tried to write."""
    TARGET_NOT_INSTALLED = "target_not_installed"
    """The row's table or routine is not in the target database."""
    DATABASE_ERROR = "database_error"
    """Any other error the database raised."""
    LEASE_EXPIRED = "lease_expired"
    """A leased transaction's lease ran out before it committed."""
    ABORT = "abort"
    """A leased step asked to abort."""
    STALE_FENCE = "stale_fence"
    """The impact claim's fence moved on: a newer holder wrote; this stale one did not."""
    LEDGER_BEHIND = "ledger_behind"
    """The target's fence holds a token the ledger never issued: the ledger lost history
    (restored from an older backup, edited); nothing was committed."""
    STALE_ATTEMPT_APPLIED = "stale_attempt_applied"
    """A woken stale attempt found its effect applied by another attempt."""
    POST_COMMIT_FAILED = "post_commit_failed"
    """A post-commit check failed (the compensation's outcome follows)."""
    NO_COMPENSATION = "no_compensation"
    """A post-commit check failed and the row declares no compensation."""
    COMPENSATION_FAILED = "compensation_failed"
    """The compensation did not run, or its re-read did not show the state restored."""
    NOT_APPLIED = "not_applied"
    """Recovery proved nothing landed."""
    REFUSED_BEFORE_APPLY = "refused_before_apply"
    """The DDL loop refused the plan before changing anything."""
