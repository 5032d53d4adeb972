"""Load capability files into a Registry, or report every problem in them.

Validation runs in layers -- YAML syntax, JSON Schema, semantic checks, the
lock -- and keeps going after the first finding so a reviewer sees every
problem of a file at once.  Nothing is registered unless every file is clean:
an invalid set of files changes nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from registry.checks import RowContext, check_row
from registry.errors import CapabilityPathError, Problem, RegistryError
from registry.lock import (
    LOCK_NAME,
    LockedRow,
    RowSite,
    lock_problems,
    read_lock,
    row_hash,
    write_lock,
)
from registry.model import Row
from registry.registry import Registry
from registry.schema import schema_problems
from registry.yamlpos import Located, load_located

SUFFIXES = (".yaml", ".yml")
DEFAULT_PATH = "capabilities"


@dataclass
class Validation:
    """The outcome of validating a set of capability files."""

    files: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    lock_path: Path | None = None
    #: where each loaded row's ``version`` is written, for the lock rules' findings
    version_at: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        if self.problems:
            count = len(self.problems)
            first = self.problems[0].render()
            more = f" (and {count - 1} more)" if count > 1 else ""
            raise RegistryError(f"invalid capability files: {first}{more}", problems=self.problems)


def discover(paths: Sequence[str | Path]) -> tuple[list[Path], Path | None]:
    """Capability files under ``paths`` and the lock file that governs them.

    The lock lives beside the files: in the first directory given, or in the
    directory of the first file.
    """
    files: list[Path] = []
    lock: Path | None = None
    for raw in paths or [DEFAULT_PATH]:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
            files.extend(found)
            lock = lock or p / LOCK_NAME
        elif p.is_file():
            files.append(p)
            lock = lock or p.parent / LOCK_NAME
        else:
            raise CapabilityPathError(f"{p}: no such file or directory", path=str(p))
    if not files:
        raise CapabilityPathError(
            f"no capability files (*.yaml) under {', '.join(map(str, paths))}",
            paths=[str(p) for p in paths],
        )
    return files, lock


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a registry is built.

    Loading allocates millions of small, acyclic objects (refcounting frees
    what is dropped); the collector's full passes over the growing heap took a
    fifth of the time of loading 10,000 rows.  Cycles made meanwhile are
    collected once it resumes.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def validate_texts(items: Iterable[tuple[str, str]]) -> Validation:
    """Validate ``(source_name, yaml_text)`` pairs without touching the disk."""
    with _cyclic_gc_paused():
        return _validate_texts(items)


def _validate_texts(items: Iterable[tuple[str, str]]) -> Validation:
    result = Validation()
    sites: dict[tuple[str, int], Problem | None] = {}
    for source, text in items:
        result.files.append(source)
        located, problems = load_located(text, source)
        result.problems.extend(problems)
        if located is None or problems:
            continue
        file_problems = schema_problems(located, source)
        result.problems.extend(file_problems)
        doc = located.data if isinstance(located.data, dict) else {}
        raw_rows = doc.get("rows")
        connectors = doc.get("connectors")
        declared = set(connectors) if isinstance(connectors, dict) else set()
        bad_rows = _row_indexes_with(file_problems, located)
        if not isinstance(raw_rows, list):
            continue
        for index, raw in enumerate(raw_rows):
            if index in bad_rows or not isinstance(raw, dict):
                continue
            ctx = RowContext(raw, index, located, source)
            row_findings = check_row(ctx, declared)
            result.problems.extend(row_findings)
            line, col = located.where(("rows", index))
            key = (raw["operation_id"], raw["version"])
            if key in sites:
                result.problems.append(Problem(
                    source, line, col, "CG118", "operation_id",
                    f"duplicate row {key[0]}@{key[1]}",
                ))
                continue
            sites[key] = None
            if row_findings:
                continue
            result.rows.append(Row.from_dict(raw, row_hash=row_hash(raw), source_path=source,
                                             source_line=line))
            result.version_at[key] = located.where(("rows", index, "version"))
    result.problems.sort(key=lambda p: (p.path, p.line, p.col, p.code))
    return result


def _row_indexes_with(problems: list[Problem], located: Located) -> set[int]:
    """Indexes of rows that have schema problems (their semantics are not checked)."""
    out: set[int] = set()
    if not problems:
        return out
    starts = sorted(
        (pos, path[1])
        for path, pos in located.values.items()
        if len(path) == 2 and path[0] == "rows" and isinstance(path[1], int)
    )
    for problem in problems:
        owner = None
        for pos, index in starts:
            if (problem.line, problem.col) >= pos:
                owner = index
        if owner is not None:
            out.add(int(owner))
    return out


def validate_paths(paths: Sequence[str | Path], *, check_lock: bool = True) -> Validation:
    """Validate files on disk, including the lock rules when a lock file exists."""
    files, lock_path = discover(paths)
    result = validate_texts((str(f), f.read_text("utf-8")) for f in files)
    result.lock_path = lock_path
    if check_lock and lock_path is not None and not result.problems:
        locked = read_lock(lock_path)
        result.problems.extend(lock_problems(_sites(result), locked, lock_path))
    return result


def _sites(result: Validation) -> list[RowSite]:
    out = []
    for r in result.rows:
        line, col = result.version_at.get(r.key, (r.source_line, 1))
        out.append(RowSite(r.operation_id, r.version, r.row_hash, r.source_path, line, col))
    return out


def load_registry(paths: Sequence[str | Path] = (DEFAULT_PATH,), *,
                  check_lock: bool = True) -> Registry:
    """Validate and load; raise ``RegistryError`` listing every problem."""
    result = validate_paths(paths, check_lock=check_lock)
    result.raise_for_problems()
    return Registry(result.rows)


def update_lock(paths: Sequence[str | Path]) -> tuple[Path, list[LockedRow], list[LockedRow]]:
    """Pin every row; refuse when a pinned row changed.  Returns (path, added, all)."""
    result = validate_paths(paths, check_lock=True)
    result.raise_for_problems()
    assert result.lock_path is not None

    locked = read_lock(result.lock_path)
    pins = [LockedRow(r.operation_id, r.version, r.row_hash) for r in result.rows]
    added = [p for p in pins if (p.operation_id, p.version) not in locked]
    write_lock(result.lock_path, pins)
    return result.lock_path, added, pins
