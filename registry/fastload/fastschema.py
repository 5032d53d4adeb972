"""Fast yes-answers for JSON Schema questions that jsonschema answers slowly.

Loading 10,000 rows spends most of its time in jsonschema: validating each
file against ``capability.schema.json`` and checking each row's ``input``
contract against the draft 2020-12 meta-schema.  Nearly every file and
contract is valid, so the answer is almost always "yes".  This module gives
that "yes" quickly and never gives it wrongly:

* ``compile_validator(schema)`` turns a schema that uses only the keywords
  listed in ``_KEYWORDS`` into a plain function.  It returns True only when
  the instance satisfies every keyword exactly as draft 2020-12 defines it;
  where it is unsure (a keyword it does not know, non-string items under
  ``uniqueItems``) it returns False.
* ``plain_contract(schema)`` is True only for an input contract built from a
  whitelist of keywords whose values the meta-schema would accept.

A False is not a "no": the caller then asks jsonschema, which also words the
errors.  Tests compare both answers on generated files and contracts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

Check = Callable[[Any], bool]


class Unsupported(Exception):
    """The schema uses a keyword (or a form of one) this module does not compile."""


_ANNOTATIONS = frozenset({"$schema", "$id", "$defs", "$comment", "title", "description"})


_SAFE = 2**53 - 1


def _is_number(v: Any) -> bool:
    return v.__class__ is int or v.__class__ is float


_TYPES: dict[str, Check] = {
    "object": lambda v: v.__class__ is dict,
    "array": lambda v: v.__class__ is list,
    "string": lambda v: v.__class__ is str,
    # an integral float counts within +-2^53 only (executor.context's rule: never 1e308)
    "integer": lambda v: v.__class__ is int or (v.__class__ is float and v.is_integer()
                                                and -_SAFE <= v <= _SAFE),
    "number": _is_number,
    "boolean": lambda v: v.__class__ is bool,
    "null": lambda v: v is None,
}


def compile_validator(schema: Mapping[str, Any]) -> Check:
    """A function that is True only for instances valid under ``schema``."""
    compiled: dict[str, Check] = {}

    def ref(target: str) -> Check:
        if not target.startswith("#/$defs/") or "/" in target[8:]:
            raise Unsupported(f"$ref {target}")
        name = target[8:]
        if name not in compiled:
            defs = schema.get("$defs", {})
            if name not in defs:
                raise Unsupported(f"$ref {target}")
            cell: list[Check] = []
            compiled[name] = lambda v: cell[0](v)  # a forward reference for recursion
            cell.append(build(defs[name]))
            compiled[name] = cell[0]
        return compiled[name]

    def build(node: Any) -> Check:
        if node is True:
            return lambda v: True
        if node is False:
            return lambda v: False
        if not isinstance(node, Mapping):
            raise Unsupported(repr(node))
        checks: list[Check] = []
        if "properties" in node or "additionalProperties" in node or "propertyNames" in node:
            checks.append(_object(node, build))
        for keyword, arg in node.items():
            if keyword in _ANNOTATIONS or keyword in _OBJECT_KEYWORDS:
                continue
            if keyword == "$ref":
                checks.append(ref(arg))
            elif keyword == "items":
                checks.append(_items(build(arg)))
            elif keyword == "oneOf":
                checks.append(_one_of([build(b) for b in arg]))
            elif keyword in _KEYWORDS:
                checks.append(_KEYWORDS[keyword](arg))
            else:
                raise Unsupported(keyword)
        return _all_of(checks)

    return build(schema)


# Plain loops, not all(<generator>): these run a million times when 10,000 rows load.


def _items(item: Check) -> Check:
    def check(v: Any) -> bool:
        if v.__class__ is list:
            for x in v:
                if not item(x):
                    return False
        return True
    return check


def _one_of(branches: list[Check]) -> Check:
    def check(v: Any) -> bool:
        matched = 0
        for branch in branches:
            if branch(v):
                matched += 1
        return matched == 1
    return check


def _all_of(checks: list[Check]) -> Check:
    if not checks:
        return lambda v: True
    if len(checks) == 1:
        return checks[0]
    frozen = tuple(checks)

    def check(v: Any) -> bool:
        for c in frozen:  # noqa: SIM110 - faster than all(<generator>) here
            if not c(v):
                return False
        return True
    return check


_OBJECT_KEYWORDS = frozenset({"properties", "additionalProperties", "propertyNames"})


def _object(node: Mapping[str, Any], build: Callable[[Any], Check]) -> Check:
    props = {k: build(s) for k, s in node.get("properties", {}).items()}
    extra = node.get("additionalProperties", True)
    extra_check = None if extra is True else build(extra)
    names = build(node["propertyNames"]) if "propertyNames" in node else None

    def check(v: Any) -> bool:
        if v.__class__ is not dict:
            return True
        for key, item in v.items():
            own = props.get(key)
            if own is not None:
                if not own(item):
                    return False
            elif extra_check is not None and not extra_check(item):
                return False
            if names is not None and not names(key):
                return False
        return True

    return check


def _type(arg: Any) -> Check:
    names = [arg] if isinstance(arg, str) else list(arg)
    if not names or any(n not in _TYPES for n in names):
        raise Unsupported(f"type {arg!r}")
    tests = [_TYPES[n] for n in names]
    if len(tests) == 1:
        return tests[0]
    return lambda v: any(t(v) for t in tests)


def _enum(arg: Any) -> Check:
    if not isinstance(arg, list) or not all(isinstance(x, str) for x in arg):
        raise Unsupported("enum of non-strings")
    options = frozenset(arg)
    return lambda v: v.__class__ is str and v in options


def _const(arg: Any) -> Check:
    if arg.__class__ is int:
        return lambda v: _is_number(v) and v == arg
    if arg.__class__ is str:
        return lambda v: v.__class__ is str and v == arg
    raise Unsupported(f"const {arg!r}")


def _pattern(arg: str) -> Check:
    rx = re.compile(arg)
    return lambda v: v.__class__ is not str or rx.search(v) is not None


def _number_bound(test: Callable[[Any, Any], bool]) -> Callable[[Any], Check]:
    def make(arg: Any) -> Check:
        if not _is_number(arg):
            raise Unsupported(f"bound {arg!r}")
        return lambda v: not _is_number(v) or test(v, arg)
    return make


def _size(kind: type[Any], test: Callable[[int, int], bool]) -> Callable[[Any], Check]:
    def make(arg: Any) -> Check:
        if arg.__class__ is not int:
            raise Unsupported(f"size {arg!r}")
        return lambda v: v.__class__ is not kind or test(len(v), arg)
    return make


def _unique(arg: Any) -> Check:
    if arg is not True:
        return lambda v: True
    # only strings are decided here; anything else is left to jsonschema (False)
    return lambda v: v.__class__ is not list or (
        all(x.__class__ is str for x in v) and len(set(v)) == len(v))


def _required(arg: Any) -> Check:
    names = tuple(arg)
    return lambda v: v.__class__ is not dict or all(n in v for n in names)


_KEYWORDS: dict[str, Callable[[Any], Check]] = {
    "type": _type,
    "enum": _enum,
    "const": _const,
    "pattern": _pattern,
    "minimum": _number_bound(lambda v, a: v >= a),
    "maximum": _number_bound(lambda v, a: v <= a),
    "exclusiveMinimum": _number_bound(lambda v, a: v > a),
    "minLength": _size(str, lambda n, a: n >= a),
    "maxLength": _size(str, lambda n, a: n <= a),
    "minItems": _size(list, lambda n, a: n >= a),
    "minProperties": _size(dict, lambda n, a: n >= a),
    "uniqueItems": _unique,
    "required": _required,
}


# --- input contracts against the meta-schema --------------------------------------------


_SIMPLE_TYPES = frozenset({"array", "boolean", "integer", "null", "number", "object", "string"})
_SUBSCHEMA = frozenset({"additionalProperties", "items", "not", "propertyNames", "contains"})
_COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties",
                     "maxProperties"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_TEXTS = frozenset({"description", "title", "$comment", "format"})
_FLAGS = frozenset({"uniqueItems", "readOnly", "writeOnly", "deprecated"})
_MAX_DEPTH = 32


@lru_cache(maxsize=4096)
def _regex_ok(pattern: str) -> bool:
    """The meta-schema's ``format: regex``, as jsonschema's format checker decides it."""
    import jsonschema  # only a contract with a pattern asks (a call's start-up never does)

    try:
        return bool(jsonschema.Draft202012Validator.FORMAT_CHECKER.conforms(pattern, "regex"))
    except Exception:  # e.g. OverflowError for a{99999999999}: leave it to the slow path
        return False


def plain_contract(schema: Any, depth: int = 0) -> bool:
    """True only if ``schema`` is valid under the draft 2020-12 meta-schema.

    Decided for a whitelist of keywords; anything else answers False.
    """
    if schema.__class__ is bool:
        return True
    if schema.__class__ is not dict or depth > _MAX_DEPTH:
        return False
    for key, v in schema.items():
        if key == "type":
            if v.__class__ is str:
                ok = v in _SIMPLE_TYPES
            else:
                ok = (v.__class__ is list and len(v) > 0
                      and all(t.__class__ is str and t in _SIMPLE_TYPES for t in v)
                      and len(set(v)) == len(v))
        elif key == "properties":
            ok = v.__class__ is dict and all(plain_contract(s, depth + 1) for s in v.values())
        elif key in _SUBSCHEMA:
            ok = plain_contract(v, depth + 1)
        elif key == "required":
            ok = (v.__class__ is list and all(x.__class__ is str for x in v)
                  and len(set(v)) == len(v))
        elif key in _COUNTS:
            ok = v.__class__ is int and v >= 0
        elif key in _BOUNDS:
            ok = _is_number(v)
        elif key == "multipleOf":
            ok = _is_number(v) and v > 0
        elif key in ("enum", "examples"):
            ok = v.__class__ is list
        elif key in ("const", "default"):
            ok = True
        elif key in _TEXTS:
            ok = v.__class__ is str
        elif key == "pattern":
            ok = v.__class__ is str and _regex_ok(v)
        elif key in _FLAGS:
            ok = v.__class__ is bool
        else:
            return False
        if not ok:
            return False
    return True
