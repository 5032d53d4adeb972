"""capgate: a connector capability registry and a gated database-write executor.

The public Python API.  ``registry``, ``executor`` and ``ddl`` carry the
logic; this package re-exports what a caller needs: :func:`open` for an
executor (``plan``, ``approve``, ``call``), and the command functions of
:mod:`capgate.commands` that the command line and the MCP server call too
(``validate``, ``init_project``, ``rehearse``, ``resume``, ``simulate``, ...).

The names are imported on first use (PEP 562): ``capgate.cli`` lives in this
package, and a command line that imported SQLAlchemy and the executor just to
print ``--help`` would pay for them on every start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capgate.api import build_executor, open
    from capgate.commands.agents import rehearse
    from capgate.commands.capabilities import validate
    from capgate.commands.project import init_project
    from capgate.commands.resume import resume
    from capgate.commands.simulation import (
        SimulationReport,
        abandon_simulation,
        continue_simulation,
        simulate,
    )
    from capgate.config import Settings, load_settings
    from capgate.executor.bindings import call_bound
    from capgate.executor.call import Executor
    from capgate.executor.connectors import ConnectorConfig, Connectors
    from capgate.executor.grants import Grants
    from capgate.executor.ledger import Ledger, open_ledger
    from capgate.executor.outcome import Outcome
    from capgate.executor.plan import Plan
    from capgate.executor.returned import Binding
    from capgate.registry.errors import CapgateError, lookup
    from capgate.registry.loader import load_registry, validate_paths
    from capgate.registry.model import Row
    from capgate.registry.registry import Registry

_WHERE = {
    "build_executor": "capgate.api", "open": "capgate.api",
    "Settings": "capgate.config", "load_settings": "capgate.config",
    "Executor": "capgate.executor.call",
    "ConnectorConfig": "capgate.executor.connectors", "Connectors": "capgate.executor.connectors",
    "Grants": "capgate.executor.grants",
    "Ledger": "capgate.executor.ledger", "open_ledger": "capgate.executor.ledger",
    "Outcome": "capgate.executor.outcome",
    "Plan": "capgate.executor.plan",
    "CapgateError": "capgate.registry.errors", "lookup": "capgate.registry.errors",
    "load_registry": "capgate.registry.loader", "validate_paths": "capgate.registry.loader",
    "Row": "capgate.registry.model",
    "Registry": "capgate.registry.registry",
    # the command functions the command line and the MCP server call too
    "validate": "capgate.commands.capabilities", "init_project": "capgate.commands.project",
    "rehearse": "capgate.commands.agents", "resume": "capgate.commands.resume",
    # simulation first (issue 16)
    "simulate": "capgate.commands.simulation",
    "continue_simulation": "capgate.commands.simulation",
    "abandon_simulation": "capgate.commands.simulation",
    "SimulationReport": "capgate.commands.simulation",
    "call_bound": "capgate.executor.bindings", "Binding": "capgate.executor.returned",
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
    "init_project",
    "load_registry",
    "load_settings",
    "lookup",
    "open",
    "open_ledger",
    "rehearse",
    "resume",
    "simulate",
    "validate",
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
