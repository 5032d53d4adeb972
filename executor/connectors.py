"""Connectors: named target databases, each reachable only by its own rows.

A connector owns its SQLAlchemy engine and its dialect.  capgate's own tables
in the target (the landing marker and the fence, :mod:`executor.target`) are
checked once per process and connector -- never created by a call.
Passwords never leave this module: everything printable uses ``safe_url``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from executor.dialects import Dialect, dialect_for
from executor.dialects import normalise_url as normalise_url  # the one URL normaliser
from executor.dialects.base import rearm_before_statement
from registry.errors import ConfigError, ConnectorUnavailable, UnknownConnector

ENVIRONMENTS = ("dev", "qa", "staging", "prod")
GATED_SIMULATION_ENVIRONMENTS = frozenset({"staging", "prod"})
"""Where a write-and-rollback rehearsal is itself a gated simulation (customer-facing data)."""
def safe_url(url: str | URL) -> str:
    return make_url(url).render_as_string(hide_password=True)


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
    budget_wait_seconds: float = 0.0
    """How long a call waits for a free session before it is refused."""
    statement_timeout: float = 30.0
    """Default server-side statement timeout, for rows that do not set one."""
    simulation_approver_roles: tuple[str, ...] = ()
    """Roles that may approve a simulation here (a rehearsal on staging or prod is one).

    Empty means no one can: a gated simulation on this connector is refused."""

    def __post_init__(self) -> None:
        if self.environment not in ENVIRONMENTS:
            raise ConfigError(
                f"connector {self.name!r}: environment must be one of {', '.join(ENVIRONMENTS)}, "
                f"got {self.environment!r}", connector=self.name)
        if self.session_budget < 1:
            raise ConfigError(f"connector {self.name!r}: session_budget must be >= 1")

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
        url = normalise_url(config.url)
        dialect = dialect_for(url.get_backend_name())
        options: dict[str, Any] = dialect.engine_options()
        if url.get_backend_name() != "sqlite" and config.db_user_budget is not None:
            # --- session budgets (executor/budget.py): an idle pooled session still counts
            # against the database user's cap at the server, so keep none
            options["poolclass"] = sa.pool.NullPool  # --- end session budgets
        elif url.get_backend_name() != "sqlite":
            options.setdefault("pool_size", config.session_budget)
            options.setdefault("max_overflow", 0)
        engine = sa.create_engine(url, **options)
        dialect.prepare_engine(engine)
        sa.event.listen(engine, "before_cursor_execute", rearm_before_statement)
        return cls(config=config, engine=engine, dialect=dialect)

    def check_target(self) -> None:
        """capgate's tables are in the target and usable (checked once per process).

        Raises TargetNotInstalled / TargetPrivilegeMissing naming the table and
        the command that fixes it, ConnectorUnavailable when the database does
        not answer.  Never creates anything.
        """
        if self._target_ready:
            return
        from executor.target import missing_tables, refuse_missing

        with self._lock:
            if self._target_ready:
                return
            try:
                with self.engine.connect() as conn:
                    problems = missing_tables(conn, self.dialect)
            except sa.exc.DBAPIError as exc:
                if isinstance(exc, sa.exc.OperationalError) or exc.connection_invalidated:
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
        """The coded error for a database that could not be reached."""
        orig = getattr(exc, "orig", None) or exc
        lines = str(orig).strip().splitlines()
        return ConnectorUnavailable(
            f"connector {self.name!r} ({self.config.safe_url}) is unreachable: "
            f"{lines[0] if lines else type(orig).__name__}", connector=self.name)

    def dispose(self) -> None:
        self.engine.dispose()


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

    def dispose(self) -> None:
        for connector in self._open.values():
            connector.dispose()
        self._open.clear()
