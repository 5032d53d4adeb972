"""The fixtures give each test an empty place of its own on a real server."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import URL


def test_target_is_empty_and_writable(target_url: URL) -> None:
    eng = sa.create_engine(target_url)
    try:
        with eng.begin() as conn:
            assert sa.inspect(conn).get_table_names() == []
            conn.execute(sa.text("CREATE TABLE t (id INTEGER PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO t (id) VALUES (:id)"), {"id": 1})
        with eng.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 1
    finally:
        eng.dispose()
