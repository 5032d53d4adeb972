"""The capability files: validate, lock, list, show, diff, bump.

A DBA's commands.  They read and write capability files and never connect to a
database, so they take the files (``paths``); :func:`capability_paths` finds
the configured ones.  The work is ``registry``'s; these functions choose what
to run and return it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capgate.registry.loader import (
    DEFAULT_PATH,
    Validation,
    load_registry,
    update_lock,
    validate_paths,
)
from capgate.registry.lock import LockedRow
from capgate.registry.model import Row

if TYPE_CHECKING:
    from capgate.config import ConfigProblem


def capability_paths(given: Sequence[str] | None = None, config: str | None = None
                     ) -> list[str]:
    """``given`` (``--capabilities``) if any, else the configured capability files."""
    if given:
        return list(given)
    from capgate.config import load_settings

    return list(load_settings(config, require=False).capabilities)


@dataclass(frozen=True)
class FilesChecked:
    """``validate``'s answer: the files' validation, and the configuration's when it was read."""

    files: Validation
    configuration: list[ConfigProblem] | None
    """The configuration's problems; None when no configuration was validated."""

    @property
    def ok(self) -> bool:
        return self.files.ok and not self.configuration

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": self.ok,
            "files": self.files.files,
            "rows": len(self.files.rows),
            "problems": [p.to_dict() for p in self.files.problems],
            "warnings": [w.to_dict() for w in self.files.warnings],
        }
        if self.configuration is not None:
            out["configuration_problems"] = [p.to_dict() for p in self.configuration]
        return out


def validate(paths: Sequence[str] = (), *, config: str | None = None) -> FilesChecked:
    """Every problem of every file in one pass.

    Without ``paths``: the configured capability files and the configuration
    itself when there is one (a configuration is validated with its files),
    else ``capabilities/``.
    """
    files = list(paths)
    configuration: list[ConfigProblem] | None = None
    settings = None
    if not files:
        from capgate.config import config_file, read_settings

        files = [DEFAULT_PATH]
        if config_file(config) is not None:
            settings, configuration = read_settings(config)
            files = list(settings.capabilities)
    checked = validate_paths(files)
    if settings is not None:
        checked = _engine_warnings_for(checked, settings.connectors)
    return FilesChecked(checked, configuration)


def _engine_warnings_for(checked: Validation, connectors: Mapping[str, Any]) -> Validation:
    """Drop an engine's warnings (CG172, CG173: Oracle binds dates as text and refuses
    leased rows) for rows whose connector is configured here on another engine.

    The files declare every dialect a row must fit, wherever it may run; the
    configuration says where it runs here.  A PostgreSQL project is not told, on every
    ``validate``, about an Oracle it does not have.  Without a configuration (a CI run
    over the files alone) every warning stays.
    """
    from sqlalchemy.exc import ArgumentError

    from capgate.executor.dialects import engine_name
    from capgate.registry.dialect_checks import GRAMMARS
    from capgate.registry.rules import DATE_BOUND_AS_TEXT, LEASED_ON_ORACLE

    applies = {DATE_BOUND_AS_TEXT.code: "dates_as_text", LEASED_ON_ORACLE.code: "refuses_leases"}
    if not any(w.code in applies for w in checked.warnings):
        return checked
    rows = sorted(checked.rows, key=lambda r: (r.source_path, r.source_line))

    def owner(path: str, line: int) -> str | None:
        found = [r for r in rows if r.source_path == path and r.source_line <= line]
        return found[-1].connector if found else None

    def runs_here(code: str, path: str, line: int) -> bool:
        config = connectors.get(owner(path, line) or "")
        if config is None:
            return False  # not configured here: it runs nowhere this configuration knows
        try:
            grammar = GRAMMARS.get(engine_name(config.url))
        except ArgumentError:  # a URL nothing parses is the configuration's own finding
            return True
        return grammar is not None and bool(getattr(grammar, applies[code]))

    kept = [w for w in checked.warnings
            if w.code not in applies or runs_here(w.code, w.path, w.line)]
    return dataclasses.replace(checked, warnings=kept)


@dataclass(frozen=True)
class Locked:
    """``lock``'s answer: the lock file, the pins it now holds and the ones it gained."""

    path: Path
    added: list[LockedRow]
    pins: list[LockedRow]

    def to_dict(self) -> dict[str, Any]:
        return {"lock": str(self.path), "rows": len(self.pins),
                "added": [p.ref for p in self.added]}


def lock(paths: Sequence[str]) -> Locked:
    """Pin every row's hash in ``capabilities.lock``; a pinned row that changed is refused."""
    path, added, pins = update_lock(paths)
    return Locked(path, added, pins)


def list_rows(paths: Sequence[str], *, include_retired: bool = False) -> list[Row]:
    """The registered rows, in registry order; retired ones only when asked."""
    return [row for row, _ in listing(paths, include_retired=include_retired)]


def listing(paths: Sequence[str], *, include_retired: bool = False
            ) -> list[tuple[Row, bool]]:
    """Each registered row with whether ``capabilities.lock`` pins it as it is (an
    unpinned row is a draft: it runs in the unlocked environments only)."""
    registry = load_registry(paths)
    return [(row, registry.pinned(row))
            for row in registry.rows(include_retired=include_retired)]


def row_summary(row: Row, pinned: bool | None = None) -> dict[str, Any]:
    """A row in one flat mapping: identity, effect, shape, authorization, where it is,
    and (``pinned``) whether the lock pins it."""
    extra = {} if pinned is None else {"pinned": pinned}
    return {**extra,
        "operation_id": row.operation_id,
        "version": row.version,
        "effect_class": str(row.effect_class),
        "shape": str(row.shape) if row.shape else None,
        "connector": row.connector,
        "authorization": str(row.authorization.kind),
        "environments": list(row.environments),
        "retired": row.retired,
        "row_hash": row.row_hash,
        "source": f"{row.source_path}:{row.source_line}",
    }


def show(paths: Sequence[str], operation: str, version: int | None = None) -> Row:
    """The row a review card is made of: ``operation@version`` (retired ones too), else current."""
    return show_row(paths, operation, version)[0]


def show_row(paths: Sequence[str], operation: str, version: int | None = None
             ) -> tuple[Row, bool]:
    """:func:`show`'s row, and whether ``capabilities.lock`` pins it as it is."""
    registry = load_registry(paths)
    if version is not None:
        found = [r for r in registry.rows() if r.key == (operation, version)]
        row = found[0] if found else registry.resolve(operation, version)
    else:
        row = registry.resolve(operation)
    return row, registry.pinned(row)


_VERSION_REF = re.compile(r"^[A-Za-z0-9_.-]+@\d+$")


def diff(old: str, new: str, *, paths: Sequence[str] | None = None,
         config: str | None = None) -> str:
    """The Markdown review of the changes from ``old`` to ``new``.

    Each is a file, a directory or ``git:REV[:PATH]``; or both are
    ``OPERATION@VERSION`` of the capability files (``paths``, default the
    configured ones), compared field by field.
    """
    from capgate.registry.review import diff as diff_rows
    from capgate.registry.review import diff_versions, rows_from

    if all(_VERSION_REF.match(x) and not Path(x).exists() for x in (old, new)):
        op_old, _, ver_old = old.partition("@")
        op_new, _, ver_new = new.partition("@")
        rows = validate_paths(capability_paths(paths, config), check_lock=False)
        rows.raise_for_problems()
        return diff_versions(rows.rows, (op_old, int(ver_old)), (op_new, int(ver_new)))
    return diff_rows(rows_from(old), rows_from(new))


def bump(paths: Sequence[str], operation: str, *, retire: bool = False) -> dict[str, Any]:
    """Write the next version of ``operation`` after the current one (a copy to edit).

    A current row edited in place becomes the new version, and the published one is
    put back from its locked text (git history, or the packaged examples ``init``
    copied): see :func:`registry.review.bump`.
    """
    from capgate.registry.review import bump as bump_row
    from capgate.sqlfiles import example_capability_files

    originals = [(f"examples:{p.name}", p.read_text("utf-8"))
                 for p in example_capability_files()]
    return bump_row(paths, operation, retire=retire, originals=originals)
