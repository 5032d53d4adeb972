"""Small, dialect-aware helpers over SQL and PL/SQL text.

Nothing here parses SQL fully; these helpers find a ``CREATE`` header, mask
comments and string literals, validate and quote identifiers, and list the
package-level declarations that make a package stateful.  They are shared by
the catalog adapters and the loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from capgate.registry.errors import InvalidObjectName, UnsupportedObjectType

# --- identifiers ----------------------------------------------------------------
# (each dialect's rule is its catalog adapter's: ``BaseAdapter.plain_identifier``)


def check_identifier(name: str, pattern: re.Pattern[str], dialect: str,
                     what: str = "identifier") -> str:
    """Return ``name`` if it matches ``dialect``'s plain-identifier ``pattern``; else raise
    InvalidObjectName.

    Only names that pass are ever interpolated into SQL text; values always
    travel as binds.
    """
    if not isinstance(name, str) or not pattern.match(name):
        raise InvalidObjectName(
            f"{what} {name!r} is not a plain {dialect} identifier; expected letters, digits "
            "and _ (no quotes, spaces or dots)",
            name=name,
            dialect=dialect,
        )
    return name


# --- comments and strings -----------------------------------------------------------

_MASK_RE = re.compile(
    r"--[^\n]*"  # line comment
    r"|/\*.*?\*/"  # block comment
    r"|'(?:[^']|'')*'"  # string literal
    r"|\$(?P<tag>[A-Za-z_]*)\$.*?\$(?P=tag)\$",  # PostgreSQL dollar quote
    re.DOTALL,
)


def mask(text: str, *, strings: bool = True, dollar: bool = False) -> str:
    """Replace comments (and string literals) with spaces, keeping offsets and newlines.

    ``dollar=True`` masks PostgreSQL dollar-quoted bodies as well.
    """

    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        if s.startswith("'") and not strings:
            return s
        if s.startswith("$") and not dollar:
            return s
        return "".join("\n" if c == "\n" else " " for c in s)

    return _MASK_RE.sub(blank, text)


# --- CREATE headers ---------------------------------------------------------------------

_Q = r'(?:"[^"]+"|`[^`]+`|\[[^\]]+\]|[A-Za-z0-9_$#]+)'
_DEFINER_PART = r"(?:`[^`]*`|\"[^\"]*\"|'[^']*'|[\w.%$-]+)"
_DEFINER = (
    rf"DEFINER\s*=\s*(?:CURRENT_USER(?:\s*\(\s*\))?|{_DEFINER_PART}(?:\s*@\s*{_DEFINER_PART})?)"
)
_MODIFIER = (
    r"(?:EDITIONABLE|NONEDITIONABLE|EDITIONING|FORCE|NO\s+FORCE|TEMP|TEMPORARY|"
    r"ALGORITHM\s*=\s*\w+|" + _DEFINER + r"|SQL\s+SECURITY\s+\w+|AGGREGATE|CONSTRAINT|RECURSIVE)"
)
HEADER_RE = re.compile(
    r"^\s*CREATE\s+(?P<replace>OR\s+REPLACE\s+)?"
    rf"(?P<mods>(?:{_MODIFIER}\s+)*)"
    r"(?P<kind>PACKAGE\s+BODY|TYPE\s+BODY|PACKAGE|TYPE|PROCEDURE|FUNCTION|"
    r"MATERIALIZED\s+VIEW|VIEW|TRIGGER|TABLE|INDEX|SEQUENCE|SYNONYM)\s+"
    r"(?P<ine>IF\s+NOT\s+EXISTS\s+)?"
    rf"(?P<qname>{_Q}(?:\s*\.\s*{_Q})?)",
    re.IGNORECASE,
)
DEFINER_RE = re.compile(_DEFINER + r"\s+", re.IGNORECASE)

KIND_WORDS = {
    "package body": "package_body",
    "type body": "type_body",
    "package": "package",
    "type": "type",
    "procedure": "procedure",
    "function": "function",
    "view": "view",
    "trigger": "trigger",
}
KIND_KEYWORD = {v: k.upper() for k, v in KIND_WORDS.items()}


@dataclass(frozen=True)
class Header:
    """What a ``CREATE`` statement's header says."""

    kind: str
    schema: str | None
    name: str
    start: int
    """Offset of ``CREATE`` in the text."""
    end: int
    """Offset just after the object name."""
    name_quoted: bool


def unquote(ident: str, fold: str | None) -> tuple[str, bool]:
    """Strip identifier quotes; fold a bare identifier to ``upper``/``lower`` case if asked."""
    ident = ident.strip()
    if ident[:1] in ('"', "`", "["):
        return ident[1:-1], True
    if fold == "upper":
        return ident.upper(), False
    if fold == "lower":
        return ident.lower(), False
    return ident, False


def parse_header(text: str, fold: str | None = None) -> Header:
    """Find the ``CREATE ... KIND [schema.]name`` header of a DDL statement.

    Raise UnsupportedObjectType if the statement is not a CREATE of a
    stored-code object this package knows.
    """
    masked = mask(text, strings=False)
    m = HEADER_RE.match(masked)
    if not m:
        raise UnsupportedObjectType(
            "the source does not start with CREATE [OR REPLACE] PACKAGE|PACKAGE BODY|PROCEDURE|"
            "FUNCTION|VIEW|TRIGGER|TYPE <name>",
            found=masked.strip()[:80],
        )
    kind_words = " ".join(m.group("kind").lower().split())
    kind = KIND_WORDS.get(kind_words)
    if kind is None:
        raise UnsupportedObjectType(
            f"{kind_words} is not a stored-code object the DDL loop handles",
            kind=kind_words,
            supported=sorted(KIND_WORDS.values()),
        )
    qname = text[m.start("qname") : m.end("qname")]
    parts = re.findall(_Q, qname)
    schema: str | None = None
    if len(parts) == 2:
        schema, _ = unquote(parts[0], fold)
        name, quoted = unquote(parts[1], fold)
    else:
        name, quoted = unquote(parts[0], fold)
    create_at = len(masked) - len(masked.lstrip())
    return Header(kind, schema, name, create_at, m.end("qname"), quoted)


HEADER_WINDOW = 65536
"""How much of a source's start is scanned for its CREATE header (comments included)."""


def header_match(text: str) -> re.Match[str] | None:
    """Match HEADER_RE against the masked start of ``text`` (offsets are ``text``'s own)."""
    return HEADER_RE.match(mask(text[:HEADER_WINDOW], strings=False))


def strip_terminator(text: str, *, keep_semicolon: bool = False) -> str:
    """Drop what a script adds after a statement: a ``/`` line, ``//`` or ``$$`` delimiters, ``;``.

    ``keep_semicolon=True`` (Oracle PL/SQL) keeps a final ``;``, which is part
    of the unit there, and drops only the SQL*Plus ``/`` line.
    """
    t = text.rstrip()
    changed = True
    while changed:
        changed = False
        for end in ("\n/", "//", "$$") if keep_semicolon else ("\n/", "//", "$$", ";"):
            if t.endswith(end) and not (end == "$$" and t.count("$$") % 2 == 0):
                t = t[: -len(end)].rstrip()
                changed = True
    return t


# --- package state ----------------------------------------------------------------------------

_STOP_WORDS = {"FUNCTION", "PROCEDURE", "BEGIN", "END"}
_NOT_STATE_FIRST = {"TYPE", "SUBTYPE", "PRAGMA", "FUNCTION", "PROCEDURE"}


def package_state(source: str) -> list[str]:
    """Package-level variables, constants and cursors declared in a package spec or body.

    Their values are the package's state; replacing the package discards it in
    every session that holds it (Oracle ORA-04068, MariaDB likewise re-reads
    the package).  Returns one short description per declaration.
    """
    masked = mask(source)
    m = re.search(r"\b(AS|IS)\b", masked[_header_end(masked) :], re.IGNORECASE)
    if not m:
        return []
    pos = _header_end(masked) + m.end()
    found: list[str] = []
    for stmt in masked[pos:].split(";"):
        words = stmt.split()
        if not words:
            continue
        first = words[0].upper()
        if first in _STOP_WORDS:
            break
        if first in _NOT_STATE_FIRST:
            continue
        second = words[1].upper() if len(words) > 1 else ""
        if second == "EXCEPTION":
            continue
        what = "cursor" if first == "CURSOR" else "constant" if second == "CONSTANT" else "variable"
        found.append(f"{what}: {' '.join(words)[:120]}")
    return found


def _header_end(masked: str) -> int:
    m = HEADER_RE.match(masked)
    return m.end() if m else 0


def find_word(text: str, word: str) -> list[tuple[int, str]]:
    """Lines (1-based number, stripped text) where ``word`` occurs as a whole word (any case)."""
    pattern = re.compile(rf"(?<![A-Za-z0-9_$#]){re.escape(word)}(?![A-Za-z0-9_$#])", re.IGNORECASE)
    hits: list[tuple[int, str]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if pattern.search(line):
            hits.append((number, line.strip()[:200]))
    return hits


SCHEMA_WIDE_RE = re.compile(
    r"\b(DBMS_UTILITY\s*\.\s*COMPILE_SCHEMA|UTL_RECOMP\s*\.|RECOMPILE_SCHEMA|"
    r"DBMS_DDL\s*\.\s*ALTER_COMPILE_SCHEMA|mysqlcheck)\b",
    re.IGNORECASE,
)


def schema_wide_recompile_in(text: str) -> str | None:
    """The schema-wide recompile call ``text`` contains, if any."""
    m = SCHEMA_WIDE_RE.search(text)
    return m.group(0) if m else None
