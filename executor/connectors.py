"""Connectors: named target databases, each reachable only by its own rows.

A connector owns its SQLAlchemy engine and its dialect.  capgate's own tables
in the target (the landing marker and the fence, :mod:`executor.target`) are
checked once per process and connector -- never created by a call.
Passwords never leave this module: everything printable uses ``safe_url``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from capgate.executor.dialects import SECRET_KEY, Dialect, dialect_class, dialect_for
from capgate.executor.dialects import normalise_url as normalise_url  # the one URL normaliser
from capgate.executor.dialects import safe_url as safe_url  # the one redaction of a URL
from capgate.executor.dialects.base import (
    CONNECT_TIMEOUT_SECONDS,
    NETWORK_TIMEOUT_SECONDS,
    ConnectCuts,
    StatementCuts,
    rearm_before_statement,
)
from capgate.registry.errors import (
    ConfigError,
    ConnectorUnavailable,
    DatabaseSessionLimit,
    UnknownConnector,
)

ENVIRONMENTS = ("rig", "dev", "qa", "staging", "prod")
"""The venues, lowest first: an isolated rig < dev < qa < staging < prod (seed 001 §5)."""
GATED_SIMULATION_ENVIRONMENTS = frozenset({"staging", "prod"})
"""Where a write-and-rollback rehearsal is itself a gated simulation (customer-facing data)."""
PROMOTION_ENVIRONMENTS = frozenset({"staging", "prod"})
"""Where a write needs simulation evidence from a lower venue unless the connector says
otherwise (``requires_simulation``)."""
DEFAULT_SIMULATION_MAX_AGE = 7 * 24 * 3600.0
"""How old simulation evidence may be when it is promoted, unless the connector says."""


def venue_rank(environment: str) -> int:
    """The venue's place in the order rig < dev < qa < staging < prod."""
    return ENVIRONMENTS.index(environment)

def secret_query_keys(url: str | URL) -> list[str]:
    """The URL's query keys that carry a secret (they belong in ``connect_args``)."""
    return sorted(k for k in make_url(url).query if SECRET_KEY.search(k))


def resolve_connect_args(name: str, connect_args: Mapping[str, Any],
                         env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``connect_args`` with each ``{env = "VAR"}`` read from the environment now.

    A secret is never written into the configuration or a URL: it is named by
    the variable that holds it, and read only when the connector opens.
    """
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    for key, value in connect_args.items():
        if isinstance(value, Mapping):
            var = str(value.get("env", ""))
            if var not in env:
                raise ConfigError(
                    f"connector {name!r}: connect_args.{key} is read from the environment "
                    f"variable {var}, which is not set", connector=name, key=key, variable=var)
            out[key] = env[var]
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class ConnectorConfig:
    """One named target database, as configured."""

    name: str
    url: str
    environment: str
    session_budget: int = 6
    """Most sessions capgate opens at once on this connector (checked before the database)."""
    db_user_budget: int | None = None
    """Most sessions of the connector's database user, across connectors sharing it."""
    budget_wait_seconds: float = 10.0
    """How long a call waits in line for a free session before it is refused (CG321)."""
    claim_wait_seconds: float = 10.0
    """How long a call waits in line for an impact key another case's call holds before
    it is refused (CG320; CG330 with a coordination decision when a case holds the key
    across its calls).  0: refused at once."""
    case_session_budget: int | None = None
    """Most sessions one case holds at once on this connector, across processes (issue 17)."""
    case_claim_seconds: float = 900.0
    """How long a case holds the impact keys of its writes and plans without touching them
    (issue 17): every plan or write of the case renews the claim, ``capgate case close`` or
    ``release`` gives it back, and an abandoned case's claim expires after this long.
    ``0`` claims a write's keys for that call only (the behaviour before issue 17)."""
    statement_timeout: float = 30.0
    """Default server-side statement timeout, for rows that do not set one."""
    connect_timeout: float = CONNECT_TIMEOUT_SECONDS
    """How long opening a session may take before it is given up (the driver's own
    ``connect_timeout``; PostgreSQL counts whole seconds, at least 2)."""
    network_timeout: float = NETWORK_TIMEOUT_SECONDS
    """How long one statement outside a call's transaction -- resume's evidence, capgate's
    checks of its own tables -- may go unanswered before the connection is cut (a call's
    own statements are bounded by its deadline instead: :mod:`executor.cutoff`)."""
    simulation_approver_roles: tuple[str, ...] = ()
    """Roles that may approve a simulation here (a rehearsal on staging or prod is one).

    Empty means no one can: a gated simulation on this connector is refused."""
    connect_args: Mapping[str, Any] = field(default_factory=dict)
    """Extra arguments for the driver's ``connect()`` (python-oracledb: ``config_dir`` for
    ``tnsnames.ora``, ``wallet_location``, ``wallet_password``...).  A value may be
    ``{"env": "VAR"}``: read from the environment when the connector opens, so a
    secret never sits in a URL (they are printed) or in the file."""
    thick_mode: bool | Mapping[str, Any] = False
    """Oracle: run python-oracledb in Thick mode (``True`` or ``{lib_dir, config_dir}``
    for ``oracledb.init_oracle_client``), e.g. for native network encryption."""
    current_schema: str | None = None
    """Oracle: the schema unqualified names resolve in (a least-privilege account using
    the application owner's tables, capgate's included)."""
    # --- simulation first (issue 16) -----------------------------------------------
    logical: str | None = None
    """The logical connector this is a venue of (``[connectors.X.venues.ENV]``): rows
    that name ``logical`` run here when the call asks for this venue.  None: itself."""
    requires_simulation: bool | None = None
    """A write here is a promotion: it needs the case's simulation evidence from a lower
    venue (or a recorded exemption).  None: yes on staging and prod, no below."""
    simulation_max_age_seconds: float = DEFAULT_SIMULATION_MAX_AGE
    """The oldest simulation evidence a promotion here accepts."""
    promotion_roles: tuple[str, ...] = ()
    """When set, a promoting caller must also hold one of these roles for this environment."""
    production_simulation_approver_roles: tuple[str, ...] = ()
    """The roles that approve a production simulation (two roles, never the requester)."""
    business_timezone: str = "UTC"
    """Where the business day of a production simulation's reconciliation ends."""

    @property
    def logical_name(self) -> str:
        """The connector rows name: the logical connector of a venue, else this one."""
        return self.logical or self.name

    @property
    def promotes(self) -> bool:
        """Whether a write here needs simulation evidence (see ``requires_simulation``)."""
        if self.requires_simulation is not None:
            return self.requires_simulation
        return self.environment in PROMOTION_ENVIRONMENTS

    def __post_init__(self) -> None:
        if self.environment not in ENVIRONMENTS:
            raise ConfigError(
                f"connector {self.name!r}: environment must be one of {', '.join(ENVIRONMENTS)}, "
                f"got {self.environment!r}", connector=self.name)
        if self.session_budget < 1:
            raise ConfigError(f"connector {self.name!r}: session_budget must be >= 1")
        if self.case_session_budget is not None and self.case_session_budget < 1:
            raise ConfigError(f"connector {self.name!r}: case_session_budget must be >= 1",
                              field="case_session_budget")
        if not self.case_claim_seconds >= 0:
            raise ConfigError(f"connector {self.name!r}: case_claim_seconds must be >= 0",
                              field="case_claim_seconds")
        for key in ("connect_timeout", "network_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"connector {self.name!r}: {key} must be > 0", field=key)

    @property
    def safe_url(self) -> str:
        return safe_url(self.url)


@dataclass
class Connector:
    """A live connector: engine, dialect and the once-per-process set-up."""

    config: ConnectorConfig
    engine: sa.Engine
    dialect: Dialect
    _target_ready: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def environment(self) -> str:
        return self.config.environment

    @classmethod
    def open(cls, config: ConnectorConfig) -> Connector:
        dialect = dialect_for(normalise_url(config.url))
        options: dict[str, Any] = {
            # session budgets (executor/budget.py): the pool never holds more sessions than
            # the budget, and none at all where the server counts idle ones against a cap
            **dialect.pool_options(config.session_budget, config.db_user_budget),
            **dialect.engine_options()}
        engine = connector_engine(config, dialect, **options)
        sa.event.listen(engine, "before_cursor_execute", rearm_before_statement, retval=True)
        StatementCuts(dialect, config.network_timeout).install(engine)
        ConnectCuts(dialect.cut, config.connect_timeout).install(engine)
        return cls(config=config, engine=engine, dialect=dialect)

    def check_target(self) -> None:
        """capgate's tables are in the target and usable (checked once per process).

        Raises TargetNotInstalled / TargetPrivilegeMissing naming the table and
        the command that fixes it, ConnectorUnavailable when the database does
        not answer.  Never creates anything.
        """
        if self._target_ready:
            return
        from capgate.executor.target import missing_tables, refuse_missing

        with self._lock:
            if self._target_ready:
                return
            try:
                with self.engine.connect() as conn:
                    problems = missing_tables(conn, self.dialect)
            except sa.exc.DBAPIError as exc:
                if isinstance(exc, sa.exc.OperationalError) or exc.connection_invalidated \
                        or self.dialect.is_session_limit(exc):
                    raise self.unavailable(exc) from None
                raise
            refuse_missing(self.name, problems)
            self._target_ready = True

    @property
    def target_checked(self) -> bool:
        """Whether :meth:`check_target` already passed in this process."""
        return self._target_ready

    def forget_target(self) -> None:
        """The tables vanished after the check (a write found them missing): check again."""
        self._target_ready = False

    def unavailable(self, exc: BaseException) -> ConnectorUnavailable:
        """The coded error for a database that could not be reached.

        A database that refused the session because its per-user limit is reached
        (ORA-02391) is a budget error (``DatabaseSessionLimit``, CG321) that is also
        "unreachable": nothing was sent, so every caller treats it as such.
        """
        orig = getattr(exc, "orig", None) or exc
        lines = str(orig).strip().splitlines()
        if self.dialect.is_session_limit(exc):
            return DatabaseSessionLimit(
                f"connector {self.name!r} ({self.config.safe_url}): the database refused a "
                f"new session, its per-user limit is reached ({lines[0] if lines else ''}); "
                "keep session_budget and db_user_budget below it (`capgate doctor`)",
                connector=self.name, scope="database", budget=self.config.session_budget)
        return ConnectorUnavailable(
            f"connector {self.name!r} ({self.config.safe_url}) is unreachable: "
            f"{lines[0] if lines else type(orig).__name__}", connector=self.name)

    def dispose(self) -> None:
        self.engine.dispose()


def driver_options(config: ConnectorConfig, *, credentials: bool = True) -> dict[str, Any]:
    """``create_engine`` options for the connector's driver settings (its ``connect_args``,
    secrets read from the environment now), after switching python-oracledb to Thick mode
    when the connector asks for it (once per process, before any connection)."""
    args = resolve_connect_args(config.name, config.connect_args)
    if not credentials:
        args = {k: v for k, v in args.items() if k not in ("user", "password")}
    if config.thick_mode:
        dialect = dialect_class(config.url)
        if dialect is not None:
            dialect.prepare_driver(config.name, {"thick_mode": config.thick_mode})
    return {"connect_args": args} if args else {}


def connector_engine(config: ConnectorConfig, dialect: Dialect | None = None, *,
                     url: str | URL | None = None, **options: Any) -> sa.Engine:
    """An engine for the connector's database, set up as capgate's sessions expect.

    The one place an engine is made from a connector's settings (calls, ``doctor``,
    ``target install|check``, the DDL loop): its ``connect_args`` (secrets read from
    the environment now), Oracle's Thick mode and ``current_schema``, and the
    dialect's session set-up.  ``url`` replaces the connector's (``--admin-url``: then
    the credentials in ``connect_args`` are left out).
    """
    target = normalise_url(url if url is not None else config.url)
    dialect = dialect or dialect_for(target)
    dialect.configure({"current_schema": config.current_schema})
    extra = driver_options(config, credentials=url is None)
    # the network's bounds first (connect timeout, keepalive): the connector's own
    # connect_args, and the URL's settings, win over them
    network = dialect.network_args(target, config.connect_timeout)
    options["connect_args"] = {**network, **options.get("connect_args", {}),
                               **extra.get("connect_args", {})}
    if not options["connect_args"]:
        del options["connect_args"]
    engine = sa.create_engine(target, **options)
    dialect.prepare_engine(engine)
    return engine


class Connectors:
    """The configured connectors, opened lazily."""

    def __init__(self, configs: dict[str, ConnectorConfig]):
        self._configs = dict(configs)
        self._open: dict[str, Connector] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self._configs)

    def config(self, name: str) -> ConnectorConfig:
        try:
            return self._configs[name]
        except KeyError:
            raise UnknownConnector(
                f"connector {name!r} is not configured (configured: "
                f"{', '.join(sorted(self._configs)) or 'none'})", connector=name) from None

    def get(self, name: str) -> Connector:
        with self._lock:
            if name not in self._open:
                self._open[name] = Connector.open(self.config(name))
            return self._open[name]

    def venue(self, name: str, environment: str | None) -> Connector:
        """The instance of logical connector ``name`` in ``environment`` (None: its own).

        One configuration may name every instance (``[connectors.NAME.venues.ENV]``,
        configured as connector ``NAME@ENV``); with one configuration per
        environment the connector *is* its venue.  Refused (UnknownConnector) when
        no instance of ``name`` is in ``environment``.
        """
        own = self.config(name)
        if environment is None or own.environment == environment:
            return self.get(name)
        for config in self._configs.values():
            if config.logical == name and config.environment == environment:
                return self.get(config.name)
        venues = sorted({own.environment} | {c.environment for c in self._configs.values()
                                             if c.logical == name})
        raise UnknownConnector(
            f"connector {name!r} has no venue in {environment!r} (configured: "
            f"{', '.join(venues)}); add [connectors.{name}.venues.{environment}] or run "
            f"with that environment's configuration", connector=name,
            environment=environment, venues=venues)

    def dispose(self) -> None:
        for connector in self._open.values():
            connector.dispose()
        self._open.clear()
