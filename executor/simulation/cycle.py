"""The simulation cycle (seed 001 §5): one command, each step a ledger event with its evidence.

``simulate(executor, OP, inputs, case=K, who=W)`` runs a change on a lower
venue and takes it back out again:

1. **plan** -- resolve the row on the venue, derive its teardown from the
   write log (:mod:`~executor.simulation.teardown`; a row that cannot be torn
   down is refused before anything runs), apply the exemption test, and on
   staging (customer-facing) and prod (a production simulation, five
   conditions: :mod:`~executor.simulation.production`) check the simulation's
   own gate; record ``simulation_planned`` with the planned effects (the
   statements and their expected counts, the expected effects) and cleanup;
2. **baseline** -- read the rows the target names and the declared baseline
   queries in one read-only transaction; record them with their digests
   (``simulation_baseline``) before the first write;
3. **execute** -- the operation itself, committed, through the normal call
   path and its gates (``Executor.call``, under the simulation's own
   idempotency key: never the key a promotion will use); ``simulation_executed``;
4. **observe** -- its verify, replay and post-commit results, the keys it
   returned and every expected effect's probe; ``simulation_observed``;
5. **tear down** -- exactly the set written: the row's compensation and a
   delete of each key its INSERTs returned, as an intent of its own (marker,
   fence, ``observed``), so a crash is reconciled like any write;
   ``simulation_torn_down``;
6. **verify restoration** -- re-read every baseline query; the digests must
   match (``simulation_restored``: the simulated intent is closed as
   ``simulated``, and the case holds the evidence a promotion needs).  A
   mismatch escalates with both digests and the rows that differ
   (``simulation_escalated``; the simulated intent is escalated, holding the
   case until a person decides with ``capgate resume CASE --resolve``).

A completed simulation is not a deployment: retaining the change is a
separate, promoted call.  ``dry_run`` stops after the plan: it sends nothing
to any database and records nothing.  A simulation interrupted between steps
(a crash, an approval still missing) is picked up with
:func:`continue_simulation` at its first unrecorded step.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from capgate.executor import boundaries, gates
from capgate.executor import outcome as oc
from capgate.executor.call import Executor
from capgate.executor.connectors import Connector
from capgate.executor.context import TERMINAL, CallContext, check_names, validated_inputs
from capgate.executor.dialects import SessionTag
from capgate.executor.expectations import evaluate
from capgate.executor.ledger.store import Guard
from capgate.executor.outcome import Outcome, jsonable
from capgate.executor.plan import Plan, binds_for, fingerprint, idempotency_key, render
from capgate.executor.runtime import Runtime
from capgate.executor.simulation.baseline import Baseline, baseline_queries, compare, read_baseline
from capgate.executor.simulation.exemption import exemption_test
from capgate.executor.simulation.production import (
    conditions,
    end_of_business_day,
    refuse_unless_all_hold,
)
from capgate.executor.simulation.records import (
    FINAL_STEPS,
    IDEM_MARK,
    in_progress,
    input_shape,
    record_step,
    simulation_key,
    summaries,
)
from capgate.executor.simulation.teardown import TeardownPlan, derive
from capgate.executor.transaction import run_statements, run_transaction
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import (
    ApprovalRequired,
    CustomerNotInformed,
    DdlError,
    ReconciliationRequired,
    SimulationNotFound,
    SimulationStateConflict,
    SimulationVenueRefused,
    UnknownPlan,
    UsageError,
)
from capgate.registry.model import AuthKind, EffectClass, Row

__all__ = ["SimulationReport", "abandon_simulation", "continue_simulation", "simulate",
           "simulation_plan"]

PLANNED, BASELINE, EXECUTED, OBSERVED, TORN_DOWN = (
    "planned", "baseline", "executed", "observed", "torn_down")
RESTORED, ROLLED_BACK, ESCALATED = "restored", "rolled_back", "escalated"
_EXIT = {"planned": 0, RESTORED: 0, ROLLED_BACK: 1, ESCALATED: 3, "abandoned": 1}


@dataclass
class SimulationReport:
    """What a simulation did, step by step, as the ledger recorded it."""

    simulation_id: str | None
    status: str
    """``planned`` (a dry run), ``restored``, ``rolled_back`` (the write rolled back; the
    baseline re-read unchanged) or ``escalated`` (a person decides)."""
    plan: dict[str, Any]
    summary: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    outcome: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        return _EXIT.get(self.status, 3)

    def to_dict(self) -> dict[str, Any]:
        return {"simulation_id": self.simulation_id, "status": self.status,
                "plan_hash": self.plan.get("plan_hash"), "plan": self.plan,
                "summary": self.summary, "steps": self.steps, "outcome": self.outcome}


# --- the plan ------------------------------------------------------------------------


def _kind(environment: str) -> str | None:
    """The simulation's own gate kind here: staging and prod are gated, below is not."""
    return {"staging": "simulation", "prod": "production_simulation"}.get(environment)


def simulation_plan(rt: Runtime, row: Row, connector: Connector, inputs: Mapping[str, Any],
                    case: str, who: str, *, teardown: TeardownPlan,
                    customer_informed: Mapping[str, str] | None,
                    data_dependency: str | None) -> Plan:
    """The simulation's plan: planned effects and cleanup, baseline, exemption, conditions.

    Its hash covers what an approver approves -- row hash, inputs, venue, case,
    requester, and (on staging and prod) the customer-informed record and the
    data-dependency argument -- never a generated id or a time, so the same
    simulation asked again after its approval has the same hash.
    """
    environment = connector.environment
    kind = _kind(environment)
    call_plan = render(row, inputs, connector.name, environment, case=case, requester=who)
    snapshot = rt.ledger.snapshot(case) or {}
    history = rt.ledger.intents(case) if snapshot else {}
    body: dict[str, Any] = {
        "kind": kind or "simulation_ungated", "operation_id": row.operation_id,
        "version": row.version, "row_hash": row.row_hash, "connector": connector.name,
        "environment": environment, "case": case, "requester": who, "inputs": dict(inputs),
        "input_shape": input_shape(inputs),
        "baseline": [{"name": n, "sql": q, "binds": binds_for(q, inputs)}
                     for n, q in baseline_queries(row, inputs)],
        "planned_effects": {
            "statements": call_plan.body["statements"] or call_plan.body["steps"],
            "verify": call_plan.body["verify"], "replay": call_plan.body["replay"],
            "post_commit": call_plan.body["post_commit"],
            "returns": [{"statement": s.name, "table": s.returns.table, "key": s.returns.key}
                        for s in row.statements if s.returns is not None],
            "expected_effects": [e.to_dict() for e in row.expected_effects]},
        "cleanup": teardown.to_dict(),
        "exemption": exemption_test(row, inputs, environment, history).to_dict(),
        "row_plan_hash": call_plan.plan_hash,
    }
    if customer_informed is not None:
        body["customer_informed"] = dict(customer_informed)
    if kind == "production_simulation":
        found = conditions(row, inputs, snapshot.get("case") or {}, data_dependency)
        body["production"] = {"conditions": [c.to_dict() for c in found],
                              "data_dependency": data_dependency,
                              "approver_roles": list(
                                  connector.config.production_simulation_approver_roles)}
    digest = canonical_hash({"plan": "simulation/1", "kind": body["kind"],
                             "row_hash": row.row_hash, "inputs": dict(inputs),
                             "connector": connector.name, "environment": environment,
                             "case": case, "requester": who,
                             "customer_informed": body.get("customer_informed"),
                             "data_dependency": data_dependency if kind else None})
    return Plan(digest, body)


# --- the cycle -----------------------------------------------------------------------


class _Cycle:
    """One simulation between its steps: the executor, the request and what was recorded."""

    def __init__(self, executor: Executor, row: Row, connector: Connector,
                 inputs: Mapping[str, Any], case: str, who: str, plan: Plan,
                 teardown: TeardownPlan, summary: dict[str, Any]) -> None:
        self.ex = executor
        self.rt = executor.rt
        self.row = row
        self.connector = connector
        self.inputs = dict(inputs)
        self.case = case
        self.who = who
        self.plan = plan
        self.teardown = teardown
        self.summary = summary
        self.steps: list[dict[str, Any]] = []
        self.outcome: Outcome | None = None
        self.baseline: dict[str, Any] | None = None

    @property
    def sid(self) -> str:
        return str(self.summary["simulation_id"])

    @property
    def tag(self) -> SessionTag:
        return SessionTag(self.case, f"capgate.simulate.{self.row.operation_id}", self.sid)

    def record(self, kind: str, step: str, payload: Mapping[str, Any],
               evidence: Mapping[str, Any] | None = None, *,
               guard: Guard | None = None) -> None:
        summary = {**self.summary, "step": step, f"{step}_at": self.rt.clock().isoformat()}
        record_step(self.rt.ledger, self.case, kind, summary, payload, evidence, guard=guard)
        self.summary = summary
        self.steps.append({"step": step, "event": kind, **payload})

    def report(self) -> SimulationReport:
        return SimulationReport(self.sid, str(self.summary["step"]), self.plan.to_dict(),
                                dict(self.summary), self.steps,
                                self.outcome.to_dict() if self.outcome else None)

    # -- 2. baseline

    def capture(self) -> None:
        base = read_baseline(self.rt, self.connector, baseline_queries(self.row, self.inputs),
                             self.inputs, self.tag, self.row.timeout.seconds)
        self.baseline = base.to_dict()
        self.summary["baseline_digest"] = base.digest
        self.record("simulation_baseline", BASELINE, {"baseline": self.baseline})

    # -- 3. execute

    def execute(self) -> None:
        venue = self.connector.environment if self.connector.config.logical else None
        result = self.ex.call(self.row.operation_id, self.inputs, case=self.case, who=self.who,
                              version=self.row.version, venue=venue, simulation=self.sid)
        self.outcome = result
        self.summary["intent_id"] = result.intent_id
        self.summary["outcome"] = result.status
        self.record("simulation_executed", EXECUTED, {
            "intent_id": result.intent_id, "outcome": result.status,
            "reason": dict(result.reason) if result.reason else None})

    # -- 4. observe

    def observe(self) -> None:
        assert self.outcome is not None
        ev = self.outcome.evidence
        probes = self._probes()
        self.record("simulation_observed", OBSERVED, {"observed": {
            "intent_id": self.outcome.intent_id, "outcome": self.outcome.status,
            "counts": ev.get("counts"), "verify": ev.get("verify"), "replay": ev.get("replay"),
            "post_commit": ev.get("post_commit"), "returned": ev.get("returned"),
            "effects": ev.get("effects"), "probes": probes}})

    def _probes(self) -> list[dict[str, Any]]:
        probed = [e for e in self.row.expected_effects if e.probe is not None]
        if not probed:
            return []
        dialect = self.connector.dialect
        out: list[dict[str, Any]] = []
        with self.rt.connect(self.connector) as conn:
            try:
                dialect.begin_read(conn, self.tag, self.row.timeout.seconds)
                for e in probed:
                    assert e.probe is not None
                    rows = conn.execute(sa.text(dialect.sql(e.probe.sql, self.tag)),
                                        binds_for(e.probe.sql, self.inputs)).fetchmany(101)
                    found = evaluate(e.name, e.probe.expect, rows)
                    out.append({"effect": e.name, "class": e.effect_class,
                                "present": found.ok, "rows": jsonable([list(r)
                                                                      for r in rows[:100]])})
            finally:
                conn.rollback()
                dialect.end_read(conn)
        return out

    # -- 5. tear down

    def tear_down(self) -> bool:
        """Run the teardown as its own intent; True when it committed."""
        assert self.outcome is not None
        if self.outcome.status == oc.COMPENSATED:  # the post-commit failure undid it already
            self.record("simulation_torn_down", TORN_DOWN, {
                "by": "compensation", "compensation": dict(self.outcome.reason or {})})
            return True
        earlier = self._earlier_teardown()
        if earlier is not None:  # it ran before a crash (resume may have settled it): once
            intent_id, record = earlier
            self.summary["teardown_intent_id"] = intent_id
            self.record("simulation_torn_down", TORN_DOWN, {
                "teardown_intent_id": intent_id, "outcome": record.get("status"),
                "counts": (record.get("evidence") or {}).get("counts"), "recovered": True,
                "note": "the teardown committed before the simulation could record it"})
            return True
        returned = self._returned()
        statements, binds = self.teardown.statements(returned)
        inputs = {**self.inputs, **binds}
        rt, row, connector = self.rt, self.row, self.connector
        exec_key = self.outcome.idempotency_key
        ctx = CallContext(row, inputs, self.case, self.who, connector, uuid.uuid4().hex,
                          f"{exec_key}#teardown" if exec_key else None,
                          fingerprint(row, inputs, connector.name, connector.environment),
                          render(row, inputs, connector.name, connector.environment,
                                 case=self.case, requester=self.who))
        rt.ledger.append(self.case, "prepared", {
            "request": {"tears_down": self.outcome.intent_id, "simulation_id": self.sid,
                        "operation_id": row.operation_id, "version": row.version,
                        "inputs": inputs, "who": self.who, "connector": connector.name,
                        "environment": connector.environment},
            "state": {"operation_id": row.operation_id, "version": row.version,
                      "row_hash": row.row_hash, "idempotency_key": ctx.idem_key,
                      "fingerprint": ctx.fingerprint, "compensates": self.outcome.intent_id,
                      "connector": connector.name, "environment": connector.environment,
                      "recovery": "never_retry", "effect_class": "compensation",
                      "simulation_teardown": self.sid, "attempt": 0, "inputs": inputs,
                      "who": self.who}},
            intent_id=ctx.intent_id, guard=boundaries.case_guard(self.case, None),
            continuing=True)
        rt.check_target(connector, ctx)
        result = run_transaction(rt, ctx, lambda conn, ev: run_statements(
            ctx, conn, ev, statements, what="teardown"))
        boundaries.observed(rt, ctx, result)
        self.summary["teardown_intent_id"] = ctx.intent_id
        self.record("simulation_torn_down", TORN_DOWN, {
            "teardown_intent_id": ctx.intent_id, "outcome": result.status,
            "statements": [{"name": s.name, "sql": s.sql} for s in statements],
            "binds": binds, "counts": result.evidence.get("counts"),
            "reason": dict(result.reason) if result.reason else None})
        return result.status == oc.APPLIED

    def _earlier_teardown(self) -> tuple[str, Mapping[str, Any]] | None:
        """A teardown intent of this simulation that already applied (None: there is none).

        One still open holds the case (``capgate resume`` first); one that rolled
        back is simply run again.
        """
        for intent_id, state in self.rt.ledger.intents(self.case).items():
            if state.get("simulation_teardown") != self.sid:
                continue
            if str(state.get("status")) not in TERMINAL:
                raise ReconciliationRequired(
                    f"the teardown {intent_id} of simulation {self.sid} is unresolved; run "
                    f"`capgate resume {self.case}` first", case=self.case, intents=[intent_id])
            record = state.get("outcome_record")
            if isinstance(record, Mapping) and record.get("status") == oc.APPLIED:
                return intent_id, record
        return None

    def _returned(self) -> dict[str, Any]:
        """The keys the execute step returned: as the ledger recorded them before COMMIT."""
        assert self.outcome is not None
        state = self.rt.ledger.intent(self.case, self.outcome.intent_id)
        keys = state.get("returned")
        if isinstance(keys, Mapping) and int(state.get("returned_attempt") or 0) == \
                self.outcome.attempt:
            return dict(keys)
        returned = self.outcome.evidence.get("returned")
        return dict(returned) if isinstance(returned, Mapping) else {}

    # -- 6. verify restoration

    def verify(self) -> None:
        if self.baseline is None:
            self.baseline = _recorded_baseline(self.rt, self.case, self.sid)
        again = read_baseline(self.rt, self.connector, baseline_queries(self.row, self.inputs),
                              self.inputs, self.tag, self.row.timeout.seconds)
        mismatches = compare(self.baseline, again)
        executed = self.summary.get("outcome")
        if not mismatches:
            self.summary["restored_digest"] = again.digest
            if executed == oc.ROLLED_BACK:
                self.record("simulation_restored", ROLLED_BACK, {
                    "restored": again.to_dict(rows=False), "note": "the write rolled back; "
                    "the baseline re-read unchanged: no evidence for a promotion"})
                return
            self._close_as_simulated(again)
            evidence = {"simulation_id": self.sid, "operation_id": self.row.operation_id,
                        "version": self.row.version, "row_hash": self.row.row_hash,
                        "input_shape": input_shape(self.inputs),
                        "environment": self.connector.environment,
                        "connector": self.connector.name, "intent_id": self.summary["intent_id"],
                        "baseline_digest": again.digest,
                        "completed_at": self.rt.clock().isoformat()}
            if self.summary.get("kind") == "production_simulation":
                self.summary["reconciliation"] = self._reconciliation_due()
            self.record("simulation_restored", RESTORED,
                        {"restored": again.to_dict(rows=False)}, evidence)
            return
        self.escalate("restoration_mismatch", {"mismatches": mismatches,
                                               "before_digest": self.baseline.get("digest"),
                                               "after_digest": again.digest})

    def _close_as_simulated(self, again: Baseline) -> None:
        intent = str(self.summary["intent_id"])
        record = dict(self.rt.ledger.intent(self.case, intent).get("outcome_record") or {})
        record.update(status=oc.SIMULATED, replayed=False, reason={
            "kind": "simulation", "simulation_id": self.sid,
            "teardown_intent_id": self.summary.get("teardown_intent_id"),
            "baseline_digest": again.digest, "note": "a completed simulation, not a "
            "deployment: torn down and the baseline re-read identical"})
        self.rt.ledger.append(self.case, "observed", {
            "outcome": record, "after_simulation": self.sid,
            "state": {"outcome": oc.SIMULATED, "outcome_record": record}}, intent_id=intent)

    def _reconciliation_due(self) -> dict[str, Any]:
        spec = self.row.simulation
        assert spec is not None and spec.reconciliation is not None
        due_by = end_of_business_day(self.rt.clock(), self.connector.config.business_timezone)
        return {"name": spec.reconciliation.name, "due_by": due_by.isoformat(),
                "timezone": self.connector.config.business_timezone}

    def escalate(self, kind: str, details: Mapping[str, Any]) -> None:
        """Hold the case on the simulated intent for a person, with everything seen."""
        intent = self.summary.get("intent_id")
        if intent is not None:
            self.rt.ledger.append(self.case, "escalated", {"state": {"escalation": {
                "kind": kind, "by": "executor", "classification": "partly_applied",
                "simulation_id": self.sid, "rule": "simulation: " + kind.replace("_", " "),
                **details}}}, intent_id=str(intent))
        self.record("simulation_escalated", ESCALATED, {"escalation": kind, **details})

    # -- the steps in order, from wherever the simulation is

    def run(self) -> SimulationReport:
        step = self.summary["step"]
        if step == PLANNED:
            self.capture()
            step = BASELINE
        if step == BASELINE:
            self.execute()
            step = EXECUTED
        if step == EXECUTED:
            self._load_outcome()
            if self.summary.get("outcome") in (oc.ROLLED_BACK,):
                self.verify()
                return self.report()
            if self.summary.get("outcome") not in (oc.APPLIED, oc.COMPENSATED):
                self.escalate("unexpected_outcome", {"outcome": self.summary.get("outcome")})
                return self.report()
            self.observe()
            step = OBSERVED
        if step == OBSERVED:
            self._load_outcome()
            if not self.tear_down():
                self.escalate("teardown_failed", {
                    "teardown_intent_id": self.summary.get("teardown_intent_id")})
                return self.report()
            step = TORN_DOWN
        if step == TORN_DOWN:
            self.verify()
        return self.report()

    def _load_outcome(self) -> None:
        if self.outcome is not None:
            return
        intent = str(self.summary.get("intent_id"))
        record = self.rt.ledger.intent(self.case, intent).get("outcome_record")
        if not isinstance(record, Mapping):
            raise SimulationStateConflict(
                f"the execute step of simulation {self.sid} (intent {intent}) has no recorded "
                f"outcome; run `capgate resume {self.case}` first", simulation_id=self.sid)
        self.outcome = Outcome.from_dict(record)


def _recorded_baseline(rt: Runtime, case: str, simulation_id: str) -> dict[str, Any]:
    for event in reversed(rt.ledger.events(case)):
        if event.kind == "simulation_baseline" and \
                event.payload.get("simulation_id") == simulation_id:
            baseline = event.payload.get("baseline")
            if isinstance(baseline, dict):
                return baseline
    raise SimulationStateConflict(f"simulation {simulation_id} has no recorded baseline",
                                  simulation_id=simulation_id)


def _open_intents(rt: Runtime, case: str) -> list[str]:
    snapshot = rt.ledger.verified_snapshot(case) or {}
    return sorted(i for i, s in (snapshot.get("intents") or {}).items()
                  if s.get("status") not in TERMINAL)


def _gate(rt: Runtime, plan: Plan, connector: Connector, who: str, simulation_id: str
          ) -> dict[str, Any] | None:
    """Staging and prod: one signed, unused approval of the simulation's plan, consumed now."""
    body = plan.body
    if body["kind"] not in gates.SIMULATION_GATES:
        return None
    what, roles = gates.simulation_gate_roles(rt, body)
    rt.ledger.record_plan(plan.plan_hash, str(body["case"]), who, plan.to_dict())
    details = {"plan_hash": plan.plan_hash, "plan": plan.to_dict(),
               "approver_roles": list(roles), "four_eyes": True}
    if not roles:
        raise ApprovalRequired(f"{what} is gated and the connector names no approver roles "
                               f"({gates.SIMULATION_GATES[body['kind']]}): nobody can approve "
                               "it", **details)
    environment = connector.environment
    try:
        approval = rt.ledger.consume_approval(
            plan.plan_hash, f"simulation:{simulation_id}", now=rt.clock(),
            exclude_approver=who,
            accept=lambda a: rt.grants.approval_problem(a, roles, environment))
    except (ApprovalRequired, UnknownPlan):
        raise ApprovalRequired(
            f"{what} is gated: approve plan {plan.plan_hash} with `capgate approve "
            f"{plan.plan_hash} --by WHO --role {'|'.join(roles)} --key FILE` (not {who!r}), "
            "then simulate again", **details) from None
    return {"plan_hash": plan.plan_hash, "approval_id": approval.approval_id,
            "approver": approval.approver, "role": approval.role}


def _precheck_row_gate(rt: Runtime, row: Row, connector: Connector, inputs: Mapping[str, Any],
                       case: str, who: str, simulation_id: str) -> None:
    """A gated row's approval must exist before the simulation records its first step.

    The check sees the execute step's own key (a simulation's, so the plan an
    approver finds is not shown as a promotion).
    """
    if row.authorization.kind is not AuthKind.GATE:
        return
    plan = render(row, inputs, connector.name, connector.environment, case=case, requester=who)
    key = idempotency_key(row, inputs, case)
    ctx = CallContext(row, inputs, case, who, connector, "simulation-precheck",
                      f"{key}{IDEM_MARK}{simulation_id}" if key is not None else None,
                      fingerprint(row, inputs, connector.name, connector.environment), plan)
    gates.check_approval(rt, ctx)


def simulate(executor: Executor, operation_id: str, inputs: Mapping[str, Any], *, case: str,
             who: str, version: int | None = None, venue: str | None = None,
             customer_informed: Mapping[str, str] | None = None,
             data_dependency: str | None = None, dry_run: bool = False) -> SimulationReport:
    """Run the whole cycle (or, with ``dry_run``, only plan it: no DML, nothing recorded).

    Refusals before anything is recorded: the row's contract and grants, a row
    that cannot be torn down (CG603), a read or DDL row, staging without the
    customer-informed record (CG605), a production simulation missing one of
    its five conditions (CG606), a missing approval of the simulation's gate
    (staging, prod) or of a gated row (CG201), an unresolved intent in the case
    (CG400).
    """
    rt = executor.rt
    check_names(case, who)
    row, connector = executor.resolve(operation_id, version, venue)
    inputs, _ = validated_inputs(row, inputs, executor.max_request_bytes)
    rt.grants.check_call(who, row, connector.name, connector.environment)
    if not row.is_write:
        raise SimulationVenueRefused(f"{row.ref} is a read: it changes nothing to simulate",
                                     operation_id=row.operation_id)
    if row.effect_class is EffectClass.DDL:
        raise DdlError(f"{row.ref} changes stored code: the DDL loop captures, applies, "
                       "verifies and compensates it (`capgate ddl plan`)",
                       operation_id=row.operation_id)
    teardown = derive(row)
    environment = connector.environment
    if environment == "staging" and not (customer_informed and customer_informed.get("who")
                                         and customer_informed.get("when")):
        raise CustomerNotInformed(
            f"a simulation on {connector.name!r} (staging) is visible to the customer: say who "
            "informed them and when (--customer-informed 'WHO at WHEN'); nothing ran",
            connector=connector.name)
    plan = simulation_plan(rt, row, connector, inputs, case, who, teardown=teardown,
                           customer_informed=customer_informed,
                           data_dependency=data_dependency)
    if plan.body["kind"] == "production_simulation":
        found = conditions(row, inputs, (rt.ledger.snapshot(case) or {}).get("case") or {},
                           data_dependency)
        roles = connector.config.production_simulation_approver_roles
        held = [r for r in roles if rt.grants.principal(who).holds(r, environment)]
        refuse_unless_all_hold(row, connector, who, held, found)
    if dry_run:
        return SimulationReport(None, "planned", plan.to_dict())
    opened = _open_intents(rt, case)
    if opened:
        raise ReconciliationRequired(
            f"case {case!r} has {len(opened)} unresolved intent(s); run `capgate resume "
            f"{case}` first", case=case, intents=opened)
    simulation_id = uuid.uuid4().hex[:16]
    _precheck_row_gate(rt, row, connector, inputs, case, who, simulation_id)
    approval = _gate(rt, plan, connector, who, simulation_id)
    summary: dict[str, Any] = {
        "simulation_id": simulation_id, "kind": plan.body["kind"],
        "operation_id": row.operation_id, "version": row.version, "row_hash": row.row_hash,
        "input_shape": input_shape(inputs), "connector": connector.name,
        "environment": environment, "who": who, "inputs": inputs,
        "plan_hash": plan.plan_hash, "started_at": rt.clock().isoformat(), "step": PLANNED}
    if customer_informed is not None:
        summary["customer_informed"] = dict(customer_informed)
    if approval is not None:
        summary["approval"] = approval
    cycle = _Cycle(executor, row, connector, inputs, case, who, plan, teardown, summary)
    cycle.record("simulation_planned", PLANNED, {"plan": plan.to_dict()},
                 guard=_one_at_a_time(case))
    return cycle.run()


def _one_at_a_time(case: str) -> Guard:
    """The first step's guard, inside its append: no other simulation of the case is still
    in progress (its write may still be in the target) and no intent is open."""
    def guard(state: Mapping[str, Any] | None) -> None:
        if state is None:
            return
        running = in_progress(state.get("case") or {})
        if running:
            other = running[0]
            raise SimulationStateConflict(
                f"simulation {other.get('simulation_id')} of {other.get('operation_id')} is "
                f"still at step {other.get('step')} in case {case!r}: continue it (`capgate "
                f"simulate --continue {other.get('simulation_id')} --case {case}`) or abandon "
                "it before starting another; nothing was recorded",
                simulation_id=other.get("simulation_id"), step=other.get("step"), case=case)
        boundaries.case_guard(case, None)(state)
    return guard


def abandon_simulation(executor: Executor, case: str, simulation_id: str, *,
                       who: str) -> SimulationReport:
    """End a simulation that never wrote (still planned, or at its baseline, with no execute
    step in the ledger); one that executed is continued, never abandoned."""
    rt = executor.rt
    cycle = _load(executor, case, simulation_id, who)
    step = cycle.summary.get("step")
    key = idempotency_key(cycle.row, cycle.inputs, case)
    executed = key is not None and rt.ledger.get_idempotency(
        f"{key}{IDEM_MARK}{simulation_id}") is not None
    if step not in (PLANNED, BASELINE) or executed:
        raise SimulationStateConflict(
            f"simulation {simulation_id} {'executed' if executed else f'is at step {step}'}: "
            "what it wrote must be torn down -- continue it (`capgate simulate --continue`), "
            "never abandon it", simulation_id=simulation_id, step=step)
    cycle.record("simulation_abandoned", "abandoned", {"by": who})
    return cycle.report()


def continue_simulation(executor: Executor, case: str, simulation_id: str, *,
                        who: str) -> SimulationReport:
    """Pick a simulation up at its first unrecorded step (after a crash, a refusal...).

    An intent the interruption left open is settled by ``capgate resume`` first
    (ReconciliationRequired): what it wrote is known from evidence, never guessed.
    """
    cycle = _load(executor, case, simulation_id, who)
    opened = _open_intents(executor.rt, case)
    if opened:
        raise ReconciliationRequired(
            f"case {case!r} has {len(opened)} unresolved intent(s); run `capgate resume "
            f"{case}` before continuing simulation {simulation_id}", case=case, intents=opened)
    return cycle.run()


def _load(executor: Executor, case: str, simulation_id: str, who: str) -> _Cycle:
    """The recorded simulation, ready to take its next step."""
    rt = executor.rt
    snapshot = rt.ledger.verified_snapshot(case) or {}
    summary = (snapshot.get("case") or {}).get(simulation_key(simulation_id))
    if not isinstance(summary, Mapping):
        known = [s.get("simulation_id") for s in summaries(snapshot.get("case") or {})]
        raise SimulationNotFound(f"case {case!r} has no simulation {simulation_id!r} "
                                 f"(simulations: {', '.join(map(str, known)) or 'none'})",
                                 case=case, simulation_id=simulation_id)
    if summary.get("step") in FINAL_STEPS:
        raise SimulationStateConflict(
            f"simulation {simulation_id} already ended {summary.get('step')}; nothing to "
            "continue", simulation_id=simulation_id, step=summary.get("step"))
    if summary.get("who") != who:
        raise UsageError(f"simulation {simulation_id} was started by {summary.get('who')!r}; "
                         f"only they continue it, not {who!r}", simulation_id=simulation_id)
    row = rt.registry.resolve(str(summary["operation_id"]), int(summary["version"]))
    if row.row_hash != summary.get("row_hash"):
        raise SimulationStateConflict(
            f"{row.ref} changed since simulation {simulation_id} began (hash "
            f"{summary.get('row_hash')} -> {row.row_hash}); it is not continued",
            simulation_id=simulation_id)
    connector = rt.connectors.get(str(summary["connector"]))
    inputs = dict(summary.get("inputs") or {})
    teardown = derive(row)
    plan = simulation_plan(rt, row, connector, inputs, case, who, teardown=teardown,
                           customer_informed=summary.get("customer_informed"),
                           data_dependency=None)
    plan = Plan(str(summary.get("plan_hash")), plan.body)  # the hash it was approved by
    return _Cycle(executor, row, connector, inputs, case, who, plan, teardown, dict(summary))
