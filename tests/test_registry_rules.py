"""The registry's lint rules as data (``registry.rules``): every code a row check reports
is a rule's, every rule's code is a documented error, and every rule fires.

Each rule fires on a minimal bad capability file: the ``tests/data/bad`` file
named after its code where there is one, else a row of
``tests/test_registry_dialects`` with the one mistake the rule is about.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from capgate.commands.codes import all_codes, explanation
from capgate.registry import checks, dialect_checks, rules, simulation_checks
from capgate.registry.loader import validate_paths, validate_texts
from capgate.registry.rules import BY_CODE, RULES, Rule
from tests.test_registry_dialects import row_file

ROOT = Path(__file__).resolve().parent.parent
BAD = ROOT / "tests" / "data" / "bad"

_ISO_DATE_AS_TEXT = """        as_of: {type: string, pattern: "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
"""

#: Rules with no bad file of their own: a row that breaks only that rule.
_TEXTS = {
    "CG170": row_file(verify="""    verify:
      - name: sum
        sql: "SELECT (SELECT count(*) FROM t WHERE id = :id) + 0"
        expect: {value: 1}
"""),
    "CG171": row_file(dialects="[]", statements="""      - name: bad
        sql: "COMMIT"
        expect_rows: {min: 0, max: 1}
"""),
    "CG172": row_file(extra_inputs=_ISO_DATE_AS_TEXT, statements="""      - name: upd
        sql: "UPDATE t SET due = :as_of WHERE id = :id"
        expect_rows: 1
"""),
    "CG173": row_file(shape="leased", steps="""    steps:
      - name: s
        sql: "UPDATE t SET x = 1 WHERE id = :id"
        expect_rows: 1
"""),
}


def test_codes_are_unique_and_named_once() -> None:
    assert len(BY_CODE) == len(RULES)
    assert all(isinstance(r, Rule) for r in RULES)


def test_no_check_writes_a_code_literal() -> None:
    """The codes come from the table: a new finding needs a rule first."""
    for module in (checks, dialect_checks, simulation_checks):
        source = inspect.getsource(module)
        assert not re.findall(r'ctx\.at\([^)]*?"CG\d{3}"', source, re.DOTALL), module.__name__
        used = set(re.findall(r"\b([A-Z][A-Z_]+)\.code\b", source))
        assert used, module.__name__


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_each_rule_is_a_documented_error_with_its_check(rule: Rule) -> None:
    registered = {cls.code: cls for cls in all_codes()}
    assert rule.code in registered, f"{rule.code} is no registered error code"
    doc = explanation(rule.code)
    assert doc.startswith(f"{rule.code} {registered[rule.code].__name__}")
    body = doc.split("\n\n", 1)[1].strip()
    assert len(body) > 20, f"{rule.code} has no documentation"
    assert rule.doc == doc
    assert rule.title and rule.checks
    (name,) = [n for n, value in vars(rules).items() if value is rule]
    for function in rule.functions():  # each function it names reports it, by its name
        assert f"{name}.code" in inspect.getsource(function), (rule.code, function.__name__)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_each_rule_fires_on_a_minimal_bad_file(rule: Rule) -> None:
    if rule.code in _TEXTS:
        result = validate_texts([("t.yaml", _TEXTS[rule.code])], workers=1)
    else:
        files = sorted(BAD.glob(f"{rule.code.lower()}_*.yaml"))
        assert files, f"no bad file for {rule.code} in {BAD}"
        result = validate_paths(files[:1])
    found = result.warnings if rule.warning else result.problems
    assert rule.code in {p.code for p in found}, [p.render() for p in found]
