"""``capgate plan | plan show | approvals | approve | approver keygen | call``: a call,
its plan and its approval.

Each handler parses its arguments, calls :mod:`capgate.commands.calls` on an
executor opened from the configuration (:func:`capgate.api.open`, as a Python
caller opens one) and prints the answer.  ``capgate call`` pays for every
import here on each call: what only one command needs is imported inside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from capgate.api import open as open_executor
from capgate.commands import calls
from capgate.handlers.console import caller, emit, parse_operation, parse_ttl, read_inputs
from capgate.registry.errors import ApprovalDeclined, UsageError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    def call_args(p: argparse.ArgumentParser, *, case_required: bool = True) -> None:
        p.add_argument("operation", metavar="OPERATION[@VERSION]")
        p.add_argument("--input", default="{}", help="inputs as a JSON object (or @file.json)")
        p.add_argument("--case", required=case_required, help="the case this call belongs to")
        p.add_argument("--as", dest="who", default=None,
                       help="caller identity (default: CAPGATE_AGENT or config `agent`)")
        p.add_argument("--venue", default=None, metavar="ENV",
                       help="the connector's instance in ENV, when one configuration names "
                            "several (default: the connector's own environment)")

    p = sub.add_parser("plan", parents=[common], help="render a call's plan; runs no DML",
                       usage="capgate plan OPERATION[@VERSION] --input JSON --case CASE "
                             "[--dry-run] | capgate plan show PLAN_HASH")
    call_args(p, case_required=False)
    p.add_argument("shown", nargs="?", metavar="PLAN_HASH",
                   help="with `show`: the recorded plan to print")
    p.add_argument("--dry-run", action="store_true",
                   help="record nothing either (by default the plan is recorded in the "
                        "ledger so that an approver can find it by its hash)")
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("approvals", parents=[common],
                       help="the plans waiting for an approval")
    p.add_argument("--case", default=None, help="only this case's")
    p.set_defaults(handler=cmd_approvals)

    p = sub.add_parser("approve", parents=[common], help="approve a recorded plan")
    p.add_argument("plan_hash", metavar="PLAN_HASH")
    p.add_argument("--yes", action="store_true",
                   help="do not ask (a script); on a terminal capgate shows the plan and "
                        "asks before it signs")
    p.add_argument("--by", required=True, help="the approver")
    p.add_argument("--role", required=True, help="the role the approver acts in")
    p.add_argument("--key", default=None, metavar="FILE",
                   help="the approver's private key (default: env CAPGATE_APPROVER_KEY); "
                        "its public half must be the approver's approval_key in the grants")
    p.add_argument("--ttl", default=None, help="lifetime, e.g. 30m, 2h, 900s (default: row's)")
    p.set_defaults(handler=cmd_approve)

    approver = sub.add_parser("approver", help="approvers' signing keys")
    asub = approver.add_subparsers(dest="approver_command", metavar="COMMAND", required=True)
    p = asub.add_parser("keygen", parents=[common],
                        help="make an approver's key pair; prints the grants line")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="where the private key goes (mode 0600; keep it where agents cannot "
                        "read it)")
    p.add_argument("--force", action="store_true", help="replace an existing key file")
    p.set_defaults(handler=cmd_approver_keygen)

    p = sub.add_parser("call", parents=[common], help="call a declared operation")
    call_args(p)
    p.add_argument("--key", default=None, help="idempotency key (default: the row's template)")
    p.add_argument("--task", default=None, help="the task this case was opened for")
    p.add_argument("--plan", dest="plan_hash", default=None,
                   help="the approved plan hash this call must match")
    p.add_argument("--bind", action="append", default=[], metavar="INPUT=SOURCE.NAME",
                   help="bind INPUT to the value an earlier intent of the case returned as "
                        "NAME (SOURCE: its intent id, or its operation id), read from the "
                        "ledger; repeatable")
    p.set_defaults(handler=cmd_call)


def cmd_plan(args: argparse.Namespace) -> int:
    from capgate import caseview

    if args.operation == "show" and args.shown is not None:
        return cmd_plan_show(args)
    if args.shown is not None:
        raise UsageError(f"unexpected argument {args.shown!r}: `capgate plan OPERATION "
                         "--input JSON --case CASE`, or `capgate plan show PLAN_HASH`")
    if not args.case:
        raise UsageError("capgate plan OPERATION needs --case CASE (the case the call "
                         "belongs to)", field="case")
    op, version = parse_operation(args.operation)
    with open_executor(args.config) as gate:
        plan = calls.plan(gate, op, read_inputs(args.input), case=args.case, who=caller(args),
                          version=version, venue=args.venue, record=not args.dry_run,
                          via="cli")
    body = plan.to_dict()
    lines = [f"plan {plan.plan_hash}", *caseview.plan_lines(body)]
    lines.extend(_promotion_lines(body.get("promotion")))
    if not args.dry_run:
        lines.append(f"recorded: `capgate plan show {plan.plan_hash}` prints it again")
    emit(args, body, "\n".join(lines))
    return 0


def cmd_plan_show(args: argparse.Namespace) -> int:
    from capgate import caseview

    with open_executor(args.config) as gate:
        shown = calls.show_plan(gate, args.shown)
    emit(args, shown, "\n".join([caseview.shown_plan_text(shown),
                                 *_promotion_lines(shown["plan"].get("promotion"))]))
    return 0


def cmd_approvals(args: argparse.Namespace) -> int:
    with open_executor(args.config) as gate:
        pending = calls.pending_plans(gate, case=args.case)
    lines = [f"{len(pending)} plan(s) recorded that need an approval and were not used"]
    for p in pending:
        body = p["plan"]
        what = (f"{body.get('operation_id')}@{body.get('version')}" if body.get("operation_id")
                else str(body.get("kind") or "plan"))
        lines.append(f"  {p['plan_hash']}  {what:<28} case {p['case']} by {p['requester']}, "
                     f"{p['created_at'][:19]}: {p['status']}")
    if pending:
        lines.append("read one with `capgate plan show PLAN_HASH`; approve it with "
                     "`capgate approve PLAN_HASH --by NAME --role ROLE --key FILE`")
    emit(args, pending, "\n".join(lines))
    return 0


def _promotion_lines(section: dict[str, Any] | None) -> list[str]:
    """Issue 16: what the plan of a promotion carries, for its approver."""
    if not section:
        return []
    if section.get("evidence"):
        ev = section["evidence"]
        return [f"  promotion to {section['environment']}: simulation {ev['simulation_id']} on "
                f"{ev['environment']} ({ev['completed_at']}), baseline restored "
                f"{ev['baseline_digest']}"]
    exemption = section.get("exemption") or {}
    head = (f"  promotion to {section['environment']}: no simulation evidence "
            f"({section.get('missing')}); exemption test: "
            f"{'exempt' if exemption.get('exempt') else 'not exempt: the call is refused'}")
    return [head, *(f"    ({p['point']}) {p['name']}: {'holds' if p['holds'] else 'fails'} "
                    f"[{p['how']}] {p['why']}" for p in exemption.get("points", ()))]


def cmd_approve(args: argparse.Namespace) -> int:
    """Show the plan, ask on a terminal (``--yes``: do not), then sign and record."""
    from capgate import caseview
    from capgate.executor.approvals import load_signing_key

    key = load_signing_key(args.key)
    ttl = parse_ttl(args.ttl)
    with open_executor(args.config) as gate:
        shown = calls.show_plan(gate, args.plan_hash)
        text = caseview.shown_plan_text(shown)
        if not args.json:
            print(text, flush=True)
        if not args.yes and sys.stdin.isatty():
            answer = _ask(f"approve this plan as {args.by} ({args.role})? [y/N] ")
            if answer not in ("y", "yes"):
                raise ApprovalDeclined(
                    f"plan {args.plan_hash} was not approved (answered {answer!r}); nothing "
                    "was recorded", plan_hash=args.plan_hash)
        record = calls.approve(gate, args.plan_hash, by=args.by, role=args.role, key=key,
                               ttl_seconds=ttl)
    emit(args, {**record, "plan": shown["plan"]},
         f"approved {record['plan_hash']} by {record['by']} as {record['role']}, "
         f"single use, expires {record['expires_at']}")
    return 0


def _ask(question: str) -> str:
    """One answer from the person at the terminal (the question on stderr)."""
    print(question, end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    return line.strip().lower()


def cmd_approver_keygen(args: argparse.Namespace) -> int:
    made = calls.make_approver_key(args.out, force=args.force)
    emit(args, made,
         f"private key written to {args.out} (mode 0600): keep it where only you can read it\n"
         f"add to your principal in the grants file:\n  approval_key = "
         f"\"{made['approval_key']}\"")
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    op, version = parse_operation(args.operation)
    with open_executor(args.config) as gate:
        inputs = read_inputs(args.input)
        bindings = []
        if args.bind:  # issue 16: inputs bound to earlier intents' returned values
            from capgate.executor.returned import parse_binding

            bindings = [parse_binding(b) for b in args.bind]
        outcome = calls.call(gate, op, inputs, case=args.case, who=caller(args),
                             version=version, key=args.key, task=args.task,
                             plan_hash=args.plan_hash, venue=args.venue, bindings=bindings,
                             via="cli")
    payload = outcome.to_dict()
    replayed = " (recorded outcome, nothing executed)" if outcome.replayed else ""
    text = [f"{outcome.status}: {outcome.operation_id}@{outcome.version} intent "
            f"{outcome.intent_id}{replayed}"]
    if outcome.reason:
        text.append(f"  reason: {json.dumps(outcome.reason, default=str)}")
    text.append(f"  evidence: {json.dumps(outcome.evidence, default=str)}")
    emit(args, payload, "\n".join(text))
    return outcome.exit_code
