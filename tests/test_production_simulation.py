"""Production simulation (issue 16, seed 001 §5, D42): a distinct gate, five conditions.

On prod a simulation runs only when all five conditions hold and are recorded
in its plan; each variant below breaks one, and is refused (CG606) with
nothing recorded and nothing sent.  Its gate is its own kind, approved by a
holder of one of two configured roles who is never the requester.  Once it
ran, its reconciliation query is due the same business day: ``due`` lists it,
``reconcile`` runs and records it, and a late one is marked late.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.simulation.cycle import simulate
from capgate.executor.simulation.production import due, end_of_business_day, reconcile
from capgate.registry import errors
from capgate.registry import errors as serr
from tests.fix_capgate import CAPABILITIES, approver_key
from tests.sim_support import NEW_CLAIM, dump, recording, registry_with, venues

__all__ = ["venues"]  # the fixture

ROLES = ("support_lead", "system_owner")
WHY = "the claim's fraud score exists only on production data"


def _claim_open() -> dict[str, Any]:
    rows = yaml.safe_load((CAPABILITIES / "policies.yaml").read_text("utf-8"))["rows"]
    (row,) = [r for r in rows if r["operation_id"] == "claim.open"]
    return {**row, "operation_id": "claim.trial", "version": 1}


def _document(r: dict[str, Any]) -> None:
    r["expected_effects"].append({"name": "acknowledgement", "class": "document",
                                  "description": "an acknowledgement letter is generated",
                                  "unobservable": "letters are rendered by another system"})


def _no_key(r: dict[str, Any]) -> None:
    r["target"] = {"system": "insurance", "object": "claim"}
    r["simulation"]["baseline"] = [{"name": "claims_of_policy", "sql":
                                    "SELECT * FROM claim WHERE policy_id = :policy_id"}]


def _no_pre_state(r: dict[str, Any]) -> None:
    r["simulation"]["target_baseline"] = False


def _no_reconciliation(r: dict[str, Any]) -> None:
    del r["simulation"]["reconciliation"]


VARIANTS: dict[str, tuple[Callable[[dict[str, Any]], None] | None, str | None, str]] = {
    # name: (change to the row, data-dependency argument, the condition that fails)
    "no_off_production_argument": (None, None, "evidence_off_production_impossible"),
    "not_transactional": (_document, WHY, "transactional_or_compensable"),
    "blast_radius_not_one_key": (_no_key, WHY, "blast_radius_one_key"),
    "no_pre_state": (_no_pre_state, WHY, "pre_state_captured_first"),
    "no_reconciliation": (_no_reconciliation, WHY, "reconciliation_same_day"),
}


def _file(row: dict[str, Any]) -> str:
    return yaml.safe_dump({"format": 1, "connectors": {"insurance": {"description": "x"}},
                           "rows": [row]}, sort_keys=False)


@pytest.fixture
def prod_of(target_url: URL, tmp_path: Path,
            venues: Callable[..., Executor]) -> Callable[..., Executor]:
    made: list[Executor] = []

    def make(extra: str | None = None, **opts: Any) -> Executor:
        opts.setdefault("production_simulation_approver_roles", ROLES)
        opts.setdefault("business_timezone", "Europe/Sofia")
        reg = registry_with(tmp_path, extra) if extra else None
        ex = venues(target_url, f"sqlite:///{tmp_path / 'ledger.db'}", "prod",
                    registry=reg, schema=not made, **opts)
        made.append(ex)
        return ex
    return make


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_production_simulation_missing_any_condition_is_refused(
        prod_of: Callable[..., Executor], target_url: URL, variant: str) -> None:
    change, argument, condition = VARIANTS[variant]
    row = _claim_open()
    if change is not None:
        change(row)
    prod = prod_of(_file(row))
    before = dump(target_url)
    with recording(prod.connectors.get("insurance").engine) as seen, \
            pytest.raises(serr.ProductionSimulationRefused) as info:
        simulate(prod, "claim.trial", NEW_CLAIM, case="PS-1", who="agent",
                 data_dependency=argument)
    assert info.value.code == "CG606"
    assert info.value.details["failed"] == [condition], info.value.details["conditions"]
    assert seen.seen == [] and dump(target_url) == before
    assert prod.ledger.snapshot("PS-1") is None, "nothing was recorded"


def test_its_gate_needs_two_roles_and_never_the_requester(
        prod_of: Callable[..., Executor]) -> None:
    one_role = prod_of(production_simulation_approver_roles=("support_lead",))
    with pytest.raises(serr.ProductionSimulationRefused, match="two approver roles"):
        simulate(one_role, "claim.open", NEW_CLAIM, case="PS-2", who="agent",
                 data_dependency=WHY)
    prod = prod_of()
    with pytest.raises(serr.ProductionSimulationRefused, match="never one of its approvers"):
        simulate(prod, "claim.open", NEW_CLAIM, case="PS-2", who="carol", data_dependency=WHY)
    with pytest.raises(errors.ApprovalRequired) as need:
        simulate(prod, "claim.open", NEW_CLAIM, case="PS-2", who="agent", data_dependency=WHY)
    plan = need.value.details["plan"]
    assert plan["kind"] == "production_simulation"
    assert [c["holds"] for c in plan["production"]["conditions"]] == [True] * 5
    with pytest.raises(errors.ApproverLacksRole):  # an operator holds no approver role
        prod.approve(need.value.details["plan_hash"], by="alice", role="dba",
                     key=approver_key("alice"))
    assert prod.ledger.snapshot("PS-2") is None or not [
        k for k in (prod.ledger.snapshot("PS-2") or {}).get("case", {})
        if k.startswith("simulation:")]


def test_an_approved_production_simulation_runs_and_is_reconciled_the_same_day(
        prod_of: Callable[..., Executor], target_url: URL, tmp_path: Path,
        venues: Callable[..., Executor]) -> None:
    prod = prod_of()
    # condition 1 by a recorded lower-venue attempt this time: a simulation on qa
    qa = venues(f"sqlite:///{tmp_path / 'qa.db'}", f"sqlite:///{tmp_path / 'ledger.db'}",
                "qa")
    assert simulate(qa, "claim.open", NEW_CLAIM, case="PS-3", who="agent").status == "restored"
    with pytest.raises(errors.ApprovalRequired) as need:
        simulate(prod, "claim.open", NEW_CLAIM, case="PS-3", who="agent")
    first = need.value.details["plan"]["production"]["conditions"][0]
    assert first["holds"] and "recorded lower-venue attempt" in first["why"]
    prod.approve(need.value.details["plan_hash"], by="carol", role="support_lead",
                 key=approver_key("carol"))
    before = dump(target_url)
    report = simulate(prod, "claim.open", NEW_CLAIM, case="PS-3", who="agent")
    assert report.status == "restored" and dump(target_url) == before
    assert report.summary["approval"]["approver"] == "carol"
    # the pre-state was evidence before the first write
    order = [s["event"] for s in report.steps]
    assert order.index("simulation_baseline") < order.index("simulation_executed")
    (listed,) = due(prod.rt)
    assert listed["state"] == "due" and listed["reconciliation"] == "no_claim_left_behind"
    expected_end = end_of_business_day(prod.clock(), "Europe/Sofia")
    assert listed["due_by"] == expected_end.isoformat()
    record = reconcile(prod.rt, "PS-3", report.simulation_id or "", "carol")
    assert record["ok"] and record["on_time"]
    assert due(prod.rt) == []


def test_a_reconciliation_after_the_business_day_is_overdue_and_recorded_late(
        prod_of: Callable[..., Executor]) -> None:
    prod = prod_of()
    with pytest.raises(errors.ApprovalRequired) as need:
        simulate(prod, "claim.open", NEW_CLAIM, case="PS-4", who="agent", data_dependency=WHY)
    prod.approve(need.value.details["plan_hash"], by="dave", role="system_owner",
                 key=approver_key("dave"))
    report = simulate(prod, "claim.open", NEW_CLAIM, case="PS-4", who="agent",
                      data_dependency=WHY)
    assert report.status == "restored"
    tomorrow = dt.datetime.now(dt.UTC) + dt.timedelta(days=1, hours=1)
    prod.clock = lambda: tomorrow
    (listed,) = due(prod.rt)
    assert listed["state"] == "overdue"
    record = reconcile(prod.rt, "PS-4", report.simulation_id or "", "dave")
    assert record["ok"] and not record["on_time"]
    with pytest.raises(serr.SimulationNotFound):
        reconcile(prod.rt, "PS-4", "nope", "dave")
