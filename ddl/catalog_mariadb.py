"""MariaDB catalog adapter: procedures, functions, views, triggers, packages and package bodies.

* Source: ``SHOW CREATE PROCEDURE|FUNCTION|VIEW|TRIGGER|PACKAGE|PACKAGE BODY``;
  existence and names from ``information_schema.ROUTINES`` / ``VIEWS`` /
  ``TRIGGERS``.  The routine's ``sql_mode`` is part of the snapshot and is set
  again when a snapshot is re-applied (packages need ``sql_mode=ORACLE``).
* Normalisation drops the ``DEFINER=`` clause (who created it, not what it
  is), ``OR REPLACE``, identifier quotes around the name, a schema prefix and
  the ``END name`` label MariaDB does not store.  For packages and triggers
  the normalised source is exactly what ``SHOW CREATE`` shows after the
  apply.  For procedures and functions MariaDB re-renders the characteristics
  and the return type, and a view's text is rewritten completely, so their
  post-apply text cannot be predicted; recovery compares the stored routine
  body (``ROUTINES.ROUTINE_DEFINITION``) with the tail of the new source, and
  cannot decide for views.
* Compile status: MariaDB has none -- no INVALID state; routines resolve
  tables and other routines when they run.  The closest honest checks are
  used and reported as such: the object is stored and ``SHOW CREATE`` reads it
  back; a package body exists next to its spec (MariaDB checks the body
  against the spec at ``CREATE``, and *drops the body* when the spec is
  replaced); a view passes ``CHECK TABLE`` (which names invalid tables and
  columns); a trigger's table exists.  Runtime behaviour needs the plan's
  smoke calls.
* Dependents and callers: there is no dependency catalog, so both come from a
  whole-word search of stored source (routines and packages, views,
  triggers); a spec's body is always a dependent of the spec.
* DDL commits implicitly: the loop records "apply started" first and
  compensates on a failed verify.  Lock: ``GET_LOCK`` (session scoped).
* The signature covers what changes behaviour besides the text: the routine's
  ``sql_mode`` and its ``DEFINER`` (``SQL SECURITY`` and ``DETERMINISTIC`` are
  in the ``SHOW CREATE`` text already).  An apply keeps the live definer by
  writing it into the applied text when the source names none -- which needs
  ``SET USER`` (or ``SUPER``); without it the plan is refused (CG529), since
  compensation could not put the definer back.
* A source is one definition: the block structure over sqlglot's tokens, and
  the server's own parser through ``PREPARE`` (which runs nothing); the
  connection has no ``MULTI_STATEMENTS``, so the server never runs a second
  statement either.  Smoke calls run in ``START TRANSACTION READ ONLY``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import sqlalchemy as sa
from sqlalchemy import bindparam, text
from sqlalchemy.engine import URL, Connection, Engine

from capgate.ddl import signature as sigmod
from capgate.ddl import source as srcmod
from capgate.ddl import sqltext
from capgate.ddl.catalog import (
    CATALOG,
    INVALID,
    MISSING,
    NO_ROW,
    NOT_RUN,
    RAN,
    READ_BACK,
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
    Progress,
    first_line,
)
from capgate.ddl.smoke import ContainedCall, Ran
from capgate.registry.errors import (
    DefinerCannotBeKept,
    FeatureNotSupported,
    SourceDoesNotParse,
    SourceNotVisible,
)

ROUTINE_TYPE = {
    "package": "PACKAGE",
    "package_body": "PACKAGE BODY",
    "procedure": "PROCEDURE",
    "function": "FUNCTION",
}
KIND_OF_ROUTINE_TYPE = {v: k for k, v in ROUTINE_TYPE.items()}
SHOW_WORD = {**ROUTINE_TYPE, "view": "VIEW", "trigger": "TRIGGER"}
_CASE_INSENSITIVE = {"package", "package_body", "procedure", "function"}


def _q(name: str, what: str = "identifier") -> str:
    return MariadbAdapter.quote(name, what)


_DEFINER_CLAUSE = re.compile(r"\bDEFINER\s*=\s*(" + sqltext._DEFINER_PART + r"(?:\s*@\s*"
                             + sqltext._DEFINER_PART + r")?|CURRENT_USER(?:\s*\(\s*\))?)",
                             re.IGNORECASE)


def definer_of(source: str) -> str | None:
    """The ``DEFINER=`` of a ``CREATE`` header as ``user@host`` (quotes dropped), if any."""
    m = sqltext.header_match(source)
    if m is None:
        return None
    d = _DEFINER_CLAUSE.search(m.group("mods"))
    if d is None:
        return None
    found = d.group(1)
    if found.upper().startswith("CURRENT_USER"):
        return "CURRENT_USER"
    user, _, host = found.partition("@")
    return user.strip().strip("`'\"") + "@" + host.strip().strip("`'\"")


def _quoted_definer(definer: str) -> str:
    user, _, host = definer.rpartition("@")
    if "`" in definer or "\n" in definer:
        raise FeatureNotSupported(f"definer {definer!r} cannot be written back")
    return f"`{user}`@`{host}`"


_INVOKER = re.compile(r"\bSQL\s+SECURITY\s+INVOKER\b", re.IGNORECASE)


def _runs_as_invoker(source: str) -> bool:
    """Whether a routine's or view's source declares ``SQL SECURITY INVOKER``."""
    return _INVOKER.search(sqltext.mask(source, strings=True)) is not None


def _run_outcome(r: Ran, how: str, kind: str) -> tuple[str, str]:
    """One contained run as ``ObjectStatus.run`` and its detail in words."""
    if r.escaped is not None:
        return RUN_ERROR, f"it left its containment: {r.escaped}"
    if r.error is not None:
        if r.writes:
            return RUN_WRITES, f"{how}: it tried to write and was refused -- ran up to there"
        if r.timed_out:
            return RUN_TIMED_OUT, f"{how}: stopped at the check's time limit"
        return RUN_ERROR, r.error
    if r.row is None and kind == "view":
        return NO_ROW, ("fetched no row from it: the functions it applies per row did not "
                        "run (contained, read-only XA transaction)")
    return RAN, f"{how} (contained, read-only XA transaction)"


class MariadbAdapter(BaseAdapter, name="mariadb"):
    plain_identifier = re.compile(r"^[A-Za-z0-9_$]{1,64}$")
    identifier_quote = "`"
    transactional_ddl = False
    kinds = frozenset({"package", "package_body", "procedure", "function", "view", "trigger"})
    fold = None
    sqlglot_dialect = "mysql"

    def plsql(self, attributes: Mapping[str, str]) -> bool:
        return "ORACLE" in str(attributes.get("sql_mode", "")).upper().split(",")

    def privilege_changes(self, ref: ObjectRef, base: str | None, new: str) -> list[str]:
        """``SQL SECURITY INVOKER`` dropped: the object starts running with its definer's rights.

        MariaDB's default is DEFINER (``SHOW CREATE`` prints ``SQL SECURITY
        INVOKER`` on a routine only when it is set, on a view always), so a
        replacement that leaves the clause out turns an invoker's routine into
        one every caller runs with the definer's privileges.  (Who the definer
        is, the plan says with CG529's note; a new object runs as its definer
        like every MariaDB routine, which is not news.)
        """
        if base is None or ref.kind not in ("function", "procedure", "view"):
            return []
        if _runs_as_invoker(base) and not _runs_as_invoker(new):
            return [f"{ref.key}: the new source runs with its definer's rights (SQL SECURITY "
                    "DEFINER, MariaDB's default when the clause is left out), where the live "
                    "one runs with its caller's (SQL SECURITY INVOKER): every account that "
                    "may use it acts with the definer's privileges inside it"]
        return []

    def parse_definition(self, conn: Connection | None, ref: ObjectRef, source: str,
                         attributes: Mapping[str, str]) -> None:
        """The block structure over sqlglot's tokens, then the server's parser (``PREPARE``).

        ``PREPARE`` parses the text as one statement under the routine's
        ``sql_mode`` and runs nothing; a syntax error there (1064) means the text
        is not one definition.  Other errors (a package body whose spec is created
        in the same plan) leave the verdict to the token scan.
        """
        srcmod.parse_blocks(source, ref.kind, "mysql", plsql=self.plsql(attributes),
                            what=ref.key)
        if conn is None:
            return
        settings = {k: v for k, v in attributes.items() if k == "sql_mode"}
        with self.session(conn, settings):
            try:
                conn.execute(text("PREPARE cg_ddl_parse FROM :s"),
                             {"s": self.sql_source(ref, source)})
            except sa.exc.DBAPIError as exc:
                code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
                if code == 1064:
                    raise SourceDoesNotParse(
                        f"the source of {ref.key} does not parse as one MariaDB statement: "
                        f"{first_line(exc.orig)}", object=ref.key,
                        database_error=first_line(exc.orig)) from None
                return
            conn.execute(text("DEALLOCATE PREPARE cg_ddl_parse"))

    def default_attributes(self, conn: Connection, ref: ObjectRef) -> dict[str, str]:
        """A new object's definer is the applying account (``CURRENT_USER()``)."""
        out = {"definer": str(conn.execute(text("SELECT CURRENT_USER()")).scalar())}
        if ref.kind in ("package", "package_body"):
            out["sql_mode"] = "ORACLE"
        return out

    def preconditions(self, conn: Connection, ref: ObjectRef, source: str,
                      attributes: Mapping[str, str], exists: bool) -> list[str]:
        """Refuse (CG529) an apply that would change the definer and could not be undone."""
        if not exists:
            return []
        wanted = definer_of(source) or attributes.get("definer")
        current = str(conn.execute(text("SELECT CURRENT_USER()")).scalar())
        if not wanted or wanted in (current, "CURRENT_USER"):
            return []
        if self._may_set_definer(conn):
            return [f"{ref.key}: keeps DEFINER={wanted} (the applying account {current} holds "
                    "SET USER)"]
        raise DefinerCannotBeKept(
            f"{ref.key} is defined by {wanted}; the applying account {current} may not set "
            "DEFINER (it needs SET USER or SUPER), so the apply would make it the definer and "
            "compensation could not restore the old one -- grant SET USER or apply as the "
            "definer", object=ref.key, definer=wanted, account=current)

    def _may_set_definer(self, conn: Connection) -> bool:
        current = str(conn.execute(text("SELECT CURRENT_USER()")).scalar())
        user, _, host = current.rpartition("@")
        grantees = conn.execute(text(
            "SELECT GRANTEE FROM information_schema.USER_PRIVILEGES "
            "WHERE PRIVILEGE_TYPE IN ('SET USER', 'SUPER')")).scalars().all()
        return f"'{user}'@'{host}'" in {str(g) for g in grantees}

    def signed_text(self, ref: ObjectRef, source: str, attributes: Mapping[str, str]) -> str:
        """``sql_mode`` and definer lines in front of the normalised text (recipe v2)."""
        head = ""
        if ref.kind != "view" and attributes.get("sql_mode") is not None:
            modes = ",".join(sorted(m for m in str(attributes["sql_mode"]).upper().split(",")
                                    if m))
            head += f"-- sql_mode: {modes}\n"
        definer = definer_of(source) or attributes.get("definer")
        if definer:
            head += f"-- definer: {definer}\n"
        return head + self.normalise(ref, source)

    def appliable(self, ref: ObjectRef, normalised: str) -> str:
        """Normalisation drops ``OR REPLACE``; a merge proposal must apply over the live object."""
        return re.sub(r"^(\s*CREATE)\s+(?!OR\s+REPLACE\b)", r"\1 OR REPLACE ", normalised,
                      count=1, flags=re.IGNORECASE)

    def engine(self, url: str | URL, **options: Any) -> Engine:
        return sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT",
                                **options)

    # -- identity ------------------------------------------------------------------------------
    def default_schema(self, conn: Connection) -> str | None:
        return self._database(conn)

    def _database(self, conn: Connection) -> str:
        db = conn.execute(text("SELECT DATABASE()")).scalar()
        if db is None:
            raise FeatureNotSupported("the connection has no current database; put it in the URL")
        return str(db)

    def _stored_name(self, conn: Connection, ref: ObjectRef, schema: str) -> str | None:
        if ref.kind in ROUTINE_TYPE:
            sql = (
                "SELECT ROUTINE_NAME FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = :s "
                "AND ROUTINE_TYPE = :t AND ROUTINE_NAME = :n"
            )
            params = {"s": schema, "t": ROUTINE_TYPE[ref.kind], "n": ref.name}
        elif ref.kind == "view":
            sql = (
                "SELECT TABLE_NAME FROM information_schema.VIEWS WHERE TABLE_SCHEMA = :s "
                "AND TABLE_NAME = :n"
            )
            params = {"s": schema, "n": ref.name}
        else:
            sql = (
                "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = :s "
                "AND TRIGGER_NAME = :n"
            )
            params = {"s": schema, "n": ref.name}
        v = conn.execute(text(sql), params).scalar()
        return None if v is None else str(v)

    def resolve(self, conn: Connection, ref: ObjectRef) -> ObjectRef:
        self.check_kind(ref)
        schema = ref.schema or self._database(conn)
        self.check_identifier(schema, "schema")
        self.check_identifier(ref.name, "object name")
        name = self._stored_name(conn, ref, schema) or ref.name
        return ObjectRef(ref.kind, name, schema)

    # -- reading ---------------------------------------------------------------------------------
    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        ref = self.resolve(conn, ref)
        assert ref.schema is not None
        if self._stored_name(conn, ref, ref.schema) is None:
            return None
        word = SHOW_WORD[ref.kind]
        try:
            row = conn.execute(text(f"SHOW CREATE {word} {_q(ref.schema)}.{_q(ref.name)}")).one()
        except sa.exc.DBAPIError:
            return None
        attributes: dict[str, str] = {}
        raw = row[1] if ref.kind == "view" else row[2]
        if raw is None:
            account = conn.execute(text("SELECT CURRENT_USER()")).scalar()
            raise SourceNotVisible(
                f"{account} cannot read the source of {ref.key}: MariaDB shows a routine's body "
                "only to its definer or to an account with SELECT on mysql.proc; nothing was "
                "captured", object=ref.key, account=account)
        if ref.kind != "view":
            attributes["sql_mode"] = str(row[1])
        create = str(raw)
        definer = definer_of(create)
        if definer:
            attributes["definer"] = definer
        create = re.sub(r"^\s*CREATE\s+(?!OR\s+REPLACE\b)", "CREATE OR REPLACE ", create,
                        count=1, flags=re.IGNORECASE)
        return LiveObject(ref, create, attributes)

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
        if kind in _CASE_INSENSITIVE:
            name = name.lower()
        keep = []
        for mod in re.findall(r"ALGORITHM\s*=\s*\w+|SQL\s+SECURITY\s+\w+", m.group("mods"),
                              re.IGNORECASE):
            keep.append(" ".join(mod.upper().replace("=", " = ").split()).replace(" = ", "="))
        header = ("CREATE " + "".join(k + " " for k in keep) + sqltext.KIND_KEYWORD[kind]
                  + " " + name)
        rest = t[m.end() :].lstrip(" \t\n")
        out = header + ("" if rest.startswith("(") else " ") + rest
        if kind in ("package", "package_body"):
            # MariaDB does not store the label of the final ``END name``.
            head, tail = out[:-256], out[-256:]
            out = head + re.sub(
                r"\bEND\s+[`\"]?" + re.escape(parts[-1].strip('`"')) + r"[`\"]?\s*$",
                "END",
                tail,
                flags=re.IGNORECASE,
            )
        return out

    def render(self, conn: Connection, ref: ObjectRef, source: str) -> str | None:
        if ref.kind in ("package", "package_body", "trigger"):
            return self.normalise(ref, source)
        return None

    def source_matches(self, conn: Connection, ref: ObjectRef, source: str) -> bool | None:
        live = self.read(conn, ref)
        if live is None:
            return False
        if ref.kind in ("package", "package_body", "trigger"):
            return self.normalise(ref, live.source) == self.normalise(ref, source)
        if ref.kind == "view":
            return None
        resolved = self.resolve(conn, ref)
        body = conn.execute(
            text(
                "SELECT ROUTINE_DEFINITION FROM information_schema.ROUTINES "
                "WHERE ROUTINE_SCHEMA = :s AND ROUTINE_TYPE = :t AND ROUTINE_NAME = :n"
            ),
            {"s": resolved.schema, "t": ROUTINE_TYPE[ref.kind], "n": resolved.name},
        ).scalar()
        if body is None:
            return None
        body_n = sigmod.normalise(str(body)).rstrip()
        if not body_n:
            return None
        return self.normalise(ref, source).rstrip().endswith(body_n)

    # -- status ------------------------------------------------------------------------------------
    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        ref = self.resolve(conn, ref)
        assert ref.schema is not None
        if self._stored_name(conn, ref, ref.schema) is None:
            return ObjectStatus(ref, MISSING, (), "information_schema", CATALOG)
        if ref.kind == "view":
            rows = conn.execute(text(f"CHECK TABLE {_q(ref.schema)}.{_q(ref.name)}")).all()
            errors = tuple(str(r[3]) for r in rows if str(r[2]).lower() == "error"
                           and str(r[3]) != "Corrupt")
            # CHECK TABLE resolves tables and columns, not what the functions under it do
            return ObjectStatus(ref, INVALID if errors else VALID, errors, "CHECK TABLE",
                                covers=False)
        live = self.read(conn, ref)
        if live is None:
            return ObjectStatus(ref, INVALID, ("SHOW CREATE could not read it",), "SHOW CREATE",
                                READ_BACK)
        if ref.kind == "package_body":
            spec = ObjectRef("package", ref.name, ref.schema)
            if self._stored_name(conn, spec, ref.schema) is None:
                return ObjectStatus(ref, INVALID, ("its package spec is missing",), "ROUTINES",
                                    CATALOG)
            return ObjectStatus(
                ref, UNCHECKED, (), "stored and readable next to its spec; MariaDB keeps no "
                "compile status (a smoke call would execute it)", READ_BACK
            )
        if ref.kind == "trigger":
            table = conn.execute(
                text(
                    "SELECT EVENT_OBJECT_TABLE FROM information_schema.TRIGGERS "
                    "WHERE TRIGGER_SCHEMA = :s AND TRIGGER_NAME = :n"
                ),
                {"s": ref.schema, "n": ref.name},
            ).scalar()
            exists = conn.execute(
                text(
                    "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = :s "
                    "AND TABLE_NAME = :t"
                ),
                {"s": ref.schema, "t": table},
            ).scalar()
            if not exists:
                return ObjectStatus(ref, INVALID, (f"table {table} is missing",), "TRIGGERS",
                                    CATALOG)
            return ObjectStatus(ref, UNCHECKED, (), "stored and readable, its table present; "
                                "MariaDB keeps no compile status", READ_BACK)
        return ObjectStatus(
            ref, UNCHECKED, (), "stored and readable only: MariaDB keeps no compile status "
            "(tables and routines are resolved when it runs; a smoke call would execute it)",
            READ_BACK
        )

    def recompile(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        """MariaDB has no recompile; the object's checks are run again."""
        return self.statuses(conn, [ref])[ref.key]

    def sweep(self, conn: Connection, refs: Sequence[ObjectRef],
              before: Mapping[str, ObjectStatus]) -> dict[str, ObjectStatus]:
        return self.statuses(conn, refs)

    def statuses(self, conn: Connection, refs: Sequence[ObjectRef]) -> dict[str, ObjectStatus]:
        """Each object's check (``status``), then its run check where one can be made.

        MariaDB keeps no compile status, and ``CHECK TABLE`` does not call the
        functions a view uses; what proves an object works is running it.  In one
        session of their own, each call in a read-only XA transaction that is rolled
        back (``run_contained``): a row is fetched from every view, every function is
        called (with NULL arguments -- MariaDB has no STRICT, so the body runs).
        Procedures, packages and triggers are not run: they stay ``unverified``
        unless a smoke call covers them, and the plan says so.
        """
        out = {r.key: self.status(conn, r) for r in refs}
        runs: list[tuple[str, str, str, str]] = []
        for ref in refs:
            st = out[ref.key]
            if not st.ok:
                continue
            resolved = st.object
            if resolved.schema is None:
                continue
            qname = f"{_q(resolved.schema)}.{_q(resolved.name)}"
            if ref.kind == "view":
                runs.append((ref.key, f"SELECT * FROM {qname} LIMIT 1",
                             "fetched a row from it", "view"))
            elif ref.kind == "function":
                n = int(conn.execute(text(
                    "SELECT COUNT(*) FROM information_schema.PARAMETERS WHERE "
                    "SPECIFIC_SCHEMA = :s AND SPECIFIC_NAME = :n AND ROUTINE_TYPE = 'FUNCTION' "
                    "AND ORDINAL_POSITION > 0"),
                    {"s": resolved.schema, "n": resolved.name}).scalar() or 0)
                args = ", ".join(["NULL"] * n)
                how = "called it" + (" with NULL arguments" if n else "")
                runs.append((ref.key, f"SELECT {qname}({args})", how, "function"))
            else:
                word = ref.kind.replace("_", " ")
                out[ref.key] = st.with_run(NOT_RUN, f"a {word} is not run by the check (only a "
                                           "smoke call can exercise it)")
        if runs:
            ran = self.run_contained(conn, [ContainedCall(sql) for _, sql, _, _ in runs],
                                     self.run_timeout, isolate=False)
            for (key, _, how, kind), r in zip(runs, ran, strict=True):
                out[key] = out[key].with_run(*_run_outcome(r, how, kind))
        return out

    def has_compile_status(self, conn: Connection, *, check: bool = False) -> bool:
        if check:
            raise FeatureNotSupported(
                "MariaDB keeps no compile status for stored code (no INVALID state)",
                feature="compile status",
                found="none",
                needed="a catalog status column",
            )
        return False

    def has_packages(self, conn: Connection, *, check: bool = False) -> bool:
        version = str(conn.execute(text("SELECT VERSION()")).scalar())
        m = re.match(r"(\d+)\.(\d+)", version)
        ok = "mariadb" in version.lower() and m is not None and (
            int(m.group(1)), int(m.group(2))) >= (10, 3)
        if not ok and check:
            raise FeatureNotSupported(
                f"packages need MariaDB 10.3 or later with sql_mode=ORACLE; found {version}",
                feature="packages",
                found=version,
                needed="MariaDB >= 10.3",
            )
        return ok

    # -- dependents and callers ----------------------------------------------------------------
    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        ref = self.resolve(conn, ref)
        found: dict[str, Dependent] = {}
        body = ref.body()
        if body is not None:
            assert ref.schema is not None
            if self._stored_name(conn, body, ref.schema) is not None:
                found[body.key] = Dependent(body, ref, "package spec/body")
        search = self.search_callers(conn, ref)
        hit_objects = sorted({h.object for h in search.hits})
        for i, obj in enumerate(hit_objects, start=1):
            if progress is not None:
                progress(i, len(hit_objects), obj.key)
            if obj.key not in found and obj.key != ref.key:
                found[obj.key] = Dependent(obj, ref, "source search")
        return list(found.values())

    def search_callers(self, conn: Connection, ref: ObjectRef) -> CallerSearch:
        ref = self.resolve(conn, ref)
        scopes = list(self.scopes(ref))
        hits: list[CallerHit] = []
        notes: list[str] = []
        searched = 0
        routines = conn.execute(
            text(
                "SELECT ROUTINE_SCHEMA, ROUTINE_NAME, ROUTINE_TYPE, ROUTINE_DEFINITION "
                "FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA IN :s "
                "ORDER BY ROUTINE_SCHEMA, ROUTINE_NAME, ROUTINE_TYPE"
            ).bindparams(bindparam("s", expanding=True)),
            {"s": scopes},
        ).all()
        for row in routines:
            kind = KIND_OF_ROUTINE_TYPE.get(str(row[2]))
            if kind is None:
                continue
            oref = ObjectRef(kind, str(row[1]), str(row[0]))
            if oref.key == ref.key:
                continue
            searched += 1
            if row[3] is None:
                notes.append(f"{oref.key}: source not visible (no privilege)")
                continue
            hits += [CallerHit(oref, n, t) for n, t in sqltext.find_word(str(row[3]), ref.name)]
        views = conn.execute(
            text(
                "SELECT TABLE_SCHEMA, TABLE_NAME, VIEW_DEFINITION FROM information_schema.VIEWS "
                "WHERE TABLE_SCHEMA IN :s ORDER BY TABLE_SCHEMA, TABLE_NAME"
            ).bindparams(bindparam("s", expanding=True)),
            {"s": scopes},
        ).all()
        for row in views:
            oref = ObjectRef("view", str(row[1]), str(row[0]))
            if oref.key == ref.key:
                continue
            searched += 1
            hits += [CallerHit(oref, n, t) for n, t in sqltext.find_word(str(row[2] or ""),
                                                                         ref.name)]
        triggers = conn.execute(
            text(
                "SELECT TRIGGER_SCHEMA, TRIGGER_NAME, ACTION_STATEMENT FROM "
                "information_schema.TRIGGERS WHERE TRIGGER_SCHEMA IN :s "
                "ORDER BY TRIGGER_SCHEMA, TRIGGER_NAME"
            ).bindparams(bindparam("s", expanding=True)),
            {"s": scopes},
        ).all()
        for row in triggers:
            oref = ObjectRef("trigger", str(row[1]), str(row[0]))
            if oref.key == ref.key:
                continue
            searched += 1
            hits += [CallerHit(oref, n, t) for n, t in sqltext.find_word(str(row[2] or ""),
                                                                         ref.name)]
        return CallerSearch(
            target=ref,
            method="whole-word search of information_schema ROUTINES.ROUTINE_DEFINITION "
            "(routines and packages), VIEWS.VIEW_DEFINITION, TRIGGERS.ACTION_STATEMENT",
            pattern=ref.name,
            scope=tuple(scopes),
            searched=searched,
            hits=tuple(hits),
            notes=tuple(notes),
        )

    # -- changing ----------------------------------------------------------------------------------
    @contextmanager
    def session(self, conn: Connection, settings: Mapping[str, str]) -> Iterator[None]:
        """Run with session settings (``sql_mode``; ``database`` switches the current one)."""
        unknown = set(settings) - {"sql_mode", "database"}
        if unknown:
            raise FeatureNotSupported(f"unknown MariaDB session settings {sorted(unknown)}")
        mode = settings.get("sql_mode")
        current_db = self._database(conn)
        target_db = settings.get("database")
        switch_db = target_db is not None and target_db != current_db
        prev_mode = str(conn.execute(text("SELECT @@SESSION.sql_mode")).scalar())
        try:
            if switch_db:
                assert target_db is not None
                conn.execute(text(f"USE {_q(target_db)}"))
            if mode is not None:
                conn.execute(text("SET SESSION sql_mode = :m"), {"m": mode})
            yield
        finally:
            with suppress(sa.exc.DBAPIError):
                if mode is not None:
                    conn.execute(text("SET SESSION sql_mode = :m"), {"m": prev_mode})
                if switch_db:
                    conn.execute(text(f"USE {_q(current_db)}"))

    def apply(
        self, conn: Connection, ref: ObjectRef, source: str, attributes: Mapping[str, str]
    ) -> None:
        """Apply under the object's ``sql_mode`` and in its database; keep its definer.

        A source without ``DEFINER=`` would make the applying account the definer;
        the attribute's definer is written into the header instead (the plan has
        checked that the account may set it).
        """
        self.check_kind(ref)
        settings = {k: v for k, v in attributes.items() if k == "sql_mode"}
        if ref.schema is not None:
            settings["database"] = ref.schema
        definer = attributes.get("definer")
        if definer and definer_of(source) is None:
            current = str(conn.execute(text("SELECT CURRENT_USER()")).scalar())
            if definer != current:
                clause = _quoted_definer(definer)
                source = re.sub(r"^(\s*CREATE(?:\s+OR\s+REPLACE)?)\s",
                                lambda m: f"{m.group(1)} DEFINER={clause} ",
                                source, count=1, flags=re.IGNORECASE)
        with self.session(conn, settings):
            self.execute_ddl(conn, ref, source)

    @contextmanager
    def read_only(self, conn: Connection) -> Iterator[None]:
        """A read-only transaction, rolled back after (far-side assertions on a MariaDB far side).

        ``SET SESSION TRANSACTION READ ONLY`` first, so that a transaction the called
        code starts on its own after a ``COMMIT`` is read-only too; smoke calls and
        run-time checks get more (``run_contained``: their own session, an XA transaction).
        """
        conn.execute(text("SET SESSION TRANSACTION READ ONLY"))
        conn.execute(text("START TRANSACTION READ ONLY"))
        try:
            yield
        finally:
            with suppress(sa.exc.DBAPIError):
                conn.execute(text("ROLLBACK"))
            with suppress(sa.exc.DBAPIError):
                conn.execute(text("SET SESSION TRANSACTION READ WRITE"))

    def run_contained(self, conn: Connection, calls: Sequence[ContainedCall],
                      timeout: float, *, isolate: bool = True) -> list[Ran]:
        """Each call in a session of its own, inside a read-only XA transaction, rolled back.

        A session-level read-only transaction alone is not enough: a procedure
        can ``COMMIT`` and ``START TRANSACTION READ WRITE`` (or ``SET SESSION
        TRANSACTION READ WRITE``) and then write -- measured on 10.11.  Inside an
        XA transaction MariaDB refuses ``COMMIT``, ``START TRANSACTION`` and every
        statement that commits implicitly (DDL) with XAER_RMFAIL, and the session's
        ``TRANSACTION READ ONLY`` refuses the writes (1792).  The XA id is random,
        so called code cannot end it by name; the session's transaction counters
        (``Com_commit``, ``Com_begin``, ``Com_xa_*``...) are read before and after,
        and a call that moved them -- or after which the XA transaction was not
        active any more -- is reported as ``escaped``.  ``isolate=False`` runs the
        calls one after another in one session (run-time checks of dependents,
        which call only functions and views: no transaction control inside).
        """
        out: list[Ran] = []
        session: Connection | None = None
        try:
            for call in calls:
                if session is None:
                    session = conn.engine.connect()
                    session.execute(text("SET SESSION TRANSACTION READ ONLY"))
                    session.execute(text("SET SESSION max_statement_time = :t"),
                                    {"t": max(float(timeout), 0.001)})
                try:
                    out.append(self._run_in_xa(session, call))
                except sa.exc.DBAPIError as exc:  # the session could not be set up for it
                    out.append(Ran(error=first_line(exc.orig)))
                    session.close()
                    session = None
                    continue
                if isolate:
                    session.close()
                    session = None
        finally:
            if session is not None:
                session.close()
        return out

    _TX_COUNTERS = ("Com_begin", "Com_commit", "Com_rollback", "Com_xa_start", "Com_xa_end",
                    "Com_xa_commit", "Com_xa_rollback", "Com_xa_prepare")

    def _tx_counters(self, session: Connection) -> dict[str, int]:
        rows = session.execute(text(
            "SHOW SESSION STATUS WHERE Variable_name IN :n").bindparams(
            bindparam("n", expanding=True)), {"n": list(self._TX_COUNTERS)}).all()
        return {str(r[0]).lower(): int(r[1]) for r in rows}

    def _run_in_xa(self, session: Connection, call: ContainedCall) -> Ran:
        """One call inside its own XA transaction (random id), rolled back, counters read.

        Counters move even for statements MariaDB refuses (measured on 10.11), so
        they are read as evidence, not as the verdict: inside an active XA
        transaction ``COMMIT``/``BEGIN``/``ROLLBACK`` are always refused
        (XAER_RMFAIL), so a moved ``Com_commit`` is a refused attempt -- named in
        the error; only an XA statement run by the call itself, or our ``XA END``
        failing, means the transaction may have been left.
        """
        xid = f"cg_check_{os.urandom(12).hex()}"
        ran = Ran(error="not run")
        delta: dict[str, int] = {}
        ended: str | None = None
        unknown = set(call.session) - {"sql_mode", "database"}
        if unknown:  # a failed check, never an exception in the middle of a verify
            return Ran(error=f"unknown MariaDB session settings {sorted(unknown)}")
        with self.session(session, dict(call.session)):
            before = self._tx_counters(session)
            session.execute(text("XA START :x"), {"x": xid})
            try:
                try:
                    result = session.execute(text(call.sql), dict(call.binds))
                    row = result.first() if result.returns_rows else None
                    ran = Ran(None if row is None else tuple(row), bool(result.returns_rows))
                except sa.exc.DBAPIError as exc:
                    code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
                    ran = Ran(error=first_line(exc.orig), writes=code == 1792,
                              timed_out=code == 1969)
                except sa.exc.SQLAlchemyError as exc:
                    ran = Ran(error=first_line(exc))
                after = self._tx_counters(session)
                delta = {k: after[k] - before.get(k, 0) - (1 if k == "com_xa_start" else 0)
                         for k in after}
            finally:
                try:
                    session.execute(text("XA END :x"), {"x": xid})
                except sa.exc.DBAPIError as exc:
                    code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
                    if code in (1397, 1399):  # XAER_NOTA, XAER_RMFAIL: not ours, not active
                        ended = first_line(exc.orig)
                with suppress(sa.exc.DBAPIError):
                    session.execute(text("XA ROLLBACK :x"), {"x": xid})
        xa = sorted(k for k, n in delta.items() if n > 0 and k.startswith("com_xa_"))
        if xa or ended:
            why = (f"it ran {', '.join(k.removeprefix('com_').upper() for k in xa)}"
                   if xa else f"XA END answered {ended}")
            return Ran(ran.row, ran.returned_rows, ran.error, ran.writes, ran.timed_out,
                       f"it ended or left the check's transaction ({why})")
        tried = sorted(k.removeprefix("com_").upper() for k, n in delta.items()
                       if n > 0 and not k.startswith("com_xa_"))
        if tried:  # refused, but code that verification runs may not even try
            said = f"{ran.error} " if ran.error is not None else ""
            ran = Ran(ran.row, ran.returned_rows,
                      f"{said}(it tried to {'/'.join(tried)}; refused inside the check's XA "
                      "transaction)", ran.writes, ran.timed_out)
        return ran

    @contextmanager
    def ddl_session(self, conn: Connection, lock_timeout: float) -> Iterator[None]:
        """``lock_wait_timeout`` (metadata locks) bounded by the row's lock seconds."""
        prev = conn.execute(text("SELECT @@SESSION.lock_wait_timeout")).scalar()
        conn.execute(text("SET SESSION lock_wait_timeout = :t"),
                     {"t": max(1, round(lock_timeout))})
        try:
            yield
        finally:
            with suppress(sa.exc.DBAPIError):
                conn.execute(text("SET SESSION lock_wait_timeout = :t"), {"t": prev})

    def drop(self, conn: Connection, ref: ObjectRef) -> None:
        ref = self.resolve(conn, ref)
        assert ref.schema is not None
        conn.execute(text(f"DROP {SHOW_WORD[ref.kind]} IF EXISTS {_q(ref.schema)}.{_q(ref.name)}"))

    # -- locks ----------------------------------------------------------------------------------
    def acquire_lock(self, conn: Connection, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                got = conn.execute(text("SELECT GET_LOCK(:n, 0)"), {"n": name}).scalar()
            except sa.exc.DBAPIError as exc:
                raise FeatureNotSupported(f"GET_LOCK failed: {first_line(exc.orig)}") from exc
            if got == 1:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def release_lock(self, conn: Connection, name: str) -> None:
        conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": name})
