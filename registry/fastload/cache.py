"""A validation cache keyed by content: a file checked once is not checked again.

Validating 10,000 rows takes seconds (YAML with positions, JSON Schema, every
SQL parsed); an agent calling through ``capgate call`` would pay that on every
call.  A file that passed every per-file check is recorded under a key made of

* the SHA-256 of the file's bytes,
* capgate's version,
* the SHA-256 of the capability JSON Schema,
* the SHA-256 of the validating code (``registry``'s ``*.py`` files, and
  ``registry.fastload``'s), and
* the versions of the libraries that take part in checking (sqlglot,
  jsonschema, PyYAML, SQLAlchemy),

so any change to the file, the schema, the checks or their libraries is a
different key: the cache can miss but it cannot go stale.  Nothing is cached
for a file with any finding -- it is checked, and reported, every time.

What spans files -- duplicate rows and the lock -- is checked on every load
from the cached keys and hashes, which need no row to be built.  Rows are
built on first use (:class:`LazyRegistry`): a call resolves one row and builds
one, not ten thousand.

An entry is one file: a JSON header line (each row's key, position, retired
flag, hash, and where its body starts after the header) followed by one JSON
line per row.  Entries
are written atomically; a cache folder that cannot be written or read is
ignored (the files are validated as without a cache).  ``CAPGATE_CACHE_DIR``
moves it (default ``$XDG_CACHE_HOME/capgate`` or ``~/.cache/capgate``) and
``CAPGATE_CACHE=off`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from capgate.registry.errors import Problem
from capgate.registry.model import Row
from capgate.registry.registry import Registry

CACHE_FORMAT = "capgate-validation/1"
CACHE_ENV = "CAPGATE_CACHE"
CACHE_DIR_ENV = "CAPGATE_CACHE_DIR"
_LIBRARIES = ("sqlglot", "jsonschema", "PyYAML", "SQLAlchemy", "capgate")
#: The ``registry`` package: its checks (and this machinery's) decide a file's validity.
_REGISTRY = Path(__file__).resolve().parent.parent


def cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where entries live, or None when the cache is turned off."""
    env = os.environ if env is None else env
    if env.get(CACHE_ENV, "").lower() in ("off", "0", "no", "false"):
        return None
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV]) / "validation"
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "capgate" / "validation"


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def installed_versions(names: Iterable[str]) -> dict[str, str]:
    """The installed version of each distribution in ``names`` ("-" where none is).

    Read from the ``NAME-VERSION.dist-info`` folder names on ``sys.path``
    (the name a wheel installs its metadata under), which costs one listing
    per folder; ``importlib.metadata`` parses every METADATA file and costs a
    CLI call 20 ms.  A distribution not found that way (an egg, a zip) is
    asked of ``importlib.metadata``.
    """
    wanted = {_normalised(n): n for n in names}
    found: dict[str, str] = {}
    for folder in sys.path:
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith(".dist-info"):
                continue
            dist, _, ver = entry[:-len(".dist-info")].partition("-")
            name = wanted.get(_normalised(dist))
            if name is not None and name not in found and ver:
                found[name] = ver
        if len(found) == len(wanted):
            break
    for name in wanted.values():
        if name not in found:
            from importlib.metadata import PackageNotFoundError, version

            try:
                found[name] = version(name)
            except PackageNotFoundError:
                found[name] = "-"
    return found


@lru_cache(maxsize=1)
def validator_digest() -> str:
    """What decides a file's validity besides its text: code, schema, library versions."""
    digest = hashlib.sha256(CACHE_FORMAT.encode())
    versions = installed_versions(_LIBRARIES)
    for name in _LIBRARIES:
        digest.update(f"\0{name}={versions[name]}".encode())
    for path in (sorted(_REGISTRY.glob("*.py")) + sorted(_REGISTRY.glob("fastload/*.py"))
                 + sorted(_REGISTRY.glob("*.json"))):
        digest.update(b"\0" + path.relative_to(_REGISTRY).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def schema_digest() -> str:
    """The SHA-256 of the capability JSON Schema (also part of :func:`validator_digest`)."""
    return hashlib.sha256((_REGISTRY / "capability.schema.json").read_bytes()).hexdigest()


def entry_key(text: str) -> str:
    """The cache key of one file's text under the running validator."""
    return hashlib.sha256(f"{validator_digest()}\0".encode() + text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class IndexedRow:
    """One clean row as the cache knows it, before it is built."""

    operation_id: str
    version: int
    retired: bool
    row_hash: str
    line: int
    col: int
    index: int
    """The row's index in its file."""
    source: str
    entry: Path
    offset: int
    length: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.operation_id, self.version)

    def build(self) -> Row:
        """The row, from its cache entry -- or, if the entry is gone, from its file again."""
        try:
            with self.entry.open("rb") as fh:
                fh.seek(self.offset)
                raw = json.loads(fh.read(self.length))
        except (OSError, ValueError):  # the cache was cleared under a running process
            raw = self._from_source()
        return Row.from_dict(raw, row_hash=self.row_hash, source_path=self.source,
                             source_line=self.line, adopt=True)

    def _from_source(self) -> dict[str, Any]:
        from capgate.registry.errors import RegistryError
        from capgate.registry.fastload.filecheck import check_file

        try:
            checked = check_file(self.source, Path(self.source).read_text("utf-8"))
        except OSError as exc:
            raise RegistryError(f"{self.source}: cannot read {self.operation_id}@"
                                f"{self.version} again: {exc.strerror}") from None
        for key, _, _, raw, digest in checked.rows:
            if key == self.key and raw is not None and digest == self.row_hash:
                return raw
        raise RegistryError(f"{self.source}: {self.operation_id}@{self.version} changed since "
                            "the capability files were loaded; load them again")


def read_entry(directory: Path, key: str, source: str) -> list[IndexedRow] | None:
    """The rows of a cached clean file, or None (a miss, or an unreadable entry)."""
    entry = directory / key[:2] / f"{key}.jsonl"
    try:
        with entry.open("rb") as fh:
            header = json.loads(fh.readline())
            start = fh.tell()
        if header.get("format") != CACHE_FORMAT or header.get("key") != key:
            return None
        return [IndexedRow(op, int(ver), bool(retired), digest, line, col, index, source,
                           entry, start + offset, length)
                for op, ver, retired, digest, line, col, index, offset, length in header["rows"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_entry(directory: Path, key: str,
                rows: Sequence[tuple[tuple[str, int], tuple[int, int], int, dict[str, Any], str]]
                ) -> bool:
    """Record a clean file's rows; False (and nothing written) when it cannot be.

    A row whose JSON form would not read back equal (a YAML value JSON cannot
    hold) makes the whole file uncacheable: it is then validated every time.
    """
    bodies: list[bytes] = []
    for _, _, _, raw, _ in rows:
        try:
            body = json.dumps(raw, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False).encode("utf-8")
        except (TypeError, ValueError):
            return False
        if json.loads(body) != raw:
            return False
        bodies.append(body)
    index: list[list[Any]] = []
    for (key_, (line, col), position, raw, digest), body in zip(rows, bodies, strict=True):
        index.append([key_[0], key_[1], bool(raw.get("retired", False)), digest, line, col,
                      position, 0, len(body)])
    offset = 0  # from the end of the header line, so that the header need not know its length
    for item, body in zip(index, bodies, strict=True):
        item[7] = offset
        offset += len(body) + 1
    header = json.dumps({"format": CACHE_FORMAT, "key": key, "rows": index},
                        separators=(",", ":")).encode("utf-8")
    try:
        folder = directory / key[:2]
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".entry-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(header + b"\n")
            for body in bodies:
                fh.write(body + b"\n")
        os.replace(tmp, folder / f"{key}.jsonl")
        return True
    except OSError:
        return False


class _LazyRows(Mapping[tuple[str, int], Row]):
    """``(operation_id, version) -> Row``, each row built on first access."""

    def __init__(self, index: Mapping[tuple[str, int], IndexedRow]):
        self._index = index
        self._built: dict[tuple[str, int], Row] = {}

    def __getitem__(self, key: tuple[str, int]) -> Row:
        row = self._built.get(key)
        if row is None:
            row = self._built[key] = self._index[key].build()
        return row

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index


class _LazyCurrent(Mapping[str, Row]):
    """``operation_id -> its newest live Row``, built on first access."""

    def __init__(self, keys: Mapping[str, tuple[str, int]], rows: _LazyRows):
        self._keys = keys
        self._rows = rows

    def __getitem__(self, operation_id: str) -> Row:
        return self._rows[self._keys[operation_id]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class LazyRegistry(Registry):
    """A :class:`Registry` over validated rows that builds each row when it is first used."""

    def __init__(self, index: Sequence[IndexedRow]):
        by_key = {item.key: item for item in index}
        rows = _LazyRows(by_key)
        self._rows = rows  # type: ignore[assignment]
        self._versions = {}
        for item in index:
            self._versions.setdefault(item.operation_id, []).append(item.version)
        current: dict[str, tuple[str, int]] = {}
        for op, versions in self._versions.items():
            versions.sort()
            live = [v for v in versions if not by_key[(op, v)].retired]
            if live:
                current[op] = (op, live[-1])
        self._current = _LazyCurrent(current, rows)  # type: ignore[assignment]


def duplicate_problems(index: Sequence[IndexedRow]) -> list[Problem]:
    """Rows that share an ``(operation_id, version)``, found as the loader finds them."""
    seen: set[tuple[str, int]] = set()
    out = []
    for item in index:
        if item.key in seen:
            out.append(Problem(item.source, item.line, item.col, "CG118", "operation_id",
                               f"duplicate row {item.operation_id}@{item.version}"))
        seen.add(item.key)
    return out
