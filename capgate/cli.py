"""``capgate``: the command line, read top down.

:data:`COMMANDS` lists every command with the handler module that registers
it (:mod:`capgate.handlers`); a handler parses its arguments, calls one
library-level command function (:mod:`capgate.commands`, which the MCP server
and the Python API share) and prints the answer.  Every command takes
``--json``.  A ``CapgateError`` -- the one root every refusal has -- prints
``FAILED: CODE: message`` (or its JSON form) and maps to its exit code: 0 ok,
1 refused or invalid, 2 usage or configuration, 3 outcome unknown or
reconciliation required, 4 approval required, 5 an internal error (a bug:
``CG999``, which says whether an intent was left open); ``--traceback`` shows
the rest.

Start-up is lazy: the table names each command's module and one-line help,
so ``capgate --help`` imports no command module at all and ``capgate call``
imports only the modules that ``call`` needs.  An agent that calls through
the CLI pays the start-up on every call.
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
from capgate.registry.errors import CapgateError, RegistryError

__all__ = ["COMMANDS", "build_parser", "did_you_mean", "main", "version"]

Handler = Callable[[argparse.Namespace], int]

#: command -> (the handler module whose ``register(sub, common)`` adds it, its one-line
#: help).  A module registers exactly the commands the table gives it
#: (:func:`build_parser` checks).
COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("capgate.handlers.project",
             "scaffold a working project: config, grants, capabilities, target"),
    "demo": ("capgate.handlers.demo", "run the demo on the packaged examples (SQLite, no server)"),
    "doctor": ("capgate.handlers.doctor",
               "check configuration, grants and every connector's live access"),
    "validate": ("capgate.handlers.capabilities", "validate capability files"),
    "lock": ("capgate.handlers.capabilities", "pin every row's hash in capabilities.lock"),
    "list": ("capgate.handlers.capabilities", "list the registered rows"),
    "show": ("capgate.handlers.capabilities", "a row's review card"),
    "diff": ("capgate.handlers.capabilities",
             "Markdown review of the changes between OLD and NEW"),
    "bump": ("capgate.handlers.capabilities",
             "write the next version of a row, after the current one"),
    "explain": ("capgate.handlers.codes", "what an error code means"),
    "plan": ("capgate.handlers.calls",
             "render a call's plan (runs no DML); `plan show HASH` prints a recorded one"),
    "approvals": ("capgate.handlers.calls", "the plans waiting for an approval"),
    "approve": ("capgate.handlers.calls", "show a recorded plan, then approve it"),
    "approver": ("capgate.handlers.calls", "approvers' signing keys"),
    "call": ("capgate.handlers.calls", "call a declared operation"),
    "ledger": ("capgate.handlers.ledger", "the hash-chained ledger"),
    "cases": ("capgate.handlers.ledger", "list cases with their state and last outcome"),
    "mcp": ("capgate.handlers.agents",
            "serve the declared operations as MCP tools (stdio, or --http)"),
    "rehearse": ("capgate.handlers.agents",
                 "run every row's examples in write-and-rollback against a connector"),
    "simulate": ("capgate.handlers.simulation",
                 "simulate a change on a lower venue: baseline, execute, observe, tear down, "
                 "verify restoration"),
    "reconcile": ("capgate.handlers.simulation",
                  "run a production simulation's reconciliation query; --due lists what is "
                  "due"),
    "resume": ("capgate.handlers.resume",
               "after a fault: classify each in-flight intent from evidence, then continue"),
    "case": ("capgate.handlers.cases",
             "a case's claims, coordination decisions, symptoms and holds"),
    "gaps": ("capgate.handlers.ledger",
             "requests for operations no row declares (capability gaps)"),
    "ddl": ("capgate.handlers.ddl", "the DDL loop for stored code"),
    "target": ("capgate.handlers.target", "capgate's own tables in a target database"),
}


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


def _parser(loaded: Sequence[str], *, check: bool = False) -> argparse.ArgumentParser:
    """The parser with the real commands of the modules in ``loaded``, the rest as names.

    ``check``: refuse a module that registers other commands than :data:`COMMANDS`
    gives it (a command only some code paths could reach).
    """
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
        before = set(sub.choices)
        importlib.import_module(module).register(sub, common)
        if check:
            _check_registered(module, set(sub.choices) - before)
    # list the commands in the table's order, whoever registered them
    order = list(COMMANDS)
    sub._choices_actions.sort(key=lambda a: order.index(a.dest) if a.dest in order else 99)
    return parser


def _check_registered(module: str, registered: set[str]) -> None:
    expected = {name for name, (owner, _) in COMMANDS.items() if owner == module}
    if registered != expected:
        raise AssertionError(f"{module} registers {sorted(registered)}; COMMANDS gives it "
                             f"{sorted(expected)}")


def build_parser() -> argparse.ArgumentParser:
    """The full parser, every command module imported (tests and documentation)."""
    return _parser([module for module, _ in COMMANDS.values()], check=True)


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
