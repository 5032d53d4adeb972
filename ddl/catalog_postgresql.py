"""PostgreSQL catalog adapter: functions, procedures, views, triggers.

* Source: ``pg_get_functiondef`` (functions, procedures), ``pg_get_viewdef``
  wrapped into ``CREATE OR REPLACE VIEW`` (views), ``pg_get_triggerdef`` as
  ``CREATE OR REPLACE TRIGGER`` (triggers, PostgreSQL 14+).
* The catalog re-renders a function's header (``int`` becomes ``integer``, the
  schema is added, clauses are reordered, ``$$`` becomes ``$function$``), so a
  submitted source is *rendered* in a savepoint that is always rolled back:
  the plan carries the exact text and signature the catalog will show.
  DDL is transactional here, so the rendering leaves nothing behind.
* Compile status: ``plpgsql_check_function_tb`` for PL/pgSQL (trigger
  functions are checked against a table they are attached to),
  ``fmgr_sql_validator`` for SQL functions (re-validates the body against
  today's catalog), ``EXPLAIN`` for views.  Other languages are ``unchecked``.
* Dependents: ``pg_depend`` (views through ``pg_rewrite``, SQL-standard
  function bodies, triggers) plus a reverse scan of every PL/pgSQL function in
  scope with ``plpgsql_show_dependency_tb`` (PL/pgSQL bodies are not in
  ``pg_depend``).
* PostgreSQL has no "recompile": re-checking an object is the equivalent.
* Lock: ``pg_advisory_lock`` on a key derived from the object, session scoped.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import text
from sqlalchemy.engine import Connection

from ddl import sqltext
from ddl.catalog import (
    INVALID,
    MISSING,
    UNCHECKED,
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
from ddl.errors import ApplyFailed, InvalidObjectName, ObjectNotFound, PlpgsqlCheckMissing

_RELOPTION_RE = re.compile(r"^[a-z_]+=[A-Za-z0-9_]+$")
PROBE_LOCK_TIMEOUT = "2s"
"""How long a rolled-back rendering probe waits for the object's lock."""


def _q(name: str, what: str = "identifier") -> str:
    """Quote a catalog name for interpolation (validated; embedded quotes doubled)."""
    if not name or "\x00" in name or len(name) > 63:
        raise InvalidObjectName(f"{what} {name!r} is not a valid PostgreSQL name", name=name)
    return '"' + name.replace('"', '""') + '"'


@register
class PostgresqlAdapter(BaseAdapter):
    dialect = "postgresql"
    transactional_ddl = True
    kinds = frozenset({"function", "procedure", "view", "trigger"})
    fold = "lower"

    # -- identity ------------------------------------------------------------------------
    def default_schema(self, conn: Connection) -> str | None:
        return self._current_schema(conn)

    def _current_schema(self, conn: Connection) -> str:
        return str(conn.execute(text("SELECT current_schema()")).scalar_one())

    def _procs(self, conn: Connection, schema: str, name: str) -> list[Any]:
        return list(
            conn.execute(
                text(
                    "SELECT p.oid, p.xmin::text AS xmin, oidvectortypes(p.proargtypes) AS args, "
                    "p.prokind FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                    "WHERE n.nspname = :s AND p.proname = :n ORDER BY p.oid"
                ),
                {"s": schema, "n": name},
            )
        )

    def resolve(self, conn: Connection, ref: ObjectRef) -> ObjectRef:
        self.check_kind(ref)
        schema = ref.schema or self._current_schema(conn)
        if ref.kind in ("function", "procedure"):
            rows = self._procs(conn, schema, ref.name)
            if ref.args is not None:
                oid = conn.execute(
                    text("SELECT to_regprocedure(format('%I.%I(%s)', CAST(:s AS text), "
                         "CAST(:n AS text), CAST(:a AS text)))::oid"),
                    {"s": schema, "n": ref.name, "a": ref.args},
                ).scalar()
                match = [r for r in rows if r.oid == oid]
                if not match:
                    return ObjectRef(ref.kind, ref.name, schema, ref.args)
                row = match[0]
            elif len(rows) == 1:
                row = rows[0]
            elif not rows:
                return ObjectRef(ref.kind, ref.name, schema)
            else:
                raise InvalidObjectName(
                    f"{ref.name} is overloaded in {schema}; name the argument types "
                    f"(e.g. {ref.kind}:{schema}.{ref.name}({rows[0].args}))",
                    candidates=[r.args for r in rows],
                )
            kind = "procedure" if row.prokind == "p" else "function"
            return ObjectRef(kind, ref.name, schema, str(row.args))
        if ref.kind == "trigger":
            rows = list(
                conn.execute(
                    text(
                        "SELECT c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s "
                        "AND t.tgname = :n AND NOT t.tgisinternal"
                    ),
                    {"s": schema, "n": ref.name},
                )
            )
            parents = [str(r.relname) for r in rows]
            if ref.parent is None and len(parents) > 1:
                raise InvalidObjectName(
                    f"trigger {ref.name} exists on several tables in {schema}; name the table",
                    candidates=parents,
                )
            parent = ref.parent or (parents[0] if parents else None)
            return ObjectRef("trigger", ref.name, schema, parent=parent)
        return ObjectRef(ref.kind, ref.name, schema)

    def identify(self, conn: Connection, source: str) -> ObjectRef:
        header = sqltext.parse_header(source, self.fold)
        ref = ObjectRef(header.kind, header.name, header.schema)
        self.check_kind(ref)
        schema = ref.schema or self._current_schema(conn)
        if ref.kind in ("function", "procedure"):
            # The argument types are what the server makes of the header: create it in a
            # savepoint, see which pg_proc row was written, roll back.
            before = {r.oid: r.xmin for r in self._procs(conn, schema, ref.name)}
            with conn.begin_nested() as sp:
                try:
                    conn.execute(text(f"SET LOCAL lock_timeout = '{PROBE_LOCK_TIMEOUT}'"))
                    self.execute_ddl(conn, ref, source)
                    after = self._procs(conn, schema, ref.name)
                finally:
                    sp.rollback()
            written = [r for r in after if before.get(r.oid) != r.xmin]
            if len(written) != 1:
                raise ApplyFailed(
                    f"could not tell which {ref.kind} the source creates",
                    object=ref.key,
                )
            kind = "procedure" if written[0].prokind == "p" else "function"
            return ObjectRef(kind, ref.name, schema, str(written[0].args))
        if ref.kind == "trigger":
            masked = sqltext.mask(source, strings=False)
            m = re.search(r"\bON\s+(" + sqltext._Q + r"(?:\s*\.\s*" + sqltext._Q + r")?)",
                          masked[header.end :], re.IGNORECASE)
            parent = None
            if m:
                parts = re.findall(sqltext._Q, m.group(1))
                parent, _ = sqltext.unquote(parts[-1], self.fold)
            return ObjectRef("trigger", ref.name, schema, parent=parent)
        return ObjectRef(ref.kind, ref.name, schema)

    # -- reading ---------------------------------------------------------------------------
    def _proc_row(self, conn: Connection, ref: ObjectRef) -> Any:
        if ref.args is None:
            ref = self.resolve(conn, ref)
            if ref.args is None:
                return None
        return conn.execute(
            text(
                "SELECT p.oid, pg_get_functiondef(p.oid) AS src, l.lanname, p.prokind, "
                "p.prorettype = 'trigger'::regtype AS is_trigger, "
                "p.prorettype = 'event_trigger'::regtype AS is_event_trigger, "
                "CAST(CAST(p.oid AS regprocedure) AS text) AS signature "
                "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "JOIN pg_language l ON l.oid = p.prolang "
                "WHERE n.nspname = :s AND p.proname = :n AND oidvectortypes(p.proargtypes) = :a"
            ),
            {"s": ref.schema, "n": ref.name, "a": ref.args},
        ).first()

    def _view_row(self, conn: Connection, ref: ObjectRef) -> Any:
        return conn.execute(
            text(
                "SELECT c.oid, pg_get_viewdef(c.oid) AS viewdef, c.reloptions, "
                "quote_ident(n.nspname) AS qs, quote_ident(c.relname) AS qn "
                "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = :s AND c.relname = :n AND c.relkind = 'v'"
            ),
            {"s": ref.schema, "n": ref.name},
        ).first()

    def _trigger_row(self, conn: Connection, ref: ObjectRef) -> Any:
        return conn.execute(
            text(
                "SELECT t.oid, pg_get_triggerdef(t.oid) AS tdef, c.relname, t.tgrelid, t.tgfoid "
                "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = :s AND t.tgname = :n AND NOT t.tgisinternal "
                "AND (CAST(:p AS text) IS NULL OR c.relname = :p)"
            ),
            {"s": ref.schema, "n": ref.name, "p": ref.parent},
        ).first()

    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        self.check_kind(ref)
        if ref.schema is None or (ref.kind in ("function", "procedure") and ref.args is None):
            ref = self.resolve(conn, ref)
        if ref.kind in ("function", "procedure"):
            row = self._proc_row(conn, ref)
            if row is None:
                return None
            kind = "procedure" if row.prokind == "p" else "function"
            resolved = ObjectRef(kind, ref.name, ref.schema, ref.args)
            return LiveObject(resolved, str(row.src), {"language": str(row.lanname)})
        if ref.kind == "view":
            row = self._view_row(conn, ref)
            if row is None:
                return None
            opts = [o for o in (row.reloptions or []) if _RELOPTION_RE.match(o)]
            with_ = f" WITH ({', '.join(opts)})" if opts else ""
            src = f"CREATE OR REPLACE VIEW {row.qs}.{row.qn}{with_} AS\n{row.viewdef}"
            return LiveObject(ref, src, {})
        row = self._trigger_row(conn, ref)
        if row is None:
            return None
        src = re.sub(r"^CREATE TRIGGER\b", "CREATE OR REPLACE TRIGGER", str(row.tdef))
        return LiveObject(ObjectRef("trigger", ref.name, ref.schema, parent=str(row.relname)), src)

    def render(self, conn: Connection, ref: ObjectRef, source: str) -> str | None:
        """Apply ``source`` in a savepoint, read the catalog's rendering, roll back.

        The savepoint holds the object's lock for the few milliseconds this takes
        (a view's or a trigger's table lock included), and waits at most
        ``PROBE_LOCK_TIMEOUT`` for it; a timeout is reported as a failed render.
        """
        with conn.begin_nested() as sp:
            try:
                conn.execute(text(f"SET LOCAL lock_timeout = '{PROBE_LOCK_TIMEOUT}'"))
                self.execute_ddl(conn, ref, source)
                live = self.read(conn, ref)
            finally:
                sp.rollback()
        return None if live is None else self.normalise(ref, live.source)

    # -- status ------------------------------------------------------------------------------
    def _ext_schema(self, conn: Connection) -> str | None:
        row = conn.execute(
            text(
                "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n "
                "ON n.oid = e.extnamespace WHERE e.extname = 'plpgsql_check'"
            )
        ).first()
        return None if row is None else str(row[0])

    def has_compile_status(self, conn: Connection, *, check: bool = False) -> bool:
        found = self._ext_schema(conn) is not None
        if not found and check:
            db = conn.execute(text("SELECT current_database()")).scalar_one()
            raise PlpgsqlCheckMissing(
                f"the extension plpgsql_check is not installed in database {db}; install "
                "postgresql-NN-plpgsql-check on the server and run CREATE EXTENSION plpgsql_check",
                extension="plpgsql_check",
                database=db,
                found="not installed",
                needed="plpgsql_check 2.x",
            )
        return found

    def _ext(self, conn: Connection) -> str:
        self.has_compile_status(conn, check=True)
        schema = self._ext_schema(conn)
        assert schema is not None
        return _q(schema, "extension schema")

    def _trigger_relid(self, conn: Connection, fn_oid: int) -> int | None:
        v = conn.execute(
            text(
                "SELECT tgrelid FROM pg_trigger WHERE tgfoid = :o AND NOT tgisinternal "
                "ORDER BY oid LIMIT 1"
            ),
            {"o": fn_oid},
        ).scalar()
        return None if v is None else int(v)

    def _check_function(
        self, conn: Connection, ref: ObjectRef, row: Any, relid: int | None = None
    ) -> ObjectStatus:
        lang = str(row.lanname)
        if lang == "plpgsql":
            if row.is_event_trigger:
                return ObjectStatus(ref, UNCHECKED, (), "event trigger functions are not checked")
            if relid is None:
                relid = 0
            if row.is_trigger and relid == 0:
                found = self._trigger_relid(conn, int(row.oid))
                if found is None:
                    return ObjectStatus(
                        ref, UNCHECKED, (), "trigger function not attached to any table"
                    )
                relid = found
            ext = self._ext(conn)
            with conn.begin_nested() as sp:
                try:
                    rows = list(
                        conn.execute(
                            text(
                                "SELECT level, message, lineno FROM "
                                f"{ext}.plpgsql_check_function_tb("
                                "CAST(CAST(:o AS oid) AS regprocedure), "
                                "CAST(CAST(:r AS oid) AS regclass))"
                            ),
                            {"o": int(row.oid), "r": relid},
                        )
                    )
                except sa.exc.DBAPIError as exc:
                    sp.rollback()
                    return ObjectStatus(
                        ref, INVALID, (first_line(exc.orig),), "plpgsql_check_function_tb"
                    )
                sp.rollback()
            errors = tuple(
                f"line {r.lineno}: {r.message}" for r in rows if str(r.level) == "error"
            )
            return ObjectStatus(
                ref, INVALID if errors else VALID, errors, "plpgsql_check_function_tb"
            )
        if lang == "sql":
            with conn.begin_nested() as sp:
                try:
                    conn.execute(
                        text("SELECT fmgr_sql_validator(CAST(:o AS oid))"), {"o": int(row.oid)}
                    )
                except sa.exc.DBAPIError as exc:
                    sp.rollback()
                    return ObjectStatus(ref, INVALID, (first_line(exc.orig),), "fmgr_sql_validator")
                sp.rollback()
            return ObjectStatus(ref, VALID, (), "fmgr_sql_validator")
        return ObjectStatus(ref, UNCHECKED, (), f"language {lang} has no compile check")

    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        self.check_kind(ref)
        if ref.kind in ("function", "procedure"):
            row = self._proc_row(conn, ref)
            if row is None:
                return ObjectStatus(ref, MISSING, (), "pg_proc")
            return self._check_function(conn, ref, row)
        if ref.kind == "view":
            vrow = self._view_row(conn, ref)
            if vrow is None:
                return ObjectStatus(ref, MISSING, (), "pg_class")
            with conn.begin_nested() as sp:
                try:
                    conn.execute(text(f"EXPLAIN SELECT * FROM {vrow.qs}.{vrow.qn}"))
                except sa.exc.DBAPIError as exc:
                    sp.rollback()
                    return ObjectStatus(ref, INVALID, (first_line(exc.orig),), "EXPLAIN")
                sp.rollback()
            return ObjectStatus(ref, VALID, (), "EXPLAIN")
        trow = self._trigger_row(conn, ref)
        if trow is None:
            return ObjectStatus(ref, MISSING, (), "pg_trigger")
        frow = conn.execute(
            text(
                "SELECT p.oid, l.lanname, true AS is_trigger, false AS is_event_trigger "
                "FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.oid = :o"
            ),
            {"o": int(trow.tgfoid)},
        ).first()
        if frow is None:
            return ObjectStatus(ref, INVALID, ("trigger function is gone",), "pg_trigger")
        return self._check_function(conn, ref, frow, relid=int(trow.tgrelid))

    def recompile(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        """PostgreSQL compiles on use; re-checking the one object is the equivalent."""
        return self.status(conn, ref)

    # -- dependents and callers ---------------------------------------------------------
    def _target_oid(self, conn: Connection, ref: ObjectRef) -> tuple[str, int] | None:
        if ref.kind in ("function", "procedure"):
            row = self._proc_row(conn, ref)
            return None if row is None else ("pg_proc", int(row.oid))
        if ref.kind == "view":
            vrow = self._view_row(conn, ref)
            return None if vrow is None else ("pg_class", int(vrow.oid))
        return None

    def _proc_ref(self, row: Any) -> ObjectRef:
        kind = "procedure" if row.prokind == "p" else "function"
        return ObjectRef(kind, str(row.proname), str(row.nspname), str(row.args))

    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        self.check_kind(ref)
        target = self._target_oid(conn, ref)
        if target is None:
            return []
        refclass, oid = target
        found: dict[str, Dependent] = {}
        deps = conn.execute(
            text(
                "SELECT d.classid::regclass::text AS cls, d.objid FROM pg_depend d "
                "WHERE d.refclassid = CAST(:rc AS regclass) AND d.refobjid = :o "
                "AND d.deptype IN ('n', 'a') ORDER BY d.classid, d.objid"
            ),
            {"rc": refclass, "o": oid},
        ).all()
        for dep in deps:
            dref: ObjectRef | None = None
            if dep.cls == "pg_rewrite":
                row = conn.execute(
                    text(
                        "SELECT c.oid, c.relname, c.relkind, n.nspname FROM pg_rewrite r "
                        "JOIN pg_class c ON c.oid = r.ev_class "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE r.oid = :o"
                    ),
                    {"o": int(dep.objid)},
                ).first()
                if row is not None and row.relkind == "v" and int(row.oid) != oid:
                    dref = ObjectRef("view", str(row.relname), str(row.nspname))
            elif dep.cls == "pg_proc":
                row = conn.execute(
                    text(
                        "SELECT p.proname, n.nspname, oidvectortypes(p.proargtypes) AS args, "
                        "p.prokind FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                        "WHERE p.oid = :o AND p.prokind IN ('f', 'p')"
                    ),
                    {"o": int(dep.objid)},
                ).first()
                if row is not None:
                    dref = self._proc_ref(row)
            elif dep.cls == "pg_trigger":
                row = conn.execute(
                    text(
                        "SELECT t.tgname, c.relname, n.nspname FROM pg_trigger t "
                        "JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n "
                        "ON n.oid = c.relnamespace WHERE t.oid = :o AND NOT t.tgisinternal"
                    ),
                    {"o": int(dep.objid)},
                ).first()
                if row is not None:
                    dref = ObjectRef("trigger", str(row.tgname), str(row.nspname),
                                     parent=str(row.relname))
            if dref is not None and dref.key not in found:
                found[dref.key] = Dependent(dref, ref, "pg_depend")
        for dep_ref in self._plpgsql_dependents(conn, ref, oid, progress):
            if dep_ref.key not in found:
                found[dep_ref.key] = Dependent(dep_ref, ref, "plpgsql_check")
        return list(found.values())

    def _plpgsql_dependents(
        self, conn: Connection, ref: ObjectRef, oid: int, progress: Progress | None
    ) -> list[ObjectRef]:
        candidates = conn.execute(
            text(
                "SELECT p.oid, p.proname, n.nspname, oidvectortypes(p.proargtypes) AS args, "
                "p.prokind, p.prorettype = 'trigger'::regtype AS is_trigger, "
                "p.prorettype = 'event_trigger'::regtype AS is_event_trigger, "
                "(SELECT t.tgrelid FROM pg_trigger t WHERE t.tgfoid = p.oid "
                " AND NOT t.tgisinternal ORDER BY t.oid LIMIT 1) AS relid "
                "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "JOIN pg_language l ON l.oid = p.prolang "
                "WHERE l.lanname = 'plpgsql' AND n.nspname = ANY(:scopes) AND p.oid <> :o "
                "ORDER BY n.nspname, p.proname, p.oid"
            ),
            {"scopes": list(self.scopes(ref)), "o": oid},
        ).all()
        if not candidates:
            return []
        ext = self._ext(conn)
        wanted = {"FUNCTION", "PROCEDURE"} if ref.kind in ("function", "procedure") else {
            "RELATION"
        }
        out: list[ObjectRef] = []
        total = len(candidates)
        for i, cand in enumerate(candidates, start=1):
            if progress is not None:
                progress(i, total, f"{cand.nspname}.{cand.proname}")
            if cand.is_event_trigger or (cand.is_trigger and cand.relid is None):
                continue
            with conn.begin_nested() as sp:
                try:
                    rows = conn.execute(
                        text(
                            f"SELECT type, oid FROM {ext}.plpgsql_show_dependency_tb("
                            "CAST(CAST(:o AS oid) AS regprocedure), "
                            "CAST(CAST(:r AS oid) AS regclass))"
                        ),
                        {"o": int(cand.oid), "r": int(cand.relid or 0)},
                    ).all()
                except sa.exc.DBAPIError:
                    rows = []
                sp.rollback()
            if any(str(r.type) in wanted and int(r.oid) == oid for r in rows):
                out.append(self._proc_ref(cand))
        return out

    def search_callers(self, conn: Connection, ref: ObjectRef) -> CallerSearch:
        self.check_kind(ref)
        scopes = list(self.scopes(ref))
        hits: list[CallerHit] = []
        searched = 0
        procs = conn.execute(
            text(
                "SELECT p.proname, n.nspname, oidvectortypes(p.proargtypes) AS args, p.prokind, "
                "pg_get_functiondef(p.oid) AS src FROM pg_proc p "
                "JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = ANY(:s) AND p.prokind IN ('f', 'p') "
                "AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass "
                "AND d.objid = p.oid AND d.deptype = 'e') ORDER BY n.nspname, p.proname, p.oid"
            ),
            {"s": scopes},
        ).all()
        for row in procs:
            oref = self._proc_ref(row)
            if oref.key == ref.key:
                continue
            searched += 1
            hits += [CallerHit(oref, n, t) for n, t in sqltext.find_word(str(row.src), ref.name)]
        views = conn.execute(
            text(
                "SELECT c.relname, n.nspname, pg_get_viewdef(c.oid) AS viewdef FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = ANY(:s) AND c.relkind = 'v' ORDER BY n.nspname, c.relname"
            ),
            {"s": scopes},
        ).all()
        for row in views:
            oref = ObjectRef("view", str(row.relname), str(row.nspname))
            if oref.key == ref.key:
                continue
            searched += 1
            found = sqltext.find_word(str(row.viewdef), ref.name)
            hits += [CallerHit(oref, n, t) for n, t in found]
        trigs = conn.execute(
            text(
                "SELECT t.tgname, c.relname, n.nspname, pg_get_triggerdef(t.oid) AS tdef "
                "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = ANY(:s) AND NOT t.tgisinternal ORDER BY n.nspname, t.tgname"
            ),
            {"s": scopes},
        ).all()
        for row in trigs:
            oref = ObjectRef("trigger", str(row.tgname), str(row.nspname), parent=str(row.relname))
            if oref.key == ref.key:
                continue
            searched += 1
            found = sqltext.find_word(str(row.tdef), ref.name)
            hits += [CallerHit(oref, n, t) for n, t in found]
        return CallerSearch(
            target=ref,
            method="whole-word search of pg_get_functiondef, pg_get_viewdef and "
            "pg_get_triggerdef text (extension members excluded)",
            pattern=ref.name,
            scope=tuple(scopes),
            searched=searched,
            hits=tuple(hits),
        )

    # -- changing ----------------------------------------------------------------------------------
    def apply(
        self, conn: Connection, ref: ObjectRef, source: str, attributes: Mapping[str, str]
    ) -> None:
        self.check_kind(ref)
        self.execute_ddl(conn, ref, source)

    def drop(self, conn: Connection, ref: ObjectRef) -> None:
        self.check_kind(ref)
        if ref.kind in ("function", "procedure"):
            row = self._proc_row(conn, ref)
            if row is None:
                return
            word = "PROCEDURE" if row.prokind == "p" else "FUNCTION"
            # regprocedure's text output is the server's own quoting of name and types.
            conn.exec_driver_sql(
                f"DROP {word} {row.signature}", execution_options={"no_parameters": True}
            )
            return
        if ref.kind == "view":
            vrow = self._view_row(conn, ref)
            if vrow is not None:
                conn.execute(text(f"DROP VIEW {vrow.qs}.{vrow.qn}"))
            return
        trow = self._trigger_row(conn, ref)
        if trow is None:
            return
        if ref.schema is None:
            raise ObjectNotFound(f"trigger {ref.key} has no schema", object=ref.key)
        conn.execute(
            text(f"DROP TRIGGER {_q(ref.name)} ON {_q(ref.schema)}.{_q(str(trow.relname))}")
        )

    # -- locks -----------------------------------------------------------------------------
    @staticmethod
    def _lock_id(name: str) -> int:
        return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)

    def acquire_lock(self, conn: Connection, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + max(timeout, 0.0)
        key = self._lock_id(name)
        while True:
            got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
            if got:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def release_lock(self, conn: Connection, name: str) -> None:
        conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self._lock_id(name)})
