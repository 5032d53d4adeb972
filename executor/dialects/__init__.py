"""Dialect-specific mechanisms, one module per database, behind ``Dialect``.

Everything the executor needs that SQL standardises badly lives here: session
tagging, server-side timeouts, read-only transactions, the transaction's
identity before COMMIT, commit-outcome probes, session liveness, cancelling and
ending a session, the fence upsert and resume's evidence.  Each engine is one
module (``postgresql``, ``mariadb``, ``sqlite``, ``oracle``) whose class
registers itself by naming its dialect (``class PostgresqlDialect(Dialect,
name="postgresql")``: :mod:`executor.dialects.registration`); this package finds it
(:func:`dialect_for`) and turns the names and URLs users write into that
dialect's canonical name (:func:`engine_name`) and pinned driver
(:func:`normalise_url`) -- for the other layers too (the DDL catalog adapters and
the ledger backends are looked up by the name given here).
"""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from capgate.executor.dialects.base import (
    SECRET_KEY,
    Dialect,
    SessionTag,
    TxIdentity,
    safe_url,
    safe_url_text,
)

__all__ = ["SECRET_KEY", "Dialect", "SessionTag", "TxIdentity", "dialect_class",
           "dialect_classes", "dialect_for", "engine_name", "normalise_url", "safe_url",
           "safe_url_text"]


def _backend_name(name_or_url: str | URL) -> str:
    if isinstance(name_or_url, URL):
        return name_or_url.get_backend_name()
    if "://" in name_or_url:
        return make_url(name_or_url).get_backend_name()
    return name_or_url.lower()


def dialect_class(name_or_url: str | URL) -> type[Dialect] | None:
    """The registered dialect for a dialect name, an alias or a URL; None if none is."""
    return Dialect.implementations.get(_backend_name(name_or_url))


def dialect_classes() -> list[type[Dialect]]:
    """Every registered dialect, by name (each engine module imported)."""
    found = (Dialect.implementations.get(name) for name in Dialect.implementations.names())
    return [cls for cls in found if cls is not None]


def engine_name(name_or_url: str | URL) -> str:
    """The canonical dialect name (``postgresql``, ``mariadb``, ``oracle``, ``sqlite``) for a
    name, an alias (``mysql``, ``postgres``) or a URL -- the one place aliases are resolved.

    A name no dialect registers comes back as it was given (lower case), so the
    caller's own refusal can name it.
    """
    name = _backend_name(name_or_url)
    cls = Dialect.implementations.get(name)
    return cls.name if cls is not None else name


def normalise_url(raw: str | URL) -> URL:
    """The URL with capgate's driver pinned (psycopg 3, PyMySQL, python-oracledb).

    Each dialect declares the schemes it rewrites (:attr:`Dialect.url_schemes`:
    ``postgres://``, ``mariadb://`` ...) and the driver it pins; any other
    scheme, and a driver the user chose, is left as written.
    """
    url = make_url(raw)
    cls = Dialect.implementations.get(url.get_backend_name())
    if cls is not None and cls.driver is not None and url.drivername in cls.url_schemes:
        url = url.set(drivername=cls.driver)
    return url


def dialect_for(name_or_url: str | URL) -> Dialect:
    """A new instance of the dialect for a dialect name, an alias or a URL.

    Raises ConfigError naming the dialects there are when none is registered.
    """
    cls = dialect_class(name_or_url)
    if cls is None:
        from capgate.registry.errors import ConfigError

        known = ", ".join(Dialect.implementations.names())
        raise ConfigError(
            f"unsupported database dialect {_backend_name(name_or_url)!r} ({known})")
    return cls()
