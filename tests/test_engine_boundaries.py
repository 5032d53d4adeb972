"""One place per engine: no code outside the engine modules asks which engine it talks to.

Every difference between PostgreSQL, MariaDB, SQLite and Oracle lives behind one
protocol per layer -- the executor's ``Dialect`` (``executor/dialects/<engine>.py``),
the DDL loop's catalog adapter (``ddl/catalog_<engine>.py``), the ledger's backend
(``executor/ledger/backends.py``) -- and, for validation, which cannot import the
executor, one grammar table (``registry/dialect_checks.py``).  Everywhere else a
comparison with an engine's name is a branch a new engine would have to find and
extend: this test finds it first.

What counts (read from the source with ``ast``, nothing is imported): a comparison
(``==``, ``!=``, ``in``, ``not in``, ``match``) with an engine-name string or a
literal collection holding one; a dict literal keyed by engine names (a dispatch
table); a subscript or ``.get`` / ``.startswith`` / ``.endswith`` / ``.removeprefix``
with one.  A name in a docstring, a message, a URL or a record is not a branch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from capgate.ddl.catalog import BaseAdapter, adapter_for, registered_dialects
from capgate.executor.dialects import (
    Dialect,
    dialect_classes,
    dialect_for,
    engine_name,
    normalise_url,
)
from capgate.executor.dialects.registration import Implementations, Registered
from capgate.executor.ledger.backends import backend_for, backend_named

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("executor", "registry", "ddl", "capgate")
ENGINE_NAMES = frozenset({"postgresql", "postgres", "mariadb", "mysql", "sqlite", "oracle"})
"""The engines' names and aliases, as SQLAlchemy and users spell them."""


def engine_modules() -> set[Path]:
    """The modules where an engine may be named: one per engine and layer."""
    dialects = ROOT / "executor" / "dialects"
    found = {p for p in dialects.glob("*.py")
             if p.stem not in ("__init__", "base", "registration")}
    found |= set((ROOT / "ddl").glob("catalog_*.py"))
    found.add(ROOT / "executor" / "ledger" / "backends.py")
    found.add(ROOT / "registry" / "dialect_checks.py")  # registry cannot import executor
    return found


def _is_engine(node: ast.AST) -> bool:
    """An engine's name (``"oracle"``, ``"postgresql+psycopg"``) or a literal collection
    that holds one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("+", 1)[0].lower() in ENGINE_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_engine(e) for e in node.elts)
    return False


_STRING_TESTS = frozenset({"get", "startswith", "endswith", "removeprefix", "pop",
                           "setdefault"})


def engine_branches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for every place ``tree`` branches on an engine's name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            if any(_is_engine(side) for side in (node.left, *node.comparators)):
                yield node.lineno, "comparison with an engine name"
        elif isinstance(node, ast.MatchValue) and _is_engine(node.value):
            yield node.lineno, "match on an engine name"
        elif isinstance(node, ast.Dict):
            if any(key is not None and _is_engine(key) for key in node.keys):
                yield node.lineno, "table keyed by engine names"
        elif isinstance(node, ast.Subscript) and _is_engine(node.slice):
            yield node.lineno, "lookup by an engine name"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _STRING_TESTS and any(_is_engine(a) for a in node.args):
            yield node.lineno, f".{node.func.attr}() with an engine name"


def _library_modules() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_engine_name_is_compared_outside_the_engine_modules() -> None:
    allowed = engine_modules()
    found = []
    for path in _library_modules():
        if path in allowed:
            continue
        tree = ast.parse(path.read_text("utf-8"), str(path))
        found += [f"{path.relative_to(ROOT)}:{line}: {what}"
                  for line, what in engine_branches(tree)]
    assert not found, ("engine-specific branches outside the engine modules (make them a "
                       "method or a has_x(check=) question of the dialect, the catalog "
                       "adapter or the ledger backend):\n" + "\n".join(found))


def test_the_detector_finds_each_kind_of_branch() -> None:
    """The check itself can fail: each kind of engine branch is found, prose is not."""
    source = '''
if dialect.name == "oracle": pass
if name in ("postgresql", "sqlite"): pass
if url.get_backend_name() != "sqlite": pass
UPSERT = {"mariadb": "...", "postgresql": "..."}
x = UPSERT["postgresql"]
y = {"mysql": "mariadb"}.get(d, d)
z = url.startswith("oracle")
w = driver in ("postgresql+psycopg",)
match name:
    case "sqlite": pass
'''
    lines = sorted({line for line, _ in engine_branches(ast.parse(source))})
    assert lines == [2, 3, 4, 5, 6, 7, 8, 9, 11], lines
    prose = '''
"""The SQLite ledger, or postgresql:// to share it."""
url = "sqlite:///ledger.db"
message = f"leased rows are refused on {title}"
record = {"dialect": dialect.name}
if dialect.name == other.name: pass
'''
    assert list(engine_branches(ast.parse(prose))) == []


def test_the_engine_modules_are_the_ones_there_are() -> None:
    """The allowance is not a blanket: every allowed module exists and is an engine's."""
    for path in engine_modules():
        assert path.exists(), path
    assert {p.stem for p in (ROOT / "executor" / "dialects").glob("*.py")} - {
        "__init__", "base", "registration"} == set(Dialect.implementations.names())
    assert {p.stem.removeprefix("catalog_") for p in (ROOT / "ddl").glob("catalog_*.py")} \
        == set(registered_dialects())


# --- one registration, one lookup per layer, one normaliser ---------------------------------


def test_every_layer_registers_by_dialect_name() -> None:
    """Each implementation names its dialect in its class statement; the names agree."""
    names = {cls.name for cls in dialect_classes()}
    assert names == {"postgresql", "mariadb", "sqlite", "oracle"}
    for cls in dialect_classes():
        assert type(dialect_for(cls.name)) is cls
        assert cls.title and cls.title != "generic"
    assert set(registered_dialects()) <= names
    for name in registered_dialects():
        adapter = adapter_for(name)
        assert isinstance(adapter, BaseAdapter) and adapter.dialect == adapter.name == name
    for name in ("sqlite", "postgresql"):
        backend = backend_named(name)
        assert backend is not None and backend.name == name
    assert backend_named("mariadb") is None and backend_named("oracle") is None


@pytest.mark.parametrize(("given", "name"), [
    ("postgresql", "postgresql"), ("postgres", "postgresql"), ("mysql", "mariadb"),
    ("mariadb", "mariadb"), ("sqlite", "sqlite"), ("oracle", "oracle"), ("MySQL", "mariadb"),
    ("mssql", "mssql"), ("postgres://u@h/db", "postgresql"), ("mysql+pymysql://u@h/d", "mariadb"),
    ("mariadb+pymysql://u@h/d", "mariadb"), ("oracle+oracledb://u@h/?service_name=s", "oracle"),
    ("sqlite:///x.db", "sqlite"),
])
def test_one_alias_resolution_for_every_layer(given: str, name: str) -> None:
    assert engine_name(given) == name
    if name in registered_dialects():
        assert adapter_for(given).dialect == name


@pytest.mark.parametrize(("given", "pinned"), [
    ("postgresql://u@h/db", "postgresql+psycopg"), ("postgres://u@h/db", "postgresql+psycopg"),
    ("postgresql+psycopg2://u@h/db", "postgresql+psycopg2"),  # a driver the user chose
    ("mysql://u@h/db", "mysql+pymysql"), ("mariadb://u@h/db", "mysql+pymysql"),
    ("mariadb+pymysql://u@h/db", "mysql+pymysql"), ("mysql+mysqldb://u@h/db", "mysql+mysqldb"),
    ("oracle://u@h/?service_name=s", "oracle+oracledb"), ("sqlite:///x.db", "sqlite"),
    ("mssql://u@h/db", "mssql"),
])
def test_one_url_normaliser(given: str, pinned: str) -> None:
    assert normalise_url(given).drivername == pinned


def test_the_ledger_uses_the_same_normaliser() -> None:
    backend, url = backend_for("postgres://u@h/db")
    assert backend.name == "postgresql" and url.drivername == "postgresql+psycopg"
    backend, url = backend_for("sqlite:///x.db")
    assert backend.name == "sqlite" and url.drivername == "sqlite"


def test_registration_refuses_two_implementations_of_one_dialect() -> None:
    class Layer(Registered):
        implementations: ClassVar[Implementations[Any]] = Implementations("test layer")

    class One(Layer, name="x", aliases=("ex",)):
        pass

    class Shared(Layer):  # no name: a shared intermediate registers nothing
        pass

    assert Layer.implementations.get("EX") is One and One.name == "x"
    assert Layer.implementations.get("y") is None
    with pytest.raises(TypeError, match="both register dialect 'x'"):
        class Two(Shared, name="x"):
            pass
    assert Layer.implementations.names() == ["x"]


def test_a_lookup_imports_that_engine_s_module_only() -> None:
    """A SQLite call loads the SQLite dialect, not every engine's module."""
    probe = ("import sys\nfrom capgate.executor.dialects import dialect_for, normalise_url\n"
             "dialect_for(normalise_url('sqlite:///x.db'))\n"
             "print(sorted(m for m in sys.modules if m.startswith('capgate.executor.dialects.')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == str(["capgate.executor.dialects.base", "capgate.executor.dialects.registration",
                       "capgate.executor.dialects.sqlite"]), out
