"""SQLite catalog adapter (for the demo): views and triggers from ``sqlite_master``.

* Source: ``sqlite_master.sql``, which SQLite keeps as written apart from its
  own normalisations (``TEMP``, ``IF NOT EXISTS`` and the schema name are
  removed, spaces after the first two keywords collapsed); the normalised
  source therefore predicts the stored text.
* SQLite has no ``CREATE OR REPLACE``: an apply is ``DROP ... IF EXISTS`` plus
  ``CREATE`` inside one ``BEGIN IMMEDIATE`` transaction (DDL is
  transactional), which also serialises writers -- there is no separate
  session lock.
* Status: a view is valid if ``SELECT * FROM view LIMIT 0`` prepares; a
  trigger if its table exists (its body is checked when it fires).
* Dependents and callers: whole-word search of the other objects' SQL.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, text
from sqlalchemy.engine import URL, Connection, Engine

from capgate.ddl import sqltext
from capgate.ddl.catalog import (
    INVALID,
    MISSING,
    VALID,
    BaseAdapter,
    CallerHit,
    CallerSearch,
    Dependent,
    LiveObject,
    ObjectRef,
    ObjectStatus,
    Progress,
    first_line,
)
from capgate.registry.errors import FeatureNotSupported


def _q(name: str) -> str:
    return SqliteAdapter.quote(name)


class SqliteAdapter(BaseAdapter, name="sqlite"):
    plain_identifier = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,127}$")
    transactional_ddl = True
    apply_replaces_existing = True  # no OR REPLACE here: the apply drops, then creates
    kinds = frozenset({"view", "trigger"})

    def engine(self, url: str | URL, **options: Any) -> Engine:
        eng = sa.create_engine(url, poolclass=sa.pool.NullPool, **options)

        @event.listens_for(eng, "connect")
        def _autocommit_driver(dbapi_conn: Any, record: Any) -> None:
            # Let SQLAlchemy's BEGIN below decide where transactions start (DDL included).
            dbapi_conn.isolation_level = None

        @event.listens_for(eng, "begin")
        def _begin(conn: Connection) -> None:
            conn.exec_driver_sql(conn.get_execution_options().get("sqlite_begin", "BEGIN"))

        return eng

    def begin(self, conn: Connection) -> None:
        conn.execution_options(sqlite_begin="BEGIN IMMEDIATE")

    def has_session_lock(self, *, check: bool = False) -> bool:
        if check:
            raise FeatureNotSupported(
                "SQLite has no session-scoped named lock; the apply's BEGIN IMMEDIATE "
                "serialises writers instead",
                feature="session lock",
                found="none",
                needed="a named lock that survives DDL commits",
            )
        return False

    def lock_session(self, engine: Engine) -> Connection:
        return engine.connect()  # no lock is taken on it (see acquire_lock)

    def acquire_lock(self, conn: Connection, name: str, timeout: float) -> bool:
        return True  # the apply's BEGIN IMMEDIATE serialises writers

    def release_lock(self, conn: Connection, name: str) -> None:
        return None

    # -- identity and reading -------------------------------------------------------------------
    def resolve(self, conn: Connection, ref: ObjectRef) -> ObjectRef:
        self.check_kind(ref)
        self.check_identifier(ref.name, "object name")
        stored = conn.execute(
            text("SELECT name FROM sqlite_master WHERE type = :t AND name = :n COLLATE NOCASE"),
            {"t": ref.kind, "n": ref.name},
        ).scalar()
        return ObjectRef(ref.kind, str(stored or ref.name), "main")

    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        ref = self.resolve(conn, ref)
        row = conn.execute(
            text("SELECT sql, tbl_name FROM sqlite_master WHERE type = :t AND name = :n"),
            {"t": ref.kind, "n": ref.name},
        ).first()
        if row is None:
            return None
        attrs = {"table": str(row[1])} if ref.kind == "trigger" else {}
        return LiveObject(ref, str(row[0]) + "\n", attrs)

    def cosmetic(self, ref: ObjectRef, text_: str) -> str:
        t = sqltext.strip_terminator(text_)
        m = sqltext.header_match(t)
        if not m:
            return t
        kind = sqltext.KIND_WORDS.get(" ".join(m.group("kind").lower().split()))
        if kind is None:
            return t
        parts = re.findall(sqltext._Q, t[m.start("qname") : m.end("qname")])
        name, _ = sqltext.unquote(parts[-1], None)
        return f"CREATE {sqltext.KIND_KEYWORD[kind]} {name} " + t[m.end() :].lstrip(" \t\n")

    # -- status ---------------------------------------------------------------------------------
    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        ref = self.resolve(conn, ref)
        live = self.read(conn, ref)
        if live is None:
            return ObjectStatus(ref, MISSING, (), "sqlite_master")
        if ref.kind == "view":
            try:
                conn.execute(text(f"SELECT * FROM {_q(ref.name)} LIMIT 0")).all()
            except sa.exc.DBAPIError as exc:
                return ObjectStatus(ref, INVALID, (first_line(exc.orig),), "SELECT ... LIMIT 0")
            return ObjectStatus(ref, VALID, (), "SELECT ... LIMIT 0")
        table = live.attributes.get("table", "")
        exists = conn.execute(
            text("SELECT COUNT(*) FROM sqlite_master WHERE type IN ('table', 'view') "
                 "AND name = :n"),
            {"n": table},
        ).scalar()
        if not exists:
            return ObjectStatus(ref, INVALID, (f"table {table} is missing",), "sqlite_master")
        return ObjectStatus(ref, VALID, (), "table present (the body is checked when it fires)")

    def recompile(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        return self.status(conn, ref)

    sqlglot_dialect = "sqlite"

    @contextmanager
    def read_only(self, conn: Connection) -> Iterator[None]:
        """``PRAGMA query_only`` in a savepoint: SQLite refuses every write meanwhile."""
        with conn.begin_nested() as sp:
            conn.exec_driver_sql("PRAGMA query_only = ON")
            try:
                yield
            finally:
                conn.exec_driver_sql("PRAGMA query_only = OFF")
                if sp.is_active:
                    sp.rollback()

    def has_compile_status(self, conn: Connection, *, check: bool = False) -> bool:
        return True

    # -- dependents and callers ---------------------------------------------------------------
    def search_callers(self, conn: Connection, ref: ObjectRef) -> CallerSearch:
        ref = self.resolve(conn, ref)
        rows = conn.execute(
            text(
                "SELECT type, name, sql FROM sqlite_master WHERE type IN ('view', 'trigger') "
                "ORDER BY type, name"
            )
        ).all()
        hits: list[CallerHit] = []
        searched = 0
        for row in rows:
            oref = ObjectRef(str(row[0]), str(row[1]), "main")
            if oref.key == ref.key:
                continue
            searched += 1
            hits += [CallerHit(oref, n, t) for n, t in sqltext.find_word(str(row[2]), ref.name)]
        return CallerSearch(ref, "whole-word search of sqlite_master.sql", ref.name, ("main",),
                            searched, tuple(hits))

    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        search = self.search_callers(conn, ref)
        objs = sorted({h.object for h in search.hits})
        out = []
        for i, obj in enumerate(objs, start=1):
            if progress is not None:
                progress(i, len(objs), obj.key)
            out.append(Dependent(obj, search.target, "source search"))
        return out

    # -- changing -----------------------------------------------------------------------------
    def apply(
        self, conn: Connection, ref: ObjectRef, source: str, attributes: Mapping[str, str]
    ) -> None:
        ref = self.resolve(conn, ref)
        body = re.sub(r"^\s*CREATE\s+OR\s+REPLACE\s+", "CREATE ", self.sql_source(ref, source),
                      count=1, flags=re.IGNORECASE)
        conn.execute(text(f"DROP {ref.kind.upper()} IF EXISTS {_q(ref.name)}"))
        self.execute_ddl(conn, ref, body)

    def drop(self, conn: Connection, ref: ObjectRef) -> None:
        ref = self.resolve(conn, ref)
        conn.execute(text(f"DROP {ref.kind.upper()} IF EXISTS {_q(ref.name)}"))
