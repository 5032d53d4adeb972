"""The call path runs one way: no import cycle inside ``executor/`` (issue 13) or ``capgate/``.

Every import counts -- at module level, inside a function, under
``TYPE_CHECKING`` -- because a cycle held together by a function-local
import is still a cycle in the design: neither side can be read, tested or
replaced without the other.  The graph is read from the source (``ast``), so
nothing is imported to check it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("executor", "registry", "ddl", "capgate")
_LIBRARIES = ("capgate.registry", "capgate.executor", "capgate.ddl")


def _modules(package: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts[0] != "capgate":  # registry/, executor/, ddl/ install as capgate.<name>
            parts.insert(0, "capgate")
        found[".".join(parts)] = path
    return found


def _imported(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every dotted name ``tree`` imports (``import a.b`` and ``from a import b`` give ``a.b``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            for alias in node.names:
                yield f"{prefix}.{alias.name}"


def graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports.

    ``import a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``: each is an edge, except
    a package the importing module itself lives in (its ``__init__`` already
    runs first, whatever the module imports).  ``from a.b import name`` where
    ``name`` is not a module is an edge to ``a.b`` itself, ancestor or not --
    that is a real use of the package's ``__init__``.
    """
    modules = _modules(package)
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text("utf-8"), str(path))
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        if path.name == "__init__.py":
            ancestors.add(name)
        targets: set[str] = set()
        for imported in _imported(tree, name, path.name == "__init__.py"):
            if package == "capgate" and imported.startswith(_LIBRARIES):
                continue  # capgate.registry and friends are other graphs, not capgate/'s
            parts = imported.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            known = [p for p in prefixes if p in modules]
            if not known:
                continue
            deepest = known[-1]
            targets.add(deepest)
            targets.update(p for p in known[:-1] if p not in ancestors)
        targets.discard(name)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_executor() -> None:
    edges = graph("executor")
    assert len(edges) > 20, "the executor package was not found"
    found = cycles(edges)
    assert not found, "import cycles inside executor/ (every import counts):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def command_table() -> dict[str, str]:
    """``capgate.cli.COMMANDS`` as command -> handler module, read from the source."""
    tree = ast.parse((ROOT / "capgate" / "cli.py").read_text("utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == "COMMANDS" and node.value is not None:
            table = ast.literal_eval(node.value)
            return {name: module for name, (module, _) in table.items()}
    raise AssertionError("capgate/cli.py has no COMMANDS table")


#: Edges the face still has that it should not, each with the reason it waits (none now:
#: the doctor's handler moved to ``capgate/handlers/`` like every other).
PENDING: set[tuple[str, str]] = set()


def capgate_graph() -> dict[str, set[str]]:
    """``capgate/``'s imports, plus the entry point's lazy ones: the modules COMMANDS names."""
    edges = graph("capgate")
    edges["capgate.cli"] |= set(command_table().values())
    for source, target in PENDING:
        assert target in edges[source], f"{source} no longer imports {target}: drop it " \
                                        "from PENDING"
        edges[source].discard(target)
    return edges


def test_no_import_cycle_inside_capgate() -> None:
    """The face reads top down: cli -> handlers -> commands -> the libraries, never back."""
    edges = capgate_graph()
    assert "capgate.commands.calls" in edges and "capgate.handlers.calls" in edges
    found = cycles(edges)
    assert not found, "import cycles inside capgate/ (every import counts, and the modules " \
        "capgate.cli.COMMANDS names):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_face_is_layered() -> None:
    """A command function never reaches for the command line; a handler for no other handler."""
    edges = capgate_graph()
    for module, targets in edges.items():
        if module.startswith("capgate.commands"):
            upward = {t for t in targets if t.startswith(("capgate.handlers", "capgate.cli"))}
            assert not upward, f"{module} (a command function) imports {sorted(upward)}"
        if module.startswith("capgate.handlers."):
            others = {t for t in targets if t == "capgate.cli" or (
                t.startswith("capgate.handlers.") and t != "capgate.handlers.console")}
            assert not others, f"{module} (a handler) imports {sorted(others)}"
    below = ("capgate.mcp_server", "capgate.api", "capgate.caseview", "capgate.exposure",
             "capgate.internal", "capgate.config")
    for module in below:
        upward = {t for t in edges[module] if t.startswith(("capgate.handlers", "capgate.cli"))}
        assert not upward, f"{module} imports {sorted(upward)}"
    table = command_table()
    assert all(m.startswith("capgate.handlers.") for c, m in table.items()
               if (m, "capgate.cli") not in PENDING), table


@pytest.mark.parametrize("package", ["registry", "ddl"])
def test_no_import_cycle_in_the_other_libraries(package: str) -> None:
    found = cycles(graph(package))
    assert not found, f"import cycles inside {package}/:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_detector_sees_a_function_local_cycle(tmp_path: Path) -> None:
    """The check itself can fail: a cycle made only of function-local imports is found."""
    edges = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles(edges) == [["p.a", "p.b", "p.c"]]
    tree = ast.parse("def f():\n    from p import a\n")
    assert "p.a" in set(_imported(tree, "p.c", False))
    tree = ast.parse("def f():\n    from . import a\n")
    assert "p.a" in set(_imported(tree, "p.c", False))
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from .b import thing\n")
    assert "p.b.thing" in set(_imported(tree, "p.a", False))


_BARE_IMPORT = re.compile(r"^\s*(?:from|import)\s+(registry|executor|ddl)\b", re.M)


def test_one_import_name_everywhere() -> None:
    """registry/, executor/ and ddl/ are imported only as ``capgate.<name>``.

    The wheel installs them under ``capgate``; a bare ``import executor`` works in
    a checkout (its root is on ``sys.path``) but would load a second copy of every
    module there, and fails outright once installed.
    """
    found = []
    for folder in (*PACKAGES, "tests", "bench", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in _BARE_IMPORT.finditer(path.read_text("utf-8")):
                line = path.read_text("utf-8").count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0).strip()}")
    assert found == []
