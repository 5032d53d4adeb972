"""``capgate ddl capture | plan | apply | simulate | verify | compensate | recover | snapshots |
export | prohibitions``: the DDL loop for stored code.

Each handler parses its arguments, calls the DDL service
(:mod:`capgate.commands.ddl`) on an executor opened from the configuration and
prints the answer.  Sweeps over many objects draw a progress bar on stderr
when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from capgate.api import open as open_executor
from capgate.commands import ddl as ddl_commands
from capgate.ddl.catalog import ObjectRef
from capgate.ddl.plan import DdlPlan
from capgate.ddl.results import SmokeCall, VerifyReport
from capgate.ddl.service import DdlService
from capgate.ddl.snapshots import Snapshot
from capgate.handlers.console import caller, emit, parse_operation
from capgate.registry.errors import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNKNOWN,
    MergeRequired,
    StaleExtract,
    UsageError,
)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    ddl = sub.add_parser(
        "ddl", help="the DDL loop for stored code: capture, plan, apply, verify, compensate",
        description="Stored code (packages, procedures, functions, views, triggers) changed "
                    "through ddl rows: snapshot, preflight, apply, verify, compensate. "
                    "OBJECT is kind:[schema.]name[(args)], e.g. function:premium_due_total "
                    "or package_body:billing.")
    dsub = ddl.add_subparsers(dest="ddl_command", metavar="COMMAND", required=True)

    p = dsub.add_parser("capture", parents=[common],
                        help="snapshot objects (immutable, content addressed)")
    p.add_argument("objects", nargs="+", metavar="OBJECT")
    p.add_argument("--connector", required=True, help="the configured connector")
    p.set_defaults(handler=cmd_capture)

    p = dsub.add_parser("plan", parents=[common],
                        help="plan new sources for a ddl row; commits no DDL")
    p.add_argument("files", nargs="+", metavar="FILE", help="a CREATE OR REPLACE per file")
    p.add_argument("--operation", required=True, metavar="OPERATION[@VERSION]",
                   help="the ddl row whose objects the sources change")
    p.add_argument("--case", required=True, help="the case this change belongs to")
    p.add_argument("--as", dest="who", default=None,
                   help="requester identity (default: CAPGATE_AGENT or config `agent`)")
    p.add_argument("--base", action="append", default=[], metavar="SNAPSHOT_ID",
                   help="the snapshot a source was written against (default: the object's "
                        "latest snapshot; captured now when it has none)")
    p.add_argument("--fresh", action="store_true",
                   help="capture every object now and plan against that")
    p.add_argument("--smoke", action="append", default=[], metavar="JSON",
                   help='a smoke call: {"name": ..., "sql": ..., "expect": ..., "binds": {}, '
                        '"session": {}}')
    p.add_argument("--recompile", action="append", default=[], metavar="OBJECT",
                   help="an extra object to recompile (never a whole schema)")
    p.set_defaults(handler=cmd_plan)

    p = dsub.add_parser("apply", parents=[common],
                        help="apply an approved plan: preflight, apply, verify, undo on failure")
    p.add_argument("plan_hash", metavar="PLAN_HASH")
    p.add_argument("--case", required=True)
    p.add_argument("--as", dest="who", default=None)
    p.set_defaults(handler=cmd_apply)

    p = dsub.add_parser("simulate", parents=[common],
                        help="on a lower venue: apply an approved plan, verify, compensate -- "
                             "the evidence a promotion of the same source needs")
    p.add_argument("plan_hash", metavar="PLAN_HASH")
    p.add_argument("--case", required=True)
    p.add_argument("--as", dest="who", default=None)
    p.set_defaults(handler=cmd_simulate)

    p = dsub.add_parser("verify", parents=[common],
                        help="compile status and dependent sweep of an object (or a plan)")
    p.add_argument("object", nargs="?", metavar="OBJECT")
    p.add_argument("--connector", default=None)
    p.add_argument("--plan", dest="plan_hash", default=None, metavar="PLAN_HASH",
                   help="verify the live state against a recorded plan instead")
    p.set_defaults(handler=cmd_verify)

    p = dsub.add_parser("compensate", parents=[common],
                        help="restore an applied intent's objects from their snapshots")
    p.add_argument("intent", metavar="INTENT")
    p.add_argument("--case", required=True)
    p.add_argument("--as", dest="who", default=None)
    p.set_defaults(handler=cmd_compensate)

    p = dsub.add_parser("recover", parents=[common],
                        help="after a crash: classify an open DDL intent and record it")
    p.add_argument("intent", metavar="INTENT")
    p.add_argument("--case", required=True)
    p.add_argument("--as", dest="who", default=None)
    p.add_argument("--dry-run", action="store_true", help="classify only; record nothing")
    p.set_defaults(handler=cmd_recover)

    p = dsub.add_parser("snapshots", parents=[common], help="an object's stored snapshots")
    p.add_argument("object", metavar="OBJECT")
    p.add_argument("--connector", required=True)
    p.set_defaults(handler=cmd_snapshots)

    p = dsub.add_parser("export", parents=[common],
                        help="write every snapshot as a file (for a git mirror)")
    p.add_argument("directory", metavar="DIR")
    p.set_defaults(handler=cmd_export)

    p = dsub.add_parser("prohibitions", parents=[common],
                        help="the six standing prohibitions and their codes")
    p.set_defaults(handler=cmd_prohibitions)


# --- progress -------------------------------------------------------------------------------------


class ProgressBar:
    """``progress(done, total, label)`` drawn on a terminal; silent when not a TTY."""

    def __init__(self, stream: TextIO | None = None, *, width: int = 28,
                 interval: float = 0.08) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.interval = interval
        self._last = 0.0
        self._shown = 0
        self.drawn = 0

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled or total <= 1:
            return
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        filled = self.width * done // total
        text = f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {label[:48]}"
        self.stream.write(text.ljust(self._shown))
        self._shown = len(text)
        self.drawn += 1
        if done >= total:
            self.stream.write("\n")
            self._shown = 0
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = 0


@contextmanager
def _service(args: argparse.Namespace) -> Iterator[DdlService]:
    bar = ProgressBar()
    with open_executor(args.config) as gate:
        try:
            yield ddl_commands.service(gate, progress=bar)
        finally:
            bar.close()


# --- handlers ------------------------------------------------------------------------------------


def _snapshot_line(s: Snapshot) -> str:
    state = f"{s.signature.lines} lines" if s.exists else "absent"
    return f"  {s.id}  {s.signature}  {state}  {s.captured_at}"


def cmd_capture(args: argparse.Namespace) -> int:
    with _service(args) as svc:
        snaps = svc.capture(args.connector, args.objects)
    lines = []
    for s in snaps:
        lines.append(f"captured {s.object.key}")
        lines.append(_snapshot_line(s))
    emit(args, [s.to_dict(with_source=False) for s in snaps], "\n".join(lines))
    return EXIT_OK


def _smoke(raw: list[str]) -> list[SmokeCall]:
    out = []
    for i, text in enumerate(raw):
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            out.append(SmokeCall(str(d.get("name") or f"smoke{i + 1}"), str(d["sql"]),
                                 d.get("expect"), dict(d.get("binds") or {}),
                                 {str(k): str(v) for k, v in (d.get("session") or {}).items()}))
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--smoke {text!r}: {exc} (expected "
                             '{"name": ..., "sql": ..., "expect": ...})') from None
    return out


def _read_sources(files: list[str]) -> list[str]:
    out = []
    for name in files:
        try:
            out.append(Path(name).read_text(encoding="utf-8"))
        except OSError as exc:
            raise UsageError(f"cannot read {name}: {exc.strerror}") from None
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    op, version = parse_operation(args.operation)
    sources = _read_sources(args.files)
    smoke = _smoke(args.smoke)
    with _service(args) as svc:
        try:
            plan = svc.plan(op, sources, case=args.case, who=caller(args, "is acting"),
                            version=version, bases=args.base, fresh=args.fresh, smoke=smoke,
                            recompile=args.recompile)
        except StaleExtract as exc:
            _print_merge(args, exc.details.get("merge") or [])
            raise
    emit(args, plan.to_dict(), _plan_text(plan))
    return EXIT_OK


def _plan_text(plan: DdlPlan) -> str:
    """The plan as an approver reads it: each source's diff against its base, the named
    dependents (with their status and how it was checked) and callers, the checker's
    findings on the new source, the prohibitions."""
    h = plan.plan_hash
    bound = plan.bound
    lines = [f"plan {h}",
             f"  {bound['operation_id']}@{bound['version']} on {bound['connector']} "
             f"({bound['environment']}), {plan.dialect}"
             f"{', transactional DDL' if plan.transactional_ddl else ', DDL commits'}"]
    lines += _stage_lines(bound.get("stage"))
    for o in plan.objects:
        changed = o.get("changed_blocks") or []
        # the block numbers and their lines, never a bare "0" that reads as "none changed"
        blocks = (f"{len(changed)} changed: " + ", ".join(
            f"#{b['block']} lines {b['lines'][0]}-{b['lines'][1]}" for b in changed[:8])
            + (", ..." if len(changed) > 8 else "")) if changed else "none changed"
        lines.append(f"  {o['change']:<7} {o['key']}")
        lines.append(f"          base {o['base_snapshot_id']}")
        lines.append(f"          {o['base_signature']} -> "
                     f"{o.get('expected_signature') or o['new_signature']}"
                     f"  (blocks: {blocks})")
        diff = o.get("diff") or []
        if diff:
            lines.append("          source diff against the base:")
            lines += [f"            {d}" for d in diff[:200]]
            if len(diff) > 200:
                lines.append(f"            ... {len(diff) - 200} more diff line(s) in --json")
        else:
            lines.append("          source diff against the base: none (same text)")
    deps = plan.dependents
    lines.append(f"  dependents: {len(deps)}")
    for d in deps[:50]:
        st = d.get("status_before") or {}
        how = f", {st['checked']}" if st.get("checked") else ""
        via = f"via {d['via']}" + (f", uses {d['on']}" if int(d.get("depth", 1)) > 1 else "")
        lines.append(f"    {d['key']}  {via}  ({st.get('state', '-')}{how})")
    if len(deps) > 50:
        lines.append(f"    ... and {len(deps) - 50} more (all of them in --json)")
    for s in plan.caller_search or ():
        hits = s.get("hits") or []
        objs = sorted({h["object"] for h in hits})
        lines.append(f"  callers of {s['object']}: {len(hits)} line(s) in "
                     f"{len(objs)} object(s), {s['searched']} searched ({s['method']})")
        for obj in objs[:50]:
            first = next(h for h in hits if h["object"] == obj)
            lines.append(f"    {obj}  line {first['line']}: {first['text'][:80]}")
        if len(objs) > 50:
            lines.append(f"    ... and {len(objs) - 50} more")
    if plan.recompile_objects:
        keys = [ObjectRef.from_dict(r).key for r in plan.recompile_objects]
        lines.append(f"  also recompiled and checked: {', '.join(keys)}")
    if plan.smoke:
        lines.append(f"  smoke calls: {len(plan.smoke)} (run after the apply, each contained: "
                     "read-only, rolled back)")
        for sm in plan.smoke:
            extra = "".join(f"  {k} {json.dumps(sm[k], sort_keys=True)}"
                            for k in ("binds", "session") if sm.get(k))
            expect = "" if sm.get("expect") is None else f"  expect {sm['expect']!r}"
            lines.append(f"    {sm['name']}: {' '.join(str(sm['sql']).split())}{extra}{expect}")
    for st in plan.far_side_steps:
        first = f"  (recompile {st['dependent']} first)" if st.get("recompile") else ""
        lines.append(f"  far-side step {st['name']} over link {st['link']}: "
                     f"{' '.join(str(st['assertion']).split())}  expect {st.get('expect')!r}"
                     f"{first}")
    unverified = plan.unverified or ()
    if unverified:
        lines.append(f"  unverified: {len(unverified)} (nothing can prove these work after the "
                     "change; approving this plan accepts them unverified)")
        for u in unverified[:50]:
            lines.append(f"    {u['object']} ({u.get('role', '')}): {u.get('why', '')}")
        if len(unverified) > 50:
            lines.append(f"    ... and {len(unverified) - 50} more (all of them in --json)")
    else:
        lines.append("  unverified: none (every object is covered by a check that runs or "
                     "compiles it)")
    for a in plan.accepted_warnings or ():
        lines.append(f"  accepted on the row: {a['object']}: {a['message']!r} ({a['reason']})")
    for w in plan.warnings:
        lines.append(f"  warning: {w}")
    passed = [p for p in plan.prohibitions if p["passed"]]
    lines.append(f"  prohibitions: {len(passed)}/{len(plan.prohibitions)} passed")
    auth = bound.get("authorization") or {}
    roles = "|".join(auth.get("approver_roles") or [])
    lines.append(f"  approval needed from: {roles}"
                 f"{' (four eyes)' if auth.get('four_eyes') else ''}")
    lines.append(f"  next: capgate approve {h} --by WHO --role {roles.split('|')[0]} "
                 "--key FILE")
    return "\n".join(lines)


def _stage_lines(stage: Any) -> list[str]:
    """Where the plan runs and what it rests on: the evidence, the exemption, or no promotion."""
    if not isinstance(stage, dict):
        return ["  stage: not recorded (a plan made before capgate recorded stages)"]
    env = stage.get("environment")
    if not stage.get("promotes"):
        return [f"  stage: {env} (no promotion venue: no simulation evidence needed; "
                f"`capgate ddl simulate` here makes the evidence for a higher venue)"]
    ev = stage.get("evidence")
    if isinstance(ev, dict):
        return [f"  stage: {env} (a promotion): rests on the simulation of the same source on "
                f"{ev.get('environment')} in this case -- intent {ev.get('intent_id')}, plan "
                f"{ev.get('plan_hash')}, {ev.get('completed_at')}: apply + verify "
                f"{ev.get('apply')}, then {ev.get('compensation')}"]
    ex = stage.get("exemption") or {}
    out = [f"  stage: {env} (a promotion): no simulation evidence "
           f"({str(stage.get('missing') or 'none').replace('_', ' ')}); exempt by the "
           "five-point test:"]
    for p in ex.get("points") or []:
        out.append(f"    ({p['point']}) {p['name']}: {'holds' if p['holds'] else 'fails'} "
                   f"[{p['how']}] {p['why']}")
    return out


def _print_merge(args: argparse.Namespace, merges: list[dict[str, Any]],
                 details: dict[str, Any] | None = None) -> None:
    """Each merge proposal, whole (it is a document to apply, not an excerpt), and the plan
    capgate made of it, if it made one."""
    if getattr(args, "json", False):
        return
    for m in merges:
        state = "clean" if m.get("clean") else f"{m.get('conflicts')} conflict(s)"
        print(f"merge proposal for {m.get('object')} ({state}; base = snapshot "
              f"{m.get('base_snapshot_id')}, ours = new source, theirs = live):",
              file=sys.stderr)
        print(m.get("merged", ""), file=sys.stderr)
    if details and details.get("merge_plan"):
        print(f"the merge is plan {details['merge_plan']}: a new source, with its own "
              f"approval (capgate approve {details['merge_plan']} --by WHO --role ROLE "
              "--key FILE)", file=sys.stderr)
    elif details and details.get("merge_plan_why"):
        print(f"no plan was made of the merge: {details['merge_plan_why']}", file=sys.stderr)


_MARK = {"passed": "ok  ", "warning": "warn", "unverified": "?   ", "failed": "FAIL"}


def verify_lines(verify: dict[str, Any], indent: str = "  ", limit: int = 50) -> list[str]:
    """One rendering of a verify report for apply, ``verify --plan`` and ``verify OBJECT``:
    the count per verdict, then each check that is not a plain pass (and the passes, up to
    ``limit`` lines), each with what was actually checked."""
    checks = verify.get("checks") or []
    counts = {v: 0 for v in _MARK}
    for c in checks:
        counts[c.get("verdict", "passed")] = counts.get(c.get("verdict", "passed"), 0) + 1
    out = [f"{indent}verify: " + ", ".join(f"{n} {v}" for v, n in counts.items())
           + f" ({len(checks)} checks)"]
    ordered = sorted(checks, key=lambda c: ["failed", "warning", "unverified", "passed"].index(
        c.get("verdict", "passed")))
    for c in ordered[:limit]:
        how = f" [{c['checked']}]" if c.get("checked") else ""
        out.append(f"{indent}  {_MARK.get(c.get('verdict', 'passed'), '?   ')} {c['name']:<10} "
                   f"{c['object']}{how}  {c['detail']}")
    if len(ordered) > limit:
        out.append(f"{indent}  ... and {len(ordered) - limit} more passed (all in --json)")
    return out


def _outcome_text(payload: dict[str, Any]) -> str:
    ev = payload.get("evidence") or {}
    replayed = " (recorded outcome, nothing executed)" if payload.get("replayed") else ""
    lines = [f"{payload['status']}: {payload['operation_id']}@{payload['version']} intent "
             f"{payload['intent_id']}{replayed}",
             f"  plan {ev.get('plan_hash')}"]
    for o in ev.get("objects") or []:
        lines.append(f"  {o['object']}: {o['base_signature']} -> "
                     f"{o.get('applied_signature') or '(not applied)'}")
    verify = ev.get("verify")
    if verify:
        lines += verify_lines(verify)
    changed = [s for s in ev.get("statuses") or [] if s.get("before") != s.get("after")]
    for s in changed[:10]:
        lines.append(f"  status {s['object']}: {s.get('before')} -> {s.get('after')}")
    for key, sid in (ev.get("new_bases") or {}).items():
        lines.append(f"  new base of {key}: snapshot {sid}")
    comp = ev.get("compensation")
    if comp:
        lines.append(f"  compensation: {'restored' if comp.get('ok') else 'FAILED'}")
        for a in comp.get("actions") or []:
            lines.append(f"    {a['object']}: {a['action']}")
            for note in a.get("notes") or []:
                lines.append(f"      {note}")
        for cause in comp.get("causes") or []:
            lines.append(f"    cause: {cause}")
        if comp.get("verify"):
            lines += verify_lines(comp["verify"], indent="    ")
    if payload.get("reason"):
        err = payload["reason"]
        text = f"{err.get('code', '')} {err.get('message', '')}".strip() or json.dumps(
            {k: v for k, v in err.items() if k != "error"})[:300]
        lines.append(f"  reason: {text}")
    return "\n".join(lines)


def cmd_apply(args: argparse.Namespace) -> int:
    with _service(args) as svc:
        try:
            outcome, _ = svc.apply(args.plan_hash, case=args.case, who=caller(args, "is acting"))
        except MergeRequired as exc:
            _print_merge(args, exc.details.get("merge") or [], exc.details)
            raise
    payload = outcome.to_dict()
    emit(args, payload, _outcome_text(payload))
    return outcome.exit_code


def cmd_simulate(args: argparse.Namespace) -> int:
    with _service(args) as svc:
        result = svc.simulate(args.plan_hash, case=args.case, who=caller(args, "is acting"))
    applied = result.get("applied") or {}
    lines = [f"{'simulated' if result.get('simulated') else 'NOT simulated'}: plan "
             f"{result['plan_hash']} on {result['environment']}, case {result['case']}"]
    lines.append(f"  apply + verify: {applied.get('status')} (intent {applied.get('intent_id')})")
    if result.get("compensated"):
        lines.append(f"  compensation: {result['compensated'].get('outcome')}")
    if result.get("simulated"):
        ev = result["evidence"]
        lines.append(f"  evidence: source {ev['source_id']} of {ev['operation_id']}@"
                     f"{ev['version']}, recorded in the case at {ev['completed_at']}; a "
                     "promotion of the same source in this case rests on it")
    else:
        lines.append(f"  no evidence: {result.get('why')}")
    emit(args, result, "\n".join(lines))
    return EXIT_OK if result.get("simulated") else EXIT_REFUSED


def _verify_text(what: str, report: VerifyReport) -> str:
    lines = [f"{'passed' if report.passed else 'FAILED'}: {what}"]
    lines += verify_lines(report.to_dict(), limit=10_000)
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    if (args.object is None) == (args.plan_hash is None):
        raise UsageError("give OBJECT --connector NAME, or --plan PLAN_HASH")
    with _service(args) as svc:
        if args.plan_hash is not None:
            report = svc.verify_plan(args.plan_hash)
            what = f"plan {args.plan_hash}"
        else:
            if not args.connector:
                raise UsageError("ddl verify OBJECT needs --connector NAME")
            report = svc.verify_object(args.connector, args.object)
            what = f"{args.object} on {args.connector}"
    emit(args, {"what": what, **report.to_dict()}, _verify_text(what, report))
    return EXIT_OK if report.passed else EXIT_REFUSED


def cmd_compensate(args: argparse.Namespace) -> int:
    with _service(args) as svc:
        result = svc.compensate(args.case, args.intent, who=caller(args, "is acting"))
    record = dict(result.record)
    text = _outcome_text(record)
    text += f"\n  before: {result.before.classification}"
    if not result.ok:
        causes = (record.get("evidence") or {}).get("compensation", {}).get("causes") or []
        text += ("\n  ESCALATED: " + ("; ".join(causes[:3]) or "see the evidence")
                 + " -- do not apply again")
    emit(args, result.to_dict(), text)
    return EXIT_OK if result.ok else EXIT_UNKNOWN


def cmd_recover(args: argparse.Namespace) -> int:
    with _service(args) as svc:
        if args.dry_run:
            result = ddl_commands.recover(svc, args.case, args.intent, dry_run=True)
        else:
            result = ddl_commands.recover(svc, args.case, args.intent,
                                          who=caller(args, "is acting"))
    ev = result.get("evidence") or {}
    lines = [f"{result['classification'] or 'closed'}: intent {args.intent} -> "
             f"{result['action']}"]
    if ev.get("rule"):
        lines.append(f"  rule: {ev['rule']}")
    for o in ev.get("objects") or []:
        lines.append(f"  {o['object']}: {o['state']} (live {o['live_signature']})")
    if ev.get("next_action"):
        lines.append(f"  next: {ev['next_action']}")
    emit(args, result, "\n".join(lines))
    return EXIT_OK if result["resolved"] or args.dry_run else EXIT_UNKNOWN


def cmd_snapshots(args: argparse.Namespace) -> int:
    with _service(args) as svc:
        snaps = svc.snapshots(args.connector, args.object)
    lines = [f"{len(snaps)} snapshot(s) of {args.object} on {args.connector}"]
    lines += [_snapshot_line(s) for s in snaps]
    emit(args, [s.to_dict(with_source=False) for s in snaps], "\n".join(lines))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    with _service(args) as svc:
        result = svc.export(args.directory)
    text = (f"exported to {result.directory}: {len(result.written)} written, "
            f"{len(result.unchanged)} unchanged")
    emit(args, result.to_dict(), text)
    return EXIT_OK


def cmd_prohibitions(args: argparse.Namespace) -> int:
    rows = ddl_commands.prohibitions()
    lines = [f"{p['code']}  {p['name']:<28} {p['summary']}" for p in rows]
    emit(args, rows, "\n".join(lines))
    return EXIT_OK

