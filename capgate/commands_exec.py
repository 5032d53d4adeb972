"""Executor commands: plan, approve, call, ledger verify/show, cases, demo."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from capgate.api import build_executor
from capgate.cli import caller, emit, parse_operation
from capgate.config import load_settings
from executor import channel
from executor.call import Executor
from executor.ledger import open_ledger
from registry.errors import EXIT_REFUSED, UsageError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    def call_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("operation", metavar="OPERATION[@VERSION]")
        p.add_argument("--input", default="{}", help="inputs as a JSON object (or @file.json)")
        p.add_argument("--case", required=True, help="the case this call belongs to")
        p.add_argument("--as", dest="who", default=None,
                       help="caller identity (default: CAPGATE_AGENT or config `agent`)")
        p.add_argument("--venue", default=None, metavar="ENV",
                       help="the connector's instance in ENV, when one configuration names "
                            "several (default: the connector's own environment)")

    p = sub.add_parser("plan", parents=[common], help="render a call's plan; runs no DML")
    call_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="record nothing either (by default the plan is recorded in the "
                        "ledger so that an approver can find it by its hash)")
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("approve", parents=[common], help="approve a recorded plan")
    p.add_argument("plan_hash", metavar="PLAN_HASH")
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

    ledger = sub.add_parser("ledger", help="the hash-chained ledger")
    lsub = ledger.add_subparsers(dest="ledger_command", metavar="COMMAND", required=True)
    p = lsub.add_parser("verify", parents=[common], help="verify chains, snapshots and anchors")
    p.add_argument("--case", default=None)
    p.add_argument("--anchor", metavar="FILE", default=None,
                   help="also check against an anchor exported by `capgate ledger anchor`: "
                        "finds a case deleted or rolled back since")
    p.set_defaults(handler=cmd_ledger_verify)
    p = lsub.add_parser("anchor", parents=[common],
                        help="record the ledger-wide head (every case head) and export it",
                        description="Records an anchor in the ledger -- the digest over "
                                    "every case's head, chained to the anchor before, MAC'd "
                                    "with the ledger's key -- and writes it to FILE. Keep the "
                                    "file where the ledger's writers cannot rewrite it; "
                                    "`capgate ledger verify --anchor FILE` later finds a case "
                                    "deleted, or rolled back to an older copy, since.")
    p.add_argument("--out", metavar="FILE", default=None, help="write the anchor as JSON here")
    p.set_defaults(handler=cmd_ledger_anchor)
    p = lsub.add_parser("migrate", parents=[common],
                        help="upgrade the ledger's tables to this capgate's format",
                        description="Runs the ledger's migrations (alembic) in one "
                                    "transaction under the store's DDL lock. Each format-1 "
                                    "case is verified first; nothing changes if one does not "
                                    "verify. Take a backup first.")
    p.set_defaults(handler=cmd_ledger_migrate)
    p = lsub.add_parser("show", parents=[common],
                        help="a case's timeline: time, actor, event, one-line summary",
                        description="Every event of CASE in chain order, one line each; "
                                    "--json prints every field of every event, --html FILE "
                                    "writes the case as one self-contained HTML page.")
    p.add_argument("case")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write the case as a self-contained HTML page")
    p.set_defaults(handler=cmd_ledger_show)
    from capgate.commands_case import register_stats

    register_stats(lsub, common)

    p = sub.add_parser("cases", parents=[common],
                       help="list cases with their state and last outcome")
    p.add_argument("--open", action="store_true", help="only cases with unresolved intents")
    p.set_defaults(handler=cmd_cases)


def _executor(args: argparse.Namespace) -> Executor:
    return build_executor(load_settings(args.config))


def _inputs(raw: str) -> dict[str, Any]:
    """``--input``: a JSON object, or ``@FILE`` holding one; every mistake is a usage error."""
    if raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as fh:
                raw = fh.read()
        except OSError as exc:
            raise UsageError(f"--input {raw}: cannot read the file: {exc.strerror}",
                             path=raw[1:]) from None
        except UnicodeDecodeError:
            raise UsageError(f"--input {raw}: the file is not UTF-8 text", path=raw[1:]) from None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--input is not valid JSON: {exc}") from None
    except RecursionError:
        raise UsageError("--input is nested too deeply to read") from None
    if not isinstance(value, dict):
        raise UsageError("--input must be a JSON object")
    return value




def cmd_plan(args: argparse.Namespace) -> int:
    op, version = parse_operation(args.operation)
    with _executor(args) as executor, channel.via("cli"):
        plan = executor.plan(op, _inputs(args.input), case=args.case, who=caller(args),
                             version=version, venue=args.venue, record=not args.dry_run)
    body = plan.to_dict()
    lines = [f"plan {plan.plan_hash}",
             f"  {body['operation_id']}@{body['version']} on {body['connector']} "
             f"({body['environment']}), {body['effect_class']}"
             f"{'/' + body['shape'] if body['shape'] else ''}",
             f"  target: {json.dumps(body['target'])}",
             f"  impact keys: {', '.join(body['impact_keys']) or '-'}"]
    for i, st in enumerate(body["statements"] + body["steps"]):
        sql = " ".join((st.get("sql") or st.get("check", {}).get("sql", "")).split())
        lines.append(f"  [{i + 1}] {sql}")
        lines.append(f"      binds {json.dumps(st.get('binds', {}))}; "
                     f"expect {st.get('expect_rows')}")
    for check in body["verify"]:
        lines.append(f"  verify {check['name']}: expect {json.dumps(check['expect'])}")
    auth = body["authorization"]
    if auth["kind"] == "gate":
        lines.append(f"  approval needed from: {', '.join(auth['approver_roles'])}"
                     f"{' (four eyes)' if auth['four_eyes'] else ''}")
    lines.extend(_promotion_lines(body.get("promotion")))
    emit(args, body, "\n".join(lines))
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


_TTL = re.compile(r"^(\d+)\s*([smhd]?)$")


def _ttl(raw: str | None) -> int | None:
    if raw is None:
        return None
    m = _TTL.match(raw.strip())
    if not m:
        raise UsageError(f"--ttl must look like 900s, 30m, 2h or 1d, got {raw!r}")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def cmd_approve(args: argparse.Namespace) -> int:
    from executor.approvals import load_signing_key

    key = load_signing_key(args.key)
    with _executor(args) as executor:
        record = executor.approve(args.plan_hash, by=args.by, role=args.role, key=key,
                                  ttl_seconds=_ttl(args.ttl))
    emit(args, record, f"approved {record['plan_hash']} by {record['by']} as {record['role']}, "
                       f"single use, expires {record['expires_at']}")
    return 0


def cmd_approver_keygen(args: argparse.Namespace) -> int:
    from executor.approvals import generate

    public = generate(args.out, force=args.force)
    emit(args, {"private_key": args.out, "approval_key": public},
         f"private key written to {args.out} (mode 0600): keep it where only you can read it\n"
         f"add to your principal in the grants file:\n  approval_key = \"{public}\"")
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    op, version = parse_operation(args.operation)
    with _executor(args) as executor, channel.via("cli"):
        call = {"version": version, "key": args.key, "task": args.task,
                "plan_hash": args.plan_hash, "venue": args.venue}
        if args.bind:  # issue 16: inputs bound to earlier intents' returned values
            from executor.bindings import call_bound
            from executor.returned import parse_binding

            outcome = call_bound(executor, op, _inputs(args.input),
                                 [parse_binding(b) for b in args.bind], case=args.case,
                                 who=caller(args), **call)
        else:
            outcome = executor.call(op, _inputs(args.input), case=args.case,
                                    who=caller(args), **call)
    payload = outcome.to_dict()
    replayed = " (recorded outcome, nothing executed)" if outcome.replayed else ""
    text = [f"{outcome.status}: {outcome.operation_id}@{outcome.version} intent "
            f"{outcome.intent_id}{replayed}"]
    if outcome.reason:
        text.append(f"  reason: {json.dumps(outcome.reason, default=str)}")
    text.append(f"  evidence: {json.dumps(outcome.evidence, default=str)}")
    emit(args, payload, "\n".join(text))
    return outcome.exit_code


def cmd_ledger_verify(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    anchor = _read_anchor(args.anchor) if args.anchor else None
    with open_ledger(settings.ledger_url) as ledger:
        report = ledger.verify(args.case, anchor=anchor)
    findings = [f.to_dict() for f in report.findings]
    payload = {"ok": report.ok, "cases": report.cases_checked, "events": report.events_checked,
               "mac_checked": report.mac_checked, "findings": findings}
    lines = [f"{f['case_id']} seq {f.get('seq')}: {f['kind']}: {f.get('detail', '')}"
             for f in findings]
    no_mac = "" if report.mac_checked else " (no HMAC key: whole-chain rewrites undetectable)"
    lines.append(("ok" if report.ok else "FAILED") + f": {report.cases_checked} case(s), "
                 f"{report.events_checked} event(s), {len(findings)} finding(s){no_mac}")
    emit(args, payload, "\n".join(lines))
    return 0 if report.ok else EXIT_REFUSED


def _read_anchor(path: str) -> Any:
    from executor.ledger import Anchor
    from registry.errors import AnchorMismatch

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise AnchorMismatch(f"cannot read the anchor file {path}: {exc.strerror}",
                             where=path) from None
    except ValueError as exc:
        raise AnchorMismatch(f"the anchor file {path} is not JSON ({exc})", where=path) from None
    if not isinstance(data, dict):
        raise AnchorMismatch(f"the anchor file {path} is not a JSON object", where=path)
    return Anchor.from_dict(data, where=path)


def cmd_ledger_anchor(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    with open_ledger(settings.ledger_url) as ledger:
        anchor = ledger.anchor()
        signed = ledger.signed
    payload = {**anchor.to_dict(), "file": args.out}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(anchor.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")
    text = (f"anchor {anchor.anchor_seq}: {anchor.cases} case(s), {anchor.events} event(s), "
            f"{anchor.digest}" + ("" if signed else " (no HMAC key: the anchor is not MAC'd)"))
    if args.out:
        text += f"\nwrote {args.out}: keep it where the ledger's writers cannot rewrite it; " \
                f"check with `capgate ledger verify --anchor {args.out}`"
    emit(args, payload, text)
    return 0


def cmd_ledger_migrate(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    with open_ledger(settings.ledger_url, migrating=True) as ledger:
        report = ledger.migrate()
    if report.before == report.after:
        text = f"the ledger is already at {report.after}; nothing to do"
    else:
        text = (f"migrated the ledger from {report.before or 'an empty store'} to "
                f"{report.after}; {report.cases_rewritten} case snapshot(s) re-derived")
    emit(args, report.to_dict(), text)
    return 0


def cmd_ledger_show(args: argparse.Namespace) -> int:
    from capgate import caseview

    settings = load_settings(args.config)
    with open_ledger(settings.ledger_url) as ledger:
        events = ledger.events(args.case)
        snapshot = ledger.snapshot(args.case)
        intents = ledger.intents(args.case)  # every intent, settled ones too (from the events)
        verified = ledger.verify(args.case).ok if args.html else None
    if not events:
        from registry.errors import UnknownCase

        raise UnknownCase(f"no case {args.case!r} in the ledger (`capgate cases` lists them)",
                          case=args.case)
    entries = caseview.timeline(events)
    if args.html:
        page = caseview.render_html(args.case, events, snapshot, verified=verified)
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(page)
    text = caseview.timeline_text(args.case, entries)
    if args.html:
        text += f"\nwrote {args.html}: the case as one HTML page (open it in a browser)"
    emit(args, {"case": args.case, "timeline": [x.to_dict() for x in entries],
                "events": [e.to_dict() for e in events], "snapshot": snapshot,
                "intents": intents,
                "html": args.html}, text)
    return 0


def cmd_cases(args: argparse.Namespace) -> int:
    from capgate import caseview

    settings = load_settings(args.config)
    with open_ledger(settings.ledger_url) as ledger:
        rows = caseview.case_rows(ledger, open_only=args.open)
    emit(args, [r.to_dict() for r in rows], caseview.cases_text(rows))
    return 0
