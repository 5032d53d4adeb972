"""Mutations of valid rows never crash the loader.

Each mutated file either validates (and then loads, resolves, renders and
diffs) or yields located Problems; a ``CapgateError`` is also acceptable.
Anything else -- a ``TypeError`` from a field of the wrong type, an error from
the canonical-JSON hasher, a ``RecursionError`` -- is a bug.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capgate.registry import errors
from capgate.registry.errors import CapgateError
from capgate.registry.fastload.fastschema import compile_validator, plain_contract
from capgate.registry.fastload.filecheck import _check_file, check_file
from capgate.registry.fastload.yamlpos import load_located
from capgate.registry.loader import Validation, validate_texts
from capgate.registry.registry import Registry
from capgate.registry.review import card, diff
from capgate.registry.schema import file_schema

GOOD = Path(__file__).resolve().parent / "data" / "good"
TEXTS = {p.name: p.read_text("utf-8") for p in sorted(GOOD.glob("*.yaml"))}
DOCS = {name: yaml.safe_load(text) for name, text in TEXTS.items()}
BASE_ROWS = validate_texts(TEXTS.items()).rows
RENDERED = re.compile(r"^[^\n]*:\d+:\d+: CG\d{3}: [^\n]*: [^\n]*$", re.S)

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# Values a reviewer could plausibly type, and some nobody should.
WORDS = st.sampled_from([
    "many", "read", "gate", "leased", "collapsed", "ddl", "dev", "prod", "unknown",
    "{case}", "{case}:{policy_id}", "{nope}", "{", "}", "{0}", "{a.b}", ":policy_id", ":nope",
    "SELECT 1", "SELECT * FROM t WHERE id = :policy_id", "DELETE FROM t", "SELECT 'open",
    "UPDATE policy SET x = 1 WHERE id = :policy_id", "SELECT * FROM t FOR UPDATE", "((((",
    "2024-01-01", "office", "policy", "policy_id", "", " ", "\n", "true", "null", "~",
    "additionalProperties", "object", "integer", "min", "max", "skip_to", "abort",
])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30), WORDS,
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(WORDS, st.text(max_size=8)), inner, max_size=3),
    ),
    max_leaves=6,
)


def _slots(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) inside ``node``."""
    out: list[tuple[Any, Any]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((node, k))
            out.extend(_slots(v))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((node, i))
            out.extend(_slots(v))
    return out


@st.composite
def mutated_docs(draw: st.DrawFn) -> dict[str, Any]:
    docs = copy.deepcopy(DOCS)
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(sorted(docs)))
        rows = docs[name]["rows"]
        row = draw(st.sampled_from(rows))
        slots = [(row, None), *_slots(row)]
        container, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["drop", "replace", "replace", "extra", "retype"]))
        if key is None:  # the row itself
            container = row
            action = "extra" if action in ("replace", "retype") else action
            if action == "drop":
                rows.remove(row)
                if not rows:
                    break
                continue
        if action == "drop":
            if isinstance(container, dict):
                del container[key]
            else:
                container.pop(key)
        elif action == "replace":
            container[key] = draw(VALUES)
        elif action == "retype":
            old_type = type(container[key])

            def other_type(v: Any, old_type: type[Any] = old_type) -> bool:
                return type(v) is not old_type

            container[key] = draw(SCALARS.filter(other_type))
        else:
            target = container[key] if key is not None and isinstance(
                container[key], dict) else row
            target[draw(st.one_of(WORDS, st.text(min_size=1, max_size=12)))] = draw(VALUES)
    return docs


def as_files(docs: dict[str, Any]) -> list[tuple[str, str]]:
    return [(name, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
            for name, doc in docs.items()]


def check_outcome(texts: list[tuple[str, str]]) -> Validation | None:
    try:
        result = validate_texts(texts)
    except CapgateError:
        return None
    if result.ok:
        registry = Registry(result.rows)
        for row in registry.current_rows():
            assert registry.resolve(row.operation_id) is row
            assert card(row).startswith(row.ref)
        diff(BASE_ROWS, result.rows)
    else:
        for problem in result.problems:
            assert RENDERED.match(problem.render()), problem.render()
            assert problem.line >= 1 and problem.col >= 1
            assert errors.lookup(problem.code).code == problem.code
    return result


def test_the_base_files_are_valid() -> None:
    result = check_outcome(list(TEXTS.items()))
    assert result is not None and result.ok


@FUZZ
@given(mutated_docs())
def test_mutated_rows_never_crash_the_loader(docs: dict[str, Any]) -> None:
    check_outcome(as_files(docs))


@settings(FUZZ, max_examples=100)
@given(mutated_docs())
def test_row_positions_only_change_nothing_on_mutated_rows(docs: dict[str, Any]) -> None:
    """The fast load (row positions only, again with every position on any finding)
    gives the same findings, rows and hashes as the fully located one."""
    for source, text in as_files(docs):
        fast, located = check_file(source, text), _check_file(source, text, "all")
        assert [p.render() for p in fast.problems] == [p.render() for p in located.problems]
        assert fast.rows == located.rows


# --- the fast paths of schema validation agree with jsonschema -------------------------------


FILE_VALIDATOR = jsonschema.Draft202012Validator(file_schema())
FAST_FILE = compile_validator(file_schema())


def test_the_shipped_schema_compiles_to_a_fast_validator() -> None:
    for doc in DOCS.values():
        assert FAST_FILE(doc) and FILE_VALIDATOR.is_valid(doc)


@settings(FUZZ, max_examples=100)  # jsonschema itself is the slow half of this comparison
@given(mutated_docs())
def test_the_fast_file_validator_never_says_valid_wrongly(docs: dict[str, Any]) -> None:
    for doc in docs.values():
        # through YAML and back, as the loader sees it (the dump turns tuples into lists etc.)
        located, problems = load_located(yaml.safe_dump(doc), "f.yaml")
        if located is None or problems:
            continue
        data = located.data
        # every uniqueItems array of the schema holds strings, so where the fast validator
        # would defer (non-string items) the file is invalid anyway: the answers are equal
        assert FAST_FILE(data) == FILE_VALIDATOR.is_valid(data), \
            list(FILE_VALIDATOR.iter_errors(data))[:3]


SCHEMAS: st.SearchStrategy[Any] = st.deferred(lambda: st.one_of(
    st.booleans(),
    st.dictionaries(
        st.sampled_from([
            "type", "properties", "additionalProperties", "required", "items", "enum",
            "const", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength",
            "minItems", "pattern", "format", "description", "default", "uniqueItems",
            "multipleOf", "not", "examples", "$ref", "oneOf", "title", "readOnly",
        ]),
        st.one_of(
            SCHEMAS, VALUES,
            st.sampled_from(["object", "string", "integer", "number", "array", "boolean",
                             "null", "strin", "^[A-Z]{3}$", "(", "a{99999999999}", "[z-a]"]),
            st.lists(st.sampled_from(["string", "null", "integer", "id", "string"]),
                     max_size=3),
            st.dictionaries(st.sampled_from(["id", "name", "amount"]), SCHEMAS, max_size=2),
            st.integers(-2, 5), st.floats(allow_nan=False, allow_infinity=False),
        ),
        max_size=4,
    ),
))


@FUZZ
@given(SCHEMAS)
def test_a_plain_contract_is_a_valid_json_schema(contract: Any) -> None:
    if plain_contract(contract):
        schema: dict[str, Any] | bool = contract
        jsonschema.Draft202012Validator.check_schema(schema)


def test_plain_contracts() -> None:
    good = {"type": "object", "additionalProperties": False, "required": ["id"],
            "properties": {"id": {"type": "integer", "minimum": 1},
                           "code": {"type": ["string", "null"], "pattern": "^[A-Z]{3}$"}}}
    assert plain_contract(good)
    bads: list[dict[str, Any]] = [
                {"type": "strin"}, {"required": "id"}, {"required": ["a", "a"]},
                {"minLength": -1}, {"pattern": "("}, {"pattern": "a{99999999999}"},
                {"properties": {"a": {"type": 5}}}, {"type": []}, {"multipleOf": 0}]
    for bad in bads:
        assert not plain_contract(bad), bad
        with pytest.raises(Exception):  # noqa: B017 - SchemaError, or OverflowError from re
            jsonschema.Draft202012Validator.check_schema(bad)
    # unknown to the fast path, valid all the same: jsonschema decides
    assert not plain_contract({"$defs": {}, "type": "object"})
    jsonschema.Draft202012Validator.check_schema({"$defs": {}, "type": "object"})


@FUZZ
@given(st.data())
def test_damaged_text_never_crashes_the_loader(data: st.DataObject) -> None:
    """Byte-level damage: cut, duplicate, or insert characters anywhere in a file."""
    name = data.draw(st.sampled_from(sorted(TEXTS)))
    text = TEXTS[name]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text)))
        j = data.draw(st.integers(i, min(len(text), i + 200)))
        how = data.draw(st.sampled_from(["cut", "dup", "insert"]))
        if how == "cut":
            text = text[:i] + text[j:]
        elif how == "dup":
            text = text[:j] + text[i:j] + text[j:]
        else:
            junk = data.draw(st.one_of(
                st.text(max_size=10),
                st.sampled_from([":", "- ", "\t", "&a ", "*a", "!x ", "'", '"', "{", "[",
                                 "\n  ", "#", "? ", "|", ">"]),
            ))
            text = text[:i] + junk + text[i:]
    check_outcome([(name, text)])
