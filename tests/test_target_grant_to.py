"""``capgate target install --grant-to NAME``: the name is checked and quoted, never pasted.

Before, the GRANT was built from the role name as typed, and a name carrying
SQL dropped a table.  Now the dialect checks the name against its identifier
rules (a MariaDB account as USER or USER@HOST) and quotes it; anything else is
refused with ``CG922`` before a statement is sent -- by ``install`` and by
``install --sql`` alike.  Real PostgreSQL and MariaDB, through the CLI.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL

from tests.server_support import Project, server_url

__all__ = ["server_url"]  # the fixture, imported for pytest

ATTACKS = (
    "app TO PUBLIC; DROP TABLE policy_note; --",
    "app; DROP TABLE policy_note",
    'app" ; DROP TABLE policy_note; --',
    "app' ; DROP TABLE policy_note; --",
    "app/**/TO/**/PUBLIC",
    "app\nDROP TABLE policy_note",
)


def tables(url: URL) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return {t.lower() for t in sa.inspect(conn).get_table_names()}
    finally:
        engine.dispose()


def fresh_target(project: Project) -> None:
    """Drop capgate's tables, so that install has something to create (and to grant)."""
    engine = sa.create_engine(project.target, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE capgate_landed"))
        conn.execute(sa.text("DROP TABLE capgate_fence"))
    engine.dispose()


def test_a_grantee_carrying_sql_is_refused_and_changes_nothing(server_url: URL,
                                                              tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)
    fresh_target(project)
    before = tables(server_url)
    assert "policy_note" in before
    user = server_url.username or "postgres"  # a grantee that exists: the GRANT would work
    for name in (f"{user}; DROP TABLE policy_note", f"{user}@localhost; DROP TABLE policy_note",
                 *ATTACKS):
        for sql in (False, True):
            ran = project.cli("target", "install", "insurance", "--grant-to", name,
                              *(["--sql"] if sql else []), "--json")
            assert ran.code == 2, (name, ran.out, ran.err)
            refusal = ran.json()
            assert refusal["code"] == "CG922", refusal
            assert "nothing was executed" in refusal["message"]
        assert tables(server_url) == before, name  # policy_note is still there; nothing made


def test_a_plain_grantee_is_quoted_by_the_dialect_and_granted(server_url: URL,
                                                              tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)
    fresh_target(project)
    postgres = server_url.get_backend_name() == "postgresql"
    role = f"server_files_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role}" if postgres else f"CREATE USER '{role}'@'%'"))
    try:
        script = project.cli("target", "install", "insurance", "--sql", "--grant-to", role)
        assert script.code == 0, script.err
        grantee = role if postgres else f"'{role}'@'%'"
        assert f"TO {grantee};" in script.out
        ran = project.cli("target", "install", "insurance", "--grant-to", role, "--json")
        assert ran.code == 0, (ran.out, ran.err)
        assert ran.json()["created"] == ["capgate_landed", "capgate_fence"]
        with admin.connect() as conn:
            if postgres:
                granted = conn.execute(sa.text(
                    "SELECT has_table_privilege(:r, 'capgate_landed', 'INSERT')"),
                    {"r": role}).scalar()
            else:
                granted = any("capgate_landed" in str(r[0]) for r in conn.execute(
                    sa.text(f"SHOW GRANTS FOR '{role}'@'%'")))
        assert granted
    finally:
        with admin.connect() as conn:
            if postgres:
                conn.execute(sa.text(f"DROP OWNED BY {role}"))
                conn.execute(sa.text(f"DROP ROLE {role}"))
            else:
                conn.execute(sa.text(f"DROP USER '{role}'@'%'"))
        admin.dispose()
