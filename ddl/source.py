"""One source, one definition: find where a ``CREATE`` statement ends and refuse the rest.

A ``ddl`` row's input is the new source of one object.  Anything after that
object's definition -- ``CREATE TABLE x(y int);`` appended to a function --
would run with the DDL under the row's approval, so it is refused at plan
time, before the source is rendered (PostgreSQL renders in a savepoint) or
applied, with ``ExtraStatements`` (CG527).

Each dialect is parsed by the field's tool for it:

* PostgreSQL -- ``pglast``, which is PostgreSQL's own parser (libpg_query): the
  source must be exactly one ``CreateFunctionStmt`` / ``ViewStmt`` /
  ``CreateTrigStmt`` / aggregate ``DefineStmt``.  SQL-standard bodies
  (``BEGIN ATOMIC ... END``) and dollar quotes are the grammar's business.
* PL/SQL (Oracle) and MariaDB -- sqlglot's tokenizer for the dialect (strings,
  ``q'[...]'`` quotes, comments, quoted identifiers), then the block structure
  over its tokens: ``BEGIN``/``CASE`` open, ``END`` / ``END CASE`` close,
  ``END IF|LOOP|WHILE|REPEAT|FOR`` close what their own keyword opened (so they
  are neutral), a package's (or type body's, or compound trigger's) ``AS``/``IS``
  opens the unit, and PL/SQL declarations before the first ``BEGIN`` end with
  ``;`` inside the statement.  On MariaDB the server also parses the source
  with ``PREPARE`` (which runs nothing) -- see ``catalog_mariadb``.

The engines enforce the same at apply: PostgreSQL DDL is sent through the
extended protocol, which takes one statement; MariaDB connections have no
``MULTI_STATEMENTS``; Oracle compiles everything sent in one call as one unit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from capgate.registry.errors import ExtraStatements, SourceDoesNotParse, UnsupportedObjectType

_NEUTRAL_AFTER_END = frozenset({"IF", "LOOP", "WHILE", "REPEAT", "FOR"})
_PACKAGE_LIKE = frozenset({"package", "package_body", "type_body"})
_ROUTINE_LIKE = frozenset({"procedure", "function", "trigger"})


@dataclass(frozen=True)
class Definition:
    """Where the one definition of a source ends."""

    statement: str
    """The source up to the end of the definition (terminators not included)."""
    rest: str
    """What followed it: only terminators, comments and blank space."""


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, max(offset, 0)) + 1


def _extra(what: str, text: str, offset: int) -> ExtraStatements:
    line = line_of(text, offset)
    snippet = " ".join(text[offset:].split())[:80]
    return ExtraStatements(
        f"the source holds more than the definition of {what}: line {line} starts another "
        f"statement ({snippet!r}); a ddl source is exactly one object's CREATE -- remove the "
        "rest",
        line=line,
        extra=snippet,
        object=what,
    )


_TAIL_RE = re.compile(r"\A(?:\s|;|/|\$\$|//|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*\Z", re.DOTALL)


def check_tail(what: str, text: str, end: int) -> Definition:
    """Refuse anything but terminators, comments and blank space after offset ``end``."""
    rest = text[end:]
    if not _TAIL_RE.match(rest):
        # point at the first character that is not a terminator or a comment
        m = re.match(r"(?:\s|;|/(?!\*)|\$\$|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", rest, re.DOTALL)
        raise _extra(what, text, end + (m.end() if m else 0))
    return Definition(text[:end], rest)


# --- PostgreSQL: pglast (PostgreSQL's own parser) ----------------------------------------------


_PG_KINDS = {
    "CreateFunctionStmt": ("function", "procedure"),
    "ViewStmt": ("view",),
    "CreateTrigStmt": ("trigger",),
    "DefineStmt": ("aggregate",),
}


def parse_postgresql(text: str, kind: str, what: str) -> Definition:
    """Exactly one statement, and it defines an object of ``kind``; else a coded refusal."""
    from pglast import parse_sql
    from pglast.parser import ParseError

    try:
        stmts = parse_sql(text)
    except ParseError as exc:
        loc = getattr(exc, "location", None)
        line = line_of(text, _char_offset(text, loc)) if isinstance(loc, int) else None
        raise SourceDoesNotParse(
            f"the source of {what} does not parse as PostgreSQL: {exc.args[0]}"
            + (f" (line {line})" if line else ""),
            object=what, database_error=str(exc.args[0]), line=line,
        ) from None
    if not stmts:
        raise SourceDoesNotParse(f"the source of {what} holds no statement", object=what)
    first = stmts[0]
    name = type(first.stmt).__name__
    from pglast.enums import ObjectType

    if name not in _PG_KINDS or kind not in _PG_KINDS[name] or (
            name == "DefineStmt"
            and getattr(first.stmt, "kind", None) != ObjectType.OBJECT_AGGREGATE):
        raise UnsupportedObjectType(
            f"the source of {what} is a {name}, not the definition of a {kind}",
            object=what, found=name)
    if len(stmts) > 1:
        raise _extra(what, text, _char_offset(text, stmts[1].stmt_location or 0))
    start = first.stmt_location or 0
    end = _char_offset(text, start + (first.stmt_len or len(text.encode("utf-8"))))
    return check_tail(what, text, end)


def _char_offset(text: str, byte_offset: int) -> int:
    """libpg_query counts bytes of UTF-8; Python counts characters."""
    return len(text.encode("utf-8")[:max(byte_offset, 0)].decode("utf-8", errors="ignore"))


# --- PL/SQL and MariaDB: sqlglot's tokenizer and the block structure -----------------------------


def definition_end(text: str, kind: str, dialect: str, *, plsql: bool, what: str) -> int:
    """The character offset just after the definition of an object of ``kind`` in ``text``.

    ``dialect`` is sqlglot's (``oracle``, ``mysql``); ``plsql`` is true for
    Oracle and for MariaDB in ``sql_mode=ORACLE``.
    """
    import sqlglot
    from sqlglot.errors import TokenError

    try:
        tokens = sqlglot.tokenize(text, read=dialect)
    except TokenError as exc:
        raise SourceDoesNotParse(
            f"the source of {what} does not tokenize as {dialect}: {str(exc).splitlines()[0]}",
            object=what, database_error=str(exc).splitlines()[0]) from None
    words = [t.text.upper() for t in tokens]
    types = [t.token_type.name for t in tokens]
    n = len(tokens)
    depth = 0
    opened = False
    package_like = plsql and kind in _PACKAGE_LIKE
    # PL/SQL declarations before a routine's (or trigger's) BEGIN end with ";" too
    declarations = plsql and kind in _ROUTINE_LIKE and "BEGIN" in words
    i = 0
    while i < n:
        w, tt = words[i], types[i]
        if tt == "SEMICOLON" and depth == 0:
            if declarations and not opened:
                i += 1
                continue
            return int(tokens[i].start)
        if package_like and not opened and w in ("AS", "IS"):
            depth += 1
            opened = True
        elif kind == "trigger" and plsql and not opened and w == "COMPOUND" and (
                i + 1 < n and words[i + 1] == "TRIGGER"):
            depth += 1
            opened = True
            i += 1
        elif w == "BEGIN":
            depth += 1
            opened = True
        elif w == "CASE":
            depth += 1
        elif w == "END":
            nxt = words[i + 1] if i + 1 < n else ""
            if nxt in _NEUTRAL_AFTER_END:
                i += 2
                continue
            if nxt == "CASE":
                i += 1
            depth -= 1
            if depth < 0:
                raise _extra(what, text, int(tokens[i].start))
            if depth == 0 and opened:
                last = i
                if i + 1 < n and types[i + 1] in ("VAR", "IDENTIFIER") and words[i + 1] not in (
                        "AS", "IS"):
                    last = i + 1  # END label
                return int(tokens[last].end) + 1
        i += 1
    return len(text.rstrip())


def parse_blocks(text: str, kind: str, dialect: str, *, plsql: bool, what: str) -> Definition:
    """``definition_end`` then ``check_tail``: the definition, and nothing but terminators after."""
    end = definition_end(text, kind, dialect, plsql=plsql, what=what)
    return check_tail(what, text, end)
