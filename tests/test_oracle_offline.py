"""Oracle without an Oracle: what can be proven here, and only that (issue 18).

No Oracle runs on these machines, so these tests prove exactly what they say:

* every SQL text capgate sends to Oracle -- the dialect's (its PL/SQL blocks
  statement by statement), capgate's tables and grants, the fence's MERGE, the
  marker queries, the ``doctor`` queries -- parses with sqlglot's Oracle dialect,
  queries as real SELECTs;
* Thin or Thick is decided by what the driver reports (``Connection.thin`` on
  each connection, ``oracledb.is_thin_mode()`` for the process), never by a
  missing attribute: a Thick connection is never asked for ``serial_num``;
* the driver must be python-oracledb 3.0 or later (Thin ``session_id`` and
  ``serial_num`` came in 2.5, the Thin LTXID in 3.0), checked on the real module;
* dates declared ``format: date`` are bound as dates; a timeout or an in-doubt
  distributed commit around COMMIT is a lost connection (outcome unknown);
  ORA-02391 is the budget error; leases are refused; the budget of a database
  user is keyed per user per service;
* connectors take ``connect_args`` (secrets only from the environment),
  ``thick_mode``, TNS aliases and ``current_schema``, and no secret reaches a
  printed URL, a DDL plan's target or a log line;
* testcontainers' Oracle container is imported without the deprecation warning
  that ``filterwarnings = error`` turned into an exception.

What needs a server (sessions, Transaction Guard, liveness, the crash matrix) is
in ``tests/test_executor.py`` and ``tests/test_oracle_recovery.py``, which
run wherever an Oracle answers.  A passing test here is never proof of those.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tomllib
import types
import warnings
from pathlib import Path
from typing import Any

import oracledb
import pytest
import sqlalchemy as sa
import sqlglot
from sqlalchemy.engine import make_url
from sqlglot import exp

from capgate.executor.dialects import SessionTag, dialect_for
from capgate.executor.dialects import oracle as ora
from capgate.executor.dialects.base import MARKER_INSERT, TARGET_TABLES
from capgate.registry.errors import (
    BudgetExhausted,
    ConnectorUnavailable,
    DriverUnsupported,
    LeaseNotEnforceable,
    TransactionSplit,
)

ROOT = Path(__file__).resolve().parent.parent


# --- every SQL text meant for Oracle parses with sqlglot's Oracle dialect ------------------


def plsql_statements(block: str) -> list[str]:
    """The SQL inside a PL/SQL block, each as a statement sqlglot can parse.

    ``:x := expr`` becomes ``SELECT expr FROM dual``; a procedure call becomes a
    function call in a SELECT; DML stays as it is.  The declarations are skipped.
    """
    body = block.strip()
    body = body[body.upper().index("BEGIN") + len("BEGIN"):]
    body = body[:body.upper().rindex("END")]
    out: list[str] = []
    for piece in body.split(";"):
        statement = " ".join(piece.split())
        if not statement:
            continue
        assignment = re.match(r"^:?\w+\s*:=\s*(.+)$", statement, re.DOTALL)
        if assignment:
            out.append(f"SELECT {assignment.group(1)} FROM dual")
        elif re.match(r"^(INSERT|UPDATE|DELETE|MERGE|SELECT)\b", statement, re.IGNORECASE):
            out.append(statement)
        else:
            out.append(f"SELECT {statement} FROM dual")
    return out


def oracle_texts() -> dict[str, str]:
    from capgate.executor.dialects.base import FENCE_READ
    from capgate.executor.recovery.evidence import _BY_INTENT, _BY_KEY
    from capgate.executor.transaction import _MARKER_BY_KEY

    dialect = ora.OracleDialect()
    texts = {f"dialect.{k}": v for k, v in ora.SQL_TEXTS.items()}
    texts.update({f"target.{k}": v for k, v in dialect.target_ddl().items()})
    texts.update({f"grant.{i}": g for i, g in enumerate(dialect.target_grants("app_user"))})
    texts.update({f"probe.{t}": dialect.probe_table_sql(t) for t in TARGET_TABLES})
    texts.update({f"doctor.{k}": v for k, v in ora.DOCTOR_QUERIES.items()})
    texts.update({"marker_insert": MARKER_INSERT, "marker_by_key": _MARKER_BY_KEY,
                  "fence_merge": dialect.fence_upsert, "fence_read": FENCE_READ,
                  "markers_by_intent": str(_BY_INTENT).replace("IN :ids", "IN (:ids)"),
                  "markers_by_key": str(_BY_KEY).replace("IN :keys", "IN (:keys)"),
                  "read_only": "SET TRANSACTION READ ONLY",
                  "budget_probe": dialect.ping_sql})
    return texts


@pytest.mark.parametrize("name", sorted(oracle_texts()))
def test_every_oracle_sql_text_parses_with_sqlglot(name: str) -> None:
    sql = oracle_texts()[name]
    pieces = plsql_statements(sql) if re.match(r"^\s*(BEGIN|DECLARE)\b", sql, re.I) else [sql]
    assert pieces, name
    for piece in pieces:
        trees = [t for t in sqlglot.parse(piece, read="oracle") if t is not None]
        assert len(trees) == 1, (name, piece)
        tree = trees[0]
        first = piece.lstrip().split()[0].upper()
        if first == "SELECT":
            assert isinstance(tree, exp.Select), (name, piece, type(tree))
            assert tree.find(exp.Command) is None, (name, piece)
            # before 23ai a query needs FROM: capgate's own SQL says FROM dual
            assert all(s.args.get("from") or s.args.get("from_")
                       for s in tree.find_all(exp.Select)), (name, piece)
        elif first in ("INSERT", "UPDATE", "DELETE", "MERGE"):
            assert not isinstance(tree, exp.Command), (name, piece)
        else:  # ALTER SESSION/SYSTEM, SET TRANSACTION, CREATE, GRANT: parsed as statements
            assert tree.sql(dialect="oracle").split()[0].upper() == first, (name, piece)


def test_the_plsql_blocks_hold_what_the_module_says() -> None:
    opening = plsql_statements(ora.OPEN_MARKED_BLOCK)
    assert opening[0].startswith("INSERT INTO capgate_landed")
    assert any("LOCAL_TRANSACTION_ID(TRUE)" in s for s in opening)
    assert any("UNIQUE_SESSION_ID" in s for s in opening)
    assert any("'INSTANCE'" in s for s in opening)  # the RAC instance (GV$SESSION.INST_ID)
    assert plsql_statements(ora.OPEN_BLOCK) == opening[1:]
    assert ora.SESSION_SETUP == ("ALTER SESSION DISABLE COMMIT IN PROCEDURE",)
    assert "NLS_DATE_FORMAT" not in " ".join(ora.SQL_TEXTS.values())
    assert "gv$session" in ora.SESSION_BY_SERIAL and "inst_id" in ora.SESSION_BY_SERIAL
    assert "@{inst}" in ora.KILL_SESSION


# --- the driver: its version and its mode, as it reports them ------------------------------


def test_the_installed_driver_is_new_enough_and_says_its_mode() -> None:
    mode = ora.check_driver(oracledb)
    assert mode == ("thin" if oracledb.is_thin_mode() else "thick")
    assert ora.version_tuple(oracledb.__version__) >= ora.MIN_DRIVER
    # what the dialect reads exists on the real class (no attribute is guessed)
    for attribute in ("thin", "ltxid", "serial_num", "session_id", "call_timeout",
                      "clientinfo", "client_identifier", "module", "action",
                      "current_schema"):
        assert hasattr(oracledb.Connection, attribute), attribute


@pytest.mark.parametrize(("version", "ok"), [
    ("1.4.2", False), ("2.0.0", False), ("2.4.1", False), ("2.5.0", False), ("2.5.1", False),
    ("3.0.0", True), ("3.0.0b1", True), ("3.4.2", True), ("26.1.0", True),
])
def test_drivers_before_3_0_are_refused(version: str, ok: bool) -> None:
    module = types.SimpleNamespace(__version__=version, is_thin_mode=lambda: True)
    if ok:
        assert ora.check_driver(module) == "thin"
    else:
        with pytest.raises(DriverUnsupported) as info:
            ora.check_driver(module)
        assert info.value.code == "CG917" and info.value.exit_code == 2
        assert "3.0" in info.value.message and version in info.value.message


def test_the_package_requires_the_driver_it_checks() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("oracledb")]
    assert spec == "oracledb>=" + ".".join(map(str, ora.MIN_DRIVER[:2]))


class _Thin:
    """The connection attributes the dialect reads, as a Thin connection has them."""

    thin = True
    ltxid = bytes.fromhex("0102a0")
    serial_num = 4711


class _Thick:
    """A Thick connection: no ``serial_num`` (reading it here would raise AttributeError)."""

    thin = False
    ltxid = b""


OUT = {"cg_txid": "7.12.3456", "cg_sid": "271", "cg_inst": "2", "cg_audsid": "998877",
       "cg_usid": "010F00A2", "cg_db": "ORCL_SITE1"}


def test_thin_and_thick_are_told_apart_by_what_the_driver_reports() -> None:
    tag = SessionTag("C-1", "policy.add_note", "intent-1")
    thin = ora.OracleDialect.identity_of(_Thin(), OUT, tag)
    assert thin == {"driver": "thin", "ltxid": "0102a0", "commit_outcome": "recorded",
                    "txid": "7.12.3456", "sid": 271, "serial": 4711, "instance": 2,
                    "audsid": 998877, "usid": "010F00A2", "db": "ORCL_SITE1",
                    "client_info": "intent-1"}
    thick = ora.OracleDialect.identity_of(_Thick(), OUT, tag, no_ltxid=True)
    assert thick["driver"] == "thick" and thick["serial"] is None  # looked up by AUDSID
    assert thick["sid"] == 271 and thick["instance"] == 2 and thick["audsid"] == 998877
    assert thick["ltxid"] is None
    assert "COMMIT_OUTCOME" in thick["commit_outcome"]  # why there is no LTXID, recorded


def test_liveness_asks_gv_session_by_serial_in_thin_and_by_audsid_in_thick() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    class Conn:
        def execute(self, statement: Any, binds: dict[str, Any] | None = None) -> Any:
            seen.append((str(statement), dict(binds or {})))
            return types.SimpleNamespace(first=lambda: (4711, "intent-1", 1))

    dialect = ora.OracleDialect()
    tag = SessionTag("C-1", "op", "intent-1")
    thin = dialect.session_facts(Conn(), ora.OracleDialect.identity_of(  # type: ignore[arg-type]
        _Thin(), OUT, tag))
    thick = dialect.session_facts(Conn(), ora.OracleDialect.identity_of(  # type: ignore[arg-type]
        _Thick(), OUT, tag))
    assert [s for s, _ in seen] == [ora.SESSION_BY_SERIAL, ora.SESSION_BY_AUDSID]
    assert seen[0][1] == {"inst": 2, "sid": 271, "serial": 4711}
    assert seen[1][1] == {"inst": 2, "sid": 271, "audsid": 998877}
    assert thin.may_commit is True and thick.serial == 4711
    # not found by serial (Thin): gone; not found by AUDSID (Thick): IS_SESSION_ALIVE decides
    asked: list[str] = []

    class Missing:
        def execute(self, statement: Any, binds: dict[str, Any] | None = None) -> Any:
            asked.append(str(statement))
            return types.SimpleNamespace(first=lambda: None, out_parameters={"alive": 1})

    gone = dialect.session_facts(Missing(), ora.OracleDialect.identity_of(  # type: ignore[arg-type]
        _Thin(), OUT, tag))
    assert gone.alive is False and asked == [ora.SESSION_BY_SERIAL]
    unsure = dialect.session_facts(Missing(), ora.OracleDialect.identity_of(  # type: ignore[arg-type]
        _Thick(), OUT, tag))
    assert unsure.alive is True and unsure.ours is None and unsure.source == "dbms_session"
    assert asked[1:] == [ora.SESSION_BY_AUDSID, ora.ALIVE_BLOCK]
    assert ora.SessionFacts(True, ours=False, in_transaction=True).may_commit is False
    assert ora.SessionFacts(True, ours=True, in_transaction=False).may_commit is False
    assert ora.SessionFacts(False).may_commit is False
    assert ora.SessionFacts(True).may_commit is None  # IS_SESSION_ALIVE only: unknowable


# --- dates, errors, leases, budgets -----------------------------------------------------------


def test_dates_declared_as_dates_are_bound_as_dates() -> None:
    import datetime as dt

    names = {"as_of": "date", "at": "date-time"}
    out = ora.convert_dates({"as_of": "2024-08-15", "at": "2024-08-15T10:30:00Z",
                             "body": "2024-08-15", "bad": "x"}, names)
    assert out["as_of"] == dt.date(2024, 8, 15)
    assert out["at"] == dt.datetime(2024, 8, 15, 10, 30, tzinfo=dt.UTC)
    assert out["body"] == "2024-08-15"  # not declared a date: stays text
    assert ora.convert_dates({'"AS_OF"': "2024-08-15"}, names)['"AS_OF"'] == dt.date(2024, 8, 15)
    assert ora.convert_dates({"as_of": "2024-13-45"}, names)["as_of"] == "2024-13-45"
    assert ora.convert_dates([{"as_of": "2024-01-02"}], names) == [{"as_of": dt.date(2024, 1, 2)}]


def test_the_call_tag_carries_the_rows_date_inputs() -> None:
    from capgate.executor.context import CallContext
    from tests.fix_capgate import registry

    row = registry().resolve("premium.list_overdue")
    assert row.version == 2 and row.date_inputs == frozenset({("as_of", "date")})
    ctx = CallContext(row, {"as_of": "2024-08-15"}, "C", "agent", None, "i", None,  # type: ignore[arg-type]
                      "fp", None)  # type: ignore[arg-type]
    assert ctx.tag.dates == frozenset({("as_of", "date")})


def _oracle_engine() -> sa.Engine:
    return sa.create_engine("oracle+oracledb://app:pw@db.example:1521/?service_name=sales",
                            poolclass=sa.pool.NullPool)


def test_prepare_engine_sets_up_sessions_without_nls_and_resets_on_return() -> None:
    engine = _oracle_engine()  # no connection is made
    dialect = ora.OracleDialect()
    dialect.prepare_engine(engine)
    assert sa.event.contains(engine, "connect", dialect.session_setup)
    assert sa.event.contains(engine, "handle_error", dialect.on_error)
    assert len(engine.pool.dispatch.reset) >= 1  # labels, call timeout, dates reset
    assert len(engine.dispatch.before_cursor_execute) >= 1  # dates bound as dates


def _error_ctx(message: str, statement: str | None = None) -> Any:
    return types.SimpleNamespace(statement=statement, is_pre_ping=False, is_disconnect=False,
                                 invalidate_pool_on_disconnect=True,
                                 original_exception=Exception(message))


@pytest.mark.parametrize("message", [
    "ORA-02054: transaction 7.12.3456 in-doubt",
    "ORA-02050: transaction 7.12.3456 rolled back, some remote DBs may be in-doubt",
    "DPY-4024: call timeout of 1000 ms exceeded",
    "DPI-1067: call timeout of 1000 ms exceeded with ORA-3156",
    "DPY-4011: the database or network closed the connection: socket timed out",
])
def test_an_open_outcome_around_commit_is_a_lost_connection(message: str) -> None:
    dialect = ora.OracleDialect()
    ctx = _error_ctx(message)
    dialect.on_error(ctx)
    assert ctx.is_disconnect and ctx.invalidate_pool_on_disconnect is False
    during = _error_ctx(message, statement="UPDATE policy SET holder = holder")
    dialect.on_error(during)  # a statement's error rolls back as usual
    assert not during.is_disconnect
    plain = _error_ctx("ORA-00001: unique constraint violated")
    dialect.on_error(plain)
    assert not plain.is_disconnect


def test_thick_mode_timeouts_are_timeouts() -> None:
    dialect = ora.OracleDialect()
    assert dialect.is_timeout(Exception("DPI-1067: call timeout of 5 ms exceeded with ORA-3156"))
    assert dialect.is_timeout(Exception("DPI-1080: connection was closed by ORA-3156"))
    assert not dialect.is_timeout(Exception("DPI-1080: connection was closed by ORA-3113"))


def test_ora_02391_is_the_budget_error_and_nothing_was_sent() -> None:
    from capgate.executor.connectors import Connector, ConnectorConfig

    dialect = ora.OracleDialect()
    limit = Exception("ORA-02391: exceeded simultaneous SESSIONS_PER_USER limit")
    assert dialect.is_session_limit(limit) and not dialect.is_session_limit(Exception("x"))
    connector = Connector.open(ConnectorConfig(
        "insurance", "oracle://app:pw@db.example:1521/?service_name=sales", "dev"))
    try:
        err = connector.unavailable(limit)
    finally:
        connector.dispose()
    assert isinstance(err, BudgetExhausted) and isinstance(err, ConnectorUnavailable)
    assert err.code == "CG321" and err.retryable and "pw" not in err.message


def test_the_db_user_budget_is_per_user_per_database_service() -> None:
    from capgate.executor.budget import scopes_for
    from capgate.executor.connectors import Connector, ConnectorConfig

    dialect = ora.OracleDialect()
    on = dialect.budget_user_scope
    scan = on(make_url("oracle+oracledb://app@scan.example:1521/?service_name=Sales"), {})
    node = on(make_url("oracle+oracledb://APP@node2.example:1522/?service_name=SALES"), {})
    assert scan == node == "APP@service:sales"  # any host, RAC node or port of one service
    assert on(make_url("oracle+oracledb://app@db.example:1521/ORCL"), {}) == "APP@service:orcl"
    assert on(make_url("oracle+oracledb://@sales_high"), {"user": "app"}) == "APP@dsn:sales_high"
    assert on(make_url("oracle+oracledb://@"), {}) is None
    connector = Connector.open(ConnectorConfig(
        "insurance", "oracle://app@scan.example:1521/?service_name=sales", "dev",
        db_user_budget=5))
    try:
        scopes = scopes_for(connector)
    finally:
        connector.dispose()
    assert [s.name for s in scopes] == ["connector:insurance", "db_user:APP@service:sales"]
    # the other dialects keep USER@HOST:PORT
    pg = dialect_for("postgresql").budget_user_scope(
        make_url("postgresql+psycopg://app@h:5432/db"), {})
    assert pg == "app@h:5432"


def test_leased_rows_are_refused_on_oracle_only() -> None:
    with pytest.raises(LeaseNotEnforceable) as info:
        ora.OracleDialect().check_lease()
    assert info.value.code == "CG326" and info.value.exit_code == 1
    for name in ("postgresql", "mariadb", "sqlite"):
        dialect_for(name).check_lease()  # accepted
    source = (ROOT / "executor" / "lease.py").read_text("utf-8")
    body = source[source.index("def run_leased"):]
    assert body.index("check_lease()") < body.index("rt.check_target")  # before anything


def test_a_split_transaction_is_refused_before_commit() -> None:
    class Conn:
        info = {"capgate_oracle_txid": "7.12.3456"}

        def __init__(self, now: str | None) -> None:
            self.now = now

        def execute(self, statement: Any) -> Any:
            assert str(statement) == ora.TXID_NOW
            return types.SimpleNamespace(scalar=lambda: self.now)

    dialect = ora.OracleDialect()
    dialect.before_commit(Conn("7.12.3456"))  # type: ignore[arg-type]
    for now in ("8.1.99", None):
        with pytest.raises(TransactionSplit) as info:
            dialect.before_commit(Conn(now))  # type: ignore[arg-type]
        assert info.value.code == "CG327" and info.value.exit_code == 3
    source = (ROOT / "executor" / "transaction.py").read_text("utf-8")
    assert source.index("dialect.before_commit(conn)") < source.index("conn.commit()")


def test_no_ltxid_is_logged_without_secrets(caplog: pytest.LogCaptureFixture) -> None:
    """The warning names the target with no password and no secret query value."""
    engine = sa.create_engine("oracle+oracledb://app:hunter2@db.example:1521/"
                              "?service_name=sales&wallet_password=w411et",
                              poolclass=sa.pool.NullPool)
    dialect = ora.OracleDialect()
    dialect.prepare_engine(engine)

    class Cursor:
        def execute(self, sql: str) -> None:
            assert sql in ora.SESSION_SETUP

        def close(self) -> None:
            pass

    raw = types.SimpleNamespace(ltxid=b"", cursor=Cursor)
    record = types.SimpleNamespace(info={})
    with caplog.at_level(logging.WARNING, logger="capgate.oracle"):
        dialect.session_setup(raw, record)
        dialect.session_setup(raw, record)  # said once per connector
    text = caplog.text
    assert text.count("COMMIT_OUTCOME") == 1
    assert "COMMIT_OUTCOME" in text and "hunter2" not in text and "w411et" not in text
    assert record.info.get("capgate_oracle_no_ltxid") is True


# --- configuration: connect_args, thick_mode, TNS aliases, wallets, no secret in a URL -------


def _settings(tmp_path: Path, body: str, env: dict[str, str] | None = None) -> Any:
    from capgate.config import read_settings

    (tmp_path / "capgate.toml").write_text(body, "utf-8")
    return read_settings(tmp_path / "capgate.toml", env or {})


def test_connect_args_take_secrets_from_the_environment_only(tmp_path: Path) -> None:
    from capgate.executor.connectors import resolve_connect_args

    settings, problems = _settings(tmp_path, """
[connectors.insurance]
url = "oracle://app@sales_high"
environment = "prod"
current_schema = "INSIS"
[connectors.insurance.connect_args]
config_dir = "/etc/tns"
wallet_location = "/etc/wallet"
wallet_password = { env = "SALES_WALLET_PW" }
""")
    assert problems == []
    config = settings.connectors["insurance"]
    assert config.current_schema == "INSIS" and config.thick_mode is False
    assert dict(config.connect_args) == {"config_dir": "/etc/tns",
                                         "wallet_location": "/etc/wallet",
                                         "wallet_password": {"env": "SALES_WALLET_PW"}}
    assert resolve_connect_args("insurance", config.connect_args,
                                {"SALES_WALLET_PW": "s3cret"})["wallet_password"] == "s3cret"
    from capgate.registry.errors import ConfigError

    with pytest.raises(ConfigError, match="SALES_WALLET_PW"):
        resolve_connect_args("insurance", config.connect_args, {})


def test_secrets_in_a_url_or_written_in_the_file_are_refused(tmp_path: Path) -> None:
    _, problems = _settings(tmp_path, """
[connectors.a]
url = "oracle://app@db:1521/?service_name=s&wallet_password=w411et"
[connectors.b]
url = "oracle://app@db:1521/?service_name=s"
connect_args = { wallet_password = "w411et", config_dir = 7.5, bad = { file = "x" } }
[connectors.c]
url = "postgresql://app@db/x"
thick_mode = true
current_schema = "X"
""")
    found = {(p.key, p.code) for p in problems}
    assert ("connectors.a.url", "CG918") in found
    assert ("connectors.b.connect_args", "CG918") in found
    assert ("connectors.b.connect_args", "CG902") in found  # bad = { file = ... }
    assert ("connectors.c.thick_mode", "CG902") in found
    assert ("connectors.c.current_schema", "CG902") in found
    assert all("w411et" not in p.message for p in problems)


def test_thin_and_thick_oracle_connectors_cannot_share_a_process(tmp_path: Path) -> None:
    settings, problems = _settings(tmp_path, """
[connectors.a]
url = "oracle://app@a_high"
thick_mode = { lib_dir = "/opt/oracle/instantclient", config_dir = "/etc/tns" }
[connectors.b]
url = "oracle://app@b_high"
""")
    assert [p.code for p in problems] == ["CG919"]
    assert dict(settings.connectors["a"].thick_mode) == {
        "lib_dir": "/opt/oracle/instantclient", "config_dir": "/etc/tns"}


def test_no_secret_reaches_a_printed_url_a_ddl_target_or_an_engine_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from capgate.ddl.loop import _redacted
    from capgate.executor.connectors import ConnectorConfig, connector_engine, safe_url

    url = "oracle://app:hunter2@db:1521/?service_name=s&wallet_password=w411et&x_token=t0k"
    for shown in (safe_url(url), _redacted(make_url(url))):
        assert "hunter2" not in shown and "w411et" not in shown and "t0k" not in shown
        assert "service_name=s" in shown
    captured: dict[str, Any] = {}
    real = sa.create_engine

    def spy(target: Any, **options: Any) -> sa.Engine:
        captured.update(target=target, **options)
        return real(target, **options)

    monkeypatch.setattr(sa, "create_engine", spy)
    monkeypatch.setenv("SALES_WALLET_PW", "w411et")
    config = ConnectorConfig("insurance", "oracle://app@sales_high", "dev",
                             connect_args={"config_dir": "/etc/tns",
                                           "wallet_password": {"env": "SALES_WALLET_PW"}},
                             current_schema="INSIS")
    engine = connector_engine(config, poolclass=sa.pool.NullPool)
    engine.dispose()
    assert captured["connect_args"] == {"config_dir": "/etc/tns", "wallet_password": "w411et"}
    assert "w411et" not in str(captured["target"])  # the secret travels beside the URL
    assert captured["target"].host == "sales_high"  # a TNS alias: SQLAlchemy's dsn
    admin = connector_engine(ConnectorConfig("i", "oracle://app@a", "dev",
                                             connect_args={"user": "app", "password":
                                                           {"env": "SALES_WALLET_PW"},
                                                           "config_dir": "/etc/tns"}),
                             url="oracle://dba:pw@a", poolclass=sa.pool.NullPool)
    admin.dispose()
    assert captured["connect_args"] == {"config_dir": "/etc/tns"}  # --admin-url: its own login


def test_the_ddl_service_hands_the_connector_driver_settings_to_the_loop() -> None:
    source = (ROOT / "ddl" / "service.py").read_text("utf-8")
    assert "engine_options=driver_options(cfg)" in source


# --- testcontainers' Oracle container, imported as filterwarnings = error demands ---------


def test_the_oracle_container_imports_without_a_deprecation_warning() -> None:
    from tests.fix_db import oracle_container_class

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls = oracle_container_class()
    assert cls.__module__.startswith("testcontainers")
    assert "gvenzl/oracle-free" in str(cls.__init__.__defaults__)


def test_a_required_oracle_that_is_missing_fails_loudly(tmp_path: Path) -> None:
    """No DSN and no Docker: one clear message, not a warnings-as-errors traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_TEST_ORACLE")}
    env.update(CAPGATE_REQUIRE_DBS="oracle", DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock")
    test = tmp_path / "test_needs_oracle.py"
    test.write_text("def test_x(oracle_url):\n    pass\n", "utf-8")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), str(test)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 3, said
    assert "required database unavailable: oracle: no CAPGATE_TEST_ORACLE_DSN and no Docker " \
           "daemon" in said, said
    assert "DeprecationWarning" not in said and "Traceback" not in said


def test_an_oracle_image_that_cannot_be_pulled_fails_loudly(tmp_path: Path) -> None:
    """Docker answers, the image cannot be had: one message naming it, and what to do."""
    from tests.fix_db import docker_available

    if not docker_available():
        pytest.skip("no Docker daemon answers: the test above covers that case")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_TEST_ORACLE")}
    env.update(CAPGATE_REQUIRE_DBS="oracle", CAPGATE_TEST_ORACLE_IMAGE="capgate-test/no-oracle:0")
    test = tmp_path / "test_needs_oracle.py"
    test.write_text("def test_x(oracle_url):\n    pass\n", "utf-8")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), str(test)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 3, said
    assert "oracle: could not start a container: image capgate-test/no-oracle:0 is not here " \
           "and cannot be pulled" in said, said
    assert "CAPGATE_TEST_ORACLE_DSN" in said
    assert "DeprecationWarning" not in said and "Traceback" not in said


# --- the CI job that proves it where Docker runs ----------------------------------------------


def test_the_oracle_ci_job_runs_every_oracle_suite_and_requires_oracle() -> None:
    import yaml

    workflow = yaml.safe_load((ROOT / "docs" / "ci" / "oracle.yml").read_text("utf-8"))
    job = workflow["jobs"]["oracle"]
    assert job["services"]["oracle"]["image"].startswith("gvenzl/oracle-free")
    assert job["env"]["CAPGATE_REQUIRE_DBS"] == "oracle"
    dsn = make_url(job["env"]["CAPGATE_TEST_ORACLE_DSN"])
    assert dsn.get_backend_name() == "oracle" and dsn.port == 1521
    assert dsn.password == job["services"]["oracle"]["env"]["ORACLE_PASSWORD"]
    command = " ".join(step.get("run", "") for step in job["steps"])
    # every test marked oracle, in every suite (the shared engine suites included) ...
    assert re.search(r"pytest\b[^\n]* -m oracle tests\b", command), command
    # ... and the offline Oracle suites, which need no server and so carry no marker
    suites = re.findall(r"tests/\S+\.py", command)
    offline = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")
                     if "oracle" in p.name and "offline" in p.name)
    assert sorted(suites) == offline


def test_the_readme_oracle_connector_reads_cleanly(tmp_path: Path) -> None:
    """The documented Oracle example (a TNS alias, a wallet, current_schema) is valid."""
    from capgate.config import read_settings

    text = (ROOT / "docs" / "configuration.md").read_text("utf-8")
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", text, re.S)
                if "[connectors.insis]" in b]
    (tmp_path / "capgate.toml").write_text(block, "utf-8")
    settings, problems = read_settings(tmp_path / "capgate.toml", {})
    assert problems == []
    config = settings.connectors["insis"]
    assert config.current_schema == "INSIS"
    assert config.connect_args["wallet_password"] == {"env": "INSIS_WALLET_PW"}
    assert make_url(config.url).host == "insis_high" and make_url(config.url).port is None


def test_a_split_seen_before_commit_escalates_and_resume_parks_it(
        sqlite_url: Any, gate: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's side of the split detector, on SQLite with the dialect's last look
    made to fail: never applied, never rolled back -- escalated for a person."""
    from capgate.executor.recovery.resume import resume

    ex = gate(sqlite_url)
    dialect = ex.connectors.get("insurance").dialect

    def split(conn: Any) -> None:
        raise TransactionSplit("the transaction opened as 1 is now 2", opened="1", now="2")

    monkeypatch.setattr(dialect, "before_commit", split)
    with pytest.raises(TransactionSplit) as info:
        ex.call("policy.add_note", {"policy_id": 1, "author": "jdoe", "body": "split"},
                case="C-split", who="agent")
    assert info.value.exit_code == 3
    (state,) = (ex.ledger.snapshot("C-split") or {})["intents"].values()
    assert state["status"] == "escalated"
    assert state["escalation"]["kind"] == "transaction_split"
    assert state["escalation"]["classification"] == "partly_applied"
    assert state["escalation"]["transaction"] == {"opened": "1", "now": "2"}
    (parked,) = resume(ex, "C-split").intents
    assert (parked.classification, parked.action) == ("partly_applied", "awaiting_person")
    assert ex.ledger.verify().ok
