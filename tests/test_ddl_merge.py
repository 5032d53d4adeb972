"""Merge proposals are whole documents and new gate packets; a plan that changes nothing is
refused.

Before: every error detail went through the 1,000-character excerpt limit, so a merge
proposal at apply (CG513) and at plan (CG501) ended in ``... (5740 characters)`` -- in
``details.merge[].merged`` and in the text.  A proposal is a document: whole, free of
conflict markers when the merge is clean, accepted by the engine as source.  It is also
a new source: capgate records it as a plan of its own in the case, against the live
object, which needs its own approval -- the approval of the plan it replaces cannot
apply it.  And a plan whose new source already is the live object says there is nothing
to do (CG532) instead of being recorded, approved and applied.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from capgate.cli import main
from capgate.registry.errors import (
    ApprovalRequired,
    MergeRequired,
    NothingToApply,
    StaleExtract,
)
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

STEPS = 150


def pg_long(ours: bool = False, theirs: bool = False) -> str:
    """A PL/pgSQL function of ~150 lines (~5,000 characters): step 10 is ours to change,
    step 140 the other session's."""
    lines = []
    for i in range(STEPS):
        n = i
        if i == 10 and ours:
            n = 1000
        if i == 140 and theirs:
            n = 2000
        lines.append(f"  v := v + {n};  -- step {i} of the long computation, kept as it is")
    body = "\n".join(lines)
    return (f"CREATE OR REPLACE FUNCTION long_total() RETURNS bigint LANGUAGE plpgsql AS $$\n"
            f"DECLARE v bigint := 0;\nBEGIN\n{body}\n  RETURN v;\nEND $$;\n")


BASE_TOTAL = sum(range(STEPS))


@pytest.fixture
def pg_rig(pg_url: URL, tmp_path: Path) -> tuple[Rig, URL]:
    ensure_plpgsql_check(pg_url)
    execute(pg_url, pg_long())
    return Rig(tmp_path, {"code": (pg_url, "dev")},
               [row("code.long", [("function", "long_total")])]), pg_url


def test_pg_a_merge_at_apply_is_whole_and_a_plan_of_its_own(pg_rig: tuple[Rig, URL]) -> None:
    rig, url = pg_rig
    with rig.service() as svc:
        svc.capture("code", ["function:long_total"])
        old = svc.plan("code.long", [pg_long(ours=True)], case="MG", who="agent")
        approve(svc, old.plan_hash)
        execute(url, pg_long(theirs=True))  # another session saves in between
        with pytest.raises(MergeRequired) as exc:
            svc.apply(old.plan_hash, case="MG", who="agent")
        (merge,) = exc.value.details["merge"]
        merged = merge["merged"]
        assert merge["clean"] and len(merged) > 5000, (len(merged), merged[-80:])
        assert "characters)" not in merged and "<<<<<<<" not in merged
        assert "v := v + 1000;" in merged and "v := v + 2000;" in merged
        new_hash = exc.value.details["merge_plan"]
        assert new_hash and new_hash != old.plan_hash
        record = svc.executor.ledger.get_plan(new_hash)
        assert record.case_id == "MG" and record.requester == "agent"
        # the old approval is worth nothing to the merge ...
        with pytest.raises(ApprovalRequired):
            svc.apply(new_hash, case="MG", who="agent")
        # ... and the old plan still cannot apply over the other session's save
        with pytest.raises(MergeRequired):
            svc.apply(old.plan_hash, case="MG", who="agent")
        assert scalar(url, "SELECT long_total()") == BASE_TOTAL - 140 + 2000
        approve(svc, new_hash)
        outcome, _ = svc.apply(new_hash, case="MG", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        assert assert_record_matches_catalog(svc, "MG", intent_of(svc, "MG", new_hash)) \
            == "applied_verified"
    assert scalar(url, "SELECT long_total()") == BASE_TOTAL - 10 + 1000 - 140 + 2000


def test_pg_a_stale_extract_at_plan_carries_the_whole_merge(pg_rig: tuple[Rig, URL]) -> None:
    rig, url = pg_rig
    with rig.service() as svc:
        (base,) = svc.capture("code", ["function:long_total"])
        execute(url, pg_long(theirs=True))
        with pytest.raises(StaleExtract) as exc:
            svc.plan("code.long", [pg_long(ours=True)], case="SX", who="agent",
                     bases=[base.id])
        (merge,) = exc.value.details["merge"]
        assert merge["clean"] and "characters)" not in merge["merged"]
        assert len(merge["merged"]) > 5000
        # the merged text is a source the engine accepts: it plans (rendered in a
        # rolled-back savepoint) against the live object
        plan = svc.plan("code.long", [merge["merged"]], case="SX", who="agent", fresh=True)
        assert plan.objects[0]["key"].endswith("long_total()")


def test_pg_the_apply_text_prints_the_whole_merge(pg_rig: tuple[Rig, URL]) -> None:
    rig, url = pg_rig
    with rig.service() as svc:
        svc.capture("code", ["function:long_total"])
        old = svc.plan("code.long", [pg_long(ours=True)], case="MT", who="agent")
        approve(svc, old.plan_hash)
    execute(url, pg_long(theirs=True))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["ddl", "apply", old.plan_hash, "--case", "MT", "--as", "agent",
                     "--config", str(rig.config)])
    text = err.getvalue()
    assert code == 1, text
    assert "v := v + 1000;" in text and "v := v + 2000;" in text and "characters)" not in text
    assert "the merge is plan sha256:" in text, text


def test_pg_a_source_equal_to_the_live_object_is_nothing_to_apply(
        pg_rig: tuple[Rig, URL]) -> None:
    rig, _ = pg_rig
    with rig.service() as svc:
        with pytest.raises(NothingToApply) as exc:
            svc.plan("code.long", [pg_long()], case="N0", who="agent")
        assert exc.value.code == "CG532"
        assert [p["code"] for k, p in events(svc.executor, "N0") if k == "ddl.refused"] == [
            "CG532"]
        assert not [k for k, _ in events(svc.executor, "N0") if k == "ddl.planned"]


# --- MariaDB: a package body --------------------------------------------------------------------

ORACLE = "ORACLE"
SPEC = "CREATE OR REPLACE PACKAGE calc AS\n  FUNCTION total RETURN INT;\nEND calc;\n"


def maria_body(ours: bool = False, theirs: bool = False) -> str:
    lines = []
    for i in range(STEPS):
        n = 1000 if (i == 10 and ours) else 2000 if (i == 140 and theirs) else i
        lines.append(f"    v := v + {n};  -- step {i} of the long computation, kept as it is")
    body = "\n".join(lines)
    return ("CREATE OR REPLACE PACKAGE BODY calc AS\n  FUNCTION total RETURN INT AS\n"
            f"    v INT := 0;\n  BEGIN\n{body}\n    RETURN v;\n  END;\nEND calc;\n")


@pytest.fixture
def maria_rig(mariadb_url: URL, tmp_path: Path) -> tuple[Rig, URL]:
    execute_each(mariadb_url, [SPEC, maria_body()], mode=ORACLE)
    return Rig(tmp_path, {"code": (mariadb_url, "dev")},
               [row("code.calc", [("package", "calc")])]), mariadb_url


def _total(url: URL) -> int:
    import sqlalchemy as sa

    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        conn.execute(sa.text("SET SESSION sql_mode = 'ORACLE'"))
        value = int(conn.execute(sa.text("SELECT calc.total()")).scalar_one())
    eng.dispose()
    return value


def test_maria_a_merge_at_apply_is_whole_and_a_plan_of_its_own(
        maria_rig: tuple[Rig, URL]) -> None:
    rig, url = maria_rig
    with rig.service() as svc:
        svc.capture("code", ["package_body:calc"])
        old = svc.plan("code.calc", [maria_body(ours=True)], case="MM", who="agent")
        approve(svc, old.plan_hash)
        execute(url, maria_body(theirs=True), mode=ORACLE)
        with pytest.raises(MergeRequired) as exc:
            svc.apply(old.plan_hash, case="MM", who="agent")
        (merge,) = exc.value.details["merge"]
        assert merge["clean"] and len(merge["merged"]) > 5000
        assert "characters)" not in merge["merged"] and "<<<<<<<" not in merge["merged"]
        new_hash = exc.value.details["merge_plan"]
        assert new_hash and new_hash != old.plan_hash
        with pytest.raises(ApprovalRequired):
            svc.apply(new_hash, case="MM", who="agent")
        approve(svc, new_hash)
        outcome, _ = svc.apply(new_hash, case="MM", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()
        assert assert_record_matches_catalog(svc, "MM", intent_of(svc, "MM", new_hash)) \
            == "applied_verified"
    assert _total(url) == BASE_TOTAL - 10 + 1000 - 140 + 2000


def test_maria_a_package_body_equal_to_the_live_one_is_nothing_to_apply(
        maria_rig: tuple[Rig, URL]) -> None:
    rig, _ = maria_rig
    with rig.service() as svc, pytest.raises(NothingToApply):
        svc.plan("code.calc", [maria_body()], case="N1", who="agent")


# --- every refusal at plan time is recorded in the case -----------------------------------------


@pytest.mark.parametrize("source,who,code", [
    (pg_long(ours=True) + "CREATE TABLE sneak (x int);\n", "agent", "CG527"),
    ("CREATE OR REPLACE FUNCTION other() RETURNS int LANGUAGE sql RETURN 1;", "agent", "CG526"),
    (pg_long(ours=True), "bob", "CG200"),
])
def test_pg_every_refused_plan_leaves_a_trace_in_its_case(
        pg_rig: tuple[Rig, URL], source: str, who: str, code: str) -> None:
    """Before, only a prohibition was recorded; a source that was more than one
    definition, out of the row's scope, or planned without a grant left no trace."""
    from capgate.registry.errors import CapgateError

    rig, _ = pg_rig
    with rig.service() as svc:
        with pytest.raises(CapgateError) as exc:
            svc.plan("code.long", [source], case="RF", who=who)
        assert exc.value.code == code, exc.value
        refused = [p for k, p in events(svc.executor, "RF") if k == "ddl.refused"]
        assert [p["code"] for p in refused] == [code], events(svc.executor, "RF")
        assert refused[0]["by"] == who and refused[0]["operation_id"] == "code.long"
        assert refused[0]["message"] == exc.value.message
