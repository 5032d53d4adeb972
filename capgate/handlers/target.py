"""``capgate target install | check CONNECTOR``: capgate's tables in a target database.

Each handler parses its arguments, calls :mod:`capgate.commands.target` and
prints the answer; ``install --sql`` prints the script for a DBA instead of
running it.
"""

from __future__ import annotations

import argparse
from typing import Any

from capgate.api import open as open_executor
from capgate.commands import target
from capgate.handlers.console import emit
from capgate.registry.errors import EXIT_REFUSED


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

    p = tsub.add_parser("fences", parents=[common],
                        help="the target's fence rows against the ledger's claim tokens "
                             "(a ledger restored from an older backup)")
    p.add_argument("connector")
    p.add_argument("--realign", action="store_true",
                   help="raise the ledger's token of every key it is behind on to the "
                        "target's, recorded in a case of its own")
    p.add_argument("--by", metavar="NAME", default=None,
                   help="who looked at the report and realigns (with --realign)")
    p.set_defaults(handler=cmd_target_fences)


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


def cmd_target_fences(args: argparse.Namespace) -> int:
    with open_executor(args.config) as gate:
        report = target.fences(gate, args.connector, realign=args.realign, by=args.by)
    lines = []
    for f in report["fences"]:
        line = (f"{f['impact_key']}: {f['state']} (target token {f['fence_token']}, "
                f"ledger token {f['ledger_token'] if f['ledger_token'] is not None else '-'})")
        if f["state"] == "ledger_behind":
            landed = f["landed"]
            line += (f"; last written by intent {f['fence_intent']}"
                     + (f" of case {landed['case_id']} ({landed['operation_id']}, landed "
                        f"{landed['landed_at']})" if landed else " (no landing marker)"))
        lines.append(line)
    if report.get("recorded_in"):
        lines.append(f"realigned {len(report['realigned'])} key(s); recorded in case "
                     f"{report['recorded_in']}")
    elif report["behind"]:
        lines.append(f"the ledger is behind the target on {report['behind']} key(s): it lost "
                     "history (restored from an older backup, edited or cloned), and the "
                     "writes listed may be missing from it; once understood, "
                     f"`capgate target fences {args.connector} --realign --by NAME`")
    if not report["fences"]:
        lines.append("no fence rows")
    emit(args, report, "\n".join(lines))
    return EXIT_REFUSED if report["behind"] else 0
