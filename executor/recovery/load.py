"""Loading many cases for resume, verified, in a few reads instead of one per case.

``Ledger.load_verified`` reads and checks one case (two statements on
PostgreSQL).  Resuming a thousand open cases that way costs a thousand round
trips before the first piece of evidence is asked for, so this module reads
the cases' rows and events in chunks of 500, in one consistent read, and runs
the very same chain check (:func:`executor.ledger.chain.check_case`) on each.
Anything that does not verify raises ``LedgerTampered`` exactly as
``load_verified`` would.

A ledger whose heads are signed (HMAC) keeps its key to itself, so its cases
are loaded one by one through ``Ledger.load_verified``, which checks the MAC.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from executor.ledger import Ledger, VerifiedCase
from executor.ledger.backends import backend_for
from executor.ledger.chain import CaseRow, Event, check_case
from executor.ledger.schema import cases, events
from registry.errors import LedgerTampered, UnknownCase

_CHUNK = 500


def load_verified_many(ledger: Ledger, case_ids: Sequence[str]) -> dict[str, VerifiedCase]:
    """Every case of ``case_ids``, verified; LedgerTampered / UnknownCase like ``load_verified``."""
    wanted = list(dict.fromkeys(case_ids))
    if ledger.signed or len(wanted) < 4:
        return {c: ledger.load_verified(c) for c in wanted}
    out: dict[str, VerifiedCase] = {}
    options = backend_for(ledger.engine.url).consistent_read_options()
    with ledger.engine.connect().execution_options(**options) as conn, conn.begin():
        for i in range(0, len(wanted), _CHUNK):
            chunk = wanted[i:i + _CHUNK]
            rows = {r.case_id: r for r in conn.execute(
                sa.select(cases).where(cases.c.case_id.in_(chunk)))}
            chains: dict[str, list[Event]] = {c: [] for c in chunk}
            for r in conn.execute(sa.select(events).where(events.c.case_id.in_(chunk))
                                  .order_by(events.c.case_id, events.c.seq)):
                chains[r.case_id].append(_event(r))
            for case_id in chunk:
                out[case_id] = _verified(case_id, chains[case_id], rows.get(case_id))
    return out


def read_snapshots(ledger: Ledger, case_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The stored snapshots of many cases (unverified: the fast re-read before acting)."""
    out: dict[str, dict[str, Any]] = {}
    wanted = list(dict.fromkeys(case_ids))
    options = backend_for(ledger.engine.url).single_read_options()
    with ledger.engine.connect().execution_options(**options) as conn:
        for i in range(0, len(wanted), _CHUNK):
            for r in conn.execute(sa.select(cases.c.case_id, cases.c.snapshot)
                                  .where(cases.c.case_id.in_(wanted[i:i + _CHUNK]))):
                try:
                    out[r.case_id] = json.loads(r.snapshot)
                except ValueError:
                    raise _tampered(r.case_id, "the snapshot is not JSON") from None
        conn.rollback()
    return out


def _event(r: Any) -> Event:
    try:
        payload = json.loads(r.payload)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise _tampered(r.case_id, f"event {r.seq} has a payload that is not a JSON object")
    return Event(case_id=r.case_id, seq=int(r.seq), kind=r.kind, intent_id=r.intent_id,
                 payload=payload, prev_digest=r.prev_digest, digest=r.digest,
                 recorded_at=r.recorded_at)


def _verified(case_id: str, chain: list[Event], row: Any) -> VerifiedCase:
    if row is None and not chain:
        raise UnknownCase(f"no case {case_id!r} in the ledger", case_id=case_id)
    case = None if row is None else CaseRow(row.snapshot, int(row.head_seq), row.head_digest,
                                            row.head_mac)
    findings = check_case(case_id, chain, case, None)
    if findings or case is None:
        kinds = ", ".join(sorted({f.kind for f in findings})) or "case_missing"
        raise LedgerTampered(
            f"case {case_id!r} does not verify ({kinds}); run `capgate ledger verify --case "
            f"{case_id}` and do not continue the case until the cause is understood",
            case_id=case_id, findings=[f.to_dict() for f in findings])
    return VerifiedCase(case_id, tuple(chain), json.loads(case.snapshot))


def _tampered(case_id: str, detail: str) -> LedgerTampered:
    return LedgerTampered(
        f"case {case_id!r}: {detail}; run `capgate ledger verify --case {case_id}`",
        case_id=case_id)
