"""Semantic checks a JSON Schema cannot express, each with its own code.

They run on rows that already passed the schema.  Binds are found with
SQLAlchemy's own ``text()`` parser -- the same one the executor uses to bind
them -- so the validator and the executor can never disagree about what a
``:name`` is.  Whether a query writes is decided with sqlglot's parser, not a
regex, so a ``DELETE`` inside a CTE or a ``SELECT ... FOR UPDATE`` is caught
and a column called ``updated_at`` is not.

sqlglot is imported on the first check, not with this module: the executor
imports :func:`binds_of` on every call's path, and a call whose files come
from the validation cache parses no SQL at all.
"""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from capgate.registry.binds import binds_of as binds_of  # re-exported: the checks' own helper
from capgate.registry.errors import Problem
from capgate.registry.fastload.fastschema import plain_contract
from capgate.registry.fastload.yamlpos import Located, Path, render_path
from capgate.registry.rules import (
    COMPENSATION_UNVERIFIABLE,
    INVALID_VALUE,
    MISSING_APPROVER_ROLES,
    MISSING_COMPENSATION,
    MISSING_STATEMENTS,
    OPEN_INPUT_CONTRACT,
    POST_COMMIT_WITHOUT_COMPENSATION,
    SHAPE_MISMATCH,
    SQL_PARSE_ERROR,
    TIMEOUT_CLAIMS_ROLLBACK,
    UNDECLARED_CONNECTOR,
    UNKNOWN_BIND,
    UNKNOWN_KEY_FIELD,
    UNKNOWN_STEP,
    UNKNOWN_TARGET_KEY,
    UNSAFE_RETRY,
    UNUSED_INPUT,
    UNVERIFIABLE,
    WRITING_READ,
)

WRITE_CLASSES = ("transactional", "compensable", "irreversible")
KEY_BUILTINS = frozenset({"case", "operation_id", "version"})


@lru_cache(maxsize=1)
def _writing_nodes() -> tuple[type[Any], ...]:
    from sqlglot import exp

    return (exp.Insert, exp.Update, exp.Delete, exp.Merge, exp.Create, exp.Drop, exp.Alter,
            exp.TruncateTable, exp.Command, exp.Grant, exp.Into)


@lru_cache(maxsize=65536)
def writing_reason(sql: str) -> str | None:
    """Why ``sql`` is not a pure read, or None when it only reads.

    Raises ``ValueError`` when no dialect can parse it.
    """
    import sqlglot
    from sqlglot import exp

    writing = _writing_nodes()
    last: Exception | None = None
    for dialect in (None, "postgres", "mysql", "oracle", "sqlite"):
        try:
            trees = sqlglot.parse(sql, read=dialect)
        except sqlglot.errors.SqlglotError as exc:  # ParseError, TokenError (an open quote)
            last = exc
            continue
        except RecursionError:
            last = ValueError("the SQL is nested too deeply to parse")
            continue
        for tree in trees:
            if tree is None:
                continue
            if not isinstance(tree, exp.Query):
                return f"is a {tree.key.upper()} statement, not a query"
            for node in tree.walk():
                if isinstance(node, writing):
                    return f"contains a {node.key.upper()}"
                if isinstance(node, exp.Lock):
                    return "locks rows (FOR UPDATE/SHARE)"
        return None
    raise ValueError(str(last).splitlines()[0] if last else "unparseable")


@dataclass
class RowContext:
    """One schema-valid row with the means to locate its fields."""

    row: Mapping[str, Any]
    index: int
    located: Located
    source: str

    def at(self, path: Path, code: str, message: str, *, key: bool = False) -> Problem:
        line, col = self.located.where(("rows", self.index, *path), key=key)
        return Problem(self.source, line, col, code, render_path(path), message)


def _sql_sites(row: Mapping[str, Any]) -> Iterator[tuple[Path, str, bool]]:
    """Every SQL text of a row: (path, sql, must_only_read)."""
    is_read = row["effect_class"] == "read"
    for i, st in enumerate(row.get("statements", ())):
        yield ("statements", i, "sql"), st["sql"], is_read
    for i, st in enumerate(row.get("steps", ())):
        if "sql" in st:
            yield ("steps", i, "sql"), st["sql"], False
        if "check" in st:
            yield ("steps", i, "check"), st["check"], True
    for i, c in enumerate(row.get("verify", ())):
        yield ("verify", i, "sql"), c["sql"], True
    if "replay" in row:
        yield ("replay", "sql"), row["replay"]["sql"], True
    if "landed_probe" in row:
        yield ("landed_probe", "sql"), row["landed_probe"]["sql"], True
    if "symptom" in row:
        yield ("symptom", "sql"), row["symptom"]["sql"], True
        if "actor" in row["symptom"]:
            yield ("symptom", "actor", "sql"), row["symptom"]["actor"]["sql"], True
    for i, st in enumerate(row.get("compensation", ())):
        yield ("compensation", i, "sql"), st["sql"], False
    for i, c in enumerate(row.get("post_commit", ())):
        yield ("post_commit", i, "sql"), c["sql"], True
    for i, c in enumerate(row.get("compensation_verify", ())):
        yield ("compensation_verify", i, "sql"), c["sql"], True
    # simulation first (issue 16): every query the cycle and the effect inventory run reads
    for i, effect in enumerate(row.get("expected_effects", ())):
        if "probe" in effect:
            yield ("expected_effects", i, "probe", "sql"), effect["probe"]["sql"], True
    simulation = row.get("simulation") or {}
    for i, q in enumerate(simulation.get("baseline", ())):
        yield ("simulation", "baseline", i, "sql"), q["sql"], True
    if "reconciliation" in simulation:
        yield ("simulation", "reconciliation", "sql"), simulation["reconciliation"]["sql"], True


def check_row(ctx: RowContext, declared_connectors: set[str]) -> list[Problem]:
    """All semantic findings for one schema-valid row."""
    row = ctx.row
    out: list[Problem] = []
    contract = row["input"]
    effect = row["effect_class"]

    if contract.get("additionalProperties") is not False or contract.get("type") != "object":
        out.append(ctx.at(("input",), OPEN_INPUT_CONTRACT.code,
                          "the input contract must be `type: object` with "
                          "`additionalProperties: false`"))
    contract_ok = True
    if not plain_contract(contract):  # the meta-schema check is slow; most contracts are plain
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(dict(contract))
        except jsonschema.SchemaError as exc:
            contract_ok = False
            out.append(ctx.at(("input", *exc.relative_path), INVALID_VALUE.code,
                              f"not a valid JSON Schema: {exc.message}"))
        except Exception as exc:  # e.g. OverflowError from the pattern a{99999999999}
            contract_ok = False
            out.append(ctx.at(("input",), INVALID_VALUE.code,
                              f"not a valid JSON Schema: {type(exc).__name__}: {exc}"))
    # An invalid contract was reported above; the checks below must not trip on it.
    found_props = contract.get("properties")
    props: Mapping[str, Any] = found_props if isinstance(found_props, Mapping) else {}
    found_required = contract.get("required")
    required: list[Any] = found_required if isinstance(found_required, list) else []

    if row["connector"] not in declared_connectors:
        out.append(ctx.at(("connector",), UNDECLARED_CONNECTOR.code,
                          f"connector {row['connector']!r} is not declared under `connectors:` "
                          "in this file"))

    used: set[str] = set()
    for path, sql, must_read in _sql_sites(row):
        binds = binds_of(sql)
        used |= binds
        for name in sorted(binds - set(props)):
            out.append(ctx.at(path, UNKNOWN_BIND.code, f"bind :{name} is not an input property "
                              f"(inputs: {', '.join(sorted(props)) or 'none'})"))
        if must_read:
            try:
                reason = writing_reason(sql)
            except ValueError as exc:
                out.append(ctx.at(path, SQL_PARSE_ERROR.code, f"cannot parse SQL: {exc}"))
                continue
            if reason:
                what = "a read row" if path[0] == "statements" else "a read-only query"
                out.append(ctx.at(path, WRITING_READ.code,
                                  f"{what} must not write: the SQL {reason}"))

    keys = row.get("target", {}).get("keys", [])
    for i, key in enumerate(keys):
        if key not in props:
            out.append(ctx.at(("target", "keys", i), UNKNOWN_TARGET_KEY.code,
                              f"target key {key!r} is not an input property"))
    used |= set(keys)
    dimensions = row.get("target", {}).get("dimensions", {})
    for dimension, name in dimensions.items():
        if name not in props:
            out.append(ctx.at(("target", "dimensions", dimension), UNKNOWN_TARGET_KEY.code,
                              f"the {dimension} dimension names {name!r}, which is not an "
                              "input property"))
    if "version" in dimensions and "product" not in dimensions:
        out.append(ctx.at(("target", "dimensions", "version"), UNKNOWN_TARGET_KEY.code,
                          "a version dimension needs its product: declare `product` too "
                          "(the impact key is product=P/version=V)"))
    used |= set(dimensions.values())

    template = row.get("idempotency_key")
    if template is not None:
        try:
            parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template)
                      if f is not None]
        except ValueError as exc:
            out.append(ctx.at(("idempotency_key",), UNKNOWN_KEY_FIELD.code,
                              f"malformed template: {exc}"))
            parsed = []
        fields = [f for f, _, _ in parsed]
        for name, spec, conversion in parsed:
            # a key is the input's value as text; a format spec would fail on some values
            # (`{id:05d}` on a string) and a conversion would make one value two keys
            if spec or conversion:
                out.append(ctx.at(("idempotency_key",), UNKNOWN_KEY_FIELD.code,
                                  f"template field {{{name}}} takes no format spec or "
                                  f"conversion (found {template[:80]!r}); write {{{name}}}"))
        for name in fields:
            if name not in props and name not in KEY_BUILTINS:
                shown = name if name.isidentifier() else repr(name)
                out.append(ctx.at(("idempotency_key",), UNKNOWN_KEY_FIELD.code,
                                  f"template field {{{shown}}} is neither an input nor one of "
                                  f"{{case}}, {{operation_id}}, {{version}}"))
        used |= set(fields)
    elif effect in WRITE_CLASSES:
        out.append(ctx.at(("effect_class",), UNKNOWN_KEY_FIELD.code,
                          "a write row needs an idempotency_key template, e.g. \"{case}:{id}\""))

    if effect != "ddl":
        for i, name in enumerate(required):
            if isinstance(name, str) and name not in used:  # a non-string was reported above
                out.append(ctx.at(("input", "required", i), UNUSED_INPUT.code,
                                  f"required input {name!r} is used by no SQL, target key or "
                                  "idempotency key"))

    out.extend(_shape_checks(ctx))

    if effect == "compensable" and not row.get("compensation"):
        out.append(ctx.at(("effect_class",), MISSING_COMPENSATION.code,
                          "a compensable row needs `compensation` statements"))
    for i, st in enumerate(row.get("compensation", ())):
        if "expect_rows" not in st:
            out.append(ctx.at(("compensation", i), MISSING_STATEMENTS.code,
                              "a compensation statement needs expect_rows"))
    if row.get("post_commit") and not row.get("compensation"):
        out.append(ctx.at(("post_commit",), POST_COMMIT_WITHOUT_COMPENSATION.code,
                          "a failed post_commit check runs the compensation, and this row "
                          "declares none: add `compensation` statements (and "
                          "`compensation_verify`) or drop the post_commit checks"))
    if row.get("compensation") and not row.get("compensation_verify"):
        out.append(ctx.at(("compensation",), COMPENSATION_UNVERIFIABLE.code,
                          "a compensation needs `compensation_verify`: checks that re-read the "
                          "restored state after it committed (without them `compensated` "
                          "could never be proven)"))
    if row.get("compensation_verify") and not row.get("compensation"):
        out.append(ctx.at(("compensation_verify",), COMPENSATION_UNVERIFIABLE.code,
                          "`compensation_verify` checks a compensation this row does not "
                          "declare"))

    out.extend(_timeout_checks(ctx))

    auth = row["authorization"]
    if auth["kind"] == "gate" and not auth.get("approver_roles"):
        out.append(ctx.at(("authorization",), MISSING_APPROVER_ROLES.code,
                          "a gate row must name approver_roles"))
    if auth["kind"] == "read_grant" and effect != "read":
        out.append(ctx.at(("authorization", "kind"), INVALID_VALUE.code,
                          "a write row cannot be authorised by a read_grant"))

    if contract_ok:
        out.extend(_example_checks(ctx))
    from capgate.registry.simulation_checks import simulation_problems  # issue 16: its own module

    out.extend(simulation_problems(ctx))
    return out


def _timeout_checks(ctx: RowContext) -> list[Problem]:
    """The effect-of-timeout contract must be one the executor can keep.

    The row's ``timeout.on_timeout``, ``idempotent`` and ``recovery`` decide what
    happens after a timeout or a lost connection (``Row.timeout_action``); these
    combinations would make that decision a lie.
    """
    row = ctx.row
    effect = row["effect_class"]
    out: list[Problem] = []
    if effect in ("read", "ddl"):
        return out
    on_timeout = row["timeout"]["on_timeout"]
    recovery = row["recovery"]
    idempotent = bool(row.get("idempotent", False))
    if effect == "irreversible" and on_timeout == "rolled_back":
        out.append(ctx.at(("timeout", "on_timeout"), TIMEOUT_CLAIMS_ROLLBACK.code,
                          "an irreversible effect is not undone by a rollback: a timeout "
                          "leaves it unknown (on_timeout: unknown)"))
    if recovery == "retryable" and effect in ("irreversible", "compensable") and not idempotent:
        out.append(ctx.at(("recovery",), UNSAFE_RETRY.code,
                          f"a retryable {effect} row must be safe to repeat: declare "
                          "`idempotent: true` if it is, else recovery: reconcile_first"))
    if (effect == "irreversible" or recovery == "reconcile_first") \
            and "landed_probe" not in row and effect not in ("transactional", "compensable"):
        out.append(ctx.at(("recovery",), UNVERIFIABLE.code,
                          "nothing can tell after the fact whether this effect landed: "
                          "declare a `landed_probe` (the landing marker proves only what "
                          "commits with it)"))
    safe = idempotent or effect == "transactional"  # the marker deduplicates a repeat
    if row["timeout"].get("attempts", 1) > 1 and not (safe and recovery == "retryable"
                                                      and on_timeout == "rolled_back"):
        out.append(ctx.at(("timeout", "attempts"), UNSAFE_RETRY.code,
                          "automatic attempts after a timeout need an idempotent, retryable "
                          "row whose timeout rolls back"))
    return out


def _shape_checks(ctx: RowContext) -> list[Problem]:
    row = ctx.row
    effect = row["effect_class"]
    shape = row.get("shape")
    out: list[Problem] = []
    statements = row.get("statements", [])
    steps = row.get("steps", [])
    if effect in ("read", "ddl"):
        if shape is not None:
            out.append(ctx.at(("shape",), SHAPE_MISMATCH.code, f"a {effect} row has no shape"))
        if steps:
            out.append(ctx.at(("steps",), SHAPE_MISMATCH.code,
                              f"a {effect} row has no leased steps"))
    if effect == "read" and not statements:
        out.append(ctx.at(("statements",), MISSING_STATEMENTS.code,
                          "a read row needs its query in `statements`"))
    if effect == "ddl" and "ddl" not in row:
        out.append(ctx.at(("effect_class",), SHAPE_MISMATCH.code,
                          "a ddl row must name its `ddl.objects`"))
    if effect != "ddl" and "ddl" in row:
        out.append(ctx.at(("ddl",), SHAPE_MISMATCH.code, "only ddl rows have a `ddl` scope"))
    if effect == "ddl" and row["authorization"]["kind"] != "gate":
        out.append(ctx.at(("authorization", "kind"), MISSING_APPROVER_ROLES.code,
                          "ddl rows are always gated"))
    if effect not in WRITE_CLASSES:
        return out
    if shape is None:
        out.append(ctx.at(("effect_class",), SHAPE_MISMATCH.code,
                          "a write row needs `shape: collapsed` or `shape: leased`"))
    elif shape == "collapsed":
        if steps:
            out.append(ctx.at(("steps",), SHAPE_MISMATCH.code,
                              "a collapsed row uses statements, not steps"))
        if not statements:
            out.append(ctx.at(("shape",), MISSING_STATEMENTS.code,
                              "a collapsed write needs statements"))
    elif shape == "leased":
        if statements:
            out.append(ctx.at(("statements",), SHAPE_MISMATCH.code,
                              "a leased row uses steps, not statements"))
        if not steps:
            out.append(ctx.at(("shape",), MISSING_STATEMENTS.code, "a leased write needs steps"))
    for i, st in enumerate(statements):
        if "expect_rows" not in st:
            out.append(ctx.at(("statements", i), MISSING_STATEMENTS.code,
                              "a writing statement needs expect_rows (an integer or a range)"))
    names = [s["name"] for s in steps]
    for i, st in enumerate(steps):
        kinds = [k for k in ("sql", "check", "function") if k in st]
        if len(kinds) != 1:
            out.append(ctx.at(("steps", i), SHAPE_MISMATCH.code,
                              "a step is exactly one of `sql`, `check` or `function`"))
            continue
        if "sql" in st and "expect_rows" not in st:
            out.append(ctx.at(("steps", i), MISSING_STATEMENTS.code,
                              "a SQL step needs expect_rows"))
        if "check" in st and ("expect" not in st or "otherwise" not in st):
            out.append(ctx.at(("steps", i), SHAPE_MISMATCH.code,
                              "a check step needs `expect` and `otherwise` (abort or skip_to)"))
        target = st.get("otherwise", {}).get("skip_to")
        if target is not None and target not in names[i + 1:]:
            out.append(ctx.at(("steps", i, "otherwise", "skip_to"), UNKNOWN_STEP.code,
                              f"skip_to {target!r} names no later step"))
    if len(set(names)) != len(names):
        out.append(ctx.at(("steps",), SHAPE_MISMATCH.code, "step names must be unique"))
    return out


def _example_checks(ctx: RowContext) -> list[Problem]:
    row = ctx.row
    out: list[Problem] = []
    if not row.get("examples"):
        return out  # building a validator for nothing costs more than every check above
    import jsonschema

    try:
        validator = jsonschema.Draft202012Validator(dict(row["input"]))
    except Exception:
        return out
    n_statements = len(row.get("statements", ()))
    for i, example in enumerate(row.get("examples", ())):
        for err in validator.iter_errors(example["input"]):
            where = render_path(tuple(err.absolute_path)) if err.absolute_path else "input"
            out.append(ctx.at(("examples", i, "input", *err.absolute_path), INVALID_VALUE.code,
                              f"example input does not satisfy the contract at {where}: "
                              f"{err.message}"))
        counts = example.get("expect_rows")
        if counts is not None and row.get("statements") and len(counts) != n_statements:
            out.append(ctx.at(("examples", i, "expect_rows"), INVALID_VALUE.code,
                              f"expected {n_statements} counts (one per statement), "
                              f"got {len(counts)}"))
    return out
