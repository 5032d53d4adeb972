"""The five-point exemption test (issue 16, seed 001 §5): applied, recorded, and strict.

``note.correct`` passes all five -- one note with an exact count, one
environment, a written compensation, no downstream consumer, nothing the
customer sees -- so it is written on prod without a simulation, and the claim
is recorded in the case and shown in the plan.  Each variant below breaks
exactly one point: the promotion is refused naming that point, and once the
variant is simulated on qa (where it can be) the same call goes through.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import URL

from capgate.executor import outcome as oc
from capgate.executor.call import Executor
from capgate.executor.simulation.cycle import simulate
from capgate.registry import errors as serr
from tests.fix_capgate import CAPABILITIES
from tests.sim_support import registry_with, venues

__all__ = ["venues"]  # the fixture

NOTE = {"note_id": 1, "old_body": "Customer asked for a quarterly schedule.",
        "body": "Customer asked for a quarterly payment schedule."}


def _base_row() -> dict[str, Any]:
    rows = yaml.safe_load((CAPABILITIES / "policies.yaml").read_text("utf-8"))["rows"]
    (row,) = [r for r in rows if r["operation_id"] == "note.correct"]
    return {**row, "operation_id": "note.fix", "version": 1}


def _no_keys(r: dict[str, Any]) -> None:
    r["target"] = {"system": "insurance", "object": "policy_note"}
    r["simulation"]["baseline"] = [{"name": "note", "sql": "SELECT * FROM policy_note "
                                                           "WHERE note_id = :note_id"}]


def _range(r: dict[str, Any]) -> None:
    r["statements"][0]["expect_rows"] = {"min": 0, "max": 1}


def _no_teardown(r: dict[str, Any]) -> None:
    r["effect_class"] = "transactional"
    for key in ("compensation", "compensation_verify"):
        r.pop(key)


def _consumer(r: dict[str, Any]) -> None:
    r["simulation"]["exemption"]["no_downstream_consumer"] = {
        "holds": False, "because": "the nightly export reads every note"}


def _undeclared(r: dict[str, Any]) -> None:
    del r["simulation"]["exemption"]["no_downstream_consumer"]


def _visible_effect(r: dict[str, Any]) -> None:
    r["expected_effects"] = [{"name": "note_mail", "class": "document",
                              "description": "a corrected note is mailed to the holder",
                              "unobservable": "the mail leaves through another system"}]


def _visible_declared(r: dict[str, Any]) -> None:
    r["simulation"]["exemption"]["no_customer_visible_effect"] = {
        "holds": False, "because": "the holder's portal shows notes"}


VARIANTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "no_target_key": (_no_keys, "single_object"),
    "count_not_asserted": (_range, "single_object"),
    "no_written_teardown": (_no_teardown, "written_teardown"),
    "downstream_consumer": (_consumer, "no_downstream_consumer"),
    "consumer_not_declared": (_undeclared, "no_downstream_consumer"),
    "customer_visible_effect": (_visible_effect, "no_customer_visible_effect"),
    "customer_visible_declared": (_visible_declared, "no_customer_visible_effect"),
}


def _file(row: dict[str, Any]) -> str:
    return yaml.safe_dump({"format": 1, "connectors": {"insurance": {"description": "x"}},
                           "rows": [row]}, sort_keys=False)


@pytest.fixture
def pair(target_url: URL, tmp_path: Path,
         venues: Callable[..., Executor]) -> Callable[[str], tuple[Executor, Executor]]:
    def make(extra: str) -> tuple[Executor, Executor]:
        reg = registry_with(tmp_path, extra)
        ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
        qa = venues(f"sqlite:///{tmp_path / 'qa.db'}", ledger, "qa", registry=reg)
        prod = venues(target_url, ledger, "prod", registry=reg)
        return qa, prod
    return make


def test_a_change_that_passes_all_five_points_skips_simulation_as_a_recorded_claim(
        pair: Callable[[str], tuple[Executor, Executor]]) -> None:
    _, prod = pair(_file(_base_row()))
    plan = prod.plan("note.fix", NOTE, case="EX-1", who="agent")
    exemption = plan.body["promotion"]["exemption"]
    assert exemption["exempt"] is True and [p["holds"] for p in exemption["points"]] == [True] * 5
    assert [p["how"] for p in exemption["points"]] == [
        "computed", "computed", "computed", "declared", "computed+declared"]
    out = prod.call("note.fix", NOTE, case="EX-1", who="agent")
    assert out.status == oc.APPLIED
    (claim,) = [e for e in prod.ledger.events("EX-1") if e.kind == "exemption_claimed"]
    assert claim.payload["plan_hash"] == plan.plan_hash
    assert all(p["holds"] for p in claim.payload["case_state"][
        f"exemption:{plan.plan_hash}"]["points"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_failing_any_one_point_forces_simulation(
        pair: Callable[[str], tuple[Executor, Executor]], variant: str) -> None:
    change, point = VARIANTS[variant]
    row = _base_row()
    change(row)
    qa, prod = pair(_file(row))
    case = f"EX-{variant}"
    with pytest.raises(serr.PromotionRefused) as info:
        prod.call("note.fix", NOTE, case=case, who="agent")
    failed = [p["name"] for p in info.value.details["exemption"]["points"] if not p["holds"]]
    assert failed == [point], info.value.details["exemption"]
    assert prod.ledger.snapshot(case) is None, "nothing was recorded"
    if point == "written_teardown":  # nothing can take it back out: it cannot be simulated
        with pytest.raises(serr.TeardownUnderivable):
            simulate(qa, "note.fix", NOTE, case=case, who="agent")
        return
    assert simulate(qa, "note.fix", NOTE, case=case, who="agent").status == "restored"
    assert prod.call("note.fix", NOTE, case=case, who="agent").status == oc.APPLIED


def test_a_change_written_in_two_environments_is_not_exempt(
        pair: Callable[[str], tuple[Executor, Executor]]) -> None:
    """Point 2, computed from the case: the same operation already written on qa."""
    qa, prod = pair(_file(_base_row()))
    other = {**NOTE, "note_id": 2, "old_body": "Lapse letter sent.", "body": "Lapse letter "
             "sent twice."}
    assert qa.call("note.fix", other, case="EX-2", who="agent").status == oc.APPLIED
    with pytest.raises(serr.PromotionRefused) as info:
        prod.call("note.fix", NOTE, case="EX-2", who="agent")
    failed = [p for p in info.value.details["exemption"]["points"] if not p["holds"]]
    assert [p["name"] for p in failed] == ["single_environment"]
    assert "qa" in failed[0]["why"]
