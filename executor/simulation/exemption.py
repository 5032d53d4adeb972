"""The five-point exemption test (seed 001 §5), applied and recorded as an auditable claim.

A change may skip simulation only when all five hold:

1. a single logical object, every statement of it with an asserted expected
   count -- *computed*: the row's target names its keys, each bound to one
   value, and every write statement (or SQL step) expects an exact count;
2. a single environment -- *computed*: the case wrote this operation in no
   other environment;
3. reversible by an already-written teardown -- *computed*: the teardown can be
   derived from the write log (returned keys, the written compensation,
   :mod:`executor.simulation.teardown`), nothing would have to be authored;
4. no downstream consumer -- *declared* on the row
   (``simulation.exemption.no_downstream_consumer``), shown to the reviewer;
5. no customer-visible effect -- *declared* on the row, and *computed* from its
   expected effects (a document, a queue message, a call-out... is visible
   unless the row says otherwise).

Failing any one means the change is simulated.  What cannot be computed is
never assumed: a point the row does not declare fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capgate.executor.simulation.teardown import underivable, write_statements
from capgate.registry.model import Row

__all__ = ["ExemptionPoint", "ExemptionTest", "exemption_test"]

COMPUTED = "computed"
DECLARED = "declared"


@dataclass(frozen=True)
class ExemptionPoint:
    number: int
    name: str
    holds: bool
    how: str
    """``computed`` by the executor, ``declared`` on the row, or both (``computed+declared``)."""
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.number, "name": self.name, "holds": self.holds, "how": self.how,
                "why": self.why}


@dataclass(frozen=True)
class ExemptionTest:
    """The test as applied to one request: recorded in the plan, so the claim is auditable."""

    points: tuple[ExemptionPoint, ...]

    @property
    def holds(self) -> bool:
        return all(p.holds for p in self.points)

    @property
    def failed(self) -> list[ExemptionPoint]:
        return [p for p in self.points if not p.holds]

    def to_dict(self) -> dict[str, Any]:
        return {"exempt": self.holds, "points": [p.to_dict() for p in self.points]}


def _single_object(row: Row, inputs: Mapping[str, Any]) -> ExemptionPoint:
    keys = row.target.keys
    unbound = [k for k in keys if inputs.get(k) is None or isinstance(inputs.get(k),
                                                                     dict | list)]
    loose = []
    for st in row.statements:
        if st.expect_rows is None or st.expect_rows.maximum != st.expect_rows.minimum:
            loose.append(st.name or st.sql[:40])
    for step in row.steps:
        if step.sql and (step.expect_rows is None
                         or step.expect_rows.maximum != step.expect_rows.minimum):
            loose.append(step.name)
    if not keys:
        return ExemptionPoint(1, "single_object", False, COMPUTED,
                              "the row's target names no key: the object is not one")
    if unbound:
        return ExemptionPoint(1, "single_object", False, COMPUTED,
                              f"target key(s) {', '.join(unbound)} are not one value each")
    if loose:
        return ExemptionPoint(1, "single_object", False, COMPUTED,
                              f"statement(s) {', '.join(loose)} assert no exact count")
    one = ", ".join(f"{k}={inputs.get(k)!s}" for k in keys)
    return ExemptionPoint(1, "single_object", True, COMPUTED,
                          f"one {row.target.object} ({one}); every statement asserts an "
                          f"exact count ({len(write_statements(row))} statement(s))")


def _single_environment(row: Row, environment: str,
                        history: Mapping[str, Mapping[str, Any]]) -> ExemptionPoint:
    elsewhere = sorted({str(s.get("environment")) for s in history.values()
                        if s.get("operation_id") == row.operation_id
                        and s.get("environment") not in (None, environment)})
    if elsewhere:
        return ExemptionPoint(2, "single_environment", False, COMPUTED,
                              f"the case also wrote {row.operation_id} in "
                              f"{', '.join(elsewhere)}")
    return ExemptionPoint(2, "single_environment", True, COMPUTED,
                          f"the case writes {row.operation_id} in {environment} only")


def _written_teardown(row: Row) -> ExemptionPoint:
    missing = underivable(row)
    if missing:
        return ExemptionPoint(3, "written_teardown", False, COMPUTED,
                              f"no written teardown covers statement(s) {', '.join(missing)} "
                              "(it would have to be authored)")
    parts = []
    if row.compensation:
        parts.append(f"the written compensation ({len(row.compensation)} statement(s))")
    returned = [s.returns.key for s in row.statements if s.returns is not None
                and s.verb == "INSERT"]
    if returned:
        parts.append(f"the returned keys {', '.join(returned)}")
    return ExemptionPoint(3, "written_teardown", True, COMPUTED,
                          "torn down by " + " and ".join(parts))


def _no_downstream(row: Row) -> ExemptionPoint:
    declared = row.simulation.no_downstream_consumer if row.simulation else None
    if declared is None:
        return ExemptionPoint(4, "no_downstream_consumer", False, DECLARED,
                              "not declared on the row (simulation.exemption."
                              "no_downstream_consumer)")
    return ExemptionPoint(4, "no_downstream_consumer", declared.holds, DECLARED,
                          declared.because)


def _no_customer_visible(row: Row) -> ExemptionPoint:
    declared = row.simulation.no_customer_visible_effect if row.simulation else None
    visible = [e.name for e in row.expected_effects if e.visible]
    how = f"{COMPUTED}+{DECLARED}"
    if visible:
        return ExemptionPoint(5, "no_customer_visible_effect", False, how,
                              f"expected effect(s) {', '.join(visible)} are customer-visible")
    if declared is None:
        return ExemptionPoint(5, "no_customer_visible_effect", False, how,
                              "not declared on the row (simulation.exemption."
                              "no_customer_visible_effect)")
    return ExemptionPoint(5, "no_customer_visible_effect", declared.holds, how,
                          declared.because)


def exemption_test(row: Row, inputs: Mapping[str, Any], environment: str,
                   history: Mapping[str, Mapping[str, Any]]) -> ExemptionTest:
    """The five points for this request; ``history`` is the case's intents (id -> state)."""
    return ExemptionTest((_single_object(row, inputs),
                          _single_environment(row, environment, history),
                          _written_teardown(row), _no_downstream(row),
                          _no_customer_visible(row)))
