"""``capgate``: a thin command line over the libraries.

One function per command, each a few lines that call ``registry``,
``executor`` or ``ddl`` and print the result.  Every command takes ``--json``.
A ``CapgateError`` prints ``FAILED: CODE: message`` (or its JSON form) and maps
to its exit code: 0 ok, 1 refused or invalid, 2 usage or configuration,
3 outcome unknown or reconciliation required, 4 approval required, 5 an
internal error (a bug: ``CG999``, which says whether an intent was left open).

Start-up is lazy: :data:`COMMANDS` names each command's module and one-line
help, so ``capgate --help`` imports no command module at all and ``capgate
call`` imports only the modules that ``call`` needs.  An agent that calls
through the CLI pays the start-up on every call.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from capgate.internal import internal_error
from registry.errors import CapgateError, RegistryError, UsageError

Handler = Callable[[argparse.Namespace], int]

#: command -> (the module whose ``register(sub, common)`` adds it, its one-line help).
#: A module registers all of its commands; ``tests/test_cli_registry.py`` checks
#: that this table and the modules agree.
COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("capgate.init", "scaffold a working project: config, grants, capabilities, target"),
    "demo": ("capgate.demo", "run the demo on the packaged examples (SQLite, no server)"),
    "doctor": ("capgate.doctor",
               "check configuration, grants and every connector's live access"),
    "validate": ("capgate.commands", "validate capability files"),
    "lock": ("capgate.commands", "pin every row's hash in capabilities.lock"),
    "list": ("capgate.commands", "list the registered rows"),
    "show": ("capgate.commands", "a row's review card"),
    "diff": ("capgate.commands", "Markdown review of the changes between OLD and NEW"),
    "bump": ("capgate.commands", "write the next version of a row, after the current one"),
    "explain": ("capgate.commands", "what an error code means"),
    "plan": ("capgate.commands_exec", "render a call's plan; runs no DML"),
    "approve": ("capgate.commands_exec", "approve a recorded plan"),
    "approver": ("capgate.commands_exec", "approvers' signing keys"),
    "call": ("capgate.commands_exec", "call a declared operation"),
    "ledger": ("capgate.commands_exec", "the hash-chained ledger"),
    "cases": ("capgate.commands_exec", "list cases with their state and last outcome"),
    "mcp": ("capgate.commands_agent",
            "serve the declared operations as MCP tools (stdio, or --http)"),
    "rehearse": ("capgate.commands_agent",
                 "run every row's examples in write-and-rollback against a connector"),
    "simulate": ("capgate.commands_simulate",
                 "simulate a change on a lower venue: baseline, execute, observe, tear down, "
                 "verify restoration"),
    "reconcile": ("capgate.commands_simulate",
                  "run a production simulation's reconciliation query; --due lists what is "
                  "due"),
    "resume": ("capgate.commands_resume",
               "after a fault: classify each in-flight intent from evidence, then continue"),
    "case": ("capgate.commands_case",
             "a case's claims, coordination decisions, symptoms and holds"),
    "gaps": ("capgate.commands_case",
             "requests for operations no row declares (capability gaps)"),
    "ddl": ("capgate.commands_ddl", "the DDL loop for stored code"),
    "target": ("capgate.commands_target", "capgate's own tables in a target database"),
}


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


def version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a bare tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("capgate")
    except PackageNotFoundError:
        return "0+unknown"


class _VersionAction(argparse.Action):
    """``--version``, which looks the version up only when asked.

    ``importlib.metadata`` costs a CLI call 25-40 ms; only ``--version`` needs it.
    """

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"capgate {version()}")
        parser.exit()


def _parser(loaded: Sequence[str]) -> argparse.ArgumentParser:
    """The parser with the real commands of the modules in ``loaded``, the rest as names."""
    parser = argparse.ArgumentParser(
        prog="capgate",
        description="Connector capability registry and gated database-write executor.",
        epilog="New here? `capgate init DIR` scaffolds a working project; `capgate demo` "
               "shows the whole loop. `capgate COMMAND --help` for one command.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = _common()
    for name, (module, help_text) in COMMANDS.items():
        if module not in loaded:
            sub.add_parser(name, help=help_text, add_help=False)
    for module in dict.fromkeys(loaded):
        importlib.import_module(module).register(sub, common)
    # list the commands in the table's order, whoever registered them
    order = list(COMMANDS)
    sub._choices_actions.sort(key=lambda a: order.index(a.dest) if a.dest in order else 99)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The full parser, every command module imported (tests and documentation)."""
    return _parser([module for module, _ in COMMANDS.values()])


def _command_word(argv: Sequence[str]) -> str | None:
    """The first word that is not an option: the command (None for ``--help``)."""
    return next((word for word in argv if not word.startswith("-")), None)


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` did you mean `x`?`` for the closest of ``choices``, or an empty string."""
    import difflib

    close = difflib.get_close_matches(word, choices, n=2, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(f"`{c}`" for c in close) + "?"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    word = _command_word(argv)
    if word is not None and word not in COMMANDS:
        # argparse would list every command; a person wants the one they meant
        _parser([]).error(f"unknown command {word!r}{did_you_mean(word, list(COMMANDS))} "
                          "(`capgate --help` lists them)")
    parser = _parser([COMMANDS[word][0]] if word is not None else [])
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
