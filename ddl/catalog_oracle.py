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
* Snapshots keep what the source text alone does not say: ``EDITIONABLE`` /
  ``NONEDITIONABLE`` (``ALL_OBJECTS.EDITIONABLE``, written into the source), a
  trigger's enabled state (``ALL_TRIGGERS.STATUS``) and the PL/SQL compiler
  settings (``ALL_PLSQL_OBJECT_SETTINGS``); all are in the signature (recipe
  v2), and an apply or compensation recompiles with the snapshot's settings
  (``ALTER ... COMPILE <settings> REUSE SETTINGS``) and disables a trigger that
  was disabled.
* The dependent sweep reads every dependent's status in one pass and
  recompiles only the invalid ones, in dependency order (a dependent before
  what depends on it), one ``ALTER ... COMPILE`` each -- recompiling a valid
  object invalidates its own dependents and discards package state.
* DDL waits for library-cache locks at most the row's ``lock_seconds``
  (``ALTER SESSION SET ddl_lock_timeout``).  Smoke calls run after ``SET
  TRANSACTION READ ONLY``.

The SQL text sent by this module is kept in ``SQL`` so that an offline test
parses every statement with sqlglot's Oracle dialect.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import sqlalchemy as sa
from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

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
from capgate.registry.errors import (
    ApplyFailed,
    FeatureNotSupported,
    InvalidObjectName,
    LockNotAcquired,
)

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
    return OracleAdapter.quote(name, what)


SQL = {
    "current_schema": "SELECT SYS_CONTEXT('USERENV', 'CURRENT_SCHEMA') FROM dual",
    "exists": "SELECT COUNT(*) FROM all_objects WHERE owner = :p_owner "
              "AND object_name = :p_name AND object_type = :p_type",
    "view_ddl": "SELECT DBMS_METADATA.GET_DDL('VIEW', :p_name, :p_owner) FROM dual",
    "source": "SELECT text FROM all_source WHERE owner = :p_owner AND name = :p_name "
              "AND type = :p_type ORDER BY line",
    "editionable": "SELECT editionable FROM all_objects WHERE owner = :p_owner "
                   "AND object_name = :p_name AND object_type = :p_type",
    "trigger_status": "SELECT status FROM all_triggers WHERE owner = :p_owner "
                      "AND trigger_name = :p_name",
    "settings": "SELECT plsql_optimize_level, plsql_code_type, plsql_warnings, "
                "nls_length_semantics, plsql_ccflags, plscope_settings "
                "FROM all_plsql_object_settings WHERE owner = :p_owner AND name = :p_name "
                "AND type = :p_type",
    "errors": "SELECT line, position, text FROM all_errors WHERE owner = :p_owner "
              "AND name = :p_name AND type = :p_type AND attribute = 'ERROR' ORDER BY sequence",
    "status": "SELECT status FROM all_objects WHERE owner = :p_owner AND object_name = :p_name "
              "AND object_type = :p_type",
    "dependents": "SELECT owner, name, type FROM all_dependencies "
                  "WHERE referenced_owner = :p_owner AND referenced_name = :p_name "
                  "AND referenced_type = :p_type AND referenced_link_name IS NULL "
                  "ORDER BY owner, name, type",
    "edges": "SELECT owner, name, type, referenced_owner, referenced_name, referenced_type "
             "FROM all_dependencies WHERE owner = :p_owner AND referenced_owner = :p_owner "
             "AND referenced_link_name IS NULL",
    "remote_dependents": "SELECT owner, name, type, referenced_link_name FROM all_dependencies "
                         "WHERE referenced_name = :p_name AND referenced_owner = :p_owner "
                         "AND referenced_link_name IS NOT NULL AND (UPPER(referenced_link_name) "
                         "= UPPER(:p_link) OR UPPER(referenced_link_name) LIKE "
                         "UPPER(:p_link) || '.%') ORDER BY owner, name, type",
    "searched": "SELECT COUNT(*) FROM (SELECT DISTINCT owner, name, type FROM all_source "
                "WHERE owner IN :p_scopes)",
    "callers": "SELECT owner, name, type, line, text FROM all_source WHERE owner IN :p_scopes "
               "AND UPPER(text) LIKE :p_pat ORDER BY owner, name, type, line",
    "views": "SELECT owner, view_name, text_vc FROM all_views WHERE owner IN :p_scopes "
             "ORDER BY owner, view_name",
    "ddl_lock_timeout": "ALTER SESSION SET ddl_lock_timeout = {seconds}",
    "read_only": "SET TRANSACTION READ ONLY",
}
"""Every SQL statement this adapter sends (PL/SQL blocks for DBMS_LOCK aside), by name."""

_SETTING_NAMES = ("plsql_optimize_level", "plsql_code_type", "plsql_warnings",
                  "nls_length_semantics", "plsql_ccflags", "plscope_settings")
_PLSQL_KINDS = frozenset({"package", "package_body", "type", "type_body", "procedure",
                          "function", "trigger"})
_CODE_TYPES = frozenset({"INTERPRETED", "NATIVE"})
_LENGTH_SEMANTICS = frozenset({"BYTE", "CHAR"})


def compile_settings_clause(attributes: Mapping[str, str]) -> str:
    """``PLSQL_OPTIMIZE_LEVEL = 2 PLSQL_CODE_TYPE = INTERPRETED ...`` from a snapshot's attributes.

    Values come from the catalog, but are validated before they reach DDL text:
    the level is an integer 0-3, the code type and length semantics are from
    their fixed sets, and the free-text settings are quoted literals.
    """
    parts: list[str] = []
    level = attributes.get("plsql_optimize_level")
    if level:
        if not re.fullmatch(r"[0-3]", level):
            raise InvalidObjectName(f"plsql_optimize_level {level!r} is not 0-3")
        parts.append(f"PLSQL_OPTIMIZE_LEVEL = {level}")
    code = (attributes.get("plsql_code_type") or "").upper()
    if code:
        if code not in _CODE_TYPES:
            raise InvalidObjectName(f"plsql_code_type {code!r} is not INTERPRETED or NATIVE")
        parts.append(f"PLSQL_CODE_TYPE = {code}")
    sem = (attributes.get("nls_length_semantics") or "").upper()
    if sem:
        if sem not in _LENGTH_SEMANTICS:
            raise InvalidObjectName(f"nls_length_semantics {sem!r} is not BYTE or CHAR")
        parts.append(f"NLS_LENGTH_SEMANTICS = {sem}")
    for name in ("plsql_warnings", "plsql_ccflags", "plscope_settings"):
        value = attributes.get(name)
        if value:
            parts.append(f"{name.upper()} = '" + value.replace("'", "''") + "'")
    return " ".join(parts)


_INVOKER_RIGHTS = re.compile(r"\bAUTHID\s+CURRENT_USER\b", re.IGNORECASE)


def _invoker_rights(source: str) -> bool:
    """Whether a PL/SQL unit's source declares invoker's rights (``AUTHID CURRENT_USER``)."""
    return _INVOKER_RIGHTS.search(sqltext.mask(source, strings=True)) is not None


class OracleAdapter(BaseAdapter, name="oracle"):
    plain_identifier = re.compile(r"^[A-Za-z][A-Za-z0-9_$#]{0,127}$")
    transactional_ddl = False
    kinds = frozenset(OBJECT_TYPE)
    fold = "upper"
    keep_semicolon = True
    sqlglot_dialect = "oracle"

    def plsql(self, attributes: Mapping[str, str]) -> bool:
        return True

    def privilege_changes(self, ref: ObjectRef, base: str | None, new: str) -> list[str]:
        """``AUTHID CURRENT_USER`` dropped: the unit starts running with its owner's rights.

        Oracle's default is definer's rights (``AUTHID DEFINER``), so a spec or a
        standalone subprogram replaced without the clause runs every caller's
        calls with the owner's privileges.  (A new unit with definer's rights is
        Oracle's default and not news; bodies take the spec's.)
        """
        if base is None or ref.kind not in ("package", "type", "procedure", "function"):
            return []
        if _invoker_rights(base) and not _invoker_rights(new):
            return [f"{ref.key}: the new source runs with its owner's rights (definer's "
                    "rights, Oracle's default when AUTHID is left out), where the live one "
                    "runs with its caller's (AUTHID CURRENT_USER): every user that may "
                    "execute it acts with the owner's privileges inside it"]
        return []

    # -- identity ------------------------------------------------------------------------------
    def default_schema(self, conn: Connection) -> str | None:
        return self._current_schema(conn)

    def _current_schema(self, conn: Connection) -> str:
        return str(conn.execute(text(SQL["current_schema"])).scalar_one())

    def _exists(self, conn: Connection, owner: str, name: str, kind: str) -> bool:
        v = conn.execute(
            text(SQL["exists"]),
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
        self.check_identifier(schema, "owner")
        self.check_identifier(name, "object name")
        return ObjectRef(ref.kind, name, schema, link=ref.link)

    # -- reading ---------------------------------------------------------------------------------
    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        ref = self.resolve(conn, ref)
        assert ref.schema is not None
        if not self._exists(conn, ref.schema, ref.name, ref.kind):
            return None
        if ref.kind == "view":
            ddl = conn.execute(
                text(SQL["view_ddl"]),
                {"p_name": ref.name, "p_owner": ref.schema},
            ).scalar()
            if ddl is None:
                return None
            src = ddl.read() if hasattr(ddl, "read") else str(ddl)
            return LiveObject(ref, src.strip() + "\n", {})
        binds = {"p_owner": ref.schema, "p_name": ref.name, "p_type": OBJECT_TYPE[ref.kind]}
        lines = conn.execute(text(SQL["source"]), binds).scalars().all()
        if not lines:
            return None
        attributes = self._attributes(conn, ref)
        word = {"Y": "EDITIONABLE ", "N": "NONEDITIONABLE "}.get(
            attributes.get("editionable", ""), "")
        return LiveObject(ref, f"CREATE OR REPLACE {word}" + "".join(str(t) for t in lines),
                          attributes)

    def _attributes(self, conn: Connection, ref: ObjectRef) -> dict[str, str]:
        """Editionability, a trigger's enabled state and the PL/SQL compiler settings."""
        binds = {"p_owner": ref.schema, "p_name": ref.name, "p_type": OBJECT_TYPE[ref.kind]}
        out: dict[str, str] = {}
        ed = conn.execute(text(SQL["editionable"]), binds).scalar()
        if ed is not None:
            out["editionable"] = str(ed)
        if ref.kind == "trigger":
            st = conn.execute(text(SQL["trigger_status"]),
                              {"p_owner": ref.schema, "p_name": ref.name}).scalar()
            if st is not None:
                out["trigger_status"] = str(st).upper()
        if ref.kind in _PLSQL_KINDS:
            row = conn.execute(text(SQL["settings"]), binds).first()
            if row is not None:
                for name, value in zip(_SETTING_NAMES, row, strict=True):
                    if value is not None:
                        out[name] = str(value)
        return out

    def signed_text(self, ref: ObjectRef, source: str, attributes: Mapping[str, str]) -> str:
        """Editionability, trigger state and compiler settings in front of the normalised text."""
        head = "".join(f"-- {k}: {attributes[k]}\n"
                       for k in ("editionable", "trigger_status", *_SETTING_NAMES)
                       if attributes.get(k))
        return head + self.normalise(ref, source)

    def appliable(self, ref: ObjectRef, normalised: str) -> str:
        return re.sub(r"^(\s*CREATE)\s+(?!OR\s+REPLACE\b)", r"\1 OR REPLACE ", normalised,
                      count=1, flags=re.IGNORECASE)

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
            text(SQL["errors"]),
            {"p_owner": ref.schema, "p_name": ref.name, "p_type": OBJECT_TYPE[ref.kind]},
        ).all()
        return tuple(f"line {r[0]}, col {r[1]}: {str(r[2]).strip()}" for r in rows)

    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        ref = self.resolve(conn, ref)
        row = conn.execute(
            text(SQL["status"]),
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

    def sweep(self, conn: Connection, refs: Sequence[ObjectRef],
              before: Mapping[str, ObjectStatus]) -> dict[str, ObjectStatus]:
        """Recompile only the invalid dependents, each after the dependents it uses.

        Every status is read first; a valid dependent is left alone (recompiling
        it would invalidate what depends on it and discard package state).  The
        invalid ones are ordered by ``ALL_DEPENDENCIES`` among themselves, so a
        package is recompiled before a procedure that calls it.
        """
        now = {r.key: self.status(conn, r) for r in refs}
        invalid = [r for r in refs if now[r.key].state == INVALID]
        for ref in recompile_order(invalid, self._edges(conn, invalid)):
            now[ref.key] = self.recompile(conn, ref)
        return now

    def _edges(self, conn: Connection, refs: Sequence[ObjectRef]) -> list[tuple[str, str]]:
        """(dependent key, what it uses) among ``refs``, from ``ALL_DEPENDENCIES``."""
        keys = {(r.schema, r.name, OBJECT_TYPE[r.kind]): r.key for r in refs}
        out: list[tuple[str, str]] = []
        for owner in sorted({str(r.schema) for r in refs}):
            for row in conn.execute(text(SQL["edges"]), {"p_owner": owner}).all():
                a = keys.get((str(row[0]), str(row[1]), str(row[2])))
                b = keys.get((str(row[3]), str(row[4]), str(row[5])))
                if a and b and a != b:
                    out.append((a, b))
        return out

    @contextmanager
    def ddl_session(self, conn: Connection, lock_timeout: float) -> Iterator[None]:
        """``ddl_lock_timeout``: DDL waits at most the row's lock seconds for library-cache
        locks (0 would fail at once; Oracle's default waits not at all either)."""
        seconds = min(max(math.ceil(lock_timeout), 0), 1_000_000)
        self._raw_execute(conn, SQL["ddl_lock_timeout"].format(seconds=int(seconds)))
        yield

    @contextmanager
    def read_only(self, conn: Connection) -> Iterator[None]:
        """``SET TRANSACTION READ ONLY`` as the first statement of a transaction, rolled back."""
        conn.rollback()
        conn.execute(text(SQL["read_only"]))
        try:
            yield
        finally:
            with suppress(sa.exc.DBAPIError):
                conn.rollback()

    # -- dependents and callers --------------------------------------------------------------------
    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        ref = self.resolve(conn, ref)
        rows = conn.execute(
            text(SQL["dependents"]),
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
            text(SQL["remote_dependents"]),
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
                text(SQL["searched"]).bindparams(bindparam("p_scopes", expanding=True)),
                {"p_scopes": scopes},
            ).scalar()
            or 0
        )
        rows = conn.execute(
            text(SQL["callers"]).bindparams(bindparam("p_scopes", expanding=True)),
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
            text(SQL["views"]).bindparams(bindparam("p_scopes", expanding=True)),
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
        self._restore_settings(conn, ref, attributes)
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

    def _restore_settings(self, conn: Connection, ref: ObjectRef,
                          attributes: Mapping[str, str]) -> None:
        """Recompile with the snapshot's compiler settings; disable a trigger that was disabled.

        ``CREATE OR REPLACE`` compiles with the session's settings, so a unit
        captured at ``PLSQL_OPTIMIZE_LEVEL = 1`` or with ``PLSQL_CCFLAGS`` would
        come back different; ``ALTER ... COMPILE <settings> REUSE SETTINGS``
        puts them back (explicit values win over the reused ones).
        """
        assert ref.schema is not None
        clause = compile_settings_clause(attributes) if ref.kind in _PLSQL_KINDS else ""
        if clause:
            word, how = _COMPILE[ref.kind]
            how = how.replace(" REUSE SETTINGS", "")
            self._raw_execute(conn, f"ALTER {word} {_q(ref.schema)}.{_q(ref.name)} {how} "
                                    f"{clause} REUSE SETTINGS")
        if ref.kind == "trigger" and attributes.get("trigger_status") == "DISABLED":
            self._raw_execute(conn, f"ALTER TRIGGER {_q(ref.schema)}.{_q(ref.name)} DISABLE")

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


def recompile_order(refs: Sequence[ObjectRef], edges: Sequence[tuple[str, str]]
                    ) -> list[ObjectRef]:
    """``refs`` with every object after the ones it uses (Kahn's order; ties by key).

    ``edges`` are ``(dependent, used)`` key pairs; a cycle (possible between a
    package and a body that call each other) keeps the remaining objects in key
    order at the end.
    """
    by_key = {r.key: r for r in refs}
    needs: dict[str, set[str]] = {k: set() for k in by_key}
    for dep, used in edges:
        if dep in needs and used in by_key:
            needs[dep].add(used)
    out: list[ObjectRef] = []
    done: set[str] = set()
    while len(done) < len(by_key):
        ready = sorted(k for k in by_key if k not in done and needs[k] <= done)
        if not ready:
            ready = sorted(k for k in by_key if k not in done)
        for k in ready:
            done.add(k)
            out.append(by_key[k])
    return out


def _oracle_error() -> type[Exception]:
    try:
        import oracledb
    except ImportError:  # pragma: no cover
        return sa.exc.DBAPIError
    err: type[Exception] = oracledb.Error
    return err

