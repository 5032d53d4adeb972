"""The loader's building blocks: located YAML, binds, and the read-only decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from capgate.registry.checks import binds_of, writing_reason
from capgate.registry.fastload.yamlpos import load_located
from capgate.registry.loader import validate_texts
from capgate.registry.model import ExpectRows
from capgate.registry.schema import row_schema

GOOD = Path(__file__).resolve().parent / "data" / "good"


# --- reads are decided by a parser, not a regex -------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT id FROM policy WHERE id = :id",
        "select updated_at, deleted, inserted_by FROM t",  # writing words as column names
        "SELECT 'DELETE FROM t' AS text",  # ... or inside a string
        "WITH x AS (SELECT 1 AS a) SELECT a FROM x",
        "SELECT a FROM t UNION ALL SELECT b FROM u",
        "SELECT count(*) FROM t -- UPDATE t SET a = 1",
        "SELECT * FROM t WHERE id IN (SELECT policy_id FROM cover)",
        "SELECT :id::int",
    ],
)
def test_pure_reads(sql: str) -> None:
    assert writing_reason(sql) is None


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("DELETE FROM t WHERE id = :id", "is a DELETE statement"),
        ("UPDATE t SET a = 1", "is a UPDATE statement"),
        ("INSERT INTO t VALUES (1)", "is a INSERT statement"),
        ("WITH d AS (DELETE FROM t RETURNING id) SELECT id FROM d", "contains a DELETE"),
        ("SELECT * FROM t FOR UPDATE", "locks rows"),
        ("SELECT * FROM t FOR SHARE", "locks rows"),
        ("SELECT * INTO copy FROM t", "contains a INTO"),
        ("SELECT 1; DROP TABLE t", "is a DROP statement"),
        ("TRUNCATE TABLE t", "statement"),
        ("CALL do_things()", "statement"),
    ],
)
def test_writing_sql(sql: str, reason: str) -> None:
    found = writing_reason(sql)
    assert found is not None and reason in found


@pytest.mark.parametrize(
    "sql",
    ["SELECT id FROM WHERE", "SELECT 'open", 'SELECT "open', "SELECT 1 /* open",
     "(" * 2000 + "1" + ")" * 2000],
)
def test_unparseable_sql_is_a_value_error(sql: str) -> None:
    with pytest.raises(ValueError):
        writing_reason(sql)


def test_binds_are_what_sqlalchemy_binds() -> None:
    assert binds_of("SELECT * FROM t WHERE a = :a AND b = :b_2 OR a = :a") == {"a", "b_2"}
    assert binds_of("SELECT '10:30' AS t, a::text FROM t") == set()
    assert binds_of("SELECT :x::int") == set()  # SQLAlchemy does not bind this either
    assert binds_of("SELECT 1") == set()


# --- located YAML ---------------------------------------------------------------------------


def test_positions_of_values_and_keys() -> None:
    text = "a:\n  b: [1, {c: 2}]\n  d:\n    - x\nkey: value\n"
    located, problems = load_located(text, "f.yaml")
    assert problems == [] and located is not None
    assert located.data == {"a": {"b": [1, {"c": 2}], "d": ["x"]}, "key": "value"}
    assert located.where(("a", "b", 1, "c")) == (2, 14)
    assert located.where(("a", "b", 1, "c"), key=True) == (2, 11)
    assert located.where(("key",)) == (5, 6)
    # a block collection is located at its key, so the line names the field
    assert located.where(("a",)) == (1, 1)
    assert located.where(("a", "d")) == (3, 3)
    # a missing path falls back to the nearest ancestor
    assert located.where(("a", "d", 7, "zzz")) == (3, 3)
    assert located.where(("a", "d", 0, "zzz")) == (4, 7)
    assert located.where(("nowhere",)) == (1, 1)


def test_empty_text_is_an_empty_document() -> None:
    located, problems = load_located("", "f.yaml")
    assert problems == [] and located is not None and located.data == {}
    result = validate_texts([("f.yaml", "# nothing\n")])
    assert [p.render() for p in result.problems] == [
        "f.yaml:1:1: CG103: (file): missing required field 'connectors'",
        "f.yaml:1:1: CG103: (file): missing required field 'rows'",
    ]


@pytest.mark.parametrize(
    ("text", "code", "line", "message"),
    [
        ("a: 1\na: 2\n", "CG101", 2, "duplicate key 'a'"),
        ("a: &x {b: 1}\nc: *x\n", "CG101", 2, "aliases (*name) are not allowed"),
        ("a: &x [*x]\n", "CG101", 1, "aliases (*name) are not allowed"),
        ("a: !custom 1\n", "CG101", 1, "tags are not allowed here (!custom)"),
        ("a: !!python/object:os.system {}\n", "CG101", 1, "tags are not allowed here"),
        ("a: !!binary aGVsbG8=\n", "CG101", 1, "tags are not allowed here"),
        ("a: !!set {x, y}\n", "CG101", 1, "tags are not allowed here"),
        ("a:\n  - 2024-01-31\n", "CG104", 2, "'2024-01-31' reads as a date; quote it"),
        ("a: .nan\n", "CG104", 1, "'.nan' is not a finite number"),
        ("a: -.inf\n", "CG104", 1, "'-.inf' is not a finite number"),
        ("a: 9007199254740992\n", "CG104", 1, "outside the range of a JSON integer"),
        ("? [a, b]\n: 1\n", "CG101", 1, "mapping keys must be plain scalars"),
        ("a: [1, 2\n", "CG101", 2, "expected ',' or ']'"),
        ("a: 1\n---\nb: 2\n", "CG101", 2, "holds one YAML document"),
        ("a: b\x08\n", "CG101", 1, "unacceptable character #x0008"),
        ("a: " + "[" * 300 + "]" * 300 + "\n", "CG101", 1, "nest"),
        ("a: " + "[" * 50_000 + "]" * 50_000 + "\n", "CG101", 1, "nest"),
    ],
)
def test_yaml_that_has_no_json_form_is_a_problem(text: str, code: str, line: int,
                                                 message: str) -> None:
    _, problems = load_located(text, "f.yaml")
    assert [(p.code, p.line) for p in problems] == [(code, line)], problems
    assert message in problems[0].message


def test_json_compatible_yaml_is_fine() -> None:
    text = "a: !!str 2024-01-31\nb: '2024-01-31'\nc: 9007199254740991\nd: 1.5e+3\ne: null\nf: yes\n"
    located, problems = load_located(text, "f.yaml")
    assert problems == [] and located is not None
    assert located.data == {"a": "2024-01-31", "b": "2024-01-31", "c": 2**53 - 1, "d": 1500.0,
                            "e": None, "f": True}


def test_field_names_are_relative_to_the_row() -> None:
    text = (GOOD / "office.yaml").read_text("utf-8")
    dup = text.replace("        expect_rows: 1\n    verify:",
                       "        expect_rows: 1\n        expect_rows: 2\n    verify:")
    (problem,) = validate_texts([("f.yaml", dup)]).problems
    assert (problem.code, problem.field) == ("CG101", "statements[0].expect_rows")
    missing = text.replace("    recovery: retryable\n    max_rows: 1\n", "    max_rows: 1\n")
    (problem,) = validate_texts([("f.yaml", missing)]).problems
    assert (problem.code, problem.field) == ("CG103", "rows[0]")
    assert problem.message == "missing required field 'recovery'"


# --- schema and model -----------------------------------------------------------------------


def test_the_row_schema_has_every_design_field() -> None:
    props = row_schema()["properties"]
    for name in ["operation_id", "version", "connector", "description", "input", "target",
                 "effect_class", "shape", "authorization", "environments", "idempotency_key",
                 "timeout", "recovery", "statements", "verify", "replay", "landed_probe",
                 "compensation", "post_commit", "evidence", "examples", "retired"]:
        assert name in props
    assert row_schema()["additionalProperties"] is False


@pytest.mark.parametrize(
    ("value", "text", "matches", "misses"),
    [(1, "1", [1], [0, 2]), ({"min": 0}, ">= 0", [0, 99], []),
     ({"min": 1, "max": 3}, "1..3", [1, 3], [0, 4])],
)
def test_expect_rows(value: object, text: str, matches: list[int], misses: list[int]) -> None:
    er = ExpectRows.from_value(value)
    assert str(er) == text
    assert er.to_value() == value
    assert all(er.matches(n) for n in matches)
    assert not any(er.matches(n) for n in misses)


def test_example_inputs_are_checked_against_the_contract() -> None:
    text = (GOOD / "office.yaml").read_text("utf-8")
    bad = text.replace("input: {policy_id: 1, holder: Ada}", "input: {policy_id: one, holder: Ada}")
    (problem,) = validate_texts([("f.yaml", bad)]).problems
    assert problem.code == "CG104"
    assert problem.field == "examples[0].input.policy_id"
    assert "example input does not satisfy the contract" in problem.message
    counts = text.replace("expect_rows: [1]", "expect_rows: [1, 1]")
    (problem,) = validate_texts([("f.yaml", counts)]).problems
    assert problem.code == "CG104"
    assert problem.message == "expected 1 counts (one per statement), got 2"
