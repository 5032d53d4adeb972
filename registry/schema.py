"""JSON Schema validation of capability files, reported with file positions.

The schema (``capability.schema.json``, draft 2020-12) is the contract for the
YAML shape.  jsonschema's raw messages are written for programmers; a DBA
needs ``path:line:col: CODE: field: message`` with a plain sentence, so each
error is mapped to a code (unknown key, missing field, invalid value) and
rewritten.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from capgate.registry.errors import Problem
from capgate.registry.fastload.fastschema import Check, Unsupported, compile_validator
from capgate.registry.fastload.yamlpos import Located, Path, field_path, render_path


@cache
def file_schema() -> dict[str, Any]:
    """The shipped JSON Schema of a capability file."""
    text = resources.files("capgate.registry").joinpath("capability.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(file_schema())


@cache
def _fast_validator() -> Check | None:
    """A quick "valid" for the common case; see ``registry.fastload.fastschema``."""
    try:
        return compile_validator(file_schema())
    except Unsupported:  # pragma: no cover - the shipped schema compiles; a test says so
        return None


def row_schema() -> dict[str, Any]:
    """The schema of one row (with the shared ``$defs``), e.g. for documentation."""
    schema = file_schema()
    return {"$defs": schema["$defs"], **schema["$defs"]["row"]}


def schema_problems(located: Located, source: str) -> list[Problem]:
    """Every schema violation in the file, located and rewritten for a reviewer."""
    fast = _fast_validator()
    if fast is not None and fast(located.data):
        return []
    problems: list[Problem] = []
    seen: set[str] = set()
    for error in _validator().iter_errors(located.data):
        # jsonschema reports each missing required property as its own error, and each of
        # them lists every missing one: keep one problem per finding
        for problem in _convert(error, located, source):
            if problem.render() not in seen:
                seen.add(problem.render())
                problems.append(problem)
    problems.sort(key=lambda p: (p.line, p.col, p.code))
    return problems


def _problem(located: Located, source: str, path: Path, code: str, message: str,
             *, key: bool = False) -> Problem:
    line, col = located.where(path, key=key)
    return Problem(source, line, col, code, render_path(field_path(path)), message)


def _convert(error: ValidationError, located: Located, source: str) -> Iterator[Problem]:
    path: Path = tuple(error.absolute_path)
    kind = error.validator
    schema: dict[str, Any] = error.schema if isinstance(error.schema, dict) else {}
    value: Any = error.validator_value
    if kind == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(schema.get("properties", {}))
        for extra in sorted(set(error.instance) - allowed):
            hint = ", ".join(sorted(allowed)) if allowed else "none"
            yield _problem(located, source, (*path, extra), "CG102",
                           f"unknown key {extra!r}; allowed here: {hint}", key=True)
        return
    if kind == "required":
        present = error.instance if isinstance(error.instance, dict) else {}
        missing = [r for r in value if r not in present]
        for name in missing:
            yield _problem(located, source, path, "CG103", f"missing required field {name!r}")
        return
    if kind in ("oneOf", "anyOf"):
        branch = _matching_branch(error)
        if branch:
            for sub in branch:
                yield from _convert(sub, located, source)
            return
    yield _problem(located, source, path, "CG104", _describe(error))


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    if value is None:
        return "null"
    return type(value).__name__


def _matching_branch(error: ValidationError) -> list[ValidationError] | None:
    """For a failed oneOf, the errors of the one branch whose type fits the value."""
    branches: Any = error.validator_value
    actual = _json_type(error.instance)
    accepted = {actual, "number"} if actual == "integer" else {actual}
    fitting = [
        i for i, b in enumerate(branches) if isinstance(b, dict) and b.get("type") in accepted
    ]
    if len(fitting) != 1:
        return None
    index = fitting[0]
    subs = [e for e in error.context or [] if e.schema_path and e.schema_path[0] == index]
    return subs or None


def _describe(error: ValidationError) -> str:
    got = error.instance
    shown = repr(got) if not isinstance(got, dict | list) else _json_type(got)
    kind = error.validator
    schema: dict[str, Any] = error.schema if isinstance(error.schema, dict) else {}
    if kind in ("oneOf", "anyOf") and "description" in schema:
        return f"expected {schema['description']}, got {shown}"
    if kind == "type":
        return f"expected {_article(error.validator_value)}, got {_json_type(got)} {shown}"
    if kind == "enum":
        enum_values: Any = error.validator_value
        options = ", ".join(str(v) for v in enum_values)
        return f"expected one of {options}, got {shown}"
    if kind == "const":
        return f"expected {error.validator_value!r}, got {shown}"
    if kind == "pattern":
        return f"{shown} does not match the pattern {error.validator_value}"
    if kind in ("minimum", "exclusiveMinimum", "maximum"):
        return f"{shown} is out of range ({kind} {error.validator_value})"
    if kind == "minItems":
        return f"needs at least {error.validator_value} item(s)"
    if kind == "minLength":
        return "must not be empty"
    if kind == "uniqueItems":
        return "items must be unique"
    if kind == "minProperties":
        return f"needs at least {error.validator_value} key(s)"
    return error.message


def _article(type_name: Any) -> str:
    if isinstance(type_name, list):
        return " or ".join(_article(t) for t in type_name)
    name = str(type_name)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"
