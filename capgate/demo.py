"""``capgate demo``: the whole loop on the packaged examples, printed step by step.

The sandbox is a project made by :func:`capgate.init.init_project` -- a SQLite
target with the example insurance schema, a SQLite ledger, a ``capgate.toml``
and a grants file with an agent and two approvers -- so the demo runs from any
folder of a plain ``pip install`` and needs no server.  It lives in a temporary
folder that is removed afterwards, or with ``--keep DIR`` in DIR, left there
for inspection (``cd DIR && capgate cases`` and so on).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from capgate.cli import emit
from registry.errors import UsageError

CASE = "TICKET-4711"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common],
                       help="run the demo on the packaged examples (SQLite, no server)",
                       description="A read, a collapsed write, an idempotent repeat, a "
                                   "rolled-back write, a four-eyes gate, a SIGKILL and "
                                   "resume, and ledger verify -- in a temporary folder, "
                                   "or in DIR with --keep.")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="run in DIR (new or empty) and leave the sandbox there: target, "
                        "ledger, capgate.toml")
    p.set_defaults(handler=cmd_demo)


def _say(title: str) -> None:
    print(f"\n== {title}")


def _brief(outcome: Any) -> str:
    lines = [f"   -> {outcome.status}  intent {outcome.intent_id[:12]}"
             f"{'  (recorded outcome replayed)' if outcome.replayed else ''}"]
    ev = outcome.evidence
    if "counts" in ev:
        lines.append(f"      counts {json.dumps(ev['counts'])}")
    for check in ev.get("verify", []):
        lines.append(f"      verify {check['name']}: expected {json.dumps(check['expected'])}, "
                     f"got {json.dumps(check['actual'])}")
    if "rows" in ev:
        lines.append(f"      rows {_clip(json.dumps(ev['rows']), 150)}")
    if "replay" in ev:
        lines.append(f"      replay {_clip(json.dumps(ev['replay']['rows']), 150)}")
    if outcome.reason:
        lines.append(f"      reason {_clip(json.dumps(outcome.reason, default=str), 300)}")
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    """At most ``width`` characters, cut at a space or comma, never mid-word."""
    if len(text) <= width:
        return text
    cut = max(text.rfind(" ", 0, width), text.rfind(",", 0, width))
    return text[:cut if cut > width // 2 else width].rstrip(", ") + " …"


def _sandbox(keep: str | None) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    if keep is None:
        tmp = tempfile.TemporaryDirectory(prefix="capgate-demo-")
        return Path(tmp.name), tmp
    folder = Path(keep).expanduser().resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UsageError(f"--keep {folder}: give a new or empty folder (this one is not "
                         "empty; nothing was changed)", folder=str(folder))
    return folder, None


def cmd_demo(args: argparse.Namespace) -> int:
    """The narration goes to stdout; with ``--json`` to stderr, and stdout has one object."""
    import contextlib
    import sys

    if args.json:
        with contextlib.redirect_stdout(sys.stderr):
            folder = _demo(args)
        emit(args, {"ok": True, "case": CASE, "kept": str(folder) if args.keep else None})
        return 0
    _demo(args)
    return 0


def _demo(args: argparse.Namespace) -> Path:
    from capgate.init import init_project

    started = time.monotonic()
    folder, tmp = _sandbox(args.keep)
    try:
        report = init_project(folder)
        _say(f"capgate init: {report.rows} capability rows validated; a SQLite target with "
             "the example schema; capgate's tables installed")
        print(f"   sandbox: {folder}")
        _run(folder / "capgate.toml")
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"\ndemo finished in {time.monotonic() - started:.1f}s")
    if args.keep:
        config = folder / "capgate.toml"
        print(f"\nthe sandbox is kept in {folder}:")
        print("  capgate.toml, grants.toml, capabilities/, insurance.db (target), "
              ".capgate/ledger.db (ledger)")
        print(f"  cd {folder}")
        print("  capgate cases")
        print(f"  capgate ledger show {CASE}")
        print(f"  capgate ledger show {CASE} --html {CASE}.html")
        print(f"  (configuration: {config})")
    return folder


def _run(config: Path) -> None:
    from capgate.api import open as open_gate
    from executor.approvals import load_signing_key
    from registry.errors import ApprovalRequired, CapgateError

    agent = "claims-agent"
    with open_gate(config) as ex:
        _say("1. a read (engine-enforced read-only transaction, row cap)")
        print("   capgate call policy.get --input '{\"policy_id\": 1}'")
        print(_brief(ex.call("policy.get", {"policy_id": 1}, case=CASE, who=agent)))

        note = {"policy_id": 1, "author": "claims-agent", "body": "Holder asked for a callback."}
        _say("2. a collapsed write: statements, verify, replay, landing marker, COMMIT")
        print(_brief(ex.call("policy.add_note", note, case=CASE, who=agent)))
        print("   the same call again returns the recorded outcome and executes nothing:")
        print(_brief(ex.call("policy.add_note", note, case=CASE, who=agent)))

        _say("3. a write whose verify fails: rolled back, with the evidence of why")
        print("   (policy 9 is void; the row's verify demands a non-void policy)")
        print(_brief(ex.call("policy.add_note", {**note, "policy_id": 9}, case=CASE,
                             who=agent)))

        _say("4. a gated write (four eyes): refused until approved, then it runs")
        try:
            ex.call("policy.purge_orphan", {"policy_id": 9}, case=CASE, who=agent)
        except ApprovalRequired as refused:
            plan_hash = refused.details["plan_hash"]
            print(f"   refused: {refused.code} approval required for plan {plan_hash[:23]}...")
            for st in refused.details["plan"]["statements"]:
                print(f"      {' '.join(st['sql'].split())[:70]:<70} expect {st['expect_rows']}")
            bob_key = load_signing_key(config.parent / "keys" / "bob.key")
            try:
                ex.approve(plan_hash, by=agent, role="dba", key=bob_key)
            except CapgateError as exc:
                print(f"   the agent cannot approve: {exc.code} {_clip(exc.message, 80)}")
            try:
                ex.approve(plan_hash, by="alice", role="dba", key=bob_key)
            except CapgateError as exc:
                print(f"   nor can anyone approve in another's name: {exc.code} "
                      f"{_clip(exc.message, 70)}")
            approval = ex.approve(plan_hash, by="bob", role="dba", key=bob_key)
            print(f"   capgate approve {plan_hash[:23]}... --by bob --role dba --key keys/bob.key "
                  f"(signed, single use, expires {approval['expires_at'][:19]})")
            print(_brief(ex.call("policy.purge_orphan", {"policy_id": 9}, case=CASE,
                                 who=agent)))

        _say("5. the case is done: `capgate case close` gives its targets back")
        from executor import cases

        closed = cases.close(ex, CASE, by=agent)
        print(f"   capgate case close {CASE}: gave back {len(closed['released'])} claim(s): "
              f"{', '.join(closed['released'])}")
        print("   (until then another case touching them gets a coordination decision, CG330)")

        _say("6. a crash: a `capgate call` process is killed (SIGKILL) after attempt_started")
        from capgate.commands_resume import crash_and_resume_demo

        for line in crash_and_resume_demo(config, who=agent):
            print(f"   {line}")

        _say("7. capgate ledger verify")
        report = ex.ledger.verify()
        print(f"   {'ok' if report.ok else 'FAILED'}: {report.cases_checked} case(s), "
              f"{report.events_checked} hash-chained event(s), {len(report.findings)} "
              "finding(s)")
        for event in ex.ledger.events(CASE)[:6]:
            print(f"   {event.seq:>3} {event.kind:<16} {event.digest[:23]}... "
                  f"<- {event.prev_digest[:16]}...")
