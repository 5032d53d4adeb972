"""Stored code is simulated before it is promoted, as data writes are (seed 001 §5).

A data write on a promotion venue needs the case's simulation evidence from a lower
venue (:mod:`executor.promotion`).  The same rule for a ``ddl`` row: before staging
or prod accepts a new source, **the same source** -- the same hash over each object's
normalised new source -- must have passed, in the same case, on a lower venue (rig <
dev < qa < staging < prod):

* **apply + verify**: the change applied and every check held (the intent was
  observed ``applied_verified``), and
* **compensate**: capgate re-applied the snapshots and the re-read showed them again
  (the intent then observed ``compensated``),

which is what ``capgate ddl simulate PLAN_HASH`` does on the lower venue and records as
evidence in the case state (``ddl_simulated:INTENT``), cross-checked against the
intent's own events when it is used.  A change that passes the five-point exemption
test (as applied to stored code below) may skip it; the test is recorded in the plan,
and in the case as ``exemption_claimed`` when the apply runs, as for writes.

Every DDL plan names its stage (``stage``: the environment, whether it is a
promotion, and the evidence or the exemption it rests on), covered by its hash; on a
promotion venue a plan without either is refused (``PromotionRefused``, CG601) and
the refusal recorded.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capgate.ddl.catalog import BaseAdapter, ObjectRef
from capgate.executor.call import Executor
from capgate.executor.connectors import ENVIRONMENTS, ConnectorConfig, venue_rank
from capgate.executor.simulation.exemption import (
    COMPUTED,
    DECLARED,
    ExemptionPoint,
    ExemptionTest,
)
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import UnknownIntent
from capgate.registry.model import Row

__all__ = ["EVIDENCE_PREFIX", "Decision", "decide", "evidence_entries", "exemption_test",
           "proven", "source_identity"]

EVIDENCE_PREFIX = "ddl_simulated:"
"""Case-state key prefix of a DDL simulation's evidence (one entry per simulated intent)."""


def source_identity(adapter: BaseAdapter, changes: Sequence[tuple[ObjectRef, str]]
                    ) -> tuple[str, list[dict[str, Any]]]:
    """The hash that says "the same source", and its parts.

    Per object: its kind, name and argument types (not its schema, which may differ
    between venues) and the SHA-256 of its normalised new source; the identity is
    the canonical hash of that list, sorted.
    """
    parts = sorted(({"kind": ref.kind, "name": ref.name.casefold(), "args": ref.args,
                     "source_hash": canonical_hash(adapter.normalise(ref, source))}
                    for ref, source in changes),
                   key=lambda p: (str(p["kind"]), str(p["name"]), str(p["args"])))
    return canonical_hash(parts), parts


def evidence_entries(case_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The DDL simulation evidence a case holds, oldest first."""
    found = [dict(v) for k, v in case_state.items()
             if k.startswith(EVIDENCE_PREFIX) and isinstance(v, Mapping)]
    return sorted(found, key=lambda e: str(e.get("completed_at")))


def proven(executor: Executor, case: str, entry: Mapping[str, Any]) -> bool:
    """The evidence's intent says so itself: observed ``applied_verified`` for the plan,
    then ``compensated`` (its own hash-chained events)."""
    intent_id = str(entry.get("intent_id"))
    try:
        state = executor.ledger.intent(case, intent_id)
    except UnknownIntent:
        return False
    record = state.get("outcome_record")
    if not isinstance(record, Mapping) or record.get("status") != "compensated" \
            or state.get("plan_hash") != entry.get("plan_hash") \
            or record.get("row_hash") != entry.get("row_hash"):
        return False
    observed = [e.payload.get("outcome") for e in executor.ledger.events(case, intent_id)
                if e.kind == "observed"]
    return any(isinstance(o, Mapping) and o.get("status") == "applied_verified"
               for o in observed)


@dataclass(frozen=True)
class Decision:
    """Whether a DDL plan on this venue may go ahead, and on what grounds."""

    environment: str
    promotes: bool
    evidence: Mapping[str, Any] | None = None
    missing: str | None = None
    """``no_evidence``, ``other_row_version``, ``other_source``, ``not_lower``, ``stale`` or
    ``unproven``."""
    exemption: ExemptionTest | None = None
    seen: tuple[Mapping[str, Any], ...] = field(default=())

    @property
    def allowed(self) -> bool:
        return not self.promotes or self.evidence is not None or bool(
            self.exemption and self.exemption.holds)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"environment": self.environment, "promotes": self.promotes}
        if not self.promotes:
            out["rule"] = (f"{self.environment} is no promotion venue: the change needs no "
                           "simulation evidence here (it may itself be the simulation: "
                           "capgate ddl simulate)")
            return out
        if self.evidence is not None:
            out["evidence"] = dict(self.evidence)
        if self.missing is not None:
            out["missing"] = self.missing
        if self.exemption is not None:
            out["exemption"] = self.exemption.to_dict()
        return out


def _age(executor: Executor, entry: Mapping[str, Any]) -> float | None:
    try:
        at = dt.datetime.fromisoformat(str(entry.get("completed_at")))
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return (executor.clock() - at).total_seconds()


def decide(executor: Executor, row: Row, cfg: ConnectorConfig, case: str, source_id: str,
           exemption: ExemptionTest | None) -> Decision:
    """The decision for a plan of ``source_id`` on ``cfg`` in ``case`` (reads the ledger)."""
    if not cfg.promotes:
        return Decision(cfg.environment, False)
    snapshot = executor.ledger.verified_snapshot(case)
    entries = evidence_entries((snapshot or {}).get("case") or {})
    target = venue_rank(cfg.environment)
    missing = "no_evidence"
    same_op = [e for e in entries if e.get("operation_id") == row.operation_id]
    if same_op:
        missing = "other_row_version"
    same_row = [e for e in same_op if e.get("row_hash") == row.row_hash]
    if same_row:
        missing = "other_source"
    same_source = [e for e in same_row if e.get("source_id") == source_id]
    if same_source:
        missing = "not_lower"
    lower = [e for e in same_source if str(e.get("environment")) in ENVIRONMENTS
             and venue_rank(str(e.get("environment"))) < target]
    if lower:
        missing = "stale"
    fresh = [e for e in lower if (age := _age(executor, e)) is not None
             and 0 <= age <= cfg.simulation_max_age_seconds]
    if fresh:
        missing = "unproven"
    for entry in reversed(fresh):
        if proven(executor, case, entry):
            return Decision(cfg.environment, True, evidence=entry, seen=tuple(entries))
    return Decision(cfg.environment, True, missing=missing, exemption=exemption,
                    seen=tuple(entries))


def exemption_test(row: Row, environment: str, refs: Sequence[ObjectRef],
                   dependents: Sequence[str], callers: Sequence[str],
                   history: Mapping[str, Mapping[str, Any]]) -> ExemptionTest:
    """The five points (seed 001 §5) as they apply to a change of stored code.

    1. one logical object -- computed: the plan changes one object (a package spec
       and its body are one);
    2. one environment -- computed: the case changed this row's objects in no other
       environment;
    3. reversible by an already-written teardown -- computed: the snapshot captured
       before the apply is the teardown (compensation re-applies it; an object the
       plan creates is dropped), written before anything runs;
    4. no downstream consumer -- computed and declared: no dependent and no caller in
       the database, and the row declares that nothing outside it (an application, a
       report) calls it (``simulation.exemption.no_downstream_consumer``);
    5. no customer-visible effect -- declared on the row.
    """
    names = {(r.kind.removesuffix("_body"), r.name.casefold()) for r in refs}
    one = ExemptionPoint(1, "single_object", len(names) == 1, COMPUTED,
                         f"one object ({', '.join(sorted(r.key for r in refs))})"
                         if len(names) == 1 else
                         f"{len(names)} objects: {', '.join(sorted(r.key for r in refs))}")
    elsewhere = sorted({str(s.get("environment")) for s in history.values()
                        if s.get("operation_id") == row.operation_id
                        and s.get("environment") not in (None, environment)})
    two = ExemptionPoint(2, "single_environment", not elsewhere, COMPUTED,
                         f"the case also changed {row.operation_id} in {', '.join(elsewhere)}"
                         if elsewhere else
                         f"the case changes {row.operation_id} in {environment} only")
    three = ExemptionPoint(3, "written_teardown", True, COMPUTED,
                           "the snapshot captured before the apply is the teardown: "
                           "compensation re-applies it (or drops an object the plan creates)")
    declared = row.simulation.no_downstream_consumer if row.simulation else None
    if dependents or callers:
        found = sorted(set(dependents) | set(callers))
        four = ExemptionPoint(4, "no_downstream_consumer", False, f"{COMPUTED}+{DECLARED}",
                              f"{len(found)} object(s) in the database use it: "
                              f"{', '.join(found[:5])}{' ...' if len(found) > 5 else ''}")
    elif declared is None:
        four = ExemptionPoint(4, "no_downstream_consumer", False, f"{COMPUTED}+{DECLARED}",
                              "no dependent or caller in the database, but the row does not "
                              "declare that nothing outside it calls the code "
                              "(simulation.exemption.no_downstream_consumer)")
    else:
        four = ExemptionPoint(4, "no_downstream_consumer", declared.holds,
                              f"{COMPUTED}+{DECLARED}",
                              f"no dependent or caller in the database; {declared.because}")
    visible = row.simulation.no_customer_visible_effect if row.simulation else None
    five = ExemptionPoint(5, "no_customer_visible_effect",
                          visible is not None and visible.holds, DECLARED,
                          visible.because if visible is not None else
                          "not declared on the row (simulation.exemption."
                          "no_customer_visible_effect)")
    return ExemptionTest((one, two, three, four, five))
