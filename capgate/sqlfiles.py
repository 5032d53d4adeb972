"""Apply a plain SQL file (the example schema) statement by statement.

The schema files in ``capabilities/schema/`` hold no procedural code, so a
statement ends with ``;`` at the end of a line.  Used by the demo and tests.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "capabilities" / "schema"


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
    name = {"mysql": "mariadb"}.get(dialect, dialect)
    return SCHEMA_DIR / f"{name}.sql"


def apply_schema(engine: sa.Engine, path: Path | None = None) -> int:
    """Create the example schema in ``engine``'s database; returns the statement count."""
    path = path or schema_file(engine.dialect.name)
    items = statements(path.read_text("utf-8"))
    with engine.begin() as conn:
        for sql in items:
            conn.exec_driver_sql(sql)
    return len(items)
