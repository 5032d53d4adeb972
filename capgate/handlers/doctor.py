"""``capgate doctor``: the argparse side of :mod:`capgate.commands.doctor`."""

from __future__ import annotations

import argparse
from typing import Any

from capgate.commands.doctor import run_doctor
from capgate.handlers.console import emit


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("doctor", parents=[common],
                       help="check configuration, grants and every connector's live access",
                       description="Every configuration key, the grants, the capability "
                                   "files, what each identity gets, and per connector: "
                                   "reachable, server, environment, capgate's tables, "
                                   "privileges, session limits, extensions.  Exit 1 on any "
                                   "error.")
    p.add_argument("--offline", action="store_true",
                   help="check the configuration and files only; connect to nothing")
    p.set_defaults(handler=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from capgate.registry.errors import EXIT_OK, EXIT_REFUSED, ConfigMissing

    report = run_doctor(args.config, live=not args.offline)
    emit(args, report.to_dict(), report.text())
    if any(f.code == ConfigMissing.code for f in report.errors):
        return ConfigMissing.exit_code
    return EXIT_OK if report.ok else EXIT_REFUSED
