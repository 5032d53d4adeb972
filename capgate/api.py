"""The Python API: open an executor from configuration, then plan, approve, call.

    import capgate
    with capgate.open() as gate:
        outcome = gate.call("policy.add_note", {"policy_id": 1, "note": "called"},
                            case="TICKET-1", who="claims-agent")
        print(outcome.status, outcome.evidence)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from capgate.config import Settings, load_settings
from capgate.executor.call import Executor
from capgate.executor.connectors import Connectors
from capgate.executor.grants import Grants
from capgate.executor.ledger import Ledger, open_ledger
from capgate.registry.loader import load_registry
from capgate.registry.registry import Registry


def build_executor(settings: Settings, *, registry: Registry | None = None,
                   ledger: Ledger | None = None, grants: Grants | None = None) -> Executor:
    """An executor wired from settings (each part may be supplied instead).

    The capability files are loaded through the validation cache
    (``registry.fastload.cache``): files that passed validation before are not parsed
    again, and rows are built when first used.
    """
    return Executor(
        max_request_bytes=settings.max_request_bytes,
        registry=registry if registry is not None else load_registry(settings.capabilities,
                                                                     cache=True),
        connectors=Connectors(dict(settings.connectors)),
        ledger=ledger if ledger is not None else open_ledger(settings.ledger_url),
        grants=grants if grants is not None else (
            Grants.load(settings.grants) if settings.grants else Grants()),
    )


@contextmanager
def open(config: str | Path | None = None, *, capabilities: Sequence[str] | None = None,
         env: Mapping[str, str] | None = None, **parts: Any) -> Iterator[Executor]:
    """Open an executor from ``capgate.toml`` (or ``config``); closes it afterwards."""
    settings = load_settings(config, env)
    if capabilities is not None:
        settings = Settings(**{**settings.__dict__, "capabilities": tuple(capabilities)})
    with build_executor(settings, **parts) as executor:
        yield executor
