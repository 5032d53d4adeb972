"""The DDL loop on PostgreSQL with plpgsql_check: a function with dependent views and functions.

PostgreSQL's DDL is transactional, so apply and verify share one transaction
and a failed verify is a rollback.  ``plpgsql_check`` is installed once per
database in ``public`` (an extension lives in one schema per database; putting
it in a test's own schema would drop it with that schema under other tests),
and the adapter finds it there through ``pg_extension``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.ddl.catalog import Dependent, ObjectRef, lock_key
from capgate.ddl.catalog_postgresql import PostgresqlAdapter
from capgate.ddl.events import ListSink
from capgate.ddl.loop import DdlLoop
from capgate.ddl.results import Change, FarSideStep, SmokeCall
from capgate.ddl.signature import sign
from capgate.ddl.snapshots import SqlSnapshotStore
from capgate.registry.errors import (
    LockNotAcquired,
    MergeRequired,
    PlanTampered,
    PlpgsqlCheckMissing,
    RemoteDependentsWithoutFarSideStep,
    SchemaWideRecompile,
    SnapshotOverwrite,
    StaleExtract,
    UngreppedCallers,
    VerifyFailed,
)
from tests.fix_db import ensure_plpgsql_check

pytestmark = pytest.mark.postgresql

PREMIUM = ObjectRef("function", "premium")
PREMIUM_V1 = """CREATE OR REPLACE FUNCTION premium(x numeric) RETURNS numeric
LANGUAGE plpgsql AS $$
DECLARE
  rate numeric := 1.10;
BEGIN
  -- base rate
  RETURN x * rate;
END $$;
"""
SCHEMA_SQL = """
CREATE TABLE pol (id int PRIMARY KEY, base numeric NOT NULL);
INSERT INTO pol VALUES (1, 100), (2, 200);
CREATE VIEW v_prem AS SELECT id, premium(base) AS p FROM pol;
CREATE VIEW v_total AS SELECT sum(p) AS total FROM v_prem;
CREATE FUNCTION total() RETURNS numeric LANGUAGE plpgsql AS $$
DECLARE t numeric;
BEGIN
  SELECT sum(premium(base)) INTO t FROM pol;
  RETURN t;
END $$;
CREATE FUNCTION plus_one(y numeric) RETURNS numeric LANGUAGE sql
BEGIN ATOMIC SELECT premium(y) + 1; END;
CREATE FUNCTION stamp() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN NEW.base := premium(NEW.base); RETURN NEW; END $$;
CREATE TRIGGER pol_stamp BEFORE INSERT ON pol FOR EACH ROW EXECUTE FUNCTION stamp();
"""



@pytest.fixture
def target(pg_url: URL) -> URL:
    ensure_plpgsql_check(pg_url)
    eng = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        conn.exec_driver_sql(PREMIUM_V1 + SCHEMA_SQL, execution_options={"no_parameters": True})
    eng.dispose()
    return pg_url


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlSnapshotStore]:
    s = SqlSnapshotStore(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield s
    s.dispose()


@pytest.fixture
def loop(target: URL, store: SqlSnapshotStore) -> Iterator[DdlLoop]:
    with DdlLoop(target, store, sink=ListSink(), lock_timeout=2) as lp:
        yield lp


def sink(loop: DdlLoop) -> ListSink:
    assert isinstance(loop.sink, ListSink)
    return loop.sink


def scalar(url: URL, sql: str) -> object:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        value = conn.execute(sa.text(sql)).scalar()
    eng.dispose()
    return value


def execute(url: URL, sql: str) -> None:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        conn.exec_driver_sql(sql, execution_options={"no_parameters": True})
    eng.dispose()


def live_signature(loop: DdlLoop, ref: ObjectRef) -> str:
    with loop.engine.connect() as conn:
        live = loop.adapter.read(conn, loop.adapter.resolve(conn, ref))
        assert live is not None
        return str(sign(loop.adapter.signed_text(live.object, live.source, live.attributes)))


# --- the whole loop ------------------------------------------------------------------------------


def test_whole_loop_function_with_dependent_views_and_functions(loop: DdlLoop,
                                                                target: URL) -> None:
    snap = loop.capture(PREMIUM)
    assert snap.object.args == "numeric" and snap.exists
    assert snap.source.startswith("CREATE OR REPLACE FUNCTION ")
    new = PREMIUM_V1.replace("1.10", "1.20")
    progress: list[tuple[int, int, str]] = []
    loop.progress = lambda done, total, label: progress.append((done, total, label))
    plan = loop.plan([Change(new, base_snapshot_id=snap.id)],
                     smoke=[SmokeCall("total premium", "SELECT total()", 360)])
    deps = {d["key"].split(":", 1)[1].split(".", 1)[1]: d["via"] for d in plan.dependents}
    assert deps["v_prem"] == "pg_depend"
    assert deps["plus_one(numeric)"] == "pg_depend"
    assert deps["total()"] == "plpgsql_check"
    assert deps["stamp()"] == "plpgsql_check"
    # the trigger uses stamp(), which uses premium(): a dependent of a dependent
    (trig,) = [d for d in plan.dependents if d["key"].endswith("pol_stamp on pol")]
    assert trig["depth"] == 2 and trig["on"].endswith("stamp()")
    hits = {h["object"].split(".", 1)[1] for h in plan.caller_search[0]["hits"]}
    assert {"total()", "plus_one(numeric)", "stamp()", "v_prem"} <= hits
    obj = plan.objects[0]
    assert obj["base_signature"] == obj["live_signature"] == str(snap.signature)
    assert obj["expected_signature"] != obj["new_signature"]  # the catalog re-renders the header
    assert obj["changed_blocks"][0]["block"] == 0
    assert all(p["passed"] for p in plan.prohibitions)
    assert plan.approval["required"]
    assert progress and progress[-1][0] == progress[-1][1]  # the sweep reported its progress

    outcome = loop.execute(plan)
    assert outcome.outcome == "applied_verified", outcome.to_dict()
    assert outcome.objects[0].applied_signature == obj["expected_signature"]
    assert live_signature(loop, PREMIUM) == obj["expected_signature"]
    assert scalar(target, "SELECT premium(100)") == 120
    statuses = {s.object.split(".", 1)[1]: (s.role, s.before.state if s.before else None,
                                            s.after.state if s.after else None)
                for s in outcome.statuses}
    assert statuses["premium(numeric)"] == ("changed", "valid", "valid")
    assert statuses["total()"] == ("dependent", "valid", "valid")
    assert statuses["v_prem"] == ("dependent", "valid", "valid")
    assert sink(loop).kinds() == ["ddl.captured", "ddl.planned", "ddl.preflight",
                                  "ddl.apply_started", "ddl.object_applied", "ddl.verified",
                                  "ddl.committed", "ddl.captured", "ddl.outcome"]
    assert outcome.new_bases == {obj["key"]: sink(loop).of("ddl.captured")[-1]["snapshot_id"]}
    report = loop.verify(plan)
    assert report.passed


def test_failed_verify_rolls_back_to_the_exact_snapshot(loop: DdlLoop, target: URL) -> None:
    snap = loop.capture(PREMIUM)
    broken = PREMIUM_V1.replace("RETURN x * rate;",
                                "RETURN x * (SELECT factor FROM no_such_rates LIMIT 1);")
    plan = loop.plan([Change(broken, base_snapshot_id=snap.id)])
    outcome = loop.execute(plan)
    assert outcome.outcome == "rolled_back"
    assert outcome.restored is True
    assert outcome.error is not None and outcome.error["code"] == "CG511"
    failed = [c for c in outcome.verify.checks if not c.passed] if outcome.verify else []
    assert failed and "no_such_rates" in failed[0].detail
    assert live_signature(loop, PREMIUM) == str(snap.signature)
    assert scalar(target, "SELECT premium(100)") == pytest.approx(110)
    with pytest.raises(VerifyFailed):
        outcome.raise_for_outcome()
    assert "ddl.rolled_back" in sink(loop).kinds()
    assert "ddl.committed" not in sink(loop).kinds()


def test_failed_smoke_call_rolls_back(loop: DdlLoop) -> None:
    snap = loop.capture(PREMIUM)
    plan = loop.plan([Change(PREMIUM_V1.replace("1.10", "2.00"), base_snapshot_id=snap.id)],
                     smoke=[SmokeCall("premium of 100", "SELECT premium(:x)", 110, {"x": 100})])
    outcome = loop.execute(plan)
    assert outcome.outcome == "rolled_back" and outcome.restored
    assert live_signature(loop, PREMIUM) == str(snap.signature)


def test_edit_by_another_session_is_refused_with_a_merge_proposal(loop: DdlLoop,
                                                                   target: URL) -> None:
    snap = loop.capture(PREMIUM)
    ours = PREMIUM_V1.replace("rate numeric := 1.10;", "rate numeric := 1.25;")
    plan = loop.plan([Change(ours, base_snapshot_id=snap.id)])
    theirs = PREMIUM_V1.replace("-- base rate", "-- base rate, reviewed by finance")
    execute(target, theirs)  # another session saves in between
    theirs_sig = live_signature(loop, PREMIUM)
    with pytest.raises(MergeRequired) as exc:
        loop.execute(plan)
    err = exc.value
    assert err.code == "CG513"
    (merge,) = err.details["merge"]
    assert merge["base_snapshot_id"] == snap.id
    assert merge["signatures"]["base"] == str(snap.signature)
    assert merge["signatures"]["theirs"] == theirs_sig
    assert merge["clean"], merge
    assert "1.25" in merge["merged"] and "reviewed by finance" in merge["merged"]
    assert live_signature(loop, PREMIUM) == theirs_sig  # nothing applied
    assert "ddl.apply_started" not in sink(loop).kinds()

    # The same edit made *before* planning is a stale extract, refused at plan time.
    with pytest.raises(StaleExtract) as stale:
        loop.plan([Change(ours, base_snapshot_id=snap.id)])
    assert stale.value.code == "CG501"
    assert stale.value.details["merge"][0]["clean"]

    # Conflicting edits of the same line are marked, never resolved.
    execute(target, PREMIUM_V1.replace("1.10", "1.30"))
    snap2 = loop.capture(PREMIUM)
    plan2 = loop.plan([Change(PREMIUM_V1.replace("1.10", "1.40"), base_snapshot_id=snap2.id)])
    execute(target, PREMIUM_V1.replace("1.10", "1.50"))
    with pytest.raises(MergeRequired) as exc2:
        loop.execute(plan2)
    merge2 = exc2.value.details["merge"][0]
    assert merge2["conflicts"] == 1 and "<<<<<<< ours" in merge2["merged"]


# --- prohibitions -------------------------------------------------------------------------------


def test_schema_wide_recompile_is_refused(loop: DdlLoop) -> None:
    with pytest.raises(SchemaWideRecompile) as exc:
        loop.plan([Change(PREMIUM_V1)], recompile=["*"])
    assert exc.value.code == "CG503"
    assert "ddl.refused" in sink(loop).kinds()


def test_ungrepped_callers_is_refused(loop: DdlLoop) -> None:
    with pytest.raises(UngreppedCallers) as exc:
        loop.plan([Change(PREMIUM_V1)], search_callers=False)
    assert exc.value.code == "CG505"
    plan = loop.plan([Change(PREMIUM_V1)], search_callers=False, refuse=False)
    with pytest.raises(UngreppedCallers):
        loop.execute(plan)  # the same check runs again on the plan's data


def test_snapshot_overwrite_is_refused(loop: DdlLoop, store: SqlSnapshotStore) -> None:
    snap = loop.capture(PREMIUM)
    assert loop.capture(PREMIUM).id == snap.id  # identical content: a no-op
    with pytest.raises(SnapshotOverwrite) as exc:
        store.put(dataclasses.replace(snap, source=snap.source.replace("1.10", "9.99")))
    assert exc.value.code == "CG506"


@pytest.fixture
def far_url(pg_admin_url: URL) -> Iterator[URL]:
    """A second database place standing for the far side of a database link."""
    schema = f"cgt_far_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_admin_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    query = dict(pg_admin_url.query)
    query["options"] = f"-csearch_path={schema}"
    url = pg_admin_url.set(query=query)
    execute(url, "CREATE FUNCTION settle(x numeric) RETURNS numeric LANGUAGE plpgsql "
                 "AS $$ BEGIN RETURN x; END $$")
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def test_remote_dependents_need_a_far_side_step(target: URL, store: SqlSnapshotStore,
                                                far_url: URL) -> None:
    far_schema = str(far_url.query["options"]).split("=", 1)[1]
    remote = ObjectRef("function", "settle", far_schema, "numeric", link="abacus")
    with DdlLoop(target, store, far_side={"abacus": far_url}, lock_timeout=2) as lp:
        snap = lp.capture(PREMIUM)
        declared = [Dependent(remote, snap.object, "declared")]
        new = PREMIUM_V1.replace("1.10", "1.20")
        with pytest.raises(RemoteDependentsWithoutFarSideStep) as exc:
            lp.plan([Change(new, base_snapshot_id=snap.id)], remote_dependents=declared)
        assert exc.value.code == "CG504"
        assert exc.value.details["findings"][0]["details"]["link"] == "abacus"

        step = FarSideStep("recheck settle on abacus", "abacus", remote,
                           "SELECT settle(5)", expect=5)
        plan = lp.plan([Change(new, base_snapshot_id=snap.id)], remote_dependents=declared,
                       far_side_steps=[step])
        outcome = lp.execute(plan)
        assert outcome.outcome == "applied_verified", outcome.to_dict()
        assert outcome.verify is not None
        far = [c for c in outcome.verify.checks if c.name.startswith("far_side:")]
        assert far and far[0].passed

        # A far-side assertion that fails after the commit is compensated, not rolled back.
        snap2 = lp.capture(PREMIUM)
        bad_step = FarSideStep("recheck settle on abacus", "abacus", remote,
                               "SELECT settle(5)", expect=6)
        plan2 = lp.plan([Change(PREMIUM_V1.replace("1.10", "1.30"), base_snapshot_id=snap2.id)],
                        remote_dependents=declared, far_side_steps=[bad_step])
        outcome2 = lp.execute(plan2)
        assert outcome2.outcome == "compensated", outcome2.to_dict()
        assert outcome2.restored
        assert live_signature(lp, PREMIUM) == str(snap2.signature)


# --- capabilities, locks, tampering ------------------------------------------------------------


def test_missing_plpgsql_check_is_named(pg_admin_url: URL) -> None:
    db = f"cgt_noext_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_admin_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{db}"'))
    url = pg_admin_url.set(database=db)
    try:
        execute(url, "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql "
                     "AS $$ BEGIN RETURN 1; END $$")
        ad = PostgresqlAdapter()
        eng = ad.engine(url)
        with eng.connect() as conn:
            assert ad.has_compile_status(conn) is False
            with pytest.raises(PlpgsqlCheckMissing) as exc:
                ad.has_compile_status(conn, check=True)
            assert "plpgsql_check" in exc.value.message and exc.value.code == "CG520"
            with pytest.raises(PlpgsqlCheckMissing):
                ad.status(conn, ObjectRef("function", "f", "public", ""))
        eng.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin.dispose()


def test_lock_held_elsewhere_refuses_the_apply(loop: DdlLoop) -> None:
    snap = loop.capture(PREMIUM)
    plan = loop.plan([Change(PREMIUM_V1.replace("1.10", "1.20"), base_snapshot_id=snap.id)])
    other = loop.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    name = lock_key(loop.dialect, snap.object)
    assert loop.adapter.acquire_lock(other, name, 1)
    loop.lock_timeout = 0.5
    try:
        t0 = time.monotonic()
        with pytest.raises(LockNotAcquired) as exc:
            loop.execute(plan)
        assert exc.value.code == "CG521" and exc.value.retryable
        assert time.monotonic() - t0 >= 0.45
    finally:
        loop.adapter.release_lock(other, name)
        other.close()
    assert loop.execute(plan).outcome == "applied_verified"


def test_tampered_or_misdirected_plan_is_refused(loop: DdlLoop, store: SqlSnapshotStore,
                                                 far_url: URL) -> None:
    plan = loop.plan([Change(PREMIUM_V1.replace("1.10", "1.20"))])
    edited = {**plan.to_dict(), "objects": [{**plan.objects[0],
                                   "new_source": PREMIUM_V1.replace("1.10", "5.00")}]}
    with pytest.raises(PlanTampered):
        loop.execute(edited)
    with DdlLoop(far_url, store) as elsewhere, pytest.raises(PlanTampered, match="not for"):
        elsewhere.execute(plan)


def test_views_and_triggers_are_captured_and_replaced(loop: DdlLoop, target: URL) -> None:
    view = loop.capture(ObjectRef("view", "v_prem"))
    assert view.source.startswith("CREATE OR REPLACE VIEW ")
    trig = loop.capture(ObjectRef("trigger", "pol_stamp"))
    assert trig.object.parent == "pol"
    assert trig.source.startswith("CREATE OR REPLACE TRIGGER pol_stamp BEFORE INSERT")
    new_view = "CREATE OR REPLACE VIEW v_prem AS SELECT id, premium(base) AS p, base FROM pol"
    plan = loop.plan([Change(new_view, base_snapshot_id=view.id)])
    assert {d["key"].rsplit(".", 1)[1] for d in plan.dependents} >= {"v_total"}
    assert loop.execute(plan).outcome == "applied_verified"
    assert scalar(target, "SELECT count(*) FROM v_prem WHERE base IS NOT NULL") == 2


def test_new_function_is_created_and_classified(loop: DdlLoop) -> None:
    src = "CREATE FUNCTION discount(x numeric, pct int) RETURNS numeric LANGUAGE sql " \
          "RETURN x * (100 - pct) / 100"
    plan = loop.plan([Change(src)])
    obj = plan.objects[0]
    assert obj["change"] == "create" and obj["key"].endswith("discount(numeric, integer)")
    assert loop.classify(plan).classification == "not_applied"
    assert loop.execute(plan).outcome == "applied_verified"
    assert loop.classify(plan).classification == "applied"


def test_capture_of_a_50000_line_function(loop: DdlLoop, target: URL) -> None:
    body = "\n".join(f"  v := v + {i};  -- step {i}" for i in range(49_992))
    execute(target, "CREATE FUNCTION big() RETURNS int LANGUAGE plpgsql AS $$\n"
                    f"DECLARE v int := 0;\nBEGIN\n{body}\n  RETURN v;\nEND $$")
    ref = ObjectRef("function", "big")
    with loop.engine.connect() as conn:
        ref = loop.adapter.resolve(conn, ref)
        t0 = time.perf_counter()
        live = loop.adapter.read(conn, ref)
        assert live is not None
        sig = sign(loop.adapter.signed_text(ref, live.source, live.attributes))
        elapsed = time.perf_counter() - t0
    print(f"\nPostgreSQL capture (pg_get_functiondef) + signature of {sig.lines} lines: "
          f"{elapsed * 1000:.1f} ms")
    assert sig.lines >= 50_000
    assert elapsed < 0.5
    t0 = time.perf_counter()
    snap = loop.capture(ref)
    print(f"full capture incl. storing the snapshot: {(time.perf_counter() - t0) * 1000:.1f} ms")
    assert snap.signature == sig


# --- whose rights the new source runs with --------------------------------------------------


def test_a_source_that_starts_running_as_its_owner_is_a_plan_warning(loop: DdlLoop) -> None:
    """SECURITY DEFINER gained is said to the approver, and one without a pinned search_path.

    Before, the plan showed the clause in its diff and passed every check with no
    word on what it means; a text that only mentions the clause (a comment in the
    body) says nothing, and a definer function that pins its search_path and was
    one already gets no warning.
    """
    snap = loop.capture(PREMIUM)
    definer = PREMIUM_V1.replace("LANGUAGE plpgsql AS", "LANGUAGE plpgsql SECURITY DEFINER AS")
    plan = loop.plan([Change(definer, base_snapshot_id=snap.id)])
    rights = [w for w in plan.warnings if "(SECURITY DEFINER)" in w]
    assert len(rights) == 1 and "where the live one runs with its caller's" in rights[0]
    assert any("SECURITY DEFINER without SET search_path" in w for w in plan.warnings)

    mention = PREMIUM_V1.replace("-- base rate", "-- not SECURITY DEFINER; SET search_path")
    quiet = loop.plan([Change(mention, base_snapshot_id=snap.id)])
    assert not [w for w in quiet.warnings if "SECURITY DEFINER" in w], quiet.warnings

    pinned = definer.replace("SECURITY DEFINER AS",
                             "SECURITY DEFINER SET search_path = pg_catalog AS")
    applied = loop.plan([Change(pinned, base_snapshot_id=snap.id)])
    assert [w for w in applied.warnings if "SECURITY DEFINER" in w] == [rights[0]]
    assert loop.execute(applied).outcome == "applied_verified"
    again = loop.plan([Change(pinned.replace("1.10", "1.30"))])
    assert not [w for w in again.warnings if "SECURITY DEFINER" in w], again.warnings
