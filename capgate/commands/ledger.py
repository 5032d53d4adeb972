"""The ledger's own commands: verify, anchor, migrate, rekey, a case's record, stats,
cases, gaps.

They read (or migrate) the configured ledger and touch no target database, so
they take the settings and open only the ledger.  The work is
``executor.ledger``'s; a case's record comes back as the data
:mod:`capgate.caseview` renders.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from capgate.config import Settings
from capgate.executor.ledger import open_ledger

if TYPE_CHECKING:
    from capgate.caseview import CaseRow, Entry
    from capgate.executor.ledger import Anchor, Event, VerifyReport
    from capgate.executor.ledger.migrate import MigrationReport
    from capgate.executor.ledger.stats import LedgerStats
    from capgate.executor.ledger.store import RekeyReport


def read_anchor(path: str) -> Anchor:
    """An anchor exported by :func:`anchor`; ``AnchorMismatch`` when the file is not one."""
    from capgate.executor.ledger import Anchor
    from capgate.registry.errors import AnchorMismatch

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise AnchorMismatch(f"cannot read the anchor file {path}: {exc.strerror}",
                             where=path) from None
    except ValueError as exc:
        raise AnchorMismatch(f"the anchor file {path} is not JSON ({exc})", where=path) from None
    if not isinstance(data, dict):
        raise AnchorMismatch(f"the anchor file {path} is not a JSON object", where=path)
    return Anchor.from_dict(data, where=path)


def verify(settings: Settings, case: str | None = None, *, anchor: str | None = None
           ) -> VerifyReport:
    """Replay every chain (or ``case``'s) against its snapshot, MAC and, given one, an anchor.

    ``anchor``: a file exported by :func:`anchor`; a case deleted, or rolled back to an
    older copy, since then is a finding.  Findings are reported, never raised.
    """
    exported = read_anchor(anchor) if anchor else None
    with open_ledger(settings.ledger_url) as ledger:
        return ledger.verify(case, anchor=exported)


@dataclass(frozen=True)
class Anchored:
    """``anchor``'s answer: the anchor recorded, whether it is MAC'd, where it was written."""

    anchor: Anchor
    signed: bool
    file: str | None


def anchor(settings: Settings, out: str | None = None) -> Anchored:
    """Record the ledger-wide head (every case head, chained, MAC'd) and export it to ``out``."""
    with open_ledger(settings.ledger_url) as ledger:
        recorded = ledger.anchor()
        signed = ledger.signed
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(recorded.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")
    return Anchored(recorded, signed, out)


def rekey(settings: Settings, previous_env: str | None = None,
          env: Mapping[str, str] | None = None) -> RekeyReport:
    """Sign every case head and anchor with ``CAPGATE_LEDGER_HMAC_KEY`` (each case verified
    first under the previous key, read from the variable ``previous_env``; none: the ledger
    was written without a key)."""
    from capgate.registry.errors import ConfigError

    env = os.environ if env is None else env
    previous: bytes | None = None
    if previous_env is not None:
        raw = env.get(previous_env, "")
        if not raw:
            raise ConfigError(f"--previous-key-env {previous_env}: that variable is not set or "
                              "empty; it must hold the ledger's previous HMAC key",
                              variable=previous_env)
        previous = raw.encode("utf-8")
    with open_ledger(settings.ledger_url) as ledger:
        return ledger.rekey(previous)


def migrate(settings: Settings) -> MigrationReport:
    """Upgrade the ledger's tables to this capgate's format (each old case verified first)."""
    with open_ledger(settings.ledger_url, migrating=True) as ledger:
        return ledger.migrate()


@dataclass(frozen=True)
class CaseRecord:
    """One case as the ledger holds it, and its timeline."""

    case: str
    events: list[Event]
    snapshot: dict[str, Any] | None
    intents: dict[str, dict[str, Any]]
    """Every intent, settled ones too (from the events)."""
    timeline: list[Entry]
    verified: bool | None
    """Whether the case's chain verified; None when not asked."""
    pending_plans: list[dict[str, Any]] = field(default_factory=list)
    """The case's recorded plans that need an approval no call has used yet, as
    ``capgate plan show`` gives them."""


def case_record(settings: Settings, case: str, *, verify: bool = False) -> CaseRecord:
    """Every event of ``case`` in chain order, its snapshot, intents and timeline.

    ``UnknownCase`` when the ledger has no such case.
    """
    from capgate import caseview
    from capgate.commands.calls import describe_plan
    from capgate.executor.plan import needs_approval

    with open_ledger(settings.ledger_url) as ledger:
        events = ledger.events(case)
        snapshot = ledger.snapshot(case)
        intents = ledger.intents(case)
        verified = ledger.verify(case).ok if verify and events else None
        pending = [describe_plan(ledger, r) for r in ledger.recorded_plans(case_id=case)
                   if needs_approval(r.plan)]
    if not events and not pending:  # a gated call refused first: its plan waits, no event
        from capgate.registry.errors import UnknownCase

        raise UnknownCase(f"no case {case!r} in the ledger (`capgate cases` lists them)",
                          case=case)
    return CaseRecord(case, events, snapshot, intents, caseview.timeline(events), verified,
                      pending)


def stats(settings: Settings, cases: Sequence[str] | None = None) -> LedgerStats:
    """Recovery accounting from the verified chain of each case (every case when None)."""
    from capgate.executor.ledger.stats import ledger_stats

    with open_ledger(settings.ledger_url) as ledger:
        return ledger_stats(ledger, None if cases is None else list(cases))


def cases(settings: Settings, *, open_only: bool = False) -> list[CaseRow]:
    """Every case (or those with unresolved intents) with its state and last outcome."""
    from capgate import caseview

    with open_ledger(settings.ledger_url) as ledger:
        return caseview.case_rows(ledger, open_only=open_only)


def gaps(settings: Settings) -> list[dict[str, Any]]:
    """Every recorded request for an operation no row declares, oldest first."""
    from capgate.executor.gaps import list_gaps

    with open_ledger(settings.ledger_url) as ledger:
        return list_gaps(ledger)
