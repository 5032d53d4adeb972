"""The ledger's tables, one definition for SQLite and PostgreSQL.

The tables are versioned with alembic (``executor/ledger/migrations``):
:data:`HEAD_REVISION` is the revision this code reads and writes.  A fresh
store is created from these definitions and stamped with it; an older store is
refused until ``capgate ledger migrate`` upgraded it.

Every text column is ``TEXT`` and every time is an ISO-8601 UTC string of fixed
width (``2026-01-31T12:00:00.000000Z``): such strings sort like the instants
they name, so expiry checks are plain string comparisons that behave the same
on both backends, and the exact stored text of ``recorded_at`` is what the
event digest covers, with no driver-specific timestamp conversion in between.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

HEAD_REVISION = "0003_wait_line"
"""The alembic revision these tables are (``tests/test_ledger_migrate.py`` checks it is
the migrations' head)."""
FIRST_REVISION = "0001_ledger_v1"
"""What a store without an ``alembic_version`` table but with ``cg_events`` is: format 1,
written before the tables were versioned."""

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
    # Format 2: the digest of the case state after this event (NULL for format 1).
    sa.Column("state_digest", sa.Text, nullable=True),
    sa.CheckConstraint("seq >= 0", name="ck_cg_events_seq"),
    # An intent's events by index: a closed intent's outcome (replays, the resume
    # fence, DDL replay) is read from them, not kept in the snapshot.
    sa.Index("ix_cg_events_intent", "case_id", "intent_id", "seq"),
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

# Anchors: the ledger-wide head over every case head, recorded by `capgate ledger
# anchor` (and exported to where the ledger's writers cannot rewrite it).  Checked
# by `ledger verify`: a case deleted, or rolled back to an older (validly signed)
# state since an anchor, is found.  Each anchor chains to the one before it.
anchors = sa.Table(
    "cg_anchors",
    metadata,
    sa.Column("anchor_seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("created_at", sa.Text, nullable=False),
    sa.Column("cases", sa.BigInteger, nullable=False),
    sa.Column("events", sa.BigInteger, nullable=False),
    sa.Column("heads_digest", sa.Text, nullable=False),
    sa.Column("heads", sa.Text, nullable=False),  # canonical JSON {case_id: [seq, digest]}
    sa.Column("prev_digest", sa.Text, nullable=False),
    sa.Column("digest", sa.Text, nullable=False),
    sa.Column("mac", sa.Text, nullable=True),
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

# The line of calls waiting for a held impact key or a full session budget
# (executor/waits.py): one row per (resource, turn).  A call that waits takes a turn
# (``seq``, from the ``wait_seq`` counter in cg_meta, only ever growing) and keeps
# its rows alive while it waits; a free key or slot goes to the earliest live turn
# that wants it, so a hot target is served in order of arrival and no waiter starves.
# ``resource`` is ``claim:<impact key>`` or ``slot:<budget scope>``.
waits = sa.Table(
    "cg_waits",
    metadata,
    sa.Column("resource", sa.Text, primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("case_id", sa.Text, nullable=True),
    sa.Column("intent_id", sa.Text, nullable=True),
    sa.Column("holder", sa.Text, nullable=True),
    sa.Column("enqueued_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Index("ix_cg_waits_seq", "seq"),
)
