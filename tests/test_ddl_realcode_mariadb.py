"""Issue 15 on MariaDB: definers, sql_mode, smoke calls that write, read-back verdicts, merges.

Fixtures of our own: routines calling each other and a view, a routine
defined by a second account created in the test, a function that writes.
Each test failed on the code before issue 15; they import only names that
existed then and compare error codes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.ddl.catalog import ObjectRef
from capgate.ddl.events import ListSink
from capgate.ddl.loop import DdlLoop
from capgate.ddl.results import Change, SmokeCall
from capgate.ddl.snapshots import SqlSnapshotStore
from capgate.registry.errors import CapgateError

pytestmark = pytest.mark.mariadb

CALC_V1 = """CREATE OR REPLACE FUNCTION calc(x INT) RETURNS INT
    DETERMINISTIC
BEGIN
  RETURN x + 10;
END"""
SETUP = [
    "CREATE TABLE pol (id INT PRIMARY KEY, base INT NOT NULL)",
    "INSERT INTO pol VALUES (1, 100), (2, 200)",
    "CREATE TABLE audit (id INT AUTO_INCREMENT PRIMARY KEY, note VARCHAR(20))",
    CALC_V1,
    "CREATE FUNCTION calc_twice(x INT) RETURNS INT DETERMINISTIC RETURN calc(calc(x))",
    "CREATE VIEW v_calc AS SELECT id, calc(base) AS c FROM pol",
    "CREATE FUNCTION log_calc(x INT) RETURNS INT MODIFIES SQL DATA "
    "BEGIN INSERT INTO audit (note) VALUES ('smoke'); RETURN calc(x); END",
]


def run(url: URL, statements: list[str], mode: str = "STRICT_TRANS_TABLES") -> None:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with eng.connect() as conn:
        conn.execute(sa.text("SET SESSION sql_mode = :m"), {"m": mode})
        for stmt in statements:
            conn.exec_driver_sql(stmt, execution_options={"no_parameters": True})
    eng.dispose()


def scalar(url: URL, sql: str) -> object:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        value = conn.execute(sa.text(sql)).scalar()
    eng.dispose()
    return value


@pytest.fixture
def target(mariadb_url: URL) -> URL:
    run(mariadb_url, SETUP)
    return mariadb_url


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlSnapshotStore]:
    s = SqlSnapshotStore(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield s
    s.dispose()


@pytest.fixture
def loop(target: URL, store: SqlSnapshotStore) -> Iterator[DdlLoop]:
    with DdlLoop(target, store, sink=ListSink(), lock_timeout=5) as lp:
        yield lp


@pytest.fixture
def other_user(mariadb_admin_url: URL, target: URL) -> Iterator[tuple[str, str]]:
    """A second MariaDB account (name, password) with rights on the test database only."""
    name = f"cgu_{uuid.uuid4().hex[:10]}"
    password = uuid.uuid4().hex[:16]
    db = target.database
    admin = sa.create_engine(mariadb_admin_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        raw = {"no_parameters": True}
        conn.exec_driver_sql(f"CREATE USER '{name}'@'%' IDENTIFIED BY '{password}'",
                             execution_options=raw)
        conn.exec_driver_sql(f"GRANT SELECT, EXECUTE, CREATE ROUTINE, ALTER ROUTINE, CREATE VIEW, "
                             f"SHOW VIEW ON `{db}`.* TO '{name}'@'%'", execution_options=raw)
    try:
        yield name, password
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP USER IF EXISTS '{name}'@'%'",
                                 execution_options={"no_parameters": True})
        admin.dispose()


# --- 1. one definition per source ----------


def test_trailing_extra_statement_is_refused_at_plan(loop: DdlLoop, target: URL) -> None:
    with pytest.raises(CapgateError) as exc:
        loop.plan([Change(CALC_V1 + ";\nCREATE TABLE x_extra (y INT);\n")])
    assert exc.value.code == "CG527"
    assert scalar(target, "SELECT COUNT(*) FROM information_schema.TABLES "
                          "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'x_extra'") == 0


# --- 8. a smoke call that writes ----------


def test_smoke_call_that_writes_is_refused_and_leaves_no_row(loop: DdlLoop, target: URL) -> None:
    plan = loop.plan([Change(CALC_V1.replace("x + 10", "x + 20"))],
                     smoke=[SmokeCall("logs", "SELECT log_calc(1)", 21)])
    outcome = loop.execute(plan)
    assert outcome.outcome == "compensated", outcome.to_dict()
    assert outcome.verify is not None
    (smoke,) = [c for c in outcome.verify.checks if c.name == "smoke:logs"]
    assert smoke.verdict == "failed" and "READ ONLY" in smoke.detail
    assert scalar(target, "SELECT COUNT(*) FROM audit") == 0
    assert scalar(target, "SELECT calc(1)") == 11  # compensated to the snapshot


# --- 9. read back is not "valid" ----------


def test_routines_that_are_only_read_back_are_unverified_not_valid(loop: DdlLoop,
                                                                   target: URL) -> None:
    run(target, ["DROP TABLE pol"])  # every call of v_calc now fails; calc_twice still runs
    report = loop.verify_object("function:calc")
    verdicts = {c.object.rsplit(".", 1)[1]: (c.verdict, c.checked) for c in report.checks
                if c.name == "dependent"}
    # what can be run is run (contained); a function that writes is refused at its write
    # and stays unverified -- MariaDB has no compile status to fall back on
    assert verdicts["calc_twice"] == ("passed", "executed")
    assert verdicts["log_calc"] == ("unverified", "read back")
    assert verdicts["v_calc"][0] == "failed"  # CHECK TABLE does see the missing table


# --- 11. a routine defined by another account ----------


def test_capture_as_an_account_that_cannot_read_the_source_is_refused(
        loop: DdlLoop, target: URL, other_user: tuple[str, str],
        store: SqlSnapshotStore) -> None:
    name, password = other_user
    as_other = target.set(username=name, password=password)
    with DdlLoop(as_other, store) as lp, pytest.raises(CapgateError) as exc:
        lp.capture(ObjectRef("function", "calc"))
    assert exc.value.code == "CG530"
    assert store.history() == []  # no snapshot holding "None"


def test_the_definer_is_kept_by_apply_and_compensation(
        loop: DdlLoop, target: URL, other_user: tuple[str, str]) -> None:
    name, _ = other_user
    run(target, [CALC_V1.replace("CREATE OR REPLACE FUNCTION",
                                 f"CREATE OR REPLACE DEFINER=`{name}`@`%` FUNCTION")])
    definer = "SELECT DEFINER FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = " \
              "DATABASE() AND ROUTINE_NAME = 'calc'"
    snap = loop.capture(ObjectRef("function", "calc"))
    assert snap.attributes["definer"] == f"{name}@%"
    plan = loop.plan([Change(CALC_V1.replace("x + 10", "x + 30"), base_snapshot_id=snap.id)])
    assert loop.execute(plan).outcome == "applied_verified"
    assert scalar(target, definer) == f"{name}@%"  # not the applying root account
    assert scalar(target, "SELECT calc(1)") == 31
    comp = loop.compensate(plan)
    assert comp.ok, comp.to_dict()
    assert scalar(target, definer) == f"{name}@%"


def test_an_account_that_may_not_set_the_definer_is_refused_at_plan(
        loop: DdlLoop, target: URL, other_user: tuple[str, str], mariadb_admin_url: URL,
        store: SqlSnapshotStore) -> None:
    name, password = other_user
    admin = sa.create_engine(mariadb_admin_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:  # it may read routine sources, but not SET USER
        conn.exec_driver_sql(f"GRANT SELECT ON mysql.proc TO '{name}'@'%'",
                             execution_options={"no_parameters": True})
    admin.dispose()
    with DdlLoop(target.set(username=name, password=password), store) as lp, \
            pytest.raises(CapgateError) as exc:
        lp.plan([Change(CALC_V1.replace("x + 10", "x + 40"))])
    assert exc.value.code == "CG529"
    assert scalar(target, "SELECT calc(1)") == 11


# --- 12. sql_mode is part of the signature ----------


def test_a_routine_recreated_under_another_sql_mode_is_drift(loop: DdlLoop, target: URL) -> None:
    snap = loop.capture(ObjectRef("function", "calc"))
    run(target, [CALC_V1], mode="STRICT_TRANS_TABLES,PIPES_AS_CONCAT")  # same text, new mode
    with pytest.raises(CapgateError) as exc:
        loop.plan([Change(CALC_V1.replace("x + 10", "x + 50"), base_snapshot_id=snap.id)])
    assert exc.value.code == "CG501"


# --- 14. a merge proposal is valid source ----------


def test_the_merge_proposal_applies_as_it_is(loop: DdlLoop, target: URL) -> None:
    snap = loop.capture(ObjectRef("function", "calc"))
    ours = CALC_V1.replace("RETURN x + 10;", "RETURN x + 60;")
    plan = loop.plan([Change(ours, base_snapshot_id=snap.id)])
    run(target, [CALC_V1.replace("    DETERMINISTIC", "    DETERMINISTIC\n    COMMENT 'ops'")])
    with pytest.raises(CapgateError) as exc:
        loop.execute(plan)
    assert exc.value.code == "CG513"
    (merge,) = exc.value.details["merge"]
    assert merge["clean"], merge
    merged = merge["merged"]
    assert merged.lstrip().upper().startswith("CREATE OR REPLACE")
    outcome = loop.execute(loop.plan([Change(merged)]))
    assert outcome.outcome == "applied_verified", outcome.to_dict()
    assert scalar(target, "SELECT calc(1)") == 61
    assert scalar(target, "SELECT ROUTINE_COMMENT FROM information_schema.ROUTINES "
                          "WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME = 'calc'") == "ops"
