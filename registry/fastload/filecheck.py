"""One capability file checked on its own: the unit of work of a parallel load.

Everything here is a pure function of the file's text -- YAML with positions,
JSON Schema, the semantic checks of each row, each clean row's hash -- so the
files of a large registry can be checked in several processes at once.  What
spans files (duplicate rows, the lock) is left to ``registry.loader``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from capgate.registry.checks import RowContext, check_row
from capgate.registry.dialect_checks import dialect_warnings, sql_fit_problems
from capgate.registry.errors import Problem
from capgate.registry.fastload.yamlpos import Located, load_located
from capgate.registry.lock import row_hash
from capgate.registry.schema import schema_problems

#: ``((operation_id, version), row position, index in the file, row or None, hash)``;
#: the row is None when it has findings of its own (it is only counted for duplicates).
CheckedRow = tuple[tuple[str, int], tuple[int, int], int, dict[str, Any] | None, str]


@dataclass
class CheckedFile:
    """The findings of one file, and its rows that passed every check."""

    problems: list[Problem]
    rows: list[CheckedRow] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    """Findings that do not stop a row from loading (CG172, CG173: ``registry.dialect_checks``)."""


def check_file(source: str, text: str) -> CheckedFile:
    """Every finding of one file on its own, and its clean rows with their hashes.

    A clean file is loaded with the positions of its rows only; a file with
    any finding is checked again with every position, so that each finding
    names the exact line and column of its field.
    """
    checked = _check_file(source, text, "rows")
    if checked.problems:
        checked = _check_file(source, text, "all")
    return checked


def _check_file(source: str, text: str, positions: str) -> CheckedFile:
    """``check_file`` with the given positions (``load_located``'s ``"rows"`` or ``"all"``).

    Rows with schema problems are checked for their semantics too, as far as
    their shape allows; a finding at a position the schema already flagged is
    not repeated.
    """
    located, problems = load_located(text, source, positions=positions)
    checked = CheckedFile(problems)
    if located is None or problems:
        return checked
    file_problems = schema_problems(located, source)
    problems.extend(file_problems)
    doc = located.data if isinstance(located.data, dict) else {}
    raw_rows = doc.get("rows")
    connectors = doc.get("connectors")
    declared = set(connectors) if isinstance(connectors, dict) else set()
    dialects = {name: [str(d) for d in spec.get("dialects") or ()]
                for name, spec in (connectors if isinstance(connectors, dict) else {}).items()
                if isinstance(spec, dict) and isinstance(spec.get("dialects") or [], list)}
    bad_rows = _row_indexes_with(file_problems, located)
    if not isinstance(raw_rows, list):
        return checked
    where = located.where
    for index, raw in enumerate(raw_rows):
        if not isinstance(raw, dict):
            continue
        if index in bad_rows:
            # Its schema findings are already listed; its semantic ones are found too, in
            # the same pass, as far as the row's shape lets the checks run -- a reviewer
            # should not fix a file in two rounds.
            problems.extend(_semantics_of_invalid(RowContext(raw, index, located, source),
                                                  declared, problems))
            continue
        ctx = RowContext(raw, index, located, source)
        own = dialects.get(str(raw.get("connector")), [])
        findings = check_row(ctx, declared) + sql_fit_problems(ctx, own)
        checked.warnings.extend(dialect_warnings(ctx, own))
        problems.extend(findings)
        key = (raw["operation_id"], raw["version"])
        at = where(("rows", index))
        if findings:
            checked.rows.append((key, at, index, None, ""))
        else:
            checked.rows.append((key, at, index, raw,
                                 row_hash(raw, known_plain=located.json_plain)))
    return checked


#: The fields the semantic checks reason from: a schema finding in one of them makes the
#: row's semantic findings consequences of it, not problems of their own.
_DRIVERS = frozenset({
    "operation_id", "version", "connector", "effect_class", "shape", "authorization", "input",
    "target", "idempotency_key", "statements", "steps", "verify", "replay", "landed_probe",
    "compensation", "post_commit", "ddl", "examples", "max_rows", "evidence",
})


def _semantics_of_invalid(ctx: RowContext, declared: set[str],
                          known: list[Problem]) -> list[Problem]:
    """The semantic findings of a row that failed the schema, not repeating a schema finding.

    Only rows whose schema findings leave alone what the semantic checks reason
    from (:data:`_DRIVERS`: the effect class, authorization, inputs, SQL ...)
    are checked; a wrong ``effect_class`` would otherwise turn into findings
    about everything an effect class decides.

    The checks assume a schema-valid row; on one that is not, a check may fail
    on the malformed part, and then the row's schema findings stand alone.  A
    finding about a field that the schema flagged, or one inside or around it,
    is a consequence of that typo (``expect_row`` makes ``expect_rows``
    missing) and is left out.
    """
    flagged = [p.field for p in known if p.path == ctx.source]
    if any(re.split(r"[.\[]", f, maxsplit=1)[0] in _DRIVERS for f in flagged):
        return []
    try:
        found = check_row(ctx, declared)
    except Exception:
        return []

    def related(field: str) -> bool:  # the same node, or one inside or around it
        return any(f == field or f.startswith((field + ".", field + "[")) or
                   field.startswith((f + ".", f + "[")) for f in flagged)

    return [p for p in found if not related(p.field)]


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
