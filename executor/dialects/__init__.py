"""Dialect-specific mechanisms, one module per database, behind ``Dialect``.

Everything the executor needs that SQL standardises badly lives here: session
tagging, server-side timeouts, read-only transactions, the transaction's
identity before COMMIT, commit-outcome probes and session liveness.
"""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from executor.dialects.base import SECRET_KEY, Dialect, SessionTag, TxIdentity, safe_url

__all__ = ["DRIVERS", "SECRET_KEY", "Dialect", "SessionTag", "TxIdentity", "dialect_for",
           "normalise_url", "safe_url"]

DRIVERS = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg",
           "mysql": "mysql+pymysql", "mariadb": "mysql+pymysql", "oracle": "oracle+oracledb",
           "mariadb+pymysql": "mysql+pymysql"}
"""URL schemes a user may write, and the driver capgate pins for each."""


def normalise_url(raw: str | URL) -> URL:
    """Pin capgate's drivers: psycopg 3, PyMySQL, python-oracledb (``mariadb://`` works too)."""
    url = make_url(raw)
    if url.drivername in DRIVERS:
        url = url.set(drivername=DRIVERS[url.drivername])
    return url


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
