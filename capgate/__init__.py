"""capgate: a connector capability registry and a gated database-write executor.

The public Python API.  ``registry``, ``executor`` and ``ddl`` carry the
logic; this package re-exports what a caller needs.
"""

from capgate.api import build_executor, open
from capgate.config import Settings, load_settings
from executor.call import Executor
from executor.connectors import ConnectorConfig, Connectors
from executor.grants import Grants
from executor.ledger import Ledger, open_ledger
from executor.outcome import Outcome
from executor.plan import Plan
from registry.errors import CapgateError, lookup
from registry.loader import load_registry, validate_paths
from registry.model import Row
from registry.registry import Registry

__all__ = [
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
    "build_executor",
    "load_registry",
    "load_settings",
    "lookup",
    "open",
    "open_ledger",
    "validate_paths",
]
