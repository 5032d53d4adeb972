"""The DDL loop on MariaDB in ``sql_mode=ORACLE``: a package spec and body.

MariaDB's DDL commits on its own: "apply started" is reported before the DDL,
a failed verify is compensated from the snapshots, and a crash after "apply
started" is classified by comparing live signatures (a real child process,
killed with SIGKILL at a chosen boundary).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.ddl.catalog import Dependent, ObjectRef
from capgate.ddl.events import ListSink
from capgate.ddl.loop import DdlLoop
from capgate.ddl.results import Change, SmokeCall
from capgate.ddl.signature import sign
from capgate.ddl.snapshots import SqlSnapshotStore
from capgate.ddl.sqltext import strip_terminator
from capgate.registry.errors import (
    CompensationFailed,
    FeatureNotSupported,
    MergeRequired,
    RemoteDependentsWithoutFarSideStep,
    SchemaWideRecompile,
    SpecWithoutBody,
    UngreppedCallers,
)

pytestmark = pytest.mark.mariadb

REPO = Path(__file__).resolve().parents[1]
SPEC = ObjectRef("package", "billing")
BODY = ObjectRef("package_body", "billing")
ORACLE = {"sql_mode": "ORACLE"}

SPEC_V1 = """CREATE OR REPLACE PACKAGE billing AS
  FUNCTION premium(base INT) RETURN INT;
  PROCEDURE bump;
END billing;
"""
BODY_V1 = """CREATE OR REPLACE PACKAGE BODY billing AS
  -- package state: how often bump ran in this session
  calls INT := 0;
  FUNCTION premium(base INT) RETURN INT AS
  BEGIN
    RETURN base + 10;
  END;
  PROCEDURE bump AS
  BEGIN
    calls := calls + 1;
  END;
END billing;
"""
SPEC_V2 = SPEC_V1.replace("  PROCEDURE bump;\n",
                          "  PROCEDURE bump;\n  FUNCTION discount(base INT) RETURN INT;\n")
BODY_V2 = BODY_V1.replace("RETURN base + 10;", "RETURN base + 20;").replace(
    "END billing;",
    "  FUNCTION discount(base INT) RETURN INT AS\n  BEGIN\n    RETURN base - 10;\n  END;\n"
    "END billing;",
)
SETUP = [
    "CREATE TABLE pol (id INT PRIMARY KEY, base INT NOT NULL)",
    "INSERT INTO pol VALUES (1, 100), (2, 200)",
    SPEC_V1,
    BODY_V1,
    "CREATE VIEW v_prem AS SELECT id, billing.premium(base) AS p FROM pol",
    "CREATE FUNCTION doubled(x INT) RETURN INT AS BEGIN RETURN billing.premium(x) * 2; END;",
]
SMOKE = [SmokeCall("premium of 100", "SELECT billing.premium(100)", 120, session=ORACLE)]


def run(url: URL, statements: list[str], mode: str = "ORACLE") -> None:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with eng.connect() as conn:
        conn.execute(sa.text("SET SESSION sql_mode = :m"), {"m": mode})
        for stmt in statements:
            conn.exec_driver_sql(strip_terminator(stmt), execution_options={"no_parameters": True})
    eng.dispose()


def scalar(url: URL, sql: str) -> object:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        conn.execute(sa.text("SET SESSION sql_mode = 'ORACLE'"))
        value = conn.execute(sa.text(sql)).scalar()
    eng.dispose()
    return value


@pytest.fixture
def target(mariadb_url: URL) -> URL:
    run(mariadb_url, SETUP)
    return mariadb_url


@pytest.fixture
def ledger(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def loop(target: URL, ledger: str) -> Iterator[DdlLoop]:
    store = SqlSnapshotStore(ledger)
    with DdlLoop(target, store, sink=ListSink(), lock_timeout=10) as lp:
        yield lp
    store.dispose()


def sink(loop: DdlLoop) -> ListSink:
    assert isinstance(loop.sink, ListSink)
    return loop.sink


def live_signature(loop: DdlLoop, ref: ObjectRef) -> str:
    with loop.engine.connect() as conn:
        live = loop.adapter.read(conn, ref)
        if live is None:
            return "v2:absent"
        return str(sign(loop.adapter.signed_text(live.object, live.source, live.attributes)))


# --- the whole loop ---------------------------------------------------------------------------


def test_whole_loop_on_a_package_spec_and_body(loop: DdlLoop, target: URL) -> None:
    spec, body = loop.capture(SPEC), loop.capture(BODY)
    assert spec.attributes["sql_mode"].split(",").count("ORACLE") == 1
    assert "DEFINER" in body.source  # kept in the snapshot, dropped by normalisation
    plan = loop.plan(
        [Change(SPEC_V2, base_snapshot_id=spec.id), Change(BODY_V2, base_snapshot_id=body.id)],
        smoke=[*SMOKE, SmokeCall("discount", "SELECT billing.discount(100)", 90, session=ORACLE)],
    )
    assert [o["object"]["kind"] for o in plan.objects] == ["package", "package_body"]
    for o in plan.objects:
        assert o["expected_signature"] == o["new_signature"]  # packages render predictably
    assert any("holds state" in w and "calls INT := 0" in w and "ORA-04068" in w
               for w in plan.warnings)
    deps = {d["key"].rsplit(".", 1)[1]: d["via"] for d in plan.dependents}
    assert deps == {"v_prem": "source search", "doubled": "source search"}
    hits = {h["object"].rsplit(".", 1)[1] for h in plan.caller_search[0]["hits"]}
    assert {"v_prem", "doubled"} <= hits

    seen_at_hook: list[str] = []

    def apply_started(snapshot_ids: list[str]) -> None:
        assert snapshot_ids == [spec.id, body.id]
        seen_at_hook.append(live_signature(loop, BODY))
        assert "ddl.object_applied" not in sink(loop).kinds()

    outcome = loop.execute(plan, on_apply_started=apply_started)
    assert outcome.outcome == "applied_verified", outcome.to_dict()
    assert seen_at_hook == [str(body.signature)]  # the hook ran before any DDL
    kinds = sink(loop).kinds()
    assert kinds.index("ddl.apply_started") < kinds.index("ddl.object_applied")
    assert [o.applied_signature for o in outcome.objects] == [
        o["expected_signature"] for o in plan.objects]
    assert scalar(target, "SELECT billing.discount(100)") == 90
    assert scalar(target, "SELECT p FROM v_prem WHERE id = 1") == 120
    assert {s.object.rsplit(".", 1)[1]: (s.before.state if s.before else None,
                                         s.after.state if s.after else None)
            for s in outcome.statuses if s.role == "dependent"} == {
        "doubled": ("unchecked", "unchecked"), "v_prem": ("valid", "valid")}
    verdicts = {c.object.rsplit(".", 1)[1]: (c.verdict, c.checked)
                for c in outcome.verify.checks if c.name == "dependent"} if outcome.verify else {}
    # MariaDB keeps no compile status: what proves a routine works is running it -- the
    # function is called (contained), a row is fetched from the view
    assert verdicts == {"doubled": ("passed", "executed"), "v_prem": ("passed", "executed")}
    assert loop.classify(plan).classification == "applied"


def test_failed_verify_is_compensated_to_the_exact_snapshot(loop: DdlLoop, target: URL) -> None:
    body = loop.capture(BODY)
    broken = BODY_V1.replace("RETURN base + 10;",
                             "RETURN base + (SELECT MAX(rate) FROM no_such_rates);")
    plan = loop.plan([Change(broken, base_snapshot_id=body.id)], smoke=SMOKE)
    outcome = loop.execute(plan)
    assert outcome.outcome == "compensated", outcome.to_dict()
    assert outcome.error is not None and outcome.error["code"] == "CG511"
    assert "no_such_rates" in json.dumps(outcome.error)
    comp = outcome.compensation
    assert comp is not None and comp.ok and outcome.restored
    assert comp.actions[0]["action"] == "re-applied snapshot"
    assert comp.live_signatures[body.object.key] == str(body.signature)
    assert live_signature(loop, BODY) == str(body.signature)
    assert scalar(target, "SELECT billing.premium(100)") == 110
    kinds = sink(loop).kinds()
    assert kinds[-3:] == ["ddl.compensation_started", "ddl.compensated", "ddl.outcome"]


def test_dependent_broken_by_a_spec_change_is_compensated(loop: DdlLoop, target: URL) -> None:
    spec, body = loop.capture(SPEC), loop.capture(BODY)
    no_premium_spec = SPEC_V1.replace("  FUNCTION premium(base INT) RETURN INT;\n", "")
    no_premium_body = (BODY_V1.split("  FUNCTION premium")[0]
                       + "  PROCEDURE bump AS\n  BEGIN\n    calls := calls + 1;\n  END;\n"
                       "END billing;\n")
    plan = loop.plan([Change(no_premium_spec, base_snapshot_id=spec.id),
                      Change(no_premium_body, base_snapshot_id=body.id)])
    outcome = loop.execute(plan)
    assert outcome.outcome == "compensated", outcome.to_dict()
    assert outcome.verify is not None
    broken = {c.object.rsplit(".", 1)[1]: c for c in outcome.verify.failures
              if c.name == "dependent"}
    # the view (CHECK TABLE, and the row fetched) and the function that calls the removed
    # premium (called, contained) are both broken
    assert set(broken) == {"v_prem", "doubled"}
    assert "invalid" in broken["v_prem"].detail and "ran and failed" in broken["doubled"].detail
    assert live_signature(loop, SPEC) == str(spec.signature)
    assert live_signature(loop, BODY) == str(body.signature)
    assert scalar(target, "SELECT p FROM v_prem WHERE id = 2") == 210


class SabotagingSink(ListSink):
    """A sink that, when verify fails, lets another session replace the spec (which makes
    MariaDB drop the body) -- so the snapshot of the body can no longer be re-applied."""

    def __init__(self, url: URL) -> None:
        super().__init__()
        self.url = url

    def record(self, kind: str, payload: dict[str, object]) -> None:
        super().record(kind, payload)
        if kind == "ddl.verify_failed":
            saboteur = SPEC_V1.replace("PROCEDURE bump;", "PROCEDURE bump;\n  PROCEDURE audit;")
            run(self.url, [saboteur])


def test_failed_compensation_escalates_with_snapshot_and_live_signature(
    target: URL, ledger: str
) -> None:
    store = SqlSnapshotStore(ledger)
    events = SabotagingSink(target)
    with DdlLoop(target, store, sink=events) as lp:
        body = lp.capture(BODY)
        broken = BODY_V1.replace("RETURN base + 10;", "RETURN base + 11;")
        outcome = lp.execute(lp.plan([Change(broken, base_snapshot_id=body.id)], smoke=SMOKE))
    store.dispose()
    assert outcome.outcome == "compensation_failed", outcome.to_dict()
    assert outcome.restored is False
    err = outcome.error
    assert err is not None and err["code"] == "CG512"
    assert err["details"]["snapshot_ids"] == {body.object.key: body.id}
    assert err["details"]["live_signatures"] == {body.object.key: "v2:absent"}
    comp = outcome.compensation
    assert comp is not None and comp.actions[0]["action"] == "failed"
    assert "not defined in the package body" in json.dumps(comp.actions[0]["error"])
    with pytest.raises(CompensationFailed):
        outcome.raise_for_outcome()
    kinds = events.kinds()
    assert kinds.count("ddl.object_applied") == 1  # never a second, blind apply
    assert kinds[-2:] == ["ddl.compensation_failed", "ddl.outcome"]


def test_edit_by_another_session_is_refused_with_a_merge_proposal(loop: DdlLoop,
                                                                   target: URL) -> None:
    body = loop.capture(BODY)
    plan = loop.plan([Change(BODY_V1.replace("base + 10", "base + 15"),
                             base_snapshot_id=body.id)])
    run(target, [BODY_V1.replace("-- package state: how often bump ran in this session",
                                 "-- package state (hotfix by ops)")])
    theirs = live_signature(loop, BODY)
    called: list[list[str]] = []
    with pytest.raises(MergeRequired) as exc:
        loop.execute(plan, on_apply_started=called.append)
    merge = exc.value.details["merge"][0]
    assert merge["signatures"] == {"base": str(body.signature),
                                   "ours": plan.objects[0]["expected_signature"],
                                   "theirs": theirs}
    assert merge["clean"] and "base + 15" in merge["merged"] and "hotfix by ops" in merge["merged"]
    assert [c["block"] for c in merge["theirs_changed_blocks"]] == [0]
    assert called == [] and live_signature(loop, BODY) == theirs


def test_routines_views_and_triggers(loop: DdlLoop, target: URL) -> None:
    """MariaDB re-renders routine headers and rewrites views: their landing is judged by the
    stored routine body, and a view's by the signature the ledger recorded."""
    run(target, ["CREATE TABLE audit (id INT)",
                 "CREATE TRIGGER pol_audit AFTER INSERT ON pol FOR EACH ROW "
                 "INSERT INTO audit VALUES (NEW.id)"], mode="STRICT_TRANS_TABLES")
    fn = loop.capture(ObjectRef("function", "doubled"))
    assert fn.source.startswith('CREATE OR REPLACE DEFINER="root"')
    new_fn = ("CREATE OR REPLACE FUNCTION doubled(x INT) RETURN INT AS "
              "BEGIN RETURN billing.premium(x) * 3; END;")
    plan = loop.plan([Change(new_fn, base_snapshot_id=fn.id, attributes=ORACLE)])
    assert plan.objects[0]["expected_signature"] is None  # header re-rendered by MariaDB
    outcome = loop.execute(plan)
    assert outcome.outcome == "applied_verified", outcome.to_dict()
    landed = [c for c in outcome.verify.checks if c.name == "landed"] if outcome.verify else []
    assert landed[0].passed and "matches" in landed[0].detail
    assert loop.classify(plan).classification == "applied"
    assert scalar(target, "SELECT doubled(1)") == 33

    view = loop.capture(ObjectRef("view", "v_prem"))
    new_view = "CREATE OR REPLACE VIEW v_prem AS SELECT id, billing.premium(base) AS p, base " \
               "FROM pol"
    vplan = loop.plan([Change(new_view, base_snapshot_id=view.id, attributes=ORACLE)])
    voutcome = loop.execute(vplan)
    assert voutcome.outcome == "applied_verified", voutcome.to_dict()
    applied = voutcome.objects[0].applied_signature
    assert applied is not None
    assert loop.classify(vplan).classification == "unknown"  # a rewritten view proves nothing
    assert loop.classify(vplan, observed={view.object.key: applied}).classification == "applied"

    trig = loop.capture(ObjectRef("trigger", "pol_audit"))
    new_trig = ("CREATE OR REPLACE TRIGGER pol_audit AFTER INSERT ON pol FOR EACH ROW "
                "INSERT INTO audit VALUES (NEW.id * 10)")
    tplan = loop.plan([Change(new_trig, base_snapshot_id=trig.id)])
    assert tplan.objects[0]["expected_signature"] == tplan.objects[0]["new_signature"]
    assert loop.execute(tplan).outcome == "applied_verified"
    run(target, ["INSERT INTO pol VALUES (3, 300)"], mode="STRICT_TRANS_TABLES")
    assert scalar(target, "SELECT MAX(id) FROM audit") == 30


def test_capability_questions(loop: DdlLoop) -> None:
    with loop.engine.connect() as conn:
        assert loop.adapter.has_packages(conn, check=True)
        assert loop.adapter.has_compile_status(conn) is False
        with pytest.raises(FeatureNotSupported) as exc:
            loop.adapter.has_compile_status(conn, check=True)
    assert exc.value.details["feature"] == "compile status"
    assert loop.adapter.has_session_lock(check=True)


# --- prohibitions ---------------------------------------------------------------------------


def test_spec_without_body_is_refused(loop: DdlLoop) -> None:
    spec = loop.capture(SPEC)
    with pytest.raises(SpecWithoutBody) as exc:
        loop.plan([Change(SPEC_V2, base_snapshot_id=spec.id)])
    assert exc.value.code == "CG502"
    finding = exc.value.details["findings"][0]
    assert finding["details"]["missing"] == "package_body"
    assert live_signature(loop, BODY) != "v2:absent"  # nothing ran: the body is still there


def test_schema_wide_recompile_is_refused(loop: DdlLoop, target: URL) -> None:
    db = str(target.database)
    with pytest.raises(SchemaWideRecompile):
        loop.plan([Change(BODY_V1)], recompile=[f"schema:{db}"])
    with pytest.raises(SchemaWideRecompile):
        loop.plan([Change(BODY_V1)], smoke=[SmokeCall(
            "recompile all", "CALL DBMS_UTILITY.COMPILE_SCHEMA('APP')")])


def test_remote_dependents_without_far_side_step_are_refused(loop: DdlLoop) -> None:
    spec, body = loop.capture(SPEC), loop.capture(BODY)
    remote = ObjectRef("procedure", "settle_premiums", "ABACUS", link="abacus_link")
    with pytest.raises(RemoteDependentsWithoutFarSideStep) as exc:
        loop.plan([Change(SPEC_V2, base_snapshot_id=spec.id),
                   Change(BODY_V2, base_snapshot_id=body.id)],
                  remote_dependents=[Dependent(remote, spec.object, "declared")])
    assert exc.value.details["findings"][0]["details"]["dependent"] == remote.key


def test_ungrepped_callers_are_refused(loop: DdlLoop) -> None:
    with pytest.raises(UngreppedCallers):
        loop.plan([Change(BODY_V2.replace("discount", "other"))], search_callers=False)


# --- a crash after "apply started" -----------------------------------------------------------


def _run_child_until(target: URL, ledger: str, plan_path: Path, kind: str,
                     index: int) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests/data/ddl/crash_child.py"),
         target.render_as_string(hide_password=False), ledger, str(plan_path), kind,
         str(index)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buffer = b""
    deadline = time.monotonic() + 60
    try:
        while b"STOPPED\n" not in buffer and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                buffer += chunk
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    lines = buffer.decode().splitlines()
    assert lines and lines[-1] == "STOPPED", (lines, proc.stderr.read() if proc.stderr else b"")
    proc.stdout.close()
    if proc.stderr is not None:
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return lines


@pytest.mark.crash
@pytest.mark.parametrize(
    ("kind", "index", "expected"),
    [
        ("ddl.apply_started", 1, "not_applied"),
        ("ddl.object_applied", 1, "partly_applied"),
        ("ddl.object_applied", 2, "applied"),
    ],
)
def test_crash_after_apply_started_is_classified(
    loop: DdlLoop, target: URL, ledger: str, tmp_path: Path, kind: str, index: int,
    expected: str,
) -> None:
    spec, body = loop.capture(SPEC), loop.capture(BODY)
    plan = loop.plan([Change(SPEC_V2, base_snapshot_id=spec.id),
                      Change(BODY_V2, base_snapshot_id=body.id)], smoke=SMOKE)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan.to_dict()))
    lines = _run_child_until(target, ledger, plan_path, kind, index)
    assert lines[lines.index(f"HOOK {spec.id},{body.id}") + 1] == "ddl.apply_started"

    report = loop.classify(plan)
    assert report.classification == expected, report.to_dict()
    states = {o.key.split(":")[0]: o.state for o in report.objects}
    if expected == "not_applied":
        assert states == {"package": "not_applied", "package_body": "not_applied"}
        assert scalar(target, "SELECT billing.premium(100)") == 110
    elif expected == "partly_applied":
        # The new spec landed; MariaDB dropped the old body with it; the new body never ran.
        assert states == {"package": "applied", "package_body": "absent"}
        comp = loop.compensate(plan)
        assert comp.ok, comp.to_dict()
        assert live_signature(loop, SPEC) == str(spec.signature)
        assert live_signature(loop, BODY) == str(body.signature)
        assert scalar(target, "SELECT billing.premium(100)") == 110
        assert loop.classify(plan).classification == "not_applied"
    else:
        assert states == {"package": "applied", "package_body": "applied"}
        assert loop.verify(plan).passed


def test_a_routine_that_starts_running_as_its_definer_is_a_plan_warning(loop: DdlLoop,
                                                                        target: URL) -> None:
    """MariaDB runs a routine with its definer's rights unless it says SQL SECURITY INVOKER:
    a replacement that leaves the clause out is said to the approver (before: nothing)."""
    run(target, ["CREATE OR REPLACE FUNCTION tripled(x INT) RETURNS INT SQL SECURITY INVOKER "
                 "RETURN x * 3"], mode="STRICT_TRANS_TABLES")
    fn = loop.capture(ObjectRef("function", "tripled"))
    dropped = "CREATE OR REPLACE FUNCTION tripled(x INT) RETURNS INT RETURN x * 4"
    plan = loop.plan([Change(dropped, base_snapshot_id=fn.id)])
    (warned,) = [w for w in plan.warnings if "definer's rights" in w]
    assert "SQL SECURITY INVOKER" in warned and warned.startswith(fn.object.key)
    kept = ("CREATE OR REPLACE FUNCTION tripled(x INT) RETURNS INT SQL SECURITY INVOKER "
            "RETURN x * 4")
    quiet = loop.plan([Change(kept, base_snapshot_id=fn.id)])
    assert not [w for w in quiet.warnings if "definer's rights" in w], quiet.warnings
