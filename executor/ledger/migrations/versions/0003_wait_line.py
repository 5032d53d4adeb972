"""The wait line: calls waiting for a held impact key or a full session budget.

* ``cg_waits``: one row per (resource, turn) of a waiting call
  (``executor/waits.py``); a free key or slot goes to the earliest live turn that
  wants it.  Nothing else changes: the events, snapshots and digests are as format 2
  wrote them, so no case is re-derived.

Revision ID: 0003_wait_line
Revises: 0002_ledger_v2
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_wait_line"
down_revision = "0002_ledger_v2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cg_waits",
        sa.Column("resource", sa.Text, primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("case_id", sa.Text, nullable=True),
        sa.Column("intent_id", sa.Text, nullable=True),
        sa.Column("holder", sa.Text, nullable=True),
        sa.Column("enqueued_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )
    op.create_index("ix_cg_waits_seq", "cg_waits", ["seq"])


def downgrade() -> None:
    op.drop_index("ix_cg_waits_seq", table_name="cg_waits")
    op.drop_table("cg_waits")
