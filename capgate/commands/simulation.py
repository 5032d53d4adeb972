"""Simulation first (issue 16): simulate a change on a lower venue; reconcile a production one.

``simulate``, ``continue_simulation`` and ``abandon_simulation`` are
:mod:`executor.simulation.cycle`'s own functions, re-exported so that every
command of the group is found here; the reconciliation of a production
simulation runs on the executor's runtime.
"""

from __future__ import annotations

from typing import Any

from capgate.executor.call import Executor
from capgate.executor.simulation.cycle import (
    SimulationReport,
    abandon_simulation,
    continue_simulation,
    simulate,
)

__all__ = ["SimulationReport", "abandon_simulation", "continue_simulation", "due",
           "reconcile", "simulate"]


def due(gate: Executor, case: str | None = None) -> list[dict[str, Any]]:
    """Every production simulation (of ``case``) whose reconciliation is due or overdue."""
    from capgate.executor.simulation.production import due as due_reconciliations

    return due_reconciliations(gate.rt, case=case)


def reconcile(gate: Executor, case: str, simulation: str, who: str) -> dict[str, Any]:
    """Run a production simulation's reconciliation query and record its result."""
    from capgate.executor.simulation.production import reconcile as run_reconciliation

    return run_reconciliation(gate.rt, case, simulation, who)
