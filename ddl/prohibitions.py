"""The six standing prohibitions, written as data.

Each ``Prohibition`` carries its name, code, groups and the error class it
raises; the long text (what it refuses, the anti-pattern, the best practice)
is the error's docstring, so ``capgate explain CG50x`` and
``capgate ddl prohibitions`` print the same words.  Five of them are checks
over the plan -- plain data, so they run when the plan is made and again,
unchanged, when it is applied; the sixth (snapshot overwrite) is enforced
by every ``SnapshotStore``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from capgate.ddl import sqltext
from capgate.registry.errors import (
    DdlProhibition,
    RemoteDependentsWithoutFarSideStep,
    SchemaWideRecompile,
    SnapshotOverwrite,
    SpecWithoutBody,
    StaleExtract,
    UngreppedCallers,
)

Plan = Mapping[str, Any]
Check = Callable[[Plan], list[dict[str, Any]]]


@dataclass(frozen=True)
class Finding:
    """One violation found in a plan."""

    name: str
    code: str
    message: str
    details: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "code": self.code, "message": self.message,
                "details": self.details}


@dataclass(frozen=True)
class Prohibition:
    """A standing prohibition: its identity, its text and its check."""

    name: str
    code: str
    error: type[DdlProhibition]
    groups: tuple[str, ...]
    check: Check | None
    """A check over the plan's data; None when another component enforces it."""
    enforced_by: str

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.error.__doc__ or "")

    @property
    def summary(self) -> str:
        return self.doc.splitlines()[0] if self.doc else self.name

    def _section(self, title: str) -> str:
        m = re.search(rf"^{title}:\s*(.*?)(?:\n\n|\Z)", self.doc, re.MULTILINE | re.DOTALL)
        return " ".join(m.group(1).split()) if m else ""

    @property
    def anti_pattern(self) -> str:
        return self._section("Anti-pattern")

    @property
    def best_practice(self) -> str:
        return self._section("Best practice")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "code": self.code,
            "error": self.error.__name__,
            "groups": list(self.groups),
            "summary": self.summary,
            "anti_pattern": self.anti_pattern,
            "best_practice": self.best_practice,
            "enforced_by": self.enforced_by,
        }


# --- the checks ------------------------------------------------------------------------------


def _objects(plan: Plan) -> list[Mapping[str, Any]]:
    return list(plan.get("objects") or [])


def check_stale_extract(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for o in _objects(plan):
        if o.get("base_signature") != o.get("live_signature"):
            out.append({
                "message": f"{o['key']}: the live object ({o.get('live_signature')}) no longer "
                f"matches snapshot {o.get('base_snapshot_id')} ({o.get('base_signature')})",
                "object": o["key"],
                "base_snapshot_id": o.get("base_snapshot_id"),
                "base_signature": o.get("base_signature"),
                "live_signature": o.get("live_signature"),
            })
    return out


_BODY_KIND = {"package": "package_body", "type": "type_body"}


def check_spec_without_body(plan: Plan) -> list[dict[str, Any]]:
    keys = {str(o["key"]) for o in _objects(plan)}
    kinds = {(o["object"]["kind"], o["object"].get("schema"), o["object"]["name"])
             for o in _objects(plan)}
    out = []
    for o in _objects(plan):
        obj = o["object"]
        body_kind = _BODY_KIND.get(str(obj["kind"]))
        if body_kind is None or not o.get("body_exists"):
            continue
        if (body_kind, obj.get("schema"), obj["name"]) not in kinds:
            out.append({
                "message": f"{o['key']}: the spec changes but its existing body is not in the plan",
                "object": o["key"],
                "missing": body_kind,
                "plan_objects": sorted(keys),
            })
    return out


_WILDCARDS = {"*", "all", "schema", "invalid", "all_invalid"}


def is_schema_wide(request: str) -> bool:
    """Whether a recompile request covers a schema: a wildcard, ``schema:``, ``%``, or a call
    such as ``DBMS_UTILITY.COMPILE_SCHEMA(...)`` / ``UTL_RECOMP`` anywhere in its text."""
    text = request.strip().lower()
    return (text in _WILDCARDS or text.endswith(".*") or text.startswith("schema:")
            or "%" in text or "*" in text or sqltext.schema_wide_recompile_in(request) is not None)


def check_schema_wide_recompile(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for item in plan.get("recompile") or []:
        if is_schema_wide(str(item)):
            out.append({"message": f"recompile request {item!r} covers a whole schema",
                        "request": item})
    texts: list[tuple[str, str]] = [(str(o["key"]), str(o.get("new_source", "")))
                                    for o in _objects(plan)]
    texts += [(f"smoke:{s.get('name')}", str(s.get("sql", ""))) for s in plan.get("smoke") or []]
    texts += [(f"far_side:{s.get('name')}", str(s.get("assertion", "")))
              for s in plan.get("far_side_steps") or []]
    for where, text in texts:
        found = sqltext.schema_wide_recompile_in(text)
        if found:
            out.append({"message": f"{where} calls {found}", "where": where, "call": found})
    return out


def check_remote_dependents(plan: Plan) -> list[dict[str, Any]]:
    steps = plan.get("far_side_steps") or []
    covered = {(str(s.get("link")), str(s.get("dependent"))) for s in steps
               if s.get("assertion")}
    out = []
    for d in plan.get("dependents") or []:
        if not d.get("remote"):
            continue
        if str(d.get("on", "")).split(":", 1)[0] in ("package_body", "type_body"):
            continue
        link = str(d["object"].get("link"))
        if (link, str(d["key"])) not in covered:
            out.append({
                "message": f"{d['on']} has remote dependent {d['key']} and the plan has no "
                f"far-side step (with an assertion) for it on link {link}",
                "object": d["on"],
                "dependent": d["key"],
                "link": link,
            })
    return out


def check_ungrepped_callers(plan: Plan) -> list[dict[str, Any]]:
    searches = plan.get("caller_search")
    if searches is None:
        return [{"message": "the plan records no caller search", "objects":
                 [o["key"] for o in _objects(plan)]}]
    searched = {str(s.get("object")) for s in searches if s.get("method")}
    return [
        {"message": f"{o['key']}: no caller search recorded", "object": o["key"]}
        for o in _objects(plan)
        if str(o["key"]) not in searched
    ]


PROHIBITIONS: tuple[Prohibition, ...] = (
    Prohibition("stale-extract", StaleExtract.code, StaleExtract, ("plan", "preflight"),
                check_stale_extract, "plan (and preflight, as a merge proposal)"),
    Prohibition("spec-without-body", SpecWithoutBody.code, SpecWithoutBody, ("plan", "packages"),
                check_spec_without_body, "plan"),
    Prohibition("schema-wide-recompile", SchemaWideRecompile.code, SchemaWideRecompile,
                ("plan", "verify"), check_schema_wide_recompile, "plan"),
    Prohibition("spec-with-remote-dependents", RemoteDependentsWithoutFarSideStep.code,
                RemoteDependentsWithoutFarSideStep, ("plan", "remote"), check_remote_dependents,
                "plan"),
    Prohibition("ungrepped-callers", UngreppedCallers.code, UngreppedCallers, ("plan",),
                check_ungrepped_callers, "plan"),
    Prohibition("snapshot-overwrite", SnapshotOverwrite.code, SnapshotOverwrite,
                ("snapshots",), None, "SnapshotStore.put"),
)

BY_NAME = {p.name: p for p in PROHIBITIONS}
BY_CODE = {p.code: p for p in PROHIBITIONS}


def evaluate(plan: Plan) -> list[Finding]:
    """Every finding of every plan-level prohibition, in code order."""
    findings: list[Finding] = []
    for p in PROHIBITIONS:
        if p.check is None:
            continue
        for f in p.check(plan):
            msg = str(f.pop("message"))
            findings.append(Finding(p.name, p.code, msg, f))
    return findings


def summary(plan: Plan) -> list[dict[str, Any]]:
    """The per-prohibition result the plan records: passed, or the findings."""
    found = evaluate(plan)
    out = []
    for p in PROHIBITIONS:
        mine = [f.to_dict() for f in found if f.code == p.code]
        out.append({"name": p.name, "code": p.code, "passed": not mine,
                    "enforced_by": p.enforced_by, "findings": mine})
    return out


def refuse(plan: Plan, extra: Mapping[str, Any] | None = None) -> None:
    """Raise the first prohibition's error if the plan violates any (all findings in details)."""
    found = evaluate(plan)
    if not found:
        return
    first = found[0]
    err = BY_CODE[first.code].error
    more = f" (and {len(found) - 1} more finding(s))" if len(found) > 1 else ""
    raise err(
        f"{first.name}: {first.message}{more}",
        findings=[f.to_dict() for f in found],
        **dict(extra or {}),
    )
