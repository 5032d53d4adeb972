"""``ddl.service``: the DDL loop behind the executor's gates, in the ledger, after a crash.

In process (an executor opened from the same configuration the CLI uses):
the row's scope rules, the progress bar, a failed verify rolled back on
PostgreSQL and compensated on MariaDB (each recorded as its own outcome), a
save by another session between plan and apply (refused, nothing recorded,
the approval kept), and crashes of a real ``capgate ddl apply`` child killed
with SIGKILL after ``ddl_apply_started`` and after the first
``ddl.object_applied`` -- classified by ``classify_ddl_intent`` and settled.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from capgate.api import open as open_executor
from capgate.ddl.catalog import ObjectRef
from capgate.ddl.results import SmokeCall
from capgate.ddl.service import (
    DdlService,
    check_scope,
    classify_ddl_intent,
    in_scope,
    settle_ddl_intent,
)
from capgate.executor.call import Executor
from capgate.handlers.ddl import ProgressBar
from capgate.registry.errors import MergeRequired, ObjectOutOfScope, ReconciliationRequired
from capgate.registry.loader import load_registry
from tests.fix_capgate import KEYS
from tests.test_ddl_cli import (
    BILLING_ROW,
    BODY_V2,
    MARIADB_SETUP,
    PG_NEW,
    REPO,
    SPEC_V2,
    Cli,
    live_signature,
    make_cli,
    pg_target,
    run_sql,
    scalar,
)

ORACLE = {"sql_mode": "ORACLE"}

SCOPE_ROWS = """\
format: 1
connectors:
  code:
    description: stored code
    dialects: [postgresql, mariadb]
rows:
  - operation_id: code.calc
    version: 1
    connector: code
    description: the calc functions and the billing package
    input:
      type: object
      additionalProperties: false
      required: [source]
      properties:
        source: {type: string}
    target: {system: s, object: o}
    effect_class: ddl
    authorization: {kind: gate, approver_roles: [dba]}
    environments: [dev]
    timeout: {seconds: 60, on_timeout: unknown}
    recovery: reconcile_first
    ddl:
      objects:
        - {type: package, name: billing}
      pattern: "function:calc_*"
"""


# --- scope and progress (no database) ---------------------------------------------------------


def test_scope_objects_bodies_patterns_and_schemas(tmp_path: Path) -> None:
    (tmp_path / "rows.yaml").write_text(SCOPE_ROWS)
    row = load_registry([tmp_path], check_lock=False).resolve("code.calc", 1)
    assert in_scope(row, "package", "billing") and in_scope(row, "package", "BILLING")
    assert in_scope(row, "package_body", "billing")  # a spec entry covers its body
    assert not in_scope(row, "package", "billing2")
    assert in_scope(row, "function", "calc_premium")
    assert not in_scope(row, "procedure", "calc_premium")  # the pattern names the kind
    assert not in_scope(row, "view", "billing")
    check_scope(row, ObjectRef("function", "calc_x", "app"), "app")
    with pytest.raises(ObjectOutOfScope) as exc:
        check_scope(row, ObjectRef("function", "calc_x", "other"), "app")
    assert exc.value.code == "CG526" and exc.value.details["pattern"] == "function:calc_*"
    with pytest.raises(ObjectOutOfScope):
        check_scope(row, ObjectRef("package", "billing", link="far"), None)
    shipped = load_registry([REPO / "capabilities"], check_lock=False)
    fn_row = shipped.resolve("code.premium_due_total", 1)
    assert in_scope(fn_row, "function", "premium_due_total")
    assert not in_scope(fn_row, "view", "policy_overview")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_only_on_a_terminal() -> None:
    tty = _Tty()
    bar = ProgressBar(tty, width=10, interval=0)
    for i in range(1, 6):
        bar(i, 5, f"view:app.v{i}")
    bar.close()
    text = tty.getvalue()
    assert "[##########] 5/5 view:app.v5" in text and text.endswith("\n")
    assert text.count("\r") == 5
    plain = io.StringIO()
    quiet = ProgressBar(plain, interval=0)
    quiet(1, 5, "x")
    quiet.close()
    assert plain.getvalue() == "" and quiet.drawn == 0


# --- PostgreSQL ----------------------------------------------------------------------------------


@pytest.fixture
def pg(pg_url: URL, ledger_url: URL, tmp_path: Path
       ) -> Iterator[tuple[DdlService, Cli, URL, Path]]:
    """A PostgreSQL target; the ledger (and its snapshots) on SQLite and on PostgreSQL."""
    pg_target(pg_url)
    cli = make_cli(tmp_path, ["insurance_code"], pg_url, REPO / "capabilities",
                   ledger=ledger_url)
    with open_executor(tmp_path / "capgate.toml") as executor:
        yield DdlService(executor), cli, pg_url, tmp_path


def _approve(executor: Executor, plan_hash: str) -> None:
    executor.approve(plan_hash, by="bob", role="dba", key=KEYS["bob"])


def _events(executor: Executor, case: str, intent_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [(e.kind, dict(e.payload)) for e in executor.ledger.events(case)
            if e.intent_id == intent_id]


@pytest.mark.postgresql
def test_pg_failed_verify_is_rolled_back_and_recorded(
        pg: tuple[DdlService, Cli, URL, Path]) -> None:
    svc, _, url, _ = pg
    broken = ("CREATE OR REPLACE FUNCTION premium_due_total(p_policy_id INTEGER) "
              "RETURNS NUMERIC(12,2) LANGUAGE plpgsql AS $$\nBEGIN\n"
              "  RETURN (SELECT sum(amount) FROM no_such_premiums);\nEND $$;\n")
    plan = svc.plan("code.premium_due_total", [broken], case="C1", who="agent")
    _approve(svc.executor, plan.plan_hash)
    before = live_signature(url, "function:premium_due_total")
    outcome, result = svc.apply(plan.plan_hash, case="C1", who="agent")
    assert outcome.status == "rolled_back" and outcome.exit_code == 1
    assert result is not None and result.restored and result.error is not None
    assert live_signature(url, "function:premium_due_total") == before
    assert outcome.reason is not None and "no_such_premiums" in json.dumps(outcome.reason)
    kinds = [k for k, _ in _events(svc.executor, "C1", outcome.intent_id)]
    assert kinds[:3] == ["prepared", "ddl.preflight", "ddl_apply_started"]
    assert kinds[-3:] == ["ddl.rolled_back", "ddl.outcome", "observed"]
    assert "ddl.committed" not in kinds
    state = svc.executor.ledger.intent("C1", outcome.intent_id)
    assert state["status"] == "observed" and state["outcome"] == "rolled_back"
    (snap,) = svc.store.history()  # kept in the ledger's own store
    assert state["snapshot_ids"] == {plan.objects[0]["key"]: snap.id}
    assert svc.executor.ledger.verify().ok


@pytest.mark.postgresql
def test_pg_save_between_plan_and_apply_is_refused_before_anything_is_recorded(
        pg: tuple[DdlService, Cli, URL, Path]) -> None:
    svc, _, url, _ = pg
    plan = svc.plan("code.premium_due_total", [PG_NEW], case="C2", who="agent")
    _approve(svc.executor, plan.plan_hash)
    theirs = PG_NEW.replace("AND p.status <> 'void'", "AND p.status <> 'cancelled'")
    run_sql(url, [theirs])  # another session saves in between
    with pytest.raises(MergeRequired) as exc:
        svc.apply(plan.plan_hash, case="C2", who="agent")
    (merge,) = exc.value.details["merge"]
    assert merge["conflicts"] == 1 and "<<<<<<<" in merge["merged"]
    assert (svc.executor.ledger.snapshot("C2") or {}).get("intents") == {}
    (approval,) = svc.executor.ledger.approvals_for(plan.plan_hash)
    assert approval.used_by_intent is None  # still usable once the object is merged
    assert scalar(url, "SELECT premium_due_total(9)") > 0  # the other session's version


# --- MariaDB -------------------------------------------------------------------------------------


@pytest.fixture
def maria(mariadb_url: URL, tmp_path: Path) -> Iterator[tuple[DdlService, Cli, URL, Path]]:
    run_sql(mariadb_url, MARIADB_SETUP, mode="ORACLE")
    caps = tmp_path / "caps"
    caps.mkdir()
    (caps / "billing.yaml").write_text(BILLING_ROW)
    cli = make_cli(tmp_path, ["billing_code"], mariadb_url, caps)
    with open_executor(tmp_path / "capgate.toml") as executor:
        yield DdlService(executor), cli, mariadb_url, tmp_path


@pytest.mark.mariadb
def test_mariadb_failed_verify_is_compensated_and_recorded(
        maria: tuple[DdlService, Cli, URL, Path]) -> None:
    svc, _, url, _ = maria
    spec_before = live_signature(url, "package:billing")
    plan = svc.plan("code.billing", [SPEC_V2, BODY_V2], case="M1", who="agent",
                    smoke=[SmokeCall("premium of 100", "SELECT billing.premium(100)", 999,
                                     session=ORACLE)])
    _approve(svc.executor, plan.plan_hash)
    outcome, result = svc.apply(plan.plan_hash, case="M1", who="agent")
    assert outcome.status == "compensated", outcome.to_dict()
    assert result is not None and result.restored
    assert live_signature(url, "package:billing") == spec_before
    assert scalar(url, "SELECT billing.premium(100)", "ORACLE") == 110
    kinds = [k for k, _ in _events(svc.executor, "M1", outcome.intent_id)]
    assert kinds == ["prepared", "ddl.preflight", "ddl_apply_started", "ddl.object_applied",
                     "ddl.object_applied", "ddl.verify_failed", "ddl.compensation_started",
                     "ddl.compensated", "ddl.outcome", "observed"]
    state = svc.executor.ledger.intent("M1", outcome.intent_id)
    assert set(state["applied_signatures"]) == {o["key"] for o in plan.objects}
    assert svc.executor.ledger.verify().ok


def _crash_apply(svc: DdlService, cli: Cli, tmp: Path, case: str,
                 point: str) -> tuple[str, str]:
    (tmp / "spec.sql").write_text(SPEC_V2)
    (tmp / "body.sql").write_text(BODY_V2)
    plan = svc.plan("code.billing", [SPEC_V2, BODY_V2], case=case, who="agent")
    _approve(svc.executor, plan.plan_hash)
    cli("ddl", "apply", plan.plan_hash, "--case", case, "--as", "agent", rc=-9,
        env_extra={"CAPGATE_CRASH_AT": point})
    (intent_id,) = (svc.executor.ledger.snapshot(case) or {})["intents"]
    return str(intent_id), str(plan.plan_hash)


@pytest.mark.mariadb
@pytest.mark.crash
def test_mariadb_crash_after_apply_started_is_not_applied(
        maria: tuple[DdlService, Cli, URL, Path]) -> None:
    svc, cli, _, tmp = maria
    intent, plan_hash = _crash_apply(svc, cli, tmp, "M2", "ddl_after_apply_started")
    state = svc.executor.ledger.intent("M2", intent)
    assert state["status"] == "ddl_apply_started"
    with pytest.raises(ReconciliationRequired):
        svc.apply(plan_hash, case="M2", who="agent")  # nothing new before recovery
    classification, evidence = classify_ddl_intent(svc.executor, "M2", intent, state)
    assert classification == "not_applied" and evidence["apply_started"] is True
    assert [o["state"] for o in evidence["objects"]] == ["not_applied", "not_applied"]
    settled = settle_ddl_intent(svc.executor, "M2", intent)
    assert settled["action"] == "closed_not_applied" and settled["resolved"]
    state = svc.executor.ledger.intent("M2", intent)
    assert state["status"] == "reconciled" and state["outcome"] == "rolled_back"
    assert svc.executor.ledger.verify().ok


@pytest.mark.mariadb
@pytest.mark.crash
def test_mariadb_crash_after_the_spec_is_partly_applied_then_compensated(
        maria: tuple[DdlService, Cli, URL, Path]) -> None:
    svc, cli, url, tmp = maria
    spec_sig = live_signature(url, "package:billing")
    body_sig = live_signature(url, "package_body:billing")
    intent, _ = _crash_apply(svc, cli, tmp, "M3", "ddl_after_object_applied")
    state = svc.executor.ledger.intent("M3", intent)
    assert state["status"] == "ddl.object_applied" and len(state["applied_signatures"]) == 1
    classification, evidence = classify_ddl_intent(svc.executor, "M3", intent, state)
    # the new spec landed; MariaDB dropped the old body with it; the new body never ran
    assert classification == "partly_applied", evidence
    assert [o["state"] for o in evidence["objects"]] == ["applied", "absent"]
    settled = settle_ddl_intent(svc.executor, "M3", intent)
    assert settled["action"] == "escalated" and not settled["resolved"]
    assert svc.executor.ledger.intent("M3", intent)["escalation"]["by"] == "ddl"
    # issue 17: the plan's recovery point, its objects' eligibility recorded as a fact
    (point,) = [e.payload["recovery_point"] for e in svc.executor.ledger.events("M3")
                if e.kind == "recovery_point"]
    assert point["intent_id"] == intent
    assert [c["eligible"] for c in point["candidates"]] == [True, False]  # the body is absent
    assert point["chosen"]["step"].startswith("package:")  # the spec landed and verifies
    assert point["latest_recorded"]["step"] == point["chosen"]["step"]
    from capgate.executor.ledger.stats import ledger_stats

    (ddl_step,) = ledger_stats(svc.executor.ledger, ["M3"]).cases[0].intents
    assert (ddl_step.attempts, ddl_step.final) == (1, "unsettled")  # escalated, one apply
    result = svc.compensate("M3", intent, who="agent")
    assert result.ok and result.before.classification == "partly_applied"
    assert live_signature(url, "package:billing") == spec_sig
    assert live_signature(url, "package_body:billing") == body_sig
    state = svc.executor.ledger.intent("M3", intent)
    assert state["status"] == "observed" and state["escalation"] is None
    report = svc.executor.ledger.verify()
    assert report.ok, json.dumps(report.to_dict())
