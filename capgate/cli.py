"""``capgate``: a thin command line over the libraries.

One function per command, each a few lines that call ``registry``,
``executor`` or ``ddl`` and print the result.  Every command takes ``--json``.
A ``CapgateError`` prints ``FAILED: CODE: message`` (or its JSON form) and maps
to its exit code: 0 ok, 1 refused or invalid, 2 usage or configuration,
3 outcome unknown or reconciliation required, 4 approval required, 5 an
internal error (a bug: ``CG999``, which says whether an intent was left open).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from capgate.internal import internal_error
from registry.errors import CapgateError, RegistryError, UsageError

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Handler, str]] = {}


def emit(args: argparse.Namespace, payload: Any, text: str | None = None) -> None:
    """Print JSON with ``--json``, else the human text."""
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, ensure_ascii=False, default=str))
    elif text is not None:
        print(text)


def parse_operation(spec: str) -> tuple[str, int | None]:
    """``OPERATION[@VERSION]`` -> (operation, version or None)."""
    op, _, ver = spec.partition("@")
    if ver and not ver.isdigit():
        raise UsageError(f"version must be an integer, got {ver!r}")
    return op, int(ver) if ver else None


def caller(args: argparse.Namespace, doing: str = "is calling") -> str:
    """The acting identity: ``--as``, else ``CAPGATE_AGENT`` or the config's ``agent``."""
    from capgate.config import load_settings

    who = args.who or load_settings(args.config).agent
    if not who:
        raise UsageError(f"say who {doing}: --as WHO (or CAPGATE_AGENT)")
    return str(who)


def _common() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parent.add_argument("--traceback", action="store_true", help="show tracebacks of errors")
    parent.add_argument("--config", metavar="FILE", default=None,
                        help="configuration file (default: capgate.toml, env CAPGATE_CONFIG)")
    return parent


def build_parser() -> argparse.ArgumentParser:
    from capgate import commands

    parser = argparse.ArgumentParser(
        prog="capgate",
        description="Connector capability registry and gated database-write executor.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.register(sub, _common())
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except CapgateError as exc:
        _report(args, exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader (e.g. `| head`) went away: stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # an unexpected failure: never a silent success
        internal = internal_error(exc, getattr(args, "case", None), getattr(args, "config", None))
        if getattr(args, "traceback", False):
            traceback.print_exc()
        _report(args, internal)
        return internal.exit_code


def _report(args: argparse.Namespace, exc: CapgateError) -> None:
    if getattr(args, "traceback", False):
        traceback.print_exc()
    if getattr(args, "json", False):
        print(json.dumps({"status": "failed", **exc.to_dict()}, indent=2, default=str))
        return
    if isinstance(exc, RegistryError) and exc.problems:
        for problem in exc.problems:
            print(problem.render(), file=sys.stderr)
        print(f"FAILED: {len(exc.problems)} problem(s)", file=sys.stderr)
        return
    print(f"FAILED: {exc}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
