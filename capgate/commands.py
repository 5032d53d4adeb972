"""Registry commands: validate, lock, list, show, diff, explain.

Each handler takes the parsed arguments, calls the library and prints; the
logic lives in ``registry``.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from capgate.cli import emit, parse_operation
from registry import errors
from registry.loader import DEFAULT_PATH, load_registry, update_lock, validate_paths
from registry.model import Row
from registry.review import card, diff, rows_from


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

    p = sub.add_parser("explain", parents=[common], help="what an error code means")
    p.add_argument("code", nargs="?")
    p.add_argument("--all", action="store_true", help="list every code")
    p.set_defaults(handler=cmd_explain)


def _capability_paths(args: argparse.Namespace) -> list[str]:
    """``--capabilities`` if given, else the configured paths."""
    if args.capabilities:
        return list(args.capabilities)
    from capgate.config import load_settings

    return list(load_settings(args.config, require=False).capabilities)


def row_summary(row: Row) -> dict[str, Any]:
    return {
        "operation_id": row.operation_id,
        "version": row.version,
        "effect_class": str(row.effect_class),
        "shape": str(row.shape) if row.shape else None,
        "connector": row.connector,
        "authorization": str(row.authorization.kind),
        "environments": list(row.environments),
        "retired": row.retired,
        "row_hash": row.row_hash,
        "source": f"{row.source_path}:{row.source_line}",
    }


def cmd_validate(args: argparse.Namespace) -> int:
    paths = list(args.paths or [])
    config_problems: list[Any] = []
    checked_config = False
    if not paths:
        from capgate.config import config_file, read_settings

        paths = [DEFAULT_PATH]
        if config_file(args.config) is not None:  # a configuration is validated with its files
            settings, config_problems = read_settings(args.config)
            paths = list(settings.capabilities)
            checked_config = True
    result = validate_paths(paths)
    ok = result.ok and not config_problems
    payload = {
        "ok": ok,
        "files": result.files,
        "rows": len(result.rows),
        "problems": [p.to_dict() for p in result.problems],
        "warnings": [w.to_dict() for w in result.warnings],
    }
    if checked_config:
        payload["configuration_problems"] = [p.to_dict() for p in config_problems]
    if args.json:
        emit(args, payload)
    else:
        for config_problem in config_problems:
            print(config_problem.render())
        for problem in result.problems:
            print(problem.render())
        for warning in result.warnings:
            print(f"warning: {warning.render()}")
        count = len(result.problems) + len(config_problems)
        if ok:
            print(f"ok: {len(result.rows)} rows in {len(result.files)} file(s)")
        else:
            print(f"FAILED: {count} problem(s) in {len(result.files)} file(s)"
                  + (" and the configuration" if config_problems else ""))
    return 0 if ok else errors.EXIT_REFUSED


def cmd_lock(args: argparse.Namespace) -> int:
    path, added, pins = update_lock(args.paths)
    emit(args, {"lock": str(path), "rows": len(pins), "added": [p.ref for p in added]},
         f"{path}: {len(pins)} rows pinned, {len(added)} new"
         + "".join(f"\n  + {p.ref} {p.hash}" for p in added))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    registry = load_registry(_capability_paths(args))
    rows = registry.rows(include_retired=True) if args.all else registry.rows(
        include_retired=False)
    lines = [f"{'OPERATION':<32} {'VER':>3}  {'EFFECT':<13} {'SHAPE':<9} {'AUTH':<11} ENVIRONMENTS"]
    for r in rows:
        lines.append(f"{r.operation_id:<32} {r.version:>3}  {r.effect_class!s:<13} "
                     f"{(r.shape or '-')!s:<9} {r.authorization.kind!s:<11} "
                     f"{','.join(r.environments)}{'  (retired)' if r.retired else ''}")
    emit(args, [row_summary(r) for r in rows], "\n".join(lines))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    registry = load_registry(_capability_paths(args))
    op, version = parse_operation(args.operation)
    if version is not None:
        found = [r for r in registry.rows() if r.key == (op, version)]
        row = found[0] if found else registry.resolve(op, version)
    else:
        row = registry.resolve(op)
    emit(args, {**row_summary(row), "row": row.to_dict()}, card(row))
    return 0


_VERSION_REF = re.compile(r"^[A-Za-z0-9_.-]+@\d+$")


def cmd_diff(args: argparse.Namespace) -> int:
    from pathlib import Path

    from registry.review import diff_versions

    if all(_VERSION_REF.match(x) and not Path(x).exists() for x in (args.old, args.new)):
        old, new = parse_operation(args.old), parse_operation(args.new)
        assert old[1] is not None and new[1] is not None
        rows = validate_paths(_capability_paths(args), check_lock=False)
        rows.raise_for_problems()
        text = diff_versions(rows.rows, (old[0], old[1]), (new[0], new[1]))
    else:
        text = diff(rows_from(args.old), rows_from(args.new))
    emit(args, {"markdown": text}, text.rstrip())
    return 0


#: Modules that define error classes outside ``registry.errors``; imported by
#: ``explain`` because the command line no longer imports every module at start.
ERROR_MODULES = ("ddl.errors", "executor.dialects.base", "registry.simulation_errors")


def cmd_explain(args: argparse.Namespace) -> int:
    import importlib

    for module in ERROR_MODULES:
        importlib.import_module(module)
    if args.all or not args.code:
        classes = errors.all_codes()
        emit(args, [{"code": c.code, "name": c.__name__, "exit_code": c.exit_code}
                    for c in classes],
             "\n".join(f"{c.code}  {c.__name__:<28} "
                       f"{(c.__doc__ or '').strip().splitlines()[0]}" for c in classes))
        return 0
    cls = errors.lookup(args.code)
    emit(args, {"code": cls.code, "name": cls.__name__, "exit_code": cls.exit_code,
                "explanation": (cls.__doc__ or "").strip()}, errors.explain(args.code).rstrip())
    return 0


def cmd_bump(args: argparse.Namespace) -> int:
    from registry.review import bump

    done = bump(_capability_paths(args), args.operation, retire=args.retire)
    emit(args, done,
         f"wrote {done['operation_id']}@{done['version']} (a copy of @{done['from']}) at "
         f"{done['file']}:{done['line']}"
         + (f"; @{done['from']} is now retired" if done["retired_previous"] else "")
         + "\nnext: edit the new row, then `capgate validate`, review it with "
           "`capgate diff git:HEAD capabilities` (or `capgate diff "
           f"{done['operation_id']}@{done['from']} {done['operation_id']}@{done['version']}`), "
           "and pin it with `capgate lock`")
    return 0
