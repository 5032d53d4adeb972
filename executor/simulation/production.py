"""Production simulation (seed 001 §5, D42): five conditions, its own gate, same-day reconciliation.

A simulation on prod is allowed only when all five hold, each recorded in its
plan with how it was established:

1. the evidence cannot be obtained off production -- a recorded attempt on a
   lower venue in the case (a simulation of the operation there, whatever its
   outcome), or a written data-dependency argument given with the request;
2. every step is transactional, or compensable with its compensation already
   written -- and no expected effect escapes both (a document, a message, a
   call-out);
3. the blast radius is one key value -- the target names its keys and each is
   bound to one value (one policy, one account, one product version);
4. the pre-state is captured as evidence before the first write -- the cycle
   reads and records the baseline before it executes, and the row must have
   one to read;
5. reconciliation is verified the same business day with a query named on the
   row (``simulation.reconciliation``): ``capgate reconcile`` runs and records
   it, and lists what is due or overdue.

Its gate is a distinct kind (``production_simulation``): approved by a holder
of one of the connector's ``production_simulation_approver_roles`` -- two roles
must be configured -- who is not the requester; a requester who holds one of
those roles is refused outright (four eyes by role configuration).
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from capgate.executor.connectors import Connector, venue_rank
from capgate.executor.dialects import SessionTag
from capgate.executor.expectations import evaluate
from capgate.executor.outcome import jsonable
from capgate.executor.plan import binds_for
from capgate.executor.runtime import Runtime
from capgate.executor.simulation.baseline import baseline_queries
from capgate.executor.simulation.records import record_step, summaries
from capgate.registry.errors import (
    ProductionSimulationRefused,
    ReconciliationUndeclared,
    SimulationNotFound,
)
from capgate.registry.model import CUSTOMER_FACING_EFFECTS, EffectClass, Row

__all__ = ["Condition", "conditions", "due", "end_of_business_day", "reconcile",
           "refuse_unless_all_hold"]


@dataclass(frozen=True)
class Condition:
    number: int
    name: str
    holds: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"condition": self.number, "name": self.name, "holds": self.holds,
                "why": self.why}


def _off_production(row: Row, case_state: Mapping[str, Any],
                    data_dependency: str | None) -> Condition:
    attempts = [s for s in summaries(case_state)
                if s.get("operation_id") == row.operation_id
                and str(s.get("environment")) in ("rig", "dev", "qa", "staging")
                and venue_rank(str(s.get("environment"))) < venue_rank("prod")]
    if attempts:
        last = attempts[-1]
        return Condition(1, "evidence_off_production_impossible", True,
                         f"recorded lower-venue attempt: simulation {last.get('simulation_id')} "
                         f"on {last.get('environment')} ended {last.get('step')}")
    if data_dependency and data_dependency.strip():
        return Condition(1, "evidence_off_production_impossible", True,
                         f"data-dependency argument: {data_dependency.strip()}")
    return Condition(1, "evidence_off_production_impossible", False,
                     "no attempt on a lower venue is recorded in the case and no "
                     "data-dependency argument was given (--data-dependency TEXT)")


def _transactional(row: Row) -> Condition:
    escaping = [e.name for e in row.expected_effects if e.effect_class in CUSTOMER_FACING_EFFECTS]
    if row.effect_class is EffectClass.TRANSACTIONAL and not escaping:
        return Condition(2, "transactional_or_compensable", True, "every step is transactional")
    if row.effect_class is EffectClass.COMPENSABLE and row.compensation and not escaping:
        return Condition(2, "transactional_or_compensable", True,
                         f"compensable, compensation written ({len(row.compensation)} "
                         "statement(s))")
    if escaping:
        why = f"expected effect(s) {', '.join(escaping)} escape the transaction"
    else:
        why = f"the row is {row.effect_class}, neither transactional nor compensable"
    return Condition(2, "transactional_or_compensable", False, why)


def _blast_radius(row: Row, inputs: Mapping[str, Any]) -> Condition:
    keys = row.target.keys
    loose = [k for k in keys if inputs.get(k) is None or isinstance(inputs.get(k), dict | list)]
    if not keys:
        return Condition(3, "blast_radius_one_key", False, "the target names no key")
    if loose:
        return Condition(3, "blast_radius_one_key", False,
                         f"target key(s) {', '.join(loose)} are not one value each")
    return Condition(3, "blast_radius_one_key", True,
                     f"one {row.target.object}: "
                     + ", ".join(f"{k}={inputs.get(k)!s}" for k in keys))


def _pre_state(row: Row, inputs: Mapping[str, Any]) -> Condition:
    queries = baseline_queries(row, inputs)
    if not queries:
        return Condition(4, "pre_state_captured_first", False,
                         "the row has no baseline to capture (no target rows, no "
                         "simulation.baseline)")
    return Condition(4, "pre_state_captured_first", True,
                     f"{len(queries)} baseline quer{'y' if len(queries) == 1 else 'ies'} read "
                     "and recorded before the first write: " + ", ".join(n for n, _ in queries))


def _reconciliation(row: Row) -> Condition:
    query = row.simulation.reconciliation if row.simulation else None
    if query is None:
        return Condition(5, "reconciliation_same_day", False,
                         "the row names no reconciliation query (simulation.reconciliation)")
    return Condition(5, "reconciliation_same_day", True,
                     f"reconciliation query {query.name!r}, due the same business day")


def conditions(row: Row, inputs: Mapping[str, Any], case_state: Mapping[str, Any],
               data_dependency: str | None) -> list[Condition]:
    """The five conditions for this request, each with how it holds or why not."""
    return [_off_production(row, case_state, data_dependency), _transactional(row),
            _blast_radius(row, inputs), _pre_state(row, inputs), _reconciliation(row)]


def refuse_unless_all_hold(row: Row, connector: Connector, who: str, holder_roles: list[str],
                           found: list[Condition]) -> None:
    """ProductionSimulationRefused naming every failed condition, or the gate's roles."""
    failed = [c for c in found if not c.holds]
    roles = connector.config.production_simulation_approver_roles
    details = {"operation_id": row.operation_id, "connector": connector.name,
               "conditions": [c.to_dict() for c in found]}
    if failed:
        raise ProductionSimulationRefused(
            f"a production simulation of {row.ref} on {connector.name!r} is refused: "
            + "; ".join(f"({c.number}) {c.name}: {c.why}" for c in failed)
            + "; nothing ran", failed=[c.name for c in failed], **details)
    if len(set(roles)) < 2:
        raise ProductionSimulationRefused(
            f"a production simulation on {connector.name!r} needs two approver roles "
            f"(production_simulation_approver_roles names {list(roles) or 'none'}); nothing "
            "ran", failed=["approver_roles"], **details)
    if holder_roles:
        raise ProductionSimulationRefused(
            f"{who!r} holds {', '.join(holder_roles)}, a role that approves production "
            "simulations: the requester is never one of its approvers; nothing ran",
            failed=["requester_holds_approver_role"], **details)


def end_of_business_day(moment: dt.datetime, timezone: str) -> dt.datetime:
    """The last instant of ``moment``'s day in ``timezone``, as UTC."""
    zone = zoneinfo.ZoneInfo(timezone)
    local = moment.astimezone(zone)
    end = dt.datetime.combine(local.date(), dt.time(23, 59, 59), tzinfo=zone)
    return end.astimezone(dt.UTC)


def _find(rt: Runtime, case: str, simulation_id: str) -> dict[str, Any]:
    snapshot = rt.ledger.verified_snapshot(case) or {}
    for summary in summaries(snapshot.get("case") or {}):
        if summary.get("simulation_id") == simulation_id:
            return summary
    raise SimulationNotFound(f"case {case!r} has no simulation {simulation_id!r}",
                             case=case, simulation_id=simulation_id)


def reconcile(rt: Runtime, case: str, simulation_id: str, who: str) -> dict[str, Any]:
    """Run the simulation's named reconciliation query (read-only) and record its result."""
    summary = _find(rt, case, simulation_id)
    row = rt.registry.resolve(str(summary["operation_id"]), int(summary["version"]))
    query = row.simulation.reconciliation if row.simulation else None
    if query is None:
        raise ReconciliationUndeclared(f"{row.ref} names no reconciliation query",
                                       operation_id=row.operation_id)
    connector = rt.connectors.get(str(summary["connector"]))
    inputs = dict(summary.get("inputs") or {})
    tag = SessionTag(case, "capgate.reconcile", simulation_id)
    dialect = connector.dialect
    with rt.connect(connector) as conn:
        try:
            dialect.begin_read(conn, tag, row.timeout.seconds)
            rows = conn.execute(sa.text(dialect.sql(query.sql, tag)),
                                binds_for(query.sql, inputs)).fetchmany(1001)
        finally:
            conn.rollback()
            dialect.end_read(conn)
    result = evaluate(query.name, query.expect, rows).to_dict()
    now = rt.clock()
    due_by = summary.get("reconciliation", {}).get("due_by")
    on_time = due_by is None or now <= dt.datetime.fromisoformat(str(due_by))
    record = {**(summary.get("reconciliation") or {}), "name": query.name,
              "recorded_at": now.isoformat(), "by": who, "ok": bool(result["ok"]),
              "on_time": on_time, "result": jsonable(result)}
    summary = {**summary, "reconciliation": record}
    record_step(rt.ledger, case, "reconciliation_recorded", summary,
                {"by": who, "reconciliation": record})
    return record


def due(rt: Runtime, *, case: str | None = None) -> list[dict[str, Any]]:
    """Production simulations whose reconciliation is not recorded: ``due`` or ``overdue``."""
    cases = [case] if case is not None else [c.case_id for c in rt.ledger.cases()]
    now = rt.clock()
    out: list[dict[str, Any]] = []
    for case_id, snapshot in rt.ledger.snapshots(cases).items():
        for summary in summaries(snapshot.get("case") or {}):
            rec = summary.get("reconciliation")
            if summary.get("kind") != "production_simulation" or not isinstance(rec, Mapping) \
                    or rec.get("recorded_at"):
                continue
            due_by = dt.datetime.fromisoformat(str(rec["due_by"]))
            out.append({"case": case_id, "simulation_id": summary["simulation_id"],
                        "operation_id": summary.get("operation_id"),
                        "reconciliation": rec.get("name"), "due_by": rec["due_by"],
                        "state": "overdue" if now > due_by else "due"})
    return sorted(out, key=lambda d: (d["due_by"], d["case"]))
