"""capgate's tables in a target database (``capgate target install|check CONNECTOR``).

A call never runs DDL, so a least-privilege account can write; these tables
(the landing marker and the fence) are installed once by an account that may
create tables -- the connector's own, or ``admin_url`` -- or by a DBA who runs
the script :func:`install_sql` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.config import load_settings
from capgate.executor.call import Executor
from capgate.executor.claims import store_for
from capgate.executor.connectors import ConnectorConfig, connector_engine, safe_url
from capgate.executor.dialects import dialect_for, normalise_url
from capgate.executor.fences import LEDGER_BEHIND, fence_report
from capgate.executor.fences import realign as realign_fences
from capgate.executor.target import TableState, first_line, install_script, table_states
from capgate.executor.target import install as install_tables
from capgate.registry.errors import (
    CapgateError,
    ConnectorUnavailable,
    TargetPrivilegeMissing,
    UnknownConnector,
    UsageError,
)


def _connector(config_path: str | Path | None, name: str) -> ConnectorConfig:
    settings = load_settings(config_path)
    found = settings.connectors.get(name)
    if found is None:
        raise UnknownConnector(
            f"connector {name!r} is not configured in {settings.source} "
            f"(configured: {', '.join(sorted(settings.connectors)) or 'none'})",
            connector=name)
    return found


def _target(config_path: str | Path | None, connector: str, admin_url: str | None
            ) -> tuple[ConnectorConfig, URL]:
    """The connector's configuration and the URL to install through."""
    if admin_url:  # the connector's driver settings when it is configured, else none
        try:
            config = _connector(config_path, connector)
        except CapgateError:
            config = ConnectorConfig(name=connector, url=admin_url,
                                     environment="dev")
        url = normalise_url(admin_url)
    else:
        config = _connector(config_path, connector)
        url = normalise_url(config.url)
    return config, url


def install_sql(config_path: str | Path | None, connector: str, *, grant_to: str | None = None,
                admin_url: str | None = None) -> dict[str, Any]:
    """The install script for a DBA to run: ``connector``, ``dialect`` and ``sql``."""
    _, url = _target(config_path, connector, admin_url)
    dialect = dialect_for(url)
    script = install_script(dialect, grant_to=grant_to)
    return {"connector": connector, "dialect": dialect.name, "sql": script}


@dataclass(frozen=True)
class Installed:
    """``install``'s answer: the tables created (none: already there), and where."""

    connector: str
    created: list[str]
    granted_to: str | None
    where: str
    """The database's URL, password hidden."""

    def to_dict(self) -> dict[str, Any]:
        return {"connector": self.connector, "created": self.created,
                "granted_to": self.granted_to}


def install(config_path: str | Path | None, connector: str, *, grant_to: str | None = None,
            admin_url: str | None = None) -> Installed:
    """Create capgate's tables in ``connector``'s database (once); grant ``grant_to`` their use.

    ``admin_url``: connect as this privileged account instead of the connector's; then the
    configuration is optional (``config_path`` names it; default: ``capgate.toml``).
    """
    config, url = _target(config_path, connector, admin_url)
    dialect = dialect_for(url)
    try:
        # the connector's driver settings (connect_args, Oracle Thick mode); with
        # --admin-url its credentials are left out
        engine = connector_engine(config, url=admin_url, poolclass=sa.pool.NullPool)
        try:
            created = install_tables(engine, dialect, grant_to=grant_to)
        finally:
            engine.dispose()
    except sa.exc.OperationalError as exc:
        raise ConnectorUnavailable(f"connector {connector!r} ({safe_url(url)}) is "
                                   f"unreachable: {first_line(exc)}",
                                   connector=connector) from None
    except sa.exc.DBAPIError as exc:
        raise TargetPrivilegeMissing(
            f"could not install capgate's tables at {safe_url(url)}: {first_line(exc)}; "
            f"use an account that may create tables (--admin-url) or give a DBA "
            f"`capgate target install {connector} --sql`",
            connector=connector) from None
    return Installed(connector, created, grant_to, safe_url(url))


@dataclass(frozen=True)
class TablesChecked:
    """``check``'s answer: each of capgate's tables as the connector's account sees it."""

    connector: str
    states: list[TableState]

    @property
    def ok(self) -> bool:
        return all(s.state == "ok" for s in self.states)

    def to_dict(self) -> dict[str, Any]:
        return {"connector": self.connector, "ok": self.ok,
                "tables": [{"table": s.table, "state": s.state, "detail": s.detail}
                           for s in self.states]}


def check(config_path: str | Path | None, connector: str) -> TablesChecked:
    """Whether ``connector``'s own account sees capgate's tables, and can use them."""
    config = _connector(config_path, connector)
    url = normalise_url(config.url)
    dialect = dialect_for(url)
    engine = connector_engine(config, dialect, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            states = table_states(conn, dialect)
    except sa.exc.OperationalError as exc:
        raise ConnectorUnavailable(f"connector {connector!r} ({safe_url(url)}) is "
                                   f"unreachable: {first_line(exc)}",
                                   connector=connector) from None
    finally:
        engine.dispose()
    return TablesChecked(connector, list(states))


def fences(gate: Executor, connector: str, *, realign: bool = False,
           by: str | None = None) -> dict[str, Any]:
    """The target's fence rows against this ledger's tokens (``executor.fences``);
    ``realign``: raise the ledger's tokens of the keys it is behind on, recorded as ``by``."""
    live = gate.connectors.get(connector)
    store = store_for(gate)
    out: dict[str, Any] = {"connector": connector}
    if realign:
        if not by:
            raise UsageError("--realign needs --by NAME: the person who looked at the report "
                             "is recorded with the change")
        moved, case = realign_fences(store, gate.ledger, live, by=by)
        out.update(realigned=[f.to_dict() for f in moved], recorded_in=case)
    rows = fence_report(store, live)
    out.update(fences=[f.to_dict() for f in rows],
               behind=sum(f.state == LEDGER_BEHIND for f in rows))
    return out
