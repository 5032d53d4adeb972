"""``capgate target install | check CONNECTOR``: capgate's tables in a target database.

Each handler parses its arguments, calls :mod:`capgate.commands.target` and
prints the answer; ``install --sql`` prints the script for a DBA instead of
running it.
"""

from __future__ import annotations

import argparse
from typing import Any

from capgate.commands import target
from capgate.handlers.console import emit
from registry.errors import EXIT_REFUSED


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    group = sub.add_parser("target", help="capgate's own tables in a target database")
    tsub = group.add_subparsers(dest="target_command", metavar="COMMAND", required=True)

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


def cmd_target_install(args: argparse.Namespace) -> int:
    if args.sql:
        script = target.install_sql(args.config, args.connector, grant_to=args.grant_to,
                                    admin_url=args.admin_url)
        emit(args, script, script["sql"].rstrip())
        return 0
    done = target.install(args.config, args.connector, grant_to=args.grant_to,
                          admin_url=args.admin_url)
    emit(args, done.to_dict(),
         (f"installed {', '.join(done.created)}" if done.created else "already installed")
         + f" in {done.where}" + (f"; granted to {done.granted_to}" if done.granted_to else ""))
    return 0


def cmd_target_check(args: argparse.Namespace) -> int:
    checked = target.check(args.config, args.connector)
    emit(args, checked.to_dict(),
         "\n".join(f"{s.table}: {s.state}{' (' + s.detail + ')' if s.detail else ''}"
                   for s in checked.states))
    return 0 if checked.ok else EXIT_REFUSED
