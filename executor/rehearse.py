"""Rehearsal: every row's examples in write-and-rollback, for CI.

``rehearse(executor, who=...)`` runs each example of each row through
``Executor.call(..., rehearse=True)`` -- the same code path as a real call
(input contract, grants, statements with their expected counts, verify,
replay, landing marker) that rolls back where a call would commit.

Every rehearsal is recorded in the ledger, in its own case (``--case``, else
``rehearse-<run id>``): who rehearsed what on which connector, and each
verdict with its counts and outcome.  A write-and-rollback rehearsal still
sends real statements to a real database -- locks, triggers, sequences -- so on
a staging or prod connector it is a *gated simulation*: the run's plan (every
row and example, connector, environment, case and requester, hashed like any
plan) needs a signed approval by a holder of the connector's
``simulation_approver_roles``, never the requester (four eyes), consumed once
before anything runs.  Each example is then judged against what it declares:

* its ``outcome`` (``applied_verified``, the default, or ``rolled_back``);
* its ``expect_rows``: one count per statement, in order -- rows returned by a
  read, rows affected by a write; for a leased row one per ``sql`` step that
  ran.  A mismatch names the row, the example and the statement (or step).

A row without examples gets a **zero-row probe** instead, which is *not* the
call path (an input contract cannot be satisfied by inputs that are known to
match nothing): every SQL text of the row -- statements or steps, verify,
replay, landed probe, compensation, post-commit checks -- runs once with every
bind NULL, each under its own savepoint, inside one transaction that is always
rolled back (read-only for read rows).  NULL matches no predicate, so
statements affect zero rows; a statement that inserts literal values may hit
a NOT NULL or other constraint, which proves it reached the table and is
reported as a note.  The probe proves the SQL compiles and binds against this
schema; it checks no counts, verify or replay expectations -- add examples
for that.

Not rehearsable, and reported as skipped: ``ddl`` rows (the DDL loop owns
them), retired rows (a call cannot reach them) and rows whose environments
exclude the connector's.  Post-commit checks and compensation run only after a
commit, so a rehearsal cannot exercise them; the report says so per row.

Afterwards the target's table contents are as before.  Two things a rollback
does not undo: the landing-marker table is created if it was missing (empty;
every database capgate writes to has it), and sequence / AUTO_INCREMENT
counters may have advanced (neither PostgreSQL nor MariaDB rolls those back).
"""

from __future__ import annotations

import functools
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from capgate.executor import outcome as oc
from capgate.executor.connectors import GATED_SIMULATION_ENVIRONMENTS
from capgate.executor.dialects import SessionTag
from capgate.executor.plan import Plan, binds_for
from capgate.registry.errors import (
    ApprovalRequired,
    CapgateError,
    UnknownOperation,
    UnknownPlan,
    UsageError,
)
from capgate.registry.model import EffectClass, Example, Row, Shape, thaw
from capgate.registry.vocabulary import RollbackReason

if TYPE_CHECKING:
    from capgate.executor.call import Executor

PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
ERROR = "error"

EXAMPLE = "example"
PROBE = "probe"
ROW = "row"

#: the name a probe or a skipped row carries in place of an example's name
PROBE_NAME = "(zero-row probe)"
ROW_NAME = "(row)"


@dataclass(frozen=True)
class Rehearsal:
    """The verdict on one example, one row's zero-row probe, or one skipped row."""

    operation_id: str
    version: int
    connector: str
    name: str
    """The example's name, or ``PROBE_NAME`` / ``ROW_NAME``."""
    kind: str
    """``example``, ``probe`` or ``row`` (a row that was skipped as a whole)."""
    result: str
    """``passed``, ``failed``, ``skipped`` or ``error`` (the call was refused)."""
    seconds: float = 0.0
    expected_outcome: str | None = None
    outcome: str | None = None
    """What happened: ``applied_verified`` (a read's ``ok`` counts as such) or ``rolled_back``."""
    expected_counts: tuple[str, ...] | None = None
    counts: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()
    """Which statement or step each count belongs to."""
    problems: tuple[str, ...] = ()
    """Why it failed: each sentence names the row, the example and the statement."""
    notes: tuple[str, ...] = ()
    reason: Mapping[str, Any] | None = None
    """The executor's rollback reason (or the refusal), as recorded."""
    evidence: Mapping[str, Any] = field(default_factory=dict)
    pinned: bool = True
    """Whether ``capabilities.lock`` pins the row as it is (a draft is rehearsed, and
    marked: a call runs it only in the unlocked environments)."""

    @property
    def ref(self) -> str:
        return f"{self.operation_id}@{self.version}"

    @property
    def message(self) -> str:
        if self.problems:
            return self.problems[0]
        return self.notes[0] if self.notes else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "operation_id": self.operation_id, "version": self.version,
            "connector": self.connector, "name": self.name, "kind": self.kind,
            "result": self.result, "seconds": round(self.seconds, 4),
            "expected_outcome": self.expected_outcome, "outcome": self.outcome,
            "expected_counts": list(self.expected_counts) if self.expected_counts is not None
            else None,
            "counts": list(self.counts), "labels": list(self.labels),
            "problems": list(self.problems), "notes": list(self.notes),
            "reason": dict(self.reason) if self.reason is not None else None,
            "evidence": dict(self.evidence), "pinned": self.pinned,
        }


@dataclass(frozen=True)
class RehearsalReport:
    """Every verdict of one rehearsal run, with table and JUnit renderings."""

    run_id: str
    who: str
    connectors: Mapping[str, Mapping[str, str]]
    """name -> {"dialect", "environment", "url" (without password)}."""
    results: tuple[Rehearsal, ...]
    seconds: float

    def tally(self) -> dict[str, int]:
        out = {PASSED: 0, FAILED: 0, SKIPPED: 0, ERROR: 0}
        for r in self.results:
            out[r.result] += 1
        return out

    @property
    def ok(self) -> bool:
        """Nothing failed, nothing was refused, and something actually ran."""
        t = self.tally()
        return t[FAILED] == 0 and t[ERROR] == 0 and t[PASSED] > 0

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "run_id": self.run_id, "who": self.who,
                "connectors": {k: dict(v) for k, v in self.connectors.items()},
                "tally": self.tally(), "seconds": round(self.seconds, 3),
                "results": [r.to_dict() for r in self.results]}

    def table(self) -> str:
        """The human report: one line per verdict, problems indented under it."""
        head = f"{'ROW':<28} {'EXAMPLE':<34} {'RESULT':<8} {'COUNTS':<12} OUTCOME"
        lines = [head]
        for r in self.results:
            counts = (",".join(map(str, r.counts)) or "-") if r.kind != ROW else ""
            outcome = r.outcome or ("" if r.kind == ROW else r.kind)
            if r.expected_outcome and r.outcome and r.expected_outcome != r.outcome:
                outcome = f"{r.outcome} (expected {r.expected_outcome})"
            lines.append(f"{r.ref:<28} {r.name:<34} {r.result.upper():<8} {counts:<12} "
                         f"{outcome}{'' if r.pinned else '  [UNPINNED]'}".rstrip())
            for text in r.problems:
                lines.append(f"    ! {text}")
            if r.result == SKIPPED:
                lines.extend(f"    - {text}" for text in r.notes[:1])
        t = self.tally()
        where = ", ".join(f"{n} ({c.get('dialect')}, {c.get('environment')})"
                          for n, c in self.connectors.items())
        verdict = "ok" if self.ok else ("FAILED" if t[FAILED] or t[ERROR]
                                        else "FAILED (nothing was rehearsed)")
        lines.append(f"{verdict}: {t[PASSED]} passed, {t[FAILED]} failed, {t[ERROR]} error(s), "
                     f"{t[SKIPPED]} skipped in {self.seconds:.2f}s on {where or 'no connector'}; "
                     f"every transaction rolled back")
        return "\n".join(lines)

    def junit(self) -> ET.Element:
        """JUnit XML: one ``testsuite`` per connector, one ``testcase`` per verdict."""
        root = ET.Element("testsuites", name="capgate rehearse")
        totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for name in self.connectors:
            mine = [r for r in self.results if r.connector == name]
            suite = ET.SubElement(root, "testsuite", name=f"capgate rehearse {name}")
            counts = {"tests": len(mine),
                      "failures": sum(r.result == FAILED for r in mine),
                      "errors": sum(r.result == ERROR for r in mine),
                      "skipped": sum(r.result == SKIPPED for r in mine)}
            for key, value in counts.items():
                suite.set(key, str(value))
                totals[key] += value
            suite.set("time", f"{sum(r.seconds for r in mine):.3f}")
            props = ET.SubElement(suite, "properties")
            for prop, text in self.connectors[name].items():
                ET.SubElement(props, "property", name=prop, value=str(text))
            for r in mine:
                case = ET.SubElement(suite, "testcase", classname=r.ref, name=r.name,
                                     time=f"{r.seconds:.3f}")
                if r.result == FAILED:
                    el = ET.SubElement(case, "failure", message=r.message,
                                       type=str((r.reason or {}).get("kind", "mismatch")))
                    el.text = "\n".join(r.problems)
                elif r.result == ERROR:
                    el = ET.SubElement(case, "error", message=r.message,
                                       type=str((r.reason or {}).get("code", "error")))
                    el.text = "\n".join(r.problems)
                elif r.result == SKIPPED:
                    ET.SubElement(case, "skipped", message=r.message)
                out = [f"counts: {list(r.counts)} ({', '.join(r.labels)})"] if r.counts else []
                out.extend(r.notes if r.result != SKIPPED else r.notes[1:])
                if out:
                    ET.SubElement(case, "system-out").text = "\n".join(out)
        for key, value in totals.items():
            root.set(key, str(value))
        root.set("time", f"{self.seconds:.3f}")
        return root

    def junit_xml(self) -> bytes:
        root = self.junit()
        ET.indent(root)
        data: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
        return data


# --- the run -------------------------------------------------------------------


def rehearse(executor: Executor, *, who: str, connectors: Sequence[str] | None = None,
             operations: Iterable[str] | None = None, run_id: str | None = None,
             case: str | None = None) -> RehearsalReport:
    """Rehearse every row of ``executor.registry`` on the given connectors.

    ``connectors`` defaults to every connector a row names; each must be
    configured (``UnknownConnector`` otherwise).  ``operations`` limits the run
    to those operation ids.  ``who`` must hold the grants a call would need on
    each connector (``NotAuthorized`` is raised before anything runs).  On a
    staging or prod connector the run is a gated simulation: ``case`` is
    required and its plan must be approved (``ApprovalRequired`` names the
    plan hash; nothing ran).  The run and every verdict are recorded in the
    ledger under ``case`` (default ``rehearse-<run id>``).
    """
    started = time.perf_counter()
    run_id = run_id or uuid.uuid4().hex[:10]
    wanted = set(operations) if operations is not None else None
    rows = [r for r in executor.registry.rows(include_retired=True)
            if wanted is None or r.operation_id in wanted]
    for missing in sorted((wanted or set()) - {r.operation_id for r in rows}):
        raise UnknownOperation(f"no capability row declares operation {missing!r}",
                               operation_id=missing)
    names = list(dict.fromkeys(connectors)) if connectors else sorted({r.connector for r in rows})
    info: dict[str, dict[str, str]] = {}
    for name in names:
        config = executor.connectors.config(name)  # UnknownConnector: fail before anything runs
        info[name] = {"dialect": executor.connectors.get(name).dialect.name,
                      "environment": config.environment, "url": config.safe_url}
    rows = [r for r in rows if r.connector in info]
    _check_grants(executor, who, rows)
    record_case = case or f"rehearse-{run_id}"
    approvals = _gate(executor, rows, info, who, case, run_id)
    for name in info:  # unreachable, or capgate's tables missing: one coded refusal up front
        executor.connectors.get(name).check_target()
    executor.ledger.append(record_case, "rehearsal_started", {
        "run_id": run_id, "who": who, "connectors": info, "approvals": approvals,
        "rows": [{"operation_id": r.operation_id, "version": r.version,
                  "row_hash": r.row_hash, "examples": [e.name for e in r.examples]}
                 for r in rows]})
    results: list[Rehearsal] = []
    for row in rows:
        results.extend(_rehearse_row(executor, row, who, run_id, len(results)))
    report = RehearsalReport(run_id, who, info, tuple(results), time.perf_counter() - started)
    executor.ledger.append_many(record_case, [
        *(("rehearsed", {"run_id": run_id, **_recorded(r)}, None) for r in results),
        ("rehearsal_finished", {"run_id": run_id, "ok": report.ok, "tally": report.tally(),
                                "seconds": round(report.seconds, 3)}, None)])
    return report


def _recorded(r: Rehearsal) -> dict[str, Any]:
    """What the ledger keeps of one verdict: what ran, its counts and outcome (no rows)."""
    return {"operation_id": r.operation_id, "version": r.version, "connector": r.connector,
            "name": r.name, "kind": r.kind, "result": r.result, "outcome": r.outcome,
            "expected_outcome": r.expected_outcome, "counts": list(r.counts),
            "labels": list(r.labels), "problems": list(r.problems)}


def rehearsal_plan(rows: Sequence[Row], connector: str, environment: str, case: str,
                   who: str) -> Plan:
    """The plan a gated rehearsal is approved by: every row and example it will run."""
    from capgate.registry.canonical import canonical_hash

    body: dict[str, Any] = {
        "kind": "rehearsal", "connector": connector, "environment": environment,
        "case": case, "requester": who,
        "rows": [{"operation_id": r.operation_id, "version": r.version, "row_hash": r.row_hash,
                  "effect_class": str(r.effect_class),
                  "examples": [{"name": e.name, "input": thaw(e.input)} for e in r.examples]
                  if r.examples else [PROBE_NAME]}
                 for r in rows if _skip_reason_env(r, environment) is None],
    }
    return Plan(canonical_hash({"plan": "rehearsal/1", **body}), body)


def _gate(executor: Executor, rows: Sequence[Row], info: Mapping[str, Mapping[str, str]],
          who: str, case: str | None, run_id: str) -> list[dict[str, Any]]:
    """Staging and prod: one signed, unused approval of the run's plan, consumed now."""
    used: list[dict[str, Any]] = []
    for name, where in info.items():
        environment = where["environment"]
        if environment not in GATED_SIMULATION_ENVIRONMENTS:
            continue
        mine = [r for r in rows if r.connector == name]
        if not any(_skip_reason_env(r, environment) is None for r in mine):
            continue
        if case is None:
            raise UsageError(f"a rehearsal on {name!r} ({environment}) is a gated simulation: "
                             "name its case (--case CASE) so that its plan can be approved")
        config = executor.connectors.config(name)
        plan = rehearsal_plan(mine, name, environment, case, who)
        executor.ledger.record_plan(plan.plan_hash, case, who, plan.to_dict())
        roles = config.simulation_approver_roles
        details = {"plan_hash": plan.plan_hash, "plan": plan.to_dict(),
                   "approver_roles": list(roles), "four_eyes": True}
        if not roles:
            raise ApprovalRequired(
                f"a rehearsal on {name!r} ({environment}) is a gated simulation and the "
                f"connector names no simulation_approver_roles: nobody can approve it",
                **details)
        intent = f"rehearsal:{run_id}:{name}"  # one approval per run: single use
        try:
            approval = executor.ledger.consume_approval(
                plan.plan_hash, intent, now=executor.clock(), exclude_approver=who,
                accept=functools.partial(executor.grants.approval_problem, row_roles=roles))
        except (ApprovalRequired, UnknownPlan):
            raise ApprovalRequired(
                f"a rehearsal on {name!r} ({environment}) is a gated simulation: approve plan "
                f"{plan.plan_hash} with `capgate approve {plan.plan_hash} --by WHO --role "
                f"{'|'.join(roles)} --key FILE` (not {who!r}), then rehearse again",
                **details) from None
        used.append({"connector": name, "plan_hash": plan.plan_hash,
                     "approval_id": approval.approval_id, "approver": approval.approver,
                     "role": approval.role})
    return used


def _check_grants(executor: Executor, who: str, rows: Sequence[Row]) -> None:
    """One refusal up front instead of one per example."""
    seen: set[tuple[str, bool]] = set()
    for row in sorted(rows, key=lambda r: not r.is_write):
        key = (row.connector, row.is_write)
        if key in seen or row.retired or row.effect_class is EffectClass.DDL:
            continue
        seen.add(key)
        config = executor.connectors.config(row.connector)
        if config.environment in row.environments:
            executor.grants.check_call(who, row, config.name, config.environment)


def _rehearse_row(executor: Executor, row: Row, who: str, run_id: str,
                  seq: int) -> list[Rehearsal]:
    verdicts = _verdicts(executor, row, who, run_id, seq)
    if executor.registry.pinned(row):
        return verdicts
    return [replace(v, pinned=False) for v in verdicts]


def _verdicts(executor: Executor, row: Row, who: str, run_id: str,
              seq: int) -> list[Rehearsal]:
    environment = executor.connectors.config(row.connector).environment
    skip = _skip_reason(executor, row, environment)
    if skip is not None:
        return [Rehearsal(row.operation_id, row.version, row.connector, ROW_NAME, ROW, SKIPPED,
                          notes=(skip,))]
    if not row.examples:
        return [_probe(executor, row, f"rehearse-{run_id}-{seq}")]
    return [_example(executor, row, ex, who, f"rehearse-{run_id}-{seq + i}")
            for i, ex in enumerate(row.examples)]


def _skip_reason(executor: Executor, row: Row, environment: str) -> str | None:
    reason = _skip_reason_env(row, environment)
    if reason is not None and row.retired:
        current = executor.registry.current_rows()
        newer = [r.ref for r in current if r.operation_id == row.operation_id]
        return f"{reason}{f' ({newer[0]} is current)' if newer else ''}"
    return reason


def _skip_reason_env(row: Row, environment: str) -> str | None:
    """Why ``row`` is not rehearsed on a connector of ``environment`` (None: it is)."""
    if row.effect_class is EffectClass.DDL:
        return "ddl row: stored code is rehearsed by the DDL loop, not by statement rehearsal"
    if row.retired:
        return "retired: a call cannot reach it"
    if environment not in row.environments:
        return (f"not allowed in environment {environment!r} of connector {row.connector!r} "
                f"(allowed: {', '.join(row.environments)})")
    return None


# --- examples ------------------------------------------------------------------


def _example(executor: Executor, row: Row, example: Example, who: str, case: str) -> Rehearsal:
    started = time.perf_counter()
    base = Rehearsal(row.operation_id, row.version, row.connector, example.name, EXAMPLE,
                     ERROR, expected_outcome=example.outcome,
                     expected_counts=tuple(str(e) for e in example.expect_rows)
                     if example.expect_rows is not None else None)
    where = f"{row.ref} example {example.name}"
    try:
        result = executor.call(row.operation_id, thaw(example.input), case=case, who=who,
                               version=row.version, rehearse=True)
    except CapgateError as exc:
        return replace(base, seconds=time.perf_counter() - started,
                       problems=(f"{where}: refused: {exc}",), reason=exc.to_dict())
    seconds = time.perf_counter() - started
    counts, labels = observed_counts(row, result)
    problems: list[str] = []
    notes: list[str] = []
    if result.status == oc.APPLIED and (result.reason or {}).get("kind") != \
            RollbackReason.REHEARSAL_ROLLED_BACK and row.is_write:
        # Defensive: a rehearsal must never commit.  Say so loudly if it ever did.
        problems.append(f"{where}: the executor reports a commit, not a rehearsal rollback")
    actual = oc.APPLIED if result.status in (oc.APPLIED, oc.READ_OK) else result.status
    reason = dict(result.reason) if result.reason else None
    if reason and reason.get("kind") == RollbackReason.REHEARSAL_ROLLED_BACK:
        reason = None
    if actual != example.outcome:
        why = f": {describe_reason(row, reason)}" if reason else ""
        problems.append(f"{where}: expected {example.outcome}, got {actual}{why}")
    elif reason is not None:
        notes.append(f"rolled back as declared: {describe_reason(row, reason)}")
        if reason.get("kind") in ("database_error", "timeout", "read_only_violation"):
            notes.append("note: the database refused the statement; a declared count or "
                         "check did not decide this outcome")
    if example.expect_rows is not None:
        problems.extend(_compare_counts(where, example, counts, labels))
    notes.extend(_evidence_notes(row, result.evidence))
    return replace(base, result=FAILED if problems else PASSED, seconds=seconds,
                   outcome=actual, counts=tuple(counts), labels=tuple(labels),
                   problems=tuple(problems), notes=tuple(notes), reason=result.reason,
                   evidence=result.evidence)


def _compare_counts(where: str, example: Example, counts: Sequence[int],
                    labels: Sequence[str]) -> list[str]:
    expected = example.expect_rows or ()
    out: list[str] = []
    for i, want in enumerate(expected):
        if i >= len(counts):
            label = labels[i] if i < len(labels) else f"count {i + 1}"
            out.append(f"{where}: {label} did not run; the example expects {want} row(s)")
        elif not want.matches(counts[i]):
            out.append(f"{where}: {labels[i]}: the example expects {want} row(s), "
                       f"got {counts[i]}")
    if len(counts) > len(expected):
        extra = ", ".join(f"{labels[i]} ({counts[i]})" for i in range(len(expected), len(counts)))
        out.append(f"{where}: {len(counts)} statement(s) ran but the example lists "
                   f"{len(expected)} count(s); unlisted: {extra}")
    return out


def statement_label(row: Row, index: int) -> str:
    """``statement 2 (raise_sum_insured)``: 1-based, as ``capgate plan`` numbers them."""
    name = row.statements[index].name if index < len(row.statements) else None
    return f"statement {index + 1}" + (f" ({name})" if name else "")


def observed_counts(row: Row, result: oc.Outcome) -> tuple[list[int], list[str]]:
    """The counts a call observed, with the statement or step each belongs to."""
    ev = result.evidence
    if row.effect_class is EffectClass.READ:
        raw = ev.get("statements")
        stmts = list(raw) if isinstance(raw, list) else ([ev] if "count" in ev else [])
        return ([int(s.get("count", len(s.get("rows", ())))) for s in stmts],
                [statement_label(row, i) for i in range(len(stmts))])
    if row.shape is Shape.LEASED:
        ran = [t for t in ev.get("steps", ()) if isinstance(t, Mapping) and "rows" in t]
        return [int(t["rows"]) for t in ran], [f"step {t['step']}" for t in ran]
    counts = [int(n) for n in ev.get("counts", ())]
    return counts, [statement_label(row, i) for i in range(len(counts))]


def describe_reason(row: Row, reason: Mapping[str, Any]) -> str:
    """A rollback reason as a sentence that names the statement, step or check."""
    kind = reason.get("kind")
    if kind == "count":
        where = (f"step {reason['step']}" if "step" in reason
                 else statement_label(row, int(reason.get("statement", 0))))
        verb = "returned" if row.effect_class is EffectClass.READ else "affected"
        return (f"{where} {verb} {reason.get('actual')} row(s), the row expects "
                f"{_expect_text(reason.get('expected'))}")
    if kind == "verify":
        return (f"verify check {reason.get('check')} expected {reason.get('expected')}, "
                f"got {reason.get('actual')}")
    if kind == "replay":
        return f"replay expected {reason.get('expected')}, got {reason.get('actual')}"
    if kind == "abort":
        return f"step {reason.get('step')} aborted: {reason.get('reason')}"
    message = reason.get("message")
    return f"{kind}{f': {message}' if message else ''}"


def _expect_text(value: Any) -> str:
    if isinstance(value, Mapping):
        low, high = value.get("min"), value.get("max")
        return f"{low}..{high}" if high is not None else f">= {low}"
    return str(value)


def _evidence_notes(row: Row, evidence: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    verify = evidence.get("verify")
    if isinstance(verify, list) and verify:
        out.append("verify: " + ", ".join(
            f"{v.get('name')} {'ok' if v.get('ok') else 'FAILED'}" for v in verify
            if isinstance(v, Mapping)))
    replay = evidence.get("replay")
    if isinstance(replay, Mapping):
        out.append(f"replay: {len(replay.get('rows', ()))} row(s)")
    if row.post_commit:
        out.append(f"not rehearsable: {len(row.post_commit)} post-commit check(s) run only "
                   "after a commit")
    if row.compensation:
        out.append("not rehearsable: the compensation runs only after a commit")
    return out


# --- the zero-row probe --------------------------------------------------------


def probe_texts(row: Row) -> list[tuple[str, str]]:
    """Every SQL text of a row, labelled as a reviewer would name it."""
    out: list[tuple[str, str]] = [(statement_label(row, i), s.sql)
                                  for i, s in enumerate(row.statements)]
    for step in row.steps:
        if step.sql:
            out.append((f"step {step.name}", step.sql))
        if step.check:
            out.append((f"step {step.name} (check)", step.check))
    out.extend((f"verify {c.name}", c.sql) for c in row.verify)
    if row.replay is not None:
        out.append(("replay", row.replay.sql))
    if row.landed_probe is not None:
        out.append(("landed_probe", row.landed_probe.sql))
    out.extend((f"compensation {i + 1}{f' ({s.name})' if s.name else ''}", s.sql)
               for i, s in enumerate(row.compensation))
    out.extend((f"post_commit {c.name}", c.sql) for c in row.post_commit)
    return out


def _probe(executor: Executor, row: Row, case: str) -> Rehearsal:
    started = time.perf_counter()
    connector = executor.connectors.get(row.connector)
    dialect = connector.dialect
    tag = SessionTag(case, row.operation_id, "probe")
    counts: list[int] = []
    labels: list[str] = []
    problems: list[str] = []
    notes = ["zero-row probe (the row has no examples): every SQL text ran once with NULL "
             "inputs in a transaction that was rolled back; it compiles against this schema, "
             "but no count, verify or replay expectation was checked -- add examples"]
    where = f"{row.ref} zero-row probe"
    with connector.engine.connect() as conn:
        try:
            if row.is_write:
                dialect.begin_write(conn, tag, row.timeout.seconds, row.timeout.lock_seconds)
            else:
                dialect.begin_read(conn, tag, row.timeout.seconds)
            for label, sql in probe_texts(row):
                savepoint = conn.begin_nested()
                try:
                    res = conn.execute(sa.text(dialect.sql(sql, tag)), binds_for(sql, {}))
                    n = len(res.fetchmany(1001)) if res.returns_rows else res.rowcount
                    counts.append(n)
                    labels.append(label)
                except sa.exc.IntegrityError as exc:
                    notes.append(f"{label}: a constraint refused NULL inputs ({_first_line(exc)});"
                                 " the statement reached its table")
                except sa.exc.DBAPIError as exc:
                    problems.append(f"{where}: {label}: {_first_line(exc)}")
                finally:
                    if savepoint.is_active:
                        savepoint.rollback()
        except sa.exc.DBAPIError as exc:
            problems.append(f"{where}: could not open the transaction: {_first_line(exc)}")
        finally:
            conn.rollback()
            if row.is_write:
                dialect.reset_session(conn)
            else:
                dialect.end_read(conn)
    return Rehearsal(row.operation_id, row.version, row.connector, PROBE_NAME, PROBE,
                     FAILED if problems else PASSED, seconds=time.perf_counter() - started,
                     counts=tuple(counts), labels=tuple(labels), problems=tuple(problems),
                     notes=tuple(notes))


def _first_line(exc: sa.exc.DBAPIError) -> str:
    text = str(exc.orig) if exc.orig is not None else str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
