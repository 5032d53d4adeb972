"""The wheel: every module and the examples in it, and a new user's path from it.

``pip install <checkout>`` once gave a capgate that could not start (a
subpackage missing from a hand-written package list), and the editable
installs of ``make demo`` and ``make test`` could not notice.  These tests
build the wheel, check its contents against the source tree, install it into
a new virtual environment outside the checkout and run
``scripts/wheel_smoke.py`` there.  Offline, the new environment borrows the
dependencies of this one through a ``.pth`` line (never capgate itself: the
editable finder lives in a ``.pth`` file that a path line does not run);
``.ci/run`` does the same with the dependencies from the package index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("registry", "executor", "ddl", "capgate")
"""The source folders; all but capgate/ install under capgate (capgate/registry ...)."""


def installed_name(source: Path) -> str:
    """Where a source file of the checkout lands in the wheel."""
    rel = source.relative_to(ROOT).as_posix()
    return rel if rel.startswith("capgate/") else f"capgate/{rel}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = tmp_path_factory.mktemp("build")
    # a copy of the tree: setuptools packs whatever an earlier build left in the
    # checkout's build/lib, so building in place would test a stale layout
    source = tmp_path_factory.mktemp("source") / "capgate"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(source)],
                          cwd=build, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (found,) = out.glob("capgate-*.whl")
    return found


def test_the_wheel_holds_every_module_and_the_examples(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {installed_name(p) for package in PACKAGES
               for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts}
    assert sources - names == set()
    assert "capgate/executor/dialects/postgresql.py" in names
    # one import name: nothing but capgate and its metadata at the top of site-packages
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"capgate"}, tops
    examples = {p.name for p in (ROOT / "capabilities").glob("*.yaml")}
    assert {f"capgate/examples/{n}" for n in examples} <= names
    assert {f"capgate/examples/schema/{e}.sql"
            for e in ("sqlite", "postgresql", "mariadb", "oracle")} <= names
    assert "capgate/registry/capability.schema.json" in names
    assert "capgate/executor/ledger/migrations/script.py.mako" in names


@pytest.mark.slow
def test_the_installed_wheel_takes_a_new_user_from_init_to_mcp(wheel: Path,
                                                               tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                              "-q", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=600, check=False)
    assert install.returncode == 0, install.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "borrowed-dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n", "utf-8")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CAPGATE_", "PYTHON", "VIRTUAL_ENV"))}
    work = tmp_path / "user"
    smoke = subprocess.run([str(python), str(ROOT / "scripts" / "wheel_smoke.py"), str(work)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
                           check=False)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    assert "wheel smoke: ok" in smoke.stdout
