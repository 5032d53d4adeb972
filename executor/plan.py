"""Plans: exactly what a call would send, computed without touching the target.

``plan`` and ``call`` share this code (STYLE: dry run and real run share one
path): the call renders the same plan and compares hashes with the approval.
The plan hash covers the row hash, the inputs, the connector, the environment,
the case and the requester -- everything else in the plan (statements, binds,
expected counts, target, impact keys) is a function of those.  So an approval,
which names a plan hash, is worth nothing in another case or to another
identity.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from capgate.registry.binds import binds_of
from capgate.registry.canonical import canonical_text, hash_of_text, object_text, scalar_text
from capgate.registry.model import Row


def binds_for(sql: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The bind values a statement takes: its ``:names`` looked up in the inputs."""
    return {name: inputs.get(name) for name in binds_of(sql)}


def key_value(value: Any) -> Any:
    """``value`` as it enters a key: as JSON knows it, whatever its Python type.

    ``1`` and ``1.0`` are one JSON number (RFC 8785 writes both as ``1``, so the
    request's fingerprint is the same), but Python prints them differently -- and
    a key printed from ``1.0`` would be another key: a retry sending ``1.0`` would
    not find the first call's idempotency key and write again, and another case
    would not meet the first one's impact claim.  So a float is the number its
    canonical JSON reads back as (an integral one is its int), in lists and
    objects too, and a tuple is the list JSON makes of it; strings, ints,
    booleans and None are left as they are, so keys print as they always have.
    A call's inputs arrive here already in that form
    (:func:`executor.context.validated_inputs`); recorded inputs read back in it.
    """
    kind = type(value)
    if kind is float:  # (NaN and infinities are no JSON: refused as inputs, kept here)
        return json.loads(canonical_text(value)) if math.isfinite(value) else value
    if kind is list or kind is tuple:
        return [key_value(item) for item in value]
    if kind is dict:
        return {key: key_value(item) for key, item in value.items()}
    return value


def _key_text(inputs: Mapping[str, Any], name: str) -> str:
    return str(key_value(inputs.get(name)))


def impact_keys(row: Row, inputs: Mapping[str, Any], environment: str) -> list[str]:
    """environment/system/object/key=value...: what two cases must not write at once.

    The first key is always the object's (resume's poisoned-resume recheck and
    the symptoms rely on it).  A row's declared dimensions (issue 17) add one
    coarser key each -- ``environment/system/product=P/version=V``,
    ``.../account=A``, ``.../route=R`` -- so that two cases changing one
    product version, account or route collide although their objects differ.
    """
    parts = [environment, row.target.system, row.target.object]
    keys = [f"{k}={_key_text(inputs, k)}" for k in row.target.keys]
    out = ["/".join(parts + keys)]
    if row.target.dimensions:
        out.extend(dimension_keys(row, inputs, environment))
    return out


DIMENSIONS = ("product", "version", "account", "route")
"""The impact-key dimensions a row's target may declare, in key order."""


def dimension_keys(row: Row, inputs: Mapping[str, Any], environment: str) -> list[str]:
    """The coarser keys of the row's declared dimensions (product and version make one)."""
    named = dict(row.target.dimensions)
    base = f"{environment}/{row.target.system}"
    out: list[str] = []
    if "product" in named:
        key = f"{base}/product={_key_text(inputs, named['product'])}"
        if "version" in named:
            key += f"/version={_key_text(inputs, named['version'])}"
        out.append(key)
    for dimension in ("account", "route"):
        if dimension in named:
            out.append(f"{base}/{dimension}={_key_text(inputs, named[dimension])}")
    return out


def idempotency_key(row: Row, inputs: Mapping[str, Any], case_id: str) -> str | None:
    if row.idempotency_key is None:
        return None
    values = {**{k: key_value(v) for k, v in inputs.items()}, "case": case_id,
              "operation_id": row.operation_id, "version": row.version}
    return row.idempotency_key.format_map(_Missing(values))


class _Missing(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return ""


def fingerprint(row: Row, inputs: Mapping[str, Any], connector: str, environment: str, *,
                inputs_text: str | None = None) -> str:
    """The request's identity: same key + same fingerprint = the same request.

    The canonical hash of ``{operation_id, version, row_hash, inputs, connector,
    environment}``, built from its members' texts; ``inputs_text`` is the inputs'
    canonical text when the caller has it already (a call serialises them once).
    """
    return hash_of_text(object_text({
        "operation_id": scalar_text(row.operation_id), "version": scalar_text(row.version),
        "row_hash": scalar_text(row.row_hash),
        "inputs": canonical_text(dict(inputs)) if inputs_text is None else inputs_text,
        "connector": scalar_text(connector), "environment": scalar_text(environment)}))


def plan_hash(row: Row, inputs: Mapping[str, Any], connector: str, environment: str,
              case: str, requester: str, *, inputs_text: str | None = None) -> str:
    """The canonical hash of ``{plan: 2, row_hash, inputs, connector, environment, case,
    requester}`` (see :func:`fingerprint` for ``inputs_text``)."""
    return hash_of_text(object_text({
        "plan": "2", "row_hash": scalar_text(row.row_hash),
        "inputs": canonical_text(dict(inputs)) if inputs_text is None else inputs_text,
        "connector": scalar_text(connector), "environment": scalar_text(environment),
        "case": scalar_text(case), "requester": scalar_text(requester)}))


APPROVAL_KINDS = ("rehearsal", "simulation", "production_simulation")
"""Plan kinds that are gated whatever row they name (a rehearsal or simulation gate)."""


def needs_approval(body: Mapping[str, Any]) -> bool:
    """Whether a recorded plan runs only with an approval: a gated row, a DDL change (DDL
    plans are always gated), a rehearsal's or a simulation's gate."""
    authorization = body.get("authorization")
    return (body.get("kind") in APPROVAL_KINDS or body.get("effect_class") == "ddl"
            or (isinstance(authorization, Mapping) and authorization.get("kind") == "gate"))


class Plan:
    """A plan: its hash, and its body (the statements, binds, checks, target, keys).

    The body is built when first read: a call that is not gated needs only the hash.
    """

    __slots__ = ("__dict__", "_make", "plan_hash")

    def __init__(self, plan_hash: str,
                 body: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> None:
        self.plan_hash = plan_hash
        self._make: Callable[[], Mapping[str, Any]] | None = None
        if callable(body):
            self._make = body
        else:
            self.__dict__["body"] = body

    @functools.cached_property
    def body(self) -> Mapping[str, Any]:
        make = self._make
        assert make is not None
        return make()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and (self.plan_hash, dict(self.body)) == (
            other.plan_hash, dict(other.body))

    def __hash__(self) -> int:
        return hash(self.plan_hash)

    def __repr__(self) -> str:
        return f"Plan({self.plan_hash!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"plan_hash": self.plan_hash, **self.body}


def render(row: Row, inputs: Mapping[str, Any], connector: str, environment: str, *,
           case: str, requester: str, inputs_text: str | None = None) -> Plan:
    """The full plan: statements with binds and expected counts, checks, target, keys.

    The hash is computed now; the body when it is first read (see :class:`Plan`).
    """
    inputs = dict(inputs)
    return Plan(plan_hash(row, inputs, connector, environment, case, requester,
                          inputs_text=inputs_text),
                lambda: _body(row, inputs, connector, environment, case, requester))


def _body(row: Row, inputs: Mapping[str, Any], connector: str, environment: str,
          case: str, requester: str) -> dict[str, Any]:
    def sql_item(sql: str, **extra: Any) -> dict[str, Any]:
        return {"sql": sql, "binds": binds_for(sql, inputs), **extra}

    return {
        "operation_id": row.operation_id,
        "version": row.version,
        "row_hash": row.row_hash,
        "connector": connector,
        "environment": environment,
        "case": case,
        "requester": requester,
        "effect_class": str(row.effect_class),
        "shape": str(row.shape) if row.shape else None,
        "recovery": str(row.recovery),
        "timeout": {"seconds": row.timeout.seconds, "on_timeout": str(row.timeout.on_timeout)},
        "authorization": {"kind": str(row.authorization.kind),
                          "approver_roles": list(row.authorization.approver_roles),
                          "four_eyes": row.authorization.four_eyes},
        "inputs": dict(inputs),
        "target": {"system": row.target.system, "object": row.target.object,
                   "keys": {k: inputs.get(k) for k in row.target.keys}},
        "impact_keys": impact_keys(row, inputs, environment) if row.is_write else [],
        "statements": [
            sql_item(s.sql, name=s.name, expect_rows=s.expect_rows.to_value()
                     if s.expect_rows else None)
            for s in row.statements
        ],
        "steps": [
            {"name": s.name,
             **(sql_item(s.sql, expect_rows=s.expect_rows.to_value() if s.expect_rows else None)
                if s.sql else {}),
             **({"check": sql_item(s.check, expect=s.expect.to_dict() if s.expect else None),
                 "otherwise": {"abort": s.abort} if s.abort else {"skip_to": s.skip_to}}
                if s.check else {}),
             **({"function": s.function} if s.function else {})}
            for s in row.steps
        ],
        "verify": [sql_item(c.sql, name=c.name, expect=c.expect.to_dict()) for c in row.verify],
        "replay": sql_item(row.replay.sql) if row.replay else None,
        "compensation": [sql_item(s.sql, expect_rows=s.expect_rows.to_value()
                                  if s.expect_rows else None) for s in row.compensation],
        "post_commit": [sql_item(c.sql, name=c.name, expect=c.expect.to_dict())
                        for c in row.post_commit],
    }
