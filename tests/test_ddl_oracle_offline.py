"""Oracle checks that need no Oracle server: the SQL it sends, its ordering and its parsing.

The Oracle adapter is written against Oracle's documentation and only runs in
``tests/test_ddl_oracle.py`` where ``CAPGATE_TEST_ORACLE_DSN`` (or Docker) gives a
server.  These tests run everywhere and prove only what they say: every SQL
statement of ``ddl.catalog_oracle.SQL`` parses with sqlglot's Oracle dialect
(queries as real SELECTs, not as opaque commands), the recompile order puts a
dependent after what it uses, compiler settings are validated before they
reach DDL text, and PL/SQL sources are cut at the end of their one unit.
"""

from __future__ import annotations

import pytest
import sqlglot
from sqlglot import exp

from capgate.ddl.catalog import ObjectRef
from capgate.ddl.catalog_oracle import SQL, compile_settings_clause, recompile_order
from capgate.ddl.source import parse_blocks
from capgate.registry.errors import ExtraStatements, InvalidObjectName


@pytest.mark.parametrize("name", sorted(SQL))
def test_every_oracle_statement_parses_with_sqlglot(name: str) -> None:
    sql = SQL[name].format(seconds=10)
    tree = sqlglot.parse_one(sql.replace(" IN :p_scopes", " IN (:p_scopes)"), read="oracle")
    if sql.lstrip().upper().startswith("SELECT"):
        assert isinstance(tree, exp.Select), (name, type(tree))
        assert not list(tree.find_all(exp.Command))
    else:
        assert tree is not None


def test_recompile_order_puts_what_is_used_first() -> None:
    pkg = ObjectRef("package", "BILLING", "APP")
    body = ObjectRef("package_body", "BILLING", "APP")
    fn = ObjectRef("function", "DOUBLED", "APP")
    view = ObjectRef("view", "V_DOUBLED", "APP")
    edges = [(fn.key, pkg.key), (view.key, fn.key), (body.key, pkg.key)]
    order = [r.key for r in recompile_order([view, fn, body, pkg], edges)]
    assert order.index(pkg.key) < order.index(fn.key) < order.index(view.key)
    assert order.index(pkg.key) < order.index(body.key)
    # a cycle still yields every object once
    cyc = recompile_order([fn, view], [(fn.key, view.key), (view.key, fn.key)])
    assert sorted(r.key for r in cyc) == sorted([fn.key, view.key])


def test_compile_settings_are_validated_and_quoted() -> None:
    clause = compile_settings_clause({"plsql_optimize_level": "1",
                                      "plsql_code_type": "native",
                                      "plsql_ccflags": "debug:TRUE, x:'y'"})
    assert clause == ("PLSQL_OPTIMIZE_LEVEL = 1 PLSQL_CODE_TYPE = NATIVE "
                      "PLSQL_CCFLAGS = 'debug:TRUE, x:''y'''")
    tree = sqlglot.parse_one(f"ALTER PACKAGE app.billing COMPILE BODY {clause} REUSE SETTINGS",
                             read="oracle")
    assert tree is not None
    with pytest.raises(InvalidObjectName):
        compile_settings_clause({"plsql_optimize_level": "2; DROP TABLE x"})
    with pytest.raises(InvalidObjectName):
        compile_settings_clause({"plsql_code_type": "INTERPRETED GRANT"})


BODY = """CREATE OR REPLACE EDITIONABLE PACKAGE BODY billing AS
  g_calls PLS_INTEGER := 0;
  FUNCTION premium(p_base NUMBER) RETURN NUMBER IS
  BEGIN
    g_calls := g_calls + 1;
    IF p_base < 0 THEN RETURN 0; END IF;
    FOR i IN 1..2 LOOP NULL; END LOOP;
    RETURN CASE WHEN p_base > 1 THEN p_base * 1.1 ELSE p_base END;
  END premium;
END billing;
/
"""


def test_a_plsql_unit_is_one_definition_and_nothing_more() -> None:
    parse_blocks(BODY, "package_body", "oracle", plsql=True, what="package_body:BILLING")
    with pytest.raises(ExtraStatements) as exc:
        parse_blocks(BODY + "GRANT EXECUTE ON billing TO PUBLIC;\n", "package_body", "oracle",
                     plsql=True, what="package_body:BILLING")
    assert exc.value.details["line"] == 12


def test_invoker_rights_dropped_is_a_plan_warning() -> None:
    """Oracle's default is definer's rights: a spec replaced without AUTHID CURRENT_USER is
    said to the approver; keeping it, a new unit, a body, or a comment naming it is not."""
    from capgate.ddl.catalog_oracle import OracleAdapter

    adapter = OracleAdapter()
    spec = ObjectRef("package", "BILLING", "APP")
    base = "CREATE OR REPLACE PACKAGE billing AUTHID CURRENT_USER AS\n  x NUMBER;\nEND;"
    dropped = "CREATE OR REPLACE PACKAGE billing AS\n  x NUMBER;\nEND;"
    (warned,) = adapter.privilege_changes(spec, base, dropped)
    assert warned.startswith(spec.key) and "AUTHID CURRENT_USER" in warned
    assert adapter.privilege_changes(spec, base, base.replace("x NUMBER", "y NUMBER")) == []
    assert adapter.privilege_changes(spec, None, dropped) == []
    commented = "CREATE OR REPLACE PACKAGE billing AS\n  -- AUTHID CURRENT_USER\nEND;"
    assert adapter.privilege_changes(spec, base, commented) != []
    body = ObjectRef("package_body", "BILLING", "APP")
    assert adapter.privilege_changes(body, base, dropped) == []
