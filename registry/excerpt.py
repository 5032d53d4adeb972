"""Bounded excerpts: no error, reply or record echoes a huge value whole.

A refusal that repeated the offending input (a 2.6 MB body, four times over)
made an MCP reply exceed a client's message limit; a ledger record that kept
it grew the store without bound.  Everything capgate says about a value it
did not write itself goes through these two functions, which keep the start
of the value and say how long it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TEXT_LIMIT = 200
"""Characters of a value quoted in a message."""
VALUE_LIMIT = 1000
"""Characters of a string kept in a structured detail, an evidence value or a record."""
ITEMS_LIMIT = 100
"""Items of a list kept in a structured detail."""


def excerpt(value: Any, limit: int = TEXT_LIMIT) -> str:
    """``repr``-like text of ``value``, cut at ``limit`` characters with its full length."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(text) if isinstance(value, str) else text
    shown = text[:limit]
    if isinstance(value, str):
        return f"{shown!r}... ({len(text)} characters)"
    return f"{shown}... ({len(text)} characters)"


def cut(text: str, limit: int = VALUE_LIMIT) -> str:
    """``text`` itself when short, else its start and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def bounded(data: Any, limit: int = VALUE_LIMIT, depth: int = 0) -> Any:
    """JSON-like ``data`` with long strings cut and long lists shortened (a copy)."""
    if isinstance(data, str):
        return cut(data, limit)
    if depth > 32:
        return cut(repr(data), limit)
    if isinstance(data, Mapping):
        return {str(k)[:limit]: bounded(v, limit, depth + 1) for k, v in data.items()}
    if isinstance(data, list | tuple):
        items = [bounded(v, limit, depth + 1) for v in list(data)[:ITEMS_LIMIT]]
        if len(data) > ITEMS_LIMIT:
            items.append(f"... ({len(data)} items)")
        return items
    return data
