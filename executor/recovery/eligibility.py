"""Where a recovered case may continue from: the latest *eligible* step, as its own fact.

A saved state is not permission to continue from it (seed 003: recovery
decisions need their own evaluation).  After resume settled a case, the
candidates are its write steps in case order; a step is *eligible* when its
effect is present and verified:

* applied and verified before COMMIT -- its ``observed`` outcome, or resume's
  ``reconciled`` from the landing marker or the commit outcome (the
  transaction commits only after its verify checks passed);
* and not since found changed (the poisoned-resume recheck failed), not
  compensated, not merely present by a landed probe or a person's word
  without a passing re-check.

The *recovery point* is the latest eligible step -- not the latest recorded
one, which may be unsettled, rolled back or no longer true.  A leased row's
steps share one transaction, so they are eligible together (all landed with
the marker) or not at all; a multi-object DDL plan's objects are judged one
by one from their live signatures and verify checks (:func:`ddl_objects`).

Resume records the result as a ``recovery_point`` event (the candidates, why
each is or is not eligible, the chosen and the latest recorded), then a
``continuation`` event that grants or withholds continuation and says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capgate.executor import outcome as oc
from capgate.executor.context import TERMINAL
from capgate.registry.model import Row, Shape

__all__ = ["Candidate", "RecoveryPoint", "assess", "ddl_objects", "eligible_now"]

_PROVEN = {"marker": "its landing marker proves it landed, and the transaction committed "
                     "only after its verify checks passed",
           "commit": "the commit outcome proves it committed, and it committed only after "
                     "its verify checks passed"}


@dataclass(frozen=True)
class Candidate:
    """One step a recovered case could continue after."""

    step: str
    """An intent id (a case's step), or an object key (a DDL plan's)."""
    order: int
    eligible: bool
    why: str
    operation_id: str | None = None
    status: str | None = None
    outcome: str | None = None
    steps: tuple[Mapping[str, Any], ...] = field(default=())
    """A leased row's declared steps, each with its eligibility."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "order": self.order,
                               "eligible": self.eligible, "why": self.why}
        if self.operation_id is not None:
            out.update(operation_id=self.operation_id, status=self.status,
                       outcome=self.outcome)
        if self.steps:
            out["steps"] = [dict(s) for s in self.steps]
        return out


@dataclass(frozen=True)
class RecoveryPoint:
    """The candidates, the chosen (latest eligible) and the latest recorded one."""

    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate | None:
        eligible = [c for c in self.candidates if c.eligible]
        return eligible[-1] if eligible else None

    @property
    def latest_recorded(self) -> Candidate | None:
        return self.candidates[-1] if self.candidates else None

    @property
    def eligible(self) -> int:
        """How many steps are eligible (applied and verified) now."""
        return sum(1 for c in self.candidates if c.eligible)

    def retained(self, redone: set[str]) -> int:
        """Validated steps this recovery kept: eligible, and not re-run by it (``redone``)."""
        return sum(1 for c in self.candidates if c.eligible and c.step not in redone)

    def to_dict(self) -> dict[str, Any]:
        chosen, latest = self.chosen, self.latest_recorded
        return {"chosen": chosen.to_dict() if chosen else None,
                "latest_recorded": latest.to_dict() if latest else None,
                "chosen_is_latest": (chosen is not None and latest is not None
                                     and chosen.step == latest.step),
                "eligible": self.eligible, "candidates": [c.to_dict() for c in self.candidates]}


def _why(state: Mapping[str, Any], rechecked: bool | None) -> tuple[bool, str]:
    status = str(state.get("status"))
    record = state.get("outcome_record")
    outcome = record.get("status") if isinstance(record, Mapping) else state.get("outcome")
    if status not in TERMINAL:
        return False, f"unsettled ({status}): nothing about it may be relied on"
    if outcome == oc.COMPENSATED:
        return False, "compensated: its effect was undone"
    if outcome != oc.APPLIED:
        return False, f"its effect is not present ({outcome})"
    if rechecked is False:
        return False, "its verify checks no longer hold: the target changed outside the case"
    if status == "observed":
        return True, "applied and verified before COMMIT"
    evidence = (record.get("evidence") or {}).get("reconciled") or {} \
        if isinstance(record, Mapping) else {}
    if evidence.get("marker") == "present":
        return True, _PROVEN["marker"]
    if evidence.get("commit_outcome") == "committed":
        return True, _PROVEN["commit"]
    if rechecked:
        return True, "present, and its verify checks hold when re-run now"
    if evidence.get("resolved_by"):
        return False, f"a person's word ({evidence['resolved_by']}), not verified"
    return False, "present by its landed probe only: not verified"


def eligible_now(state: Mapping[str, Any]) -> bool:
    """Whether a settled intent's state makes it an eligible step (no recheck known)."""
    return _why(state, None)[0]


def assess(intents: Iterable[tuple[str, Mapping[str, Any], int]],
           row_of: Callable[[str, int], Row | None],
           rechecked: Mapping[str, bool] | None = None) -> RecoveryPoint:
    """The recovery point of a case from its intents (id, full state, order).

    Reads, compensation intents and holds are not steps.  ``rechecked`` is
    the poisoned-resume recheck per intent (True: its checks hold now).
    """
    out: list[Candidate] = []
    for intent_id, state, order in sorted(intents, key=lambda x: x[2]):
        if state.get("effect_class") in (None, "read") or state.get("compensates") \
                or state.get("hold"):
            continue
        eligible, why = _why(state, (rechecked or {}).get(intent_id))
        record = state.get("outcome_record")
        steps: tuple[Mapping[str, Any], ...] = ()
        row = row_of(str(state.get("operation_id")), int(state.get("version") or 0))
        if row is not None and row.shape is Shape.LEASED:
            how = ("landed with the lease's one transaction" if eligible else
                   "the lease's one transaction: not landed, or not verified")
            steps = tuple({"step": s.name, "eligible": eligible, "why": how} for s in row.steps)
        out.append(Candidate(intent_id, order, eligible, why, str(state.get("operation_id")),
                             str(state.get("status")),
                             record.get("status") if isinstance(record, Mapping) else None,
                             steps))
    return RecoveryPoint(tuple(out))


def ddl_objects(objects: Sequence[Mapping[str, Any]], verified: Mapping[str, bool],
                recorded: Iterable[str]) -> dict[str, Any]:
    """A DDL plan's recovery point: the latest object (plan order) applied *and* verified.

    ``objects`` are the classification's rows (``object``, ``state``, ``evidence``);
    ``verified`` says per object whether its verify checks passed; ``recorded`` names
    the objects the ledger recorded as applied.
    """
    cands: list[Candidate] = []
    for i, o in enumerate(objects):
        key = str(o.get("object"))
        state = str(o.get("state"))
        if state == "applied" and verified.get(key):
            cands.append(Candidate(key, i, True, "its live signature is the planned one and "
                                                 "it verifies (compiled, dependents valid)"))
        elif state == "applied":
            cands.append(Candidate(key, i, False, "applied, but its verify checks fail"))
        elif state == "unchanged":
            cands.append(Candidate(key, i, bool(verified.get(key, True)),
                                   "the plan leaves it as it was"))
        else:
            cands.append(Candidate(key, i, False, f"{state}: {o.get('evidence', '')}"))
    point = RecoveryPoint(tuple(cands))
    written = [c for c in cands if c.step in set(recorded)]
    out = point.to_dict()
    out["latest_recorded"] = written[-1].to_dict() if written else None
    out["chosen_is_latest"] = bool(written and point.chosen
                                   and written[-1].step == point.chosen.step)
    return out
