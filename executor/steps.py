"""Registered step functions: reviewed, named, deterministic code for leases.

A leased row may name a ``function`` step; only functions registered here
(by name, at import time, by reviewed code) can run.  An unregistered name is
refused -- there is no way to pass an arbitrary callable into a lease.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from registry.errors import UnregisteredStep

if TYPE_CHECKING:
    from executor.call import CallContext

StepFunction = Callable[[sa.Connection, "CallContext"], dict[str, Any]]
_REGISTRY: dict[str, StepFunction] = {}


def register_step(name: str) -> Callable[[StepFunction], StepFunction]:
    """Decorator: register a deterministic step function under ``name``."""

    def deco(fn: StepFunction) -> StepFunction:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"step function {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_steps() -> list[str]:
    return sorted(_REGISTRY)


def run_registered(name: str, conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
    fn = _REGISTRY.get(name)
    if fn is None:
        raise UnregisteredStep(f"step function {name!r} is not registered; only reviewed, "
                               "registered functions may run inside a lease", function=name)
    result = fn(conn, ctx)
    return {"step": name, "function": name, "result": result}
