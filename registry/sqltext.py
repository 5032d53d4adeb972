"""The SQL-text helpers validation shares: tokens, PL/SQL blocks, a quiet sqlglot.

Kept apart so that every checking module (:mod:`registry.dialect_checks`,
:mod:`registry.sql_functions`, :mod:`registry.sql_effects`) can use them
without importing one another.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

LITERALS = frozenset({"STRING", "NATIONAL_STRING", "RAW_STRING", "BYTE_STRING", "BIT_STRING",
                       "HEX_STRING", "HEREDOC_STRING", "UNICODE_STRING", "IDENTIFIER"})
"""Token types whose text is data or a quoted name, never a keyword."""
PLSQL = re.compile(r"^\s*(BEGIN|DECLARE)\b", re.IGNORECASE)
LEADING_COMMENTS = re.compile(r"^(\s*(--[^\n]*\n|/\*.*?\*/))*", re.DOTALL)


def is_plsql_block(sql: str) -> bool:
    """An anonymous PL/SQL block (``BEGIN ... END;`` / ``DECLARE ...``), comments aside."""
    body = LEADING_COMMENTS.sub("", sql, count=1)
    if not PLSQL.match(body):
        return False
    # BEGIN; / BEGIN WORK / BEGIN TRANSACTION start a transaction (PostgreSQL, MySQL)
    return re.match(r"^\s*BEGIN\s*(;|\s*$|\s+(WORK|TRANSACTION)\b)", body, re.IGNORECASE) is None


class QuietSqlglot:
    """sqlglot logs each statement it falls back to parsing as a Command: not a finding."""

    def __enter__(self) -> None:
        self.logger = logging.getLogger("sqlglot")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)


def tokens(sql: str, grammars: Sequence[str | None]) -> list[Any] | None:
    """sqlglot's tokens of ``sql`` under the first of ``grammars`` (sqlglot dialect names;
    then sqlglot's default) that can read it; None when none can."""
    import sqlglot

    for name in [*grammars, None]:
        try:
            return list(sqlglot.Dialect.get_or_raise(name).tokenize(sql))
        except Exception:  # a TokenError: another dialect's quoting may read it
            continue
    return None
