"""Ledger format 1: the tables as they were before they were versioned.

A store written by format-1 code has these tables and no ``alembic_version``;
``capgate ledger migrate`` stamps it with this revision, then upgrades it.
On an empty database this creates them, so that the migrations alone build
the same tables as :data:`executor.ledger.schema.metadata`
(``tests/test_ledger_migrate.py`` compares the two).

Revision ID: 0001_ledger_v1
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_ledger_v1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cg_events",
        sa.Column("case_id", sa.Text, primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("intent_id", sa.Text, nullable=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("prev_digest", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.Text, nullable=False),
        sa.CheckConstraint("seq >= 0", name="ck_cg_events_seq"),
    )
    op.create_table(
        "cg_cases",
        sa.Column("case_id", sa.Text, primary_key=True),
        sa.Column("snapshot", sa.Text, nullable=False),
        sa.Column("head_seq", sa.BigInteger, nullable=False),
        sa.Column("head_digest", sa.Text, nullable=False),
        sa.Column("head_mac", sa.Text, nullable=True),
        sa.Column("updated_at", sa.Text, nullable=False),
    )
    op.create_table(
        "cg_idempotency",
        sa.Column("idem_key", sa.Text, primary_key=True),
        sa.Column("case_id", sa.Text, nullable=False),
        sa.Column("intent_id", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("operation_id", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
    )
    op.create_table(
        "cg_plans",
        sa.Column("plan_hash", sa.Text, primary_key=True),
        sa.Column("case_id", sa.Text, nullable=False),
        sa.Column("requester", sa.Text, nullable=False),
        sa.Column("plan", sa.Text, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
    )
    op.create_table(
        "cg_approvals",
        sa.Column("approval_id", sa.Text, primary_key=True),
        sa.Column("plan_hash", sa.Text, nullable=False),
        sa.Column("approver", sa.Text, nullable=False),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
        sa.Column("expires_at", sa.Text, nullable=False),
        sa.Column("used_by_intent", sa.Text, nullable=True),
        sa.Column("used_at", sa.Text, nullable=True),
    )
    op.create_index("ix_cg_approvals_plan_hash", "cg_approvals", ["plan_hash"])
    op.create_table(
        "cg_approval_proofs",
        sa.Column("approval_id", sa.Text, primary_key=True),
        sa.Column("public_key", sa.Text, nullable=False),
        sa.Column("signature", sa.Text, nullable=False),
    )
    op.create_table(
        "cg_meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.create_table(
        "cg_claims",
        sa.Column("impact_key", sa.Text, primary_key=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("case_id", sa.Text, nullable=True),
        sa.Column("intent_id", sa.Text, nullable=True),
        sa.Column("operation_id", sa.Text, nullable=True),
        sa.Column("holder", sa.Text, nullable=True),
        sa.Column("acquired_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )
    op.create_table(
        "cg_budget_slots",
        sa.Column("scope", sa.Text, primary_key=True),
        sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("ticket", sa.Text, nullable=True),
        sa.Column("case_id", sa.Text, nullable=True),
        sa.Column("intent_id", sa.Text, nullable=True),
        sa.Column("holder", sa.Text, nullable=True),
        sa.Column("acquired_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    raise NotImplementedError("the ledger is never downgraded below its first format")
