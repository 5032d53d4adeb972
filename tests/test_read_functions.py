"""Read rows cannot act: read and verify SQL call only side-effect-free functions.

Before, reads ran in a READ ONLY transaction and nothing else: a read row ran
``pg_terminate_backend`` and killed another session, and on MariaDB
``LOAD_FILE`` returned a server file.  Now ``capgate validate`` refuses such SQL
(``CG139``: a function not on the engine's list, nor in the row's reviewed
``allow_functions``; some functions can never be allowed) with path:line:col,
so the row never loads and never runs.  The proofs run against real PostgreSQL
and MariaDB: the victim session survives, no file is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.registry.loader import validate_texts
from tests.server_support import Project, server_url

__all__ = ["server_url"]  # the fixture, imported for pytest

ROW = """
format: 1
connectors:
  insurance:
    description: the insurance back office
    dialects: [{dialect}]
rows:
  - operation_id: ops.peek
    version: 1
    connector: insurance
    description: A read that should only read.
    input: {{type: object, additionalProperties: false, properties: {{}}}}
    target: {{system: insurance, object: policy}}
    effect_class: read
    authorization: {{kind: read_grant}}
    environments: [dev]
    timeout: {{seconds: 5, on_timeout: rolled_back}}
    recovery: retryable
{extra}    statements:
      - name: peek
        sql: "{sql}"
    evidence: [rows]
"""


def row_file(sql: str, dialect: str = "postgresql", extra: str = "") -> str:
    return ROW.format(sql=sql, dialect=dialect, extra=extra)


def findings(text: str) -> list[tuple[str, int, int, str]]:
    result = validate_texts([("peek.yaml", text)], workers=1)
    return [(p.code, p.line, p.col, p.message) for p in result.problems]


@pytest.mark.parametrize(("dialect", "sql", "name"), [
    ("postgresql", "SELECT pg_terminate_backend(pid) FROM pg_stat_activity",
     "pg_terminate_backend"),
    ("postgresql", "SELECT pg_cancel_backend(1)", "pg_cancel_backend"),
    ("postgresql", "SELECT pg_read_file('/etc/passwd')", "pg_read_file"),
    ("postgresql", "SELECT pg_read_binary_file('/etc/passwd')", "pg_read_binary_file"),
    ("postgresql", "SELECT lo_import('/etc/passwd')", "lo_import"),
    ("postgresql", "SELECT * FROM dblink('dbname=x', 'DELETE FROM t') AS t(a int)", "dblink"),
    ("postgresql", "SELECT pg_advisory_lock(1)", "pg_advisory_lock"),
    ("postgresql", "SELECT pg_try_advisory_xact_lock(1)", "pg_try_advisory_xact_lock"),
    ("postgresql", "SELECT set_config('statement_timeout', '0', false)", "set_config"),
    ("postgresql", "SELECT nextval('policy_seq')", "nextval"),
    ("postgresql", "SELECT setval('policy_seq', 1)", "setval"),
    ("postgresql", "SELECT pg_notify('chan', 'x')", "pg_notify"),
    ("postgresql", "SELECT pg_sleep(10)", "pg_sleep"),
    ("postgresql", "SELECT query_to_xml('DELETE FROM policy', true, true, '')",
     "query_to_xml"),
    ("mariadb", "SELECT LOAD_FILE('/etc/passwd') AS f", "load_file"),
    ("mariadb", "SELECT SLEEP(10)", "sleep"),
    ("mariadb", "SELECT GET_LOCK('x', 1)", "get_lock"),
    ("oracle", "SELECT DBMS_LOCK.SLEEP(1) FROM dual", "dbms_lock.sleep"),
    ("oracle", "SELECT UTL_HTTP.REQUEST('http://example.org') FROM dual", "utl_http.request"),
    ("oracle", "SELECT s.NEXTVAL FROM dual", "s.NEXTVAL"),
])
def test_functions_that_act_are_refused_with_their_position(dialect: str, sql: str,
                                                           name: str) -> None:
    found = findings(row_file(sql, dialect))
    assert [(code, line) for code, line, _, _ in found] == [("CG139", 21)], found
    _, _, col, message = found[0]
    assert col == 14 and name in message  # the `sql:` value's line and column
    # no allow_functions entry admits it
    allowed = row_file(sql, dialect, extra=f"    allow_functions: [{name.split('.')[-1]}]\n")
    again = findings(allowed)
    assert [c for c, *_ in again] == ["CG139"], again
    assert "no allow_functions entry" in again[0][3] or "advances a sequence" in again[0][3]


def test_a_function_no_list_names_needs_the_rows_allow_list() -> None:
    sql = "SELECT app.risk_score(holder) FROM policy"
    found = findings(row_file(sql))
    assert [c for c, *_ in found] == ["CG139"]
    assert "allow_functions" in found[0][3] and "(SQL line 1, column 8)" in found[0][3]
    assert findings(row_file(sql, extra="    allow_functions: [app.risk_score]\n")) == []


def test_plain_reads_keep_validating() -> None:
    for dialect, sql in (
            ("postgresql", "SELECT count(*), coalesce(max(policy_id), 0), lower(holder), "
                           "date_trunc('day', now()), to_char(now(), 'YYYY') FROM policy "
                           "GROUP BY holder"),
            ("mariadb", "SELECT ifnull(holder, ''), date_format(now(), '%Y'), "
                        "group_concat(holder) FROM policy"),
            ("oracle", "SELECT nvl(holder, 'x'), to_char(sysdate, 'YYYY') FROM policy")):
        assert findings(row_file(sql, dialect)) == [], (dialect, sql)


def test_into_outfile_is_refused() -> None:
    found = findings(row_file("SELECT holder FROM policy INTO OUTFILE '/tmp/x'", "mariadb"))
    assert "CG144" in {c for c, *_ in found}, found


def _peek_project(tmp_path: Path, url: URL, sql: str) -> Project:
    project = Project(tmp_path, url)
    dialect = "postgresql" if url.get_backend_name() == "postgresql" else "mariadb"
    (project.caps / "peek.yaml").write_text(row_file(sql, dialect))
    return project


def test_a_read_row_cannot_end_another_session(pg_url: URL, tmp_path: Path) -> None:
    """PostgreSQL: the row that killed a session is refused by validate and by call."""
    victim_engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    with victim_engine.connect() as victim:
        pid = victim.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        victim.execute(sa.text("SET application_name = 'server_files_victim'"))
        project = _peek_project(
            tmp_path, pg_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'server_files_victim'")
        checked = project.cli("validate")
        assert checked.code == 1 and "CG139" in checked.out and "peek.yaml:21:14" in checked.out
        ran = project.cli("call", "ops.peek", "--input", "{}", "--case", "K-1", "--json")
        assert ran.code != 0, ran.out
        assert "CG139" in ran.out
        # the victim is alive: its session answers
        assert victim.execute(sa.text("SELECT pg_backend_pid()")).scalar() == pid
    victim_engine.dispose()


def test_a_read_row_cannot_read_a_server_file(mariadb_url: URL, tmp_path: Path) -> None:
    """MariaDB: LOAD_FILE is refused before any session opens."""
    project = _peek_project(tmp_path, mariadb_url, "SELECT LOAD_FILE('/etc/hostname') AS f")
    checked = project.cli("validate")
    assert checked.code == 1 and "CG139" in checked.out and "load_file()" in checked.out
    ran = project.cli("call", "ops.peek", "--input", "{}", "--case", "F-1", "--json")
    assert ran.code != 0 and "CG139" in ran.out
    assert "evidence" not in ran.out


def test_an_allowed_function_runs(server_url: URL, tmp_path: Path) -> None:
    """A reviewed `allow_functions` entry lets a read call the project's own function."""
    project = Project(tmp_path, server_url)
    engine = sa.create_engine(server_url, poolclass=sa.pool.NullPool)
    postgres = server_url.get_backend_name() == "postgresql"
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE FUNCTION risk_score(n INTEGER) RETURNS INTEGER "
            + ("LANGUAGE sql IMMUTABLE AS 'SELECT $1 * 2'" if postgres
               else "DETERMINISTIC RETURN n * 2")))
    engine.dispose()
    dialect = "postgresql" if postgres else "mariadb"
    sql = "SELECT risk_score(policy_id) AS score FROM policy WHERE policy_id = 1"
    (project.caps / "peek.yaml").write_text(row_file(sql, dialect))
    assert project.cli("validate").code == 1
    (project.caps / "peek.yaml").write_text(
        row_file(sql, dialect, extra="    allow_functions: [risk_score]\n"))
    assert project.cli("validate").code == 0
    ran = project.cli("call", "ops.peek", "--input", "{}", "--case", "A-1", "--json")
    assert ran.code == 0, (ran.out, ran.err)
    assert ran.json()["evidence"]["rows"] == [[2]]
