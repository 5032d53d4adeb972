"""Lookup of capability rows: the only way from an operation name to SQL.

``resolve`` fails closed with a specific refusal for each way a call can be
unlisted: unknown operation, unknown version, retired row, environment not
allowed.  It sits on every call's hot path, so everything is precomputed into
dictionaries at construction.

A registry also carries what ``capabilities.lock`` says (``lock``: which rows
it pins), and -- when it was reloaded by a long-lived process from files of
which some no longer validate -- the operations that fail closed (``down``:
each with the refusal naming the file, line and column), or a failure that
refuses everything (``failure``: the lock itself cannot be read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from capgate.registry.errors import (
    CapgateError,
    EnvironmentNotAllowed,
    Problem,
    RetiredRow,
    UnknownOperation,
    UnknownVersion,
)
from capgate.registry.lock import LockState
from capgate.registry.model import Row


class Registry:
    """An immutable set of validated rows."""

    lock: LockState = LockState()
    """What ``capabilities.lock`` says about these rows (no lock: nothing pinned)."""
    down: Mapping[str, CapgateError] = {}
    """Operations refused because a file they depend on fails validation (a reload's)."""
    failure: CapgateError | None = None
    """Set when nothing can be served: every resolution raises it."""
    problems: tuple[Problem, ...] = ()
    """A reload's validation findings (what an operator is told), when files failed."""

    def __init__(self, rows: Iterable[Row], *, lock: LockState | None = None,
                 down: Mapping[str, CapgateError] | None = None,
                 failure: CapgateError | None = None):
        if lock is not None:
            self.lock = lock
        if down:
            self.down = dict(down)
        if failure is not None:
            self.failure = failure
        self._rows: dict[tuple[str, int], Row] = {}
        self._versions: dict[str, list[int]] = {}
        self._current: dict[str, Row] = {}
        for row in rows:
            self._rows[row.key] = row
            self._versions.setdefault(row.operation_id, []).append(row.version)
        for op, versions in self._versions.items():
            versions.sort()
            live = [v for v in versions if not self._rows[(op, v)].retired]
            if live:
                self._current[op] = self._rows[(op, live[-1])]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows())

    def rows(self, *, include_retired: bool = True) -> list[Row]:
        """All rows ordered by operation and version."""
        return [
            self._rows[k]
            for k in sorted(self._rows)
            if include_retired or not self._rows[k].retired
        ]

    def current_rows(self) -> list[Row]:
        """The newest non-retired version of every operation."""
        return [self._current[op] for op in sorted(self._current)]

    def versions(self, operation_id: str) -> list[int]:
        return list(self._versions.get(operation_id, ()))

    def _unknown(self, operation_id: str) -> UnknownOperation:
        """The refusal for an unknown name, with the closest declared names (a typo's fix)."""
        import difflib

        close = difflib.get_close_matches(operation_id, list(self._versions), n=2, cutoff=0.8)
        hint = ("; did you mean " + " or ".join(f"`{c}`" for c in close) + "?") if close else ""
        return UnknownOperation(f"no capability row declares operation {operation_id!r}{hint}",
                                operation_id=operation_id, suggestions=close)

    def pinned(self, row: Row) -> bool:
        """Whether ``capabilities.lock`` pins ``row`` as it is."""
        return self.lock.pinned(row)

    def resolve(self, operation_id: str, version: int | None = None,
                environment: str | None = None) -> Row:
        """The row for a call, or the refusal that says why there is none."""
        if self.failure is not None:
            raise self.failure
        refused = self.down.get(operation_id)
        if refused is not None:
            raise refused
        if version is None:
            row = self._current.get(operation_id)
            if row is None:
                if operation_id not in self._versions:
                    raise self._unknown(operation_id)
                last = self._rows[(operation_id, self._versions[operation_id][-1])]
                raise RetiredRow(f"every version of {operation_id} is retired",
                                 operation_id=operation_id, version=last.version)
        else:
            found = self._rows.get((operation_id, version))
            if found is None:
                if operation_id not in self._versions:
                    raise self._unknown(operation_id)
                raise UnknownVersion(
                    f"{operation_id} has no version {version}; registered: "
                    f"{', '.join(map(str, self._versions[operation_id]))}",
                    operation_id=operation_id, version=version,
                    registered=self._versions[operation_id],
                )
            if found.retired:
                current = self._current.get(operation_id)
                hint = f"; call version {current.version}" if current else ""
                raise RetiredRow(f"{found.ref} is retired{hint}", operation_id=operation_id,
                                 version=version)
            row = found
        if environment is not None and environment not in row.environments:
            raise EnvironmentNotAllowed(
                f"{row.ref} is not allowed in environment {environment!r} "
                f"(allowed: {', '.join(row.environments)})",
                operation_id=operation_id, version=row.version, environment=environment,
                allowed=list(row.environments),
            )
        return row
