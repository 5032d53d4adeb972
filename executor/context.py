"""What one call is, before and while it runs: its context, its inputs' checks, a rollback.

Everything below the :class:`~executor.call.Executor` takes a
:class:`CallContext` -- the resolved row, the validated inputs, the case, the
caller, the connector, the intent and its idempotency key, the plan -- and
nothing else about the call.  ``crash_point`` is the test hook that kills the
process at a named boundary (``CAPGATE_CRASH_AT``); every boundary calls it
through this module, so a test can replace it in one place.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from capgate.executor.connectors import Connector
from capgate.executor.dialects import SessionTag
from capgate.executor.outcome import Outcome
from capgate.executor.plan import Plan
from capgate.registry.errors import InputInvalid, RequestTooLarge
from capgate.registry.excerpt import bounded, cut, excerpt
from capgate.registry.model import Row
from capgate.registry.names import name_problem

if TYPE_CHECKING:
    import jsonschema

CRASH_ENV = "CAPGATE_CRASH_AT"
CRASH_POINTS = ("after_prepared", "after_attempt_started", "before_commit", "after_commit",
                "after_observed")
TERMINAL = frozenset({"observed", "reconciled", "escalation_resolved"})
"""Intent statuses after which nothing more is needed (the ledger's terminal statuses)."""


def crash_point(name: str) -> None:
    """Test-only: die here, hard, when ``CAPGATE_CRASH_AT`` names this boundary."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def at_boundary(name: str) -> None:
    """Every boundary calls this; it looks ``crash_point`` up at call time (tests patch it)."""
    crash_point(name)


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


MAX_REQUEST_BYTES = 1_048_576
"""Default bound on a request's inputs as recorded (canonical JSON); see RequestTooLarge."""
MAX_INPUT_DEPTH = 64
"""Inputs nested deeper than this are refused before anything else looks at them."""
_SAFE_INT = 2**53 - 1


@lru_cache(maxsize=4096)
def _fast_yes(row_hash: str, schema_json: str) -> Callable[[Any], bool] | None:
    """The contract compiled to a plain function that says only "valid" quickly.

    :mod:`registry.fastload.fastschema` answers True only where draft 2020-12 would;
    a False (or a contract it cannot compile: None) goes to jsonschema, which
    decides and words the errors.  A call's start-up then never imports
    jsonschema for a valid request.
    """
    import json

    from capgate.registry.fastload.fastschema import Unsupported, compile_validator

    try:
        return compile_validator(json.loads(schema_json))
    except (Unsupported, RecursionError, TypeError, ValueError):
        return None


@lru_cache(maxsize=4096)
def _input_validator(row_hash: str, schema_json: str) -> jsonschema.Draft202012Validator:
    import json

    return _validator_class()(json.loads(schema_json))


@lru_cache(maxsize=1)
def _validator_class() -> type[jsonschema.Draft202012Validator]:
    """Draft 2020-12, where an ``integer`` is one the ledger records exactly.

    JSON Schema counts ``1e308`` as an integer (a number with no fraction); as a
    double it is no exact integer, and bound to an integer column it overflows or
    rounds.  So an integral float is an integer only within +-2^53, like an int
    (larger ints are refused before the schema, see :func:`_representable`).
    """
    import jsonschema  # imported on first use: a `capgate --help` never pays for it
    from jsonschema import validators

    base = jsonschema.Draft202012Validator

    def is_integer(_checker: Any, instance: Any) -> bool:
        if isinstance(instance, bool):
            return False
        if isinstance(instance, int):
            return True
        return isinstance(instance, float) and instance.is_integer() \
            and -_SAFE_INT <= instance <= _SAFE_INT

    checker = base.TYPE_CHECKER.redefine("integer", is_integer)
    extended: type[jsonschema.Draft202012Validator] = validators.extend(  # type: ignore[no-untyped-call]
        base, type_checker=checker)
    return extended


def _representable(row: Row, inputs: Mapping[str, Any]) -> None:
    """Refuse inputs the ledger cannot record exactly (RFC 8785 JSON), naming the field.

    Integers beyond 2^53, NaN and infinities, strings with lone surrogates,
    non-string keys and nesting deeper than :data:`MAX_INPUT_DEPTH` would
    either change on the way into the record or crash the canonical encoder
    after the intent was half-recorded; they are invalid input instead.
    """
    stack: list[tuple[str, Any, int]] = [("", dict(inputs), 0)]
    while stack:
        where, value, depth = stack.pop()
        problem: str | None = None
        if depth > MAX_INPUT_DEPTH:
            problem = f"nested deeper than {MAX_INPUT_DEPTH} levels"
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not -_SAFE_INT <= value <= _SAFE_INT:
                # never str() the value: beyond 4,300 digits Python refuses to (ValueError)
                digits = int(value.bit_length() * 0.30103) + 1
                problem = (f"an integer of about {digits} digits is beyond 2^53 and cannot be "
                           "recorded exactly (JSON numbers are IEEE-754 doubles); send it as "
                           "a string")
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                problem = f"{value!r} is not a JSON number"
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                problem = "the text holds a lone surrogate (not valid Unicode text)"
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    problem = f"the key {excerpt(key, 40)} is not a string"
                    break
                if not _is_text(key):
                    problem = (f"the key {_shown_key(key)} holds a lone surrogate (not valid "
                               "Unicode text)")
                    break
                stack.append((f"{where}.{key}" if where else key, item, depth + 1))
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", item, depth + 1) for i, item in enumerate(value))
        else:
            problem = f"a {type(value).__name__} is not JSON data"
        if problem is not None:
            where = _shown_key(where) if not _is_text(where) else where
            field = excerpt(where, 80) if len(where) > 80 else (where or "(input)")
            raise InputInvalid(f"input does not satisfy the contract of {row.ref}: "
                               f"{field}: {problem}", field=field,
                               operation_id=row.operation_id, version=row.version)


def _is_text(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone surrogate, which UTF-8 cannot carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown_key(text: str) -> str:
    """A name with lone surrogates escaped (``\\ud800``): printable, and safe to encode."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_SCHEMA_JSON: dict[str, str] = {}


def _schema_json(row: Row) -> str:
    """The row's input contract as JSON, once per row (by its hash: rows are immutable)."""
    found = _SCHEMA_JSON.get(row.row_hash)
    if found is None:
        import json

        from capgate.registry.model import thaw

        if len(_SCHEMA_JSON) >= 4096:
            _SCHEMA_JSON.clear()
        found = _SCHEMA_JSON[row.row_hash] = json.dumps(thaw(row.input), sort_keys=True)
    return found


def validate_input(row: Row, inputs: Mapping[str, Any],
                   max_bytes: int = MAX_REQUEST_BYTES) -> str:
    """Refuse inputs that break the row's contract, naming the field.

    Before the row's JSON Schema: what the ledger could not record exactly
    (:func:`_representable`) and requests over ``max_bytes``.  Messages quote
    offending values as bounded excerpts, never whole.  Returns the inputs'
    canonical JSON text, which the call reuses in its fingerprint and plan hash.
    """
    from capgate.registry.canonical import canonical_bytes

    _representable(row, inputs)
    canonical = canonical_bytes(dict(inputs))
    size = len(canonical)
    if size > max_bytes:
        raise RequestTooLarge(
            f"the request to {row.ref} is {size} bytes of JSON; this executor takes at most "
            f"{max_bytes} (`max_request_bytes`); nothing was recorded",
            size=size, limit=max_bytes, operation_id=row.operation_id)
    _check_contract(row, inputs)
    return canonical.decode("utf-8")


def check_names(case: object, who: object, task: object = None) -> None:
    """Refuse a case id, an identity or a task that is no short line of printable text
    (:mod:`registry.names`), before anything is looked up or recorded."""
    named = [("case", "the case id", case), ("who", "the identity", who)]
    if task is not None:
        named.append(("task", "the task", task))
    for field, title, value in named:
        problem = name_problem(value)
        if problem is not None:
            shown = excerpt(value, 60) if isinstance(value, str) else type(value).__name__
            raise InputInvalid(f"{title} {shown} {problem}; nothing was recorded",
                               field=field)


def validated_inputs(row: Row, inputs: Mapping[str, Any],
                     max_bytes: int = MAX_REQUEST_BYTES) -> tuple[dict[str, Any], str]:
    """:func:`validate_input`, and the inputs as the ledger records them, with their text.

    The record is canonical JSON, where ``2.0`` is the number ``2`` and a tuple a
    list; a resumed retry binds what the record holds.  So every attempt binds
    that -- the first one too -- and ``:amount / 3`` computes the same on each.
    """
    text = validate_input(row, inputs, max_bytes)
    recorded: dict[str, Any] = json.loads(text)
    return recorded, text


def _check_contract(row: Row, inputs: Mapping[str, Any]) -> None:
    """The row's JSON Schema: a quick compiled "valid", else jsonschema's verdict."""
    schema_json = _schema_json(row)
    fast = _fast_yes(row.row_hash, schema_json)
    if fast is not None:
        try:
            if fast(dict(inputs)):
                return
        except RecursionError:
            pass  # jsonschema below words it
    validator = _input_validator(row.row_hash, schema_json)
    try:
        errors = sorted(validator.iter_errors(dict(inputs)), key=lambda e: list(e.absolute_path))
    except RecursionError:
        raise InputInvalid(f"input does not satisfy the contract of {row.ref}: nested too "
                           "deeply to check", field="(input)",
                           operation_id=row.operation_id, version=row.version) from None
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.absolute_path) or "(input)"
        if first.validator == "additionalProperties" and isinstance(first.instance, dict):
            allowed = set(first.schema.get("properties", {})) if isinstance(
                first.schema, dict) else set()
            extras = sorted(set(first.instance) - allowed)
            prefix = where + "." if where != "(input)" else ""
            where = ", ".join(prefix + e for e in extras) or where
        elif first.validator == "required" and isinstance(first.instance, dict):
            required: Any = first.validator_value
            missing = [r for r in required if r not in first.instance]
            where = ", ".join(missing) or where
        raise InputInvalid(
            f"input does not satisfy the contract of {row.ref}: {excerpt(where, 120)[1:-1]}: "
            f"{_schema_message(first)}",
            field=where, problems=[{"field": ".".join(str(p) for p in e.absolute_path),
                                    "message": _schema_message(e)} for e in errors[:20]],
            operation_id=row.operation_id, version=row.version,
        )


def _schema_message(error: jsonschema.ValidationError) -> str:
    """jsonschema's message without the offending value quoted whole."""
    if error.validator in ("maxLength", "minLength") and isinstance(error.instance, str):
        return (f"{len(error.instance)} characters, "
                f"{'at most' if error.validator == 'maxLength' else 'at least'} "
                f"{error.validator_value} allowed")
    text = error.message
    shown = repr(error.instance)
    if len(shown) > 120 and shown in text:
        text = text.replace(shown, excerpt(error.instance, 60))
    return cut(text, 500)


@dataclass(frozen=True)
class CallContext:
    row: Row
    inputs: Mapping[str, Any]
    case_id: str
    who: str
    connector: Connector
    intent_id: str
    idem_key: str | None
    fingerprint: str
    plan: Plan
    attempt: int = 1
    rehearse: bool = False
    resumed: bool = False
    """A later attempt of an intent already prepared (resume, the timeout contract)."""
    task: str | None = None
    """The task the case was opened for; recorded on the case by its first ``prepared``."""

    @property
    def tag(self) -> SessionTag:
        # issue 18: the row's date inputs travel with the tag, so a dialect that must
        # bind dates as dates (Oracle: no NLS_DATE_FORMAT dependence) can
        return SessionTag(self.case_id, self.row.operation_id, self.intent_id,
                          self.row.date_inputs)

    def outcome(self, status: str, evidence: Mapping[str, Any],
                reason: Mapping[str, Any] | None = None) -> Outcome:
        """This call's outcome.  A write's evidence and every reason are bounded
        (``registry.excerpt``): they are recorded and replayed; a read's rows go
        back to its caller whole and are never recorded."""
        if self.row.is_write:
            evidence = bounded(evidence)
        return Outcome(status=status, intent_id=self.intent_id, case_id=self.case_id,
                       operation_id=self.row.operation_id, version=self.row.version,
                       row_hash=self.row.row_hash, idempotency_key=self.idem_key,
                       fingerprint=self.fingerprint, attempt=self.attempt,
                       evidence=evidence, reason=bounded(reason) if reason else reason)


class Rollback(Exception):
    """Internal: a count, check or error that rolls the transaction back."""

    def __init__(self, reason: dict[str, Any]):
        super().__init__(reason.get("kind", "rollback"))
        self.reason = reason
