"""``capgate simulate`` and ``capgate reconcile``: simulation first (issue 16).

Each handler parses its arguments, calls :mod:`capgate.commands.simulation` on
an executor opened from the configuration and prints what it returned
(``--json``: the whole report).  ``simulate`` exits 0 when the baseline was
restored (or, with ``--dry-run``, once planned), 1 when the write rolled back,
3 when it escalated.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from capgate.handlers.console import caller, emit, parse_operation, read_inputs
from capgate.registry.errors import UsageError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "simulate", parents=[common],
        help="simulate a change on a lower venue: baseline, execute, observe, tear down, "
             "verify restoration",
        description="Runs OPERATION on a lower venue (rig < dev < qa < staging < prod) and "
                    "takes it back out: captures the baseline, declares the planned effects "
                    "and cleanup, executes it (committed, through the call path and its "
                    "gates), observes it, tears down exactly what it wrote and re-reads the "
                    "baseline. Every step is a ledger event of CASE; a restored simulation "
                    "is the evidence a promotion of the same row version needs. It is not a "
                    "deployment.")
    p.add_argument("operation", metavar="OPERATION[@VERSION]", nargs="?")
    p.add_argument("--input", default="{}", help="inputs as a JSON object (or @file.json)")
    p.add_argument("--case", required=True, help="the case the simulation belongs to")
    p.add_argument("--as", dest="who", default=None,
                   help="caller identity (default: CAPGATE_AGENT or config `agent`)")
    p.add_argument("--venue", default=None, metavar="ENV",
                   help="the connector's instance in ENV, when one configuration names "
                        "several (default: the connector's own environment)")
    p.add_argument("--customer-informed", default=None, metavar="'WHO at WHEN'",
                   help="staging: who informed the customer, and when (ISO time)")
    p.add_argument("--data-dependency", default=None, metavar="TEXT",
                   help="prod: why the evidence cannot be obtained off production")
    p.add_argument("--dry-run", action="store_true",
                   help="plan only: no statement to any database, nothing recorded")
    p.add_argument("--continue", dest="resume", default=None, metavar="SIMULATION",
                   help="continue simulation SIMULATION of CASE at its first unrecorded step")
    p.add_argument("--abandon", default=None, metavar="SIMULATION",
                   help="end simulation SIMULATION of CASE that never executed")
    p.set_defaults(handler=cmd_simulate)

    p = sub.add_parser(
        "reconcile", parents=[common],
        help="run a production simulation's reconciliation query; --due lists what is due",
        description="Runs the reconciliation query a production simulation's row names and "
                    "records its result; it is due the same business day (the connector's "
                    "business_timezone). With --due, lists every production simulation whose "
                    "reconciliation is due or overdue (exit 1 when one is overdue).")
    p.add_argument("case", nargs="?", help="the case")
    p.add_argument("simulation", nargs="?", help="the simulation id")
    p.add_argument("--due", action="store_true", help="list due and overdue reconciliations")
    p.add_argument("--as", dest="who", default=None, help="who records the reconciliation")
    p.set_defaults(handler=cmd_reconcile)


def customer_informed(raw: str | None) -> dict[str, str] | None:
    """``'WHO at WHEN'`` -> ``{"who", "when"}``, WHEN an ISO-8601 time with its zone."""
    if raw is None:
        return None
    who, sep, when = raw.rpartition(" at ")
    try:
        moment = dt.datetime.fromisoformat(when.strip())
    except ValueError:
        moment = None
    if not sep or not who.strip() or moment is None or moment.tzinfo is None:
        raise UsageError(f"--customer-informed {raw!r}: expected 'WHO at WHEN' with WHEN an "
                         "ISO time with its zone, e.g. 'Maria Ivanova at 2026-12-01T09:00Z'",
                         option="--customer-informed")
    return {"who": who.strip(), "when": moment.isoformat()}


def _text(report: Any) -> str:
    lines = [f"simulation {report.simulation_id or '(dry run)'}: {report.status}"]
    plan = report.plan
    lines.append(f"  {plan['operation_id']}@{plan['version']} on {plan['connector']} "
                 f"({plan['environment']}), case {plan['case']}; plan {plan['plan_hash']}")
    for q in plan["baseline"]:
        lines.append(f"  baseline {q['name']}: {' '.join(q['sql'].split())}")
    cleanup = plan["cleanup"]
    for st in cleanup["compensation"]:
        lines.append(f"  cleanup (compensation) {st['name']}: {' '.join(st['sql'].split())}")
    for d in cleanup["delete_returned"]:
        lines.append(f"  cleanup: delete each {d['table']}.{d['key']} that {d['statement']} "
                     "returns")
    for effect in plan["planned_effects"]["expected_effects"]:
        lines.append(f"  expected effect {effect['name']} ({effect['class']}, observed by "
                     f"{effect['observed_by']})")
    exemption = plan["exemption"]
    lines.append(f"  exemption test: {'exempt' if exemption['exempt'] else 'not exempt'}")
    for point in exemption["points"]:
        lines.append(f"    ({point['point']}) {point['name']}: "
                     f"{'holds' if point['holds'] else 'fails'} [{point['how']}] {point['why']}")
    for c in (plan.get("production") or {}).get("conditions", ()):
        lines.append(f"  production condition ({c['condition']}) {c['name']}: "
                     f"{'holds' if c['holds'] else 'fails'}: {c['why']}")
    for step in report.steps:
        extra = ""
        if step["step"] == "planned":
            planned = step["plan"]["planned_effects"]
            extra = (f"{len(planned['statements'])} statement(s), "
                     f"{len(planned['expected_effects'])} expected effect(s) and the cleanup")
        elif step["step"] == "baseline":
            extra = f"digest {step['baseline']['digest']}"
        elif step["step"] == "executed":
            extra = f"intent {step['intent_id']}: {step['outcome']}"
        elif step["step"] == "observed":
            extra = f"returned {json.dumps(step['observed'].get('returned') or {})}"
        elif step["step"] == "torn_down":
            extra = (f"intent {step.get('teardown_intent_id')}: {step.get('outcome')}, counts "
                     f"{step.get('counts')}")
        elif step["step"] in ("restored", "rolled_back"):
            extra = f"baseline re-read: digest {step['restored']['digest']} (identical)"
        elif step["step"] == "escalated":
            extra = f"{step['escalation']}: {json.dumps(step.get('mismatches') or step)[:400]}"
        lines.append(f"  {step['event']:<22} {extra}".rstrip())
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    from capgate.api import open as open_executor
    from capgate.commands import simulation

    who = caller(args, "is simulating")
    with open_executor(args.config) as gate:
        if args.resume is not None:
            report = simulation.continue_simulation(gate, args.case, args.resume, who=who)
        elif args.abandon is not None:
            report = simulation.abandon_simulation(gate, args.case, args.abandon, who=who)
        else:
            if not args.operation:
                raise UsageError("say which operation to simulate (or --continue SIMULATION)")
            op, version = parse_operation(args.operation)
            report = simulation.simulate(
                gate, op, read_inputs(args.input), case=args.case, who=who, version=version,
                venue=args.venue, customer_informed=customer_informed(args.customer_informed),
                data_dependency=args.data_dependency, dry_run=args.dry_run)
    emit(args, report.to_dict(), _text(report))
    return report.exit_code


def cmd_reconcile(args: argparse.Namespace) -> int:
    from capgate.api import open as open_executor
    from capgate.commands import simulation

    with open_executor(args.config) as gate:
        if args.due:
            found = simulation.due(gate, case=args.case)
            emit(args, found, "\n".join(
                f"{d['state']:<8} {d['case']}  simulation {d['simulation_id']} "
                f"{d['operation_id']}: {d['reconciliation']} due by {d['due_by']}"
                for d in found) or "no reconciliation is due")
            return 1 if any(d["state"] == "overdue" for d in found) else 0
        if not args.case or not args.simulation:
            raise UsageError("reconcile CASE SIMULATION (or --due)")
        record = simulation.reconcile(gate, args.case, args.simulation,
                                      caller(args, "is reconciling"))
    emit(args, record, f"reconciliation {record['name']}: {'ok' if record['ok'] else 'FAILED'}"
                       f"{'' if record['on_time'] else ' (late: after the business day)'}")
    return 0 if record["ok"] else 1
