"""The whole loop on the packaged examples, told step by step (``capgate demo``).

The sandbox is a project made by :func:`capgate.commands.project.init_project` -- a SQLite
target with the example insurance schema, a SQLite ledger, a ``capgate.toml``
and a grants file with an agent and two approvers -- so the demo runs from any
folder of a plain ``pip install`` and needs no server.  It lives in a temporary
folder that is removed afterwards, or with ``--keep DIR`` in DIR, left there
for inspection (``cd DIR && capgate cases`` and so on).

The demo is a story told to a person, so :func:`run_demo` writes it to a
stream as it goes; :func:`crash_and_resume_demo`, its crash and resume, returns
its lines (``tests/test_resume.py`` runs it on a server database too).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from capgate.registry.errors import UsageError

CASE = "TICKET-4711"


Say = Callable[[str], None]


def _title(say: Say, title: str) -> None:
    say(f"\n== {title}")


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


def run_demo(keep: str | None = None, *, out: TextIO | None = None) -> Path:
    """Run the demo, telling it to ``out`` (default: standard output); the sandbox's folder.

    ``keep``: run in this new or empty folder and leave the sandbox there; else a
    temporary folder, removed afterwards.
    """
    from capgate.commands.project import init_project

    stream = out if out is not None else sys.stdout

    def say(line: str = "") -> None:
        print(line, file=stream)

    started = time.monotonic()
    folder, tmp = _sandbox(keep)
    try:
        report = init_project(folder)
        _title(say, f"capgate init: {report.rows} capability rows validated; a SQLite target "
               "with the example schema; capgate's tables installed")
        say(f"   sandbox: {folder}")
        _run(folder / "capgate.toml", say)
    finally:
        if tmp is not None:
            tmp.cleanup()
    say(f"\ndemo finished in {time.monotonic() - started:.1f}s")
    if keep:
        config = folder / "capgate.toml"
        say(f"\nthe sandbox is kept in {folder}:")
        say("  capgate.toml, grants.toml, capabilities/, insurance.db (target), "
            ".capgate/ledger.db (ledger)")
        say(f"  cd {folder}")
        say("  capgate cases")
        say(f"  capgate ledger show {CASE}")
        say(f"  capgate ledger show {CASE} --html {CASE}.html")
        say(f"  (configuration: {config})")
    return folder


def _run(config: Path, say: Say) -> None:
    from capgate.api import open as open_gate
    from capgate.executor.approvals import load_signing_key
    from capgate.registry.errors import ApprovalRequired, CapgateError

    agent = "claims-agent"
    with open_gate(config) as ex:
        _title(say, "1. a read (engine-enforced read-only transaction, row cap)")
        say("   capgate call policy.get --input '{\"policy_id\": 1}'")
        say(_brief(ex.call("policy.get", {"policy_id": 1}, case=CASE, who=agent)))

        note = {"policy_id": 1, "author": "claims-agent", "body": "Holder asked for a callback."}
        _title(say, "2. a collapsed write: statements, verify, replay, landing marker, COMMIT")
        say(_brief(ex.call("policy.add_note", note, case=CASE, who=agent)))
        say("   the same call again returns the recorded outcome and executes nothing:")
        say(_brief(ex.call("policy.add_note", note, case=CASE, who=agent)))

        _title(say, "3. a write whose verify fails: rolled back, with the evidence of why")
        say("   (policy 9 is void; the row's verify demands a non-void policy)")
        say(_brief(ex.call("policy.add_note", {**note, "policy_id": 9}, case=CASE,
                           who=agent)))

        _title(say, "4. a gated write (four eyes): refused until approved, then it runs")
        try:
            ex.call("policy.purge_orphan", {"policy_id": 9}, case=CASE, who=agent)
        except ApprovalRequired as refused:
            plan_hash = refused.details["plan_hash"]
            say(f"   refused: {refused.code} approval required for plan {plan_hash[:23]}...")
            for st in refused.details["plan"]["statements"]:
                say(f"      {' '.join(st['sql'].split())[:70]:<70} expect {st['expect_rows']}")
            bob_key = load_signing_key(config.parent / "keys" / "bob.key")
            try:
                ex.approve(plan_hash, by=agent, role="dba", key=bob_key)
            except CapgateError as exc:
                say(f"   the agent cannot approve: {exc.code} {_clip(exc.message, 80)}")
            try:
                ex.approve(plan_hash, by="alice", role="dba", key=bob_key)
            except CapgateError as exc:
                say(f"   nor can anyone approve in another's name: {exc.code} "
                    f"{_clip(exc.message, 70)}")
            approval = ex.approve(plan_hash, by="bob", role="dba", key=bob_key)
            say(f"   capgate approve {plan_hash[:23]}... --by bob --role dba --key keys/bob.key "
                f"(signed, single use, expires {approval['expires_at'][:19]})")
            say(_brief(ex.call("policy.purge_orphan", {"policy_id": 9}, case=CASE,
                               who=agent)))

        _title(say, "5. the case is done: `capgate case close` gives its targets back")
        from capgate.executor import cases

        closed = cases.close(ex, CASE, by=agent)
        say(f"   capgate case close {CASE}: gave back {len(closed['released'])} claim(s): "
            f"{', '.join(closed['released'])}")
        say("   (until then another case touching them gets a coordination decision, CG330)")

        _title(say, "6. a crash: a `capgate call` process is killed (SIGKILL) after "
               "attempt_started")
        for line in crash_and_resume_demo(config, who=agent):
            say(f"   {line}")

        _title(say, "7. capgate ledger verify")
        report = ex.ledger.verify()
        say(f"   {'ok' if report.ok else 'FAILED'}: {report.cases_checked} case(s), "
            f"{report.events_checked} hash-chained event(s), {len(report.findings)} "
            "finding(s)")
        for event in ex.ledger.events(CASE)[:6]:
            say(f"   {event.seq:>3} {event.kind:<16} {event.digest[:23]}... "
                f"<- {event.prev_digest[:16]}...")


# --- the crash and resume ----------------------------------------------------------


DEMO_FIRST = {"policy_id": 1, "author": "agent", "body": "Crash demo: asked for a new schedule."}
DEMO_NEXT = {"policy_id": 2, "author": "agent", "body": "Crash demo: the case continues."}


def crash_and_resume_demo(config: str | Path | None = None, *,
                          env: Mapping[str, str] | None = None, case: str | None = None,
                          who: str = "agent", operation: str = "policy.add_note",
                          inputs: Mapping[str, Any] | None = None,
                          next_operation: str = "policy.add_note",
                          next_inputs: Mapping[str, Any] | None = None,
                          crash_at: str = "after_attempt_started") -> list[str]:
    """Kill a real ``capgate call`` with SIGKILL mid-call, then show resume settling it.

    1. a child process (``python -m capgate call ...``) runs a collapsed call
       with ``CAPGATE_CRASH_AT=crash_at`` and kills itself with SIGKILL there;
    2. the next call in ``case`` is refused (``ReconciliationRequired``, CG400);
    3. ``resume`` classifies the intent from the target's evidence and acts;
    4. the next call runs, and the ledger verifies.

    ``config`` / ``env`` are what ``capgate`` itself would read (``env`` is laid
    over ``os.environ`` for the child and for this process's executor); the
    configuration must grant ``who`` writes on the row's connector.  ``case``
    defaults to a fresh ``DEMO-CRASH-xxxxxx``, so the demo can run again on the
    same ledger.  Returns the lines to print.
    """
    from capgate import caseview
    from capgate.api import build_executor
    from capgate.config import load_settings
    from capgate.executor.recovery.resume import resume
    from capgate.registry.errors import CapgateError

    environ = {**os.environ, **(env or {})}
    case = case or f"DEMO-CRASH-{uuid.uuid4().hex[:6]}"
    first = dict(inputs if inputs is not None else DEMO_FIRST)
    later = dict(next_inputs if next_inputs is not None else DEMO_NEXT)
    argv = [sys.executable, "-m", "capgate", "call", operation, "--input", json.dumps(first),
            "--case", case, "--as", who]
    if config is not None:
        argv += ["--config", str(config)]
    lines = [f"$ CAPGATE_CRASH_AT={crash_at} capgate call {operation} --case {case} ..."]
    child = subprocess.run(argv, env={**environ, "CAPGATE_CRASH_AT": crash_at},
                           capture_output=True, text=True, timeout=120, check=False)
    if child.returncode == -signal.SIGKILL:
        lines.append(f"  the call process was killed with SIGKILL at {crash_at} "
                     f"(pid gone, exit {child.returncode})")
    else:
        lines.append(f"  the call process exited {child.returncode} (expected a SIGKILL): "
                     f"{(child.stderr or child.stdout).strip()[:300]}")
    with build_executor(load_settings(config, environ)) as executor:
        events = executor.ledger.events(case)
        lines.append("  ledger: " + ", ".join(e.kind for e in events[-4:]))
        lines.append(f"$ capgate call {next_operation} --case {case} ...")
        try:
            executor.call(next_operation, later, case=case, who=who)
            lines.append("  UNEXPECTED: the call ran although the case has an unresolved intent")
        except CapgateError as exc:
            lines.append(f"  refused: {exc}")
        lines.append(f"$ capgate resume {case}")
        report = resume(executor, case)
        lines.extend("  " + line for line in caseview.resume_lines(report.to_dict()))
        lines.append(f"$ capgate call {next_operation} --case {case} ...")
        outcome = executor.call(next_operation, later, case=case, who=who)
        lines.append(f"  {outcome.status}: {outcome.operation_id}@{outcome.version} "
                     f"intent {outcome.intent_id}")
        from capgate.executor import cases

        closed = cases.close(executor, case, by=who)
        lines.append(f"$ capgate case close {case}")
        lines.append(f"  gave back {len(closed['released'])} claim(s)")
        verified = executor.ledger.verify(case)
        lines.append(f"$ capgate ledger verify --case {case}")
        lines.append(f"  {'ok' if verified.ok else 'FAILED'}: {verified.events_checked} "
                     f"event(s), {len(verified.findings)} finding(s)")
    return lines
