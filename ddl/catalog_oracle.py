"""Oracle catalog adapter (python-oracledb thin mode): PL/SQL units, types, views, triggers.

Written against Oracle's documented catalog; it runs in the test suite only
when ``CAPGATE_TEST_ORACLE_DSN`` (or Docker) provides a server.

* Source: ``ALL_SOURCE`` (packages, bodies, procedures, functions, types,
  type bodies, triggers), prefixed with ``CREATE OR REPLACE``;
  ``DBMS_METADATA.GET_DDL`` for views.  Normalisation drops the owner prefix,
  ``EDITIONABLE``/``NONEDITIONABLE``/``FORCE``, quotes around an upper-case
  name and the SQL*Plus ``/`` line; the final ``;`` of a PL/SQL unit is part
  of the unit and stays.
* Compile status: ``ALL_OBJECTS.STATUS`` and ``ALL_ERRORS`` (attribute
  ``ERROR``).  A ``CREATE OR REPLACE`` that compiles with errors *succeeds*
  in Oracle; python-oracledb reports it as warning DPY-7000 on the cursor
  (``cursor.warning``), and the adapter turns it -- or an ``INVALID`` status
  after the DDL -- into ``ApplyFailed`` carrying the ``ALL_ERRORS`` lines.
* Dependents: ``ALL_DEPENDENCIES`` (local rows have no
  ``REFERENCED_LINK_NAME``); remote dependents are read from the far
  database's ``ALL_DEPENDENCIES`` rows whose ``REFERENCED_LINK_NAME`` is the
  link back to us.  Recompiles are ``ALTER ... COMPILE [BODY|SPECIFICATION]
  REUSE SETTINGS``, one object at a time.
* Callers: ``ALL_SOURCE`` lines containing the name (whole word, checked in
  Python), plus ``ALL_VIEWS.TEXT_VC`` (the first 4000 characters of a view).
* Lock: ``DBMS_LOCK.ALLOCATE_UNIQUE`` + ``DBMS_LOCK.REQUEST(..., release_on_commit
  => FALSE)``, which survives the commits DDL makes; needs ``EXECUTE`` on
  ``DBMS_LOCK``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from ddl import sqltext
from ddl.catalog import (
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
    register,
)
from ddl.errors import ApplyFailed, FeatureNotSupported, LockNotAcquired

OBJECT_TYPE = {
    "package": "PACKAGE",
    "package_body": "PACKAGE BODY",
    "type": "TYPE",
    "type_body": "TYPE BODY",
    "procedure": "PROCEDURE",
    "function": "FUNCTION",
    "view": "VIEW",
    "trigger": "TRIGGER",
}
KIND_OF_TYPE = {v: k for k, v in OBJECT_TYPE.items()}
_COMPILE = {
    "package": ("PACKAGE", "COMPILE SPECIFICATION REUSE SETTINGS"),
    "package_body": ("PACKAGE", "COMPILE BODY REUSE SETTINGS"),
    "type": ("TYPE", "COMPILE SPECIFICATION REUSE SETTINGS"),
    "type_body": ("TYPE", "COMPILE BODY REUSE SETTINGS"),
    "procedure": ("PROCEDURE", "COMPILE REUSE SETTINGS"),
    "function": ("FUNCTION", "COMPILE REUSE SETTINGS"),
    "trigger": ("TRIGGER", "COMPILE REUSE SETTINGS"),
    "view": ("VIEW", "COMPILE"),
}


def _q(name: str, what: str = "identifier") -> str:
    return sqltext.quote(name, "oracle", what)


@register
class OracleAdapter(BaseAdapter):
    dialect = "oracle"
    transactional_ddl = False
    kinds = frozenset(OBJECT_TYPE)
    fold = "upper"
    keep_semicolon = True

    # -- identity ------------------------------------------------------------------------------
    def default_schema(self, conn: Connection) -> str | None:
        return self._current_schema(conn)

    def _current_schema(self, conn: Connection) -> str:
        return str(
            conn.execute(text("SELECT SYS_CONTEXT('USERENV', 'CURRENT_SCHEMA') FROM dual"))
            .scalar_one()
        )

    def _exists(self, conn: Connection, owner: str, name: str, kind: str) -> bool:
        v = conn.execute(
            text(
                "SELECT COUNT(*) FROM all_objects WHERE owner = :p_owner "
                "AND object_name = :p_name AND object_type = :p_type"
            ),
            {"p_owner": owner, "p_name": name, "p_type": OBJECT_TYPE[kind]},
        ).scalar()
        return bool(v)

    def resolve(self, conn: Connection, ref: ObjectRef) -> ObjectRef:
        self.check_kind(ref)
        schema = ref.schema or self._current_schema(conn)
        if not self._exists(conn, schema, ref.name, ref.kind):
            upper_schema = schema.upper()
            if self._exists(conn, upper_schema, ref.name.upper(), ref.kind):
                schema, name = upper_schema, ref.name.upper()
            else:
                name = ref.name if ref.name != ref.name.lower() else ref.name.upper()
                schema = schema if schema != schema.lower() else upper_schema
        else:
            name = ref.name
        sqltext.check_identifier(schema, "oracle", "owner")
        sqltext.check_identifier(name, "oracle", "object name")
        return ObjectRef(ref.kind, name, schema, link=ref.link)

    # -- reading ---------------------------------------------------------------------------------
    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        ref = self.resolve(conn, ref)
        assert ref.schema is not None
        if not self._exists(conn, ref.schema, ref.name, ref.kind):
            return None
        if ref.kind == "view":
            ddl = conn.execute(
                text("SELECT DBMS_METADATA.GET_DDL('VIEW', :p_name, :p_owner) FROM dual"),
                {"p_name": ref.name, "p_owner": ref.schema},
            ).scalar()
            if ddl is None:
                return None
            src = ddl.read() if hasattr(ddl, "read") else str(ddl)
            return LiveObject(ref, src.strip() + "\n", {})
        lines = conn.execute(
            text(
                "SELECT text FROM all_source WHERE owner = :p_owner AND name = :p_name "
                "AND type = :p_type ORDER BY line"
            ),
            {"p_owner": ref.schema, "p_name": ref.name, "p_type": OBJECT_TYPE[ref.kind]},
        ).scalars().all()
        if not lines:
            return None
        return LiveObject(ref, "CREATE OR REPLACE " + "".join(str(t) for t in lines), {})

    def cosmetic(self, ref: ObjectRef, text_: str) -> str:
        t = sqltext.strip_terminator(text_, keep_semicolon=self.keeps_semicolon(ref))
        m = sqltext.header_match(t)
        if not m:
            return t
        kind = sqltext.KIND_WORDS.get(" ".join(m.group("kind").lower().split()))
        if kind is None:
            return t
        parts = re.findall(sqltext._Q, t[m.start("qname") : m.end("qname")])
        name, _ = sqltext.unquote(parts[-1], "upper")
        rest = t[m.end() :].lstrip(" \t\n")
        return (f"CREATE {sqltext.KIND_KEYWORD[kind]} {name}"
                + ("" if rest.startswith("(") else " ") + rest)

    def render(self, conn: Connection, ref: ObjectRef, source: str) -> str | None:
        # ALL_SOURCE keeps PL/SQL as written; GET_DDL re-renders a view (column list, quotes).
        return None if ref.kind == "view" else self.normalise(ref, source)

    # -- status ------------------------------------------------------------------------------------
    def _errors(self, conn: Connection, ref: ObjectRef) -> tuple[str, ...]:
        rows = conn.execute(
            text(
                "SELECT line, position, text FROM all_errors WHERE owner = :p_owner "
                "AND name = :p_name AND type = :p_type AND attribute = 'ERROR' ORDER BY sequence"
            ),
            {"p_owner": ref.schema, "p_name": ref.name, "p_type": OBJECT_TYPE[ref.kind]},
        ).all()
        return tuple(f"line {r[0]}, col {r[1]}: {str(r[2]).strip()}" for r in rows)

    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        ref = self.resolve(conn, ref)
        row = conn.execute(
            text(
                "SELECT status FROM all_objects WHERE owner = :p_owner AND object_name = :p_name "
                "AND object_type = :p_type"
            ),
            {"p_owner": ref.schema, "p_name": ref.name, "p_type": OBJECT_TYPE[ref.kind]},
        ).first()
        if row is None:
            return ObjectStatus(ref, MISSING, (), "ALL_OBJECTS")
        if str(row[0]).upper() == "VALID":
            return ObjectStatus(ref, VALID, (), "ALL_OBJECTS.STATUS")
        return ObjectStatus(ref, INVALID, self._errors(conn, ref), "ALL_OBJECTS.STATUS, ALL_ERRORS")

    def recompile(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        ref = self.resolve(conn, ref)
        assert ref.schema is not None
        word, clause = _COMPILE[ref.kind]
        sql = f"ALTER {word} {_q(ref.schema)}.{_q(ref.name)} {clause}"
        try:
            self._raw_execute(conn, sql)
        except _oracle_error() as exc:  # pragma: no cover - needs an Oracle server
            return ObjectStatus(ref, INVALID, (first_line(exc),), "ALTER ... COMPILE")
        return self.status(conn, ref)

    # -- dependents and callers --------------------------------------------------------------------
    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        ref = self.resolve(conn, ref)
        rows = conn.execute(
            text(
                "SELECT owner, name, type FROM all_dependencies WHERE referenced_owner = :p_owner "
                "AND referenced_name = :p_name AND referenced_type = :p_type "
                "AND referenced_link_name IS NULL ORDER BY owner, name, type"
            ),
            {"p_owner": ref.schema, "p_name": ref.name, "p_type": OBJECT_TYPE[ref.kind]},
        ).all()
        out: list[Dependent] = []
        for i, row in enumerate(rows, start=1):
            if progress is not None:
                progress(i, len(rows), f"{row[0]}.{row[1]}")
            kind = KIND_OF_TYPE.get(str(row[2]))
            if kind is None:
                continue
            dref = ObjectRef(kind, str(row[1]), str(row[0]))
            if dref.key != ref.key:
                out.append(Dependent(dref, ref, "ALL_DEPENDENCIES"))
        return out

    def remote_dependents(self, far: Connection, ref: ObjectRef, link: str) -> list[Dependent]:
        rows = far.execute(
            text(
                "SELECT owner, name, type, referenced_link_name FROM all_dependencies "
                "WHERE referenced_name = :p_name AND referenced_owner = :p_owner "
                "AND referenced_link_name IS NOT NULL AND (UPPER(referenced_link_name) = "
                "UPPER(:p_link) OR UPPER(referenced_link_name) LIKE UPPER(:p_link) || '.%') "
                "ORDER BY owner, name, type"
            ),
            {"p_name": ref.name, "p_owner": ref.schema, "p_link": link},
        ).all()
        out: list[Dependent] = []
        for row in rows:
            kind = KIND_OF_TYPE.get(str(row[2]))
            if kind is not None:
                out.append(
                    Dependent(ObjectRef(kind, str(row[1]), str(row[0]), link=link), ref,
                              "ALL_DEPENDENCIES@far side")
                )
        return out

    def search_callers(self, conn: Connection, ref: ObjectRef) -> CallerSearch:
        ref = self.resolve(conn, ref)
        scopes = list(self.scopes(ref))
        searched = int(
            conn.execute(
                text(
                    "SELECT COUNT(*) FROM (SELECT DISTINCT owner, name, type FROM all_source "
                    "WHERE owner IN :p_scopes)"
                ).bindparams(bindparam("p_scopes", expanding=True)),
                {"p_scopes": scopes},
            ).scalar()
            or 0
        )
        rows = conn.execute(
            text(
                "SELECT owner, name, type, line, text FROM all_source WHERE owner IN :p_scopes "
                "AND UPPER(text) LIKE :p_pat ORDER BY owner, name, type, line"
            ).bindparams(bindparam("p_scopes", expanding=True)),
            {"p_scopes": scopes, "p_pat": f"%{ref.name.upper()}%"},
        ).all()
        hits: list[CallerHit] = []
        for row in rows:
            kind = KIND_OF_TYPE.get(str(row[2]))
            if kind is None:
                continue
            oref = ObjectRef(kind, str(row[1]), str(row[0]))
            if oref.key == ref.key:
                continue
            if sqltext.find_word(str(row[4]), ref.name):
                hits.append(CallerHit(oref, int(row[3]), str(row[4]).strip()[:200]))
        views = conn.execute(
            text(
                "SELECT owner, view_name, text_vc FROM all_views WHERE owner IN :p_scopes "
                "ORDER BY owner, view_name"
            ).bindparams(bindparam("p_scopes", expanding=True)),
            {"p_scopes": scopes},
        ).all()
        for row in views:
            oref = ObjectRef("view", str(row[1]), str(row[0]))
            if oref.key == ref.key:
                continue
            searched += 1
            hits += [CallerHit(oref, n, t) for n, t in sqltext.find_word(str(row[2] or ""),
                                                                         ref.name)]
        return CallerSearch(
            target=ref,
            method="whole-word search of ALL_SOURCE lines and ALL_VIEWS.TEXT_VC",
            pattern=ref.name,
            scope=tuple(scopes),
            searched=searched,
            hits=tuple(hits),
            notes=("ALL_VIEWS.TEXT_VC holds the first 4000 characters of a view",),
        )

    # -- changing ----------------------------------------------------------------------------------
    def _raw_execute(self, conn: Connection, sql: str) -> Any:
        """Execute on the driver's cursor and return its ``warning`` (DPY-7000 lives there)."""
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        cur = dbapi.cursor()
        try:
            cur.execute(sql)
            return getattr(cur, "warning", None)
        finally:
            cur.close()

    def apply(
        self, conn: Connection, ref: ObjectRef, source: str, attributes: Mapping[str, str]
    ) -> None:
        ref = self.resolve(conn, ref)
        try:
            warning = self._raw_execute(conn, self.sql_source(ref, source))
        except _oracle_error() as exc:
            raise ApplyFailed(
                f"oracle refused the DDL for {ref.key}: {first_line(exc)}",
                object=ref.key,
                database_error=first_line(exc),
            ) from exc
        status = self.status(conn, ref)
        code = getattr(warning, "full_code", None)
        if code == "DPY-7000" or status.state != VALID:
            raise ApplyFailed(
                f"{ref.key} was created with compilation errors"
                + (" (DPY-7000)" if code == "DPY-7000" else ""),
                object=ref.key,
                warning=code,
                status=status.state,
                errors=list(status.errors or self._errors(conn, ref)),
            )

    def drop(self, conn: Connection, ref: ObjectRef) -> None:
        ref = self.resolve(conn, ref)
        assert ref.schema is not None
        if not self._exists(conn, ref.schema, ref.name, ref.kind):
            return
        self._raw_execute(conn, f"DROP {OBJECT_TYPE[ref.kind]} {_q(ref.schema)}.{_q(ref.name)}")

    # -- capabilities ------------------------------------------------------------------------------
    def has_packages(self, conn: Connection, *, check: bool = False) -> bool:
        return True

    # -- locks -----------------------------------------------------------------------------
    def _lock_call(self, conn: Connection, block: str, **binds: Any) -> int:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        cur = dbapi.cursor()
        try:
            result = cur.var(int)
            cur.execute(block, {**binds, "r": result})
            return int(result.getvalue())
        finally:
            cur.close()

    def acquire_lock(self, conn: Connection, name: str, timeout: float) -> bool:
        try:
            code = self._lock_call(
                conn,
                "DECLARE h VARCHAR2(128); BEGIN DBMS_LOCK.ALLOCATE_UNIQUE(:n, h); "
                ":r := DBMS_LOCK.REQUEST(h, DBMS_LOCK.X_MODE, :t, release_on_commit => FALSE); "
                "END;",
                n=name,
                t=max(0, math.ceil(timeout)),
            )
        except _oracle_error() as exc:
            raise FeatureNotSupported(
                f"DBMS_LOCK is not usable: {first_line(exc)}; grant EXECUTE ON DBMS_LOCK",
                feature="DBMS_LOCK",
            ) from exc
        if code in (0, 4):
            return True
        if code == 1:
            return False
        raise LockNotAcquired(f"DBMS_LOCK.REQUEST returned {code}", lock=name, result=code)

    def release_lock(self, conn: Connection, name: str) -> None:
        self._lock_call(
            conn,
            "DECLARE h VARCHAR2(128); BEGIN DBMS_LOCK.ALLOCATE_UNIQUE(:n, h); "
            ":r := DBMS_LOCK.RELEASE(h); END;",
            n=name,
        )


def _oracle_error() -> type[Exception]:
    try:
        import oracledb
    except ImportError:  # pragma: no cover
        return sa.exc.DBAPIError
    err: type[Exception] = oracledb.Error
    return err

