"""What a case id or an identity may be: a short line of printable text.

Both are chosen by the caller -- an agent, a script -- and then shown to the
people who review what happened: ``capgate cases``, ``ledger show``, error
messages, the case page.  A newline in a case id would print a second, forged
row in a listing; a right-to-left override would reorder what a DBA reads; a
100,000-character id would fill every message that names it.  So a name is
at most :data:`NAME_LIMIT` characters, not blank, and holds no control,
format, separator-line or surrogate code point (Unicode categories Cc, Cf, Zl,
Zp, Cs).
"""

from __future__ import annotations

import unicodedata

NAME_LIMIT = 200
"""The most characters of a case id or an identity (the MCP ``_meta`` case included)."""

_REFUSED = {"Cc": "a control character", "Cf": "an invisible formatting character",
            "Zl": "a line separator", "Zp": "a paragraph separator",
            "Cs": "a lone surrogate"}


def name_problem(value: object) -> str | None:
    """Why ``value`` cannot be a case id or an identity; None when it can."""
    if not isinstance(value, str):
        return f"must be text, not {type(value).__name__}"
    if not value.strip():
        return "must not be empty or blank"
    if len(value) > NAME_LIMIT:
        return f"is {len(value)} characters; at most {NAME_LIMIT}"
    for at, char in enumerate(value):
        if char.isprintable() and char.isascii():
            continue
        what = _REFUSED.get(unicodedata.category(char))
        if what is not None:
            return f"holds {what} (U+{ord(char):04X}) at character {at + 1}"
    return None
