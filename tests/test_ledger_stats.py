"""Recovery accounting (issue 17, items 4-5): ``ledger stats`` counted from the ledger.

A case of six steps runs in real processes killed with SIGKILL at several
depths (before COMMIT, after COMMIT, after attempt_started, after observed),
each followed by ``resume``.  ``ledger stats`` then reports, from the verified
chain: every attempt, the useful final actions, re-execution overhead 0 for
every step whose marker proved it landed (1 for the two killed before
COMMIT), the validated actions each recovery retained -- and the numbers
match what the target holds (landing markers and their attempts, the rows).
An edited ledger is not counted.  On PostgreSQL and MariaDB targets.

Also: resume chooses the latest *eligible* step as the recovery point, not the
latest recorded one, and records eligibility as its own fact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.ledger.stats import ledger_stats
from capgate.executor.recovery.eligibility import assess, ddl_objects
from capgate.executor.recovery.resume import resume
from tests.crash_child import Zygote
from tests.fix_db import engine_params
from tests.test_coordination import rows, server_url, url_text

ROOT = Path(__file__).resolve().parent.parent

# (policy, where the process is killed); None: the call runs to its end.  Policy 9 is
# void: that last step's verify fails and it rolls back -- an unsuccessful final action.
STEPS: list[tuple[int, str | None]] = [(1, None), (2, "before_commit"), (3, "after_commit"),
                                       (4, "after_attempt_started"), (5, "after_observed"),
                                       (9, None)]
KILLED_BEFORE_COMMIT = {2, 4}
LANDED = {1, 2, 3, 4, 5}


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_target(request: pytest.FixtureRequest) -> URL:
    return server_url(request)


@pytest.fixture
def pg_ledger(pg_ledger_url: URL) -> URL:
    return pg_ledger_url


def note(policy: int) -> dict[str, Any]:
    return {"policy_id": policy, "author": "jdoe", "body": f"stats step on policy {policy}"}


def run_case(ex: Executor, zygote: Zygote, target: URL, ledger: URL, case: str,
             tmp: Path) -> dict[int, str]:
    """The six steps, each killed where STEPS says, each kill followed by resume."""
    by_policy: dict[int, str] = {}
    for policy, point in STEPS:
        spec: dict[str, Any] = {"target": url_text(target), "ledger": url_text(ledger),
                                "operation": "policy.add_note", "inputs": note(policy),
                                "case": case, "who": "agent", "out": str(tmp / "out.json")}
        if point:
            spec["crash_at"] = point
        ended = zygote.run(spec)
        assert ended.killed == bool(point), ended
        if point:
            report = resume(ex, case)
            assert report.exit_code == 0, report.lines()
    for intent_id, state in ex.ledger.intents(case).items():
        by_policy[int(state["inputs"]["policy_id"])] = intent_id
    return by_policy


@pytest.mark.crash
def test_ledger_stats_after_kills_at_several_depths_match_the_target(
        server_target: URL, pg_ledger: URL, gate: Callable[..., Executor], zygote: Zygote,
        tmp_path: Path) -> None:
    ex = gate(server_target, pg_ledger)
    case = "STATS-1"
    intents = run_case(ex, zygote, server_target, pg_ledger, case, tmp_path)

    found = ledger_stats(ex.ledger, [case])
    assert found.unverified == ()
    (stats,) = found.cases
    assert stats.total_attempts == len(STEPS) + len(KILLED_BEFORE_COMMIT) == 8
    assert stats.useful_final_actions == len(LANDED) == 5
    assert stats.re_execution_overhead == len(KILLED_BEFORE_COMMIT) == 2
    assert stats.finals()["unsuccessful_final_actions"] == 1  # 8 = 5 + 2 + 1
    # retained at each recovery: the steps validated before it, not re-run by it
    # (after 2: step 1; after 3: 1-3, its marker proving 3; after 4: 1-3; after 5: 1-5)
    assert [r["retained"] for r in stats.recoveries] == [1, 3, 3, 5]
    assert stats.validated_actions_retained_at_recovery == 12
    assert dict(stats.decisions) == {"retried": 2, "reconciled": 1, "escalated": 0,
                                     "withheld": 0, "granted": 4}
    per = {i.intent_id: i for i in stats.intents}
    for policy, point in STEPS:
        step = per[intents[policy]]
        assert step.final == ("applied" if policy in LANDED else "not_applied")
        expected = 1 if policy in KILLED_BEFORE_COMMIT else 0
        assert step.overhead == expected, (policy, point, step)
    landed = per[intents[3]]  # killed after COMMIT: its marker proved it, nothing re-ran
    assert (landed.attempts, landed.status, landed.overhead) == (1, "reconciled", 0)
    for r in stats.recoveries:  # every step eligible here: the chosen is the latest
        assert r["chosen_is_latest"] is True

    # what the target holds: one marker per useful action, the attempts it landed with
    markers = rows(server_target, "SELECT intent_id, attempt FROM capgate_landed"
                                  " WHERE case_id = :c", c=case)
    assert len(markers) == stats.useful_final_actions
    assert sum(int(a) - 1 for _, a in markers) == stats.re_execution_overhead
    assert {i: int(a) for i, a in markers} == {i.intent_id: i.attempts for i in stats.intents
                                               if i.final == "applied"}
    assert rows(server_target, "SELECT count(*) FROM policy_note WHERE body LIKE"
                               " 'stats step on policy %'") == [(len(LANDED),)]

    # the command line says the same (and --all adds the totals)
    config = write_config(tmp_path, server_target, pg_ledger)
    one = capgate("ledger", "stats", case, "--json", "--config", str(config))
    assert one.returncode == 0, one.stderr
    body = json.loads(one.stdout)["cases"][0]
    assert (body["total_attempts"], body["useful_final_actions"],
            body["re_execution_overhead"], body["validated_actions_retained_at_recovery"]) == (
        8, 5, 2, 12)
    text = capgate("ledger", "stats", "--all", "--config", str(config)).stdout
    assert text.splitlines()[0].split()[:5] == ["CASE", "ATTEMPTS", "USEFUL", "OVERHEAD",
                                               "RETAINED"]
    assert text.splitlines()[-1].split()[:5] == ["total", "8", "5", "2", "12"]

    # an edited ledger is not counted: accounting on an edited record would be false
    engine = sa.create_engine(pg_ledger, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE cg_events SET payload = replace(payload, :was, :now)"
                             " WHERE case_id = :c AND kind = 'attempt_started'"),
                     {"c": case, "was": '"attempt":2', "now": '"attempt":1'})
    engine.dispose()
    edited = ledger_stats(ex.ledger, [case])
    assert edited.cases == () and edited.unverified[0]["case"] == case
    assert capgate("ledger", "stats", case, "--config", str(config)).returncode == 1


def write_config(tmp: Path, target: URL, ledger: URL) -> Path:
    from tests.test_resume import write_config as resume_config

    return resume_config(tmp, target, url_text(ledger))


def capgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capgate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.crash
def test_resume_chooses_the_latest_eligible_step_not_the_latest_recorded(
        sqlite_url: URL, gate: Callable[..., Executor], zygote: Zygote,
        tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = gate(sqlite_url, ledger)
    case = "ELIGIBLE-1"
    first = ex.call("policy.add_note", note(3), case=case, who="agent")
    second = ex.call("policy.add_note", note(1), case=case, who="agent")
    assert first.status == second.status == "applied_verified"
    engine = sa.create_engine(sqlite_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:  # policy 1 voided outside the case: step 2 no longer holds
        conn.execute(sa.text("UPDATE policy SET status = 'void' WHERE policy_id = 1"))
    engine.dispose()
    ended = zygote.run({"target": url_text(sqlite_url), "ledger": ledger,
                        "operation": "policy.add_note", "inputs": note(2), "case": case,
                        "who": "agent", "out": str(tmp_path / "out.json"),
                        "crash_at": "before_commit"})
    assert ended.killed
    report = resume(ex, case)
    assert report.exit_code == 3  # held: a completed step changed outside the case
    point = report.recovery[case]["recovery_point"]
    assert point["chosen"]["step"] == first.intent_id  # the latest eligible step
    latest = point["latest_recorded"]
    assert latest["step"] != first.intent_id and not latest["eligible"]
    assert point["chosen_is_latest"] is False
    why = {c["step"]: (c["eligible"], c["why"]) for c in point["candidates"]}
    assert why[first.intent_id][0] is True
    assert why[second.intent_id][0] is False and "unsettled" in why[second.intent_id][1]
    # eligibility is its own fact in the ledger, next to the continuation decision
    kinds = [e.kind for e in ex.ledger.events(case)]
    assert kinds[-2:] == ["recovery_point", "continuation"]
    recorded = ex.ledger.events(case)[-2].payload["recovery_point"]
    assert recorded["chosen"]["step"] == first.intent_id
    decision = ex.ledger.events(case)[-1].payload["continuation"]
    assert decision["decision"] == "withheld" and decision["after"] == "resume"
    assert "changed outside the case" in decision["why"]
    stats = ledger_stats(ex.ledger, [case]).cases[0]
    assert stats.decisions["withheld"] == 1
    assert stats.recoveries[0]["chosen_is_latest"] is False


def test_a_leased_rows_steps_share_their_transactions_eligibility(
        gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url)
    row_of = ex.registry.resolve
    leased = {"operation_id": "policy.cancel", "version": 2, "effect_class": "transactional",
              "status": "observed", "outcome_record": {"status": "rolled_back"}}
    landed = {"operation_id": "policy.add_note", "version": 1, "effect_class": "transactional",
              "status": "reconciled", "outcome_record": {
                  "status": "applied_verified",
                  "evidence": {"reconciled": {"marker": "present"}}}}
    probed = {**landed, "outcome_record": {"status": "applied_verified",
                                           "evidence": {"reconciled": {"probe": "present"}}}}
    point = assess([("a", landed, 1), ("b", probed, 2), ("c", leased, 3)], row_of)
    assert point.chosen is not None and point.chosen.step == "a"
    assert "marker" in point.chosen.why
    assert not point.candidates[1].eligible and "probe" in point.candidates[1].why
    steps = point.candidates[2].steps
    assert steps and all(not s["eligible"] for s in steps)
    assert [s["step"] for s in steps] == [s.name for s in row_of("policy.cancel", 2).steps]
    again = assess([("a", landed, 1), ("b", probed, 2)], row_of, rechecked={"b": True})
    assert again.chosen is not None and again.chosen.step == "b"  # its checks hold now


def test_a_multi_object_ddl_plans_recovery_point_is_its_latest_verified_object() -> None:
    objects = [{"object": "v_a", "state": "applied"}, {"object": "v_b", "state": "applied"},
               {"object": "v_c", "state": "not_applied", "evidence": "live = snapshot"}]
    point = ddl_objects(objects, {"v_a": True, "v_b": False, "v_c": False},
                        recorded=["v_a", "v_b"])
    assert point["chosen"]["step"] == "v_a"  # v_b landed but does not verify
    assert point["latest_recorded"]["step"] == "v_b" and point["chosen_is_latest"] is False
    assert [c["eligible"] for c in point["candidates"]] == [True, False, False]
