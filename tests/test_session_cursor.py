"""One driver cursor per session for the call's statements (issue 13: client CPU per call).

``Dialect.execute`` used to make a new driver cursor for every statement; it now
keeps one per pooled driver connection.  What must hold on every engine: each
statement's result is its own (a later statement never shows an earlier one's
rows or count), a session whose driver connection was replaced (a disconnect)
gets a cursor of the new connection, and a closed cursor is never handed out.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.dialects import dialect_for
from capgate.executor.dialects.base import _CURSOR_KEY


@pytest.fixture
def engine(target_url: URL) -> Iterator[sa.Engine]:
    eng = sa.create_engine(target_url)
    with eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE cur_t (id INTEGER PRIMARY KEY, v INTEGER NOT NULL)"))
        conn.execute(sa.text("INSERT INTO cur_t (id, v) VALUES (1, 10), (2, 20), (3, 30)"))
    yield eng
    eng.dispose()


def test_each_statement_answers_for_itself_on_the_one_cursor(engine: sa.Engine) -> None:
    dialect = dialect_for(engine.url)
    with engine.connect() as conn:
        first = dialect.execute(conn, "UPDATE cur_t SET v = v + 1 WHERE id >= :lo", {"lo": 2})
        assert first.rowcount == 2
        rows = dialect.execute(conn, "SELECT id, v FROM cur_t WHERE id = :id", {"id": 3})
        assert [tuple(r) for r in rows.fetchall()] == [(3, 31)]
        again = dialect.execute(conn, "UPDATE cur_t SET v = v WHERE id = :id", {"id": 99})
        assert again.rowcount == 0
        if dialect.reuse_cursor:
            assert first is rows is again  # one cursor for the session
        else:
            assert first is not rows
        conn.rollback()


def test_a_replaced_or_closed_connection_gets_a_cursor_of_its_own(engine: sa.Engine) -> None:
    dialect = dialect_for(engine.url)
    if not dialect.reuse_cursor:
        pytest.skip(f"{dialect.name} makes a cursor per statement")
    with engine.connect() as conn:
        before = dialect.execute(conn, "SELECT v FROM cur_t WHERE id = :id", {"id": 1})
        assert before.fetchall()[0][0] == 10
        old_raw = conn.connection.driver_connection
        conn.invalidate()  # as after a disconnect: the pool record gets a new connection
        after = dialect.execute(conn, "SELECT v FROM cur_t WHERE id = :id", {"id": 2})
        assert conn.connection.driver_connection is not old_raw
        assert after is not before
        assert after.fetchall()[0][0] == 20
        if engine.url.get_backend_name() == "sqlite":
            conn.rollback()
            return  # (sqlite3 cannot tell a closed cursor; nothing of capgate closes it)
        after.close()
        closed_then = dialect.execute(conn, "SELECT v FROM cur_t WHERE id = :id", {"id": 3})
        assert closed_then is not after
        assert closed_then.fetchall()[0][0] == 30
        assert conn.connection.info[_CURSOR_KEY][1] is closed_then
        conn.rollback()
