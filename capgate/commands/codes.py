"""The error codes: what each ``CGnnn`` means (``capgate explain``).

Every refusal is a ``CapgateError`` with a stable code whose class docstring
is its explanation.  All of them live in :mod:`registry.errors`, the lowest
layer, so every code is known as soon as that module is imported -- a command
line that imports lazily needs nothing else loaded to explain one.
"""

from __future__ import annotations

from capgate.registry import errors
from capgate.registry.errors import CapgateError


def all_codes() -> list[type[CapgateError]]:
    """Every error class, in code order."""
    return errors.all_codes()


def explain(code: str) -> type[CapgateError]:
    """The class of ``code``; ``UnknownErrorCode`` (CG901) for a code no class has."""
    return errors.lookup(code)


def explanation(code: str) -> str:
    """``code``'s explanation as a person reads it: name, exit code, the docstring."""
    return errors.explain(code)
