"""``capgate mcp`` and ``capgate rehearse``: the faces for agents and CI.

Each handler parses its arguments and calls :mod:`capgate.commands.agents`
with the settings; ``rehearse`` prints the table (``--junit FILE``: also JUnit
XML) and exits 0 when every example passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from capgate.commands import agents
from capgate.config import load_settings
from capgate.handlers.console import emit
from capgate.registry.errors import EXIT_OK, EXIT_REFUSED


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "mcp", parents=[common],
        help="serve the declared operations as MCP tools (stdio, or --http)",
        description="One MCP tool per capability row the agent may use. The case of a call "
                    "comes from request _meta 'capgate/case', else --case, else one per "
                    "identity and server run.")
    p.add_argument("--as", dest="who", default=None,
                   help="the agent identity on stdio (default: CAPGATE_AGENT or config `agent`)")
    p.add_argument("--case", default=None,
                   help="default case for calls whose request _meta names none")
    p.add_argument("--http", metavar="HOST:PORT", default=None,
                   help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio")
    p.add_argument("--tokens", metavar="FILE", default=None,
                   help="HTTP: JSON object {token: identity} (default: env CAPGATE_MCP_TOKENS)")
    p.add_argument("--tls-cert", metavar="FILE", default=None,
                   help="HTTP: serve https with this certificate chain (PEM); needed beyond "
                        "a loopback address")
    p.add_argument("--tls-key", metavar="FILE", default=None,
                   help="HTTP: the certificate's private key (PEM)")
    p.add_argument("--poll", type=float, default=2.0, metavar="SECONDS",
                   help="how often to look for changed capability files (default 2)")
    p.set_defaults(handler=cmd_mcp)

    p = sub.add_parser(
        "rehearse", parents=[common],
        help="run every row's examples in write-and-rollback against a connector",
        description="Every example runs through the same path as `call` and rolls back "
                    "instead of committing; rows without examples get a zero-row probe. "
                    "Exit 0 when every example passed, 1 otherwise.")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="capability files or directories (default: the configured ones)")
    p.add_argument("--connector", action="append", default=None, metavar="NAME",
                   help="rehearse the rows of this connector (repeatable; default: every "
                        "connector a row names, each must be configured)")
    p.add_argument("--operation", action="append", default=None, metavar="OPERATION_ID",
                   help="only these operations (repeatable)")
    p.add_argument("--junit", metavar="FILE", default=None, help="also write JUnit XML here")
    p.add_argument("--case", default=None,
                   help="the case the rehearsal is recorded in (required on staging and prod, "
                        "where the rehearsal's plan needs an approval)")
    p.add_argument("--as", dest="who", default=None,
                   help="who rehearses; needs the grants a call needs "
                        "(default: CAPGATE_AGENT or config `agent`)")
    p.set_defaults(handler=cmd_rehearse)


def cmd_mcp(args: argparse.Namespace) -> int:
    agents.serve_mcp(load_settings(args.config), who=args.who, http=args.http,
                     tokens=args.tokens, case=args.case, poll_seconds=args.poll,
                     tls_cert=args.tls_cert, tls_key=args.tls_key)
    return EXIT_OK


def cmd_rehearse(args: argparse.Namespace) -> int:
    report = agents.rehearse(load_settings(args.config), args.paths, who=args.who,
                             connectors=args.connector, operations=args.operation,
                             case=args.case)
    if args.junit:
        Path(args.junit).write_bytes(report.junit_xml())
    emit(args, report.to_dict(), report.table())
    return EXIT_OK if report.ok else EXIT_REFUSED
