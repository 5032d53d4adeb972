"""PostgreSQL catalog adapter: functions, procedures, aggregates, views, triggers.

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
* Aggregates: ``pg_get_functiondef`` refuses them; their source is written
  from ``pg_aggregate`` as ``CREATE OR REPLACE AGGREGATE`` (PostgreSQL 12+).
* Dependents, transitively (a changed state function changes its aggregate
  and every view over it): one graph per sweep from ``pg_depend`` (views
  through ``pg_rewrite``, SQL-standard function bodies, aggregates, triggers),
  ``plpgsql_show_dependency_tb`` over every PL/pgSQL function in scope in one
  query (PL/pgSQL bodies are not in ``pg_depend``), and the string bodies of
  ``LANGUAGE sql`` functions parsed with ``pglast`` (not in ``pg_depend``
  either).  Statuses of many objects are checked in one round trip per kind.
* One statement per source: ``pglast`` (PostgreSQL's parser) at plan time, and
  the DDL is sent through the extended protocol, which runs one statement.
* PostgreSQL has no "recompile": re-checking an object is the equivalent.
* Lock: ``pg_advisory_lock`` on a key derived from the object, session scoped.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import text
from sqlalchemy.engine import URL, Connection, Engine

from capgate.ddl import source as srcmod
from capgate.ddl import sqltext
from capgate.ddl.catalog import (
    CATALOG,
    EXECUTED,
    INVALID,
    MISSING,
    NO_ROW,
    NOT_CHECKED,
    NOT_RUN,
    RAN,
    RUN_ERROR,
    RUN_TIMED_OUT,
    RUN_WRITES,
    UNCHECKED,
    VALID,
    BaseAdapter,
    CallerHit,
    CallerSearch,
    Dependent,
    LiveObject,
    ObjectRef,
    ObjectStatus,
    Probe,
    Progress,
    first_line,
)
from capgate.ddl.smoke import ContainedCall, Ran, refuse
from capgate.registry.errors import (
    ApplyFailed,
    InvalidObjectName,
    ObjectNotFound,
    PlpgsqlCheckMissing,
    UnsupportedObjectType,
)

_RELOPTION_RE = re.compile(r"^[a-z_]+=[A-Za-z0-9_]+$")
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")
"""A ``:name`` bind as SQLAlchemy's ``text()`` reads it (``::type`` casts are not binds)."""
PROBE_LOCK_TIMEOUT = "2s"
"""How long a rolled-back rendering probe waits for the object's lock."""


def _q(name: str, what: str = "identifier") -> str:
    """Quote a catalog name for interpolation (validated; embedded quotes doubled)."""
    if not name or "\x00" in name or len(name) > 63:
        raise InvalidObjectName(f"{what} {name!r} is not a valid PostgreSQL name", name=name)
    return '"' + name.replace('"', '""') + '"'


_PROKIND = {"p": "procedure", "a": "aggregate", "f": "function", "w": "function"}
_PROC_KINDS = frozenset({"function", "procedure", "aggregate"})
_VIEW_COLUMNS_CHANGED = "42P16"
"""SQLSTATE of ``cannot drop columns from view`` (and renamed or retyped view columns)."""

Node = tuple[str, int]
"""A catalog object as ``(catalog, oid)``: ``pg_proc``, ``pg_class`` or ``pg_trigger``."""


def _kind_of(prokind: str) -> str:
    return _PROKIND.get(str(prokind), "function")


def _ms(seconds: float) -> str:
    return f"{max(int(seconds * 1000), 1)}ms"


def _literal(value: str) -> str:
    """A SQL string literal (quotes doubled) for text read from the catalog."""
    return "'" + value.replace("'", "''") + "'"


_DEP_FILTER = ("d.deptype IN ('n', 'a') AND d.refclassid IN ('pg_proc'::regclass, "
               "'pg_class'::regclass) AND n.nspname = ANY(:s)")
_PG_DEPEND_EDGES = (
    # a view's rewrite rule uses functions, aggregates, views and tables
    "SELECT DISTINCT 'pg_class' AS ncls, c.oid AS noid, 'view' AS kind, c.relname AS name, "
    "n.nspname AS schema, NULL::text AS args, NULL::text AS parent, "
    "d.refclassid::regclass::text AS rcls, d.refobjid AS roid FROM pg_depend d "
    "JOIN pg_rewrite rw ON d.classid = 'pg_rewrite'::regclass AND rw.oid = d.objid "
    "JOIN pg_class c ON c.oid = rw.ev_class AND c.relkind = 'v' "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    f"WHERE {_DEP_FILTER} AND d.refobjid <> c.oid "
    # an aggregate uses its state and final functions; a BEGIN ATOMIC body what it calls
    "UNION SELECT DISTINCT 'pg_proc', p.oid, CASE p.prokind WHEN 'p' THEN 'procedure' "
    "WHEN 'a' THEN 'aggregate' ELSE 'function' END, p.proname, n.nspname, "
    "oidvectortypes(p.proargtypes), NULL, d.refclassid::regclass::text, d.refobjid "
    "FROM pg_depend d JOIN pg_proc p ON d.classid = 'pg_proc'::regclass AND p.oid = d.objid "
    "JOIN pg_namespace n ON n.oid = p.pronamespace "
    f"WHERE {_DEP_FILTER} AND d.refobjid <> p.oid "
    # a trigger uses its function
    "UNION SELECT DISTINCT 'pg_trigger', t.oid, 'trigger', t.tgname, n.nspname, NULL, "
    "c.relname, d.refclassid::regclass::text, d.refobjid FROM pg_depend d "
    "JOIN pg_trigger t ON d.classid = 'pg_trigger'::regclass AND t.oid = d.objid "
    "AND NOT t.tgisinternal JOIN pg_class c ON c.oid = t.tgrelid "
    f"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {_DEP_FILTER}"
)


_FIRST_TRIGGER = ("SELECT DISTINCT ON (tgfoid) tgfoid, tgrelid FROM pg_trigger "
                  "WHERE NOT tgisinternal ORDER BY tgfoid, oid")
"""Per trigger function, the table of its first trigger (plpgsql_check checks it against it);
one pass over pg_trigger, joined -- not a scan of it per function."""
_IN_SCOPE = "JOIN pg_namespace n ON n.oid = {ns} WHERE n.nspname = ANY(:s)"
_CATALOG_VERSION = (
    "SELECT count(*) || ':' || coalesce(sum(hashtextextended(x, 7)), 0) FROM ("
    "SELECT 'p' || p.oid || ':' || p.xmin FROM pg_proc p "
    + _IN_SCOPE.format(ns="p.pronamespace") +
    " UNION ALL SELECT 'c' || c.oid || ':' || c.xmin FROM pg_class c "
    + _IN_SCOPE.format(ns="c.relnamespace") +
    " UNION ALL SELECT 'r' || r.oid || ':' || r.xmin FROM pg_rewrite r "
    "JOIN pg_class c ON c.oid = r.ev_class " + _IN_SCOPE.format(ns="c.relnamespace") +
    " UNION ALL SELECT 't' || t.oid || ':' || t.xmin FROM pg_trigger t "
    "JOIN pg_class c ON c.oid = t.tgrelid " + _IN_SCOPE.format(ns="c.relnamespace") +
    ") AS v(x)")
"""The catalog digest of a sweep's scope (``catalog_version``): a new dependent is a new
function, relation, rule or trigger row, and a replaced one a new ``xmin``."""

_CLAUSE = re.compile(r"\b(SECURITY\s+(?:DEFINER|INVOKER)|SET\s+SEARCH_PATH)\b", re.IGNORECASE)


def _clauses(source: str) -> set[str]:
    """The security clauses a function's source declares, upper-cased, spaces single.

    (The last ``SECURITY`` clause wins in PostgreSQL; a source naming both is
    refused by the server, so the set is enough.)
    """
    masked = sqltext.mask(source, strings=True, dollar=True)
    return {" ".join(m.group(1).upper().split()) for m in _CLAUSE.finditer(masked)}


def _run_verdict(result: tuple[str, str], how: str, kind: str) -> tuple[str, str]:
    """A run check's outcome as ``ObjectStatus.run`` and its detail in words."""
    outcome, error = result
    if outcome == "row":
        return RAN, f"{how} (contained, read-only)"
    if outcome == NO_ROW:
        if kind == "view":
            return NO_ROW, ("fetched no row from it: the functions it applies per row did "
                            "not run (contained, read-only)")
        return RAN, f"{how}: no row (contained, read-only)"
    if outcome == RUN_WRITES:
        return RUN_WRITES, f"{how}: it tried to write and was refused -- ran up to there"
    if outcome == RUN_TIMED_OUT:
        return RUN_TIMED_OUT, f"{how}: stopped at the check's time limit ({error})"
    return RUN_ERROR, error


class PostgresqlAdapter(BaseAdapter, name="postgresql"):
    plain_identifier = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
    transactional_ddl = True
    kinds = frozenset({"function", "procedure", "aggregate", "view", "trigger"})
    fold = "lower"
    sqlglot_dialect = "postgres"

    def engine(self, url: str | URL, **options: Any) -> Engine:
        """A small pool for the loop's lifetime: a plan or an apply opens several short
        sessions (the lock's, the working one, reads between), each a new backend without
        one.  Nothing session-scoped is left on a returned connection: settings are ``SET
        LOCAL``, the advisory locks are released, the pool rolls back on return."""
        opts: dict[str, Any] = {"poolclass": sa.pool.QueuePool, "pool_size": 2,
                                "max_overflow": 8, **options}
        return sa.create_engine(url, **opts)

    # -- whose rights the code runs with -----------------------------------------------------
    def privilege_changes(self, ref: ObjectRef, base: str | None, new: str) -> list[str]:
        """``SECURITY DEFINER`` gained, and one without a pinned ``search_path``.

        A SECURITY DEFINER function or procedure runs with its owner's rights for
        every caller.  The manual ("Writing SECURITY DEFINER Functions Safely")
        asks for a ``SET search_path`` on it that leaves out schemas others can
        write: otherwise a caller who can create an object (an operator, a
        function) that the body resolves by name runs it with the owner's rights.
        Read from the header clauses, strings, comments and dollar-quoted bodies
        blanked out (``pg_get_functiondef`` writes each clause on a line of its
        own; a user's source may put them after the body too).
        """
        if ref.kind not in ("function", "procedure"):
            return []
        now = _clauses(new)
        if "SECURITY DEFINER" not in now:
            return []
        out: list[str] = []
        if base is None or "SECURITY DEFINER" not in _clauses(base):
            was = "" if base is None else ", where the live one runs with its caller's"
            out.append(f"{ref.key}: the new source runs with its owner's rights (SECURITY "
                       f"DEFINER){was}: every role that may execute it acts with the owner's "
                       "privileges inside it")
        if "SET SEARCH_PATH" not in now:
            out.append(f"{ref.key}: SECURITY DEFINER without SET search_path: a caller who can "
                       "create objects in a schema on the search path can make the body run "
                       "them with the owner's rights; add e.g. SET search_path = pg_catalog, "
                       "<schema> (PostgreSQL manual: Writing SECURITY DEFINER Functions "
                       "Safely)")
        return out

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
        if ref.kind in _PROC_KINDS:
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
            return ObjectRef(_kind_of(row.prokind), ref.name, schema, str(row.args))
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

    def header(self, source: str) -> ObjectRef:
        """What the source defines, by PostgreSQL's own parser (``pglast``); no catalog read.

        The source must be exactly one definition (``ExtraStatements`` otherwise).
        """
        from pglast import parse_sql
        from pglast.parser import ParseError

        try:
            stmts = parse_sql(source)
        except ParseError:
            stmts = ()
        if not stmts:  # let parse_definition word the refusal
            srcmod.parse_postgresql(source, "function", "the source")
        stmt: Any = stmts[0].stmt
        name = type(stmt).__name__
        if name == "CreateFunctionStmt":
            parts = [str(x.sval) for x in stmt.funcname]
            kind = "procedure" if stmt.is_procedure else "function"
            ref = ObjectRef(kind, parts[-1], parts[-2] if len(parts) > 1 else None)
        elif name == "ViewStmt":
            ref = ObjectRef("view", str(stmt.view.relname), stmt.view.schemaname)
        elif name == "CreateTrigStmt":
            ref = ObjectRef("trigger", str(stmt.trigname), stmt.relation.schemaname,
                            parent=str(stmt.relation.relname))
        elif name == "DefineStmt" and len(stmt.defnames or ()) >= 1:
            parts = [str(x.sval) for x in stmt.defnames]
            ref = ObjectRef("aggregate", parts[-1], parts[-2] if len(parts) > 1 else None)
        else:
            raise UnsupportedObjectType(
                f"the source is a {name}, not a function, procedure, aggregate, view or trigger",
                found=name, supported=sorted(self.kinds))
        srcmod.parse_postgresql(source, ref.kind, ref.key)
        return ref

    def parse_definition(self, conn: Connection | None, ref: ObjectRef, source: str,
                         attributes: Mapping[str, str]) -> None:
        srcmod.parse_postgresql(source, ref.kind, ref.key)

    def identify(self, conn: Connection, source: str) -> ObjectRef:
        ref = self.header(source)  # parsed first: nothing but one definition is ever executed
        self.check_kind(ref)
        schema = ref.schema or self._current_schema(conn)
        if ref.kind in _PROC_KINDS:
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
            return ObjectRef(_kind_of(written[0].prokind), ref.name, schema,
                             str(written[0].args))
        if ref.kind == "trigger":
            return ObjectRef("trigger", ref.name, schema, parent=ref.parent)
        return ObjectRef(ref.kind, ref.name, schema)

    # -- reading ---------------------------------------------------------------------------
    def _proc_row(self, conn: Connection, ref: ObjectRef) -> Any:
        if ref.args is None:
            ref = self.resolve(conn, ref)
            if ref.args is None:
                return None
        return conn.execute(
            text(
                "SELECT p.oid, CASE WHEN p.prokind = 'a' THEN NULL "
                "ELSE pg_get_functiondef(p.oid) END AS src, l.lanname, p.prokind, "
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

    def _aggregate_source(self, conn: Connection, oid: int) -> str:
        """``CREATE OR REPLACE AGGREGATE`` written from ``pg_aggregate`` (no functiondef exists)."""
        a = conn.execute(text(
            "SELECT quote_ident(n.nspname) AS qs, quote_ident(p.proname) AS qn, "
            "pg_get_function_arguments(p.oid) AS args, a.aggkind, p.proparallel, "
            "a.aggtransfn::regproc::text AS sfunc, format_type(a.aggtranstype, NULL) AS stype, "
            "a.aggtransspace, NULLIF(a.aggfinalfn, 0)::regproc::text AS finalfunc, "
            "a.aggfinalextra, a.aggfinalmodify, "
            "NULLIF(a.aggcombinefn, 0)::regproc::text AS combinefunc, "
            "NULLIF(a.aggserialfn, 0)::regproc::text AS serialfunc, "
            "NULLIF(a.aggdeserialfn, 0)::regproc::text AS deserialfunc, a.agginitval, "
            "NULLIF(a.aggmtransfn, 0)::regproc::text AS msfunc, "
            "NULLIF(a.aggminvtransfn, 0)::regproc::text AS minvfunc, "
            "CASE WHEN a.aggmtranstype = 0 THEN NULL "
            "ELSE format_type(a.aggmtranstype, NULL) END AS mstype, a.aggmtransspace, "
            "NULLIF(a.aggmfinalfn, 0)::regproc::text AS mfinalfunc, a.aggmfinalextra, "
            "a.aggmfinalmodify, a.aggminitval, "
            "CASE WHEN a.aggsortop = 0 THEN NULL ELSE a.aggsortop::regoperator::text END "
            "AS sortop "
            "FROM pg_aggregate a JOIN pg_proc p ON p.oid = a.aggfnoid "
            "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE a.aggfnoid = :o"
        ), {"o": oid}).one()
        modify = {"r": "READ_ONLY", "s": "SHAREABLE", "w": "READ_WRITE"}
        default_modify = "w" if a.aggkind in ("o", "h") else "r"
        opts = [f"SFUNC = {a.sfunc}", f"STYPE = {a.stype}"]
        if a.aggtransspace:
            opts.append(f"SSPACE = {int(a.aggtransspace)}")
        if a.finalfunc:
            opts.append(f"FINALFUNC = {a.finalfunc}")
            if a.aggfinalextra:
                opts.append("FINALFUNC_EXTRA")
            if a.aggfinalmodify != default_modify:
                opts.append(f"FINALFUNC_MODIFY = {modify[a.aggfinalmodify]}")
        for key, value in (("COMBINEFUNC", a.combinefunc), ("SERIALFUNC", a.serialfunc),
                           ("DESERIALFUNC", a.deserialfunc)):
            if value:
                opts.append(f"{key} = {value}")
        if a.agginitval is not None:
            opts.append("INITCOND = " + _literal(str(a.agginitval)))
        if a.msfunc:
            opts += [f"MSFUNC = {a.msfunc}", f"MINVFUNC = {a.minvfunc}", f"MSTYPE = {a.mstype}"]
            if a.aggmtransspace:
                opts.append(f"MSSPACE = {int(a.aggmtransspace)}")
            if a.mfinalfunc:
                opts.append(f"MFINALFUNC = {a.mfinalfunc}")
                if a.aggmfinalextra:
                    opts.append("MFINALFUNC_EXTRA")
                if a.aggmfinalmodify != default_modify:
                    opts.append(f"MFINALFUNC_MODIFY = {modify[a.aggmfinalmodify]}")
            if a.aggminitval is not None:
                opts.append("MINITCOND = " + _literal(str(a.aggminitval)))
        if a.sortop:
            opts.append(f"SORTOP = {a.sortop.split('(')[0]}")
        if a.proparallel != "u":
            opts.append("PARALLEL = " + {"s": "SAFE", "r": "RESTRICTED"}[a.proparallel])
        if a.aggkind == "h":
            opts.append("HYPOTHETICAL")
        body = ",\n    ".join(opts)
        return f"CREATE OR REPLACE AGGREGATE {a.qs}.{a.qn}({a.args}) (\n    {body}\n)\n"

    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        self.check_kind(ref)
        if ref.schema is None or (ref.kind in _PROC_KINDS and ref.args is None):
            ref = self.resolve(conn, ref)
        if ref.kind in _PROC_KINDS:
            row = self._proc_row(conn, ref)
            if row is None:
                return None
            resolved = ObjectRef(_kind_of(row.prokind), ref.name, ref.schema, ref.args)
            if row.prokind == "a":
                return LiveObject(resolved, self._aggregate_source(conn, int(row.oid)),
                                  {"language": "aggregate"})
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

    def catalog_version(self, conn: Connection, refs: Sequence[ObjectRef]) -> str | None:
        """A digest (count, and the sum of 64-bit hashes -- no sort) of every function,
        relation, rule and trigger row of the scope, each with its ``xmin``: creating,
        replacing or dropping any of them changes it."""
        scopes = sorted({s for r in refs for s in self.scopes(r)} | {
            str(r.schema) for r in refs if r.schema})
        if not scopes:
            return None
        return str(conn.execute(text(_CATALOG_VERSION), {"s": scopes}).scalar())

    def render(self, conn: Connection, ref: ObjectRef, source: str) -> str | None:
        """Apply ``source`` in a savepoint, read the catalog's rendering, roll back."""
        (probe,) = self.probe(conn, [(ref, source, {})])
        if probe.error is not None:
            raise ApplyFailed(f"postgresql refused the DDL for {ref.key}: {probe.error}",
                              object=ref.key, database_error=probe.error)
        return probe.rendered

    def probe(self, conn: Connection,
              items: Sequence[tuple[ObjectRef, str, Mapping[str, str]]]) -> list[Probe]:
        return self.probe_many(conn, items, ())[0]

    def probe_many(self, conn: Connection,
                   items: Sequence[tuple[ObjectRef, str, Mapping[str, str]]],
                   after: Sequence[ObjectRef]
                   ) -> tuple[list[Probe], dict[str, ObjectStatus] | None]:
        """Apply every source in order in one savepoint, read and check each, roll back.

        The savepoint holds the objects' locks for the few milliseconds this takes
        (a view's or a trigger's table lock included), and waits at most
        ``PROBE_LOCK_TIMEOUT`` for them; a timeout is reported as the source's error.
        The check is the same as verify's, so a checker's complaint about the new
        source (a ``plpgsql_check`` false positive among them) is known at plan time;
        so are the statuses of ``after`` -- the dependents, compiled and run with the new
        code in place -- before the savepoint is rolled back.
        """
        out: list[Probe] = []
        predicted: dict[str, ObjectStatus] = {}
        with conn.begin_nested() as sp:
            try:
                conn.execute(text(f"SET LOCAL lock_timeout = '{PROBE_LOCK_TIMEOUT}'"))
                for ref, source, _ in items:
                    with conn.begin_nested() as one:
                        try:
                            self.execute_ddl(conn, ref, source)
                        except ApplyFailed as exc:
                            one.rollback()
                            out.append(Probe(None, None, str(exc.details.get("database_error")
                                                             or exc.message)))
                            continue
                        live = self.read(conn, ref)
                        rendered = None if live is None else self.normalise(ref, live.source)
                        status = None if live is None else self.statuses(conn, [live.object])[
                            live.object.key]
                        out.append(Probe(rendered, status, None))
                predicted = self.statuses(conn, list(after)) if after else {}
            finally:
                sp.rollback()
        return out, predicted

    def execute_ddl(self, conn: Connection, ref: ObjectRef, source: str) -> None:
        """Send the DDL through the extended protocol, which runs exactly one statement.

        psycopg uses the simple protocol (where ``;`` separates statements) for a
        query without parameters; ``prepare=True`` makes it Parse/Bind/Execute, so
        whatever the plan-time parse might have missed, the server refuses a
        second statement ("cannot insert multiple commands into a prepared
        statement") instead of running it.
        """
        import psycopg

        dbapi: Any = conn.connection.dbapi_connection
        assert dbapi is not None
        cur = dbapi.cursor()
        try:
            cur.execute(self.sql_source(ref, source), prepare=True)
        except psycopg.Error as exc:
            raise ApplyFailed(
                f"{self.dialect} refused the DDL for {ref.key}: {first_line(exc)}",
                object=ref.key,
                database_error=first_line(exc),
                sqlstate=getattr(exc, "sqlstate", None),
            ) from exc
        finally:
            cur.close()

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

    def _plpgsql_errors(self, conn: Connection, pairs: Sequence[tuple[int, int]]
                        ) -> dict[tuple[int, int], tuple[str, ...] | str]:
        """``plpgsql_check_function_tb`` for many (function, table) pairs in one query.

        A pair whose check raises (instead of reporting) is re-run alone; its
        value is then the error text (the function cannot be checked at all).
        """
        if not pairs:
            return {}
        ext = self._ext(conn)
        sql = text(
            "SELECT c.o, c.r, x.level, x.message, x.lineno FROM "
            "unnest(CAST(:o AS oid[]), CAST(:r AS oid[])) AS c(o, r) CROSS JOIN LATERAL "
            f"{ext}.plpgsql_check_function_tb(CAST(c.o AS regprocedure), "
            "CAST(c.r AS regclass)) AS x"
        )
        out: dict[tuple[int, int], tuple[str, ...] | str] = {p: () for p in pairs}
        try:
            with conn.begin_nested() as sp:
                rows = conn.execute(sql, {"o": [p[0] for p in pairs],
                                          "r": [p[1] for p in pairs]}).all()
                sp.rollback()
        except sa.exc.DBAPIError as exc:
            if len(pairs) == 1:
                return {pairs[0]: first_line(exc.orig)}
            half = len(pairs) // 2
            return {**self._plpgsql_errors(conn, pairs[:half]),
                    **self._plpgsql_errors(conn, pairs[half:])}
        for r in rows:
            if str(r.level) == "error":
                key = (int(r.o), int(r.r))
                prev = out[key]
                assert isinstance(prev, tuple)
                out[key] = (*prev, f"line {r.lineno}: {r.message}")
        return out

    def _validate_sql(self, conn: Connection, oids: Sequence[int]) -> dict[int, str | None]:
        """``fmgr_sql_validator`` over many SQL functions; bisects to find the ones that fail."""
        if not oids:
            return {}
        sql = text("SELECT fmgr_sql_validator(o) FROM unnest(CAST(:o AS oid[])) AS o")
        try:
            with conn.begin_nested() as sp:
                conn.execute(sql, {"o": list(oids)}).all()
                sp.rollback()
        except sa.exc.DBAPIError as exc:
            if len(oids) == 1:
                return {oids[0]: first_line(exc.orig)}
            half = len(oids) // 2
            return {**self._validate_sql(conn, oids[:half]),
                    **self._validate_sql(conn, oids[half:])}
        return dict.fromkeys(oids)

    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        return self.statuses(conn, [ref])[ref.key]

    def statuses(self, conn: Connection, refs: Sequence[ObjectRef]) -> dict[str, ObjectStatus]:
        """Check many objects with one query per kind of check (not one per object).

        PL/pgSQL functions and trigger functions (against their table):
        ``plpgsql_check_function_tb``; SQL functions: ``fmgr_sql_validator``;
        views and aggregates: run (a row fetched, a call with typed NULLs); other
        languages: ``unchecked``.  Then the run checks of functions that can be called
        (``_run_call``).  Every run is contained: a read-only savepoint of the caller's
        transaction, rolled back, with the check's time limit.  Bisection finds the
        failing ones when a batch fails.
        """
        out: dict[str, ObjectStatus] = {}
        procs: list[tuple[ObjectRef, Any]] = []
        views: list[tuple[ObjectRef, str]] = []
        plpgsql: list[tuple[ObjectRef, int, int, str]] = []
        runs: list[tuple[str, str, str, str]] = []
        not_run: dict[str, str] = {}
        for ref in refs:
            self.check_kind(ref)
        proc_refs = [r if r.args is not None and r.schema is not None else self.resolve(conn, r)
                     for r in refs if r.kind in _PROC_KINDS]
        found_procs = {str(row.k): row for row in conn.execute(text(
            "SELECT r.k, p.oid, l.lanname, p.prokind, "
            "p.prorettype = 'trigger'::regtype AS is_trigger, "
            "p.prorettype = 'event_trigger'::regtype AS is_event_trigger, "
            "tr.tgrelid AS relid, "
            "quote_ident(ns.nspname) || '.' || quote_ident(p.proname) AS qname, p.pronargs, "
            "p.proisstrict, p.provariadic <> 0 AS variadic, "
            "(SELECT typtype = 'p' AND oid NOT IN ('void'::regtype, 'record'::regtype) "
            "FROM pg_type WHERE oid = p.prorettype) AS pseudo_result, "
            "EXISTS (SELECT 1 FROM unnest(p.proargtypes) a JOIN pg_type ty ON ty.oid = a "
            "WHERE ty.typtype = 'p') AS pseudo_args, "
            "ARRAY(SELECT format_type(a, NULL) FROM unnest(p.proargtypes) a) AS argtypes "
            "FROM unnest(CAST(:k AS text[]), CAST(:s AS text[]), CAST(:n AS text[]), "
            "CAST(:a AS text[])) AS r(k, s, n, a) "
            "JOIN pg_namespace ns ON ns.nspname = r.s "
            "JOIN pg_proc p ON p.pronamespace = ns.oid AND p.proname = r.n "
            "AND oidvectortypes(p.proargtypes) = r.a JOIN pg_language l ON l.oid = p.prolang "
            f"LEFT JOIN ({_FIRST_TRIGGER}) tr ON tr.tgfoid = p.oid"),
            {"k": [r.key for r in proc_refs], "s": [r.schema for r in proc_refs],
             "n": [r.name for r in proc_refs], "a": [r.args or "" for r in proc_refs]}).all()}
        for orig, ref in zip([r for r in refs if r.kind in _PROC_KINDS], proc_refs, strict=True):
            row = found_procs.get(ref.key)
            if row is None:
                out[orig.key] = ObjectStatus(orig, MISSING, (), "pg_proc", CATALOG)
            else:
                procs.append((orig, row))
        view_refs = [r if r.schema is not None else self.resolve(conn, r)
                     for r in refs if r.kind == "view"]
        found_views = {str(row.k): row for row in conn.execute(text(
            "SELECT r.k, quote_ident(n.nspname) AS qs, quote_ident(c.relname) AS qn "
            "FROM unnest(CAST(:k AS text[]), CAST(:s AS text[]), CAST(:n AS text[])) "
            "AS r(k, s, n) JOIN pg_namespace n ON n.nspname = r.s "
            "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = r.n AND c.relkind = 'v'"),
            {"k": [r.key for r in view_refs], "s": [r.schema for r in view_refs],
             "n": [r.name for r in view_refs]}).all()}
        for orig, ref in zip([r for r in refs if r.kind == "view"], view_refs, strict=True):
            vrow = found_views.get(ref.key)
            if vrow is None:
                out[orig.key] = ObjectStatus(orig, MISSING, (), "pg_class", CATALOG)
            else:
                views.append((orig, f"SELECT coalesce(length(x::text), 0) FROM "
                              f"{vrow.qs}.{vrow.qn} x LIMIT 1"))
        for ref in refs:
            if ref.kind != "trigger":
                continue
            trow = self._trigger_row(conn, ref)
            if trow is None:
                out[ref.key] = ObjectStatus(ref, MISSING, (), "pg_trigger", CATALOG)
                continue
            lang = conn.execute(text(
                "SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
                "WHERE p.oid = :o"), {"o": int(trow.tgfoid)}).scalar()
            if lang is None:
                out[ref.key] = ObjectStatus(ref, INVALID, ("trigger function is gone",),
                                            "pg_trigger", CATALOG)
            elif lang != "plpgsql":
                out[ref.key] = ObjectStatus(ref, UNCHECKED, (),
                                            f"language {lang} has no compile check",
                                            NOT_CHECKED)
            else:
                plpgsql.append((ref, int(trow.tgfoid), int(trow.tgrelid),
                                "plpgsql_check_function_tb"))
        sql_fns: list[tuple[ObjectRef, int]] = []
        for ref, row in procs:
            call = self._run_call(row)
            if isinstance(call, tuple):
                runs.append((ref.key, *call, "function"))
            else:
                not_run[ref.key] = call
            if row.prokind == "a":
                probe = self._aggregate_probe(conn, int(row.oid))
                views.append((ref, f"SELECT coalesce(length(x.a::text), 0) FROM "
                                   f"({probe.removesuffix(' LIMIT 0')}) AS x(a)"))
                not_run.pop(ref.key, None)
            elif row.lanname == "plpgsql":
                if row.is_event_trigger:
                    out[ref.key] = ObjectStatus(ref, UNCHECKED, (),
                                                "event trigger functions are not checked",
                                                NOT_CHECKED)
                    continue
                relid = 0
                if row.is_trigger:
                    if row.relid is None:
                        out[ref.key] = ObjectStatus(ref, UNCHECKED, (),
                                                    "trigger function not attached to any table",
                                                    NOT_CHECKED)
                        continue
                    relid = int(row.relid)
                plpgsql.append((ref, int(row.oid), relid, "plpgsql_check_function_tb"))
            elif row.lanname == "sql":
                sql_fns.append((ref, int(row.oid)))
            else:
                out[ref.key] = ObjectStatus(ref, UNCHECKED, (),
                                            f"language {row.lanname} has no compile check",
                                            NOT_CHECKED)
        found_errors = self._plpgsql_errors(conn, [(o, r) for _, o, r, _ in plpgsql])
        for ref, o, r, method in plpgsql:
            errs = found_errors[(o, r)]
            errors = (errs,) if isinstance(errs, str) else errs
            out[ref.key] = ObjectStatus(ref, INVALID if errors else VALID, errors, method)
        validated = self._validate_sql(conn, [o for _, o in sql_fns])
        for ref, o in sql_fns:
            err = validated[o]
            out[ref.key] = ObjectStatus(ref, INVALID if err else VALID,
                                        (err,) if err else (), "fmgr_sql_validator",
                                        covers=False)
        # a view (an aggregate) is checked by running it: a row fetched (a call with typed
        # NULLs), planned and executed in one go -- EXPLAIN would only plan it, and not run
        # the functions under it; a failure is the object's error, as a compile error was
        fetched = self._run_checks(conn, [q for _, q in views])
        for (ref, _), (outcome, error) in zip(views, fetched, strict=True):
            how = "called it with NULL arguments" if ref.kind == "aggregate" else \
                "fetched a row from it"
            if outcome == RUN_ERROR:
                out[ref.key] = ObjectStatus(ref, INVALID, (error,), f"{how} (contained)",
                                            EXECUTED)
                continue
            run, detail = _run_verdict((outcome, error), how, ref.kind)
            out[ref.key] = ObjectStatus(ref, VALID, (), "planned and run", EXECUTED,
                                        covers=False, run=run, run_detail=detail)
        # the run checks of functions: what compiles may still fail when it runs (a record
        # function whose result changed shape under a SQL function) -- compiled ones only
        todo = [r for r in runs if out.get(r[0]) is not None and out[r[0]].ok]
        for (key, _, how, kind), result in zip(todo, self._run_checks(conn, [
                r[1] for r in todo]), strict=True):
            out[key] = out[key].with_run(*_run_verdict(result, how, kind))
        for key, why in not_run.items():
            if key in out and out[key].ok and out[key].run is None:
                out[key] = out[key].with_run(NOT_RUN, why)
        return out

    @staticmethod
    def _run_call(row: Any) -> tuple[str, str] | str:
        """The contained call that runs one function, and what it does; or why none is made.

        A function without arguments is called; a ``LANGUAGE sql`` function that is not
        STRICT is called with typed NULLs (its body runs -- a record function read with a
        column list that no longer matches fails here, which ``fmgr_sql_validator``
        does not see).  Procedures, trigger functions, STRICT functions with
        arguments, variadic and polymorphic ones are not called.
        """
        if row.prokind == "p":
            return "a procedure is not called by the check (CALL could do anything it may)"
        if row.prokind == "a":
            return ""
        if row.pseudo_result:
            return "returns a pseudo-type (trigger, internal...): it cannot be called alone"
        if row.variadic or row.pseudo_args:
            return "takes variadic or polymorphic arguments: no call can be written for it"
        if int(row.pronargs) == 0:
            call, how = f"{row.qname}()", "called it"
        elif row.lanname != "sql":
            return (f"takes arguments: not called ({row.lanname} bodies are checked by "
                    "their checker)" if row.lanname == "plpgsql" else
                    f"takes arguments: not called (language {row.lanname})")
        elif row.proisstrict:
            return "STRICT with arguments: a call with NULL arguments would not run its body"
        else:
            nulls = ", ".join(f"NULL::{t}" for t in row.argtypes)
            call, how = f"{row.qname}({nulls})", "called it with NULL arguments"
        return (f"SELECT coalesce(length(s.r::text), 0) FROM (SELECT {call} AS r) AS s "
                "LIMIT 1", how)

    def _run_checks(self, conn: Connection, queries: Sequence[str]) -> list[tuple[str, str]]:
        """Run many one-row queries in one statement, contained; bisect to the failing ones.

        In a read-only savepoint of the caller's transaction (the verification's: it sees
        the new code) with the loop's time limit per statement; always rolled back.
        Returns per query ``(outcome, detail)``: ``row`` / ``no_row`` / ``error`` /
        ``writes`` / ``timed_out`` and the error's first line.
        """
        if not queries:
            return []
        sql = " UNION ALL ".join(f"SELECT {i} AS i, ({q}) AS v" for i, q in enumerate(queries))
        try:
            with conn.begin_nested() as sp:
                conn.execute(text("SET LOCAL transaction_read_only = on"))
                conn.execute(text(f"SET LOCAL statement_timeout = '{_ms(self.run_timeout)}'"))
                rows = conn.exec_driver_sql(sql, execution_options={"no_parameters": True}).all()
                sp.rollback()
        except sa.exc.DBAPIError as exc:
            if len(queries) == 1:
                state = getattr(exc.orig, "sqlstate", None)
                kind = {"25006": RUN_WRITES, "57014": RUN_TIMED_OUT}.get(str(state), RUN_ERROR)
                return [(kind, first_line(exc.orig))]
            half = len(queries) // 2
            return self._run_checks(conn, queries[:half]) + self._run_checks(
                conn, queries[half:])
        got = {int(r[0]): r[1] for r in rows}
        return [("row" if got.get(i) is not None else NO_ROW, "") for i in range(len(queries))]

    def _aggregate_probe(self, conn: Connection, oid: int) -> str:
        """A call of the aggregate with typed NULLs, for EXPLAIN (ordered-set ones included)."""
        row = conn.execute(text(
            "SELECT quote_ident(n.nspname) || '.' || quote_ident(p.proname) AS qname, "
            "a.aggkind, a.aggnumdirectargs, "
            "ARRAY(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) t) AS types "
            "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "JOIN pg_aggregate a ON a.aggfnoid = p.oid WHERE p.oid = :o"), {"o": oid}).one()
        nulls = [f"NULL::{t}" for t in row.types]
        if row.aggkind in ("o", "h"):
            direct = nulls[: row.aggnumdirectargs]
            ordered = nulls[row.aggnumdirectargs:] or nulls[-1:]
            return (f"SELECT {row.qname}({', '.join(direct)}) WITHIN GROUP "
                    f"(ORDER BY {', '.join(ordered)}) LIMIT 0")
        return f"SELECT {row.qname}({', '.join(nulls)}) LIMIT 0"

    def recompile(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        """PostgreSQL compiles on use; re-checking the one object is the equivalent."""
        return self.status(conn, ref)

    def sweep(self, conn: Connection, refs: Sequence[ObjectRef],
              before: Mapping[str, ObjectStatus]) -> dict[str, ObjectStatus]:
        return self.statuses(conn, refs)

    # -- dependents and callers ---------------------------------------------------------
    def _target_node(self, conn: Connection, ref: ObjectRef) -> Node | None:
        if ref.kind in _PROC_KINDS:
            row = self._proc_row(conn, ref)
            return None if row is None else ("pg_proc", int(row.oid))
        if ref.kind == "view":
            vrow = self._view_row(conn, ref)
            return None if vrow is None else ("pg_class", int(vrow.oid))
        return None

    def _proc_ref(self, row: Any) -> ObjectRef:
        return ObjectRef(_kind_of(row.prokind), str(row.proname), str(row.nspname),
                         str(row.args))

    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        """Direct dependents only (``dependents_many`` follows the chain)."""
        return [d for d in self.dependents_many(conn, [ref], progress) if d.depth == 1]

    def dependents_many(self, conn: Connection, refs: Sequence[ObjectRef],
                        progress: Progress | None = None) -> list[Dependent]:
        """Every object in scope that uses one of ``refs``, transitively, nearest first.

        One graph is read per sweep: the ``pg_depend`` edges of views, functions,
        aggregates and triggers in scope; ``plpgsql_show_dependency_tb`` of every
        PL/pgSQL function in scope, in one query; and the string bodies of
        ``LANGUAGE sql`` functions parsed by ``pglast`` (names matched in scope).
        """
        targets: dict[Node, ObjectRef] = {}
        for ref in refs:
            self.check_kind(ref)
            node = self._target_node(conn, ref)
            if node is not None:
                targets[node] = ref
        if not targets:
            return []
        scopes = sorted({s for r in refs for s in self.scopes(r)})
        rev: dict[Node, list[tuple[Node, ObjectRef, str]]] = {}
        names: dict[Node, ObjectRef] = dict(targets)

        def edge(dep: Node, dep_ref: ObjectRef, on: Node, via: str) -> None:
            if dep != on:
                rev.setdefault(on, []).append((dep, dep_ref, via))
                names.setdefault(dep, dep_ref)

        for row in conn.execute(text(_PG_DEPEND_EDGES), {"s": scopes}).all():
            if row.kind == "view":
                dref = ObjectRef("view", str(row.name), str(row.schema))
            elif row.kind == "trigger":
                dref = ObjectRef("trigger", str(row.name), str(row.schema),
                                 parent=str(row.parent))
            else:
                dref = ObjectRef(str(row.kind), str(row.name), str(row.schema), str(row.args))
            edge((str(row.ncls), int(row.noid)), dref, (str(row.rcls), int(row.roid)),
                 "pg_depend")
        plpgsql_edges, unreadable = self._plpgsql_edges(conn, scopes)
        for dep, dref, on in plpgsql_edges:
            edge(dep, dref, on, "plpgsql_check")
        sql_refs = [(n, r, q, name, "sql body") for n, r, q, name in
                    self._sql_body_refs(conn, scopes)]
        # a PL/pgSQL body the checker cannot read (a broken one) is matched by its words
        for node, pref, src in unreadable:
            for word in sorted(set(re.findall(r"[a-z_][a-z0-9_$]*", src.lower()))):
                sql_refs.append((node, pref, None, word, "source search (unreadable body)"))
        out: list[Dependent] = []
        seen: set[Node] = set(targets)
        frontier = list(targets)
        depth = 0
        while frontier:
            depth += 1
            nxt: list[Node] = []
            for node in frontier:
                on_ref = names[node]
                found = list(rev.get(node, ()))
                for (sql_node, sql_ref, qualifier, name, how) in sql_refs:
                    if name == on_ref.name and (qualifier is None or qualifier == on_ref.schema):
                        found.append((sql_node, sql_ref, how))
                for dep, dref, via in found:
                    if dep in seen:
                        continue
                    seen.add(dep)
                    names.setdefault(dep, dref)
                    out.append(Dependent(dref, on_ref, via, depth))
                    if dep[0] != "pg_trigger":
                        nxt.append(dep)
            frontier = nxt
        if progress is not None:
            for i, d in enumerate(out, start=1):
                progress(i, len(out), d.object.key)
        return out

    def _plpgsql_edges(self, conn: Connection, scopes: Sequence[str]
                       ) -> tuple[list[tuple[Node, ObjectRef, Node]],
                                  list[tuple[Node, ObjectRef, str]]]:
        """(function, its ref, what it uses) for every PL/pgSQL function in scope, one query;
        and the functions whose body the checker could not read at all."""
        cands = conn.execute(text(
            "SELECT p.oid, p.proname, n.nspname, oidvectortypes(p.proargtypes) AS args, "
            "p.prokind, COALESCE(tr.tgrelid, 0) AS relid, "
            "p.prorettype = 'trigger'::regtype AS is_trigger, p.prosrc "
            "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "JOIN pg_language l ON l.oid = p.prolang "
            f"LEFT JOIN ({_FIRST_TRIGGER}) tr ON tr.tgfoid = p.oid "
            "WHERE l.lanname = 'plpgsql' AND n.nspname = ANY(:s) "
            "AND p.prorettype <> 'event_trigger'::regtype"), {"s": list(scopes)}).all()
        cands = [c for c in cands if not (c.is_trigger and not c.relid)]
        if not cands:
            return [], []
        ext = self._ext(conn)
        sql = text(
            "SELECT c.o, d.type, d.oid AS ref FROM unnest(CAST(:o AS oid[]), "
            "CAST(:r AS oid[])) AS c(o, r) CROSS JOIN LATERAL "
            f"{ext}.plpgsql_show_dependency_tb(CAST(c.o AS regprocedure), "
            "CAST(c.r AS regclass)) AS d")
        by_oid = {int(c.oid): c for c in cands}

        unreadable: list[Any] = []

        def scan(batch: list[Any]) -> list[Any]:
            try:
                with conn.begin_nested() as sp:
                    rows = conn.execute(sql, {"o": [int(c.oid) for c in batch],
                                              "r": [int(c.relid) for c in batch]}).all()
                    sp.rollback()
            except sa.exc.DBAPIError:
                if len(batch) == 1:
                    unreadable.append(batch[0])  # e.g. it reads a table that is gone
                    return []
                half = len(batch) // 2
                return scan(batch[:half]) + scan(batch[half:])
            return list(rows)

        out: list[tuple[Node, ObjectRef, Node]] = []
        rows = scan(cands)
        listed = {int(r.o) for r in rows}
        # no dependency listed: the checker could not resolve the body (it reads a table that
        # is gone, say) -- such a function is matched by the words of its body instead
        unreadable += [c for c in cands if int(c.oid) not in listed and c not in unreadable]
        for row in rows:
            cand = by_oid[int(row.o)]
            kind = str(row.type).upper()
            if kind in ("FUNCTION", "PROCEDURE"):
                on: Node = ("pg_proc", int(row.ref))
            elif kind == "RELATION":
                on = ("pg_class", int(row.ref))
            else:
                continue
            out.append((("pg_proc", int(cand.oid)), self._proc_ref(cand), on))
        return out, [(("pg_proc", int(c.oid)), self._proc_ref(c), str(c.prosrc))
                     for c in unreadable]

    def _sql_body_refs(self, conn: Connection, scopes: Sequence[str]
                       ) -> list[tuple[Node, ObjectRef, str | None, str]]:
        """Names used by ``LANGUAGE sql`` functions with string bodies (not in ``pg_depend``).

        Each body is parsed with ``pglast``; function calls and relations are kept
        as ``(qualifier, name)`` and matched by name against the objects of the
        sweep.  Overloads are not told apart (every overload's callers are swept).
        """
        from pglast import parse_sql
        from pglast.parser import ParseError
        from pglast.visitors import Visitor

        rows = conn.execute(text(
            "SELECT p.oid, p.proname, n.nspname, oidvectortypes(p.proargtypes) AS args, "
            "p.prokind, p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "JOIN pg_language l ON l.oid = p.prolang WHERE l.lanname = 'sql' "
            "AND p.prosqlbody IS NULL AND n.nspname = ANY(:s)"), {"s": list(scopes)}).all()

        class _Names(Visitor):
            def __init__(self) -> None:
                self.found: set[tuple[str | None, str]] = set()

            def visit_FuncCall(self, ancestors: Any, node: Any) -> None:
                parts = [str(x.sval) for x in node.funcname]
                self.found.add((parts[-2] if len(parts) > 1 else None, parts[-1]))

            def visit_RangeVar(self, ancestors: Any, node: Any) -> None:
                self.found.add((node.schemaname, str(node.relname)))

        out: list[tuple[Node, ObjectRef, str | None, str]] = []
        for row in rows:
            try:
                tree = parse_sql(str(row.prosrc))
            except ParseError:
                continue
            names = _Names()
            names(tree)
            for qualifier, name in sorted(names.found, key=lambda x: (x[0] or "", x[1])):
                out.append((("pg_proc", int(row.oid)), self._proc_ref(row), qualifier, name))
        return out

    def remote_dependents(self, far: Connection, ref: ObjectRef, link: str) -> list[Dependent]:
        """Foreign tables of the far database that read ``ref`` through foreign server ``link``.

        ``postgres_fdw`` keeps the remote name in the foreign table's options
        (``schema_name`` defaults to the foreign table's own schema, ``table_name``
        to its own name); the far side's catalog is the only place that knows.
        """
        rows = far.execute(text(
            "SELECT c.relname, n.nspname, ft.ftoptions FROM pg_foreign_table ft "
            "JOIN pg_class c ON c.oid = ft.ftrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_foreign_server s ON s.oid = ft.ftserver WHERE s.srvname = :l "
            "ORDER BY n.nspname, c.relname"), {"l": link}).all()
        out: list[Dependent] = []
        for r in rows:
            opts = dict(str(o).split("=", 1) for o in (r.ftoptions or []) if "=" in str(o))
            if (opts.get("table_name", str(r.relname)) == ref.name
                    and opts.get("schema_name", str(r.nspname)) == ref.schema):
                out.append(Dependent(ObjectRef("foreign_table", str(r.relname), str(r.nspname),
                                               link=link), ref, "pg_foreign_table on the far side"))
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
        if ref.kind in _PROC_KINDS:
            row = self._proc_row(conn, ref)
            if row is None:
                return
            word = {"p": "PROCEDURE", "a": "AGGREGATE"}.get(str(row.prokind), "FUNCTION")
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

    def restore(self, conn: Connection, ref: ObjectRef, source: str,
                attributes: Mapping[str, str]) -> list[str]:
        """Re-apply a snapshot; a view whose columns changed is dropped and re-created.

        ``CREATE OR REPLACE VIEW`` cannot remove the column a change added
        (``cannot drop columns from view``).  Then, in the compensation's own
        transaction, the view and the views built on it are dropped and
        re-created from their definitions, with their owners, grants and
        comments; anything else built on them (a function body, a materialized
        view, a trigger, column grants) is refused rather than lost.
        """
        if ref.kind != "view":
            self.apply(conn, ref, source, attributes)
            return []
        with conn.begin_nested() as sp:
            try:
                self.apply(conn, ref, source, attributes)
                return []
            except ApplyFailed as exc:
                sp.rollback()
                if exc.details.get("sqlstate") != _VIEW_COLUMNS_CHANGED:
                    raise
        return self._recreate_view(conn, ref, source)

    def _recreate_view(self, conn: Connection, ref: ObjectRef, source: str) -> list[str]:
        vrow = self._view_row(conn, ref)
        if vrow is None:
            self.apply(conn, ref, source, {})
            return []
        views = [ref] + [d.object for d in self.dependents_many(conn, [ref])]
        blockers = [r.key for r in views if r.kind != "view"]
        if blockers:
            raise ApplyFailed(
                f"{ref.key} changed its columns and cannot be replaced in place; dropping and "
                f"re-creating it would drop {', '.join(blockers)} too -- restore by hand",
                object=ref.key, blockers=blockers)
        saved: list[tuple[ObjectRef, str, list[str]]] = []
        for view in views:
            row = self._view_row(conn, view)
            live = self.read(conn, view)
            assert row is not None and live is not None
            extra = self._view_extras(conn, int(row.oid), f"{row.qs}.{row.qn}")
            saved.append((view, live.source, extra))
        conn.execute(text(f"DROP VIEW {vrow.qs}.{vrow.qn} CASCADE"))
        self.apply(conn, ref, source, {})
        for view, src, _ in saved[1:]:
            self.apply(conn, view, src, {})
        for _, _, extra in saved:
            for stmt in extra:
                conn.exec_driver_sql(stmt, execution_options={"no_parameters": True})
        names = ", ".join(v.key for v, _, _ in saved[1:]) or "none"
        return [f"dropped and re-created {ref.key} (CREATE OR REPLACE cannot remove columns); "
                f"re-created dependent views: {names}; owners, grants and comments restored"]

    def _view_extras(self, conn: Connection, oid: int, qname: str) -> list[str]:
        """Owner, grants and comments of a view, as statements that restore them."""
        if conn.execute(text("SELECT count(*) FROM pg_attribute WHERE attrelid = :o "
                             "AND attacl IS NOT NULL"), {"o": oid}).scalar():
            raise ApplyFailed(f"view {qname} has column grants; re-creating it would lose "
                              "them -- restore by hand", object=qname)
        out = [str(conn.execute(text(
            "SELECT format('ALTER VIEW %s OWNER TO %I', CAST(:q AS text), "
            "pg_get_userbyid(relowner)) FROM pg_class WHERE oid = :o"),
            {"q": qname, "o": oid}).scalar_one())]
        out += [str(r[0]) for r in conn.execute(text(
            "SELECT format('GRANT %s ON %s TO %s%s', a.privilege_type, CAST(:q AS text), "
            "CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) "
            "END, CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END) "
            "FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a "
            "WHERE c.oid = :o AND a.grantee <> c.relowner"), {"q": qname, "o": oid})]
        out += [str(r[0]) for r in conn.execute(text(
            "SELECT format('COMMENT ON VIEW %s IS %L', CAST(:q AS text), d.description) "
            "FROM pg_description d WHERE d.objoid = :o AND d.classoid = 'pg_class'::regclass "
            "AND d.objsubid = 0 UNION ALL "
            "SELECT format('COMMENT ON COLUMN %s.%I IS %L', CAST(:q AS text), a.attname, "
            "d.description) FROM pg_description d JOIN pg_attribute a ON a.attrelid = d.objoid "
            "AND a.attnum = d.objsubid WHERE d.objoid = :o "
            "AND d.classoid = 'pg_class'::regclass AND d.objsubid > 0"), {"q": qname, "o": oid})]
        return out

    @contextmanager
    def ddl_session(self, conn: Connection, lock_timeout: float) -> Iterator[None]:
        """``SET LOCAL lock_timeout``: the DDL waits at most the row's lock seconds."""
        conn.execute(text(f"SET LOCAL lock_timeout = '{_ms(lock_timeout)}'"))
        yield

    @contextmanager
    def read_only(self, conn: Connection) -> Iterator[None]:
        """A savepoint made read-only (``SET LOCAL transaction_read_only``), always rolled back.

        PostgreSQL lets a transaction that already wrote become read-only (only the
        opposite is refused), so a smoke call inside the apply's transaction sees
        the new code and still cannot write: an ``INSERT`` in the function raises
        ``cannot execute INSERT in a read-only transaction``.
        """
        with conn.begin_nested() as sp:
            try:
                conn.execute(text("SET LOCAL transaction_read_only = on"))
                yield
            finally:
                if sp.is_active:
                    sp.rollback()

    # -- smoke calls and run-time checks: contained in a read-only savepoint -------------------
    def check_smoke(self, name: str, sql: str) -> None:
        """One ``SELECT`` (``VALUES``, ``WITH ... SELECT``) or one ``CALL``, by PostgreSQL's parser.

        Refused (CG531): more than one statement (sent over the simple protocol a
        ``SELECT ...; COMMIT; UPDATE ...`` would commit the verification), any
        other statement (``COMMIT``, ``SAVEPOINT``, ``SET``, DDL, ``DO``...), a
        ``SELECT ... INTO`` (it creates a table) and a data-modifying ``WITH``.
        """
        from pglast import parse_sql
        from pglast.parser import ParseError
        from pglast.visitors import Visitor

        # ``:name`` binds (SQLAlchemy's text() syntax) read as the server's ``$n`` parameters
        numbered: dict[str, int] = {}
        positional = _BIND.sub(
            lambda m: f"${numbered.setdefault(m.group(1), len(numbered) + 1)}", sql)
        try:
            stmts = parse_sql(positional)
        except ParseError as exc:
            raise refuse(name, sql, f"it does not parse ({exc})") from None
        if len(stmts) != 1:
            raise refuse(name, sql, "it is empty" if not stmts else
                         f"it holds {len(stmts)} statements")
        stmt: Any = stmts[0].stmt
        kind = type(stmt).__name__
        if kind == "CallStmt":
            return
        if kind != "SelectStmt":
            word = {"TransactionStmt": "transaction control", "VariableSetStmt": "a SET",
                    "DoStmt": "a DO block", "InsertStmt": "an INSERT", "UpdateStmt": "an UPDATE",
                    "DeleteStmt": "a DELETE", "MergeStmt": "a MERGE"}.get(kind, kind)
            raise refuse(name, sql, f"it is {word}")
        if stmt.intoClause is not None:
            raise refuse(name, sql, "SELECT ... INTO creates a table")

        class _Writes(Visitor):
            found: list[str] = []

            def visit_InsertStmt(self, ancestors: Any, node: Any) -> None:
                self.found.append("INSERT")

            def visit_UpdateStmt(self, ancestors: Any, node: Any) -> None:
                self.found.append("UPDATE")

            def visit_DeleteStmt(self, ancestors: Any, node: Any) -> None:
                self.found.append("DELETE")

            def visit_MergeStmt(self, ancestors: Any, node: Any) -> None:
                self.found.append("MERGE")

        writes = _Writes()
        writes.found = []
        writes(stmts)
        if writes.found:
            raise refuse(name, sql, f"it holds a data-modifying {writes.found[0]}")

    def _transaction_id(self, conn: Connection) -> tuple[str, str | None]:
        """The verification transaction's identity: its start time and its id, if assigned."""
        row = conn.execute(text("SELECT transaction_timestamp()::text, "
                                "pg_current_xact_id_if_assigned()::text")).one()
        return str(row[0]), None if row[1] is None else str(row[1])

    def run_contained(self, conn: Connection, calls: Sequence[ContainedCall],
                      timeout: float, *, isolate: bool = True) -> list[Ran]:
        """Each call as one statement over the extended protocol, in a read-only savepoint.

        Inside the caller's transaction (the verification's, which holds the new
        code): ``SET LOCAL transaction_read_only`` (a transaction that already
        wrote may still become read-only; the reverse is refused, inside a
        subtransaction always) and ``statement_timeout``, then the statement
        sent with ``prepare=True`` -- Parse/Bind/Execute, which runs exactly one
        statement -- and the savepoint rolled back.  The transaction's identity
        (start time and id) is compared before and after: a call that ended it
        is reported as ``escaped``, never as a plain failure.
        """
        out: list[Ran] = []
        for call in calls:
            if call.session:  # a failed check, never an exception in the middle of a verify
                out.append(Ran(error=f"PostgreSQL takes no session settings for a check "
                                     f"({', '.join(sorted(call.session))})"))
                continue
            before = self._transaction_id(conn)
            ran = Ran(error="not run")
            sp = conn.begin_nested()
            rollback_error: str | None = None
            try:
                conn.execute(text("SET LOCAL transaction_read_only = on"))
                conn.execute(text(f"SET LOCAL statement_timeout = '{_ms(timeout)}'"))
                ran = self._run_extended(conn, call)
            finally:
                try:
                    if sp.is_active:
                        sp.rollback()
                except sa.exc.DBAPIError as exc:
                    rollback_error = first_line(exc.orig)
            after = None if rollback_error else self._transaction_id(conn)
            if rollback_error or after != before:
                why = (f"the savepoint was gone afterwards ({rollback_error})" if rollback_error
                       else "the verification transaction was not the same one afterwards")
                ran = Ran(ran.row, ran.returned_rows, ran.error, ran.writes, ran.timed_out,
                          f"it ended the verification transaction: {why}")
            out.append(ran)
        return out

    def _run_extended(self, conn: Connection, call: ContainedCall) -> Ran:
        """One statement, Parse/Bind/Execute (``prepare=True``), binds from ``:name``."""
        import psycopg

        try:
            compiled = sa.text(call.sql).compile(dialect=conn.dialect)
            params = compiled.construct_params(dict(call.binds))
        except sa.exc.SQLAlchemyError as exc:
            return Ran(error=first_line(exc))
        dbapi: Any = conn.connection.dbapi_connection
        assert dbapi is not None
        cur = dbapi.cursor()
        try:
            cur.execute(compiled.string, dict(params), prepare=True)
            if cur.description is None:
                return Ran(None, False)
            row = cur.fetchone()
            return Ran(None if row is None else tuple(row), True)
        except psycopg.Error as exc:
            state = getattr(exc, "sqlstate", None)
            return Ran(error=first_line(exc), writes=state == "25006",
                       timed_out=state == "57014")
        finally:
            cur.close()

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
