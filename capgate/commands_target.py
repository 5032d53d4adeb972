"""``capgate target install|check CONNECTOR``: capgate's tables in a target database.

A call never runs DDL, so a least-privilege account can write; these tables
(the landing marker and the fence) are installed once by an account that may
create tables -- the connector's own, or ``--admin-url`` -- or by a DBA who runs
what ``--sql`` prints.
"""

from __future__ import annotations

import argparse
from typing import Any

import sqlalchemy as sa

from capgate.cli import emit
from capgate.config import load_settings
from executor.connectors import ConnectorConfig, connector_engine, safe_url
from executor.dialects import dialect_for, normalise_url
from executor.target import first_line, install, install_script, table_states
from registry.errors import (
    EXIT_REFUSED,
    CapgateError,
    ConnectorUnavailable,
    TargetPrivilegeMissing,
    UnknownConnector,
)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    target = sub.add_parser("target", help="capgate's own tables in a target database")
    tsub = target.add_subparsers(dest="target_command", metavar="COMMAND", required=True)

    p = tsub.add_parser("install", parents=[common],
                        help="create capgate's tables in a connector's database (once)")
    p.add_argument("connector")
    p.add_argument("--sql", action="store_true",
                   help="print the script for a DBA instead of running it")
    p.add_argument("--grant-to", metavar="USER", default=None,
                   help="also grant USER (the calling account) what a call needs on them")
    p.add_argument("--admin-url", metavar="URL", default=None,
                   help="connect as this privileged account instead of the connector's")
    p.set_defaults(handler=cmd_target_install)

    p = tsub.add_parser("check", parents=[common],
                        help="whether the connector's account sees capgate's tables")
    p.add_argument("connector")
    p.set_defaults(handler=cmd_target_check)


def _connector(args: argparse.Namespace) -> ConnectorConfig:
    settings = load_settings(args.config)
    config = settings.connectors.get(args.connector)
    if config is None:
        raise UnknownConnector(
            f"connector {args.connector!r} is not configured in {settings.source} "
            f"(configured: {', '.join(sorted(settings.connectors)) or 'none'})",
            connector=args.connector)
    return config


def cmd_target_install(args: argparse.Namespace) -> int:
    if args.admin_url:  # the connector's driver settings when it is configured, else none
        try:
            config = _connector(args)
        except CapgateError:
            config = ConnectorConfig(name=args.connector, url=args.admin_url,
                                     environment="dev")
        url = normalise_url(args.admin_url)
    else:
        config = _connector(args)
        url = normalise_url(config.url)
    dialect = dialect_for(url)
    if args.sql:
        script = install_script(dialect, grant_to=args.grant_to)
        emit(args, {"connector": args.connector, "dialect": dialect.name, "sql": script},
             script.rstrip())
        return 0
    try:
        # the connector's driver settings (connect_args, Oracle Thick mode); with
        # --admin-url its credentials are left out
        engine = connector_engine(config, url=args.admin_url, poolclass=sa.pool.NullPool)
        try:
            created = install(engine, dialect, grant_to=args.grant_to)
        finally:
            engine.dispose()
    except sa.exc.OperationalError as exc:
        raise ConnectorUnavailable(f"connector {args.connector!r} ({safe_url(url)}) is "
                                   f"unreachable: {first_line(exc)}",
                                   connector=args.connector) from None
    except sa.exc.DBAPIError as exc:
        raise TargetPrivilegeMissing(
            f"could not install capgate's tables at {safe_url(url)}: {first_line(exc)}; "
            f"use an account that may create tables (--admin-url) or give a DBA "
            f"`capgate target install {args.connector} --sql`",
            connector=args.connector) from None
    emit(args, {"connector": args.connector, "created": created, "granted_to": args.grant_to},
         (f"installed {', '.join(created)}" if created else "already installed")
         + f" in {safe_url(url)}" + (f"; granted to {args.grant_to}" if args.grant_to else ""))
    return 0


def cmd_target_check(args: argparse.Namespace) -> int:
    config = _connector(args)
    url = normalise_url(config.url)
    dialect = dialect_for(url)
    engine = connector_engine(config, dialect, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            states = table_states(conn, dialect)
    except sa.exc.OperationalError as exc:
        raise ConnectorUnavailable(f"connector {args.connector!r} ({safe_url(url)}) is "
                                   f"unreachable: {first_line(exc)}",
                                   connector=args.connector) from None
    finally:
        engine.dispose()
    ok = all(s.state == "ok" for s in states)
    emit(args, {"connector": args.connector, "ok": ok,
                "tables": [{"table": s.table, "state": s.state, "detail": s.detail}
                           for s in states]},
         "\n".join(f"{s.table}: {s.state}{' (' + s.detail + ')' if s.detail else ''}"
                   for s in states))
    return 0 if ok else EXIT_REFUSED
