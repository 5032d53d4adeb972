"""``capgate demo``: the whole loop on the packaged examples, in a scratch project.

The handler calls :func:`capgate.commands.demo.run_demo`, which tells the story
on standard output; with ``--json`` the story goes to stderr and standard
output holds one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from capgate.commands.demo import CASE, run_demo
from capgate.handlers.console import emit


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common],
                       help="run the demo on the packaged examples (SQLite, no server)",
                       description="A read, a collapsed write, an idempotent repeat, a "
                                   "rolled-back write, a four-eyes gate, a SIGKILL and "
                                   "resume, and ledger verify -- in a temporary folder, "
                                   "or in DIR with --keep.")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="run in DIR (new or empty) and leave the sandbox there: target, "
                        "ledger, capgate.toml")
    p.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.json:
        with contextlib.redirect_stdout(sys.stderr):
            folder = run_demo(args.keep)
        emit(args, {"ok": True, "case": CASE, "kept": str(folder) if args.keep else None})
        return 0
    run_demo(args.keep)
    return 0
