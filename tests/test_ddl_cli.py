"""``capgate ddl`` end to end, through real subprocesses, on real databases.

PostgreSQL (with plpgsql_check): the shipped row ``code.premium_due_total``
changes a function that a view, a PL/pgSQL function and a SQL-standard
function depend on.  MariaDB in ``sql_mode=ORACLE``: a package spec and body
under a row written for the test.  Each walks capture -> plan -> approve ->
apply -> verify -> compensate, asserts the ledger events of the intent, and
ends with ``capgate ledger verify``.  Also: an apply without approval (exit 4),
objects outside the row's scope (CG526), prohibitions (CG502, CG503).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.cli import main
from capgate.ddl.sqltext import strip_terminator
from capgate.sqlfiles import apply_schema
from tests.fix_capgate import approval_key_line, approver_key_file, install_target
from tests.fix_db import ensure_plpgsql_check

REPO = Path(__file__).resolve().parents[1]
BOB_KEY = str(approver_key_file("bob"))

GRANTS_TOML = f"""\
[principals.agent]
grants = [{{ connector = "*", environments = ["dev"], access = "write" }}]

[principals.bob]
roles = ["dba"]
{approval_key_line("bob")}

[principals.alice]
roles = ["dba"]
{approval_key_line("alice")}
grants = [{{ connector = "*", environments = ["dev"], access = "write" }}]

[principals.reader]
grants = [{{ connector = "*", environments = ["dev"], access = "read" }}]
"""

# -- PostgreSQL: a function with dependent views and functions ------------------------------------

PG_DEPENDENTS = """
CREATE VIEW dunning_list AS
SELECT policy_id, holder, premium_due_total(policy_id) AS due FROM policy
WHERE premium_due_total(policy_id) > 0;
CREATE FUNCTION dunning_total() RETURNS numeric LANGUAGE plpgsql AS $$
DECLARE t numeric;
BEGIN
  SELECT sum(premium_due_total(policy_id)) INTO t FROM policy;
  RETURN t;
END $$;
CREATE FUNCTION due_with_fee(p integer) RETURNS numeric LANGUAGE sql
BEGIN ATOMIC SELECT premium_due_total(p) + 5; END;
"""
PG_NEW = """\
CREATE OR REPLACE FUNCTION premium_due_total(p_policy_id INTEGER) RETURNS NUMERIC(12,2)
LANGUAGE SQL
RETURN (SELECT COALESCE(SUM(r.amount), 0)
        FROM premium r JOIN policy p ON p.policy_id = r.policy_id
        WHERE r.policy_id = p_policy_id AND r.paid = 0 AND p.status <> 'void');
"""

# -- MariaDB: a package spec and body -------------------------------------------------------------

BILLING_ROW = """\
format: 1
connectors:
  billing_code:
    description: stored code of the billing back office (MariaDB, sql_mode=ORACLE)
    dialects: [mariadb]
rows:
  - operation_id: code.billing
    version: 1
    connector: billing_code
    description: >
      Replace the billing package (spec and body) that computes premiums.
    input:
      type: object
      additionalProperties: false
      required: [source]
      properties:
        source: {type: string, minLength: 1, maxLength: 100000}
    target: {system: billing, object: billing}
    effect_class: ddl
    authorization:
      kind: gate
      approver_roles: [dba]
      four_eyes: true
    environments: [dev]
    timeout: {seconds: 60, lock_seconds: 10, on_timeout: unknown}
    recovery: reconcile_first
    ddl:
      objects:
        - {type: package, name: billing}
        - {type: package_body, name: billing}
"""
SPEC_V1 = """CREATE OR REPLACE PACKAGE billing AS
  FUNCTION premium(base INT) RETURN INT;
  PROCEDURE bump;
END billing;
"""
BODY_V1 = """CREATE OR REPLACE PACKAGE BODY billing AS
  calls INT := 0;
  FUNCTION premium(base INT) RETURN INT AS
  BEGIN
    RETURN base + 10;
  END;
  PROCEDURE bump AS
  BEGIN
    calls := calls + 1;
  END;
END billing;
"""
SPEC_V2 = SPEC_V1.replace("  PROCEDURE bump;\n",
                          "  PROCEDURE bump;\n  FUNCTION discount(base INT) RETURN INT;\n")
BODY_V2 = BODY_V1.replace("RETURN base + 10;", "RETURN base + 20;").replace(
    "END billing;",
    "  FUNCTION discount(base INT) RETURN INT AS\n  BEGIN\n    RETURN base - 10;\n  END;\n"
    "END billing;",
)
MARIADB_SETUP = [
    "CREATE TABLE pol (id INT PRIMARY KEY, base INT NOT NULL)",
    "INSERT INTO pol VALUES (1, 100), (2, 200)",
    SPEC_V1,
    BODY_V1,
    "CREATE VIEW v_prem AS SELECT id, billing.premium(base) AS p FROM pol",
    "CREATE FUNCTION doubled(x INT) RETURN INT AS BEGIN RETURN billing.premium(x) * 2; END;",
]
SMOKE = json.dumps({"name": "premium of 100", "sql": "SELECT billing.premium(100)",
                    "expect": 120, "session": {"sql_mode": "ORACLE"}})

APPLY_EVENTS_TRANSACTIONAL = ["prepared", "ddl.preflight", "ddl_apply_started",
                              "ddl.object_applied", "ddl.verified", "ddl.committed",
                              "ddl.captured", "ddl.outcome", "observed"]
COMPENSATE_EVENTS = ["ddl_compensation_requested", "ddl.compensation_started",
                     "ddl.compensated", "observed"]


# --- helpers --------------------------------------------------------------------------------------

Cli = Callable[..., Any]



def run_sql(url: URL, statements: Sequence[str], mode: str | None = None) -> None:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with eng.connect() as conn:
        if mode is not None:
            conn.execute(sa.text("SET SESSION sql_mode = :m"), {"m": mode})
        for stmt in statements:
            conn.exec_driver_sql(strip_terminator(stmt), execution_options={"no_parameters": True})
    eng.dispose()


def scalar(url: URL, sql: str, mode: str | None = None) -> Any:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        if mode is not None:
            conn.execute(sa.text("SET SESSION sql_mode = :m"), {"m": mode})
        value = conn.execute(sa.text(sql)).scalar()
    eng.dispose()
    return value


def make_cli(tmp_path: Path, connectors: Sequence[str], url: URL, capabilities: Path,
             *, subprocesses: bool = True, ledger: URL | None = None) -> Cli:
    """Write capgate.toml + grants.toml; return ``cli(*argv, rc=0)`` -> parsed --json output.

    Each call is a ``python -m capgate`` child process, or (``subprocesses=False``,
    for the refusals) ``capgate.cli.main`` in this process.
    """
    (tmp_path / "grants.toml").write_text(GRANTS_TOML)
    target = json.dumps(url.render_as_string(hide_password=False))
    ledger_url = json.dumps(ledger.render_as_string(hide_password=False) if ledger
                            else "sqlite:///.capgate/ledger.db")
    sections = "".join(f'\n[connectors.{c}]\nurl = {target}\nenvironment = "dev"\n'
                       for c in connectors)
    (tmp_path / "capgate.toml").write_text(textwrap.dedent(f"""\
        [capgate]
        capabilities = [{json.dumps(str(capabilities))}]
        grants = "grants.toml"
        ledger = {ledger_url}
        """) + sections)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env["CAPGATE_CONFIG"] = str(tmp_path / "capgate.toml")
    env["PYTHONPATH"] = str(REPO)

    def cli(*argv: str, rc: int = 0, env_extra: dict[str, str] | None = None) -> Any:
        if subprocesses:
            done = subprocess.run([sys.executable, "-m", "capgate", *argv, "--json"],
                                  cwd=tmp_path, env={**env, **(env_extra or {})},
                                  capture_output=True, text=True, timeout=120, check=False)
            code, out, err = done.returncode, done.stdout, done.stderr
        else:
            out_buf, err_buf = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
                code = main([*argv, "--json", "--config", env["CAPGATE_CONFIG"]])
            out, err = out_buf.getvalue(), err_buf.getvalue()
        assert code == rc, (argv, code, out, err)
        return json.loads(out) if out.strip() else None

    return cli


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


# --- PostgreSQL ----------------------------------------------------------------------------------


def pg_target(url: URL) -> None:
    ensure_plpgsql_check(url)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        apply_schema(engine)
        install_target(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql(PG_DEPENDENTS, execution_options={"no_parameters": True})
    finally:
        engine.dispose()


@pytest.fixture
def pg_cli(pg_url: URL, tmp_path: Path) -> tuple[Cli, URL, Path]:
    pg_target(pg_url)
    cli = make_cli(tmp_path, ["insurance_code"], pg_url, REPO / "capabilities")
    return cli, pg_url, tmp_path


@pytest.fixture
def pg_cli_inproc(pg_url: URL, tmp_path: Path) -> tuple[Cli, URL, Path]:
    pg_target(pg_url)
    cli = make_cli(tmp_path, ["insurance", "insurance_code"], pg_url, REPO / "capabilities",
                   subprocesses=False)
    return cli, pg_url, tmp_path


def live_signature(url: URL, obj: str) -> str:
    from capgate.ddl.catalog import ObjectRef, adapter_for
    from capgate.ddl.signature import sign

    adapter = adapter_for(url)
    eng = adapter.engine(url)
    try:
        with eng.connect() as conn:
            live = adapter.read(conn, adapter.resolve(conn, ObjectRef.parse(obj)))
            assert live is not None
            return str(sign(adapter.signed_text(live.object, live.source, live.attributes)))
    finally:
        eng.dispose()


@pytest.mark.postgresql
def test_pg_capture_plan_approve_apply_verify_compensate(pg_cli: tuple[Cli, URL, Path]) -> None:
    cli, url, tmp = pg_cli
    fn = "function:premium_due_total"
    before_due = scalar(url, "SELECT premium_due_total(9)")
    assert before_due > 0  # policy 9 is void but has unpaid instalments

    (captured,) = cli("ddl", "capture", fn, "--connector", "insurance_code")
    assert captured["exists"] and captured["signature"].startswith("v2:sha256:")
    base_id, base_sig = captured["snapshot_id"], captured["signature"]

    (tmp / "premium_due_total.sql").write_text(PG_NEW)
    plan = cli("ddl", "plan", "premium_due_total.sql", "--operation", "code.premium_due_total",
               "--case", "CHG-1", "--as", "agent")
    h = plan["plan_hash"]
    assert (plan["operation_id"], plan["version"], plan["connector"]) == (
        "code.premium_due_total", 1, "insurance_code")
    (obj,) = plan["objects"]
    assert obj["base_snapshot_id"] == base_id  # the captured snapshot is the base
    deps = {d["key"].split(".", 1)[1]: d["via"] for d in plan["dependents"]}
    assert deps == {"dunning_list": "pg_depend", "due_with_fee(integer)": "pg_depend",
                    "dunning_total()": "plpgsql_check"}
    assert all(p["passed"] for p in plan["prohibitions"])
    assert scalar(url, "SELECT premium_due_total(9)") == before_due  # no DDL committed
    # the approver's text names the changed blocks with their lines, never a bare count
    from capgate.ddl.plan import DdlPlan
    from capgate.handlers.ddl import _plan_text

    text = _plan_text(DdlPlan.from_dict(plan))
    first = obj["changed_blocks"][0]
    assert f"#{first['block']} lines {first['lines'][0]}-{first['lines'][1]}" in text, text
    assert "(blocks: none changed)" not in text

    # no approval yet: refused with exit 4, nothing recorded for an intent
    refused = cli("ddl", "apply", h, "--case", "CHG-1", "--as", "agent", rc=4)
    assert refused["code"] == "CG201"
    # four eyes: bob (dba), not the requester, approves -- with the usual command
    approved = cli("approve", h, "--by", "bob", "--role", "dba", "--key", BOB_KEY)
    assert approved["operation_id"] == "code.premium_due_total"

    applied = cli("ddl", "apply", h, "--case", "CHG-1", "--as", "agent")
    assert applied["status"] == "applied_verified", applied
    intent = applied["intent_id"]
    ev = applied["evidence"]
    assert ev["objects"][0]["applied_signature"] == obj["expected_signature"]
    assert {c["object"].split(".", 1)[1] for c in ev["verify"]["checks"]
            if c["name"] == "dependent"} == set(deps)
    assert scalar(url, "SELECT premium_due_total(9)") == 0

    verified = cli("ddl", "verify", fn, "--connector", "insurance_code")
    assert verified["passed"]
    assert [c["name"] for c in verified["checks"]] == ["compile"] + ["dependent"] * 3
    assert obj["expected_signature"] in verified["checks"][0]["detail"]

    comp = cli("ddl", "compensate", intent, "--case", "CHG-1", "--as", "agent")
    assert comp["outcome"] == "compensated" and comp["before"]["classification"] == "applied"
    assert scalar(url, "SELECT premium_due_total(9)") == before_due
    assert live_signature(url, fn) == base_sig

    shown = cli("ledger", "show", "CHG-1")
    events = [e for e in shown["events"] if e["intent_id"] == intent]
    assert kinds(events) == APPLY_EVENTS_TRANSACTIONAL + COMPENSATE_EVENTS
    prepared = events[0]["payload"]
    assert prepared["state"]["plan_hash"] == h
    assert prepared["state"]["snapshot_ids"] == {obj["key"]: base_id}
    assert prepared["state"]["row_hash"] == plan["row_hash"]
    assert events[2]["payload"]["snapshot_ids"] == [base_id]
    assert events[8]["payload"]["outcome"]["status"] == "applied_verified"
    assert events[-1]["payload"]["outcome"]["status"] == "compensated"
    assert kinds(shown["events"])[:2] == ["ddl.planned", "approval_recorded"]
    assert shown["intents"][intent]["status"] == "observed"
    assert intent not in shown["snapshot"]["intents"]  # format 2: the snapshot holds open ones
    report = cli("ledger", "verify")
    assert report["ok"] and report["findings"] == []


@pytest.mark.postgresql
def test_pg_replay_plan_verify_snapshots_export(pg_cli_inproc: tuple[Cli, URL, Path]) -> None:
    cli, _, tmp = pg_cli_inproc
    fn = "function:premium_due_total"
    (captured,) = cli("ddl", "capture", fn, "--connector", "insurance_code")
    (tmp / "new.sql").write_text(PG_NEW)
    h = cli("ddl", "plan", str(tmp / "new.sql"), "--operation", "code.premium_due_total",
            "--case", "CHG-3", "--as", "agent")["plan_hash"]
    assert cli("ddl", "apply", h, "--case", "CHG-4", "--as", "agent", rc=1)["code"] == "CG302"
    cli("approve", h, "--by", "alice", "--role", "dba", "--key", str(approver_key_file("alice")))
    # the plan is agent's: nobody else applies it (not even the approver); bob holds no
    # write grant at all
    assert cli("ddl", "apply", h, "--case", "CHG-3", "--as", "alice", rc=4)["code"] == "CG204"
    assert cli("ddl", "apply", h, "--case", "CHG-3", "--as", "bob", rc=1)["code"] == "CG200"
    applied = cli("ddl", "apply", h, "--case", "CHG-3", "--as", "agent")
    # the same plan again in the same case: the recorded outcome, nothing executed
    again = cli("ddl", "apply", h, "--case", "CHG-3", "--as", "agent")
    assert again["replayed"] and again["intent_id"] == applied["intent_id"]
    checked = cli("ddl", "verify", "--plan", h)
    assert checked["passed"] and {c["name"] for c in checked["checks"]} == {
        "compile", "landed", "dependent"}
    # the approval was single use; the plan cannot be approved into a second apply
    cli("ddl", "compensate", applied["intent_id"], "--case", "CHG-3", "--as", "agent")
    assert cli("ddl", "apply", h, "--case", "CHG-3", "--as", "agent", rc=4)["code"] == "CG203"
    # nothing left to compensate
    err = cli("ddl", "compensate", applied["intent_id"], "--case", "CHG-3", "--as", "agent",
              rc=1)
    assert "nothing to compensate" in err["message"]
    snaps = cli("ddl", "snapshots", fn, "--connector", "insurance_code")
    # the capture, then what capgate applied (recorded as the next plan's base)
    applied_base = applied["evidence"]["new_bases"][checked["checks"][0]["object"]]
    assert [s["snapshot_id"] for s in snaps] == [captured["snapshot_id"], applied_base]
    exported = cli("ddl", "export", str(tmp / "mirror"))
    assert "index.json" in exported["written"]
    index = json.loads((tmp / "mirror" / "index.json").read_text())
    assert [s["snapshot_id"] for s in index["snapshots"]] == [captured["snapshot_id"],
                                                              applied_base]
    paths = [p for p in exported["written"] if p.endswith(".sql")]
    assert len(paths) == 2
    assert all((tmp / "mirror" / p).read_text().startswith("CREATE OR REPLACE FUNCTION")
               for p in paths)
    assert cli("ddl", "export", str(tmp / "mirror"))["written"] == []  # content addressed
    codes = [p["code"] for p in cli("ddl", "prohibitions")]
    assert codes == ["CG501", "CG502", "CG503", "CG504", "CG505", "CG506"]
    assert cli("ledger", "verify")["ok"]


@pytest.mark.postgresql
def test_pg_objects_outside_the_rows_scope_are_refused(
        pg_cli_inproc: tuple[Cli, URL, Path]) -> None:
    cli, url, tmp = pg_cli_inproc
    other = ("CREATE OR REPLACE FUNCTION dunning_total() RETURNS numeric LANGUAGE sql "
             "RETURN 0;\n")
    (tmp / "other.sql").write_text(other)
    err = cli("ddl", "plan", str(tmp / "other.sql"), "--operation", "code.premium_due_total",
              "--case", "CHG-2", "--as", "agent", rc=1)
    assert err["code"] == "CG526" and err["details"]["object"] == "function:dunning_total"
    # a view the row names, but in another schema
    (tmp / "elsewhere.sql").write_text("CREATE OR REPLACE VIEW public.policy_overview AS "
                                       "SELECT 1 AS policy_id;\n")
    err = cli("ddl", "plan", str(tmp / "elsewhere.sql"), "--operation", "code.policy_overview",
              "--case", "CHG-2", "--as", "agent", rc=1)
    assert err["code"] == "CG526" and "schema public" in err["message"]
    # a function source under the view's row
    (tmp / "fn.sql").write_text(PG_NEW)
    err = cli("ddl", "plan", str(tmp / "fn.sql"), "--operation", "code.policy_overview",
              "--case", "CHG-2", "--as", "agent", rc=1)
    assert err["code"] == "CG526"
    # a schema-wide recompile request is a prohibition, recorded in the case
    err = cli("ddl", "plan", str(tmp / "fn.sql"), "--operation", "code.premium_due_total",
              "--case", "CHG-2", "--as", "agent", "--recompile", "*", rc=1)
    assert err["code"] == "CG503"
    assert "ddl.refused" in kinds(cli("ledger", "show", "CHG-2")["events"])
    # a reader cannot plan a DDL change; a non-ddl row is not planned here
    err = cli("ddl", "plan", str(tmp / "fn.sql"), "--operation", "code.premium_due_total",
              "--case", "CHG-2", "--as", "reader", rc=1)
    assert err["code"] == "CG200"
    err = cli("ddl", "plan", str(tmp / "fn.sql"), "--operation", "policy.add_note",
              "--case", "CHG-2", "--as", "agent", rc=2)
    assert err["code"] == "CG900"
    assert scalar(url, "SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
                       "WHERE p.proname = 'dunning_total' "
                       "AND p.pronamespace = current_schema()::regnamespace") == "plpgsql"
    assert cli("ledger", "verify")["ok"]


# --- MariaDB in Oracle mode ----------------------------------------------------------------------


@pytest.fixture
def maria_cli(mariadb_url: URL, tmp_path: Path) -> tuple[Cli, URL, Path]:
    run_sql(mariadb_url, MARIADB_SETUP, mode="ORACLE")
    caps = tmp_path / "caps"
    caps.mkdir()
    (caps / "billing.yaml").write_text(BILLING_ROW)
    return make_cli(tmp_path, ["billing_code"], mariadb_url, caps), mariadb_url, tmp_path


@pytest.mark.mariadb
def test_mariadb_package_spec_and_body_loop(maria_cli: tuple[Cli, URL, Path]) -> None:
    cli, url, tmp = maria_cli
    spec, body = cli("ddl", "capture", "package:billing", "package_body:billing",
                     "--connector", "billing_code")
    assert spec["attributes"]["sql_mode"].split(",").count("ORACLE") == 1

    (tmp / "spec.sql").write_text(SPEC_V2)
    (tmp / "body.sql").write_text(BODY_V2)
    plan = cli("ddl", "plan", "spec.sql", "body.sql", "--operation", "code.billing",
               "--case", "PKG-1", "--as", "agent", "--smoke", SMOKE)
    h = plan["plan_hash"]
    assert [o["base_snapshot_id"] for o in plan["objects"]] == [spec["snapshot_id"],
                                                                 body["snapshot_id"]]
    assert not plan["transactional_ddl"]
    assert any("holds state" in w for w in plan["warnings"])
    assert scalar(url, "SELECT billing.premium(100)", "ORACLE") == 110

    cli("approve", h, "--by", "bob", "--role", "dba", "--key", BOB_KEY)
    applied = cli("ddl", "apply", h, "--case", "PKG-1", "--as", "agent")
    assert applied["status"] == "applied_verified", applied
    intent = applied["intent_id"]
    assert scalar(url, "SELECT billing.premium(100)", "ORACLE") == 120
    assert scalar(url, "SELECT billing.discount(100)", "ORACLE") == 90

    verified = cli("ddl", "verify", "package:billing", "--connector", "billing_code")
    assert verified["passed"]
    assert {c["object"].rsplit(".", 1)[1] for c in verified["checks"]
            if c["name"] == "dependent"} >= {"billing", "v_prem", "doubled"}

    comp = cli("ddl", "compensate", intent, "--case", "PKG-1", "--as", "agent")
    assert comp["outcome"] == "compensated", comp
    assert comp["record"]["evidence"]["compensation"]["live_signatures"] == {
        spec["key"]: spec["signature"], body["key"]: body["signature"]}
    assert scalar(url, "SELECT billing.premium(100)", "ORACLE") == 110

    shown = cli("ledger", "show", "PKG-1")
    events = [e for e in shown["events"] if e["intent_id"] == intent]
    assert kinds(events) == [
        "prepared", "ddl.preflight", "ddl_apply_started", "ddl.object_applied",
        "ddl.object_applied", "ddl.verified", "ddl.captured", "ddl.captured", "ddl.outcome",
        "observed", *COMPENSATE_EVENTS]
    started = events[2]["payload"]
    assert started["snapshot_ids"] == [spec["snapshot_id"], body["snapshot_id"]]
    assert started["transactional"] is False  # recorded before DDL that commits on its own
    report = cli("ledger", "verify")
    assert report["ok"] and report["findings"] == []


@pytest.fixture
def maria_cli_inproc(mariadb_url: URL, tmp_path: Path) -> tuple[Cli, URL, Path]:
    run_sql(mariadb_url, MARIADB_SETUP, mode="ORACLE")
    caps = tmp_path / "caps"
    caps.mkdir()
    (caps / "billing.yaml").write_text(BILLING_ROW)
    cli = make_cli(tmp_path, ["billing_code"], mariadb_url, caps, subprocesses=False)
    return cli, mariadb_url, tmp_path


@pytest.mark.mariadb
def test_mariadb_spec_without_body_and_no_approval(
        maria_cli_inproc: tuple[Cli, URL, Path]) -> None:
    cli, url, tmp = maria_cli_inproc
    (tmp / "spec.sql").write_text(SPEC_V2)
    (tmp / "body.sql").write_text(BODY_V2)
    err = cli("ddl", "plan", str(tmp / "spec.sql"), "--operation", "code.billing",
              "--case", "PKG-2", "--as", "agent", rc=1)
    assert err["code"] == "CG502"  # spec without body
    h = cli("ddl", "plan", str(tmp / "spec.sql"), str(tmp / "body.sql"), "--operation",
            "code.billing", "--case", "PKG-2", "--as", "agent", "--smoke", SMOKE)["plan_hash"]
    assert cli("ddl", "apply", h, "--case", "PKG-2", "--as", "agent", rc=4)["code"] == "CG201"
    snapshot = cli("ledger", "show", "PKG-2")["snapshot"]
    assert snapshot["intents"] == {}  # refusals record no intent
    assert scalar(url, "SELECT billing.premium(100)", "ORACLE") == 110


# --- the docs -------------------------------------------------------------------------------------


def test_docs_commands_parse_and_every_ddl_command_is_documented() -> None:
    import argparse
    import shlex

    from capgate.cli import build_parser

    doc = (REPO / "docs" / "ddl.md").read_text()
    parser = build_parser()
    seen = set()
    for line in doc.splitlines():
        if line.startswith("$ capgate "):
            args = parser.parse_args(shlex.split(line[2:])[1:])
            seen.add((args.command, getattr(args, "ddl_command", None)))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    ddl = sub.choices["ddl"]
    ddl_sub = next(a for a in ddl._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in ddl_sub.choices.items():
        assert f"`capgate ddl {name}" in doc, name
        assert p.format_help()
    assert {("ddl", c) for c in ("capture", "plan", "apply", "verify", "compensate",
                                 "snapshots", "export", "prohibitions")} <= seen
    assert ("approve", None) in seen and ("ledger", None) in seen
