"""Registry commands: validate, lock, list, show, diff, explain.

Each handler takes the parsed arguments, calls the library and prints; the
logic lives in ``registry``.
"""

from __future__ import annotations

import argparse
from typing import Any

from capgate.cli import emit, parse_operation
from registry import errors
from registry.loader import DEFAULT_PATH, load_registry, update_lock, validate_paths
from registry.model import Row
from registry.review import card, diff, rows_from


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("validate", parents=[common], help="validate capability files")
    p.add_argument("paths", nargs="*", default=[DEFAULT_PATH])
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
                       help="Markdown review of the changes between OLD and NEW")
    p.add_argument("old", help="file, directory or git:REV[:PATH]")
    p.add_argument("new", help="file, directory or git:REV[:PATH]")
    p.set_defaults(handler=cmd_diff)

    p = sub.add_parser("explain", parents=[common], help="what an error code means")
    p.add_argument("code", nargs="?")
    p.add_argument("--all", action="store_true", help="list every code")
    p.set_defaults(handler=cmd_explain)

    from capgate import commands_exec

    commands_exec.register(sub, common)


def _capability_paths(args: argparse.Namespace) -> list[str]:
    """``--capabilities`` if given, else the configured paths."""
    if args.capabilities:
        return list(args.capabilities)
    from capgate.config import load_settings

    return list(load_settings(args.config).capabilities)


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
    result = validate_paths(args.paths)
    payload = {
        "ok": result.ok,
        "files": result.files,
        "rows": len(result.rows),
        "problems": [p.to_dict() for p in result.problems],
        "warnings": [w.to_dict() for w in result.warnings],
    }
    if args.json:
        emit(args, payload)
    else:
        for problem in result.problems:
            print(problem.render())
        for warning in result.warnings:
            print(f"warning: {warning.render()}")
        if result.ok:
            print(f"ok: {len(result.rows)} rows in {len(result.files)} file(s)")
        else:
            print(f"FAILED: {len(result.problems)} problem(s) in {len(result.files)} file(s)")
    return 0 if result.ok else errors.EXIT_REFUSED


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


def cmd_diff(args: argparse.Namespace) -> int:
    text = diff(rows_from(args.old), rows_from(args.new))
    emit(args, {"markdown": text}, text.rstrip())
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
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
