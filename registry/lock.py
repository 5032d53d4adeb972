"""``capabilities.lock``: the canonical hash of every published row, and the retired ones.

A published row is immutable.  The lock pins the RFC 8785 SHA-256 of each
``(operation_id, version)``; a changed row without a new version, a new version
lower than a published one, or a published row that disappeared are errors.

Retiring is one step: ``retired`` is left out of the row hash, so a row is
retired by adding ``retired: true`` with no version bump, and the retirement
takes effect at once.  ``capgate lock`` then records it in the lock's
``retired`` list, which pins it: a row the lock lists as retired that is no
longer retired in its file is an error (``CG137``), so deleting the line cannot
bring a withdrawn row back unreviewed.  The list is optional (a lock written
before it existed reads as "nothing retired yet")::

    {"format": 1, "rows": {"policy.cancel@1": "sha256:...", ...},
     "retired": ["policy.cancel@1"]}

What the lock says at run time is :class:`LockState`: whether a lock exists
and which rows it pins.  Outside the unlocked environments a call runs only a
pinned row (``executor.runtime.Runtime.check_pinned``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import LockFileInvalid, Problem

if TYPE_CHECKING:
    from capgate.registry.model import Row

LOCK_NAME = "capabilities.lock"
LOCK_FORMAT = 1


def row_hash(row: Mapping[str, Any], *, known_plain: bool = False) -> str:
    """Canonical hash of a row's reviewed content (everything but ``retired``).

    ``known_plain``: see ``canonical.canonical_bytes``.
    """
    return canonical_hash({k: v for k, v in row.items() if k != "retired"},
                          known_plain=known_plain)


class LockedRow(NamedTuple):
    """One pin.  A named tuple: a lock holds one per published row, read on every load."""

    operation_id: str
    version: int
    hash: str

    @property
    def ref(self) -> str:
        return f"{self.operation_id}@{self.version}"


@dataclass(frozen=True)
class LockState:
    """What ``capabilities.lock`` says, as a registry carries it: does a lock exist, what
    does it pin, which rows has it recorded as retired."""

    path: Path | None = None
    """Where the lock is (or would be): beside the capability files."""
    present: bool = False
    """Whether a lock file exists there.  Without one, no row is pinned."""
    pins: Mapping[tuple[str, int], LockedRow] = field(default_factory=dict)
    retired: frozenset[tuple[str, int]] = frozenset()
    """Rows whose retirement the lock records: they may not come back unreviewed."""

    def pinned(self, row: Row) -> bool:
        """Whether the lock pins ``row`` exactly as it is (same key, same hash)."""
        pin = self.pins.get(row.key)
        return pin is not None and pin.hash == row.row_hash

    @classmethod
    def of_rows(cls, rows: Iterable[Row], path: Path | None = None) -> LockState:
        """A lock pinning ``rows`` as they are (and their retirements): what ``capgate
        lock`` would write for them, held in memory."""
        rows = list(rows)
        return cls(path, True,
                   {r.key: LockedRow(r.operation_id, r.version, r.row_hash) for r in rows},
                   frozenset(r.key for r in rows if r.retired))


def read_lock_state(path: Path | None) -> LockState:
    """The lock at ``path`` (a state with ``present=False`` when there is no file).

    Raises ``LockFileInvalid`` when the file exists and cannot be read.
    """
    if path is None or not path.exists():
        return LockState(path)
    try:
        doc = json.loads(path.read_text("utf-8"))
        if doc.get("format") != LOCK_FORMAT:
            raise ValueError(f"unsupported lock format {doc.get('format')!r}")
        out: dict[tuple[str, int], LockedRow] = {}
        for ref, digest in doc["rows"].items():
            op, _, ver = ref.rpartition("@")
            out[(op, int(ver))] = LockedRow(op, int(ver), str(digest))
        retired: set[tuple[str, int]] = set()
        listed = doc.get("retired", [])
        if not isinstance(listed, list):
            raise ValueError("`retired` must be a list of OPERATION@VERSION")
        for ref in listed:
            op, sep, ver = str(ref).rpartition("@")
            if not sep or (op, int(ver)) not in out:
                raise ValueError(f"`retired` names {ref!r}, which the lock does not pin")
            retired.add((op, int(ver)))
        return LockState(path, True, out, frozenset(retired))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LockFileInvalid(f"{path}: cannot read the lock file: {exc}", path=str(path)) from exc
    except OSError as exc:
        raise LockFileInvalid(f"{path}: cannot read the lock file: {exc.strerror}",
                              path=str(path)) from exc


def read_lock(path: Path) -> dict[tuple[str, int], LockedRow]:
    """The pinned rows, or an empty pin set when there is no lock file yet."""
    return dict(read_lock_state(path).pins)


def write_lock(path: Path, rows: Iterable[LockedRow],
               retired: Iterable[tuple[str, int]] = ()) -> None:
    ordered = sorted(rows, key=lambda r: (r.operation_id, r.version))
    doc: dict[str, Any] = {"format": LOCK_FORMAT, "rows": {r.ref: r.hash for r in ordered}}
    gone = sorted(set(retired))
    if gone:
        doc["retired"] = [f"{op}@{version}" for op, version in gone]
    # written aside and renamed: a running server re-reading the lock sees the old file or
    # the new one, never half of one (which would fail closed until the next look)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", "utf-8")
    os.replace(tmp, path)


class RowSite(NamedTuple):
    """Where a row came from, for error positions (a named tuple, one per loaded row)."""

    operation_id: str
    version: int
    hash: str
    source: str
    line: int
    col: int
    retired: bool = False


def lock_problems(
    current: Iterable[RowSite], locked: Mapping[tuple[str, int], LockedRow], lock_path: Path,
    retired: frozenset[tuple[str, int]] = frozenset(),
) -> list[Problem]:
    """Findings of the lock rules for the rows as they are now."""
    return [p for _, p in lock_findings(current, locked, lock_path, retired)]


def lock_findings(
    current: Iterable[RowSite], locked: Mapping[tuple[str, int], LockedRow], lock_path: Path,
    retired: frozenset[tuple[str, int]] = frozenset(),
) -> list[tuple[tuple[str, int], Problem]]:
    """Each finding of the lock rules with the row it concerns (for a partial reload)."""
    problems: list[tuple[tuple[str, int], Problem]] = []
    seen: set[tuple[str, int]] = set()
    highest: dict[str, int] = {}
    for locked_row in locked.values():
        op = locked_row.operation_id
        highest[op] = max(highest.get(op, 0), locked_row.version)
    for site in current:
        key = (site.operation_id, site.version)
        seen.add(key)
        pin = locked.get(key)
        if pin is not None:
            if pin.hash != site.hash:
                problems.append((key, Problem(
                    site.source, site.line, site.col, "CG130", "version",
                    f"{pin.ref} changed without a new version: locked {pin.hash}, now {site.hash}; "
                    f"publish the change as version {highest[site.operation_id] + 1}",
                )))
            if key in retired and not site.retired:
                problems.append((key, Problem(
                    site.source, site.line, site.col, "CG137", "retired",
                    f"{pin.ref} is retired in the lock ({lock_path.name}) but not in its file: "
                    "un-retiring needs a reviewed change -- publish version "
                    f"{highest[site.operation_id] + 1}, or remove {pin.ref} from the lock's "
                    "`retired` list in a reviewed change",
                )))
            continue
        top = highest.get(site.operation_id)
        if top is not None and site.version <= top:
            problems.append((key, Problem(
                site.source, site.line, site.col, "CG131", "version",
                f"new version {site.version} of {site.operation_id} is not greater than "
                f"the published version {top}",
            )))
    for key, gone in sorted(locked.items()):
        if key not in seen:
            problems.append((key, Problem(
                str(lock_path), 1, 1, "CG133", gone.ref,
                f"{gone.ref} is pinned in the lock but no longer in the files; "
                "retire it with `retired: true` instead of deleting it",
            )))
    return problems
