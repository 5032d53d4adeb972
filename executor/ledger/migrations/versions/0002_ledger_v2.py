"""Ledger format 2: state digests on events, an index on an intent's events, anchors.

* ``cg_events.state_digest``: the digest of the case state after each new event
  (NULL for the events format 1 wrote, which keep hashing as they did);
* ``ix_cg_events_intent`` on ``(case_id, intent_id, seq)``: a closed intent's
  outcome is read from its events;
* ``cg_anchors``: the ledger-wide heads ``capgate ledger anchor`` records;
* every case's snapshot re-derived from its events as format 2 keeps it (open
  intents only), after each case verified under format 1's rules.

Revision ID: 0002_ledger_v2
Revises: 0001_ledger_v1
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from capgate.executor.ledger.migrate import rewrite_snapshots

revision = "0002_ledger_v2"
down_revision = "0001_ledger_v1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cg_events") as batch:
        batch.add_column(sa.Column("state_digest", sa.Text, nullable=True))
    op.create_index("ix_cg_events_intent", "cg_events", ["case_id", "intent_id", "seq"])
    op.create_table(
        "cg_anchors",
        sa.Column("anchor_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("created_at", sa.Text, nullable=False),
        sa.Column("cases", sa.BigInteger, nullable=False),
        sa.Column("events", sa.BigInteger, nullable=False),
        sa.Column("heads_digest", sa.Text, nullable=False),
        sa.Column("heads", sa.Text, nullable=False),
        sa.Column("prev_digest", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("mac", sa.Text, nullable=True),
    )
    config = op.get_context().config
    attributes = config.attributes if config is not None else {}
    rewritten = rewrite_snapshots(op.get_bind(), attributes.get("hmac_key"))
    attributes["rewritten"] = int(attributes.get("rewritten") or 0) + rewritten


def downgrade() -> None:
    raise NotImplementedError("format 2 is not downgraded: restore the backup taken before")
