"""A target's fence rows against the ledger's claim tokens: finding a ledger that lost history.

Every fencing token is committed in the ledger (``cg_claims``) before its holder
writes the target, and a key's token only grows, so the target's fence row
(``capgate_fence``) never holds a token above the ledger's -- unless the ledger
lost history: restored from an older backup, edited, or cloned.  Then every
write to the key is refused at COMMIT (``ledger_behind``, CG416) until its new
tokens pass the target's, and the writes the target holds under the newer tokens
may be missing from the ledger.

:func:`fence_report` lists each fence row of this ledger with the ledger's token
and, for a key the ledger is behind on, the landing marker of the intent that
wrote it last (its case, operation and time: what the ledger lost).
:func:`realign` -- for a person, once they have looked -- raises the ledger's
token of each such key to the target's, so the key can be written again, and
records what it did in a case of its own.  Raising a token never lets a stale
write through: a holder of an older token is refused by the fence as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from capgate.executor.claims import ClaimStore, key_hash
from capgate.executor.connectors import Connector
from capgate.executor.dialects.base import FENCE_TABLE, MARKER_TABLE, first_line
from capgate.executor.ledger import Ledger
from capgate.registry.errors import ConnectorUnavailable, TargetNotInstalled

__all__ = ["FenceRow", "fence_report", "realign"]

OK = "ok"
LEDGER_BEHIND = "ledger_behind"
NOT_OURS = "not_this_ledger"
_CHUNK = 200


@dataclass(frozen=True)
class FenceRow:
    """One fence row of a target, as this ledger sees it."""

    impact_key: str
    fence_token: int
    fence_intent: str
    ledger_token: int | None
    """This ledger's token for the key (None: it has no claim row for it)."""
    state: str
    """``ok``; ``ledger_behind`` (the fence holds a token this ledger never issued);
    ``not_this_ledger`` (the row's hash is another ledger's, or of a key longer than
    the 400 characters the row keeps)."""
    landed: dict[str, Any] | None = None
    """For ``ledger_behind``: the landing marker of ``fence_intent`` in the target
    (case, operation, attempt, landed_at), None when there is none."""

    def to_dict(self) -> dict[str, Any]:
        return {"impact_key": self.impact_key, "fence_token": self.fence_token,
                "fence_intent": self.fence_intent, "ledger_token": self.ledger_token,
                "state": self.state, "landed": self.landed}


def _target_rows(connector: Connector, sql: str, binds: dict[str, Any] | None = None
                 ) -> list[tuple[Any, ...]]:
    try:
        with connector.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql), binds or {})]
    except sa.exc.DBAPIError as exc:
        if connector.dialect.is_undefined_table(exc):
            raise TargetNotInstalled(
                f"connector {connector.name!r} has no {FENCE_TABLE}/{MARKER_TABLE}: run "
                f"`capgate target install {connector.name}`", connector=connector.name) from None
        if isinstance(exc, sa.exc.OperationalError):
            raise ConnectorUnavailable(f"connector {connector.name!r} is unreachable: "
                                       f"{first_line(exc)}", connector=connector.name) from None
        raise


def _markers(connector: Connector, intents: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for start in range(0, len(intents), _CHUNK):
        part = intents[start:start + _CHUNK]
        names = {f"i{i}": intent for i, intent in enumerate(part)}
        sql = (f"SELECT intent_id, case_id, operation_id, attempt, landed_at FROM {MARKER_TABLE}"
               " WHERE intent_id IN (" + ", ".join(":" + n for n in names) + ")")
        for row in _target_rows(connector, sql, names):
            out[str(row[0])] = {"case_id": str(row[1]), "operation_id": str(row[2]),
                                "attempt": int(row[3]), "landed_at": str(row[4])}
    return out


def fence_report(store: ClaimStore, connector: Connector) -> list[FenceRow]:
    """Every fence row of ``connector``'s target against this ledger's tokens, by key."""
    namespace = store.ledger_id()
    rows = _target_rows(connector, f"SELECT key_hash, impact_key, token, intent_id"
                                   f" FROM {FENCE_TABLE} ORDER BY impact_key")
    ours = {i for i, r in enumerate(rows) if str(r[0]) == key_hash(f"{namespace}\n{r[1]}")}
    tokens = store.tokens([str(rows[i][1]) for i in sorted(ours)])
    found: list[FenceRow] = []
    for i, r in enumerate(rows):
        key, token, intent = str(r[1]), int(r[2]), str(r[3])
        if i not in ours:
            found.append(FenceRow(key, token, intent, None, NOT_OURS))
            continue
        issued = tokens.get(key)
        state = LEDGER_BEHIND if token > (issued or 0) else OK
        found.append(FenceRow(key, token, intent, issued, state))
    behind = [f.fence_intent for f in found if f.state == LEDGER_BEHIND]
    if not behind:
        return found
    landed = _markers(connector, behind)
    return [dataclasses.replace(f, landed=landed.get(f.fence_intent))
            if f.state == LEDGER_BEHIND else f for f in found]


def realign(store: ClaimStore, ledger: Ledger, connector: Connector, *, by: str
            ) -> tuple[list[FenceRow], str | None]:
    """Raise the ledger's token of every key it is behind on to the target's.

    Returns the rows realigned and the case that records it (None: nothing was
    behind, nothing written).  The tokens and the record are one ledger
    transaction each; a token is only ever raised (:meth:`ClaimStore.raise_tokens`),
    so a concurrent claim that already passed it is left alone.
    """
    behind = [f for f in fence_report(store, connector) if f.state == LEDGER_BEHIND]
    if not behind:
        return [], None
    store.raise_tokens({f.impact_key: f.fence_token for f in behind})
    case = f"fences-{connector.name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
    ledger.append(case, "fences_realigned", {
        "connector": connector.name, "by": by,
        "keys": [f.to_dict() for f in behind],
        "note": "the ledger's tokens raised to the target's fences: the target holds "
                "writes under these tokens that the ledger may not record"})
    return behind, case
