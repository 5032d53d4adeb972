"""The ledger's tables, one definition for SQLite and PostgreSQL.

Every text column is ``TEXT`` and every time is an ISO-8601 UTC string of fixed
width (``2026-01-31T12:00:00.000000Z``): such strings sort like the instants
they name, so expiry checks are plain string comparisons that behave the same
on both backends, and the exact stored text of ``recorded_at`` is what the
event digest covers, with no driver-specific timestamp conversion in between.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

events = sa.Table(
    "cg_events",
    metadata,
    sa.Column("case_id", sa.Text, primary_key=True),
    # The primary key on (case_id, seq) is the last line of defence against a
    # forked chain: two writers can never both record seq N of one case.
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("intent_id", sa.Text, nullable=True),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("prev_digest", sa.Text, nullable=False),
    sa.Column("digest", sa.Text, nullable=False),
    sa.Column("recorded_at", sa.Text, nullable=False),
    sa.CheckConstraint("seq >= 0", name="ck_cg_events_seq"),
)

cases = sa.Table(
    "cg_cases",
    metadata,
    sa.Column("case_id", sa.Text, primary_key=True),
    sa.Column("snapshot", sa.Text, nullable=False),
    sa.Column("head_seq", sa.BigInteger, nullable=False),
    sa.Column("head_digest", sa.Text, nullable=False),
    sa.Column("head_mac", sa.Text, nullable=True),
    sa.Column("updated_at", sa.Text, nullable=False),
)

idempotency = sa.Table(
    "cg_idempotency",
    metadata,
    sa.Column("idem_key", sa.Text, primary_key=True),
    sa.Column("case_id", sa.Text, nullable=False),
    sa.Column("intent_id", sa.Text, nullable=False),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("operation_id", sa.Text, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
)

plans = sa.Table(
    "cg_plans",
    metadata,
    sa.Column("plan_hash", sa.Text, primary_key=True),
    sa.Column("case_id", sa.Text, nullable=False),
    sa.Column("requester", sa.Text, nullable=False),
    sa.Column("plan", sa.Text, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
)

approvals = sa.Table(
    "cg_approvals",
    metadata,
    sa.Column("approval_id", sa.Text, primary_key=True),
    sa.Column("plan_hash", sa.Text, nullable=False, index=True),
    sa.Column("approver", sa.Text, nullable=False),
    sa.Column("role", sa.Text, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
    sa.Column("expires_at", sa.Text, nullable=False),
    sa.Column("used_by_intent", sa.Text, nullable=True),
    sa.Column("used_at", sa.Text, nullable=True),
)

# The proof of each approval: the approver's public key and Ed25519 signature of
# the approval (executor/approvals.py).  A table of its own so that stores made
# before approvals were signed gain it on open without touching cg_approvals.
approval_proofs = sa.Table(
    "cg_approval_proofs",
    metadata,
    sa.Column("approval_id", sa.Text, primary_key=True),
    sa.Column("public_key", sa.Text, nullable=False),
    sa.Column("signature", sa.Text, nullable=False),
)

# --- coordination tables (executor/claims.py, executor/budget.py) -------------
#
# Unlike the chain, these rows are compared against *the store's own clock*
# (epoch seconds as FLOAT): an expiry written by one machine and tested by
# another must use one clock, and the store is the only one they share.

# The store's own identity: a random id created once.  Fencing rows in a target
# are namespaced by it, so that two ledgers (say a developer's SQLite file and
# the shared PostgreSQL store) never read each other's tokens as newer.
meta = sa.Table(
    "cg_meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

claims = sa.Table(
    "cg_claims",
    metadata,
    # One row per impact key, never deleted: ``token`` only grows, so a fencing
    # token is never reused even after the key was released and claimed again.
    sa.Column("impact_key", sa.Text, primary_key=True),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("case_id", sa.Text, nullable=True),  # NULL: free
    sa.Column("intent_id", sa.Text, nullable=True),
    sa.Column("operation_id", sa.Text, nullable=True),
    sa.Column("holder", sa.Text, nullable=True),  # host:pid of the claiming executor
    sa.Column("acquired_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)

budget_slots = sa.Table(
    "cg_budget_slots",
    metadata,
    # Slots 0..N-1 of one scope (``connector:NAME`` or ``db_user:USER@HOST:PORT``).
    sa.Column("scope", sa.Text, primary_key=True),
    sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("ticket", sa.Text, nullable=True),  # NULL: free
    sa.Column("case_id", sa.Text, nullable=True),
    sa.Column("intent_id", sa.Text, nullable=True),
    sa.Column("holder", sa.Text, nullable=True),
    sa.Column("acquired_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)
