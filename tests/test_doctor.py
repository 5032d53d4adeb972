"""``capgate doctor`` and the MCP server's start-up message: say what is wrong, and where."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.commands.doctor import run_doctor
from capgate.commands.project import init_project
from tests.fix_db import engine_params
from tests.test_init import capgate, clean_env, mcp_tools


def codes(report: object) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in report.findings:  # type: ignore[attr-defined]
        out.setdefault(f.code, []).append(f.message)
    return out


def test_doctor_is_happy_right_after_init(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    init_project(tmp_path / "proj")
    said = capgate(["doctor", "--json"], tmp_path / "proj", env)
    report = json.loads(said.stdout)
    assert report["ok"] and report["errors"] == 0
    subjects = {f["subject"] for f in report["findings"]}
    assert {"configuration", "grants", "capabilities", "identity claims-agent",
            "connector insurance", "connector insurance_code"} <= subjects


def test_doctor_names_bad_grants_roles_and_environments(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    init_project(proj)
    grants = proj / "grants.toml"
    grants.write_text(grants.read_text("utf-8").replace('connector = "insurance",',
                                                        'connector = "insurence",')
                      .replace('roles = ["dba"]', 'roles = ["dab"]'), "utf-8")
    config = proj / "capgate.toml"
    config.write_text(config.read_text("utf-8").replace('environment = "dev"',
                                                        'environment = "prod"'), "utf-8")
    report = run_doctor(config, {}, live=False)
    found = codes(report)
    assert not report.ok
    assert any("'insurence'" in m and "did you mean 'insurance'" in m for m in found["CG910"])
    assert any("'dab'" in m and "did you mean 'dba'" in m for m in found["CG911"])
    # the connector says prod, the grants cover dev: the agent gets no tool, and why
    assert any("0 tool(s) for 'claims-agent'" in m and "lists no tools" in m
               for m in found["CG912"])
    env = clean_env(tmp_path)
    said = capgate(["doctor"], proj, env, code=1)
    assert "ERROR CG910" in said.stdout and "FAILED:" in said.stdout


def test_doctor_finds_an_unreachable_connector_and_missing_tables(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    init_project(proj)
    config = proj / "capgate.toml"
    text = config.read_text("utf-8")
    head, _, code_part = text.partition("[connectors.insurance_code]")
    code_part = code_part.replace('url = "sqlite:///insurance.db"',
                                  'url = "postgresql://nobody@127.0.0.1:9/none"')
    config.write_text(head.replace('url = "sqlite:///insurance.db"', 'url = "sqlite:///blank.db"')
                      + "[connectors.insurance_code]" + code_part, "utf-8")
    sa.create_engine(f"sqlite:///{proj / 'blank.db'}").connect().close()
    report = run_doctor(config, {})
    found = codes(report)
    assert any("unreachable" in m for m in found["CG304"])
    # the write rows' connector needs capgate's tables; the DDL-only one never would
    missing = [f for f in report.findings if f.code == "CG305"]
    assert missing and {f.subject for f in missing} == {"connector insurance"}, missing
    assert any("capgate_landed is missing" in f.message for f in missing)


def test_mcp_says_how_many_tools_and_why_rows_are_hidden(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    proj = tmp_path / "proj"
    init_project(proj)
    config = proj / "capgate.toml"
    config.write_text(config.read_text("utf-8").replace('environment = "dev"',
                                                        'environment = "prod"', 1), "utf-8")
    errlog = tmp_path / "mcp.err"
    tools = mcp_tools(proj, env, errlog)
    said = errlog.read_text()
    assert f"{len(tools)} tool(s) for 'claims-agent'" in said
    assert "environment mismatch" in said or "no grant" in said
    assert "hidden policy.get@1: no grant: 'claims-agent' holds no read grant on 'insurance' " \
           "in 'prod'" in said


def _connect_as(config: Path, target: URL, user: str, password: str) -> None:
    """Point the project's connector at ``target`` as ``user`` instead of its owner."""
    text = config.read_text("utf-8")
    owner = target.render_as_string(hide_password=False)
    assert owner in text, text
    as_user = target.set(username=user, password=password).render_as_string(hide_password=False)
    config.write_text(text.replace(owner, as_user), "utf-8")


@pytest.mark.postgresql
def test_doctor_on_postgresql_limits_privileges_and_plpgsql_check(
        tmp_path: Path, pg_admin_url: URL) -> None:
    name = f"cg_doc_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex  # a server that checks passwords (a container) asks for one
    admin = sa.create_engine(pg_admin_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
        conn.execute(sa.text(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' CONNECTION LIMIT 2"))
    target = pg_admin_url.set(database=name)
    owner = sa.create_engine(target, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        init_project(tmp_path / "proj", target=target.render_as_string(hide_password=False),
                     example_schema=True)
        with owner.connect() as conn:
            conn.execute(sa.text(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {name}"))
        config = tmp_path / "proj" / "capgate.toml"
        _connect_as(config, target, name, password)
        found = codes(run_doctor(config, {}))
        assert any("CONNECTION LIMIT allows 2 session(s) but session_budget is 4" in m
                   for m in found["CG913"]), found
        assert any("lacks INSERT on policy_note" in m and "policy.add_note@1" in m
                   for m in found["CG914"]), found
        assert "CG915" not in found, found  # init created plpgsql_check (the server has it)
    finally:
        owner.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {name}"))
        admin.dispose()


@pytest.mark.mariadb
def test_doctor_on_mariadb_max_user_connections_and_privileges(
        tmp_path: Path, mariadb_url: URL) -> None:
    user = f"cg_doc_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    init_project(tmp_path / "proj", target=mariadb_url.render_as_string(hide_password=False),
                 example_schema=True)
    database = mariadb_url.database
    password = uuid.uuid4().hex
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}' "
                             f"WITH MAX_USER_CONNECTIONS 2"))
        conn.execute(sa.text(f"GRANT SELECT ON {database}.* TO '{user}'@'%'"))
    try:
        config = tmp_path / "proj" / "capgate.toml"
        _connect_as(config, mariadb_url, user, password)
        found = codes(run_doctor(config, {}))
        assert any("MAX_USER_CONNECTIONS allows 2 session(s)" in m or
                   "max_user_connections allows 2" in m for m in found["CG913"]), found
        assert any("lacks INSERT on policy_note" in m for m in found["CG914"])
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP USER '{user}'@'%'"))
        admin.dispose()


def test_doctor_warns_when_no_lock_pins_the_rows(tmp_path: Path) -> None:
    """CG134: without capabilities.lock a row edited in place runs unreviewed; drafts named."""
    proj = tmp_path / "proj"
    init_project(proj)
    config = proj / "capgate.toml"
    pinned = run_doctor(config, {}, live=False)
    assert "CG134" not in codes(pinned)
    assert any("every row is pinned" in m for m in codes(pinned)["OK"])

    caps = proj / "capabilities"
    lock = caps / "capabilities.lock"
    kept = lock.read_text("utf-8")
    lock.unlink()
    unlocked = run_doctor(config, {}, live=False)
    (warned,) = codes(unlocked)["CG134"]
    assert "no capabilities.lock" in warned and "edited in place" in warned
    assert unlocked.ok, "a warning, not an error"

    lock.write_text(kept, "utf-8")
    env = clean_env(tmp_path)
    capgate(["bump", "policy.add_note"], proj, env)
    draft = run_doctor(config, {}, live=False)
    (warned,) = codes(draft)["CG134"]
    assert "1 row(s) not pinned" in warned and "policy.add_note@2" in warned
    capgate(["lock"], proj, env)
    assert "CG134" not in codes(run_doctor(config, {}, live=False))


@pytest.mark.mariadb
def test_doctor_on_a_ddl_only_mariadb_project_reads_the_grants_of_its_role(
        tmp_path: Path, mariadb_url: URL) -> None:
    """A DDL-only project uses none of capgate's target tables, and privileges held through
    a role count: before, both were reported as errors (CG305 missing tables; CG914 'the DDL
    rows need CREATE ROUTINE and ALTER ROUTINE' although the role had them)."""
    from tests.ddl_support import Rig, row

    user = f"cg_ddl_{uuid.uuid4().hex[:8]}"
    database = mariadb_url.database
    admin = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text("CREATE FUNCTION f(x INT) RETURNS INT RETURN x + 1"))
        conn.execute(sa.text(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"))
        conn.execute(sa.text(f"CREATE ROLE {user}_role"))
        conn.execute(sa.text(f"GRANT CREATE ROUTINE, ALTER ROUTINE, EXECUTE, SELECT, CREATE VIEW, "
                             f"SHOW VIEW, DROP, TRIGGER ON `{database}`.* TO {user}_role"))
        conn.execute(sa.text(f"GRANT SELECT ON mysql.proc TO {user}_role"))
        conn.execute(sa.text(f"GRANT {user}_role TO '{user}'@'%'"))
        conn.execute(sa.text(f"SET DEFAULT ROLE {user}_role FOR '{user}'@'%'"))
    try:
        account = mariadb_url.set(username=user, password="pw")
        rig = Rig(tmp_path, {"code": (account, "dev")}, [row("code.f", [("function", "f")])])
        report = run_doctor(rig.config, {})
        found = codes(report)
        assert "CG305" not in found and "CG914" not in found, found
        assert any("DDL rows only" in m for m in found["OK"]), found
        assert any("DDL capture" in m and "are allowed" in m for m in found["OK"]), found
        with admin.connect() as conn:
            conn.execute(sa.text(f"REVOKE ALTER ROUTINE ON `{database}`.* FROM {user}_role"))
        found = codes(run_doctor(rig.config, {}))
        assert any("need ALTER ROUTINE" in m for m in found["CG914"]), found
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP USER IF EXISTS '{user}'@'%'"))
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {user}_role"))
        admin.dispose()


@pytest.mark.postgresql
def test_doctor_on_a_ddl_only_postgresql_project_needs_no_target_tables(
        tmp_path: Path, pg_url: URL) -> None:
    from tests.ddl_support import Rig, execute, row
    from tests.fix_db import ensure_plpgsql_check

    ensure_plpgsql_check(pg_url)
    execute(pg_url, "CREATE FUNCTION f(x int) RETURNS int LANGUAGE sql RETURN x + 1")
    rig = Rig(tmp_path, {"code": (pg_url, "dev")}, [row("code.f", [("function", "f")])])
    report = run_doctor(rig.config, {})
    found = codes(report)
    assert "CG305" not in found, found
    assert report.ok, report.text()


# --- least privilege (CG921) ---------------------------------------------------------------


@pytest.mark.parametrize("engine", engine_params("postgresql", "mariadb"))
def test_doctor_reports_an_over_privileged_account(engine: str, tmp_path: Path,
                                                   request: pytest.FixtureRequest) -> None:
    """A superuser (PostgreSQL) or an account with ALL / FILE / GRANT OPTION (MariaDB):
    a warning in dev, an error where the configuration marks the environment production."""
    from tests.server_support import Project

    url = request.getfixturevalue("pg_url" if engine == "postgresql" else "mariadb_url")
    project = Project(tmp_path, url)
    found = codes(run_doctor(project.config, {}))
    (said,) = found["CG921"]
    assert ("SUPERUSER" in said) if engine == "postgresql" else ("ALL PRIVILEGES" in said
                                                                 and "GRANT OPTION" in said)
    report = run_doctor(project.config, {})
    (finding,) = [f for f in report.findings if f.code == "CG921"]
    assert finding.severity == "warning" and "is not a production environment" in said
    project.config.write_text(project.config.read_text().replace('environment = "dev"',
                                                                 'environment = "prod"'))
    report = run_doctor(project.config, {})
    (finding,) = [f for f in report.findings if f.code == "CG921"]
    assert finding.severity == "error" and not report.ok
    # the configuration decides what production is
    project.config.write_text(project.config.read_text().replace(
        "[capgate]\n", '[capgate]\nproduction_environments = ["staging"]\n', 1))
    (finding,) = [f for f in run_doctor(project.config, {}).findings if f.code == "CG921"]
    assert finding.severity == "warning"


@pytest.mark.postgresql
def test_doctor_accepts_a_least_privileged_postgresql_role(pg_url: URL, tmp_path: Path) -> None:
    from tests.server_support import Project

    project = Project(tmp_path, pg_url, environment="prod")
    role = f"server_files_{uuid.uuid4().hex[:8]}"
    schema = str(pg_url.query["options"]).split("=", 1)[1]
    admin = sa.create_engine(pg_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{role}'"))
        conn.execute(sa.text(f"GRANT USAGE ON SCHEMA {schema} TO {role}"))
        conn.execute(sa.text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                             f"{schema} TO {role}"))
    try:
        # a server that checks passwords (a container) asks for one
        project.config.write_text(project.config.read_text().replace(
            pg_url.render_as_string(hide_password=False),
            pg_url.set(username=role, password=role).render_as_string(hide_password=False)))
        found = codes(run_doctor(project.config, {}))
        assert "CG921" not in found, found["CG921"]
        assert any("no privilege beyond tables" in m for m in found["OK"])
        with admin.connect() as conn:  # then one predefined role too many
            conn.execute(sa.text(f"GRANT pg_signal_backend TO {role}"))
        (said,) = codes(run_doctor(project.config, {}))["CG921"]
        assert "pg_signal_backend" in said and "terminate other roles' sessions" in said
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


@pytest.mark.mariadb
def test_doctor_accepts_a_least_privileged_mariadb_account(mariadb_url: URL,
                                                           tmp_path: Path) -> None:
    from tests.server_support import Project

    project = Project(tmp_path, mariadb_url, environment="prod")
    user = f"server_files_{uuid.uuid4().hex[:8]}"
    database = mariadb_url.database
    admin = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{user}'"))
        conn.execute(sa.text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {database}.* TO "
                             f"'{user}'@'%'"))
    try:
        project.config.write_text(project.config.read_text().replace(
            mariadb_url.render_as_string(hide_password=False),
            mariadb_url.set(username=user, password=user).render_as_string(hide_password=False)))
        found = codes(run_doctor(project.config, {}))
        assert "CG921" not in found, found["CG921"]
        with admin.begin() as conn:
            conn.execute(sa.text(f"GRANT FILE ON *.* TO '{user}'@'%'"))
        (said,) = codes(run_doctor(project.config, {}))["CG921"]
        assert "FILE on *.*" in said
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP USER '{user}'@'%'"))


@pytest.mark.postgresql
def test_a_fresh_init_on_postgresql_is_green_and_plpgsql_check_is_made(
        tmp_path: Path, pg_admin_url: URL) -> None:
    """`capgate init --target --example-schema` on a new PostgreSQL database: init creates
    plpgsql_check (the server has the package), so doctor passes; without the extension
    the DDL rows are reported unverifiable -- a warning with the command to run, never a
    failed first run.  (Doctor used to fail such a project with CG915.)"""
    name = f"cg_init_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_admin_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    target = pg_admin_url.set(database=name)
    owner = sa.create_engine(target, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with owner.connect() as conn:
            available = conn.execute(sa.text(
                "SELECT 1 FROM pg_available_extensions WHERE name = 'plpgsql_check'")).first()
        if available is None:
            pytest.skip("this server has no plpgsql_check package (scripts/"
                        "install-test-extensions installs it)")
        made = init_project(tmp_path / "proj", target=target.render_as_string(
            hide_password=False), example_schema=True)
        assert made.ddl_checks is None
        with owner.connect() as conn:
            assert conn.execute(sa.text("SELECT 1 FROM pg_extension "
                                        "WHERE extname = 'plpgsql_check'")).first()
        config = tmp_path / "proj" / "capgate.toml"
        report = run_doctor(config, {})
        assert "CG915" not in codes(report), report.text()
        with owner.connect() as conn:
            conn.execute(sa.text("DROP EXTENSION plpgsql_check"))
        report = run_doctor(config, {})
        warned = [f for f in report.findings if f.code == "CG915"]
        # a warning, never an error: a first run is not failed for it
        assert warned and {f.severity for f in warned} == {"warning"}, report.text()
        assert any("unverifiable" in f.message and "code.premium_due_total" in f.message
                   and "CREATE EXTENSION plpgsql_check" in f.message for f in warned), warned
    finally:
        owner.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
