"""capgate's own tables in a target database: installed once, never at call time.

A write records its landing marker (``capgate_landed``) and moves its fence row
(``capgate_fence``) in the target, in its own transaction.  Those tables are
created once, by an account that may create tables, with :func:`install` (CLI:
``capgate target install CONNECTOR``) -- or by a DBA running the script that
:func:`install_script` prints.  A call only checks, once per process and
connector, that they are there and readable (:func:`missing_tables`); it never
runs DDL, so the account it writes with needs no CREATE privilege (and on
MariaDB and Oracle, where DDL commits implicitly, nothing could commit a
call's work early).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.dialects import Dialect, dialect_for, normalise_url
from capgate.executor.dialects.base import TARGET_TABLES, first_line
from capgate.registry.errors import TargetNotInstalled, TargetPrivilegeMissing

__all__ = ["TARGET_TABLES", "TableState", "first_line", "install", "install_at",
           "install_script", "missing_tables", "prepare_ddl_checks_at", "refuse_missing",
           "table_states"]


@dataclass(frozen=True)
class TableState:
    """One of capgate's tables as the connector's account sees it."""

    table: str
    state: str
    """``ok``, ``missing`` or ``no_privilege``."""
    detail: str = ""


def table_states(conn: sa.Connection, dialect: Dialect) -> list[TableState]:
    """Probe each table with a query that reads nothing; classify what failed."""
    out: list[TableState] = []
    for table in TARGET_TABLES:
        try:
            conn.execute(sa.text(dialect.probe_table_sql(table))).fetchall()
            out.append(TableState(table, "ok"))
        except sa.exc.DBAPIError as exc:
            conn.rollback()  # PostgreSQL: an error aborts the rest of the transaction
            if exc.connection_invalidated:
                raise
            detail = first_line(exc)
            if dialect.is_insufficient_privilege(exc):
                out.append(TableState(table, "no_privilege", detail))
            elif dialect.is_undefined_table(exc):
                out.append(TableState(table, "missing", detail))
            else:
                raise
    conn.rollback()
    return out


def missing_tables(conn: sa.Connection, dialect: Dialect) -> list[TableState]:
    """The tables that are missing or unreadable (empty when the target is ready)."""
    return [s for s in table_states(conn, dialect) if s.state != "ok"]


def refuse_missing(connector_name: str, problems: Iterable[TableState]) -> None:
    """Raise the coded error for the first problem, naming the table and the fix."""
    for problem in problems:
        if problem.state == "no_privilege":
            raise TargetPrivilegeMissing(
                f"connector {connector_name!r}: the account may not use capgate's table "
                f"{problem.table} ({problem.detail}); grant what `capgate target install "
                f"{connector_name} --sql --grant-to USER` prints",
                connector=connector_name, table=problem.table)
        raise TargetNotInstalled(
            f"connector {connector_name!r}: capgate's table {problem.table} is not installed "
            f"in the target; run `capgate target install {connector_name}` with an account "
            f"that may create tables (or give a DBA `capgate target install {connector_name} "
            "--sql`)", connector=connector_name, table=problem.table)


def install_script(dialect: Dialect, *, grant_to: str | None = None) -> str:
    """The SQL a DBA runs once in the target: the tables, and the grants for ``grant_to``."""
    grantee = dialect.grantee(grant_to) if grant_to else None  # checked before anything
    lines = [f"-- capgate's tables in a {dialect.name} target (capgate target install)"]
    lines += [f"{ddl};" for ddl in dialect.target_ddl().values()]
    if grantee:
        lines.append(f"-- what the calling account {grantee} needs on them")
        lines += [f"{grant};" for grant in dialect.target_grants(grantee)]
    return "\n".join(lines) + "\n"


def install_at(url: str | URL, *, grant_to: str | None = None) -> list[str]:
    """:func:`install` in the database at ``url`` (a privileged account's URL)."""
    parsed = normalise_url(url)
    dialect = dialect_for(parsed)
    engine = sa.create_engine(parsed, poolclass=sa.pool.NullPool)
    dialect.prepare_engine(engine)
    try:
        return install(engine, dialect, grant_to=grant_to)
    finally:
        engine.dispose()


def prepare_ddl_checks_at(url: str | URL) -> str | None:
    """What the DDL loop's checks need in the database at ``url`` (a privileged account,
    ``capgate init``): created where the server has it; None when ready, else what a
    person must do first (see :meth:`Dialect.prepare_ddl_checks`)."""
    parsed = normalise_url(url)
    dialect = dialect_for(parsed)
    engine = sa.create_engine(parsed, poolclass=sa.pool.NullPool)
    dialect.prepare_engine(engine)
    try:
        with engine.connect() as conn:
            return dialect.prepare_ddl_checks(conn)
    finally:
        engine.dispose()


def install(engine: sa.Engine, dialect: Dialect, *, grant_to: str | None = None) -> list[str]:
    """Create the tables that do not exist yet (and grant ``grant_to``); the ones created.

    Each table is created in a transaction of its own and looked for again if
    the creation fails, so two installers racing each other both succeed.
    """
    grantee = dialect.grantee(grant_to) if grant_to else None  # refused before anything runs
    created: list[str] = []
    for table, ddl in dialect.target_ddl().items():
        with engine.connect() as conn:
            if sa.inspect(conn).has_table(table):
                continue
            try:
                conn.execute(sa.text(ddl))
                conn.commit()
                created.append(table)
            except sa.exc.DatabaseError:
                conn.rollback()
                if not sa.inspect(conn).has_table(table):
                    raise
    if grantee:
        with engine.begin() as conn:
            for grant in dialect.target_grants(grantee):
                conn.execute(sa.text(grant))
    return created
