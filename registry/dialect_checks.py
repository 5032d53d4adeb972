"""A row's SQL checked against the dialects its connector declares, and against commits.

A capability file's connector may declare the databases it runs on
(``connectors: {insurance: {dialects: [postgresql, oracle]}}``).  A DBA should
learn at ``capgate validate`` time -- not on the first call against a real
estate -- that a check written for PostgreSQL does not run on Oracle 19c.  So:

* **CG170** (error): every SQL text of the row parses with sqlglot's parser for
  each declared dialect, and fits that dialect's rules that a parse alone does
  not catch.  On Oracle: every query has a FROM clause (``SELECT 1`` needs 23ai),
  no ``LIMIT``/``OFFSET`` (Oracle has ``FETCH FIRST``), no ``TRUE``/``FALSE``
  literals (SQL booleans need 23ai).  A PL/SQL block (``BEGIN ... END;``) cannot
  be parsed as SQL; on Oracle it is accepted as written.
* **CG171** (error, every row): a write statement must not end or split the
  transaction capgate opens and marks: no COMMIT, ROLLBACK or SAVEPOINT
  anywhere (a PL/SQL block included), no DDL or session/transaction control as
  the statement (``CREATE``, ``ALTER SESSION``, ``TRUNCATE``, ``START
  TRANSACTION`` ...), no dynamic SQL (``EXECUTE IMMEDIATE``, ``DBMS_SQL``,
  ``PREPARE``) whose text nobody reviewed.
* **CG172** (warning, Oracle): a string input whose pattern admits ISO dates and
  that declares no ``format: date`` -- Oracle would convert it through the
  session's ``NLS_DATE_FORMAT``; with the format capgate binds a DATE.
* **CG173** (warning, Oracle): a leased row -- refused on Oracle at call time.

Retired rows are left out of the dialect checks (they can no longer run).  The
findings name the file, the row and the statement, like every other finding.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from capgate.registry.checks import RowContext, _sql_sites, binds_of
from capgate.registry.errors import Problem
from capgate.registry.fastload.yamlpos import Path
from capgate.registry.rules import (
    DATE_BOUND_AS_TEXT,
    DIALECT_SQL_INVALID,
    LEASED_ON_ORACLE,
    TRANSACTION_CONTROL_IN_WRITE,
)


@dataclass(frozen=True)
class Grammar:
    """What validation knows of one engine's SQL, as flags and rules.

    ``registry`` is the lowest layer: it cannot ask the executor's dialects, so
    the facts about each engine's SQL that validation needs live in one table
    here (:data:`GRAMMARS`) and the checks below only read its flags.
    """

    sqlglot: str
    """sqlglot's name for the dialect (its parser and tokenizer)."""
    plsql_blocks: bool = False
    """An anonymous PL/SQL block (``BEGIN ... END;``) is accepted as written: it is not
    SQL, and sqlglot cannot read it."""
    rules: Callable[[Any], str | None] | None = None
    """The engine's rules a parse does not enforce: why a parsed statement does not run
    there, or None."""
    dates_as_text: bool = False
    """A string bound to a DATE is converted through a session setting (``NLS_DATE_FORMAT``):
    an input that takes ISO dates should declare ``format: date`` (CG172)."""
    refuses_leases: bool = False
    """Leased rows are refused at call time here (CG173)."""


def oracle_reason(tree: Any) -> str | None:
    """Oracle's rules a parse does not enforce (before 23ai), or None."""
    from sqlglot import exp

    for select in tree.find_all(exp.Select):
        if select.args.get("from") is None and select.args.get("from_") is None:
            return "a query without FROM needs Oracle 23ai (write FROM dual, or select " \
                   "from a derived table that every declared dialect accepts)"
    if tree.find(exp.Limit) is not None or tree.find(exp.Offset) is not None:
        return "Oracle has no LIMIT/OFFSET (FETCH FIRST n ROWS ONLY)"
    if tree.find(exp.Boolean) is not None:
        return "SQL TRUE/FALSE literals need Oracle 23ai (compare with 1/0)"
    return None


GRAMMARS: Mapping[str, Grammar] = {
    "postgresql": Grammar("postgres"),
    "mariadb": Grammar("mysql"),
    "oracle": Grammar("oracle", plsql_blocks=True, rules=oracle_reason, dates_as_text=True,
                      refuses_leases=True),
    "sqlite": Grammar("sqlite"),
}
"""capgate's dialect names (a connector's declared ``dialects``) -> what validation knows."""

CONTROL_FIRST_WORDS = frozenset({
    "CREATE", "DROP", "ALTER", "TRUNCATE", "GRANT", "REVOKE", "RENAME", "COMMENT", "ANALYZE",
    "AUDIT", "NOAUDIT", "PURGE", "FLASHBACK", "COMMIT", "ROLLBACK", "SAVEPOINT", "START",
    "SET", "PREPARE", "EXECUTE", "DEALLOCATE", "VACUUM", "REINDEX", "CLUSTER", "DISCARD",
    "RESET", "USE", "LOAD", "UNLOCK", "FLUSH", "OPTIMIZE", "REPAIR", "INSTALL", "ATTACH",
    "DETACH", "PRAGMA",
})
"""A write statement that *is* one of these (DDL, session or transaction control)."""
TRANSACTION_WORDS = frozenset({"COMMIT", "ROLLBACK", "SAVEPOINT"})
"""Refused anywhere in a write statement (a PL/SQL block's body included)."""
_LITERALS = frozenset({"STRING", "NATIONAL_STRING", "RAW_STRING", "BYTE_STRING", "BIT_STRING",
                       "HEX_STRING", "HEREDOC_STRING", "UNICODE_STRING", "IDENTIFIER"})
"""Token types whose text is data or a quoted name, never a keyword."""
ISO_DATE_SAMPLE = "2024-08-15"
ISO_DATETIME_SAMPLE = "2024-08-15T10:30:00"
NOT_A_DATE = "not a date"

_PLSQL = re.compile(r"^\s*(BEGIN|DECLARE)\b", re.IGNORECASE)
_LEADING_COMMENTS = re.compile(r"^(\s*(--[^\n]*\n|/\*.*?\*/))*", re.DOTALL)


def is_plsql_block(sql: str) -> bool:
    """An anonymous PL/SQL block (``BEGIN ... END;`` / ``DECLARE ...``), comments aside."""
    body = _LEADING_COMMENTS.sub("", sql, count=1)
    if not _PLSQL.match(body):
        return False
    # BEGIN; / BEGIN WORK / BEGIN TRANSACTION start a transaction (PostgreSQL, MySQL)
    return re.match(r"^\s*BEGIN\s*(;|\s*$|\s+(WORK|TRANSACTION)\b)", body, re.IGNORECASE) is None


class _QuietSqlglot:
    """sqlglot logs each statement it falls back to parsing as a Command: not a finding."""

    def __enter__(self) -> None:
        self.logger = logging.getLogger("sqlglot")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)


def _write_sites(row: Mapping[str, Any]) -> Iterator[tuple[Path, str]]:
    """The SQL that writes: a write row's statements, SQL steps, compensations."""
    writes = row["effect_class"] in ("transactional", "compensable", "irreversible")
    for path, sql, must_read in _sql_sites(row):
        if must_read:
            continue
        if path[0] == "statements" and not writes:
            continue
        yield path, sql


def _tokens(sql: str, dialects: Sequence[str]) -> list[Any] | None:
    import sqlglot

    for name in [*(GRAMMARS[d].sqlglot for d in dialects if d in GRAMMARS), None]:
        try:
            return list(sqlglot.Dialect.get_or_raise(name).tokenize(sql))
        except Exception:  # a TokenError: another dialect's quoting may read it
            continue
    return None


_SUSPECT_FIRST = re.compile(r"^\s*(" + "|".join(sorted(CONTROL_FIRST_WORDS | {"BEGIN"}))
                            + r")\b", re.IGNORECASE)
_SUSPECT_ANYWHERE = re.compile(r"\b(COMMIT|ROLLBACK|SAVEPOINT|IMMEDIATE|DBMS_SQL|DBMS_UTILITY)"
                               r"\b", re.IGNORECASE)


def control_reason(sql: str, dialects: Sequence[str] = ()) -> str | None:
    """Why a write statement would end or split its transaction, or None.

    A regular expression finds the suspects cheaply (validation of a large registry
    tokenizes nothing for ordinary DML); sqlglot's tokens then decide, so a word in
    a string literal or a comment is no finding.
    """
    body = _LEADING_COMMENTS.sub("", sql, count=1)
    if not (_SUSPECT_FIRST.match(body) or _SUSPECT_ANYWHERE.search(sql)):
        return None
    return _control_reason(sql, tuple(dialects))


@functools.lru_cache(maxsize=4096)
def _control_reason(sql: str, dialects: tuple[str, ...]) -> str | None:
    tokens = _tokens(sql, dialects)
    if tokens is None:
        return None  # unparseable everywhere: CG120/CG170 say so where it matters
    # words outside string literals and quoted identifiers
    words = [t.text.upper() for t in tokens
             if t.token_type.name not in _LITERALS or t.text.upper().startswith("IMMEDIATE")]
    if not words:
        return None
    plsql = is_plsql_block(sql)
    first = words[0]
    if first == "BEGIN" and not plsql:
        return "starts a transaction of its own (BEGIN)"
    if not plsql and first in CONTROL_FIRST_WORDS:
        return f"is a {first} statement (DDL or session/transaction control)"
    for i, word in enumerate(words):
        following = words[i + 1] if i + 1 < len(words) else ""
        if word in TRANSACTION_WORDS:
            return f"contains {word}"
        if word == "EXECUTE" and following.startswith("IMMEDIATE"):
            return "runs dynamic SQL (EXECUTE IMMEDIATE)"
        if word in ("DBMS_SQL", "DBMS_UTILITY") and following == ".":
            return f"runs dynamic SQL ({word})"
    return None


def transaction_control_problems(ctx: RowContext, dialects: Sequence[str] = ()
                                 ) -> list[Problem]:
    """CG171 for every write statement of the row."""
    out: list[Problem] = []
    for path, sql in _write_sites(ctx.row):
        reason = control_reason(sql, dialects)
        if reason:
            out.append(ctx.at(path, TRANSACTION_CONTROL_IN_WRITE.code,
                              f"a write statement must not commit, roll back or run DDL: it "
                              f"{reason}; capgate owns the transaction (marker, COMMIT)"))
    return out


@functools.lru_cache(maxsize=16384)
def dialect_reason(sql: str, dialect: str) -> str | None:
    """Why ``sql`` does not fit ``dialect`` (a capgate dialect name), or None."""
    import sqlglot

    grammar = GRAMMARS.get(dialect)
    if grammar is None:
        return None
    if grammar.plsql_blocks and is_plsql_block(sql):
        return None  # PL/SQL is not SQL: accepted as written, sqlglot cannot read it
    try:
        with _QuietSqlglot():
            trees = [t for t in sqlglot.parse(sql, read=grammar.sqlglot) if t is not None]
    except sqlglot.errors.SqlglotError as exc:
        return f"does not parse as {dialect}: {str(exc).splitlines()[0]}"
    except RecursionError:
        return f"does not parse as {dialect}: nested too deeply"
    if grammar.rules is not None:
        for tree in trees:
            reason = grammar.rules(tree)
            if reason:
                return reason
    return None


def dialect_problems(ctx: RowContext, dialects: Sequence[str]) -> list[Problem]:
    """CG170 for every SQL text of a (non-retired) row, for each declared dialect."""
    if not dialects or ctx.row.get("retired"):
        return []
    out: list[Problem] = []
    for path, sql, _ in _sql_sites(ctx.row):
        for dialect in dialects:
            reason = dialect_reason(sql, dialect)
            if reason:
                out.append(ctx.at(path, DIALECT_SQL_INVALID.code, f"{dialect}: {reason}"))
                break  # one finding per statement
    return out


def _admits_iso_dates(pattern: Any) -> bool:
    if not isinstance(pattern, str):
        return False
    try:
        compiled = re.compile(pattern)
    except re.error:
        return False
    return bool(compiled.search(ISO_DATE_SAMPLE) or compiled.search(ISO_DATETIME_SAMPLE)) \
        and not compiled.search(NOT_A_DATE)


def dialect_warnings(ctx: RowContext, dialects: Sequence[str]) -> list[Problem]:
    """CG172 and CG173 for a (non-retired) row whose connector declares Oracle."""
    row = ctx.row
    declared = [GRAMMARS[d] for d in dialects if d in GRAMMARS]
    dates = any(g.dates_as_text for g in declared)
    leases = any(g.refuses_leases for g in declared)
    if not (dates or leases) or row.get("retired"):
        return []
    out: list[Problem] = []
    props = row.get("input", {}).get("properties")
    used: set[str] = set()
    for _, sql, _ in _sql_sites(row):
        used |= binds_of(sql)
    if dates and isinstance(props, Mapping) and row.get("shape") != "leased":  # CG173 says it
        for name, spec in props.items():
            if not isinstance(spec, Mapping) or name not in used:
                continue
            if spec.get("type") == "string" and "format" not in spec \
                    and _admits_iso_dates(spec.get("pattern")):
                out.append(ctx.at(("input", "properties", name), DATE_BOUND_AS_TEXT.code,
                                  f"input {name!r} takes ISO dates but is bound as text: on "
                                  "Oracle a DATE column meets it through NLS_DATE_FORMAT; "
                                  "declare `format: date` and capgate binds a DATE"))
    if leases and row.get("shape") == "leased":
        out.append(ctx.at(("shape",), LEASED_ON_ORACLE.code,
                          "a leased row is refused on Oracle (CG326): nothing there ends a "
                          "hung executor's transaction at the deadline"))
    return out


def sql_fit_problems(ctx: RowContext, dialects: Sequence[str]) -> list[Problem]:
    """Every error of this module for one row: CG171 (any row), CG170 (declared dialects)."""
    return transaction_control_problems(ctx, dialects) + dialect_problems(ctx, dialects)
