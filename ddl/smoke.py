"""What may run during verification, and what one contained run reports.

Smoke calls and the run-time checks of dependents execute code while the
change is being verified.  Whatever they do must not outlive the check: a
``COMMIT`` in the middle of verification would make the recorded outcome
(``rolled_back``) contradict the catalog.  So two lines of defence:

* **At plan time** the smoke call's SQL is refused (``SmokeNotContained``,
  CG531) unless it is one read-only statement: one ``SELECT`` / ``VALUES`` /
  ``WITH ... SELECT`` or one ``CALL``, no transaction or session control, no
  DDL, nothing that writes a table or a file.  Each adapter reads the SQL with
  its engine's parser (PostgreSQL: ``pglast``; the others: sqlglot's
  tokenizer, :func:`check_statement`).
* **At run time** each adapter contains what the statement calls
  (``BaseAdapter.run_contained``): PostgreSQL runs it as one statement over the
  extended protocol in a read-only savepoint of the verification transaction
  and checks that the transaction is still the same one afterwards; MariaDB
  runs it in a session of its own, inside a read-only XA transaction that is
  always rolled back, and reads the session's transaction counters before and
  after.  A statement that left its containment all the same is reported as
  :attr:`Ran.escaped`, and the loop escalates instead of recording a rollback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capgate.registry.errors import SmokeNotContained

#: Statements a smoke call may be.
READ_STATEMENTS = frozenset({"SELECT", "WITH", "VALUES", "CALL"})
#: Statements that write or change something (the main statement after ``WITH``).
_WRITERS = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "UPSERT"})


@dataclass(frozen=True)
class ContainedCall:
    """One statement to run contained: a smoke call or a run-time check."""

    sql: str
    binds: Mapping[str, Any] = field(default_factory=dict)
    session: Mapping[str, str] = field(default_factory=dict)
    """Session settings for the call (MariaDB ``sql_mode``, ``database``)."""


@dataclass(frozen=True)
class Ran:
    """What one contained statement did."""

    row: tuple[Any, ...] | None = None
    """Its first row (None: no row, or no result set)."""
    returned_rows: bool = False
    """Whether it produced a result set at all (a ``CALL`` may not)."""
    error: str | None = None
    """The database's error, first line (None: it ran)."""
    writes: bool = False
    """The engine refused a write: the code ran until it tried to write."""
    timed_out: bool = False
    """It ran past the check's time limit and the database stopped it."""
    escaped: str | None = None
    """It left its containment (ended or started a transaction): what showed it.  What it
    wrote may then be committed; the loop escalates."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.escaped is None


def refuse(name: str, sql: str, why: str) -> SmokeNotContained:
    """The refusal of one smoke call, naming it and what was found."""
    shown = " ".join(sql.split())
    return SmokeNotContained(
        f"smoke call {name!r} is not one read-only statement: {why}; a smoke call is one "
        "SELECT (or VALUES / WITH ... SELECT) or one CALL -- nothing was planned",
        smoke=name, sql=shown[:200], found=why)


def check_statement(name: str, sql: str, dialect: str) -> str:
    """Refuse (CG531) a smoke call that is not one read-only statement; its leading keyword.

    Read with sqlglot's tokenizer for ``dialect`` (strings, quoted identifiers
    and comments are tokens of their own, so a ``;`` or a keyword inside them
    does not count).  One statement; it starts with ``SELECT``, ``WITH``,
    ``VALUES`` or ``CALL``; after ``WITH`` the main statement is a ``SELECT``;
    no ``INTO OUTFILE`` / ``INTO DUMPFILE``.
    """
    import sqlglot
    from sqlglot.errors import TokenError

    try:
        tokens = sqlglot.tokenize(sql, read=dialect)
    except TokenError as exc:
        raise refuse(name, sql, f"it does not tokenize ({str(exc).splitlines()[0]})") from None
    words = [t.text.upper() for t in tokens]
    types = [t.token_type.name for t in tokens]
    if not tokens:
        raise refuse(name, sql, "it is empty")
    for i, tt in enumerate(types):
        if tt == "SEMICOLON" and any(t != "SEMICOLON" for t in types[i + 1:]):
            raise refuse(name, sql, "it holds more than one statement")
    lead = words[0]
    if lead not in READ_STATEMENTS:
        raise refuse(name, sql, f"it is a {lead} statement")
    depth = 0
    main: str | None = None if lead == "WITH" else lead
    for i, (w, tt) in enumerate(zip(words, types, strict=True)):
        if tt == "L_PAREN":
            depth += 1
        elif tt == "R_PAREN":
            depth -= 1
        elif w == "INTO" and i + 1 < len(words) and words[i + 1] in ("OUTFILE", "DUMPFILE"):
            raise refuse(name, sql, f"it writes a file (INTO {words[i + 1]})")
        elif depth == 0 and main is None and i > 0 and w in _WRITERS | {"SELECT"}:
            main = w
    if main is None or main in _WRITERS:
        raise refuse(name, sql, f"its main statement is {main or 'missing'}, not a SELECT")
    return lead
