"""``capgate ledger verify | anchor | migrate | rekey | show | stats``, ``capgate cases``,
``capgate gaps``.

Each handler parses its arguments, calls :mod:`capgate.commands.ledger` with
the settings and prints the answer; a case's record is printed by
:mod:`capgate.caseview` (its timeline, or its HTML page with ``--html``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from capgate.commands import ledger
from capgate.config import load_settings
from capgate.handlers.console import emit
from capgate.registry.errors import EXIT_REFUSED, UsageError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    group = sub.add_parser("ledger", help="the hash-chained ledger")
    lsub = group.add_subparsers(dest="ledger_command", metavar="COMMAND", required=True)
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
    p = lsub.add_parser("rekey", parents=[common],
                        help="sign every case head and anchor with the ledger's HMAC key "
                             "(a key turned on, or rotated)",
                        description="Verifies every case and the anchors under the previous "
                                    "key (none: the ledger was written without one), then "
                                    "signs each head and anchor with CAPGATE_LEDGER_HMAC_KEY "
                                    "in one transaction, and records it in a case of its own. "
                                    "Any finding refuses it all. Stop the ledger's writers "
                                    "first; export a new anchor afterwards.")
    p.add_argument("--previous-key-env", metavar="VAR", default=None,
                   help="the environment variable holding the previous key (when rotating)")
    p.set_defaults(handler=cmd_ledger_rekey)
    p = lsub.add_parser("show", parents=[common],
                        help="a case's timeline: time, actor, event, one-line summary",
                        description="Every event of CASE in chain order, one line each; "
                                    "--json prints every field of every event, --html FILE "
                                    "writes the case as one self-contained HTML page.")
    p.add_argument("case")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write the case as a self-contained HTML page")
    p.set_defaults(handler=cmd_ledger_show)
    p = lsub.add_parser("stats", parents=[common],
                        help="recovery accounting: attempts, useful final actions, "
                             "re-execution overhead, validated actions retained",
                        description="Counted from the verified chain of each case: total "
                                    "attempts, useful final actions, re-execution overhead "
                                    "and validated actions retained at recovery, with the "
                                    "decision counts (retried, reconciled, escalated, "
                                    "withheld).  A case that does not verify is reported and "
                                    "counted nowhere.")
    p.add_argument("case", nargs="?", metavar="CASE")
    p.add_argument("--all", action="store_true", help="every case, and the totals")
    p.set_defaults(handler=cmd_ledger_stats)

    p = sub.add_parser("cases", parents=[common],
                       help="list cases with their state and last outcome")
    p.add_argument("--open", action="store_true", help="only cases with unresolved intents")
    p.set_defaults(handler=cmd_cases)

    p = sub.add_parser("gaps", parents=[common],
                       help="requests for operations no row declares (capability gaps)")
    p.set_defaults(handler=cmd_gaps)


def cmd_ledger_verify(args: argparse.Namespace) -> int:
    report = ledger.verify(load_settings(args.config), args.case, anchor=args.anchor)
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


def cmd_ledger_anchor(args: argparse.Namespace) -> int:
    done = ledger.anchor(load_settings(args.config), args.out)
    anchor = done.anchor
    text = (f"anchor {anchor.anchor_seq}: {anchor.cases} case(s), {anchor.events} event(s), "
            f"{anchor.digest}" + ("" if done.signed else " (no HMAC key: the anchor is not MAC'd)"))
    if args.out:
        text += f"\nwrote {args.out}: keep it where the ledger's writers cannot rewrite it; " \
                f"check with `capgate ledger verify --anchor {args.out}`"
    emit(args, {**anchor.to_dict(), "file": args.out}, text)
    return 0


def cmd_ledger_migrate(args: argparse.Namespace) -> int:
    report = ledger.migrate(load_settings(args.config))
    if report.before == report.after:
        text = f"the ledger is already at {report.after}; nothing to do"
    else:
        text = (f"migrated the ledger from {report.before or 'an empty store'} to "
                f"{report.after}; {report.cases_rewritten} case snapshot(s) re-derived")
    emit(args, report.to_dict(), text)
    return 0


def cmd_ledger_rekey(args: argparse.Namespace) -> int:
    report = ledger.rekey(load_settings(args.config), args.previous_key_env)
    emit(args, report.to_dict(),
         f"signed {report.cases} case head(s) and {report.anchors} anchor(s) with key "
         f"{report.key_id}; recorded in case {report.recorded_in}; export a new anchor "
         "(`capgate ledger anchor --out FILE`): exported ones carry the old MACs")
    return 0


def cmd_ledger_show(args: argparse.Namespace) -> int:
    from capgate import caseview

    record = ledger.case_record(load_settings(args.config), args.case, verify=bool(args.html))
    if args.html:
        page = caseview.render_html(args.case, record.events, record.snapshot,
                                    verified=record.verified, plans=record.pending_plans)
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(page)
    text = caseview.timeline_text(args.case, record.timeline)
    if args.html:
        text += f"\nwrote {args.html}: the case as one HTML page (open it in a browser)"
    emit(args, {"case": args.case, "timeline": [x.to_dict() for x in record.timeline],
                "events": [e.to_dict() for e in record.events], "snapshot": record.snapshot,
                "intents": record.intents, "pending_plans": record.pending_plans,
                "html": args.html}, text)
    return 0


_COLUMNS = (("ATTEMPTS", "total_attempts"), ("USEFUL", "useful_final_actions"),
            ("OVERHEAD", "re_execution_overhead"),
            ("RETAINED", "validated_actions_retained_at_recovery"))
_DECIDED = ("retried", "reconciled", "escalated", "withheld")


def _row(name: str, d: Mapping[str, Any]) -> str:
    decisions = d.get("decisions") or {}
    return (f"{name[:24]:<24} " + " ".join(f"{d[k]:>8}" for _, k in _COLUMNS) + " "
            + " ".join(f"{decisions.get(k, 0):>10}" for k in _DECIDED))


def cmd_ledger_stats(args: argparse.Namespace) -> int:
    if bool(args.case) == bool(args.all):
        raise UsageError("name one CASE, or --all for every case", field="case")
    found = ledger.stats(load_settings(args.config), None if args.all else [args.case])
    body = found.to_dict(intents=not args.all)
    head = (f"{'CASE':<24} " + " ".join(f"{h:>8}" for h, _ in _COLUMNS) + " "
            + " ".join(f"{h.upper():>10}" for h in _DECIDED))
    lines = [head] + [_row(c["case"], c) for c in body["cases"]]
    if args.all:
        lines.append(_row("total", body["total"]))
    for c in body["cases"] if not args.all else []:
        for r in c["recoveries"]:
            point = str(r["recovery_point"] or "none")[:8]
            lines.append(f"  recovery at seq {r['seq']}: retained {r['retained']}, recovery "
                         f"point {point}"
                         + (" (the latest recorded step)" if r.get("chosen_is_latest") else
                            f" (the latest recorded, {str(r['latest_recorded'])[:8]}, is not "
                            "eligible)" if r.get("latest_recorded") else ""))
        for i in c.get("intents") or []:
            lines.append(f"  {i['intent_id'][:8]} {i['operation_id']:<24} attempts "
                         f"{i['attempts']}  {i['final']:<11} {i['outcome']} ({i['status']})  "
                         f"overhead {i['re_execution_overhead']}")
    for u in body["unverified"]:
        lines.append(f"NOT COUNTED {u['case']}: {u['message']}")
    emit(args, body, "\n".join(lines))
    return 1 if body["unverified"] else 0


def cmd_cases(args: argparse.Namespace) -> int:
    from capgate import caseview

    rows = ledger.cases(load_settings(args.config), open_only=args.open)
    emit(args, [r.to_dict() for r in rows], caseview.cases_text(rows))
    return 0


def cmd_gaps(args: argparse.Namespace) -> int:
    gaps = ledger.gaps(load_settings(args.config))
    lines = [f"{len(gaps)} capability gap(s)"]
    for g in gaps:
        version = f"@{g['version']}" if g.get("version") is not None else ""
        lines.append(f"  {g['recorded_at'][:19]}  {g.get('operation_id')}{version}  "
                     f"by {g.get('requested_by')} in {g.get('case')} via {g.get('via')} "
                     f"({g.get('refusal')})")
    emit(args, gaps, "\n".join(lines))
    return 0
