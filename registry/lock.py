"""``capabilities.lock``: the canonical hash of every published row.

A published row is immutable.  The lock pins the RFC 8785 SHA-256 of each
``(operation_id, version)``; a changed row without a new version, a new version
lower than a published one, or a published row that disappeared are errors.
Retiring is not a change: ``retired`` is left out of the row hash so a row can
be retired without a version bump.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import LockFileInvalid, Problem

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


def read_lock(path: Path) -> dict[tuple[str, int], LockedRow]:
    """The pinned rows, or an empty pin set when there is no lock file yet."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text("utf-8"))
        if doc.get("format") != LOCK_FORMAT:
            raise ValueError(f"unsupported lock format {doc.get('format')!r}")
        out: dict[tuple[str, int], LockedRow] = {}
        for ref, digest in doc["rows"].items():
            op, _, ver = ref.rpartition("@")
            out[(op, int(ver))] = LockedRow(op, int(ver), str(digest))
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LockFileInvalid(f"{path}: cannot read the lock file: {exc}", path=str(path)) from exc


def write_lock(path: Path, rows: Iterable[LockedRow]) -> None:
    ordered = sorted(rows, key=lambda r: (r.operation_id, r.version))
    doc = {"format": LOCK_FORMAT, "rows": {r.ref: r.hash for r in ordered}}
    path.write_text(json.dumps(doc, indent=2) + "\n", "utf-8")


class RowSite(NamedTuple):
    """Where a row came from, for error positions (a named tuple, one per loaded row)."""

    operation_id: str
    version: int
    hash: str
    source: str
    line: int
    col: int


def lock_problems(
    current: Iterable[RowSite], locked: Mapping[tuple[str, int], LockedRow], lock_path: Path
) -> list[Problem]:
    """Findings of the lock rules for the rows as they are now."""
    problems: list[Problem] = []
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
                problems.append(Problem(
                    site.source, site.line, site.col, "CG130", "version",
                    f"{pin.ref} changed without a new version: locked {pin.hash}, now {site.hash}; "
                    f"publish the change as version {highest[site.operation_id] + 1}",
                ))
            continue
        top = highest.get(site.operation_id)
        if top is not None and site.version <= top:
            problems.append(Problem(
                site.source, site.line, site.col, "CG131", "version",
                f"new version {site.version} of {site.operation_id} is not greater than "
                f"the published version {top}",
            ))
    for key, gone in sorted(locked.items()):
        if key not in seen:
            problems.append(Problem(
                str(lock_path), 1, 1, "CG133", gone.ref,
                f"{gone.ref} is pinned in the lock but no longer in the files; "
                "retire it with `retired: true` instead of deleting it",
            ))
    return problems
