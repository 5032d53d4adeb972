"""Stored-code objects, and the one small protocol every catalog adapter implements.

One module per dialect (``catalog_postgresql``, ``catalog_mariadb``,
``catalog_oracle``, ``catalog_sqlite``) holds that dialect's quirks -- its
identifier rules included; the loop talks only to ``CatalogAdapter``.  An
adapter registers itself by naming its dialect (``class PostgresqlAdapter(
BaseAdapter, name="postgresql")``, :mod:`executor.dialects.registration`), and
``adapter_for("postgresql")`` (an alias, or a URL) returns it.  Flags such as
``transactional_ddl`` tell the loop which path to take; capability questions
take ``check=`` (with ``check=True`` a missing feature raises
``FeatureNotSupported`` or a more specific error naming what was found and what
is needed).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from capgate.ddl import signature as sigmod
from capgate.ddl import sqltext
from capgate.ddl.smoke import ContainedCall, Ran
from capgate.executor.dialects import engine_name
from capgate.executor.dialects.registration import Implementations, Registered, package_modules
from capgate.registry.errors import ApplyFailed, FeatureNotSupported, UnsupportedObjectType

KINDS = (
    "aggregate",
    "package",
    "package_body",
    "type",
    "type_body",
    "procedure",
    "function",
    "view",
    "trigger",
    "foreign_table",
)
"""``foreign_table`` only names a remote dependent (a PostgreSQL foreign table on the far
side of a foreign server); no adapter changes one."""
SPEC_OF_BODY = {"package_body": "package", "type_body": "type"}
BODY_OF_SPEC = {v: k for k, v in SPEC_OF_BODY.items()}

Progress = Callable[[int, int, str], None]
"""``progress(done, total, label)``: called during sweeps so a CLI can draw a bar."""


@dataclass(frozen=True, order=True)
class ObjectRef:
    """The identity of one stored-code object."""

    kind: str
    """One of ``KINDS`` (package, package_body, type, type_body, procedure, function, ...)."""
    name: str
    """The name as the catalog stores it."""
    schema: str | None = None
    """Schema / database / owner; None means the connection's current one."""
    args: str | None = None
    """PostgreSQL only: identity argument types of a function, e.g. ``integer, text``."""
    parent: str | None = None
    """The table a trigger belongs to, where trigger names are per table (PostgreSQL)."""
    link: str | None = None
    """A database link: set for remote objects, which the local catalog cannot see."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UnsupportedObjectType(
                f"object type {self.kind!r} is not handled by the DDL loop",
                kind=self.kind,
                supported=list(KINDS),
            )
        if not self.name:
            raise ValueError("an object needs a name")

    @property
    def key(self) -> str:
        """A stable text identity, e.g. ``function:billing.calc(integer)``."""
        out = f"{self.kind}:"
        if self.schema:
            out += f"{self.schema}."
        out += self.name
        if self.args is not None:
            out += f"({self.args})"
        if self.parent:
            out += f" on {self.parent}"
        if self.link:
            out += f"@{self.link}"
        return out

    def __str__(self) -> str:
        return self.key

    @property
    def is_body(self) -> bool:
        return self.kind in SPEC_OF_BODY

    @property
    def is_spec(self) -> bool:
        return self.kind in BODY_OF_SPEC

    def body(self) -> ObjectRef | None:
        """The body of a package or type spec; None for other kinds."""
        kind = BODY_OF_SPEC.get(self.kind)
        return None if kind is None else ObjectRef(kind, self.name, self.schema, link=self.link)

    def spec(self) -> ObjectRef | None:
        """The spec of a package or type body; None for other kinds."""
        kind = SPEC_OF_BODY.get(self.kind)
        return None if kind is None else ObjectRef(kind, self.name, self.schema, link=self.link)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "name": self.name, "schema": self.schema}
        if self.args is not None:
            out["args"] = self.args
        if self.parent is not None:
            out["parent"] = self.parent
        if self.link is not None:
            out["link"] = self.link
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ObjectRef:
        return cls(
            kind=str(data["kind"]),
            name=str(data["name"]),
            schema=data.get("schema"),
            args=data.get("args"),
            parent=data.get("parent"),
            link=data.get("link"),
        )

    _KEY_RE: ClassVar[re.Pattern[str]] = re.compile(
        r"^(?P<kind>[a-z_]+):(?:(?P<schema>[^.()@ ]+)\.)?(?P<name>[^.()@ ]+)"
        r"(?:\((?P<args>[^)]*)\))?(?: on (?P<parent>[^@ ]+))?(?:@(?P<link>\S+))?$"
    )

    @classmethod
    def parse(cls, text: str) -> ObjectRef:
        """Parse ``kind:[schema.]name[(args)][ on table][@link]`` (the ``key`` form)."""
        m = cls._KEY_RE.match(text.strip())
        if not m:
            raise ValueError(f"not an object reference: {text!r} (expected kind:[schema.]name)")
        return cls(
            kind=m.group("kind"),
            name=m.group("name"),
            schema=m.group("schema"),
            args=m.group("args"),
            parent=m.group("parent"),
            link=m.group("link"),
        )


@dataclass(frozen=True)
class LiveObject:
    """An object's source as the catalog renders it, ready to be applied again."""

    object: ObjectRef
    source: str
    """Re-appliable DDL (``CREATE OR REPLACE ...`` where the dialect has it)."""
    attributes: dict[str, str] = field(default_factory=dict)
    """Settings the source needs to mean the same thing again (e.g. MariaDB ``sql_mode``)."""


VALID = "valid"
INVALID = "invalid"
MISSING = "missing"
UNCHECKED = "unchecked"

COMPILED = "compiled"
"""The database validated the object against today's catalog (a compiler or checker ran)."""
READ_BACK = "read back"
"""Only stored and readable: the engine keeps no compile status (MariaDB routines)."""
NOT_CHECKED = "not checked"
"""No checker exists for it (a language PostgreSQL cannot check, an event trigger)."""
CATALOG = "catalog"
"""Looked up in the catalog only (to find it missing)."""
EXECUTED = "executed"
"""The object ran: a row fetched from a view, a call of a function (contained, read-only)."""

RAN = "ran"
"""Run check: it ran and returned (a view gave a row, a function returned)."""
NO_ROW = "no_row"
"""Run check: the view returned no row -- what it applies per row did not run."""
RUN_ERROR = "error"
"""Run check: it raised an error."""
RUN_WRITES = "writes"
"""Run check: it tried to write and the read-only check refused it (ran up to there)."""
RUN_TIMED_OUT = "timed_out"
"""Run check: it ran past the check's time limit and was stopped."""
NOT_RUN = "not_run"
"""Run check: there was no way to run it (arguments, a procedure, a trigger...)."""


@dataclass(frozen=True)
class ObjectStatus:
    """The status of one object: its compile check, its run check, and how each was done.

    The compile check (``state``) is what the catalog or a checker says of the
    object as stored.  Some checkers prove little about what happens when the code
    runs (``EXPLAIN`` of a view does not run the functions under it;
    ``fmgr_sql_validator`` does not see a record function's result change shape;
    MariaDB's ``CHECK TABLE`` does not call the functions a view uses): their
    verdict does not ``cover`` the object, and only a run check -- a row fetched,
    a call made, in a read-only contained transaction -- can.
    """

    object: ObjectRef
    state: str
    """``valid`` | ``invalid`` | ``missing`` | ``unchecked`` (no check is possible)."""
    errors: tuple[str, ...] = ()
    method: str = ""
    """What was checked, in words, e.g. ``plpgsql_check_function_tb`` or ``ALL_OBJECTS.STATUS``."""
    checked: str = COMPILED
    """What the check actually did: ``compiled``, ``read back``, ``not checked``, ``catalog``."""
    covers: bool = True
    """Whether a ``valid`` compile check is enough evidence on its own (False: EXPLAIN,
    fmgr_sql_validator, CHECK TABLE -- only the run check can prove the object works)."""
    run: str | None = None
    """The run check: ``ran``, ``no_row``, ``error``, ``writes``, ``timed_out``, ``not_run``;
    None where no run check was attempted."""
    run_detail: str = ""
    """What the run check did, or the error it met, in words."""

    @property
    def ok(self) -> bool:
        return self.state in (VALID, UNCHECKED)

    def with_run(self, run: str, detail: str) -> ObjectStatus:
        return ObjectStatus(self.object, self.state, self.errors, self.method, self.checked,
                            self.covers, run, detail)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "object": self.object.key,
            "state": self.state,
            "errors": list(self.errors),
            "method": self.method,
            "checked": self.checked,
        }
        if not self.covers:
            out["covers"] = False
        if self.run is not None:
            out["run"] = self.run
            out["run_detail"] = self.run_detail
        return out

    @classmethod
    def from_dict(cls, ref: ObjectRef, data: Mapping[str, Any]) -> ObjectStatus:
        run = data.get("run")
        return cls(ref, str(data["state"]), tuple(str(e) for e in data.get("errors") or ()),
                   str(data.get("method", "")), str(data.get("checked", COMPILED)),
                   bool(data.get("covers", True)), None if run is None else str(run),
                   str(data.get("run_detail", "")))


@dataclass(frozen=True)
class Dependent:
    """An object that depends on another one (directly, or through other dependents)."""

    object: ObjectRef
    on: ObjectRef
    """The object it uses directly (a changed object, or another dependent)."""
    via: str
    """Where it was found: pg_depend, plpgsql_check, sql body, ALL_DEPENDENCIES, source search."""
    depth: int = 1
    """1 for a direct dependent, 2 for a dependent of a dependent, and so on."""

    @property
    def remote(self) -> bool:
        return self.object.link is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": self.object.to_dict(),
            "key": self.object.key,
            "on": self.on.key,
            "via": self.via,
            "depth": self.depth,
            "remote": self.remote,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Dependent:
        return cls(
            object=ObjectRef.from_dict(data["object"]),
            on=ObjectRef.parse(str(data["on"])),
            via=str(data.get("via", "declared")),
            depth=int(data.get("depth", 1)),
        )


@dataclass(frozen=True)
class CallerHit:
    """One line of stored source that names the object."""

    object: ObjectRef
    line: int
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"object": self.object.key, "line": self.line, "text": self.text}


@dataclass(frozen=True)
class CallerSearch:
    """The evidence of a caller search: what was searched, how, and what was found."""

    target: ObjectRef
    method: str
    pattern: str
    scope: tuple[str, ...]
    searched: int
    """How many stored objects were searched."""
    hits: tuple[CallerHit, ...]
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": self.target.key,
            "method": self.method,
            "pattern": self.pattern,
            "scope": list(self.scope),
            "searched": self.searched,
            "hits": [h.to_dict() for h in self.hits],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Probe:
    """What the plan learns by trying a new source without keeping it."""

    rendered: str | None
    """The normalised text the catalog will show; None when it cannot be predicted."""
    status: ObjectStatus | None
    """The checker's verdict on the new source (PostgreSQL); None where no check is possible."""
    error: str | None
    """The database's refusal of the source, if it refused."""


# --- the protocol -----------------------------------------------------------------------


@runtime_checkable
class CatalogAdapter(Protocol):
    """What the DDL loop needs from one dialect's catalog."""

    dialect: ClassVar[str]
    transactional_ddl: ClassVar[bool]
    """True where DDL is transactional (PostgreSQL, SQLite): apply and verify share one txn."""
    kinds: ClassVar[frozenset[str]]

    def engine(self, url: str | URL, **options: Any) -> Engine:
        """An engine for ``url`` set up the way this adapter's steps expect.

        ``options`` go to ``create_engine`` (a connector's ``connect_args``: a TNS
        alias's ``config_dir``, a wallet -- secrets never in the URL)."""
        ...

    def begin(self, conn: Connection) -> None:
        """Open the transaction the apply runs in (transactional dialects)."""
        ...

    def resolve(self, conn: Connection, ref: ObjectRef) -> ObjectRef:
        """Fill in the schema and the catalog's spelling of the name; the object need not exist."""
        ...

    def identify(self, conn: Connection, source: str) -> ObjectRef:
        """The object a ``CREATE`` statement creates or replaces."""
        ...

    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        """The live object's source, or None if it does not exist."""
        ...

    def normalise(self, ref: ObjectRef, text: str) -> str:
        """Recipe-v1 normalisation with this dialect's cosmetic noise removed."""
        ...

    def render(self, conn: Connection, ref: ObjectRef, source: str) -> str | None:
        """The normalised text the catalog will show after ``source``; None if unpredictable."""
        ...

    def source_matches(self, conn: Connection, ref: ObjectRef, source: str) -> bool | None:
        """Whether the live object is what ``source`` creates; None when it cannot be told."""
        ...

    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        """The object's compile status."""
        ...

    def recompile(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        """Recompile (or re-check) this one object and return its status.  Never schema-wide."""
        ...

    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        """Local objects that depend on ``ref``, as far as the catalog can tell."""
        ...

    def remote_dependents(self, far: Connection, ref: ObjectRef, link: str) -> list[Dependent]:
        """Objects in a far database that use ``ref`` through database link ``link``."""
        ...

    def search_callers(self, conn: Connection, ref: ObjectRef) -> CallerSearch:
        """Search stored source for the object's name; the result is evidence for the plan."""
        ...

    def apply(
        self, conn: Connection, ref: ObjectRef, source: str, attributes: Mapping[str, str]
    ) -> None:
        """Execute the DDL; ApplyFailed if the database refuses it or creates it with errors."""
        ...

    def drop(self, conn: Connection, ref: ObjectRef) -> None:
        """Drop the object (compensation of an object that did not exist before)."""
        ...

    def holds_state(self, ref: ObjectRef, source: str) -> list[str]:
        """Package-level declarations that make the package stateful."""
        ...

    def privilege_changes(self, ref: ObjectRef, base: str | None, new: str) -> list[str]:
        """What the approver must know about whose rights the new source runs with."""
        ...

    def session(
        self, conn: Connection, settings: Mapping[str, str]
    ) -> AbstractContextManager[None]:
        """A block run with session settings (MariaDB ``sql_mode``), restored afterwards."""
        ...

    def acquire_lock(self, conn: Connection, name: str, timeout: float) -> bool:
        """Take a session-scoped exclusive lock named ``name`` on ``conn``; False on timeout."""
        ...

    def release_lock(self, conn: Connection, name: str) -> None: ...

    def has_compile_status(self, conn: Connection, *, check: bool = False) -> bool:
        """Can the catalog tell a compiled object from a broken one?"""
        ...

    def has_packages(self, conn: Connection, *, check: bool = False) -> bool:
        """Does the database have packages with a spec and a body?"""
        ...

    def has_session_lock(self, *, check: bool = False) -> bool:
        """Does the database offer a session-scoped lock that survives DDL commits?"""
        ...


# --- a base with the shared behaviour -----------------------------------------------------------


class BaseAdapter(Registered):
    """Shared behaviour of the adapters; each dialect overrides what differs."""

    implementations: ClassVar[Implementations[BaseAdapter]] = Implementations(
        "DDL catalog adapter", module_of=lambda name: f"capgate.ddl.catalog_{name}",
        modules=package_modules("capgate.ddl", "catalog_"))
    dialect: ClassVar[str] = ""
    """The dialect's name (:attr:`name`, under the name the DDL loop's records use)."""
    transactional_ddl: ClassVar[bool] = False
    plain_identifier: ClassVar[re.Pattern[str]] = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
    """A name that may be interpolated into SQL text unquoted-safe (then quoted)."""
    identifier_quote: ClassVar[str] = '"'
    """How an identifier is quoted (MariaDB: a backtick)."""
    apply_replaces_existing: ClassVar[bool] = False
    """An apply replaces an existing object whatever the source's CREATE says (SQLite drops
    it first); elsewhere a ``CREATE`` without ``OR REPLACE`` of an existing object fails."""
    kinds: ClassVar[frozenset[str]] = frozenset()
    fold: ClassVar[str | None] = None
    """How bare identifiers fold: ``lower`` (PostgreSQL), ``upper`` (Oracle) or None."""
    keep_semicolon: ClassVar[bool] = False
    """Oracle PL/SQL keeps its final ``;``; other dialects drop it as a terminator."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.dialect = cls.name

    def __init__(self, scope: Sequence[str] | None = None) -> None:
        self.scope: tuple[str, ...] | None = tuple(scope) if scope else None
        """Schemas searched for callers and dependents; None means the object's own schema."""
        self.run_timeout: float = 30.0
        """Seconds one contained run check may take (the DDL loop sets its ``check_timeout``)."""

    # -- identifiers
    @classmethod
    def check_identifier(cls, name: str, what: str = "identifier") -> str:
        """``name`` if it is a plain identifier here; else InvalidObjectName.

        Only names that pass are ever interpolated into SQL text; values always
        travel as binds.
        """
        return sqltext.check_identifier(name, cls.plain_identifier, cls.name, what)

    @classmethod
    def quote(cls, name: str, what: str = "identifier") -> str:
        """Validate ``name`` and quote it for this dialect."""
        cls.check_identifier(name, what)
        return f"{cls.identifier_quote}{name}{cls.identifier_quote}"

    # -- engines and transactions
    def engine(self, url: str | URL, **options: Any) -> Engine:
        return sa.create_engine(url, poolclass=sa.pool.NullPool, **options)

    def lock_session(self, engine: Engine) -> Connection:
        """The connection the DDL loop's session-scoped locks are taken on (autocommit:
        a lock must outlive the DDL's own commits)."""
        return engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def begin(self, conn: Connection) -> None:
        return None

    # -- identity
    def check_kind(self, ref: ObjectRef) -> None:
        if ref.kind not in self.kinds:
            raise UnsupportedObjectType(
                f"{self.dialect} cannot handle {ref.kind.replace('_', ' ')} objects "
                f"({ref.key}); it handles {', '.join(sorted(self.kinds))}",
                object=ref.key,
                kind=ref.kind,
                supported=sorted(self.kinds),
            )

    def header(self, source: str) -> ObjectRef:
        """What the source's ``CREATE`` header names (kind, schema, name), without a catalog."""
        header = sqltext.parse_header(source, self.fold)
        return ObjectRef(header.kind, header.name, header.schema)

    def identify(self, conn: Connection, source: str) -> ObjectRef:
        header = sqltext.parse_header(source, self.fold)
        ref = ObjectRef(header.kind, header.name, header.schema)
        self.check_kind(ref)
        return self.resolve(conn, ref)

    def resolve(self, conn: Connection, ref: ObjectRef) -> ObjectRef:
        self.check_kind(ref)
        return ref

    def default_schema(self, conn: Connection) -> str | None:
        """The schema an unqualified name resolves to on ``conn`` (None where there are none)."""
        return None

    def scopes(self, ref: ObjectRef) -> tuple[str, ...]:
        if self.scope:
            return self.scope
        return (ref.schema,) if ref.schema else ()

    # -- text
    def keeps_semicolon(self, ref: ObjectRef) -> bool:
        """Whether a final ``;`` belongs to the unit (Oracle PL/SQL) rather than the script."""
        return self.keep_semicolon and ref.kind != "view"

    def cosmetic(self, ref: ObjectRef, text: str) -> str:
        """Remove this dialect's cosmetic noise (before the generic recipe steps)."""
        return sqltext.strip_terminator(text, keep_semicolon=self.keeps_semicolon(ref))

    def normalise(self, ref: ObjectRef, text: str) -> str:
        return sigmod.normalise(text, lambda t: self.cosmetic(ref, t))

    def render(self, conn: Connection, ref: ObjectRef, source: str) -> str | None:
        return self.normalise(ref, source)

    def source_matches(self, conn: Connection, ref: ObjectRef, source: str) -> bool | None:
        live = self.read(conn, ref)
        if live is None:
            return False
        expected = self.render(conn, ref, source)
        if expected is None:
            return None
        return bool(self.normalise(ref, live.source) == expected)

    def holds_state(self, ref: ObjectRef, source: str) -> list[str]:
        if ref.kind in ("package", "package_body"):
            return sqltext.package_state(source)
        return []

    def privilege_changes(self, ref: ObjectRef, base: str | None, new: str) -> list[str]:
        """Plan warnings when the new source runs with more rights than the live one.

        ``base`` is the live source (None: the plan creates the object), ``new``
        the source as the server renders it where the plan could try it.  A
        source that starts running with its owner's rights gives them to every
        caller: the diff shows the clause, this says what it means.  Engines
        whose code can run as its owner say it; the default has nothing to say.
        """
        return []

    def sql_source(self, ref: ObjectRef, source: str) -> str:
        """The text sent to the server: line endings fixed, script terminators dropped."""
        text = source.replace("\r\n", "\n").replace("\r", "\n")
        return sqltext.strip_terminator(text, keep_semicolon=self.keeps_semicolon(ref))

    def execute_ddl(self, conn: Connection, ref: ObjectRef, source: str) -> None:
        """Send DDL text verbatim (no bind parsing: PL/SQL ``:=`` and ``:new`` stay as they are)."""
        try:
            conn.exec_driver_sql(
                self.sql_source(ref, source), execution_options={"no_parameters": True})
        except sa.exc.DBAPIError as exc:
            raise ApplyFailed(
                f"{self.dialect} refused the DDL for {ref.key}: {_first_line(exc.orig)}",
                object=ref.key,
                database_error=_first_line(exc.orig),
            ) from exc

    # -- one definition per source ----------------------------------------------------------
    sqlglot_dialect: ClassVar[str] = ""
    """The sqlglot dialect whose tokenizer reads this engine's stored code."""

    def plsql(self, attributes: Mapping[str, str]) -> bool:
        """Whether stored code is PL/SQL-shaped here (Oracle; MariaDB in ``sql_mode=ORACLE``)."""
        return False

    def parse_definition(self, conn: Connection | None, ref: ObjectRef, source: str,
                         attributes: Mapping[str, str]) -> None:
        """Refuse a source that is more than the one definition of ``ref`` (ExtraStatements).

        ``conn`` may be None (offline checks); engines that can parse on the
        server without running anything (MariaDB ``PREPARE``) do so when given one.
        """
        from capgate.ddl import source as srcmod

        srcmod.parse_blocks(source, ref.kind, self.sqlglot_dialect,
                            plsql=self.plsql(attributes), what=ref.key)

    def default_attributes(self, conn: Connection, ref: ObjectRef) -> dict[str, str]:
        """Attributes of an object the plan creates (MariaDB: the definer it will get)."""
        return {}

    def preconditions(self, conn: Connection, ref: ObjectRef, source: str,
                      attributes: Mapping[str, str], exists: bool) -> list[str]:
        """Refuse (raise) what the apply could do but compensation could not undo; warnings."""
        return []

    # -- batches: the defaults ask one object at a time ---------------------------------------
    def statuses(self, conn: Connection, refs: Sequence[ObjectRef]) -> dict[str, ObjectStatus]:
        """The compile status of many objects (engines override this with one round trip)."""
        return {r.key: self.status(conn, r) for r in refs}

    def sweep(self, conn: Connection, refs: Sequence[ObjectRef],
              before: Mapping[str, ObjectStatus]) -> dict[str, ObjectStatus]:
        """Re-check (recompile where the engine has it) the dependents after a change."""
        return {r.key: self.recompile(conn, r) for r in refs}

    def dependents_many(self, conn: Connection, refs: Sequence[ObjectRef],
                        progress: Progress | None = None) -> list[Dependent]:
        """Every local object that uses one of ``refs``, directly or through others, nearest first.

        A changed function changes what an aggregate over it computes, and so
        every view over that aggregate: the sweep follows the chain.
        """
        seen = {r.key for r in refs}
        out: list[Dependent] = []
        frontier = list(refs)
        depth = 0
        while frontier:
            depth += 1
            nxt: list[ObjectRef] = []
            for ref in frontier:
                for d in self.dependents(conn, ref, progress):
                    if d.remote or d.object.key in seen:
                        continue
                    seen.add(d.object.key)
                    out.append(Dependent(d.object, d.on, d.via, depth))
                    nxt.append(d.object)
            frontier = nxt
        return out

    # -- signatures, merges, restores -----------------------------------------------------------
    def signed_text(self, ref: ObjectRef, source: str, attributes: Mapping[str, str]) -> str:
        """The text the signature is computed over: the normalised source, plus whatever
        attribute changes behaviour on this engine (MariaDB ``sql_mode`` and definer;
        Oracle editionability, compiler settings, a trigger's enabled state)."""
        return self.normalise(ref, source)

    def appliable(self, ref: ObjectRef, normalised: str) -> str:
        """A normalised text made re-appliable (``CREATE OR REPLACE``), for merge proposals."""
        return normalised

    def restore(self, conn: Connection, ref: ObjectRef, source: str,
                attributes: Mapping[str, str]) -> list[str]:
        """Re-apply a snapshot (compensation); returns notes on anything beyond a plain apply."""
        self.apply(conn, ref, source, attributes)
        return []

    @contextmanager
    def ddl_session(self, conn: Connection, lock_timeout: float) -> Iterator[None]:
        """Bound how long the DDL waits for locks (PostgreSQL ``lock_timeout``, MariaDB
        ``lock_wait_timeout``, Oracle ``ddl_lock_timeout``): the row's ``lock_seconds``."""
        yield

    @contextmanager
    def read_only(self, conn: Connection) -> Iterator[None]:
        """A block in an engine-enforced read-only transaction, rolled back after (smoke calls)."""
        raise FeatureNotSupported(f"{self.dialect} has no read-only transaction for smoke calls",
                                  feature="read-only transaction")
        yield  # pragma: no cover

    # -- contained runs: smoke calls and run-time checks ----------------------------------------
    def check_smoke(self, name: str, sql: str) -> None:
        """Refuse (``SmokeNotContained``, CG531) a smoke call that is not one read-only
        statement, read with this engine's tokenizer (:func:`ddl.smoke.check_statement`)."""
        from capgate.ddl.smoke import check_statement

        check_statement(name, sql, self.sqlglot_dialect)

    def run_contained(self, conn: Connection, calls: Sequence[ContainedCall],
                      timeout: float, *, isolate: bool = True) -> list[Ran]:
        """Run each call where nothing it does can stay, and say what it did.

        The default runs each in the adapter's read-only block (``read_only``);
        engines that can also tell whether a call left its containment (PostgreSQL,
        MariaDB) override this and report it as ``Ran.escaped``.  ``isolate``: each
        call in a session of its own where the engine contains calls that way.
        """
        out: list[Ran] = []
        for call in calls:
            try:
                with self.session(conn, dict(call.session)), self.read_only(conn):
                    result = conn.execute(sa.text(call.sql), dict(call.binds))
                    row = result.first() if result.returns_rows else None
                    out.append(Ran(None if row is None else tuple(row), result.returns_rows))
            except sa.exc.DBAPIError as exc:
                out.append(Ran(error=_first_line(exc.orig)))
        return out

    def catalog_version(self, conn: Connection, refs: Sequence[ObjectRef]) -> str | None:
        """A digest of the catalog in the sweep's scope, or None where none can be made.

        Equal digests at plan and at apply mean the dependents found at plan are still
        the dependents (an apply then skips finding them again); None always sweeps.
        """
        return None

    def probe_many(self, conn: Connection,
                   items: Sequence[tuple[ObjectRef, str, Mapping[str, str]]],
                   after: Sequence[ObjectRef]
                   ) -> tuple[list[Probe], dict[str, ObjectStatus] | None]:
        """``probe`` the sources, and the statuses ``after`` would have under them.

        Where the engine can try the sources without keeping them (PostgreSQL: in a
        savepoint that is rolled back) the statuses of ``after`` (the dependents) are
        checked -- compiled and run -- with the new code in place, so the plan knows what
        the change breaks and what no check covers before anyone approves it.  None
        where that cannot be known before the apply.
        """
        return self.probe(conn, items), None

    def probe(self, conn: Connection,
              items: Sequence[tuple[ObjectRef, str, Mapping[str, str]]]) -> list[Probe]:
        """What the catalog will show after each source, and its checker findings, if knowable.

        PostgreSQL applies every source in order in a savepoint that is rolled back;
        others predict the text from the source (or cannot) and have no findings.
        """
        out: list[Probe] = []
        for ref, source, _ in items:
            try:
                out.append(Probe(self.render(conn, ref, source), None, None))
            except ApplyFailed as exc:
                out.append(Probe(None, None, exc.message))
        return out

    # -- what every dialect must provide
    def read(self, conn: Connection, ref: ObjectRef) -> LiveObject | None:
        raise NotImplementedError

    def status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        raise NotImplementedError

    def recompile(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        raise NotImplementedError

    def dependents(
        self, conn: Connection, ref: ObjectRef, progress: Progress | None = None
    ) -> list[Dependent]:
        raise NotImplementedError

    def search_callers(self, conn: Connection, ref: ObjectRef) -> CallerSearch:
        raise NotImplementedError

    def apply(
        self, conn: Connection, ref: ObjectRef, source: str, attributes: Mapping[str, str]
    ) -> None:
        raise NotImplementedError

    def drop(self, conn: Connection, ref: ObjectRef) -> None:
        raise NotImplementedError

    def acquire_lock(self, conn: Connection, name: str, timeout: float) -> bool:
        raise NotImplementedError

    def release_lock(self, conn: Connection, name: str) -> None:
        raise NotImplementedError

    @contextmanager
    def session(self, conn: Connection, settings: Mapping[str, str]) -> Iterator[None]:
        """Run a block with session settings (e.g. MariaDB ``sql_mode``); none by default."""
        if settings:
            raise FeatureNotSupported(
                f"{self.dialect} takes no session settings ({sorted(settings)})",
                feature="session settings",
            )
        yield

    # -- remote and capabilities
    def remote_dependents(self, far: Connection, ref: ObjectRef, link: str) -> list[Dependent]:
        return []

    def has_packages(self, conn: Connection, *, check: bool = False) -> bool:
        if check:
            raise FeatureNotSupported(
                f"{self.dialect} has no packages", feature="packages", dialect=self.dialect
            )
        return False

    def has_session_lock(self, *, check: bool = False) -> bool:
        return True

    def has_compile_status(self, conn: Connection, *, check: bool = False) -> bool:
        return True


def _first_line(exc: BaseException | None) -> str:
    text = str(exc) if exc is not None else ""
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


first_line = _first_line


def lock_key(dialect: str, ref: ObjectRef) -> str:
    """The name of the session lock that serialises DDL on one (resolved) object.

    It depends on the object only -- not on how a URL spells the server -- so
    every loop on the same database contends for the same lock (PostgreSQL
    advisory locks are per database; MariaDB ``GET_LOCK`` and Oracle
    ``DBMS_LOCK`` names are per server, and the schema is part of the name).
    Packages and their bodies share one lock.
    """
    kind = SPEC_OF_BODY.get(ref.kind, ref.kind)
    raw = f"capgate:ddl:{dialect}:{kind}:{ref.schema}:{ref.name}:{ref.args}:{ref.parent}"
    return "cgddl_" + hashlib.sha256(raw.encode()).hexdigest()[:40]


# --- the registry -------------------------------------------------------------------------------


def adapter_for(name_or_url: str | URL, scope: Sequence[str] | None = None) -> BaseAdapter:
    """The catalog adapter for a dialect name (or alias) or a database URL."""
    name = engine_name(name_or_url)
    cls = BaseAdapter.implementations.get(name)
    if cls is None:
        raise FeatureNotSupported(
            f"no DDL catalog adapter for dialect {name!r}; known: "
            f"{', '.join(registered_dialects())}",
            feature="catalog adapter",
            dialect=name,
        )
    return cls(scope=scope)


def registered_dialects() -> list[str]:
    return BaseAdapter.implementations.names()
