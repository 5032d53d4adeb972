"""Dialect-specific mechanisms, one module per database, behind ``Dialect``.

Everything the executor needs that SQL standardises badly lives here: session
tagging, server-side timeouts, read-only transactions, the transaction's
identity before COMMIT, commit-outcome probes and session liveness.
"""

from __future__ import annotations

from executor.dialects.base import Dialect, SessionTag, TxIdentity

__all__ = ["Dialect", "SessionTag", "TxIdentity", "dialect_for"]


def dialect_for(name: str) -> Dialect:
    """The dialect implementation for a SQLAlchemy dialect name."""
    if name == "sqlite":
        from executor.dialects.sqlite import SqliteDialect

        return SqliteDialect()
    if name == "postgresql":
        from executor.dialects.postgresql import PostgresqlDialect

        return PostgresqlDialect()
    if name in ("mysql", "mariadb"):
        from executor.dialects.mariadb import MariadbDialect

        return MariadbDialect()
    if name == "oracle":
        from executor.dialects.oracle import OracleDialect

        return OracleDialect()
    from registry.errors import ConfigError

    raise ConfigError(
        f"unsupported database dialect {name!r} (sqlite, postgresql, mariadb, oracle)"
    )
