"""The benchmarks stand on their own: nothing in ``bench/`` imports ``tests``.

``bench/claims.py`` once borrowed the test fixtures (``tests.fix_capgate``,
``tests.fix_db``, ``tests.test_lease_support``): a change to a fixture changed what
a benchmark measured.  What the benchmarks share is ``bench/_support.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (``import a.b``, ``from a import b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def test_no_bench_file_imports_tests() -> None:
    files = sorted(BENCH.glob("*.py"))
    assert BENCH / "claims.py" in files and BENCH / "_support.py" in files
    offenders = {p.name: sorted(m for m in imported_modules(p)
                                if m == "tests" or m.startswith("tests."))
                 for p in files}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_the_scan_sees_every_kind_of_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import tests.fix_db\nfrom tests import fix_capgate\n"
                     "def f():\n    from tests.test_lease_support import run_workers\n"
                     "import importlib\nimportlib.import_module('tests.fix_db')\n", "utf-8")
    assert {"tests.fix_db", "tests", "tests.fix_capgate",
            "tests.test_lease_support"} <= imported_modules(probe)
