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
from capgate.executor.sources import LiveSources
from capgate.registry.registry import Registry


def build_executor(settings: Settings, *, registry: Registry | None = None,
                   ledger: Ledger | None = None, grants: Grants | None = None) -> Executor:
    """An executor wired from settings (each part may be supplied instead).

    The capability files are loaded through the validation cache
    (``registry.fastload.cache``): files that passed validation before are not parsed
    again, and rows are built when first used.

    The parts read from files -- the capability files with their lock, and the
    grants file -- are re-read whenever they change, checked with a stat before
    every call (:mod:`executor.sources`): a long-lived executor (the MCP server,
    a Python caller's) runs what the files say now.  A part supplied here is
    used as it is and never reloaded.
    """
    sources = LiveSources(None if registry is not None else list(settings.capabilities),
                          settings.grants if grants is None else None, cache=True)
    if registry is None:
        registry = sources.load_registry()
    if grants is None:
        grants = sources.load_grants() if settings.grants else Grants()
    return Executor(
        max_request_bytes=settings.max_request_bytes,
        registry=registry,
        connectors=Connectors(dict(settings.connectors)),
        ledger=ledger if ledger is not None else open_ledger(settings.ledger_url),
        grants=grants,
        unlocked_environments=settings.unlocked_environments,
        approval_ttl_max_seconds=settings.approval_ttl_max_seconds,
        sources=sources,
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
