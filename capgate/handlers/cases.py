"""``capgate case show | decide | close | release | renew | symptom | checkpoint | accept |
reopen``: a case's claims, coordination decisions, symptoms and holds (issue 17).

Each handler parses its arguments, calls :mod:`capgate.commands.cases` on an
executor opened from the configuration and prints the answer.  A person's
decision (``decide``, ``accept``, ``reopen``) is signed with their approver key
(``--key FILE`` or ``CAPGATE_APPROVER_KEY``), like an approval.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from capgate.api import open as open_executor
from capgate.commands import cases
from capgate.handlers.console import caller, emit, parse_operation, read_inputs
from capgate.registry.errors import EXIT_UNKNOWN

if TYPE_CHECKING:
    from capgate.executor.approvals import SigningKey


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    case = sub.add_parser("case", help="a case's claims, coordination decisions, symptoms "
                                       "and holds")
    csub = case.add_subparsers(dest="case_command", metavar="COMMAND", required=True)

    def person(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--by", required=True, help=f"the person who {what}")
        p.add_argument("--key", default=None, metavar="FILE",
                       help="their private key (default: env CAPGATE_APPROVER_KEY); its "
                            "public half must be their approval_key in the grants")

    p = csub.add_parser("show", parents=[common], help="what the case holds and waits for")
    p.add_argument("case")
    p.set_defaults(handler=cmd_show)

    p = csub.add_parser("decide", parents=[common],
                        help="a person's coordination decision for a case that asked for a "
                             "held target",
                        description="DECISION is the id a CG330 refusal named.  wait: the "
                                    "asking case waits; hand_over: the holder is done, the "
                                    "keys move to the asking case with a new fencing token; "
                                    "override: the asking case goes ahead (needs --reason). "
                                    "Recorded, signed, in both cases' ledgers.")
    p.add_argument("case", help="the case that asked")
    p.add_argument("decision_id", metavar="DECISION")
    p.add_argument("--decision", required=True, choices=("wait", "hand_over", "override"))
    p.add_argument("--reason", default="", help="why (required for override)")
    person(p, "decides")
    p.set_defaults(handler=cmd_decide)

    for name, what in (("close", "close the case: give back every claim, drop its budget "
                                 "slots"),
                       ("release", "give back some (--impact-key) or all of the case's "
                                   "claims")):
        p = csub.add_parser(name, parents=[common], help=what)
        p.add_argument("case")
        p.add_argument("--as", dest="who", default=None,
                       help="who does it: an identity that acted in the case (default: "
                            "CAPGATE_AGENT or config `agent`), or a person with --key")
        p.add_argument("--key", default=None, metavar="FILE",
                       help="a person's private key, to act on a case they did not work in")
        if name == "release":
            p.add_argument("--impact-key", action="append", dest="keys", default=None,
                           metavar="KEY", help="a key to give back (repeat; default: all)")
        p.set_defaults(handler=cmd_close if name == "close" else cmd_release)

    p = csub.add_parser("renew", parents=[common], help="extend the case's claims")
    p.add_argument("case")
    p.add_argument("--seconds", type=float, default=None,
                   help="how long from now (default: the largest case_claim_seconds of the "
                        "configured connectors)")
    p.set_defaults(handler=cmd_renew)

    p = csub.add_parser("symptom", parents=[common],
                        help="register the symptom the case starts from (the row's symptom "
                             "query), re-read before the fix and the send")
    p.add_argument("case")
    p.add_argument("operation", metavar="OPERATION[@VERSION]")
    p.add_argument("--input", default="{}", help="the symptom's inputs as a JSON object")
    p.add_argument("--as", dest="who", default=None, help="caller identity")
    p.set_defaults(handler=cmd_symptom)

    p = csub.add_parser("checkpoint", parents=[common],
                        help="re-read the case's symptoms at a declared checkpoint (the send)")
    p.add_argument("case")
    p.add_argument("--name", default="send", help="the checkpoint's name (default: send)")
    p.add_argument("--as", dest="who", default=None, help="caller identity")
    p.set_defaults(handler=cmd_checkpoint)

    for name, what in (("accept", "accept a changed symptom: the case continues from the "
                                  "target as it is now"),
                       ("reopen", "re-open the case from a changed symptom")):
        p = csub.add_parser(name, parents=[common], help=what)
        p.add_argument("case")
        p.add_argument("hold", metavar="HOLD")
        p.add_argument("--note", default="", help="why")
        person(p, "decides")
        p.set_defaults(handler=cmd_hold, decision="accepted" if name == "accept"
                       else "reopened")


def _key(args: argparse.Namespace) -> SigningKey:
    from capgate.executor.approvals import load_signing_key

    return load_signing_key(args.key)


def cmd_show(args: argparse.Namespace) -> int:
    with open_executor(args.config) as gate:
        shown = cases.show(gate, args.case)
    lines = [f"case {shown['case']}" + (" (closed)" if shown.get("closed") else "")]
    for c in shown["claims"]:
        lines.append(f"  holds {c['impact_key']} token {c['token']} "
                     f"({float(c['expires_in']):.0f} s left; last {c['operation_id']})")
    for d in shown["decisions"]:
        other = d.get("holder_case") if d.get("role") == "asker" else d.get("asker_case")
        lines.append(f"  decision {d['decision_id']} ({d.get('role')}, with {other}): "
                     f"{d.get('status')}" + (f" {d.get('decision')} by {d.get('decided_by')}"
                                             if d.get("decision") else "")
                     + f" -- {', '.join(d.get('keys') or [])}")
    for s in shown["symptoms"]:
        lines.append(f"  symptom {s['impact_key']} via {s['operation_id']}@{s['version']}: "
                     f"{s['digest']}")
    for h in shown["holds"]:
        lines.append(f"  HELD {h['hold']}: changed outside the case ({h.get('detected')}); "
                     f"`capgate case accept|reopen {args.case} {h['hold']} --by NAME`")
    if shown["open_intents"]:
        lines.append(f"  open intents: {', '.join(shown['open_intents'])}")
    emit(args, shown, "\n".join(lines))
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    key = _key(args)
    with open_executor(args.config) as gate:
        done = cases.decide(gate, args.case, args.decision_id, decision=args.decision,
                            by=args.by, key=key, reason=args.reason)
    tokens = ", ".join(f"{k} token {v}" for k, v in done["tokens"].items())
    emit(args, done, f"recorded in {done['case']} and {done['holder_case']}: "
                     f"{done['decision']} by {done['by']}" + (f" ({tokens})" if tokens else ""))
    return 0


def _release(args: argparse.Namespace, closing: bool) -> int:
    who = caller(args, "acts")
    key = _key(args) if args.key else None
    with open_executor(args.config) as gate:
        if closing:
            done = cases.close(gate, args.case, by=who, key=key)
        else:
            done = cases.release(gate, args.case, args.keys, by=who, key=key)
    text = (f"{'closed' if closing else 'released'} {args.case}: gave back "
            f"{len(done['released'])} claim(s)" + (f" {', '.join(done['released'])}"
                                                   if done["released"] else ""))
    if done["kept"]:
        text += f"; kept {', '.join(done['kept'])} (claimed again meanwhile)"
    emit(args, done, text)
    return 0


def cmd_close(args: argparse.Namespace) -> int:
    return _release(args, True)


def cmd_release(args: argparse.Namespace) -> int:
    return _release(args, False)


def cmd_renew(args: argparse.Namespace) -> int:
    with open_executor(args.config) as gate:
        done = cases.renew(gate, args.case, args.seconds)
    emit(args, done, f"renewed {len(done['renewed'])} claim(s) of {args.case} for "
                     f"{done['seconds']:g} s")
    return 0


def cmd_symptom(args: argparse.Namespace) -> int:
    op, version = parse_operation(args.operation)
    with open_executor(args.config) as gate:
        done = cases.symptom(gate, args.case, op, read_inputs(args.input),
                             who=caller(args, "registers the symptom"), version=version)
    emit(args, done, f"registered the symptom of {done['impact_key']} for case {args.case}: "
                     f"{done['digest']} ({len(done['reading']['rows'])} row(s))")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    with open_executor(args.config) as gate:
        done = cases.checkpoint(gate, args.case, name=args.name, who=caller(args, "checks"))
    if done["held"]:
        lines = [f"HELD {args.case} at checkpoint {args.name}: hold {done['hold']}"]
        for c in done["changed"]:
            actor = c.get("actor") or {}
            who = (actor.get("declared") or {}).get("who") or \
                (actor.get("capgate") or {}).get("case")
            lines.append(f"  {c['impact_key']}: {c.get('before')} -> {c.get('after')}"
                         + (f" by {who}" if who else "") + (f" ({c['error']})"
                                                            if c.get("error") else ""))
        emit(args, done, "\n".join(lines))
        return EXIT_UNKNOWN
    emit(args, done, f"ok: {args.case} at checkpoint {args.name}: "
                     f"{len(done['digests'])} symptom(s) as registered")
    return 0


def cmd_hold(args: argparse.Namespace) -> int:
    key = _key(args)
    with open_executor(args.config) as gate:
        done = cases.resolve_hold(gate, args.case, args.hold, decision=args.decision,
                                  by=args.by, key=key, note=args.note)
    emit(args, done, f"recorded: hold {args.hold} of {args.case} {args.decision} by "
                     f"{args.by}; the case may continue")
    return 0
