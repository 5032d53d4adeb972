"""Dependents broken at run time do not pass verification; what nothing covers is named.

Before: a view over a ``SETOF record`` function whose result gained a column passed as
"valid (EXPLAIN)"; an SQL function reading a column whose type changed passed as "valid
(fmgr_sql_validator)"; a MariaDB view over a function that now reads a missing table
passed "valid (CHECK TABLE)"; a MariaDB function reading a column a view no longer has
was "unverified" -- and each change ended ``applied_verified``.

Now every dependent view is fetched from (a row), every dependent function that can be
called is called (no arguments; a SQL function that is not STRICT with NULL arguments),
contained and read-only, inside the verification transaction on PostgreSQL and in an XA
transaction of its own on MariaDB.  A dependent that breaks rolls the change back or
compensates it.  A dependent nothing covers is listed in the plan as ``unverified`` --
the approval of the plan's hash accepts exactly those -- and one that turns out
unverified at apply without being listed fails the verify.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from capgate.handlers.ddl import _plan_text
from tests.ddl_support import (
    Rig,
    approve,
    assert_record_matches_catalog,
    execute,
    execute_each,
    intent_of,
    row,
    scalar,
)
from tests.fix_db import ensure_plpgsql_check

# --- PostgreSQL ----------------------------------------------------------------------------------

RECS = """CREATE OR REPLACE FUNCTION recs() RETURNS SETOF record LANGUAGE sql AS $$
  SELECT id, base FROM pol
$$;
"""
PG_SCHEMA = """
CREATE TABLE pol (id int PRIMARY KEY, base numeric NOT NULL);
INSERT INTO pol VALUES (1, 100), (2, 200);
""" + RECS + """
CREATE VIEW v_recs AS SELECT * FROM recs() AS t(id int, base numeric);
CREATE FUNCTION first_base() RETURNS numeric LANGUAGE sql AS $$
  SELECT base FROM recs() AS t(id int, base numeric) ORDER BY id LIMIT 1
$$;
"""
GAINED_A_COLUMN = RECS.replace("SELECT id, base FROM pol", "SELECT id, base, base * 2 FROM pol")
TYPE_CHANGED = RECS.replace("SELECT id, base FROM pol", "SELECT id, base::text FROM pol")


@pytest.fixture
def pg_rig(pg_url: URL, tmp_path: Path) -> tuple[Rig, URL]:
    ensure_plpgsql_check(pg_url)
    execute(pg_url, PG_SCHEMA)
    return Rig(tmp_path, {"code": (pg_url, "dev")},
               [row("code.recs", [("function", "recs")])]), pg_url


@pytest.mark.parametrize("source,broken,why", [
    (GAINED_A_COLUMN, "view:", "mismatch"),
    (TYPE_CHANGED, "function:", "mismatch"),
])
def test_pg_a_dependent_that_breaks_when_it_runs_rolls_the_change_back(
        pg_rig: tuple[Rig, URL], source: str, broken: str, why: str) -> None:
    rig, url = pg_rig
    with rig.service() as svc:
        plan = svc.plan("code.recs", [source], case="RT", who="agent")
        text = _plan_text(plan)
        # the plan already knows (the new source was tried in a rolled-back savepoint)
        assert "breaks" in text and why in text, text
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="RT", who="agent")
        assert outcome.status == "rolled_back", outcome.to_dict()
        failed = [c for c in outcome.to_dict()["evidence"]["verify"]["checks"]
                  if c["verdict"] == "failed"]
        assert failed and all(c["name"] == "dependent" for c in failed), failed
        assert any(c["object"].startswith(broken) and why in c["detail"] for c in failed), failed
        assert assert_record_matches_catalog(svc, "RT", intent_of(svc, "RT", plan.plan_hash)) \
            == "rolled_back"
    assert scalar(url, "SELECT count(*) FROM v_recs") == 2
    assert scalar(url, "SELECT first_base()") == 100


def test_pg_the_dependents_that_run_fine_are_passed_as_executed(
        pg_rig: tuple[Rig, URL]) -> None:
    rig, _ = pg_rig
    same_shape = RECS.replace("SELECT id, base FROM pol", "SELECT id, base + 0 FROM pol")
    with rig.service() as svc:
        plan = svc.plan("code.recs", [same_shape], case="OK", who="agent")
        assert plan.to_dict()["unverified"] == [], plan.to_dict()["unverified"]
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="OK", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        deps = {c["object"].split(".", 1)[1]: c for c in
                outcome.to_dict()["evidence"]["verify"]["checks"] if c["name"] == "dependent"}
        assert deps["v_recs"]["checked"] == "executed" and deps["v_recs"]["verdict"] == "passed"
        assert deps["first_base()"]["checked"] == "executed"


def test_pg_a_dependent_nothing_covers_is_listed_and_only_then_accepted(
        pg_rig: tuple[Rig, URL]) -> None:
    rig, url = pg_rig
    # a STRICT SQL function with an argument: no call runs its body, fmgr_sql_validator
    # only plans it -- unverified, and the plan says so
    execute(url, "CREATE FUNCTION base_of(p int) RETURNS numeric LANGUAGE sql STRICT AS $$ "
                 "SELECT base FROM recs() AS t(id int, base numeric) WHERE id = p $$")
    same_shape = RECS.replace("SELECT id, base FROM pol", "SELECT id, base + 0 FROM pol")
    with rig.service() as svc:
        plan = svc.plan("code.recs", [same_shape], case="UV", who="agent")
        listed = {u["object"].split(".", 1)[1]: u for u in plan.to_dict()["unverified"]}
        assert set(listed) == {"base_of(integer)"}, listed
        assert "STRICT" in listed["base_of(integer)"]["why"]
        text = _plan_text(plan)
        assert "unverified: 1" in text and "base_of(integer)" in text, text
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="UV", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        (check,) = [c for c in outcome.to_dict()["evidence"]["verify"]["checks"]
                    if c["object"].endswith("base_of(integer)")]
        assert check["verdict"] == "unverified", check


def test_pg_an_unverified_dependent_the_plan_did_not_list_fails_the_verify(
        pg_rig: tuple[Rig, URL]) -> None:
    rig, url = pg_rig
    same_shape = RECS.replace("SELECT id, base FROM pol", "SELECT id, base + 0 FROM pol")
    with rig.service() as svc:
        plan = svc.plan("code.recs", [same_shape], case="UL", who="agent")
        assert plan.to_dict()["unverified"] == []
        approve(svc, plan.plan_hash)
        # between plan and apply the table empties: the view gives no row, so the
        # functions it applies per row would not run -- not what the approver accepted
        execute(url, "CREATE VIEW v_each AS SELECT id, first_base() AS b FROM pol")
        execute(url, "DELETE FROM pol")
        outcome, _ = svc.apply(plan.plan_hash, case="UL", who="agent")
        assert outcome.status == "rolled_back", outcome.to_dict()
        failed = [c for c in outcome.to_dict()["evidence"]["verify"]["checks"]
                  if c["verdict"] == "failed"]
        assert any("not listed as unverified" in c["detail"] for c in failed), failed
        assert assert_record_matches_catalog(svc, "UL", intent_of(svc, "UL", plan.plan_hash)) \
            == "rolled_back"


# --- MariaDB -------------------------------------------------------------------------------------

MARIA_SETUP = [
    "CREATE TABLE t (x INT PRIMARY KEY)",
    "INSERT INTO t VALUES (1), (2)",
    "CREATE TABLE other (y INT)",
    "CREATE OR REPLACE FUNCTION weight(p INT) RETURNS INT RETURN (SELECT count(*) FROM other) + p",
    "CREATE VIEW v_weight AS SELECT x, weight(x) AS w FROM t",
    "CREATE OR REPLACE VIEW v_pair AS SELECT x, x * 2 AS y FROM t",
    "CREATE FUNCTION max_y() RETURNS INT RETURN (SELECT max(y) FROM v_pair)",
]


@pytest.fixture
def maria_rig(mariadb_url: URL, tmp_path: Path) -> tuple[Rig, URL]:
    execute_each(mariadb_url, MARIA_SETUP)
    return Rig(tmp_path, {"code": (mariadb_url, "dev")},
               [row("code.weight", [("function", "weight")]),
                row("code.pair", [("view", "v_pair")])]), mariadb_url


def test_maria_a_view_over_a_function_that_now_reads_a_missing_table_is_compensated(
        maria_rig: tuple[Rig, URL]) -> None:
    rig, url = maria_rig
    reads_missing = ("CREATE OR REPLACE FUNCTION weight(p INT) RETURNS INT "
                     "RETURN (SELECT count(*) FROM nosuch) + p")
    with rig.service() as svc:
        plan = svc.plan("code.weight", [reads_missing], case="MV", who="agent")
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="MV", who="agent")
        assert outcome.status == "compensated", outcome.to_dict()
        failed = [c for c in outcome.to_dict()["evidence"]["verify"]["checks"]
                  if c["verdict"] == "failed"]
        by = {c["object"].split(".", 1)[1]: c["detail"] for c in failed}
        assert "invalid table" in by["v_weight"], by  # the row fetched from the view
        assert "nosuch" in by["weight"], by  # the function called with a NULL argument
        assert assert_record_matches_catalog(svc, "MV", intent_of(svc, "MV", plan.plan_hash)) \
            == "compensated"
    assert scalar(url, "SELECT w FROM v_weight WHERE x = 1") == 1


def test_maria_a_function_reading_a_column_the_view_lost_is_compensated(
        maria_rig: tuple[Rig, URL]) -> None:
    rig, url = maria_rig
    with rig.service() as svc:
        plan = svc.plan("code.pair", ["CREATE OR REPLACE VIEW v_pair AS SELECT x FROM t"],
                        case="MF", who="agent")
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="MF", who="agent")
        assert outcome.status == "compensated", outcome.to_dict()
        failed = [c for c in outcome.to_dict()["evidence"]["verify"]["checks"]
                  if c["verdict"] == "failed"]
        assert any(c["object"].endswith("max_y") for c in failed), failed
        assert assert_record_matches_catalog(svc, "MF", intent_of(svc, "MF", plan.plan_hash)) \
            == "compensated"
    assert scalar(url, "SELECT max_y()") == 4


def test_maria_routines_nothing_can_run_are_listed_unverified_in_the_plan(
        maria_rig: tuple[Rig, URL]) -> None:
    rig, url = maria_rig
    execute(url, "CREATE PROCEDURE uses_weight() BEGIN SELECT weight(1); END")
    with rig.service() as svc:
        plan = svc.plan("code.weight", [
            "CREATE OR REPLACE FUNCTION weight(p INT) RETURNS INT "
            "RETURN (SELECT count(*) FROM other) + p + 0"], case="MU", who="agent")
        listed = {u["object"].split(".", 1)[1] for u in plan.to_dict()["unverified"]}
        assert "uses_weight" in listed, plan.to_dict()["unverified"]
        approve(svc, plan.plan_hash)
        outcome, _ = svc.apply(plan.plan_hash, case="MU", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        checks = {c["object"].split(".", 1)[1]: c for c in
                  outcome.to_dict()["evidence"]["verify"]["checks"] if c["name"] == "dependent"}
        assert checks["v_weight"]["checked"] == "executed", checks
        assert checks["uses_weight"]["verdict"] == "unverified", checks
