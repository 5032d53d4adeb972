"""The ``:name`` binds of a row's SQL, as SQLAlchemy's ``text()`` will see them.

Its own small module: the executor needs it on every call's path, and
:mod:`registry.checks` (where the validator uses it too) imports the YAML
position machinery a call never needs.
"""

from __future__ import annotations

from functools import lru_cache

import sqlalchemy as sa

__all__ = ["binds_of"]


@lru_cache(maxsize=65536)
def binds_of(sql: str) -> frozenset[str]:
    """The ``:name`` binds SQLAlchemy will see in ``sql``."""
    return frozenset(sa.text(sql)._bindparams)
