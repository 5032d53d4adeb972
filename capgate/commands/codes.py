"""The error codes: what each ``CGnnn`` means (``capgate explain``).

Every refusal is a ``CapgateError`` with a stable code whose class docstring
is its explanation.  Some classes live outside ``registry.errors`` and register
their codes only when their module is imported, which a command line that
imports lazily may not have done: :data:`ERROR_MODULES` are imported first.
"""

from __future__ import annotations

import importlib

from registry import errors
from registry.errors import CapgateError

#: Modules that define error classes outside ``registry.errors``.
ERROR_MODULES = ("ddl.errors", "executor.dialects.base", "registry.simulation_errors")


def _register_all() -> None:
    for module in ERROR_MODULES:
        importlib.import_module(module)


def all_codes() -> list[type[CapgateError]]:
    """Every error class, in code order."""
    _register_all()
    return errors.all_codes()


def explain(code: str) -> type[CapgateError]:
    """The class of ``code``; ``UnknownErrorCode`` (CG901) for a code no class has."""
    _register_all()
    return errors.lookup(code)


def explanation(code: str) -> str:
    """``code``'s explanation as a person reads it: name, exit code, the docstring."""
    _register_all()
    return errors.explain(code)
