"""``capgate validate | lock | list | show | diff | bump``: the capability files.

Each handler parses its arguments, calls :mod:`capgate.commands.capabilities`
and prints the answer (``--json``: its JSON form).
"""

from __future__ import annotations

import argparse
from typing import Any

from capgate.commands import capabilities
from capgate.handlers.console import emit, parse_operation
from capgate.registry import errors
from capgate.registry.loader import DEFAULT_PATH


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("validate", parents=[common], help="validate capability files",
                       description="Every problem of every file in one pass.  Without PATH: "
                                   "the configured capability files, and the configuration "
                                   "itself (capgate.toml) when there is one.")
    p.add_argument("paths", nargs="*", default=None)
    p.set_defaults(handler=cmd_validate)

    p = sub.add_parser("lock", parents=[common], help="pin every row's hash in capabilities.lock")
    p.add_argument("paths", nargs="*", default=[DEFAULT_PATH])
    p.set_defaults(handler=cmd_lock)

    p = sub.add_parser("list", parents=[common], help="list the registered rows")
    p.add_argument("--capabilities", metavar="PATH", action="append", default=None)
    p.add_argument("--all", action="store_true", help="include retired rows")
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("show", parents=[common], help="a row's review card")
    p.add_argument("operation", metavar="OPERATION[@VERSION]")
    p.add_argument("--capabilities", metavar="PATH", action="append", default=None)
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("diff", parents=[common],
                       help="Markdown review of the changes between OLD and NEW",
                       description="OLD and NEW are files, directories or git:REV[:PATH]; a "
                                   "new version is compared field by field with the version "
                                   "before it. Or two versions of one operation in the "
                                   "configured files: capgate diff OP@1 OP@2.")
    p.add_argument("old", help="file, directory, git:REV[:PATH], or OPERATION@VERSION")
    p.add_argument("new", help="file, directory, git:REV[:PATH], or OPERATION@VERSION")
    p.add_argument("--capabilities", metavar="PATH", action="append", default=None,
                   help="with OPERATION@VERSION: the capability files (default: configured)")
    p.set_defaults(handler=cmd_diff)

    p = sub.add_parser("bump", parents=[common],
                       help="write the next version of a row, after the current one")
    p.add_argument("operation", metavar="OPERATION")
    p.add_argument("--capabilities", metavar="PATH", action="append", default=None)
    p.add_argument("--retire", action="store_true",
                   help="also mark the current version retired (kept, refused at call time)")
    p.set_defaults(handler=cmd_bump)


def _paths(args: argparse.Namespace) -> list[str]:
    return capabilities.capability_paths(args.capabilities, args.config)


def cmd_validate(args: argparse.Namespace) -> int:
    checked = capabilities.validate(args.paths or [], config=args.config)
    if args.json:
        emit(args, checked.to_dict())
        return 0 if checked.ok else errors.EXIT_REFUSED
    result, config_problems = checked.files, checked.configuration or []
    for config_problem in config_problems:
        print(config_problem.render())
    for problem in result.problems:
        print(problem.render())
    for warning in result.warnings:
        print(f"warning: {warning.render()}")
    count = len(result.problems) + len(config_problems)
    if checked.ok:
        print(f"ok: {len(result.rows)} rows in {len(result.files)} file(s)")
    else:
        print(f"FAILED: {count} problem(s) in {len(result.files)} file(s)"
              + (" and the configuration" if config_problems else ""))
    return 0 if checked.ok else errors.EXIT_REFUSED


def cmd_lock(args: argparse.Namespace) -> int:
    locked = capabilities.lock(args.paths)
    emit(args, locked.to_dict(),
         f"{locked.path}: {len(locked.pins)} rows pinned, {len(locked.added)} new"
         + "".join(f"\n  + {p.ref} {p.hash}" for p in locked.added))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    rows = capabilities.listing(_paths(args), include_retired=args.all)
    lines = [f"{'OPERATION':<32} {'VER':>3}  {'EFFECT':<13} {'SHAPE':<9} {'AUTH':<11} "
             f"{'LOCK':<9} ENVIRONMENTS"]
    for r, pinned in rows:
        lines.append(f"{r.operation_id:<32} {r.version:>3}  {r.effect_class!s:<13} "
                     f"{(r.shape or '-')!s:<9} {r.authorization.kind!s:<11} "
                     f"{'pinned' if pinned else 'UNPINNED':<9} "
                     f"{','.join(r.environments)}{'  (retired)' if r.retired else ''}")
    if any(not pinned for _, pinned in rows):
        lines.append("UNPINNED rows are drafts: capabilities.lock does not pin them as they "
                     "are, so they run only in the unlocked environments (`capgate lock`)")
    emit(args, [capabilities.row_summary(r, pinned) for r, pinned in rows], "\n".join(lines))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from capgate.registry.review import card

    paths = _paths(args)
    op, version = parse_operation(args.operation)
    row, pinned = capabilities.show_row(paths, op, version)
    emit(args, {**capabilities.row_summary(row, pinned), "row": row.to_dict()},
         card(row, pinned))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    text = capabilities.diff(args.old, args.new, paths=args.capabilities, config=args.config)
    emit(args, {"markdown": text}, text.rstrip())
    return 0


def cmd_bump(args: argparse.Namespace) -> int:
    done = capabilities.bump(_paths(args), args.operation, retire=args.retire)
    emit(args, done,
         f"wrote {done['operation_id']}@{done['version']} (a copy of @{done['from']}) at "
         f"{done['file']}:{done['line']}"
         + (f"; @{done['from']} is now retired" if done["retired_previous"] else "")
         + (f"\n@{done['from']} had been edited in place: the edit is @{done['version']} "
            f"now, and @{done['from']} reads again as it was locked"
            if done.get("restored_previous") else "")
         + "\nnext: edit the new row, then `capgate validate`, review it with "
           "`capgate diff git:HEAD capabilities` (or `capgate diff "
           f"{done['operation_id']}@{done['from']} {done['operation_id']}@{done['version']}`), "
           "and pin it with `capgate lock`")
    return 0
