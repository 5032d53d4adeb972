"""Issue 15 through the gated path (rows, configuration, ledger, ``capgate ddl plan``).

PostgreSQL: the base of a plan after A -> B -> A and after capgate's own apply;
a checker false positive declared on the row (``ddl.accepted_warnings``); remote
dependents found on the far side of a ``postgres_fdw`` foreign server named by
the row's ``ddl.far_side``, refused (CG504) until the row names a far-side step.
Each test failed on the code before issue 15.
"""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.api import open as open_executor
from capgate.cli import main
from capgate.ddl.service import DdlService
from capgate.registry.errors import CapgateError
from tests.fix_capgate import KEYS, approval_key_line, approver_key_file
from tests.fix_db import ensure_plpgsql_check

pytestmark = pytest.mark.postgresql

PREMIUM_V1 = """CREATE OR REPLACE FUNCTION premium(x numeric) RETURNS numeric
LANGUAGE plpgsql AS $$
BEGIN
  RETURN x * 1.10;
END $$;
"""
TMP_V1 = """CREATE OR REPLACE FUNCTION tmp_report() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE n bigint;
BEGIN
  CREATE TEMP TABLE IF NOT EXISTS tmp_totals AS SELECT id FROM pol;
  SELECT count(*) INTO n FROM tmp_totals;
  RETURN n;
END $$;
"""
SCHEMA = PREMIUM_V1 + TMP_V1 + """
CREATE TABLE pol (id int PRIMARY KEY, base numeric NOT NULL);
INSERT INTO pol VALUES (1, 100), (2, 200);
CREATE VIEW v_base AS SELECT id, base FROM pol;
"""
GRANTS = f"""\
[principals.agent]
grants = [{{ connector = "*", environments = ["dev"], access = "write" }}]

[principals.bob]
roles = ["dba"]
{approval_key_line("bob")}
"""
ROW = """\
  - operation_id: {op}
    version: 1
    connector: code
    description: test row
    input:
      type: object
      additionalProperties: false
      required: [source]
      properties:
        source: {{type: string}}
    target: {{system: s, object: o}}
    effect_class: ddl
    authorization: {{kind: gate, approver_roles: [dba]}}
    environments: [dev]
    timeout: {{seconds: 60, lock_seconds: 5, on_timeout: unknown}}
    recovery: reconcile_first
    ddl:
      objects:
        - {{type: {kind}, name: {name}}}
{extra}"""


def execute(url: URL, sql: str) -> None:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        conn.exec_driver_sql(sql, execution_options={"no_parameters": True})
    eng.dispose()


def setup_config(tmp: Path, url: URL, rows: list[str], far: URL | None = None) -> Path:
    caps = tmp / "caps"
    caps.mkdir(exist_ok=True)
    (caps / "rows.yaml").write_text(
        "format: 1\nconnectors:\n  code:\n    description: code\n    dialects: [postgresql]\n"
        "  far:\n    description: the far side\n    dialects: [postgresql]\nrows:\n"
        + "".join(rows))
    (tmp / "grants.toml").write_text(GRANTS)
    conns = {"code": url, "far": far or url}
    sections = "".join(
        f'\n[connectors.{n}]\nurl = {json.dumps(u.render_as_string(hide_password=False))}\n'
        'environment = "dev"\n' for n, u in conns.items())
    (tmp / "capgate.toml").write_text(textwrap.dedent(f"""\
        [capgate]
        capabilities = [{json.dumps(str(caps))}]
        grants = "grants.toml"
        ledger = "sqlite:///{tmp / 'ledger.db'}"
        """) + sections)
    return tmp / "capgate.toml"


@pytest.fixture
def target(pg_url: URL) -> URL:
    ensure_plpgsql_check(pg_url)
    execute(pg_url, SCHEMA)
    return pg_url


def schema_of(url: URL) -> str:
    return str(url.query["options"]).split("=", 1)[1]


# --- 4, 5. the base of a plan ----------


def test_a_to_b_to_a_plans_against_a_again(target: URL, tmp_path: Path) -> None:
    config = setup_config(tmp_path, target, [ROW.format(op="code.premium", kind="function",
                                                        name="premium", extra="")])
    with open_executor(config) as executor:
        svc = DdlService(executor)
        (a,) = svc.capture("code", ["function:premium"])
        execute(target, PREMIUM_V1.replace("1.10", "1.50"))  # somebody saves B ...
        (b,) = svc.capture("code", ["function:premium"])
        execute(target, PREMIUM_V1)  # ... and puts A back
        plan = svc.plan("code.premium", [PREMIUM_V1.replace("1.10", "1.20")], case="AB",
                        who="agent")
        assert plan.objects[0]["base_snapshot_id"] == a.id != b.id


def test_capgates_own_apply_is_the_base_of_the_next_plan(target: URL, tmp_path: Path) -> None:
    config = setup_config(tmp_path, target, [ROW.format(op="code.premium", kind="function",
                                                        name="premium", extra="")])
    with open_executor(config) as executor:
        svc = DdlService(executor)
        svc.capture("code", ["function:premium"])
        plan = svc.plan("code.premium", [PREMIUM_V1.replace("1.10", "1.20")], case="C1",
                        who="agent")
        executor.approve(plan.plan_hash, by="bob", role="dba", key=KEYS["bob"])
        outcome, result = svc.apply(plan.plan_hash, case="C1", who="agent")
        assert outcome.status == "applied_verified"
        plan2 = svc.plan("code.premium", [PREMIUM_V1.replace("1.10", "1.30")], case="C2",
                         who="agent")
        assert result is not None
        assert plan2.objects[0]["base_snapshot_id"] == result.new_bases[
            plan.objects[0]["key"]]


# --- 7. a checker false positive declared on the row ----------


def test_a_false_positive_declared_on_the_row_lets_the_change_through(target: URL,
                                                                     tmp_path: Path) -> None:
    extra = ("      accepted_warnings:\n"
             "        - object: function:tmp_report\n"
             "          message: 'relation \"tmp_totals\" does not exist'\n"
             "          reason: the function creates tmp_totals itself at run time\n")
    config = setup_config(tmp_path, target, [ROW.format(op="code.tmp", kind="function",
                                                        name="tmp_report", extra=extra)])
    with open_executor(config) as executor:
        svc = DdlService(executor)
        new = TMP_V1.replace("DECLARE n bigint;", "DECLARE n bigint;  -- rows")
        plan = svc.plan("code.tmp", [new], case="T1", who="agent")
        assert any("accepted on the row (the function creates tmp_totals" in w
                   for w in plan.warnings)
        executor.approve(plan.plan_hash, by="bob", role="dba", key=KEYS["bob"])
        outcome, _ = svc.apply(plan.plan_hash, case="T1", who="agent")
        assert outcome.status == "applied_verified", outcome.to_dict()


# --- 17. remote dependents through the gated path ----------


@pytest.fixture
def far(target: URL, pg_admin_url: URL) -> Iterator[tuple[URL, str]]:
    """A far database place whose postgres_fdw foreign table reads our view ``v_base``."""
    schema = f"cgt_far_{uuid.uuid4().hex[:10]}"
    server = f"cgsrv_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_admin_url, poolclass=sa.pool.NullPool,
                             isolation_level="AUTOCOMMIT")
    u = pg_admin_url
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_advisory_lock(hashtext('capgate:postgres_fdw'))"))
        conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS postgres_fdw SCHEMA public")
        conn.execute(sa.text("SELECT pg_advisory_unlock(hashtext('capgate:postgres_fdw'))"))
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        # The server reaches itself where it accepted us, as it sees it: inside a
        # container the published host port means nothing, the server's own does.
        addr, port = conn.execute(sa.text(
            "SELECT host(inet_server_addr()), inet_server_port()")).one()
        conn.exec_driver_sql(
            f"CREATE SERVER {server} FOREIGN DATA WRAPPER postgres_fdw OPTIONS (host "
            f"'{addr or u.host or '127.0.0.1'}', port '{port or u.port or 5432}', "
            f"dbname '{u.database}')")
        password = f", password '{u.password}'" if u.password else ""
        conn.exec_driver_sql(f"CREATE USER MAPPING FOR CURRENT_USER SERVER {server} "
                             f"OPTIONS (user '{u.username or 'postgres'}'{password})")
        conn.exec_driver_sql(
            f'CREATE FOREIGN TABLE "{schema}".ft_base (id int, base numeric) SERVER {server} '
            f"OPTIONS (schema_name '{schema_of(target)}', table_name 'v_base')")
    try:
        yield pg_admin_url.set(query={"options": f"-csearch_path={schema}"}), server
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.exec_driver_sql(f"DROP SERVER IF EXISTS {server} CASCADE")
        admin.dispose()


def run_cli(config: Path, *argv: str) -> tuple[int, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*argv, "--json", "--config", str(config)])
    return code, json.loads(out.getvalue()) if out.getvalue().strip() else None


def test_remote_dependents_are_found_and_need_a_far_side_step(
        target: URL, far: tuple[URL, str], tmp_path: Path) -> None:
    far_url, server = far
    far_schema = schema_of(far_url)
    no_step = f"      far_side:\n        - {{connector: far, link: {server}}}\n"
    with_step = (f"      far_side:\n        - connector: far\n          link: {server}\n"
                 "          steps:\n            - name: foreign table still reads\n"
                 f"              dependent: foreign_table:{far_schema}.ft_base\n"
                 "              assertion: SELECT count(*) FROM ft_base\n"
                 "              expect: 2\n")
    config = setup_config(tmp_path, target, [
        ROW.format(op="code.view", kind="view", name="v_base", extra=no_step),
        ROW.format(op="code.view_far", kind="view", name="v_base", extra=with_step),
    ], far=far_url)
    (tmp_path / "v.sql").write_text(
        "CREATE OR REPLACE VIEW v_base AS SELECT id, base FROM pol WHERE base > 0\n")
    code, err = run_cli(config, "ddl", "plan", str(tmp_path / "v.sql"), "--operation",
                        "code.view", "--case", "R1", "--as", "agent")
    assert code == 1 and err["code"] == "CG504", err
    (finding,) = err["details"]["findings"]
    assert finding["details"]["dependent"] == f"foreign_table:{far_schema}.ft_base@{server}"

    code, plan = run_cli(config, "ddl", "plan", str(tmp_path / "v.sql"), "--operation",
                         "code.view_far", "--case", "R2", "--as", "agent")
    assert code == 0, plan
    assert [s["name"] for s in plan["far_side_steps"]] == ["foreign table still reads"]
    assert run_cli(config, "approve", plan["plan_hash"], "--by", "bob", "--role", "dba",
                   "--key", str(approver_key_file("bob")))[0] == 0
    code, applied = run_cli(config, "ddl", "apply", plan["plan_hash"], "--case", "R2",
                            "--as", "agent")
    assert code == 0 and applied["status"] == "applied_verified", applied
    far_checks = [c for c in applied["evidence"]["verify"]["checks"]
                  if c["name"].startswith("far_side:")]
    assert far_checks and far_checks[0]["verdict"] == "passed"


def test_unknown_row_keys_still_fail(tmp_path: Path, target: URL) -> None:
    """Guard: the new ddl fields are the only new keys; a typo is still an error."""
    bad = ROW.format(op="code.x", kind="function", name="premium",
                     extra="      accepted_warning: []\n")
    config = setup_config(tmp_path, target, [bad])
    with pytest.raises(CapgateError), open_executor(config) as executor:
        executor.registry.resolve("code.x", 1)
