"""One way to register an engine's implementation of a layer, alembic style.

Three layers differ by database engine: the executor's :class:`~executor.dialects.Dialect`,
the DDL loop's catalog adapter (``ddl.catalog.BaseAdapter``) and the ledger's
``Backend`` (``executor.ledger.backends``).  Each layer is one base class deriving
from :class:`Registered`; an engine's implementation is a subclass that names its
dialect in the class statement::

    class PostgresqlDialect(Dialect, name="postgresql", aliases=("postgres",)):
        ...

and the layer finds it with one lookup, :meth:`Implementations.get`.  The modules
that hold a layer's implementations are imported on the first lookup that needs
them, so adding an engine means adding its module -- no table elsewhere names it.

Names are SQLAlchemy's backend names (``URL.get_backend_name()``); ``aliases`` are
the other spellings a user or SQLAlchemy may give the same engine (``mysql`` for
MariaDB).  Only the executor's dialects declare aliases: the other layers are
looked up by the canonical name :func:`executor.dialects.engine_name` gives.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T")


class Implementations(Generic[T]):
    """One layer's implementations, by dialect name (and alias).

    ``modules`` lists, when called, the modules that may hold implementations;
    ``module_of`` names the module an implementation of a given name lives in by
    convention (``executor.dialects.<name>``), so that the usual lookup imports
    that one module only and the whole list is imported only for an alias or a
    name that has no module of its own.
    """

    def __init__(self, layer: str, *, module_of: Callable[[str], str] | None = None,
                 modules: Callable[[], Iterable[str]] | None = None) -> None:
        self.layer = layer
        self._module_of = module_of
        self._modules = modules
        self._by_name: dict[str, type[T]] = {}
        self._canonical: dict[str, type[T]] = {}
        self._loaded = modules is None
        self._lock = threading.RLock()

    def add(self, cls: type[T], name: str, aliases: Iterable[str] = ()) -> None:
        """Register ``cls`` as the layer's implementation for ``name`` (and its aliases)."""
        with self._lock:
            for key in (name, *aliases):
                known = self._by_name.get(key)
                if known is not None and _path(known) != _path(cls):  # (a reload is no clash)
                    raise TypeError(f"{self.layer}: {_path(cls)} and {_path(known)} both "
                                    f"register dialect {key!r}")
                self._by_name[key] = cls
            self._canonical[name] = cls

    def get(self, name: str) -> type[T] | None:
        """The implementation registered for ``name`` (or an alias of it); None if none is."""
        key = name.lower()
        found = self._by_name.get(key)
        if found is not None:
            return found
        with self._lock:
            if self._module_of is not None and key.isidentifier():
                try:
                    importlib.import_module(self._module_of(key))
                except ModuleNotFoundError as exc:
                    if exc.name != self._module_of(key):
                        raise  # the module exists but imports something missing
                found = self._by_name.get(key)
            if found is None and not self._loaded:
                self._load()
                found = self._by_name.get(key)
        return found

    def names(self) -> list[str]:
        """Every registered canonical name, sorted (all modules imported first)."""
        with self._lock:
            if not self._loaded:
                self._load()
            return sorted(self._canonical)

    def _load(self) -> None:
        assert self._modules is not None
        for module in self._modules():
            importlib.import_module(module)
        self._loaded = True


def _path(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def package_modules(package: str, prefix: str = "") -> Callable[[], list[str]]:
    """The modules of ``package`` whose name starts with ``prefix`` (for ``modules=``)."""

    def listed() -> list[str]:
        path = importlib.import_module(package).__path__
        return [f"{package}.{info.name}" for info in pkgutil.iter_modules(path)
                if info.name.startswith(prefix) and not info.name.startswith("_")]

    return listed


class Registered:
    """Base of a layer's protocol class: a subclass that names a dialect registers itself.

    The layer's base class sets :attr:`implementations`; a subclass given
    ``name=`` (and optionally ``aliases=``) in its class statement is added to it
    and gets :attr:`name` and :attr:`aliases` as class attributes.  A subclass
    without ``name=`` (a shared intermediate, a test's stand-in) registers nothing.
    """

    implementations: ClassVar[Implementations[Any]]
    name: ClassVar[str] = "generic"
    """The dialect this class implements (SQLAlchemy's backend name)."""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Other names of the same engine (``mysql`` for MariaDB)."""

    def __init_subclass__(cls, *, name: str | None = None, aliases: Iterable[str] = (),
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            cls.aliases = tuple(aliases)
            cls.implementations.add(cls, name, cls.aliases)
