"""``validate`` reports every problem of every file in one pass.

A row with a schema problem (an unknown key) used to hide its semantic
problems (an unknown bind) until the first was fixed: two rounds for one row.
"""

from __future__ import annotations

from pathlib import Path

from capgate.registry.loader import validate_paths

ONE_ROW = """\
format: 1
connectors:
  db: {}
rows:
  - operation_id: a.read
    version: 1
    connector: db
    description: an unknown key and an unknown bind in one row
    input: {type: object, additionalProperties: false}
    target: {system: db, object: t}
    effect_class: read
    authorization: {kind: read_grant}
    max_row: 10
    environments: [dev]
    timeout: {seconds: 1, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - sql: SELECT count(*) FROM t WHERE id = :id
"""


def test_a_rows_schema_and_semantic_problems_come_together(tmp_path: Path) -> None:
    path = tmp_path / "one.yaml"
    path.write_text(ONE_ROW, "utf-8")
    result = validate_paths([path])
    found = {(p.code, p.line) for p in result.problems}
    assert found == {("CG102", 13), ("CG110", 18)}, [p.render() for p in result.problems]


def test_a_typo_in_a_field_the_checks_reason_from_is_not_repeated(tmp_path: Path) -> None:
    path = tmp_path / "one.yaml"
    path.write_text(ONE_ROW.replace("    max_row: 10\n", "").replace(
        "effect_class: read", "effect_class: query").replace(":id", "1"), "utf-8")
    result = validate_paths([path])
    assert [p.code for p in result.problems] == ["CG104"]
