"""Registered step functions: reviewed, named, deterministic code for leases.

A leased row may name a ``function`` step; only functions registered here
(by name, at import time, by reviewed code) can run.  An unregistered name is
refused -- there is no way to pass an arbitrary callable into a lease.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from capgate.registry.errors import UnregisteredStep

if TYPE_CHECKING:
    from capgate.executor.context import CallContext

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


def require(name: str) -> StepFunction:
    """The function registered under ``name``; UnregisteredStep if there is none."""
    fn = _REGISTRY.get(name)
    if fn is None:
        raise UnregisteredStep(f"step function {name!r} is not registered; only reviewed, "
                               "registered functions may run inside a lease", function=name)
    return fn


def registered_name(step: str | Callable[..., Any]) -> str:
    """The registered name of ``step`` (a name, or the very function object registered).

    Anything else -- an unregistered name, a lambda, a function that merely has
    the same ``__name__`` as a registered one -- is refused with UnregisteredStep.
    """
    if isinstance(step, str):
        require(step)
        return step
    for name, fn in _REGISTRY.items():
        if fn is step:
            return name
    label = getattr(step, "__qualname__", None) or type(step).__name__
    raise UnregisteredStep(f"{label} is not a registered step function; register reviewed, "
                           "deterministic code with @register_step(name) -- an arbitrary "
                           "callable never runs inside a lease", function=str(label))


def run_registered(name: str, conn: sa.Connection, ctx: CallContext) -> dict[str, Any]:
    result = require(name)(conn, ctx)
    return {"step": name, "function": name, "result": result}
