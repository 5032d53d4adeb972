"""capgate: a connector capability registry and a gated database-write executor.

The public Python API.  ``registry``, ``executor`` and ``ddl`` carry the
logic; this package re-exports what a caller needs.

The names are imported on first use (PEP 562): ``capgate.cli`` lives in this
package, and a command line that imported SQLAlchemy and the executor just to
print ``--help`` would pay for them on every start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capgate.api import build_executor, open
    from capgate.config import Settings, load_settings
    from executor.bindings import call_bound
    from executor.call import Executor
    from executor.connectors import ConnectorConfig, Connectors
    from executor.grants import Grants
    from executor.ledger import Ledger, open_ledger
    from executor.outcome import Outcome
    from executor.plan import Plan
    from executor.returned import Binding
    from executor.simulation.cycle import (
        SimulationReport,
        abandon_simulation,
        continue_simulation,
        simulate,
    )
    from registry.errors import CapgateError, lookup
    from registry.loader import load_registry, validate_paths
    from registry.model import Row
    from registry.registry import Registry

_WHERE = {
    "build_executor": "capgate.api", "open": "capgate.api",
    "Settings": "capgate.config", "load_settings": "capgate.config",
    "Executor": "executor.call",
    "ConnectorConfig": "executor.connectors", "Connectors": "executor.connectors",
    "Grants": "executor.grants",
    "Ledger": "executor.ledger", "open_ledger": "executor.ledger",
    "Outcome": "executor.outcome",
    "Plan": "executor.plan",
    "CapgateError": "registry.errors", "lookup": "registry.errors",
    "load_registry": "registry.loader", "validate_paths": "registry.loader",
    "Row": "registry.model",
    "Registry": "registry.registry",
    # simulation first (issue 16)
    "simulate": "executor.simulation.cycle", "continue_simulation": "executor.simulation.cycle",
    "abandon_simulation": "executor.simulation.cycle",
    "SimulationReport": "executor.simulation.cycle",
    "call_bound": "executor.bindings", "Binding": "executor.returned",
}

__all__ = [
    "Binding",
    "CapgateError",
    "ConnectorConfig",
    "Connectors",
    "Executor",
    "Grants",
    "Ledger",
    "Outcome",
    "Plan",
    "Registry",
    "Row",
    "Settings",
    "SimulationReport",
    "abandon_simulation",
    "build_executor",
    "call_bound",
    "continue_simulation",
    "load_registry",
    "load_settings",
    "lookup",
    "open",
    "open_ledger",
    "simulate",
    "validate_paths",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'capgate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
