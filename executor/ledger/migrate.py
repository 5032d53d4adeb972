"""The ledger's table versions: what a store is, the refusal to touch an older one, the upgrade.

Ledger tables are versioned with alembic (``executor/ledger/migrations``).  A
store records its revision in ``alembic_version``; one written before the
tables were versioned (format 1) has ``cg_events`` and no such table, and
counts as :data:`~executor.ledger.schema.FIRST_REVISION`.

Opening a ledger never migrates it: :func:`check_revision` refuses a store of
another revision with :class:`~registry.errors.LedgerNotMigrated`, so an old
process can never write format-1 events into a format-2 store or the other way
round.  ``capgate ledger migrate`` (:func:`upgrade`) runs the migrations, in one
transaction, under the store's DDL lock.  alembic is imported only here, and
only when migrating: opening a ledger reads one row.

The format-2 migration re-derives every case's snapshot from its events (open
intents only), after checking each case still verifies under format 1's own
rules -- it refuses, changing nothing, when one does not, so a migration never
launders an edited record into a valid one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from capgate.executor.ledger.chain import (
    GENESIS_DIGEST,
    CaseRow,
    Event,
    canonical_text,
    check_case,
    fold,
)
from capgate.executor.ledger.schema import FIRST_REVISION, HEAD_REVISION, cases, events
from capgate.registry.errors import LedgerNotMigrated, LedgerTampered

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "alembic_version"


def current_revision(conn: Connection) -> str | None:
    """The store's revision: ``alembic_version``'s, FIRST_REVISION for an unversioned
    format-1 store, None for an empty database."""
    names = set(sa.inspect(conn).get_table_names())
    if VERSION_TABLE in names:
        row = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).first()
        return str(row[0]) if row is not None else None
    if "cg_events" in names:
        return FIRST_REVISION
    return None


def stamp_head(conn: Connection) -> None:
    """Record HEAD_REVISION in a store just created from the current table definitions
    (what ``alembic stamp head`` does, without importing alembic on every open)."""
    conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} "
                         "(version_num VARCHAR(32) NOT NULL PRIMARY KEY)"))
    conn.execute(sa.text(f"DELETE FROM {VERSION_TABLE}"))
    conn.execute(sa.text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES (:v)"),
                 {"v": HEAD_REVISION})


def check_revision(revision: str | None, where: str) -> None:
    """Refuse a store this code must not read or write (LedgerNotMigrated)."""
    if revision == HEAD_REVISION:
        return
    if revision in _OLDER:
        raise LedgerNotMigrated(
            f"the ledger at {where} is at revision {revision} (format "
            f"{_OLDER[revision]}); this capgate reads and writes {HEAD_REVISION}: run "
            "`capgate ledger migrate` (after a backup), then try again -- nothing was read "
            "or written", ledger=where, revision=revision, expected=HEAD_REVISION)
    raise LedgerNotMigrated(
        f"the ledger at {where} is at revision {revision!r}, which this capgate does not "
        f"know (it reads and writes {HEAD_REVISION}): it was written by a newer capgate; "
        "use that version", ledger=where, revision=revision, expected=HEAD_REVISION)


_OLDER = {FIRST_REVISION: 1, "0002_ledger_v2": 2}
"""Revisions ``capgate ledger migrate`` upgrades from, with their ledger format (``0002``
to ``0003`` adds the wait line's table and changes no event)."""


@dataclass(frozen=True)
class MigrationReport:
    """What ``capgate ledger migrate`` did."""

    before: str | None
    after: str
    cases_rewritten: int

    def to_dict(self) -> dict[str, Any]:
        return {"before": self.before, "after": self.after,
                "cases_rewritten": self.cases_rewritten}


def upgrade(conn: Connection, *, key: bytes | None) -> MigrationReport:
    """Upgrade the store on ``conn`` (inside the caller's transaction) to HEAD_REVISION.

    ``key`` is the ledger's HMAC key: the format-2 migration checks each case's
    MAC with it before rewriting the case's snapshot.
    """
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    before = current_revision(conn)
    if before == HEAD_REVISION:
        return MigrationReport(before, HEAD_REVISION, 0)
    if before is not None and before not in _OLDER:
        check_revision(before, str(conn.engine.url.render_as_string(hide_password=True)))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    config.attributes["hmac_key"] = key
    config.attributes["rewritten"] = 0
    script = ScriptDirectory.from_config(config)
    if before is not None:
        MigrationContext.configure(conn).stamp(script, before)
    from alembic import command

    command.upgrade(config, "head")
    return MigrationReport(before, HEAD_REVISION, int(config.attributes["rewritten"]))


def head_of_scripts() -> str:
    """The migrations' head revision (tests compare it with HEAD_REVISION)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    head = ScriptDirectory.from_config(config).get_current_head()
    return str(head)


# --- the format-2 data step ---------------------------------------------------------------


def rewrite_snapshots(conn: Connection, key: bytes | None) -> int:
    """Every case's snapshot as format 2 derives it from the events; returns how many.

    Each case is first checked under format 1's rules (digests, links, head,
    the format-1 snapshot, and the MAC when a key is given); any finding
    refuses the whole migration (LedgerTampered, nothing written).
    """
    rows = {r.case_id: r for r in conn.execute(sa.select(
        cases.c.case_id, cases.c.snapshot, cases.c.head_seq, cases.c.head_digest,
        cases.c.head_mac))}
    chains: dict[str, list[Event]] = {}
    for r in conn.execute(sa.select(events.c.case_id, events.c.seq, events.c.kind,
                                    events.c.intent_id, events.c.payload,
                                    events.c.prev_digest, events.c.digest,
                                    events.c.recorded_at)
                          .order_by(events.c.case_id, events.c.seq)):
        chains.setdefault(r.case_id, []).append(_event(r))
    problems: dict[str, list[dict[str, Any]]] = {}
    for case_id in sorted(set(rows) | set(chains)):
        chain = chains.get(case_id, [])
        row = rows.get(case_id)
        findings = _format1_findings(case_id, chain, row, key)
        if findings:
            problems[case_id] = findings
    if problems:
        named = ", ".join(sorted(problems)[:5]) + (" ..." if len(problems) > 5 else "")
        raise LedgerTampered(
            f"{len(problems)} case(s) do not verify as format 1 ({named}); the migration "
            "changed nothing -- run `capgate ledger verify` on the old version and settle "
            "them first", findings=problems)
    for case_id, chain in chains.items():
        conn.execute(sa.update(cases).where(cases.c.case_id == case_id)
                     .values(snapshot=canonical_text(fold(chain))))
    return len(chains)


def _event(r: Any) -> Event:
    try:
        payload = json.loads(r.payload)
    except ValueError:
        payload = {"unreadable_payload": str(r.payload)}
    if not isinstance(payload, dict):
        payload = {"unreadable_payload": str(r.payload)}
    return Event(case_id=r.case_id, seq=int(r.seq), kind=r.kind, intent_id=r.intent_id,
                 payload=payload, prev_digest=r.prev_digest, digest=r.digest,
                 recorded_at=r.recorded_at)


def _format1_findings(case_id: str, chain: Sequence[Event], row: Any,
                      key: bytes | None) -> list[dict[str, Any]]:
    """Format 1's own check: the chain (shared with format 2), then its full snapshot."""
    case = None if row is None else CaseRow(
        # the chain checks compare the snapshot to format 2's fold: give them that, and
        # compare the stored snapshot to format 1's fold here instead
        canonical_text(fold(chain)) if chain else "", int(row.head_seq), row.head_digest,
        row.head_mac)
    found = [f.to_dict() for f in check_case(case_id, list(chain), case, key)]
    if row is not None and chain and row.snapshot != canonical_text(_fold_format1(chain)):
        found.append({"case_id": case_id, "seq": None, "kind": "snapshot_mismatch",
                      "detail": "the stored format-1 snapshot differs from fold(events)"})
    return found


def _fold_format1(chain: Sequence[Event]) -> dict[str, Any]:
    """Format 1's reducer: every intent stays in the snapshot, whatever its status."""
    state: dict[str, Any] = {"case_id": chain[0].case_id, "head_seq": -1,
                             "head_digest": GENESIS_DIGEST, "case": {}, "intents": {}}
    for event in chain:
        state = dict(state)
        state["head_seq"] = event.seq
        state["head_digest"] = event.digest
        case_state = event.payload.get("case_state")
        if case_state:
            state["case"] = {**state["case"], **case_state}
        if event.intent_id is not None:
            intents: dict[str, Any] = dict(state["intents"])
            merged: dict[str, Any] = {**intents.get(event.intent_id, {}),
                                      **(event.payload.get("state") or {})}
            merged["status"] = event.kind
            merged["last_seq"] = event.seq
            intents[event.intent_id] = merged
            state["intents"] = intents
    return state

