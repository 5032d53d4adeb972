"""Promotion is bound to evidence (issue 16, seed 001 §5), on SQLite, PostgreSQL and MariaDB.

Two venues of the logical connector ``insurance``, each its own database, one
configuration each, one shared ledger (the deployment the issue requires to
work): a simulation on qa is the evidence a write on prod needs -- the same
row version, inputs of the same shape, from a lower venue, younger than the
connector's limit.  Without it, with stale evidence or with evidence of
another row version the write is refused (CG601) and nothing is recorded.
The approver sees the evidence in the plan; roles are scoped by environment;
an edited or forged ledger vouches for nothing; one configuration naming
every instance works too.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.api import build_executor
from capgate.config import load_settings
from capgate.executor import outcome as oc
from capgate.executor.call import Executor
from capgate.executor.simulation.cycle import simulate
from capgate.registry import errors
from capgate.registry import errors as serr
from capgate.sqlfiles import apply_schema
from tests.fix_capgate import KEYS, approver_key, install_target, registry, table_dump
from tests.sim_support import NEW_CLAIM, SIM_GRANTS, recording, registry_with, venues

__all__ = ["venues"]  # the fixture

Pair = tuple[Executor, Executor]


@pytest.fixture
def pair(target_url: URL, tmp_path: Path, venues: Callable[..., Executor]) -> Pair:
    """qa on its own SQLite database, prod on the engine under test; one ledger."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    qa = venues(f"sqlite:///{tmp_path / 'qa.db'}", ledger, "qa")
    prod = venues(target_url, ledger, "prod")
    return qa, prod


def claims(ex: Executor, ref: str) -> int:
    with ex.connectors.get("insurance").engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM claim WHERE claim_ref = :r"),
                                {"r": ref}).scalar_one())


def refused(ex: Executor, case: str, operation: str = "claim.open",
            inputs: dict[str, Any] | None = None, **call: Any) -> serr.PromotionRefused:
    target = ex.connectors.get("insurance").engine
    with recording(target) as seen, pytest.raises(serr.PromotionRefused) as info:
        ex.call(operation, inputs or NEW_CLAIM, case=case, who=call.pop("who", "agent"), **call)
    assert seen.seen == [], "a refused promotion sends nothing to the target"
    assert info.value.code == "CG601"
    return info.value


def test_a_promotion_without_evidence_is_refused(pair: Pair) -> None:
    _, prod = pair
    err = refused(prod, "P-NONE")
    assert err.details["missing"] == "no_evidence"
    failed = [p["name"] for p in err.details["exemption"]["points"] if not p["holds"]]
    assert failed == ["no_downstream_consumer"], "claim.open is no exemption (point 4)"
    assert prod.ledger.snapshot("P-NONE") is None, "nothing was recorded"
    assert claims(prod, NEW_CLAIM["claim_ref"]) == 0


def test_simulation_on_a_lower_venue_is_the_evidence_the_promotion_needs(pair: Pair) -> None:
    qa, prod = pair
    report = simulate(qa, "claim.open", NEW_CLAIM, case="P-OK", who="agent")
    assert report.status == "restored"
    assert claims(qa, NEW_CLAIM["claim_ref"]) == 0, "the simulation left nothing on qa"
    plan = prod.plan("claim.open", {**NEW_CLAIM, "policy_id": 5}, case="P-OK", who="agent")
    evidence = plan.body["promotion"]["evidence"]
    assert evidence["simulation_id"] == report.simulation_id
    assert evidence["environment"] == "qa"
    out = prod.call("claim.open", {**NEW_CLAIM, "policy_id": 5}, case="P-OK", who="agent")
    assert out.status == oc.APPLIED
    assert claims(prod, NEW_CLAIM["claim_ref"]) == 1
    assert prod.ledger.verify().ok


def test_stale_evidence_is_refused(pair: Pair) -> None:
    qa, prod = pair
    simulate(qa, "claim.open", NEW_CLAIM, case="P-OLD", who="agent")
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=8)
    prod.clock = lambda: later
    assert refused(prod, "P-OLD").details["missing"] == "stale"
    earlier = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)  # evidence "from the future"
    prod.clock = lambda: earlier
    assert refused(prod, "P-OLD").details["missing"] == "stale"
    prod.clock = lambda: dt.datetime.now(dt.UTC)
    assert prod.call("claim.open", NEW_CLAIM, case="P-OLD", who="agent").status == oc.APPLIED


CLAIM_OPEN_V2 = """
format: 1
connectors: {insurance: {description: insurance}}
rows:
  - operation_id: claim.open
    version: 2
    connector: insurance
    description: Open a claim on an active policy, with an optional handler's remark.
    input:
      type: object
      additionalProperties: false
      required: [policy_id, claim_ref, reported_on, amount]
      properties:
        policy_id: {type: integer, minimum: 1}
        claim_ref: {type: string, pattern: "^CLM-[0-9]{4}-[0-9]{3,6}$"}
        reported_on: {type: string, format: date, pattern: "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
        amount: {type: integer, minimum: 1, maximum: 10000000}
        remark: {type: string, maxLength: 100}
    target: {system: insurance, object: claim, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [rig, dev, qa, staging, prod]
    idempotency_key: "{case}:{operation_id}:{claim_ref}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: insert_claim
        sql: >
          INSERT INTO claim (policy_id, claim_ref, reported_on, amount, status)
          VALUES (:policy_id, :claim_ref, :reported_on, :amount, 'open')
        expect_rows: 1
        returns: {table: claim, key: claim_id}
    verify:
      - name: policy_active
        sql: "SELECT count(*) FROM policy WHERE policy_id = :policy_id AND status = 'active'"
        expect: {value: 1}
"""


def test_evidence_of_another_row_version_or_input_shape_is_refused(
        pair: Pair, tmp_path: Path) -> None:
    qa, prod = pair
    both = registry_with(tmp_path, CLAIM_OPEN_V2)
    qa.registry = prod.registry = both
    simulate(qa, "claim.open", NEW_CLAIM, case="P-V", who="agent", version=1)
    err = refused(prod, "P-V")  # the current row is version 2
    assert err.details["missing"] == "other_row_version"
    assert err.details["evidence_seen"][0]["version"] == 1
    simulate(qa, "claim.open", NEW_CLAIM, case="P-S", who="agent", version=2)
    shaped = {**NEW_CLAIM, "remark": "holder called twice"}
    assert refused(prod, "P-S", inputs=shaped).details["missing"] == "other_input_shape"
    assert prod.call("claim.open", {**NEW_CLAIM, "claim_ref": "CLM-2024-501"}, case="P-S",
                     who="agent").status == oc.APPLIED  # the simulated shape is promoted


def test_evidence_must_come_from_a_lower_venue(tmp_path: Path,
                                               venues: Callable[..., Executor]) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    qa = venues(f"sqlite:///{tmp_path / 'qa.db'}", ledger, "qa", requires_simulation=True)
    assert simulate(qa, "claim.open", NEW_CLAIM, case="P-L", who="agent").status == "restored"
    assert refused(qa, "P-L").details["missing"] == "not_lower", "qa is not below qa"
    rig = venues(f"sqlite:///{tmp_path / 'rig.db'}", ledger, "rig")
    simulate(rig, "claim.open", NEW_CLAIM, case="P-L", who="agent")
    assert qa.call("claim.open", NEW_CLAIM, case="P-L", who="agent").status == oc.APPLIED


def test_an_edited_ledger_vouches_for_no_promotion(pair: Pair) -> None:
    qa, prod = pair
    simulate(qa, "claim.open", NEW_CLAIM, case="P-T", who="agent")
    state = prod.ledger.verified_snapshot("P-T") or {}
    (key,) = [k for k in state["case"] if k.startswith("simulated:")]
    forged = dict(state["case"][key], row_hash="sha256:" + "1" * 64)
    # (a) the evidence rewritten in the store: the snapshot no longer verifies
    import json

    with prod.ledger.engine.begin() as conn:
        text = conn.execute(sa.text("SELECT snapshot FROM cg_cases WHERE case_id = 'P-T'")
                            ).scalar_one()
        edited = json.loads(text)
        edited["case"]["simulated:edited"] = forged
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = :s WHERE case_id = 'P-T'"),
                     {"s": json.dumps(edited)})
    with pytest.raises(errors.LedgerTampered) as info:
        prod.call("claim.open", NEW_CLAIM, case="P-T", who="agent")
    assert info.value.code == "CG410"
    # (b) evidence appended through the ledger, not earned by a simulation: not proven
    prod.ledger.append("P-F", "simulation_restored", {"case_state": {
        "simulated:forged": {**state["case"][key], "intent_id": "0" * 32}}})
    assert refused(prod, "P-F").details["missing"] == "unproven"
    assert claims(prod, NEW_CLAIM["claim_ref"]) == 0


def test_the_approver_sees_the_simulation_evidence_in_the_plan(pair: Pair) -> None:
    """A gated, compensable row: simulated on qa (its gate approved there too), then on
    prod the call asks for approval with a plan that carries the evidence."""
    qa, prod = pair
    discount = {"policy_id": 1, "discount": 100, "expected_premium": 1100}
    with pytest.raises(errors.ApprovalRequired) as first:
        simulate(qa, "premium.apply_discount", discount, case="P-G", who="agent")
    qa.approve(first.value.details["plan_hash"], by="alice", role="underwriting_lead",
               key=KEYS["alice"])
    report = simulate(qa, "premium.apply_discount", discount, case="P-G", who="agent")
    assert report.status == "restored", report.steps
    with pytest.raises(errors.ApprovalRequired) as need:
        prod.call("premium.apply_discount", discount, case="P-G", who="agent")
    shown = need.value.details["plan"]["promotion"]
    assert shown["evidence"]["simulation_id"] == report.simulation_id
    recorded = prod.ledger.get_plan(need.value.details["plan_hash"]).plan
    assert recorded["promotion"]["evidence"]["baseline_digest"]
    prod.approve(need.value.details["plan_hash"], by="alice", role="underwriting_lead",
                 key=KEYS["alice"])
    out = prod.call("premium.apply_discount", discount, case="P-G", who="agent")
    assert out.status == oc.APPLIED


def test_roles_are_scoped_by_environment(tmp_path: Path,
                                         venues: Callable[..., Executor]) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    # the promoting identity must hold the promotion role *for this environment*
    prod = venues(f"sqlite:///{tmp_path / 'prod.db'}", ledger, "prod",
                  promotion_roles=("release_manager",))
    staging = venues(f"sqlite:///{tmp_path / 'staging.db'}", ledger, "staging",
                     promotion_roles=("release_manager",), simulation_approver_roles=("dba",))
    qa = venues(f"sqlite:///{tmp_path / 'qa.db'}", ledger, "qa", requires_simulation=True,
                promotion_roles=("release_manager",))
    note = {"note_id": 1, "old_body": "Customer asked for a quarterly schedule.",
            "body": "Corrected."}
    with pytest.raises(serr.PromoterLacksRole) as info:
        prod.call("note.correct", note, case="P-R", who="agent")
    assert info.value.code == "CG602" and prod.ledger.snapshot("P-R") is None
    with pytest.raises(serr.PromoterLacksRole):  # rita's role is staging's and prod's
        qa.call("note.correct", note, case="P-R", who="rita")
    assert prod.call("note.correct", note, case="P-R", who="rita").status == oc.APPLIED
    assert staging.call("note.correct", note, case="P-R2", who="rita").status == oc.APPLIED
    # an approver's role scoped to prod approves prod's plans, not qa's
    qa_gate = venues(f"sqlite:///{tmp_path / 'qa2.db'}", ledger, "qa")
    prod_gate = venues(f"sqlite:///{tmp_path / 'prod2.db'}", ledger, "prod",
                       requires_simulation=False)
    orphan = {"policy_id": 9}
    with pytest.raises(errors.ApprovalRequired) as on_qa:
        qa_gate.call("policy.purge_orphan", orphan, case="P-Q", who="agent")
    with pytest.raises(errors.ApproverLacksRole, match="in 'qa'"):
        qa_gate.approve(on_qa.value.details["plan_hash"], by="quinn", role="dba",
                        key=approver_key("quinn"))
    with pytest.raises(errors.ApprovalRequired) as on_prod:
        prod_gate.call("policy.purge_orphan", orphan, case="P-Q2", who="agent")
    prod_gate.approve(on_prod.value.details["plan_hash"], by="quinn", role="dba",
                      key=approver_key("quinn"))
    assert prod_gate.call("policy.purge_orphan", orphan, case="P-Q2",
                          who="agent").status == oc.APPLIED


def test_eight_threads_promoting_at_once_apply_it_once(pair: Pair) -> None:
    qa, prod = pair
    simulate(qa, "claim.open", NEW_CLAIM, case="P-8", who="agent")
    results: list[Any] = []

    def one() -> None:
        try:
            results.append(prod.call("claim.open", NEW_CLAIM, case="P-8", who="agent"))
        except errors.CapgateError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(getattr(r, "status", None) == oc.APPLIED for r in results), results
    assert sum(not r.replayed for r in results) == 1
    assert claims(prod, NEW_CLAIM["claim_ref"]) == 1


def test_one_configuration_naming_every_instance(tmp_path: Path) -> None:
    """``[connectors.insurance.venues.qa]``: the qa database is a venue of the same logical
    connector in the same configuration; simulate there, then promote on prod."""
    for name in ("prod", "qa"):
        engine = sa.create_engine(f"sqlite:///{tmp_path / f'{name}.db'}")
        apply_schema(engine)
        install_target(engine)
        engine.dispose()
    config = tmp_path / "capgate.toml"
    config.write_text(f"""
[capgate]
ledger = "sqlite:///{tmp_path / 'ledger.db'}"

[connectors.insurance]
url = "sqlite:///{tmp_path / 'prod.db'}"
environment = "prod"

[connectors.insurance.venues.qa]
url = "sqlite:///{tmp_path / 'qa.db'}"
""", "utf-8")
    settings = load_settings(config)
    with build_executor(settings, registry=registry(), grants=SIM_GRANTS) as ex:
        refusal = pytest.raises(serr.PromotionRefused)
        with refusal:
            ex.call("claim.open", NEW_CLAIM, case="P-A", who="agent")
        report = simulate(ex, "claim.open", NEW_CLAIM, case="P-A", who="agent", venue="qa")
        assert report.status == "restored"
        assert report.summary["connector"] == "insurance@qa"
        assert ex.call("claim.open", NEW_CLAIM, case="P-A", who="agent").status == oc.APPLIED
        with pytest.raises(errors.UnknownConnector, match="no venue in 'staging'"):
            simulate(ex, "claim.open", NEW_CLAIM, case="P-A2", who="agent", venue="staging")
    assert [r[2] for r in table_dump(f"sqlite:///{tmp_path / 'prod.db'}", "claim")] == \
        ["CLM-2024-001", "CLM-2024-500"]
    assert [r[2] for r in table_dump(f"sqlite:///{tmp_path / 'qa.db'}", "claim")] == \
        ["CLM-2024-001"]


def test_a_simulation_waiting_for_its_execute_step_lets_nothing_else_through(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adversarial: a simulation on qa stopped at its execute step does not let a write
    on prod -- nor one with other inputs on qa -- pass as that step.  Only the very call
    the simulation would make (its venue, its inputs, its requester) is admitted."""
    import capgate.executor.simulation.cycle as sim_cycle

    qa, prod = pair

    def unreachable(self: Any) -> None:
        raise ConnectionError("the simulating process died before its execute step")

    monkeypatch.setattr(sim_cycle._Cycle, "execute", unreachable)
    with pytest.raises(ConnectionError):
        simulate(qa, "claim.open", NEW_CLAIM, case="P-STEP", who="agent")
    monkeypatch.undo()
    state = qa.ledger.verified_snapshot("P-STEP") or {}
    (summary,) = [v for k, v in state["case"].items() if k.startswith("simulation:")]
    assert summary["step"] == "baseline"
    sid = summary["simulation_id"]
    target = prod.connectors.get("insurance").engine
    with recording(target) as seen, pytest.raises(serr.SimulationStateConflict):
        prod.call("claim.open", NEW_CLAIM, case="P-STEP", who="agent", simulation=sid)
    assert seen.seen == [], "the prod target saw nothing"
    other = {**NEW_CLAIM, "claim_ref": "CLM-2024-999"}
    with pytest.raises(serr.SimulationStateConflict):
        qa.call("claim.open", other, case="P-STEP", who="agent", simulation=sid)
    assert claims(prod, NEW_CLAIM["claim_ref"]) == 0
    assert claims(qa, other["claim_ref"]) == 0


def test_a_caller_key_cannot_pass_for_a_simulation_step(pair: Pair) -> None:
    """A caller key may not carry the simulation mark (it would select the step check)."""
    from capgate.executor.simulation.records import IDEM_MARK

    _, prod = pair
    row, _ = prod.resolve("claim.open")
    with pytest.raises((errors.InputInvalid, errors.CallerKeyRefused)):
        prod._key_for(dataclasses.replace(row, accepts_caller_key=True), NEW_CLAIM, "P-KEY",
                      f"x{IDEM_MARK}deadbeef")
