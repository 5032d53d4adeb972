"""The packaged examples, and applying a plain SQL file statement by statement.

The example capabilities (a small insurance back office) and their schema ship
inside the package as ``capgate/examples/`` -- in the source tree a link to the
top-level ``capabilities/`` folder, in a wheel real files -- and are found with
``importlib.resources``, so ``capgate demo`` and ``capgate init`` work from any
folder of a plain ``pip install``, not only from a checkout.

The schema files in ``examples/schema/`` hold no procedural code, so a
statement ends with ``;`` at the end of a line.
"""

from __future__ import annotations

import shutil
import tempfile
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlalchemy as sa

_EXTRACTED: Path | None = None


def examples_dir() -> Path:
    """The packaged example capabilities as a folder on disk (``schema/`` inside it).

    An installed package is a folder and this is a path into it; from a zip
    import the files are copied out once per process.
    """
    global _EXTRACTED
    root = files("capgate") / "examples"
    if isinstance(root, Path):
        return root
    if _EXTRACTED is None:  # pragma: no cover - zip imports only
        target = Path(tempfile.mkdtemp(prefix="capgate-examples-"))
        _copy_tree(root, target)
        _EXTRACTED = target
    return _EXTRACTED


def _copy_tree(source: Traversable, target: Path) -> None:  # pragma: no cover - zip imports
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_dir():
            _copy_tree(item, target / item.name)
        else:
            (target / item.name).write_bytes(item.read_bytes())


def example_capability_files() -> list[Path]:
    """The example capability files, in name order."""
    return sorted(p for p in examples_dir().iterdir() if p.suffix in (".yaml", ".yml"))


def copy_examples(target: Path) -> list[Path]:
    """Copy the example capability files (not the schema) into ``target``; the copies."""
    target.mkdir(parents=True, exist_ok=True)
    out = []
    for source in example_capability_files():
        dest = target / source.name
        shutil.copyfile(source, dest)
        out.append(dest)
    return out


def statements(text: str) -> list[str]:
    out: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        if not current and (not line.strip() or line.strip().startswith("--")):
            continue
        current.append(line)
        if line.rstrip().endswith(";"):
            out.append("\n".join(current).rstrip().rstrip(";"))
            current = []
    if any(line.strip() for line in current):
        out.append("\n".join(current))
    return out


def schema_file(dialect: str) -> Path:
    """The example schema for a dialect name or alias (SQLAlchemy's ``mysql`` is MariaDB)."""
    from capgate.executor.dialects import engine_name

    return examples_dir() / "schema" / f"{engine_name(dialect)}.sql"


def apply_schema(engine: sa.Engine, path: Path | None = None) -> int:
    """Create the example schema in ``engine``'s database; returns the statement count."""
    path = path or schema_file(engine.dialect.name)
    items = statements(path.read_text("utf-8"))
    with engine.begin() as conn:
        for sql in items:
            conn.exec_driver_sql(sql)
    return len(items)
