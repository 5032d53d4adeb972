"""``capgate resume CASE | --all``: settle a case's in-flight intents from evidence.

The handler parses, calls :mod:`capgate.commands.resume` on an executor opened
from the configuration, prints the report (:func:`capgate.caseview.resume_lines`)
and maps it to an exit code: 0 when every intent is resolved, 3 when anything
is escalated, unknown, held or changed outside the case.
"""

from __future__ import annotations

import argparse
from typing import Any

from capgate.handlers.console import emit
from capgate.registry.errors import UsageError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "resume", parents=[common],
        help="after a fault: classify each in-flight intent from evidence, then continue",
        description="Classify every in-flight intent of CASE as applied, not_applied, "
                    "partly_applied or unknown from the target's evidence (landing marker, "
                    "commit outcome, session liveness, landed probe); record applied ones, "
                    "retry not_applied ones per the row's recovery with the same idempotency "
                    "key, escalate the rest.  Exit 0 when all are resolved, 3 otherwise.")
    p.add_argument("case", nargs="?", metavar="CASE", help="the case to resume")
    p.add_argument("--all", action="store_true", help="resume every open case")
    p.add_argument("--task", default=None, help="the task the case was opened for (refused "
                                                "when the case belongs to another task)")
    p.add_argument("--dry-run", action="store_true",
                   help="classify and re-check only; record and retry nothing")
    p.add_argument("--no-terminate", action="store_true",
                   help="never terminate a recorded session that may still commit; only wait")
    p.add_argument("--wait", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for such a session to end (default 5)")
    p.add_argument("--resolve", metavar="INTENT", default=None,
                   help="record a person's decision on an escalated intent instead")
    p.add_argument("--decision", choices=("applied", "not_applied", "accepted"), default=None)
    p.add_argument("--by", default=None, help="who decides (with --resolve)")
    p.add_argument("--note", default="", help="why (with --resolve)")
    p.set_defaults(handler=cmd_resume)


def cmd_resume(args: argparse.Namespace) -> int:
    from capgate import caseview
    from capgate.api import open as open_executor
    from capgate.commands import resume

    if bool(args.case) == bool(args.all):
        raise UsageError("name one CASE, or --all for every open case")
    with open_executor(args.config) as gate:
        if args.resolve:
            if not args.case or not args.decision or not args.by:
                raise UsageError("--resolve INTENT needs CASE, --decision and --by")
            done = resume.resolve(gate, args.case, args.resolve, by=args.by,
                                  decision=args.decision, note=args.note)
            emit(args, done, f"recorded: intent {args.resolve} {args.decision} by {args.by}")
            return 0
        report = resume.resume(gate, None if args.all else args.case, task=args.task,
                               terminate=not args.no_terminate, wait_seconds=args.wait,
                               act=not args.dry_run)
        body = report.to_dict()
        emit(args, body, "\n".join(caseview.resume_lines(body)))
        return report.exit_code
