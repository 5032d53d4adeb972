"""Stored code is simulated before prod, as data writes are.

Before: a prod view or function change passed with an approval only.  Now a DDL plan on a
promotion venue (staging, prod) rests on the case's simulation of the same source (same
hash) on a lower venue -- applied, verified and compensated there by ``capgate ddl
simulate`` -- or on the five-point exemption test, and the plan names the stage and the
evidence; without either it is refused (CG601) and the refusal recorded.

Two configurations share one ledger (qa and prod, each its own schema): the setup the
simulation docs walk through.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from capgate.handlers.ddl import _plan_text
from capgate.registry.errors import PromotionRefused, SimulationVenueRefused
from tests.ddl_support import (
    Rig,
    approve,
    assert_record_matches_catalog,
    events,
    execute,
    intent_of,
    row,
    scalar,
)
from tests.fix_db import ensure_plpgsql_check

PREMIUM = """CREATE OR REPLACE FUNCTION premium(x numeric) RETURNS numeric
LANGUAGE plpgsql AS $$
BEGIN
  RETURN x * 1.10;
END $$;
"""
NEW = PREMIUM.replace("1.10", "1.20")
SCHEMA = PREMIUM + """
CREATE TABLE pol (id int PRIMARY KEY, base numeric NOT NULL);
INSERT INTO pol VALUES (1, 100), (2, 200);
CREATE VIEW v_prem AS SELECT id, premium(base) AS p FROM pol;
CREATE FUNCTION lonely(x int) RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN x; END $$;
"""
EXEMPT = """    simulation:
      exemption:
        no_downstream_consumer: {holds: true, because: only the month-end job calls it}
        no_customer_visible_effect: {holds: true, because: an internal helper}
"""
ROWS = [row("code.premium", [("function", "premium")], environments="[qa, prod]"),
        row("code.lonely", [("function", "lonely")], environments="[qa, prod]", extra=EXEMPT)]


@pytest.fixture
def venues(pg_url: URL, pg_ledger_url: URL, tmp_path: Path) -> tuple[Rig, Rig, URL, URL]:
    qa_url, prod_url = pg_url, pg_ledger_url
    for url in (qa_url, prod_url):
        ensure_plpgsql_check(url)
        execute(url, SCHEMA)
    ledger = f"sqlite:///{tmp_path / 'shared-ledger.db'}"
    (tmp_path / "qa").mkdir()
    (tmp_path / "prod").mkdir()
    qa = Rig(tmp_path / "qa", {"code": (qa_url, "qa")}, ROWS, ledger=ledger)
    prod = Rig(tmp_path / "prod", {"code": (prod_url, "prod")}, ROWS, ledger=ledger)
    return qa, prod, qa_url, prod_url


def test_a_prod_change_without_a_simulation_is_refused_and_recorded(
        venues: tuple[Rig, Rig, URL, URL]) -> None:
    _, prod, _, prod_url = venues
    with prod.service() as svc:
        with pytest.raises(PromotionRefused) as exc:
            svc.plan("code.premium", [NEW], case="CHG-1", who="agent")
        assert exc.value.code == "CG601" and exc.value.details["missing"] == "no_evidence"
        points = {p["name"]: p["holds"] for p in exc.value.details["exemption"]["points"]}
        assert points["no_downstream_consumer"] is False  # a view uses it
        assert [p["code"] for k, p in events(svc.executor, "CHG-1") if k == "ddl.refused"] \
            == ["CG601"]
    assert scalar(prod_url, "SELECT premium(100)") == 110


def test_the_same_source_simulated_on_qa_is_what_prod_accepts(
        venues: tuple[Rig, Rig, URL, URL]) -> None:
    qa, prod, qa_url, prod_url = venues
    with qa.service() as svc:
        plan = svc.plan("code.premium", [NEW], case="CHG-2", who="agent")
        assert plan.bound["stage"]["promotes"] is False
        approve(svc, plan.plan_hash)
        result = svc.simulate(plan.plan_hash, case="CHG-2", who="agent")
        assert result["simulated"] is True, result
        assert result["applied"]["status"] == "applied_verified"
        assert result["compensated"]["outcome"] == "compensated"
        # a simulation is not a deployment: qa is as it was, and the record says so
        assert assert_record_matches_catalog(svc, "CHG-2", result["applied"]["intent_id"]) \
            == "compensated"
    assert scalar(qa_url, "SELECT premium(100)") == 110
    with prod.service() as svc:
        # another source is not what was simulated
        with pytest.raises(PromotionRefused) as exc:
            svc.plan("code.premium", [NEW.replace("1.20", "1.25")], case="CHG-2", who="agent")
        assert exc.value.details["missing"] == "other_source"
        plan = svc.plan("code.premium", [NEW], case="CHG-2", who="agent")
        stage = plan.bound["stage"]
        assert stage["promotes"] and stage["evidence"]["environment"] == "qa"
        assert stage["evidence"]["intent_id"] == result["applied"]["intent_id"]
        text = _plan_text(plan)
        assert "stage: prod (a promotion): rests on the simulation of the same source on qa" \
            in text, text
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="CHG-2", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        assert assert_record_matches_catalog(svc, "CHG-2", intent_of(
            svc, "CHG-2", plan.plan_hash)) == "applied_verified"
    assert scalar(prod_url, "SELECT premium(100)") == 120


def test_a_failed_simulation_is_no_evidence(venues: tuple[Rig, Rig, URL, URL]) -> None:
    qa, prod, qa_url, _ = venues
    broken = PREMIUM.replace("RETURN x * 1.10;", "RETURN x * missing_rate;")
    with qa.service() as svc:
        plan = svc.plan("code.premium", [broken], case="CHG-3", who="agent")
        approve(svc, plan.plan_hash)
        result = svc.simulate(plan.plan_hash, case="CHG-3", who="agent")
        assert result["simulated"] is False and result["applied"]["status"] == "rolled_back"
    with prod.service() as svc, pytest.raises(PromotionRefused):
        svc.plan("code.premium", [broken], case="CHG-3", who="agent")
    assert scalar(qa_url, "SELECT premium(100)") == 110


def test_a_simulation_on_prod_is_refused(venues: tuple[Rig, Rig, URL, URL]) -> None:
    _, prod, _, prod_url = venues
    lonely = "CREATE OR REPLACE FUNCTION lonely(x int) RETURNS int LANGUAGE plpgsql AS $$ " \
             "BEGIN RETURN x + 1; END $$"
    with prod.service() as svc:
        plan = svc.plan("code.lonely", [lonely], case="CHG-4", who="agent")
        approve(svc, plan.plan_hash)
        with pytest.raises(SimulationVenueRefused):
            svc.simulate(plan.plan_hash, case="CHG-4", who="agent")
    assert scalar(prod_url, "SELECT lonely(1)") == 1


def test_an_exempt_change_is_applied_with_its_exemption_recorded(
        venues: tuple[Rig, Rig, URL, URL]) -> None:
    _, prod, _, prod_url = venues
    lonely = "CREATE OR REPLACE FUNCTION lonely(x int) RETURNS int LANGUAGE plpgsql AS $$ " \
             "BEGIN RETURN x + 1; END $$"
    with prod.service() as svc:
        plan = svc.plan("code.lonely", [lonely], case="CHG-5", who="agent")
        stage = plan.bound["stage"]
        assert stage["promotes"] and stage["exemption"]["exempt"] is True, stage
        assert "exempt by the five-point test" in _plan_text(plan)
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="CHG-5", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        claimed = [p for k, p in events(svc.executor, "CHG-5") if k == "exemption_claimed"]
        assert len(claimed) == 1 and claimed[0]["plan_hash"] == plan.plan_hash
    assert scalar(prod_url, "SELECT lonely(1)") == 2
