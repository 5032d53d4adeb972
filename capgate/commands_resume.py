"""``capgate resume``: settle a case's in-flight intents from evidence; and the crash demo.

The logic lives in :mod:`executor.recovery.resume`; this module parses, prints and maps
the report to an exit code: 0 when every intent is resolved, 3 when anything
is escalated, unknown, held or changed outside the case.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capgate.cli import emit
from registry.errors import UsageError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "resume", parents=[common],
        help="after a fault: classify each in-flight intent from evidence, then continue",
        description="Classify every in-flight intent of CASE as applied, not_applied, "
                    "partly_applied or unknown from the target's evidence (landing marker, "
                    "commit outcome, session liveness, landed probe); record applied ones, "
                    "retry not_applied ones per the row's recovery with the same idempotency "
                    "key, escalate the rest.  Exit 0 when all are resolved, 3 otherwise.")
    p.add_argument("case", nargs="?", metavar="CASE", help="the case to resume")
    p.add_argument("--all", action="store_true", help="resume every open case")
    p.add_argument("--task", default=None, help="the task the case was opened for (refused "
                                                "when the case belongs to another task)")
    p.add_argument("--dry-run", action="store_true",
                   help="classify and re-check only; record and retry nothing")
    p.add_argument("--no-terminate", action="store_true",
                   help="never terminate a recorded session that may still commit; only wait")
    p.add_argument("--wait", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for such a session to end (default 5)")
    p.add_argument("--resolve", metavar="INTENT", default=None,
                   help="record a person's decision on an escalated intent instead")
    p.add_argument("--decision", choices=("applied", "not_applied", "accepted"), default=None)
    p.add_argument("--by", default=None, help="who decides (with --resolve)")
    p.add_argument("--note", default="", help="why (with --resolve)")
    p.set_defaults(handler=cmd_resume)


def cmd_resume(args: argparse.Namespace) -> int:
    from capgate.api import build_executor
    from capgate.config import load_settings
    from executor.recovery.resume import resolve_escalation, resume, resume_many

    if bool(args.case) == bool(args.all):
        raise UsageError("name one CASE, or --all for every open case")
    executor = build_executor(load_settings(args.config))
    try:
        if args.resolve:
            if not args.case or not args.decision or not args.by:
                raise UsageError("--resolve INTENT needs CASE, --decision and --by")
            done = resolve_escalation(executor, args.case, args.resolve, by=args.by,
                                      decision=args.decision, note=args.note)
            emit(args, done, f"recorded: intent {args.resolve} {args.decision} by {args.by}")
            return 0
        options: dict[str, Any] = {"task": args.task, "terminate": not args.no_terminate,
                                   "wait_seconds": args.wait, "act": not args.dry_run}
        if args.all:
            report = resume_many(executor, None, **options)
        else:
            report = resume(executor, args.case, **options)
        body = report.to_dict()
        emit(args, body, "\n".join(resume_lines(body)))
        return report.exit_code
    finally:
        executor.connectors.dispose()
        executor.ledger.close()


# --- printing ------------------------------------------------------------------------


def _text(value: Any) -> str:
    """A value for a person: strings as they are, everything else as JSON -- never a repr."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)


#: evidence keys in the order they weigh (strongest first), with how to say each
_EVIDENCE_ORDER = ("marker", "marker_row", "commit_outcome", "commit_outcome_detail",
                   "server_identity", "server_now", "terminated_session", "session",
                   "write_lock", "probe", "unreachable")


def evidence_line(evidence: Mapping[str, Any]) -> str:
    """The evidence that decided, strongest first, on one line of ``key: value`` parts."""
    parts: list[str] = []
    marker = evidence.get("marker")
    if marker == "present":
        row = evidence.get("marker_row") or {}
        parts.append(f"marker present (attempt {_text(row.get('attempt'))}, landed "
                     f"{_text(row.get('landed_at'))})")
    elif marker is not None:
        parts.append(f"marker {_text(marker)}")
    detail = evidence.get("commit_outcome_detail")
    if isinstance(detail, Mapping) and detail.get("probe"):
        xid = f"({_text(detail['xid'])})" if detail.get("xid") else ""
        parts.append(f"{_text(detail['probe'])}{xid} = "
                     f"{_text(evidence.get('commit_outcome') or 'no answer')}")
    elif evidence.get("commit_outcome"):
        parts.append(f"commit outcome {_text(evidence['commit_outcome'])}")
    identity = evidence.get("server_identity")
    server = evidence.get("server_now")
    if identity in ("same", "changed"):
        said = "same server" if identity == "same" else "server CHANGED"
        parts.append(said + (f" {_text(server)}" if isinstance(server, Mapping) else ""))
    for key in ("terminated_session", "session", "write_lock", "probe", "unreachable"):
        if evidence.get(key) not in (None, "", {}, []):
            parts.append(f"{key.replace('_', ' ')}: {_text(evidence[key])}")
    for key, value in evidence.items():  # what a newer executor adds is shown too
        if key not in _EVIDENCE_ORDER and key not in ("rule", "finished", "attempt") \
                and value not in (None, "", {}, []):
            parts.append(f"{key.replace('_', ' ')}: {_text(value)}")
    return "; ".join(parts)


def resume_lines(report: Mapping[str, Any]) -> list[str]:
    """``capgate resume``'s report for a person, from its JSON form (one intent a paragraph)."""
    case = report.get("case")
    intents = list(report.get("intents") or [])
    several = not isinstance(case, str)
    where = case if isinstance(case, str) else f"{len(case or [])} cases"
    out = [f"resume {where}: {len(intents)} in-flight intent(s)"
           + (" (dry run: nothing recorded or retried)" if report.get("dry_run") else "")]
    for i in intents:
        op = f"{i.get('operation_id')}@{i.get('version')}" if i.get("operation_id") else "?"
        in_case = f" case {i.get('case')}," if several else ""
        out.append(f"  intent {i.get('intent_id')}{in_case} {op}, attempt {i.get('attempt')}, "
                   f"found {i.get('status_found')}")
        evidence = i.get("evidence") or {}
        out.append(f"    {i.get('classification')}: {_text(evidence.get('rule', ''))}")
        brief = evidence_line(evidence)
        if brief:
            out.append(f"    evidence: {brief}")
        out.append(f"    action: {i.get('action')}"
                   + (f" -> {i.get('outcome')}" if i.get("outcome") else "")
                   + (f" ({_text(i.get('detail'))})" if i.get("detail") else ""))
    for c in report.get("changed_outside_case") or []:
        failed = [ch.get("name") for ch in c.get("checks", []) if not ch.get("ok")]
        out.append(f"  CHANGED OUTSIDE THE CASE: intent {c.get('intent_id')} "
                   f"{c.get('operation_id')}@{c.get('version')} ({_text(c.get('impact_key'))}): "
                   + (f"check(s) {', '.join(map(str, failed))} no longer hold" if failed
                      else f"cannot re-check: {_text(c.get('error'))}"))
    for case_id, rec in (report.get("recovery") or {}).items():
        point = rec.get("recovery_point") or {}
        chosen = point.get("chosen") or {}
        latest = point.get("latest_recorded") or {}
        cont = rec.get("continuation") or {}
        head = f"  {case_id}: " if several else "  "
        out.append(f"{head}recovery point: "
                   + (f"{chosen.get('operation_id')} intent {chosen.get('step')}" if chosen
                      else "none (no eligible step)")
                   + ("" if point.get("chosen_is_latest") or not latest else
                      f" (latest recorded {latest.get('operation_id')} intent "
                      f"{latest.get('step')} is not eligible: {_text(latest.get('why'))})")
                   + f"; continuation {cont.get('decision')}")
    if report.get("resolved"):
        out.append(f"ok: every intent resolved; {where} may continue")
    else:
        open_ = [i for i in intents if not i.get("resolved")]
        changed = report.get("changed_outside_case") or []
        out.append(f"NOT RESOLVED: {len(open_)} intent(s) open"
                   + (f", {len(changed)} target(s) changed outside the case" if changed else "")
                   + "; the case may not continue (see `capgate ledger show`)")
    return out


# --- the demo's crash ---------------------------------------------------------------


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
    from capgate.api import build_executor
    from capgate.config import load_settings
    from executor.recovery.resume import resume
    from registry.errors import CapgateError

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
    executor = build_executor(load_settings(config, environ))
    try:
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
        lines.extend("  " + line for line in resume_lines(report.to_dict()))
        lines.append(f"$ capgate call {next_operation} --case {case} ...")
        outcome = executor.call(next_operation, later, case=case, who=who)
        lines.append(f"  {outcome.status}: {outcome.operation_id}@{outcome.version} "
                     f"intent {outcome.intent_id}")
        from executor import cases

        closed = cases.close(executor, case, by=who)
        lines.append(f"$ capgate case close {case}")
        lines.append(f"  gave back {len(closed['released'])} claim(s)")
        verified = executor.ledger.verify(case)
        lines.append(f"$ capgate ledger verify --case {case}")
        lines.append(f"  {'ok' if verified.ok else 'FAILED'}: {verified.events_checked} "
                     f"event(s), {len(verified.findings)} finding(s)")
    finally:
        executor.connectors.dispose()
        executor.ledger.close()
    return lines
