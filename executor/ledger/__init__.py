"""The durable, hash-chained ledger: events per case, snapshots, and the records beside them.

``store`` is the ledger itself (appends, reads, verification, idempotency
claims, plans and approvals); ``chain`` is its pure part (events, digests, the
snapshot reducer, chain checks); ``backends`` holds what differs between the
SQLite and the PostgreSQL store; ``schema`` declares the tables.
"""

from capgate.executor.ledger.backends import LedgerBounds
from capgate.executor.ledger.store import (
    FINDING_KINDS,
    GENESIS_DIGEST,
    HMAC_KEY_ENV,
    RESERVED_INTENT_KEYS,
    TERMINAL_STATUSES,
    Anchor,
    ApprovalRecord,
    CaseSummary,
    Event,
    Finding,
    IdempotencyRecord,
    KeyAlreadyClaimed,
    KeyClaim,
    Ledger,
    PlanRecord,
    VerifiedCase,
    VerifyReport,
    apply_event,
    digest_of,
    empty_state,
    event_digest,
    fold,
    head_mac,
    intent_states,
    is_open_status,
    open_ledger,
    state_digest,
)

__all__ = [
    "FINDING_KINDS",
    "GENESIS_DIGEST",
    "HMAC_KEY_ENV",
    "RESERVED_INTENT_KEYS",
    "TERMINAL_STATUSES",
    "Anchor",
    "ApprovalRecord",
    "CaseSummary",
    "Event",
    "Finding",
    "IdempotencyRecord",
    "KeyAlreadyClaimed",
    "KeyClaim",
    "Ledger",
    "LedgerBounds",
    "PlanRecord",
    "VerifiedCase",
    "VerifyReport",
    "apply_event",
    "digest_of",
    "empty_state",
    "event_digest",
    "fold",
    "head_mac",
    "intent_states",
    "is_open_status",
    "open_ledger",
    "state_digest",
]
