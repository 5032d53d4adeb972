"""A DDL plan: what a person approves by its hash, and what the apply then does.

``DdlLoop.plan`` makes one; the ledger records it (as canonical JSON, under
its hash) and ``capgate ddl plan --json`` prints it.  Its serialised shape is
:meth:`DdlPlan.to_dict` -- the same JSON the loop wrote when a plan was a
plain dict, key for key, so a recorded plan keeps its hash.  A plan read back
(from the ledger, from a file) comes in through :meth:`DdlPlan.from_dict`,
which names the field that is wrong (``PlanTampered``, CG514) instead of
failing later with a ``KeyError`` in the middle of an apply.

What the fields hold below the top level (each object's entry, a dependent,
a caller search) stays plain JSON data, as the catalogs and the approver's
text read it: treat it as read-only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import PlanTampered

PLAN_FORMAT = "capgate.ddl.plan/1"

#: Fields each entry of ``objects`` must have: what the apply reads of it.
_OBJECT_KEYS = ("key", "object", "base_snapshot_id", "base_signature", "new_source",
                "new_signature")

Json = Mapping[str, Any]


@dataclass(frozen=True)
class DdlPlan:
    """One DDL plan, checked in shape; its content hashed as ``plan_hash``."""

    dialect: str
    """The target's dialect (``postgresql``, ``mysql``, ``oracle``, ``sqlite``): a plan made
    for one is refused by a loop on another."""
    target: str
    """The target database as plans and lock keys name it (no password): a plan applies
    there only."""
    recipe: str
    """The version of the signature recipe the plan's signatures were computed with."""
    transactional_ddl: bool
    """Whether the dialect runs DDL in a transaction (PostgreSQL, SQLite): a failed verify
    then rolls back; elsewhere DDL commits and a failure is compensated."""
    objects: tuple[Json, ...]
    """Each changed object, in apply order (a body right after its spec): its base snapshot
    and signature, the live signature at plan time, the new source and its signature, the
    signature expected after the apply, the diff the approver reads, its status before."""
    dependents: tuple[Json, ...]
    """The objects that depend on the changed ones (local and far side), each with its
    status before: what the dependent sweep checks after the apply."""
    caller_search: tuple[Json, ...] | None
    """For each changed object, the callers found in stored code (and how they were
    searched); None when the search was skipped -- such a plan is refused as ungrepped."""
    far_side_steps: tuple[Json, ...]
    """Checks run on another database through a link after the apply (recompile a remote
    dependent, run an assertion)."""
    smoke: tuple[Json, ...]
    """Read-only calls run after the apply, each with what it must return."""
    recompile: tuple[str, ...]
    """The recompile requests as given (``--recompile``); a schema-wide one is refused."""
    recompile_objects: tuple[Json, ...] | None
    """The objects those requests resolved to, recompiled and checked after the apply.
    None: a plan recorded before capgate wrote this field (absent from its JSON)."""
    accepted_warnings: tuple[Json, ...] | None
    """The row's declared checker false positives: a verify finding one reports a warning,
    not a failure.  None: a plan recorded before capgate wrote this field."""
    warnings: tuple[str, ...]
    """What the approver should read before approving (callers found, package state
    discarded, checker findings, dependents the new source breaks)."""
    approval: Json
    """That a person must approve this plan hash, and why."""
    prohibitions: tuple[Json, ...]
    """Each standing prohibition (``ddl.prohibitions``) and whether the plan passed it."""
    plan_hash: str
    """The canonical hash of every other field: what an approval names."""
    catalog_version: str | None = None
    """A digest of the catalog rows in the sweep's scope when the plan was made (PostgreSQL:
    every function, relation, rule and trigger row, with its ``xmin``).  An
    apply that finds the same digest uses the plan's dependents and their statuses before,
    instead of finding and checking them again; any other value (or None) means a new
    sweep."""
    unverified: tuple[Json, ...] | None = None
    """The objects no check can prove work after the change (``{"object", "role", "why"}``):
    approving the plan's hash accepts exactly these as unverified; any other object found
    unverified at apply fails the verify.  None: a plan recorded before capgate wrote this
    field -- then nothing is accepted unverified."""
    bound: Json = field(default_factory=dict)
    """The caller's fields, bound into the plan and covered by its hash (``bind=``): the
    service binds the case, requester, row (operation, version, row hash, effect class,
    authorization), connector and environment, so an approval of the hash is an approval
    of that row on that target."""
    format: str = PLAN_FORMAT
    """The plan format; another is refused."""

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON data, keys in the order the loop has always written them."""
        out: dict[str, Any] = {
            "format": self.format,
            "dialect": self.dialect,
            "target": self.target,
            "recipe": self.recipe,
            "transactional_ddl": self.transactional_ddl,
            "objects": list(self.objects),
            "dependents": list(self.dependents),
            "caller_search": None if self.caller_search is None else list(self.caller_search),
            "far_side_steps": list(self.far_side_steps),
            "smoke": list(self.smoke),
            "recompile": list(self.recompile),
        }
        if self.recompile_objects is not None:
            out["recompile_objects"] = list(self.recompile_objects)
        if self.accepted_warnings is not None:
            out["accepted_warnings"] = list(self.accepted_warnings)
        if self.unverified is not None:
            out["unverified"] = list(self.unverified)
        if self.catalog_version is not None:
            out["catalog_version"] = self.catalog_version
        out["warnings"] = list(self.warnings)
        out["approval"] = self.approval
        out.update(self.bound)
        out["prohibitions"] = list(self.prohibitions)
        out["plan_hash"] = self.plan_hash
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DdlPlan:
        """A plan from its JSON data; PlanTampered (CG514) naming the first field that is
        missing or of the wrong kind.  The hash is not checked here (``check_plan``)."""
        if not isinstance(data, Mapping):
            raise PlanTampered(f"a DDL plan is a JSON object, got {type(data).__name__}",
                               field="plan")
        if data.get("format") != PLAN_FORMAT:
            raise PlanTampered(f"not a DDL plan of format {PLAN_FORMAT}",
                               found=data.get("format"), field="format")
        objects = _tables(data, "objects")
        for i, o in enumerate(objects):
            for key in _OBJECT_KEYS:
                if key not in o:
                    raise PlanTampered(f"the plan's objects[{i}] has no {key}",
                                       field=f"objects[{i}].{key}")
        return cls(
            dialect=_text(data, "dialect"),
            target=_text(data, "target"),
            recipe=_text(data, "recipe"),
            transactional_ddl=_flag(data, "transactional_ddl"),
            objects=objects,
            dependents=_tables(data, "dependents"),
            caller_search=None if data.get("caller_search", ...) is None
            else _tables(data, "caller_search"),
            far_side_steps=_tables(data, "far_side_steps"),
            smoke=_tables(data, "smoke"),
            recompile=_texts(data, "recompile"),
            recompile_objects=_tables(data, "recompile_objects")
            if "recompile_objects" in data else None,
            accepted_warnings=_tables(data, "accepted_warnings")
            if "accepted_warnings" in data else None,
            warnings=_texts(data, "warnings"),
            unverified=_tables(data, "unverified") if "unverified" in data else None,
            catalog_version=_text(data, "catalog_version") if data.get("catalog_version")
            is not None else None,
            approval=_table(data, "approval"),
            prohibitions=_tables(data, "prohibitions"),
            plan_hash=_text(data, "plan_hash"),
            bound={k: v for k, v in data.items() if k not in PLAN_FIELDS},
        )

    @classmethod
    def of(cls, plan: DdlPlan | Mapping[str, Any]) -> DdlPlan:
        """``plan`` checked intact (format, hash) and as a DdlPlan: what every step that
        takes a plan from outside -- a file, the ledger, a caller's dict -- starts with."""
        if isinstance(plan, DdlPlan) and getattr(plan, "_intact", None) == plan.plan_hash:
            return plan  # checked already in this process (a frozen object cannot change)
        check_plan(plan)
        out = plan if isinstance(plan, DdlPlan) else cls.from_dict(plan)
        object.__setattr__(out, "_intact", out.plan_hash)
        return out


#: The serialised names of the plan's own fields (``bound`` holds every other key).
PLAN_FIELDS = frozenset({
    "format", "dialect", "target", "recipe", "transactional_ddl", "objects", "dependents",
    "caller_search", "far_side_steps", "smoke", "recompile", "recompile_objects", "warnings",
    "approval", "prohibitions", "plan_hash", "accepted_warnings", "unverified",
    "catalog_version",
})


def _missing(name: str) -> PlanTampered:
    return PlanTampered(f"the plan has no {name}; make a new plan", field=name)


def _wrong(name: str, expected: str, value: Any) -> PlanTampered:
    return PlanTampered(f"the plan's {name} must be {expected}, got {type(value).__name__}",
                        field=name)


def _get(data: Mapping[str, Any], name: str) -> Any:
    if name not in data:
        raise _missing(name)
    return data[name]


def _text(data: Mapping[str, Any], name: str) -> str:
    value = _get(data, name)
    if not isinstance(value, str):
        raise _wrong(name, "a string", value)
    return value


def _flag(data: Mapping[str, Any], name: str) -> bool:
    value = _get(data, name)
    if not isinstance(value, bool):
        raise _wrong(name, "true or false", value)
    return value


def _table(data: Mapping[str, Any], name: str) -> Json:
    value = _get(data, name)
    if not isinstance(value, Mapping):
        raise _wrong(name, "an object", value)
    return value


def _list(data: Mapping[str, Any], name: str) -> Sequence[Any]:
    value = _get(data, name)
    if not isinstance(value, list | tuple):
        raise _wrong(name, "a list", value)
    return value


def _tables(data: Mapping[str, Any], name: str) -> tuple[Json, ...]:
    items = _list(data, name)
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise _wrong(f"{name}[{i}]", "an object", item)
    return tuple(items)


def _texts(data: Mapping[str, Any], name: str) -> tuple[str, ...]:
    items = _list(data, name)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise _wrong(f"{name}[{i}]", "a string", item)
    return tuple(items)


def _content(plan: DdlPlan | Mapping[str, Any]) -> Mapping[str, Any]:
    return plan.to_dict() if isinstance(plan, DdlPlan) else plan


def plan_hash(plan: DdlPlan | Mapping[str, Any]) -> str:
    """The canonical hash of a plan (everything but the ``plan_hash`` field)."""
    return canonical_hash({k: v for k, v in _content(plan).items() if k != "plan_hash"})


def check_plan(plan: DdlPlan | Mapping[str, Any]) -> None:
    """Refuse a plan whose content no longer matches its hash, or of an unknown format."""
    content = _content(plan)
    if content.get("format") != PLAN_FORMAT:
        raise PlanTampered(f"not a DDL plan of format {PLAN_FORMAT}",
                           found=content.get("format"))
    if content.get("plan_hash") != plan_hash(content):
        raise PlanTampered(
            "the plan's content does not match its plan_hash; make a new plan",
            recorded=content.get("plan_hash"),
            computed=plan_hash(content),
        )
