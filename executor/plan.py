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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from registry.binds import binds_of
from registry.canonical import canonical_hash
from registry.model import Row


def binds_for(sql: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The bind values a statement takes: its ``:names`` looked up in the inputs."""
    return {name: inputs.get(name) for name in binds_of(sql)}


def impact_keys(row: Row, inputs: Mapping[str, Any], environment: str) -> list[str]:
    """environment/system/object/key=value...: what two cases must not write at once.

    The first key is always the object's (resume's poisoned-resume recheck and
    the symptoms rely on it).  A row's declared dimensions (issue 17) add one
    coarser key each -- ``environment/system/product=P/version=V``,
    ``.../account=A``, ``.../route=R`` -- so that two cases changing one
    product version, account or route collide although their objects differ.
    """
    parts = [environment, row.target.system, row.target.object]
    keys = [f"{k}={inputs.get(k)!s}" for k in row.target.keys]
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
        key = f"{base}/product={inputs.get(named['product'])!s}"
        if "version" in named:
            key += f"/version={inputs.get(named['version'])!s}"
        out.append(key)
    for dimension in ("account", "route"):
        if dimension in named:
            out.append(f"{base}/{dimension}={inputs.get(named[dimension])!s}")
    return out


def idempotency_key(row: Row, inputs: Mapping[str, Any], case_id: str) -> str | None:
    if row.idempotency_key is None:
        return None
    values = {**{k: v for k, v in inputs.items()}, "case": case_id,
              "operation_id": row.operation_id, "version": row.version}
    return row.idempotency_key.format_map(_Missing(values))


class _Missing(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return ""


def fingerprint(row: Row, inputs: Mapping[str, Any], connector: str, environment: str) -> str:
    """The request's identity: same key + same fingerprint = the same request."""
    return canonical_hash({"operation_id": row.operation_id, "version": row.version,
                           "row_hash": row.row_hash, "inputs": dict(inputs),
                           "connector": connector, "environment": environment})


def plan_hash(row: Row, inputs: Mapping[str, Any], connector: str, environment: str,
              case: str, requester: str) -> str:
    return canonical_hash({"plan": 2, "row_hash": row.row_hash, "inputs": dict(inputs),
                           "connector": connector, "environment": environment,
                           "case": case, "requester": requester})


@dataclass(frozen=True)
class Plan:
    plan_hash: str
    body: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"plan_hash": self.plan_hash, **self.body}


def render(row: Row, inputs: Mapping[str, Any], connector: str, environment: str, *,
           case: str, requester: str) -> Plan:
    """The full plan: statements with binds and expected counts, checks, target, keys."""

    def sql_item(sql: str, **extra: Any) -> dict[str, Any]:
        return {"sql": sql, "binds": binds_for(sql, inputs), **extra}

    body: dict[str, Any] = {
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
    return Plan(plan_hash(row, inputs, connector, environment, case, requester), body)
