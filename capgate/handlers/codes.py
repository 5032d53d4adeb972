"""``capgate explain [CODE | --all]``: what an error code means."""

from __future__ import annotations

import argparse
from typing import Any

from capgate.commands import codes
from capgate.handlers.console import emit


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("explain", parents=[common], help="what an error code means")
    p.add_argument("code", nargs="?")
    p.add_argument("--all", action="store_true", help="list every code")
    p.set_defaults(handler=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    if args.all or not args.code:
        classes = codes.all_codes()
        emit(args, [{"code": c.code, "name": c.__name__, "exit_code": c.exit_code}
                    for c in classes],
             "\n".join(f"{c.code}  {c.__name__:<28} "
                       f"{(c.__doc__ or '').strip().splitlines()[0]}" for c in classes))
        return 0
    cls = codes.explain(args.code)
    emit(args, {"code": cls.code, "name": cls.__name__, "exit_code": cls.exit_code,
                "explanation": (cls.__doc__ or "").strip()},
         codes.explanation(args.code).rstrip())
    return 0
