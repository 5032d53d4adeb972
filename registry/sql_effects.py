"""What a row's write statements do to existing data, read from the statements themselves.

An MCP client shows ``destructiveHint`` to a person deciding whether to let an
agent call a tool: it must not understate.  The effect class says how a failure
is undone, not what the SQL does -- a ``transactional`` row may well DELETE.
So the hint is derived from the parsed statements too: a row whose statements
(and leased SQL steps) only INSERT new rows is not destructive; one that
UPDATEs, DELETEs, MERGEs, upserts (``ON CONFLICT DO UPDATE``, ``ON DUPLICATE KEY
UPDATE``, ``REPLACE``) or runs DDL is -- as is every ``irreversible`` or
``ddl`` row, and any statement that cannot be read (it is assumed to destroy).
"""

from __future__ import annotations

import functools
import re

from capgate.registry.model import EffectClass, Row

__all__ = ["destructive", "statement_kind"]

_GRAMMARS = (None, "postgres", "mysql", "oracle", "sqlite")
_REPLACE = re.compile(r"^\s*(/\*.*?\*/\s*|--[^\n]*\n\s*)*REPLACE\b", re.IGNORECASE | re.DOTALL)


@functools.lru_cache(maxsize=8192)
def statement_kind(sql: str) -> str:
    """``insert``, ``upsert``, ``update``, ``delete``, ``merge``, ``ddl``, ``read`` or
    ``unknown`` (nothing could parse it) for one SQL text."""
    import sqlglot
    from sqlglot import exp

    from capgate.registry.sqltext import QuietSqlglot

    if _REPLACE.match(sql):
        return "upsert"  # MariaDB's REPLACE deletes the row it replaces
    for grammar in _GRAMMARS:
        try:
            with QuietSqlglot():
                trees = [t for t in sqlglot.parse(sql, read=grammar) if t is not None]
        except (sqlglot.errors.SqlglotError, RecursionError):
            continue
        kinds = set()
        for tree in trees:
            for node in tree.walk():
                if isinstance(node, exp.Merge):
                    kinds.add("merge")
                elif isinstance(node, exp.Update):
                    kinds.add("update")
                elif isinstance(node, exp.Delete):
                    kinds.add("delete")
                elif isinstance(node, exp.Create | exp.Drop | exp.Alter | exp.TruncateTable):
                    kinds.add("ddl")
                elif isinstance(node, exp.Insert):
                    conflict = node.args.get("conflict")
                    upsert = conflict is not None and (
                        conflict.args.get("duplicate") or conflict.args.get("expressions")
                        or "UPDATE" in conflict.sql().upper())
                    kinds.add("upsert" if upsert or node.args.get("overwrite") else "insert")
                elif isinstance(node, exp.Command):
                    kinds.add("unknown")
            if not kinds and not isinstance(tree, exp.Query):
                kinds.add("unknown")  # a block, a CALL: what it does is not in the text
        for kind in ("ddl", "merge", "delete", "update", "upsert", "unknown", "insert"):
            if kind in kinds:
                return kind
        return "read"
    return "unknown"


def destructive(row: Row) -> bool:
    """Whether calling ``row`` may change or remove data that was there before."""
    if row.effect_class in (EffectClass.IRREVERSIBLE, EffectClass.DDL):
        return True
    if row.effect_class is EffectClass.READ:
        return False
    texts = [s.sql for s in row.statements] + [s.sql for s in row.steps if s.sql]
    return any(statement_kind(sql) not in ("insert", "read") for sql in texts)
