"""A row's SQL checked for the dialects its connector declares, and for commits (issue 18).

A DBA learns at ``capgate validate`` time what the first call against a real
Oracle would have taught: a check without FROM (needs 23ai), a LIMIT, a PL/SQL
block declared for PostgreSQL (CG170); a write statement that commits, rolls
back or runs DDL on any engine (CG171); a date bound as text where Oracle would
read it through ``NLS_DATE_FORMAT`` and a leased row Oracle refuses (warnings
CG172, CG173).  Each finding names the file, the line of the statement and the
field, like every other finding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from capgate.registry.errors import explain
from capgate.registry.loader import validate_paths, validate_texts

ROOT = Path(__file__).resolve().parent.parent


def row_file(*, dialects: str = "[oracle]", statements: str = "", verify: str = "",
             shape: str = "collapsed", extra_inputs: str = "", retired: bool = False,
             steps: str = "") -> str:
    body = steps if shape == "leased" else f"    statements:\n{statements or _INSERT}"
    return f"""format: 1
connectors:
  db:
    description: a database
    dialects: {dialects}
rows:
  - operation_id: t.write
    version: 1
    connector: db
    description: a write
{"    retired: true" if retired else ""}
    input:
      type: object
      additionalProperties: false
      required: [id]
      properties:
        id: {{type: integer}}
{extra_inputs}
    target: {{system: db, object: t, keys: [id]}}
    effect_class: transactional
    shape: {shape}
    authorization: {{kind: write_grant}}
    environments: [dev]
    idempotency_key: "{{case}}:{{id}}"
    timeout: {{seconds: 5, on_timeout: rolled_back}}
    recovery: retryable
{body}
{verify}
"""


_INSERT = """      - name: ins
        sql: "INSERT INTO t (id) VALUES (:id)"
        expect_rows: 1
"""


def findings(text: str) -> tuple[list[tuple[str, str, int]], list[tuple[str, str]]]:
    result = validate_texts([("t.yaml", text)], workers=1)
    return ([(p.code, p.field, p.line) for p in result.problems],
            [(w.code, w.field) for w in result.warnings])


def test_a_check_without_from_fails_for_oracle_only() -> None:
    verify = """    verify:
      - name: sum
        sql: "SELECT (SELECT count(*) FROM t WHERE id = :id) + 0"
        expect: {value: 1}
"""
    problems, _ = findings(row_file(verify=verify))
    assert [(c, f) for c, f, _ in problems] == [("CG170", "verify[0].sql")]
    line = problems[0][2]
    assert row_file(verify=verify).splitlines()[line - 1].strip().startswith("sql:")
    assert findings(row_file(dialects="[postgresql, mariadb, sqlite]", verify=verify))[0] == []
    assert findings(row_file(verify=verify, retired=True))[0] == []  # a retired row cannot run


@pytest.mark.parametrize(("sql", "words"), [
    ("SELECT id FROM t WHERE id = :id LIMIT 1", "LIMIT"),
    ("SELECT count(*) FROM t WHERE id = :id AND TRUE", "TRUE/FALSE"),
    ("SELECT 1 WHERE :id = 1", "FROM"),
])
def test_oracle_rules_a_parse_alone_does_not_enforce(sql: str, words: str) -> None:
    verify = f"""    verify:
      - name: c
        sql: "{sql}"
        expect: {{rows: 1}}
"""
    problems, _ = findings(row_file(verify=verify))
    assert len(problems) == 1 and problems[0][0] == "CG170"
    result = validate_texts([("t.yaml", row_file(verify=verify))], workers=1)
    assert words in result.problems[0].message and "oracle:" in result.problems[0].message


def test_a_plsql_block_is_oracle_only() -> None:
    statements = """      - name: call
        sql: "BEGIN app.touch(:id); END;"
        expect_rows: {min: 0, max: 1}
"""
    assert findings(row_file(statements=statements))[0] == []
    problems, _ = findings(row_file(dialects="[oracle, postgresql]", statements=statements))
    assert [(c, f) for c, f, _ in problems] == [("CG170", "statements[0].sql")]
    message = validate_texts([("t.yaml", row_file(dialects="[oracle, postgresql]",
                                                   statements=statements))],
                             workers=1).problems[0].message
    assert message.startswith("postgresql: does not parse as postgresql")


@pytest.mark.parametrize(("sql", "why"), [
    ("BEGIN app.touch(:id); COMMIT; END;", "contains COMMIT"),
    ("BEGIN app.touch(:id); ROLLBACK; END;", "contains ROLLBACK"),
    ("BEGIN EXECUTE IMMEDIATE 'TRUNCATE TABLE t'; END;", "EXECUTE IMMEDIATE"),
    ("BEGIN DBMS_SQL.PARSE(c, :id, 1); END;", "DBMS_SQL"),
    ("CREATE TABLE t2 AS SELECT * FROM t WHERE id = :id", "CREATE statement"),
    ("TRUNCATE TABLE t", "TRUNCATE statement"),
    ("ALTER SESSION SET NLS_DATE_FORMAT = 'YYYY-MM-DD'", "ALTER statement"),
    ("COMMIT", "COMMIT statement"),
    ("SAVEPOINT before_delete", "SAVEPOINT statement"),
    ("START TRANSACTION", "START statement"),
])
def test_a_write_statement_may_not_commit_or_run_ddl_on_any_engine(sql: str, why: str) -> None:
    statements = f"""      - name: bad
        sql: "{sql}"
        expect_rows: {{min: 0, max: 1}}
"""
    for dialects in ("[oracle]", "[postgresql]", "[]"):
        result = validate_texts([("t.yaml", row_file(dialects=dialects,
                                                     statements=statements))], workers=1)
        cg171 = [p for p in result.problems if p.code == "CG171"]
        assert len(cg171) == 1, (dialects, [p.render() for p in result.problems])
        assert cg171[0].field == "statements[0].sql" and why in cg171[0].message


@pytest.mark.parametrize("sql", [
    "INSERT INTO t (id, note) VALUES (:id, 'COMMIT; ROLLBACK')",  # words in a literal
    'UPDATE t SET "COMMIT" = 1 WHERE id = :id',  # a quoted name
    "UPDATE t SET commit_count = commit_count + 1 WHERE id = :id",
    "-- COMMIT is ours\nDELETE FROM t WHERE id = :id",
    "BEGIN app.touch(:id); END;",
])
def test_ordinary_writes_are_no_finding(sql: str) -> None:
    block = "\n".join("          " + line for line in sql.splitlines())
    statements = f"""      - name: ok
        sql: |-
{block}
        expect_rows: {{min: 0, max: 1}}
"""
    result = validate_texts([("t.yaml", row_file(dialects="[]", statements=statements))],
                            workers=1)
    assert [p.render() for p in result.problems if p.code == "CG171"] == []
    assert result.rows and result.rows[0].statements[0].sql == sql


def test_date_inputs_bound_as_text_and_leased_rows_warn_on_oracle() -> None:
    dated = """        as_of: {type: string, pattern: "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
"""
    statements = """      - name: upd
        sql: "UPDATE t SET due = :as_of WHERE id = :id"
        expect_rows: 1
"""
    _, warnings = findings(row_file(extra_inputs=dated, statements=statements))
    assert warnings == [("CG172", "input.properties.as_of")]
    with_format = dated.replace("type: string,", "type: string, format: date,")
    assert findings(row_file(extra_inputs=with_format, statements=statements))[1] == []
    assert findings(row_file(dialects="[postgresql]", extra_inputs=dated,
                             statements=statements))[1] == []
    free_text = dated.replace('pattern: "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"', "maxLength: 20")
    assert findings(row_file(extra_inputs=free_text, statements=statements))[1] == []
    steps = """    steps:
      - name: s
        sql: "UPDATE t SET x = 1 WHERE id = :id"
        expect_rows: 1
"""
    problems, warnings = findings(row_file(shape="leased", steps=steps))
    assert problems == [] and warnings == [("CG173", "shape")]


def test_the_example_rows_fit_every_dialect_they_declare() -> None:
    result = validate_paths([ROOT / "capabilities"], check_lock=False)
    assert result.problems == []
    assert [(w.code, w.path.rsplit("/", 1)[-1]) for w in result.warnings] == [
        ("CG173", "policies.yaml")]  # policy.cancel is leased: refused on Oracle
    rows = {r.ref: r for r in result.rows}
    for ref, name in (("claim.register@2", "reported_on"), ("premium.list_overdue@2", "as_of"),
                      ("premium.move_due_date@2", "due_date")):
        assert rows[ref].date_inputs == frozenset({(name, "date")}), ref
    for old in ("claim.register@1", "premium.list_overdue@1", "premium.move_due_date@1",
                "policy.purge_orphan@1"):
        assert rows[old].retired, old
    check = next(c for c in rows["policy.purge_orphan@2"].verify
                 if c.name == "nothing_left_behind")
    assert "FROM (" in check.sql


@pytest.mark.parametrize("code", ["CG170", "CG171", "CG172", "CG173", "CG326", "CG327",
                                  "CG917", "CG918", "CG919"])
def test_every_new_code_is_explained(code: str) -> None:
    text = explain(code)
    assert text.startswith(code) and len(text.splitlines()) > 3


def test_validate_warns_of_oracle_only_where_an_oracle_connector_is_configured(
        tmp_path: Path) -> None:
    """`capgate validate` in a project: the Oracle-only warnings (CG172, CG173) are for rows
    whose connector is configured on Oracle, not for every project (a PostgreSQL or SQLite
    one was told on every run).  Over the files alone, without a configuration, they stay."""
    from capgate.commands.capabilities import validate
    from capgate.commands.project import init_project

    init_project(tmp_path / "proj")
    config = tmp_path / "proj" / "capgate.toml"
    here = validate(config=str(config))
    assert here.ok and [w.code for w in here.files.warnings if w.code == "CG173"] == []
    files_only = validate([str(tmp_path / "proj" / "capabilities")])
    assert "CG173" in {w.code for w in files_only.files.warnings}
    text = config.read_text("utf-8")
    start = text.index("[connectors.insurance]")
    end = text.index("[connectors.insurance_code]")
    oracle = text[start:end].replace(text[start:end].split("\n")[1],
                                     'url = "oracle://app@db.example:1521/?service_name=ins"')
    config.write_text(text[:start] + oracle + text[end:], "utf-8")
    on_oracle = validate(config=str(config))
    assert "CG173" in {w.code for w in on_oracle.files.warnings}
