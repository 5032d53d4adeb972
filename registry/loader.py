"""Load capability files into a Registry, or report every problem in them.

Validation runs in layers -- YAML syntax, JSON Schema, semantic checks, the
lock -- and keeps going after the first finding so a reviewer sees every
problem of a file at once.  Nothing is registered unless every file is clean:
an invalid set of files changes nothing.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capgate.registry.errors import (
    CapabilityFilesInvalid,
    CapabilityPathError,
    CapgateError,
    Problem,
    RegistryError,
)
from capgate.registry.lock import (
    LOCK_NAME,
    LockedRow,
    LockState,
    RowSite,
    lock_findings,
    lock_problems,
    read_lock_state,
    write_lock,
)
from capgate.registry.model import EffectClass, Row
from capgate.registry.registry import Registry

if TYPE_CHECKING:
    from capgate.registry.fastload.filecheck import CheckedFile

# The checking modules (YAML with positions, JSON Schema, the SQL checks and the
# workers) are imported where files are checked: a load whose files all come from
# the validation cache (registry.fastload.cache) checks none, and a CLI call should not pay
# for their import.

SUFFIXES = (".yaml", ".yml")
DEFAULT_PATH = "capabilities"


@dataclass
class Validation:
    """The outcome of validating a set of capability files."""

    files: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    """Findings that do not stop a row from loading (e.g. CG160 unbounded inputs)."""
    lock_path: Path | None = None
    lock: LockState | None = None
    """What the lock said when it was checked (None: not read)."""
    #: each loaded row's index in its file, to locate its ``version`` for a lock finding
    row_index: dict[tuple[str, int], int] = field(default_factory=dict)

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
    fifth of the time of loading 10,000 rows.

    On resuming, the first young-generation pass would still walk every object
    the load made (0.1 s for 10,000 rows), only to find them alive.  So the
    survivors are moved to the oldest generation directly (``gc.freeze`` then
    ``gc.unfreeze``: two list splices); cycles made meanwhile are collected by
    the next full collection.  Skipped when something else has frozen objects,
    whose freeze ``unfreeze`` would undo.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def validate_texts(items: Iterable[tuple[str, str]], *, workers: int | None = None) -> Validation:
    """Validate ``(source_name, yaml_text)`` pairs without touching the disk.

    ``workers`` is the number of processes to check files in; ``None`` decides
    from the machine and the amount of text (see ``registry.fastload.parallel``).
    """
    with _cyclic_gc_paused():
        return _validate_texts(list(items), workers)


def _validate_texts(items: list[tuple[str, str]], workers: int | None) -> Validation:
    from capgate.registry.fastload.parallel import check_files

    result = Validation(files=[source for source, _ in items])
    # Files finish in any order (see check_files); each file's rows are built as soon
    # as it is checked, and the cross-file rules then run in file order.
    checked: list[CheckedFile | None] = [None] * len(items)
    built: list[list[Row | None]] = [[] for _ in items]
    for index, found in check_files(items, workers):
        checked[index] = found
        source = items[index][0]
        built[index] = [
            None if raw is None else Row.from_dict(raw, row_hash=digest, source_path=source,
                                                   source_line=line, adopt=True)
            for _, (line, _), _, raw, digest in found.rows
        ]
    seen: set[tuple[str, int]] = set()
    for (source, _), file, rows in zip(items, checked, built, strict=True):
        assert file is not None  # check_files yields every index once
        result.problems.extend(file.problems)
        for (key, (line, col), index, _, _), row in zip(file.rows, rows, strict=True):
            if key in seen:  # duplicates span files, so they are found here
                result.problems.append(Problem(
                    source, line, col, "CG118", "operation_id",
                    f"duplicate row {key[0]}@{key[1]}",
                ))
                continue
            seen.add(key)
            if row is not None:  # None: the row has findings of its own
                result.rows.append(row)
                result.row_index[key] = index
    result.problems.sort(key=lambda p: (p.path, p.line, p.col, p.code))
    result.warnings = sorted([w for file in checked if file is not None for w in file.warnings]
                             + [w for row in result.rows for w in unbounded_inputs(row)]
                             + [w for row in result.rows for w in free_text_keys(row)],
                             key=lambda p: (p.path, p.line, p.col, p.code))
    return result


def unbounded_inputs(row: Row) -> list[Problem]:
    """CG160 warnings: a write row's string inputs (at any depth) without a declared bound.

    DDL rows are left out: their input is stored code, bounded by the DDL loop.
    """
    if not row.is_write or row.effect_class is EffectClass.DDL:
        return []
    out: list[Problem] = []
    stack: list[tuple[str, Any]] = [("input", row.input)]
    while stack:
        where, schema = stack.pop()
        if not isinstance(schema, Mapping):
            continue
        kinds = schema.get("type")
        is_string = kinds == "string" or (isinstance(kinds, list | tuple) and "string" in kinds)
        if is_string and not any(k in schema for k in ("maxLength", "enum", "const", "format")) \
                and not _bounded_pattern(schema.get("pattern")):
            out.append(Problem(row.source_path, row.source_line, 1, "CG160", where,
                               "string input without maxLength: bounded only by the "
                               "executor's max_request_bytes; declare maxLength"))
        for name, sub in (schema.get("properties") or {}).items():
            stack.append((f"{where}.properties.{name}", sub))
        if isinstance(schema.get("items"), Mapping):
            stack.append((f"{where}.items", schema["items"]))
    return sorted(out, key=lambda p: p.field)


def free_text_keys(row: Row) -> list[Problem]:
    """CG161 warnings: a write row's target key or dimension that is free text.

    A key input is free text when it may be a string and declares neither an
    ``enum``, a ``const`` nor a ``pattern``: nothing then says that one value has
    one spelling, while the database may compare spellings by collation.
    """
    if not row.is_write or row.effect_class is EffectClass.DDL:
        return []
    properties = (row.input or {}).get("properties") or {}
    names = list(row.target.keys) + [name for _, name in row.target.dimensions]
    out: list[Problem] = []
    for name in dict.fromkeys(names):
        schema = properties.get(name)
        if not isinstance(schema, Mapping):
            continue
        kinds = schema.get("type")
        may_be_text = kinds is None or kinds == "string" or (
            isinstance(kinds, list | tuple) and "string" in kinds)
        if may_be_text and not any(k in schema for k in ("enum", "const", "pattern")):
            out.append(Problem(
                row.source_path, row.source_line, 1, "CG161", f"input.properties.{name}",
                f"target key {name!r} is free text: capgate compares keys exactly, the "
                "database may by collation (MariaDB's ignore case and trailing spaces), "
                "so two spellings of one row would be two impact keys; declare an enum, "
                "a const or a pattern with one spelling per value"))
    return out


def _bounded_pattern(pattern: Any) -> bool:
    """An anchored pattern with no unbounded repetition (``*``, ``+``, ``{n,}``) bounds length."""
    if not isinstance(pattern, str) or not (pattern.startswith("^") and pattern.endswith("$")):
        return False
    return re.search(r"(?<!\\)[*+]|\{\d*,\}", pattern) is None


def validate_paths(paths: Sequence[str | Path], *, check_lock: bool = True,
                   workers: int | None = None) -> Validation:
    """Validate files on disk, including the lock rules when a lock file exists."""
    files, lock_path = discover(paths)
    with _cyclic_gc_paused():  # the lock's 10,000 pins too: a full pass here costs 0.4 s
        texts = [(str(f), f.read_text("utf-8")) for f in files]
        result = validate_texts(texts, workers=workers)
        result.lock_path = lock_path
        if check_lock and lock_path is not None and not result.problems:
            state = read_lock_state(lock_path)
            result.lock = state
            found = lock_problems(_sites(result), state.pins, lock_path, state.retired)
            if found:  # name the line of each `version:` rather than of the row
                at = _version_positions(result, dict(texts), {p.path for p in found})
                found = lock_problems(_sites(result, at), state.pins, lock_path,
                                      state.retired)
            result.problems.extend(found)
    return result


def _sites(result: Validation,
           version_at: dict[tuple[str, int], tuple[int, int]] | None = None) -> list[RowSite]:
    """Each loaded row for the lock rules, located at its ``version`` where known."""
    where = version_at or {}
    out = []
    for r in result.rows:
        line, col = where.get(r.key, (r.source_line, 1))
        out.append(RowSite(r.operation_id, r.version, r.row_hash, r.source_path, line, col,
                           r.retired))
    return out


def _version_positions(result: Validation, texts: dict[str, str],
                       sources: set[str]) -> dict[tuple[str, int], tuple[int, int]]:
    """Where ``version`` is written in each row of ``sources`` (loaded again, located).

    A clean load keeps only where rows start; the lock's findings are rare
    enough to pay for a second, fully located parse of the files they name.
    """
    from capgate.registry.fastload.yamlpos import load_located

    located = {}
    for source in sources & texts.keys():
        found, _ = load_located(texts[source], source)
        if found is not None:
            located[source] = found
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for row in result.rows:
        file = located.get(row.source_path)
        index = result.row_index.get(row.key)
        if file is not None and index is not None:
            out[row.key] = file.where(("rows", index, "version"))
    return out


def load_registry(paths: Sequence[str | Path] = (DEFAULT_PATH,), *,
                  check_lock: bool = True, workers: int | None = None,
                  cache: bool = False) -> Registry:
    """Validate and load; raise ``RegistryError`` listing every problem.

    ``workers``: processes to check the files in (``None``: decided by
    ``registry.fastload.parallel.worker_count``; 1: all in the calling thread).
    ``cache``: skip the per-file checks of files that passed them before, as
    recorded by content in ``registry.fastload.cache`` (the command line's calls use
    it); the rows are then built when first used.  Any finding is reported
    exactly as without the cache.
    """
    if cache:
        from capgate.registry.fastload.cache import cache_dir

        directory = cache_dir()
        if directory is not None:
            cached = _load_cached(paths, check_lock=check_lock, workers=workers,
                                  directory=directory)
            if cached is not None:
                return cached
    with _cyclic_gc_paused():
        result = validate_paths(paths, check_lock=check_lock, workers=workers)
        result.raise_for_problems()
        return Registry(result.rows, lock=_lock_of(result))


def _lock_of(result: Validation) -> LockState:
    """The lock beside the files as the registry carries it (read if not checked)."""
    if result.lock is not None:
        return result.lock
    try:
        return read_lock_state(result.lock_path)
    except RegistryError:  # unchecked and unreadable: it pins nothing
        return LockState(result.lock_path)


def _load_cached(paths: Sequence[str | Path], *, check_lock: bool, workers: int | None,
                 directory: Path) -> Registry | None:
    """The registry through the validation cache, or None to take the uncached path.

    None when the cache folder cannot be written, or when anything is wrong
    with the files (a finding, a duplicate, the lock): the uncached path then
    reports every problem with its exact position.
    """
    from capgate.registry.fastload.cache import (
        IndexedRow,
        LazyRegistry,
        duplicate_problems,
        entry_key,
        read_entry,
        write_entry,
    )

    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None
    if not os.access(directory, os.W_OK):
        return None
    files, lock_path = discover(paths)
    with _cyclic_gc_paused():
        texts = [(str(f), f.read_text("utf-8")) for f in files]
        keys = [entry_key(text) for _, text in texts]
        per_file: list[list[IndexedRow] | None] = [
            read_entry(directory, key, source) for key, (source, _) in zip(keys, texts,
                                                                            strict=True)]
        missing = [i for i, found in enumerate(per_file) if found is None]
        if missing:
            from capgate.registry.fastload.parallel import check_files

            items = [texts[i] for i in missing]
            for position, checked in check_files(items, workers):
                if checked.problems or any(raw is None for *_, raw, _ in checked.rows):
                    return None
                at = missing[position]
                rows = [(k, where, i, raw, digest) for k, where, i, raw, digest in checked.rows
                        if raw is not None]
                if not write_entry(directory, keys[at], rows):
                    return None
                per_file[at] = read_entry(directory, keys[at], texts[at][0])
                if per_file[at] is None:
                    return None
        index = [row for found in per_file if found is not None for row in found]
        if duplicate_problems(index):
            return None
        try:
            state = read_lock_state(lock_path)
        except RegistryError:
            if check_lock:
                return None
            state = LockState(lock_path)
        if check_lock and lock_path is not None:
            sites = [RowSite(r.operation_id, r.version, r.row_hash, r.source, r.line, r.col,
                             r.retired) for r in index]
            if lock_problems(sites, state.pins, lock_path, state.retired):
                return None
        registry = LazyRegistry(index)
        registry.lock = state
        return registry


def update_lock(paths: Sequence[str | Path]) -> tuple[Path, list[LockedRow], list[LockedRow]]:
    """Pin every row; refuse when a pinned row changed.  Returns (path, added, all)."""
    result = validate_paths(paths, check_lock=True)
    result.raise_for_problems()
    assert result.lock_path is not None

    locked = read_lock_state(result.lock_path)
    pins = [LockedRow(r.operation_id, r.version, r.row_hash) for r in result.rows]
    added = [p for p in pins if (p.operation_id, p.version) not in locked.pins]
    # a retirement is recorded, and stays recorded: validation above refuses a row the
    # lock lists as retired that is no longer retired in its file
    retired = locked.retired | {r.key for r in result.rows if r.retired}
    write_lock(result.lock_path, pins, retired)
    return result.lock_path, added, pins


def reload_registry(paths: Sequence[str | Path], previous: Registry | None = None, *,
                    cache: bool = True) -> Registry:
    """The registry as the files are now, failing closed per operation: a long-lived
    process's reload.

    A clean set of files loads as :func:`load_registry` loads it.  When some
    files fail validation the answer is still a registry: the rows of the
    files that validate, with every operation that has a row in a failing
    file -- as the file is now, or as ``previous`` knew it -- in ``down``,
    refused with the file, line and column of that file's first problem
    (``CG138``).  A lock finding takes down its operation the same way.  When
    nothing can be trusted (the lock cannot be read, a configured path is
    gone) every resolution raises ``failure``.  The previous rows are never
    kept: what the files say now is what runs.
    """
    try:
        return load_registry(paths, cache=cache)
    except RegistryError as exc:
        if not exc.problems:  # no located finding: a path or the lock itself
            return _failed(exc)
    try:
        result = validate_paths(paths, check_lock=False)
        lock_path = result.lock_path
        state = read_lock_state(lock_path)
    except RegistryError as exc:
        return _failed(exc)
    first: dict[str, Problem] = {}
    for problem in result.problems:  # sorted by path and position: the first of each file
        first.setdefault(problem.path, problem)
    down: dict[str, Problem] = {}
    before = list(previous.rows()) if previous is not None else []
    for row in (*before, *result.rows):
        if row.source_path in first:
            down.setdefault(row.operation_id, first[row.source_path])
    if previous is not None:  # still down: an operation whose failing file still fails
        for op, refused in previous.down.items():
            where = refused.details.get("path")
            if isinstance(where, str) and where in first:
                down.setdefault(op, first[where])
    clean = [r for r in result.rows if r.operation_id not in down]
    if lock_path is not None:
        sites = {r.key: RowSite(r.operation_id, r.version, r.row_hash, r.source_path,
                                r.source_line, 1, r.retired) for r in clean}
        pins = {k: v for k, v in state.pins.items() if k[0] not in down}
        for (op, _), problem in lock_findings(sites.values(), pins, lock_path, state.retired):
            down.setdefault(op, problem)
    rows = [r for r in clean if r.operation_id not in down]
    refusals: dict[str, CapgateError] = {op: _down(op, problem) for op, problem in down.items()}
    registry = Registry(rows, lock=state, down=refusals)
    registry.problems = tuple(result.problems) + tuple(
        p for op, p in down.items() if p not in result.problems)
    return registry


def _failed(exc: RegistryError) -> Registry:
    """A registry that refuses everything with ``exc`` (a path gone, the lock unreadable)."""
    failure = _whole_failure(exc)
    registry = Registry((), failure=failure, lock=LockState())
    path = failure.details.get("path")
    registry.problems = (Problem(str(path or "(capabilities)"), 1, 1, exc.code, "(file)",
                                 exc.message),)
    return registry


def _down(operation_id: str, problem: Problem) -> CapabilityFilesInvalid:
    return CapabilityFilesInvalid(
        f"{operation_id} is refused until its capability file validates again: "
        f"{problem.render()}; nothing was executed",
        operation_id=operation_id, path=problem.path, line=problem.line, col=problem.col,
        problem=problem.to_dict())


def _whole_failure(exc: RegistryError) -> CapabilityFilesInvalid:
    path = exc.details.get("path")
    where = f"{path}:1: " if isinstance(path, str) and path not in exc.message else ""
    return CapabilityFilesInvalid(
        f"every operation is refused until the capability files load again: {where}"
        f"{exc.code}: {exc.message}; nothing was executed",
        path=path if isinstance(path, str) else None, line=1 if path else None,
        cause=exc.code)
