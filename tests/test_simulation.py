"""The simulation cycle on SQLite, PostgreSQL and MariaDB (issue 16, seed 001 §5).

Capture the baseline, declare the planned effects and cleanup, execute
(committed, through the call path), observe, tear down from the write log,
verify restoration by re-reading the baseline: every step a ledger event, and
the target afterwards what it was, byte for byte.  A teardown removes exactly
the keys written -- never a concurrent writer's -- and a re-read that differs
escalates with both digests.  A dry run sends nothing anywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor import outcome as oc
from capgate.executor.call import Executor
from capgate.executor.recovery.resume import resume
from capgate.executor.simulation import cycle as sim_cycle
from capgate.executor.simulation.cycle import abandon_simulation, continue_simulation, simulate
from capgate.registry import errors
from capgate.registry import errors as serr
from tests.fix_capgate import KEYS
from tests.sim_support import NEW_CLAIM, dump, recording, venues

__all__ = ["venues"]  # the fixture


def engine_of(url: URL) -> str:
    return {"mysql": "mariadb"}.get(url.get_backend_name(), url.get_backend_name())


def scalar(ex: Executor, sql: str, **binds: Any) -> Any:
    with ex.connectors.get("insurance").engine.connect() as conn:
        return conn.execute(sa.text(sql), binds).scalar()


def kinds(ex: Executor, case: str) -> list[str]:
    return [e.kind for e in ex.ledger.events(case)]


@pytest.fixture
def dev(target_url: URL, tmp_path: Path, venues: Callable[..., Executor]) -> Executor:
    return venues(target_url, f"sqlite:///{tmp_path / 'ledger.db'}", "dev")


CYCLES = {
    "claim.open": NEW_CLAIM,  # an INSERT: torn down by the key it returned
    "claim.settle": {"claim_id": 1},  # an UPDATE: torn down by its written compensation
    "note.correct": {"note_id": 1, "old_body": "Customer asked for a quarterly schedule.",
                     "body": "Customer asked for a quarterly payment schedule."},
}


@pytest.mark.parametrize("operation", sorted(CYCLES))
def test_a_full_cycle_restores_the_baseline_byte_for_byte(dev: Executor, target_url: URL,
                                                          operation: str) -> None:
    before = dump(target_url)
    report = simulate(dev, operation, CYCLES[operation], case="SIM-1", who="agent")

    assert report.status == "restored" and report.exit_code == 0, report.steps
    assert dump(target_url) == before, "the target is what it was, byte for byte"
    steps = [s["event"] for s in report.steps]
    assert steps == ["simulation_planned", "simulation_baseline", "simulation_executed",
                     "simulation_observed", "simulation_torn_down", "simulation_restored"]
    recorded = [k for k in kinds(dev, "SIM-1") if k.startswith("simulation_")]
    assert recorded == steps, "each step is a ledger event, in order"
    baseline = report.steps[1]["baseline"]
    assert report.steps[-1]["restored"]["digest"] == baseline["digest"]
    executed = report.steps[2]
    assert executed["outcome"] == oc.APPLIED, "the change was committed, not rehearsed"
    # the simulated write is closed as simulated: a completed simulation is not a deployment
    intent = dev.ledger.intent("SIM-1", executed["intent_id"])
    assert intent["outcome_record"]["status"] == oc.SIMULATED
    state = dev.ledger.verified_snapshot("SIM-1")
    assert state is not None
    evidence = [v for k, v in state["case"].items() if k.startswith("simulated:")]
    assert len(evidence) == 1 and evidence[0]["environment"] == "dev"
    assert dev.ledger.verify().ok
    # the plan declared the planned effects and the cleanup before anything ran
    plan = report.steps[0]["plan"]
    assert plan["planned_effects"]["statements"] and plan["cleanup"]
    assert not dev.ledger.cases(open_only=True)


def test_the_teardown_deletes_exactly_the_key_the_insert_returned(dev: Executor,
                                                                   target_url: URL) -> None:
    report = simulate(dev, "claim.open", NEW_CLAIM, case="SIM-K", who="agent")
    observed = report.steps[3]["observed"]
    (claim_id,) = observed["returned"]["claim_id"]
    torn = report.steps[4]
    assert list(torn["binds"].values()) == [claim_id]
    assert torn["counts"] == [1]
    assert any(f"claim_id = :{name}" in st["sql"] for st in torn["statements"]
               for name in torn["binds"])
    assert scalar(dev, "SELECT count(*) FROM claim WHERE claim_id = :c", c=claim_id) == 0


def test_a_teardown_leaves_what_a_concurrent_writer_added(
        dev: Executor, target_url: URL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between execute and teardown another writer adds a claim to the same policy: the
    teardown removes only the simulation's own key, and the re-read baseline -- which now
    differs -- escalates with both digests and the row that is new."""
    writer = sa.create_engine(target_url, poolclass=sa.pool.NullPool)
    original = sim_cycle._Cycle.tear_down

    def concurrent_then_tear_down(self: Any) -> bool:
        with writer.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO claim (policy_id, claim_ref, reported_on, amount, status) "
                "VALUES (2, 'CLM-2024-999', '2024-08-21', 99, 'open')"))
        return original(self)

    monkeypatch.setattr(sim_cycle._Cycle, "tear_down", concurrent_then_tear_down)
    try:
        report = simulate(dev, "claim.open", NEW_CLAIM, case="SIM-C", who="agent")
    finally:
        writer.dispose()
    (ours,) = report.steps[3]["observed"]["returned"]["claim_id"]
    assert scalar(dev, "SELECT count(*) FROM claim WHERE claim_id = :c", c=ours) == 0
    assert scalar(dev, "SELECT count(*) FROM claim WHERE claim_ref = 'CLM-2024-999'") == 1, \
        "the concurrent writer's claim is untouched"
    assert report.status == "escalated" and report.exit_code == 3
    escalation = report.steps[-1]
    assert escalation["escalation"] == "restoration_mismatch"
    assert escalation["before_digest"] != escalation["after_digest"]
    (mismatch,) = [m for m in escalation["mismatches"] if m["name"] == "target"]
    assert mismatch["only_before"] == [] and len(mismatch["only_after"]) == 1
    assert "CLM-2024-999" in mismatch["only_after"][0]
    # the escalation holds the case for a person; it is no evidence for a promotion
    with pytest.raises(errors.ReconciliationRequired):
        dev.call("claim.open", {**NEW_CLAIM, "claim_ref": "CLM-2024-501"}, case="SIM-C",
                 who="agent")
    state = dev.ledger.verified_snapshot("SIM-C") or {}
    assert not [k for k in state["case"] if k.startswith("simulated:")]


def test_a_write_that_rolls_back_records_what_survived_the_rollback(
        dev: Executor, target_url: URL) -> None:
    """claim.open on a lapsed policy: the insert ran, the verify failed, the rollback came.
    The identity value the insert drew is recorded as surviving where the engine keeps it
    consumed (PostgreSQL, MariaDB) and as given back on SQLite."""
    before = dump(target_url)
    lapsed = {**NEW_CLAIM, "policy_id": 3, "claim_ref": "CLM-2024-600"}
    report = simulate(dev, "claim.open", lapsed, case="SIM-R", who="agent")
    assert report.status == "rolled_back" and report.exit_code == 1
    assert dump(target_url) == before
    outcome = dev.ledger.intent("SIM-R", report.steps[2]["intent_id"])["outcome_record"]
    assert outcome["status"] == oc.ROLLED_BACK
    survived = {e["effect"]: e for e in outcome["evidence"]["survived_rollback"]}
    (consumed,) = survived["claim_id_identity"]["values"]
    keeps = engine_of(target_url) != "sqlite"
    assert survived["claim_id_identity"]["survived"] is keeps
    assert survived["dashboard_cache"]["survived"] is None  # not observable: never guessed
    # and it is true: the next claim gets a later id where the value stayed consumed
    dev.call("claim.open", {**NEW_CLAIM, "claim_ref": "CLM-2024-601"}, case="SIM-R2",
             who="agent")
    after = scalar(dev, "SELECT claim_id FROM claim WHERE claim_ref = 'CLM-2024-601'")
    assert (after > consumed) if keeps else (after == consumed)
    state = dev.ledger.verified_snapshot("SIM-R") or {}
    assert not [k for k in state["case"] if k.startswith("simulated:")], "no evidence"


def test_a_row_whose_teardown_cannot_be_derived_is_refused_before_anything(
        dev: Executor, target_url: URL) -> None:
    engine = dev.connectors.get("insurance").engine
    with recording(engine, dev.ledger.engine) as seen, \
            pytest.raises(serr.TeardownUnderivable) as info:
        simulate(dev, "cover.add", {"policy_id": 1, "kind": "liability", "amount": 10},
                 case="SIM-U", who="agent")
    assert info.value.code == "CG603"
    assert set(info.value.details["statements"]) == {"insert_cover", "raise_sum_insured"}
    assert seen.writes == [] and dev.ledger.snapshot("SIM-U") is None


def test_a_dry_run_sends_no_dml_anywhere(dev: Executor, target_url: URL) -> None:
    """Recorded at the engines: the target gets no statement at all, the ledger no write."""
    before = dump(target_url)
    target = dev.connectors.get("insurance").engine
    with recording(target) as on_target, recording(dev.ledger.engine) as on_ledger:
        report = simulate(dev, "claim.open", NEW_CLAIM, case="SIM-D", who="agent",
                          dry_run=True)
        plan = dev.plan("claim.open", NEW_CLAIM, case="SIM-D", who="agent", record=False)
    assert report.status == "planned" and report.simulation_id is None
    assert report.plan["cleanup"]["delete_returned"] == [
        {"statement": "insert_claim", "table": "claim", "key": "claim_id"}]
    assert plan.body["statements"]
    assert on_target.seen == [], on_target.seen
    assert on_ledger.writes == [], on_ledger.writes
    assert dump(target_url) == before and dev.ledger.snapshot("SIM-D") is None
    # a plain plan records the plan (for its approver) and still sends nothing to the target
    with recording(target) as on_target:
        dev.plan("claim.open", NEW_CLAIM, case="SIM-D", who="agent")
    assert on_target.seen == []


def test_a_staging_simulation_records_that_the_customer_was_informed(
        target_url: URL, tmp_path: Path, venues: Callable[..., Executor]) -> None:
    stage = venues(target_url, f"sqlite:///{tmp_path / 'ledger.db'}", "staging",
                  simulation_approver_roles=("dba",))
    with pytest.raises(serr.CustomerNotInformed) as info:
        simulate(stage, "claim.open", NEW_CLAIM, case="SIM-S", who="agent")
    assert info.value.code == "CG605" and stage.ledger.snapshot("SIM-S") is None
    informed = {"who": "Maria Ivanova", "when": "2026-12-01T09:00:00+00:00"}
    with pytest.raises(errors.ApprovalRequired) as need:
        simulate(stage, "claim.open", NEW_CLAIM, case="SIM-S", who="agent",
                 customer_informed=informed)
    plan_hash = need.value.details["plan_hash"]
    assert need.value.details["plan"]["kind"] == "simulation"
    stage.approve(plan_hash, by="bob", role="dba", key=KEYS["bob"])
    before = dump(target_url)
    report = simulate(stage, "claim.open", NEW_CLAIM, case="SIM-S", who="agent",
                      customer_informed=informed)
    assert report.status == "restored" and dump(target_url) == before
    assert report.summary["customer_informed"] == informed
    assert report.summary["approval"]["approver"] == "bob"


def test_a_simulation_interrupted_between_steps_continues_where_it_stopped(
        dev: Executor, target_url: URL, monkeypatch: pytest.MonkeyPatch) -> None:
    before = dump(target_url)

    def lost(self: Any) -> bool:
        raise ConnectionError("the process lost its target before the teardown")

    monkeypatch.setattr(sim_cycle._Cycle, "tear_down", lost)
    with pytest.raises(ConnectionError):
        simulate(dev, "claim.open", NEW_CLAIM, case="SIM-I", who="agent")
    monkeypatch.undo()
    state = dev.ledger.verified_snapshot("SIM-I") or {}
    (summary,) = [v for k, v in state["case"].items() if k.startswith("simulation:")]
    assert summary["step"] == "observed"
    assert dump(target_url) != before, "the simulated claim is still there"
    # a new simulation of the case waits for this one
    with pytest.raises(serr.SimulationStateConflict):
        simulate(dev, "claim.open", {**NEW_CLAIM, "claim_ref": "CLM-2024-777"},
                 case="SIM-I", who="agent")
    with pytest.raises(serr.SimulationStateConflict):  # it wrote: it cannot be abandoned
        abandon_simulation(dev, "SIM-I", summary["simulation_id"], who="agent")
    report = continue_simulation(dev, "SIM-I", summary["simulation_id"], who="agent")
    assert report.status == "restored"
    assert [s["event"] for s in report.steps] == ["simulation_torn_down", "simulation_restored"]
    assert dump(target_url) == before
    with pytest.raises(serr.SimulationStateConflict):  # torn down once, never twice
        continue_simulation(dev, "SIM-I", summary["simulation_id"], who="agent")


def test_eight_simulations_of_one_case_at_once_run_one(dev: Executor,
                                                       target_url: URL) -> None:
    before = dump(target_url)
    results: list[Any] = []

    def one() -> None:
        try:
            results.append(simulate(dev, "claim.open", NEW_CLAIM, case="SIM-8", who="agent"))
        except errors.CapgateError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if not isinstance(r, errors.CapgateError)]
    refused = [r for r in results if isinstance(r, errors.CapgateError)]
    assert len(done) == 1 and done[0].status == "restored", results
    assert all(isinstance(r, serr.SimulationStateConflict | errors.ReconciliationRequired)
               for r in refused), refused
    assert dump(target_url) == before
    assert dev.ledger.verify().ok


@pytest.mark.crash
@pytest.mark.parametrize(("nth", "where"), [(1, "execute"), (2, "teardown")])
def test_a_simulation_killed_inside_a_commit_is_resumed_then_continued(
        target_url: URL, tmp_path: Path, nth: int, where: str,
        venues: Callable[..., Executor]) -> None:
    """A real process runs the cycle and is killed (SIGKILL) right after a COMMIT and
    before its ``observed`` -- the execute step's (nth 1) or the teardown's (nth 2).
    ``resume`` proves that write from its marker; the simulation then continues from the
    ledger, tears down exactly once and re-reads the baseline identical."""
    from tests.crash_child import Zygote

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = venues(target_url, ledger, "dev")
    before = dump(target_url)
    case = f"SIM-KILL-{where}"
    zygote = Zygote()
    try:
        ended = zygote.run({"target": target_url.render_as_string(hide_password=False),
                            "ledger": ledger, "operation": "claim.open", "inputs": NEW_CLAIM,
                            "case": case, "who": "agent", "simulate": True,
                            "crash_at": "after_commit", "crash_nth": nth,
                            "out": str(tmp_path / "out.json")})
    finally:
        zygote.close()
    assert ended.killed, ended
    state = ex.ledger.verified_snapshot(case) or {}
    (summary,) = [v for k, v in state["case"].items() if k.startswith("simulation:")]
    with pytest.raises(errors.ReconciliationRequired):
        continue_simulation(ex, case, summary["simulation_id"], who="agent")
    report = resume(ex, case)
    assert [i.classification for i in report.intents] == ["applied"], report.intents
    assert report.resolved
    done = continue_simulation(ex, case, summary["simulation_id"], who="agent")
    assert done.status == "restored", done.steps
    assert dump(target_url) == before
    teardowns = [s for s in ex.ledger.intents(case).values()
                 if s.get("simulation_teardown") == summary["simulation_id"]]
    assert len(teardowns) == 1, "torn down exactly once"
    assert ex.ledger.verify().ok and not ex.ledger.cases(open_only=True)


def test_a_simulation_that_never_wrote_can_be_abandoned(
        dev: Executor, target_url: URL, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(self: Any) -> None:
        raise ConnectionError("the target went away before the execute step")

    monkeypatch.setattr(sim_cycle._Cycle, "execute", unreachable)
    with pytest.raises(ConnectionError):
        simulate(dev, "claim.open", NEW_CLAIM, case="SIM-A", who="agent")
    monkeypatch.undo()
    state = dev.ledger.verified_snapshot("SIM-A") or {}
    (summary,) = [v for k, v in state["case"].items() if k.startswith("simulation:")]
    assert summary["step"] == "baseline"
    with pytest.raises(errors.UsageError):  # only its requester ends it
        abandon_simulation(dev, "SIM-A", summary["simulation_id"], who="alice")
    ended = abandon_simulation(dev, "SIM-A", summary["simulation_id"], who="agent")
    assert ended.status == "abandoned" and ended.exit_code == 1
    assert simulate(dev, "claim.open", NEW_CLAIM, case="SIM-A", who="agent").status == "restored"
