"""The files a long-lived executor runs from, re-read when they change.

An MCP server or a Python caller's executor lives for days; the grants file,
the capability files and ``capabilities.lock`` change under it (a grant
withdrawn, an approver removed, a row retired, the lock restored).  What the
files say now is what runs, so before every call the executor asks
:class:`LiveSources` whether any of them changed -- a ``stat`` per file and
folder, a few microseconds -- and, when one did, re-reads it and swaps the new
state in under a lock (a call that finds a change waits for the swap; none
runs on the state the change replaced).

A changed file that fails validation fails closed for what depends on it:

* the grants file -- everything depends on it: every call, plan and approval
  is refused with ``GrantsFileInvalid`` (``CG209``) naming the file and line;
* a capability file -- the operations with a row in it are refused with
  ``CapabilityFilesInvalid`` (``CG138``) naming the file, line and column,
  while every other operation runs from the files as they are now
  (:func:`registry.loader.reload_registry`);
* the lock -- when it cannot be read at all, every operation is refused.

The process keeps running and picks up the fix on the next call.  No stale,
more permissive state is ever kept: the previous grants and rows are dropped
the moment their file is seen to change.

Noticing a change by ``stat``: each file's device, inode, size, mtime and
ctime.  A write within the filesystem's timestamp granularity of the last
read could leave them all unchanged (git's "racy" entries), so a file whose
ctime is within :data:`RACY_SECONDS` of the last confirmation is compared by
content (a SHA-256) until it is older than that.  A folder is watched the same
way for files added, removed or renamed (its listing is its content).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from capgate.executor.grants import Grants, load_failing_closed
from capgate.registry.lock import LOCK_NAME

if TYPE_CHECKING:
    from capgate.registry.registry import Registry

__all__ = ["RACY_SECONDS", "FileWatch", "LiveSources"]

RACY_SECONDS = 2.0
"""How close to the last confirmation a ctime must be for the content to be compared too.
Two seconds covers the coarsest common timestamps (FAT's) and the kernel's coarse clock."""
_SUFFIXES = (".yaml", ".yml")

Stamp = tuple[int, int, int, int, int]
"""(device, inode, size, mtime_ns, ctime_ns); all -1 for a path that does not exist."""
_MISSING: Stamp = (-1, -1, -1, -1, -1)


def _stamp(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return _MISSING
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _content(path: Path, is_dir: bool, wanted: Callable[[Path], bool]) -> str:
    """What a racy entry is compared by: a file's bytes, a folder's listing (its folders
    and the files that matter: an editor's swap file coming and going is no change)."""
    h = hashlib.sha256()
    try:
        if is_dir:
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                if entry.is_dir() or wanted(Path(entry.path)):
                    h.update(entry.name.encode("utf-8", "surrogateescape") + b"\0")
        else:
            h.update(path.read_bytes())
    except OSError as exc:
        h.update(f"\0unreadable {exc.errno}".encode())
    return h.hexdigest()


@dataclass
class _Seen:
    """The entries of one look: each path's stamp, and the content of the racy ones."""

    stamps: dict[Path, Stamp] = field(default_factory=dict)
    dirs: frozenset[Path] = frozenset()
    contents: dict[Path, str] = field(default_factory=dict)
    confirmed_ns: int = 0
    """Wall-clock time (ns) taken before the look: entries whose ctime is not older than
    this minus RACY_SECONDS are compared by content too."""

    def racy(self) -> list[Path]:
        edge = self.confirmed_ns - int(RACY_SECONDS * 1e9)
        return [p for p, s in self.stamps.items() if s != _MISSING and s[4] >= edge]


class FileWatch:
    """A set of files (and the folders that hold them), and whether any changed since the
    last :meth:`take`.

    ``roots``: files and folders; a folder is searched recursively for the files
    ``wanted`` accepts (by name).  ``extra``: files watched whether or not they
    exist (a lock that may appear).
    """

    def __init__(self, roots: Sequence[str | Path], wanted: Callable[[Path], bool],
                 extra: Iterable[Path] = ()):
        self.roots = [Path(r) for r in roots]
        self.wanted = wanted
        self.extra = list(extra)
        self._seen: _Seen | None = None

    def _discover(self) -> tuple[list[Path], list[Path]]:
        files: list[Path] = list(self.extra)
        dirs: list[Path] = []
        for root in self.roots:
            if root.is_dir():
                dirs.append(root)
                for here, subdirs, names in os.walk(root):
                    subdirs.sort()
                    dirs.extend(Path(here) / d for d in subdirs)
                    files.extend(Path(here) / n for n in sorted(names)
                                 if self.wanted(Path(here) / n))
            else:
                files.append(root)  # a file, or a path that does not exist (yet)
        return list(dict.fromkeys(files)), dirs

    def take(self) -> _Seen:
        """Look now (before the files are read): what :meth:`changed` compares against."""
        confirmed = time.time_ns()
        files, dirs = self._discover()
        seen = _Seen({p: _stamp(p) for p in (*dirs, *files)}, frozenset(dirs),
                     confirmed_ns=confirmed)
        for p in seen.racy():
            seen.contents[p] = _content(p, p in seen.dirs, self.wanted)
        return seen

    def commit(self, seen: _Seen) -> None:
        """The files were read after ``seen`` was taken: it is the state to compare with."""
        self._seen = seen

    def changed(self) -> bool:
        """Whether anything watched differs from the last committed look (True before any)."""
        seen = self._seen
        if seen is None:
            return True
        moved = [path for path, stamp in seen.stamps.items() if _stamp(path) != stamp]
        if moved:
            if any(path not in seen.dirs for path in moved):
                return True  # a watched file changed (or went)
            # only folders changed: something was added, removed or renamed in them --
            # perhaps only a file that does not matter (an editor's swap file, a temp file)
            files, dirs = self._discover()
            if set(dirs) != seen.dirs or set(files) != set(seen.stamps) - seen.dirs:
                return True
            stamps = {**seen.stamps, **{d: _stamp(d) for d in moved}}
            seen = self._seen = _Seen(stamps, seen.dirs, dict(seen.contents),
                                      seen.confirmed_ns)
            for d in moved:  # a new folder stamp may be racy: know its listing
                seen.contents[d] = _content(d, True, self.wanted)
        racy = seen.racy()
        if not racy:
            return False
        confirmed = time.time_ns()
        for path in racy:
            current = _content(path, path in seen.dirs, self.wanted)
            if path in seen.contents and current != seen.contents[path]:
                return True
            seen.contents.setdefault(path, current)
        # unchanged by content: confirmed as of now, so these stop being racy once older
        self._seen = _Seen(seen.stamps, seen.dirs, seen.contents, confirmed)
        return False


def capability_watch(paths: Sequence[str | Path]) -> FileWatch:
    """The capability files under ``paths`` and the lock beside them (see ``discover``)."""
    lock: Path | None = None
    for raw in paths:
        p = Path(raw)
        lock = p / LOCK_NAME if p.is_dir() else p.parent / LOCK_NAME
        break
    return FileWatch(paths, lambda p: p.suffix in _SUFFIXES or p.name == LOCK_NAME,
                     [lock] if lock is not None else [])


class LiveSources:
    """The grants and capability files of one executor, re-read before each call.

    ``capabilities``: the capability paths (None: the registry was handed in and
    is not reloaded).  ``grants``: the grants file (None: no file, nothing
    granted, nothing to reload).  ``generation`` grows with every swap, so that
    a server can tell its callers their tools changed.
    """

    def __init__(self, capabilities: Sequence[str] | None, grants: str | None, *,
                 cache: bool = True):
        self.capabilities = list(capabilities) if capabilities is not None else None
        self.grants_path = grants
        self.cache = cache
        self.generation = 0
        self._caps = capability_watch(self.capabilities) if self.capabilities else None
        self._grants = FileWatch([grants], lambda _: True) if grants else None
        self._lock = threading.Lock()

    # --- the first read (a start-up error is raised: nothing runs yet) --------

    def load_registry(self) -> Registry:
        """The registry as the files are now; an invalid set raises (``RegistryError``)."""
        from capgate.registry.loader import load_registry

        assert self.capabilities is not None and self._caps is not None
        seen = self._caps.take()
        registry = load_registry(self.capabilities, cache=self.cache)
        self._caps.commit(seen)
        return registry

    def load_grants(self) -> Grants:
        """The grants as the file is now; an invalid file raises (``ConfigError``)."""
        assert self.grants_path is not None and self._grants is not None
        seen = self._grants.take()
        grants = Grants.load(self.grants_path)
        self._grants.commit(seen)
        return grants

    # --- before every call -------------------------------------------------------

    def stale(self) -> bool:
        """Whether any watched file changed since it was read (a stat each)."""
        return bool((self._caps is not None and self._caps.changed())
                    or (self._grants is not None and self._grants.changed()))

    def refresh(self, target: _Swappable) -> bool:
        """Re-read what changed into ``target`` (the runtime); True when anything was swapped.

        The stat runs without the lock; a change is re-checked and read under it,
        so concurrent callers that saw the change wait for one reload and then
        run on its result.
        """
        if not self.stale():
            return False
        with self._lock:
            swapped = False
            if self._grants is not None and self._grants.changed():
                assert self.grants_path is not None
                seen = self._grants.take()
                grants = load_failing_closed(self.grants_path)
                self._grants.commit(seen)
                target.grants = grants
                swapped = True
            if self._caps is not None and self._caps.changed():
                from capgate.registry.loader import reload_registry

                assert self.capabilities is not None
                seen = self._caps.take()
                registry = reload_registry(self.capabilities, target.registry, cache=self.cache)
                self._caps.commit(seen)
                target.registry = registry
                swapped = True
            if swapped:
                self.generation += 1
            return swapped


class _Swappable(Protocol):
    """What :meth:`LiveSources.refresh` swaps into (the executor's runtime)."""

    registry: Registry
    grants: Grants
