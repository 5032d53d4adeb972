"""``capgate init [DIR]``: scaffold a working project.

The handler parses, calls :func:`capgate.commands.project.init_project` and
prints what was made and what to run next.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from capgate.commands.project import ENVIRONMENTS, init_project
from capgate.handlers.console import emit


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "init", parents=[common],
        help="scaffold a working project: config, grants, capabilities, target",
        description="Write capgate.toml, grants.toml and capabilities/ into DIR, make the "
                    "target (an embedded SQLite file with the example schema, or --target "
                    "URL) and install capgate's tables in it.  Right after, `capgate call` "
                    "and `capgate mcp` work in DIR with no edits.  Nothing is overwritten.")
    p.add_argument("folder", nargs="?", default=".", metavar="DIR",
                   help="the project folder (created if missing; default: here)")
    p.add_argument("--empty", action="store_true",
                   help="an annotated template with one read row instead of the examples")
    p.add_argument("--target", metavar="URL", default=None,
                   help="your own database instead of an embedded SQLite file")
    p.add_argument("--example-schema", action="store_true",
                   help="with --target: also create the example tables and rows there")
    p.add_argument("--environment", default="dev", choices=ENVIRONMENTS,
                   help="the connectors' environment label, which the grants cover "
                        "(default dev)")
    p.add_argument("--agent", default=None,
                   help="the agent identity to grant (default claims-agent, or agent "
                        "with --empty)")
    p.set_defaults(handler=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    report = init_project(args.folder, target=args.target, empty=args.empty,
                          environment=args.environment, example_schema=args.example_schema,
                          agent=args.agent)
    lines = [f"created a capgate project in {report.folder}:"]
    for name in report.files:
        lines.append(f"  {name}")
    for name, url in report.connectors.items():
        lines.append(f"  connector {name} ({report.environment}) -> {url}")
    lines.append(f"  {report.rows} capability rows, {report.pinned} pinned in "
                 "capabilities/capabilities.lock (a change is a new version: `capgate bump`); "
                 "capgate's tables in the target: "
                 + (", ".join(report.target_tables) or "already there")
                 + ("; the example schema and rows created" if report.example_schema else ""))
    lines.append(f"  {report.agent!r} may write in {report.environment}; alice and bob "
                 "approve (role dba), each with their own signing key in keys/ (sample keys: "
                 "in a real project each person keeps their own where agents cannot read it)")
    if report.ddl_checks:
        lines.append(f"  the example DDL rows cannot be verified here yet: {report.ddl_checks} "
                     "(`capgate doctor` warns until then)")
    lines += ["", "next:"] + [f"  {step}" for step in report.next_steps]
    lines += ["", "an MCP client (e.g. the `mcpServers` of its settings file):",
              "  " + json.dumps(report.mcp_client)]
    emit(args, report.to_dict(), "\n".join(lines))
    return 0
