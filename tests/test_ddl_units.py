"""Pure parts of the DDL loop: object references, headers, package state, errors, prohibitions,
merge proposals and plan hashing."""

from __future__ import annotations

import copy

import pytest

from capgate.ddl import prohibitions, sqltext
from capgate.ddl.catalog import ObjectRef, adapter_for, registered_dialects
from capgate.ddl.loop import DdlLoop, _order
from capgate.ddl.merge import propose
from capgate.ddl.plan import PLAN_FORMAT, DdlPlan, check_plan, plan_hash
from capgate.registry.errors import (
    DdlError,
    FeatureNotSupported,
    InvalidObjectName,
    PlanTampered,
    SchemaWideRecompile,
    UnsupportedObjectType,
    all_codes,
    explain,
    lookup,
)


def test_object_ref_key_round_trip() -> None:
    refs = [
        ObjectRef("function", "calc", "billing", "integer, text"),
        ObjectRef("package_body", "pkg", "app"),
        ObjectRef("trigger", "trg", "s", parent="pol"),
        ObjectRef("package", "PKG", "APP", link="INSIS"),
        ObjectRef("view", "v"),
    ]
    for ref in refs:
        assert ObjectRef.parse(ref.key) == ref
        assert ObjectRef.from_dict(ref.to_dict()) == ref
    assert refs[0].key == "function:billing.calc(integer, text)"
    assert refs[1].spec() == ObjectRef("package", "pkg", "app")
    assert ObjectRef("package", "pkg", "app").body() == refs[1]
    with pytest.raises(UnsupportedObjectType) as exc:
        ObjectRef("table", "t")
    assert exc.value.code == "CG522"


@pytest.mark.parametrize(
    ("source", "fold", "expected"),
    [
        ('CREATE DEFINER="root"@"127.0.0.1" PACKAGE BODY "billing" AS', None,
         ("package_body", None, "billing")),
        ("create or replace editionable package body app.pkg is", "upper",
         ("package_body", "APP", "PKG")),
        ("CREATE OR REPLACE FUNCTION s.f(x int) RETURNS int", "lower", ("function", "s", "f")),
        ("-- comment\nCREATE ALGORITHM=MERGE DEFINER=`a`@`%` SQL SECURITY INVOKER VIEW `v` AS",
         None, ("view", None, "v")),
        ("create or replace trigger trg before insert on t", None, ("trigger", None, "trg")),
    ],
)
def test_parse_header(source: str, fold: str | None, expected: tuple[str, str | None, str]) -> None:
    h = sqltext.parse_header(source, fold)
    assert (h.kind, h.schema, h.name) == expected


def test_parse_header_refuses_other_statements() -> None:
    with pytest.raises(UnsupportedObjectType):
        sqltext.parse_header("CREATE TABLE t (a int)")
    with pytest.raises(UnsupportedObjectType):
        sqltext.parse_header("DROP PACKAGE x")


def test_package_state_lists_variables_constants_and_cursors() -> None:
    body = """CREATE OR REPLACE PACKAGE BODY pkg AS
      -- a comment; with a semicolon
      g_calls   PLS_INTEGER := 0;
      c_rate    CONSTANT NUMBER := 1.1;
      e_bad     EXCEPTION;
      TYPE t_tab IS TABLE OF NUMBER;
      CURSOR c_pol IS SELECT 'x;y' FROM dual;
      FUNCTION f RETURN NUMBER IS v_local NUMBER := 1; BEGIN RETURN v_local; END;
    END pkg;"""
    state = sqltext.package_state(body)
    assert [s.split(":")[0] for s in state] == ["variable", "constant", "cursor"]
    assert sqltext.package_state("CREATE PACKAGE p AS FUNCTION f RETURN NUMBER; END;") == []


def test_strip_terminator_and_schema_wide_detection() -> None:
    assert sqltext.strip_terminator("END;\n/\n") == "END"
    assert sqltext.strip_terminator("END;\n/\n", keep_semicolon=True) == "END;"
    assert sqltext.strip_terminator("END //") == "END"
    assert sqltext.schema_wide_recompile_in("begin dbms_utility.compile_schema('APP'); end;")
    assert sqltext.schema_wide_recompile_in("BEGIN UTL_RECOMP.recomp_serial(); END;")
    assert sqltext.schema_wide_recompile_in("select compile_schema_x from t") is None


@pytest.mark.parametrize("bad", ['x"; drop table t; --', "a b", "", "a.b", "x`y"])
def test_identifiers_are_validated_before_interpolation(bad: str) -> None:
    with pytest.raises(InvalidObjectName):
        adapter_for("mariadb").quote(bad)
    assert adapter_for("mariadb").quote("billing") == "`billing`"
    assert adapter_for("oracle").quote("PKG") == '"PKG"'


def test_every_ddl_error_has_a_unique_code_and_an_explanation() -> None:
    ddl_codes = [c for c in all_codes() if issubclass(c, DdlError)]
    codes = [c.code for c in ddl_codes]
    assert len(codes) == len(set(codes))
    assert {"CG501", "CG502", "CG503", "CG504", "CG505", "CG506", "CG510", "CG511", "CG512",
            "CG513", "CG520", "CG521", "CG522"} <= set(codes)
    for c in ddl_codes:
        assert c.__doc__ and len(c.__doc__.strip()) > 20, c
    assert "Anti-pattern" in explain("CG502")
    assert lookup("cg512").__name__ == "CompensationFailed"


def test_prohibitions_are_data_with_their_metadata() -> None:
    ps = prohibitions.PROHIBITIONS
    assert [p.code for p in ps] == ["CG501", "CG502", "CG503", "CG504", "CG505", "CG506"]
    assert len({p.name for p in ps}) == 6
    for p in ps:
        assert p.anti_pattern and p.best_practice and p.summary
        assert p.error.code == p.code
        assert p.to_dict()["error"] == p.error.__name__
    assert prohibitions.BY_NAME["snapshot-overwrite"].check is None


def _plan(**over: object) -> dict[str, object]:
    obj = {"kind": "package", "name": "pkg", "schema": "app"}
    plan: dict[str, object] = {
        "format": PLAN_FORMAT,
        "objects": [{
            "key": "package:app.pkg", "object": obj, "base_snapshot_id": "sha256:x",
            "base_signature": "v1:sha256:" + "a" * 64, "live_signature": "v1:sha256:" + "a" * 64,
            "new_source": "CREATE PACKAGE pkg AS END;", "body_exists": False,
        }],
        "dependents": [],
        "caller_search": [{"object": "package:app.pkg", "method": "grep", "hits": []}],
        "far_side_steps": [],
        "smoke": [],
        "recompile": [],
    }
    plan.update(over)
    return plan


def test_prohibition_checks_over_plan_data() -> None:
    assert prohibitions.evaluate(_plan()) == []
    stale = _plan()
    stale["objects"][0]["live_signature"] = "v1:sha256:" + "b" * 64  # type: ignore[index]
    body = _plan()
    body["objects"][0]["body_exists"] = True  # type: ignore[index]
    remote = _plan(dependents=[{
        "key": "procedure:far.pay@insis", "on": "package:app.pkg", "remote": True,
        "object": {"kind": "procedure", "name": "pay", "schema": "far", "link": "insis"},
    }])
    covered = copy.deepcopy(remote)
    covered["far_side_steps"] = [{"name": "recompile pay", "link": "insis",
                                  "dependent": "procedure:far.pay@insis",
                                  "assertion": "select 1 from dual"}]
    cases = {
        "stale-extract": stale,
        "spec-without-body": body,
        "schema-wide-recompile": _plan(recompile=["*"]),
        "spec-with-remote-dependents": remote,
        "ungrepped-callers": _plan(caller_search=None),
    }
    for name, plan in cases.items():
        found = prohibitions.evaluate(plan)
        assert [f.name for f in found] == [name], name
        with pytest.raises(prohibitions.BY_NAME[name].error) as exc:
            prohibitions.refuse(plan)
        assert exc.value.code == prohibitions.BY_NAME[name].code
        assert exc.value.details["findings"]
    assert prohibitions.evaluate(covered) == []
    with pytest.raises(SchemaWideRecompile):
        DdlLoop.refuse_schema_wide("schema:APP")
    DdlLoop.refuse_schema_wide("package_body:app.pkg")


def test_plan_hash_detects_any_edit() -> None:
    plan = _plan()
    plan["plan_hash"] = plan_hash(plan)
    check_plan(plan)
    edited = copy.deepcopy(plan)
    edited["objects"][0]["new_source"] = "CREATE PACKAGE pkg AS x INT; END;"  # type: ignore[index]
    with pytest.raises(PlanTampered) as exc:
        check_plan(edited)
    assert exc.value.code == "CG514"


def _full_plan(**over: object) -> dict[str, object]:
    """A plan as ``DdlLoop.plan`` and the service write it: every field, and bound ones."""
    plan = _plan(dialect="postgresql", target="postgresql://app@db/app", recipe="v1",
                 transactional_ddl=True, recompile_objects=[], accepted_warnings=[],
                 warnings=["w"], approval={"required": True, "reason": "gated"},
                 case="C-1", operation_id="code.pkg", version=2, row_hash="sha256:r")
    plan["objects"][0].update(new_signature="v1:sha256:" + "c" * 64)  # type: ignore[index]
    plan["prohibitions"] = prohibitions.summary(plan)
    plan.update(over)
    plan["plan_hash"] = plan_hash(plan)
    return plan


def test_ddl_plan_round_trips_to_the_same_json_and_hash() -> None:
    data = _full_plan()
    plan = DdlPlan.from_dict(data)
    assert plan.to_dict() == data
    # the key order the loop has always written: the bound fields before the prohibitions
    assert list(plan.to_dict()) == [
        "format", "dialect", "target", "recipe", "transactional_ddl", "objects", "dependents",
        "caller_search", "far_side_steps", "smoke", "recompile", "recompile_objects",
        "accepted_warnings", "warnings", "approval", "case", "operation_id", "version",
        "row_hash", "prohibitions", "plan_hash"]
    assert plan_hash(plan) == data["plan_hash"] == plan.plan_hash
    assert plan.bound == {"case": "C-1", "operation_id": "code.pkg", "version": 2,
                          "row_hash": "sha256:r"}
    assert DdlPlan.of(data) == plan and DdlPlan.of(plan) is plan
    # a plan recorded before accepted_warnings / recompile_objects existed keeps its hash
    old = _full_plan()
    del old["accepted_warnings"], old["recompile_objects"]
    old["plan_hash"] = plan_hash(old)
    again = DdlPlan.of(old)
    assert again.accepted_warnings is None and again.to_dict() == old
    edited = dict(data, warnings=["another"])
    with pytest.raises(PlanTampered, match="does not match its plan_hash"):
        DdlPlan.of(edited)


@pytest.mark.parametrize(("edit", "field"), [
    ({"dialect": None}, "dialect"),
    ({"transactional_ddl": "yes"}, "transactional_ddl"),
    ({"objects": {}}, "objects"),
    ({"objects": [{"key": "package:app.pkg"}]}, "objects[0].object"),
    ({"warnings": [1]}, "warnings[0]"),
    ({"approval": []}, "approval"),
    ({"format": "capgate.ddl.plan/0"}, "format"),
])
def test_ddl_plan_from_dict_names_the_bad_field(edit: dict[str, object], field: str) -> None:
    with pytest.raises(PlanTampered) as exc:
        DdlPlan.from_dict({**_full_plan(), **edit})
    assert exc.value.code == "CG514"
    assert exc.value.details["field"] == field
    missing = _full_plan()
    del missing["smoke"]
    with pytest.raises(PlanTampered, match="has no smoke") as exc:
        DdlPlan.from_dict(missing)
    assert exc.value.details["field"] == "smoke"


def test_merge_proposal_clean_and_conflicting() -> None:
    base = "a\nb\nc\nd\ne\n"
    clean = propose("k", "sha256:s", base, "a\nB\nc\nd\ne\n", "a\nb\nc\nd\nE\n")
    assert clean.clean and clean.merged == "a\nB\nc\nd\nE\n"
    assert [c["block"] for c in clean.theirs_changed_blocks] == [0]
    clash = propose("k", "sha256:s", base, "a\nOURS\nc\nd\ne\n", "a\nTHEIRS\nc\nd\ne\n")
    assert clash.conflicts == 1 and not clash.clean
    for marker in ("<<<<<<< ours", "||||||| base", "=======", ">>>>>>> theirs"):
        assert marker in clash.merged
    assert clash.to_dict()["regions"][0]["kind"] == "conflict"


def test_apply_order_puts_a_body_right_after_its_spec() -> None:
    refs = [ObjectRef("package_body", "p", "s"), ObjectRef("view", "v", "s"),
            ObjectRef("package", "p", "s")]
    assert _order(refs) == [1, 2, 0]


def test_adapter_registry() -> None:
    assert registered_dialects() == ["mariadb", "oracle", "postgresql", "sqlite"]
    assert adapter_for("mysql+pymysql://u@h/db").dialect == "mariadb"
    assert adapter_for("postgresql+psycopg://u@h/db").transactional_ddl
    assert not adapter_for("oracle").transactional_ddl
    with pytest.raises(FeatureNotSupported):
        adapter_for("mssql")
    assert not adapter_for("sqlite").has_session_lock()
    with pytest.raises(UnsupportedObjectType):
        adapter_for("sqlite").check_kind(ObjectRef("package", "p"))


@pytest.mark.parametrize("dialect", ["mariadb", "oracle", "sqlite"])
@pytest.mark.parametrize("sql,ok", [
    ("SELECT f(1) FROM dual", True),
    ("  -- a comment\nSELECT 'a; COMMIT' FROM dual;", True),
    ("WITH x AS (SELECT 1 AS a FROM dual) SELECT a FROM x", True),
    ("CALL p(1)", True),
    ("COMMIT", False),
    ("SELECT 1 FROM dual; COMMIT", False),
    ("BEGIN p; END;", False),
    ("CREATE TABLE t (x INT)", False),
    ("DELETE FROM t", False),
    ("SET autocommit = 1", False),
    ("SELECT x INTO OUTFILE '/tmp/f' FROM t", False),
    ("", False),
])
def test_a_smoke_call_is_one_read_only_statement_offline(dialect: str, sql: str,
                                                          ok: bool) -> None:
    """The plan-time rule for smoke calls, read with each engine's tokenizer (no server)."""
    from capgate.ddl.catalog import adapter_for
    from capgate.registry.errors import SmokeNotContained

    adapter = adapter_for(dialect)
    if ok:
        adapter.check_smoke("s", sql)
    else:
        with pytest.raises(SmokeNotContained) as exc:
            adapter.check_smoke("s", sql)
        assert exc.value.code == "CG531" and exc.value.details["smoke"] == "s"


@pytest.mark.parametrize("sql,ok", [
    ("SELECT premium(:x)", True),
    ("SELECT ':x'::text, x::int FROM t", True),
    ("CALL p()", True),
    ("VALUES (1)", True),
    ("SELECT 1; SELECT 2", False),
    ("SAVEPOINT a", False),
    ("DO $$ BEGIN NULL; END $$", False),
    ("WITH d AS (UPDATE t SET x = 1 RETURNING x) SELECT * FROM d", False),
    ("SELECT * INTO t2 FROM t", False),
])
def test_a_postgresql_smoke_call_is_read_by_postgresqls_parser(sql: str, ok: bool) -> None:
    from capgate.ddl.catalog import adapter_for
    from capgate.registry.errors import SmokeNotContained

    adapter = adapter_for("postgresql")
    if ok:
        adapter.check_smoke("s", sql)
    else:
        with pytest.raises(SmokeNotContained):
            adapter.check_smoke("s", sql)
