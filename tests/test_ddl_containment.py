"""Smoke calls that cannot write, and a recorded outcome the catalog never contradicts.

PostgreSQL: a smoke call that is ``COMMIT``, or several statements, committed in the
middle of verification and the change was then recorded ``rolled_back`` while the new
code stayed live (and the smoke's ``UPDATE`` was committed).  Now such SQL is refused
when the plan is made (CG531, recorded in the case), each smoke call runs as one
statement over the extended protocol in a read-only savepoint, and a rollback is
recorded only when the catalog shows the snapshots again -- otherwise the change is
compensated and, when code run during verification left its containment, escalated.

MariaDB: smoke calls ran in ``START TRANSACTION READ ONLY``, which a procedure escapes
with ``COMMIT`` + ``START TRANSACTION [READ WRITE]``, and DDL as smoke SQL persisted.
Now DDL and other non-read statements are refused at plan time, and each call runs in a
session of its own inside a read-only XA transaction that is rolled back.

Every failure path ends with :func:`assert_record_matches_catalog`: verify fails, a
smoke call fails, a smoke call tries to commit or write, the rollback does not restore,
compensation fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from capgate.ddl.catalog_postgresql import PostgresqlAdapter
from capgate.ddl.results import SmokeCall
from capgate.registry.errors import SmokeNotContained, UnknownPlan
from tests.ddl_support import (
    Rig,
    approve,
    assert_record_matches_catalog,
    events,
    execute,
    execute_each,
    intent_of,
    row,
    scalar,
)
from tests.fix_db import ensure_plpgsql_check

# --- PostgreSQL --------------------------------------------------------------------------------

PG_PREMIUM = """CREATE OR REPLACE FUNCTION premium(x numeric) RETURNS numeric
LANGUAGE plpgsql AS $$
BEGIN
  RETURN x * 1.10;
END $$;
"""
PG_SCHEMA = PG_PREMIUM + """
CREATE TABLE pol (id int PRIMARY KEY, base numeric NOT NULL);
INSERT INTO pol VALUES (1, 100), (2, 200);
CREATE TABLE audit (x int);
CREATE FUNCTION noisy() RETURNS int LANGUAGE plpgsql AS $$
BEGIN INSERT INTO audit VALUES (1); RETURN 1; END $$;
CREATE PROCEDURE commits() LANGUAGE plpgsql AS $$
BEGIN COMMIT; INSERT INTO audit VALUES (2); COMMIT; END $$;
"""
PG_NEW = PG_PREMIUM.replace("1.10", "1.20")


@pytest.fixture
def pg_rig(pg_url: URL, tmp_path: Path) -> tuple[Rig, URL]:
    ensure_plpgsql_check(pg_url)
    execute(pg_url, PG_SCHEMA)
    return Rig(tmp_path, {"code": (pg_url, "dev")},
               [row("code.premium", [("function", "premium")])]), pg_url


UNCONTAINABLE_PG = [
    "COMMIT",
    "SELECT premium(100); COMMIT; UPDATE pol SET base = 0",
    "ROLLBACK",
    "SAVEPOINT s1",
    "RELEASE SAVEPOINT sa_savepoint_1",
    "SET transaction_read_only = off",
    "UPDATE pol SET base = 0",
    "WITH gone AS (DELETE FROM pol RETURNING *) SELECT count(*) FROM gone",
    "SELECT * INTO pol_copy FROM pol",
    "DO $$ BEGIN UPDATE pol SET base = 0; END $$",
    "CREATE TABLE x (y int)",
]


@pytest.mark.parametrize("sql", UNCONTAINABLE_PG)
def test_pg_a_smoke_call_that_could_commit_or_write_is_refused_when_planned(
        pg_rig: tuple[Rig, URL], sql: str) -> None:
    rig, url = pg_rig
    with rig.service() as svc:
        with pytest.raises(SmokeNotContained) as exc:
            svc.plan("code.premium", [PG_NEW], case="SMK", who="agent",
                     smoke=[SmokeCall("s", sql)])
        assert exc.value.code == "CG531" and exc.value.details["smoke"] == "s"
        refused = [p for k, p in events(svc.executor, "SMK") if k == "ddl.refused"]
        assert refused and refused[-1]["code"] == "CG531", events(svc.executor, "SMK")
        assert not [k for k, _ in events(svc.executor, "SMK") if k == "ddl.planned"]
    assert scalar(url, "SELECT premium(100)") == 110
    assert scalar(url, "SELECT sum(base) FROM pol") == 300


def test_pg_the_plan_text_lists_every_smoke_call_and_its_hash_covers_them(
        pg_rig: tuple[Rig, URL]) -> None:
    from capgate.handlers.ddl import _plan_text

    rig, _ = pg_rig
    with rig.service() as svc:
        a = svc.plan("code.premium", [PG_NEW], case="TXT", who="agent",
                     smoke=[SmokeCall("premium of 100", "SELECT premium(:x)", 120, {"x": 100})])
        b = svc.plan("code.premium", [PG_NEW], case="TXT", who="agent",
                     smoke=[SmokeCall("premium of 100", "SELECT premium(:x)", 121, {"x": 100})])
    text = _plan_text(a)
    assert "smoke calls: 1" in text, text
    assert "premium of 100: SELECT premium(:x)" in text and "expect 120" in text, text
    assert '"x": 100' in text, text
    assert a.plan_hash != b.plan_hash  # the expected value is part of what is approved


def test_pg_a_committing_smoke_call_that_got_past_the_plan_is_never_a_false_rollback(
        pg_rig: tuple[Rig, URL], monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault fixture: the plan-time refusal is switched off, as for a plan recorded by
    an older capgate.  ``COMMIT`` sent over the extended protocol still ends the
    verification transaction; the loop sees that the transaction is not the same one,
    compensates, and escalates -- the catalog and the record agree."""
    rig, url = pg_rig
    monkeypatch.setattr(PostgresqlAdapter, "check_smoke", lambda self, name, sql: None,
                        raising=False)
    with rig.service() as svc:
        plan = svc.plan("code.premium", [PG_NEW], case="ESC", who="agent",
                        smoke=[SmokeCall("commit", "COMMIT")])
        approve(svc, plan.plan_hash)
        outcome, result = svc.apply(plan.plan_hash, case="ESC", who="agent")
        assert outcome.status != "rolled_back", outcome.to_dict()
        assert outcome.status == "compensation_failed", outcome.to_dict()
        assert result is not None and result.restored is not True
        causes = outcome.to_dict()["evidence"]["compensation"]["causes"]
        assert any("left its containment" in c for c in causes), causes
        kinds = [k for k, _ in events(svc.executor, "ESC")]
        assert "ddl.rollback_incomplete" in kinds and "ddl.rolled_back" not in kinds, kinds
        assert assert_record_matches_catalog(svc, "ESC", intent_of(svc, "ESC", plan.plan_hash)) \
            == "compensation_failed"
    assert scalar(url, "SELECT premium(100)") == 110  # the code was restored all the same


@pytest.mark.parametrize("sql,why", [
    ("SELECT noisy()", "read-only"),
    ("CALL commits()", "transaction termination"),
    ("SELECT premium(100); UPDATE pol SET base = 0", "multiple commands"),
])
def test_pg_smoke_code_that_writes_or_commits_leaves_nothing_and_is_recorded_truly(
        pg_rig: tuple[Rig, URL], monkeypatch: pytest.MonkeyPatch, sql: str, why: str) -> None:
    rig, url = pg_rig
    # the multi-statement one is refused at plan time; here it is let through to show
    # that the extended protocol would not run its second statement either
    monkeypatch.setattr(PostgresqlAdapter, "check_smoke", lambda self, name, sql: None,
                        raising=False)
    with rig.service() as svc:
        plan = svc.plan("code.premium", [PG_NEW], case="WR", who="agent",
                        smoke=[SmokeCall("writes", sql)])
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="WR", who="agent")
        assert outcome.status == "rolled_back", outcome.to_dict()
        detail = outcome.to_dict()["evidence"]["verify"]["checks"][-1]["detail"]
        assert why in detail, detail
        assert assert_record_matches_catalog(svc, "WR", intent_of(svc, "WR", plan.plan_hash)) \
            == "rolled_back"
    assert scalar(url, "SELECT count(*) FROM audit") == 0
    assert scalar(url, "SELECT sum(base) FROM pol") == 300
    assert scalar(url, "SELECT premium(100)") == 110


def test_pg_a_failed_verify_and_a_failed_smoke_are_recorded_as_the_catalog_shows(
        pg_rig: tuple[Rig, URL]) -> None:
    rig, url = pg_rig
    execute(url, "CREATE VIEW v_prem AS SELECT id, premium(base) AS p FROM pol")
    broken = PG_PREMIUM.replace("RETURN x * 1.10;", "RETURN x * missing_rate;")
    with rig.service() as svc:
        for case, source, smoke in (
                ("VF", broken, []),
                ("SF", PG_NEW, [SmokeCall("wrong", "SELECT premium(100)", 999)])):
            plan = svc.plan("code.premium", [source], case=case, who="agent", smoke=smoke)
            approve(svc, plan.plan_hash)
            outcome, _ = svc.apply(plan.plan_hash, case=case, who="agent")
            assert outcome.status == "rolled_back", outcome.to_dict()
            assert assert_record_matches_catalog(svc, case, intent_of(
                svc, case, plan.plan_hash)) == "rolled_back"
    assert scalar(url, "SELECT premium(100)") == 110


# --- MariaDB ----------------------------------------------------------------------------------

MARIA_PREMIUM = "CREATE OR REPLACE FUNCTION premium(x INT) RETURNS INT RETURN x + 10"
MARIA_NEW = MARIA_PREMIUM.replace("x + 10", "x + 20")
MARIA_SETUP = [
    "CREATE TABLE t (x INT) ENGINE=InnoDB",
    "INSERT INTO t VALUES (1), (2)",
    MARIA_PREMIUM,
    "CREATE PROCEDURE p_commit() BEGIN COMMIT; START TRANSACTION; INSERT INTO t VALUES (3); "
    "COMMIT; END",
    "CREATE PROCEDURE p_read_write() BEGIN COMMIT; START TRANSACTION READ WRITE; "
    "INSERT INTO t VALUES (3); COMMIT; END",
    "CREATE PROCEDURE p_session_rw() BEGIN COMMIT; SET SESSION TRANSACTION READ WRITE; "
    "START TRANSACTION; INSERT INTO t VALUES (3); COMMIT; END",
    "CREATE PROCEDURE p_tables() BEGIN DROP TABLE IF EXISTS zz; CREATE TABLE zz (y INT); END",
    "CREATE PROCEDURE p_handler() BEGIN DECLARE CONTINUE HANDLER FOR SQLEXCEPTION BEGIN END; "
    "COMMIT; START TRANSACTION READ WRITE; INSERT INTO t VALUES (3); COMMIT; END",
]


@pytest.fixture
def maria_rig(mariadb_url: URL, tmp_path: Path) -> tuple[Rig, URL]:
    execute_each(mariadb_url, MARIA_SETUP)
    return Rig(tmp_path, {"code": (mariadb_url, "dev")},
               [row("code.premium", [("function", "premium")])]), mariadb_url


def _tables(url: URL) -> list[str]:
    import sqlalchemy as sa

    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        names = sorted(str(r[0]) for r in conn.execute(sa.text("SHOW TABLES")))
    eng.dispose()
    return names


@pytest.mark.parametrize("proc", ["p_commit", "p_read_write", "p_session_rw", "p_tables",
                                  "p_handler"])
def test_maria_a_smoke_procedure_that_commits_or_changes_tables_keeps_nothing(
        maria_rig: tuple[Rig, URL], proc: str) -> None:
    rig, url = maria_rig
    tables = _tables(url)
    with rig.service() as svc:
        plan = svc.plan("code.premium", [MARIA_NEW], case="M1", who="agent",
                        smoke=[SmokeCall("calls " + proc, f"CALL {proc}()")])
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="M1", who="agent")
        assert outcome.status == "compensated", outcome.to_dict()
        assert assert_record_matches_catalog(svc, "M1", intent_of(svc, "M1", plan.plan_hash)) \
            == "compensated"
    assert scalar(url, "SELECT count(*) FROM t") == 2
    assert _tables(url) == tables
    assert scalar(url, "SELECT premium(100)") == 110


@pytest.mark.parametrize("sql", [
    "CREATE TABLE zz2 (a INT)",
    "DROP TABLE t",
    "INSERT INTO t VALUES (9)",
    "COMMIT",
    "XA START 'x'",
    "SET SESSION TRANSACTION READ WRITE",
    "SELECT premium(1); INSERT INTO t VALUES (9)",
    "SELECT x INTO OUTFILE '/tmp/capgate-smoke.txt' FROM t",
])
def test_maria_ddl_and_other_writes_as_smoke_sql_are_refused_when_planned(
        maria_rig: tuple[Rig, URL], sql: str) -> None:
    rig, url = maria_rig
    tables = _tables(url)
    with rig.service() as svc:
        with pytest.raises(SmokeNotContained):
            svc.plan("code.premium", [MARIA_NEW], case="M2", who="agent",
                     smoke=[SmokeCall("bad", sql)])
        with pytest.raises(UnknownPlan):
            svc.executor.ledger.get_plan("sha256:" + "0" * 64)
        assert [p["code"] for k, p in events(svc.executor, "M2") if k == "ddl.refused"] == [
            "CG531"]
    assert _tables(url) == tables and scalar(url, "SELECT count(*) FROM t") == 2


def test_maria_a_smoke_call_that_passes_reports_its_value(maria_rig: tuple[Rig, URL]) -> None:
    rig, url = maria_rig
    with rig.service() as svc:
        plan = svc.plan("code.premium", [MARIA_NEW], case="M3", who="agent",
                        smoke=[SmokeCall("premium", "SELECT premium(:x)", 120, {"x": 100})])
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="M3", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        assert assert_record_matches_catalog(svc, "M3", intent_of(svc, "M3", plan.plan_hash)) \
            == "applied_verified"
    assert scalar(url, "SELECT premium(100)") == 120


def test_maria_a_recorded_plan_with_an_uncontainable_smoke_is_refused_before_any_ddl(
        maria_rig: tuple[Rig, URL], monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan recorded before the plan-time rule (here: planned with the rule switched off)
    is refused at apply before the DDL -- on MariaDB, whose DDL commits, a refusal after it
    would leave the change live."""
    from capgate.ddl.catalog_mariadb import MariadbAdapter

    rig, url = maria_rig
    with rig.service() as svc:
        with monkeypatch.context() as m:
            m.setattr(MariadbAdapter, "check_smoke", lambda self, name, sql: None,
                      raising=False)
            plan = svc.plan("code.premium", [MARIA_NEW], case="M4", who="agent",
                            smoke=[SmokeCall("ddl", "CREATE TABLE zz3 (a INT)")])
        approve(svc, plan.plan_hash)
        with pytest.raises(SmokeNotContained):
            svc.apply(plan.plan_hash, case="M4", who="agent")
        state = svc.executor.ledger.intent("M4", intent_of(svc, "M4", plan.plan_hash))
        assert state["outcome"] == "rolled_back"
        assert state["outcome_record"]["reason"]["kind"] == "refused_before_apply"
        assert "ddl_apply_started" not in [k for k, _ in events(svc.executor, "M4")]
    assert scalar(url, "SELECT premium(100)") == 110 and "zz3" not in _tables(url)


def test_maria_a_failed_compensation_is_escalated_with_what_is_live(
        maria_rig: tuple[Rig, URL], monkeypatch: pytest.MonkeyPatch) -> None:
    """The last failure path: the smoke call fails, the compensation cannot re-apply the
    snapshot (a fault injected into the restore), and the record says what is live."""
    from capgate.ddl.catalog_mariadb import MariadbAdapter
    from capgate.registry.errors import ApplyFailed

    def refuse_restore(self: MariadbAdapter, *args: object, **kwargs: object) -> list[str]:
        raise ApplyFailed("the restore was refused (injected fault)")

    rig, url = maria_rig
    with rig.service() as svc:
        plan = svc.plan("code.premium", [MARIA_NEW], case="M5", who="agent",
                        smoke=[SmokeCall("wrong", "SELECT premium(100)", 999)])
        approve(svc, plan.plan_hash)
        monkeypatch.setattr(MariadbAdapter, "restore", refuse_restore)
        outcome, _ = svc.apply(plan.plan_hash, case="M5", who="agent")
        assert outcome.status == "compensation_failed", outcome.to_dict()
        assert assert_record_matches_catalog(svc, "M5", intent_of(svc, "M5", plan.plan_hash)) \
            == "compensation_failed"
    assert scalar(url, "SELECT premium(100)") == 120  # still the new code: escalated, as said
