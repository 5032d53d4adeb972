"""Loading many cases for resume, verified, in a few reads instead of one per case.

The reading and the chain check are the ledger's own
(:meth:`executor.ledger.Ledger.load_verified_many`, :meth:`~executor.ledger.Ledger.snapshots`);
this module only names them the way resume uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capgate.executor.ledger import Ledger, VerifiedCase


def load_verified_many(ledger: Ledger, case_ids: Sequence[str]) -> dict[str, VerifiedCase]:
    """Every case of ``case_ids``, verified; LedgerTampered / UnknownCase like ``load_verified``."""
    return ledger.load_verified_many(case_ids)


def read_snapshots(ledger: Ledger, case_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The stored snapshots of many cases (unverified: the fast re-read before acting)."""
    return ledger.snapshots(case_ids)
