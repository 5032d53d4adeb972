"""The DDL loop on Oracle (python-oracledb thin mode).

Runs only where ``CAPGATE_TEST_ORACLE_DSN`` names an Oracle server (the module
is skipped before any fixture runs otherwise: probing for Docker on a machine
without it leaves an unclosed socket behind, which ``filterwarnings = error``
turns into an error in a later test).  The fresh test user is granted
``EXECUTE ON DBMS_LOCK`` for the session-scoped DDL lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.ddl.catalog import ObjectRef
from capgate.ddl.events import ListSink
from capgate.ddl.loop import DdlLoop
from capgate.ddl.results import Change, SmokeCall
from capgate.ddl.snapshots import SqlSnapshotStore
from tests.fix_db import require_server

# Oracle comes from CAPGATE_TEST_ORACLE_DSN, else a gvenzl/oracle-free container when
# Docker answers; the oracle_url fixture skips (or fails, under CAPGATE_REQUIRE_DBS).
pytestmark = [pytest.mark.oracle]

SPEC_V1 = """CREATE OR REPLACE PACKAGE billing AS
  FUNCTION premium(p_base NUMBER) RETURN NUMBER;
END billing;
/
"""
BODY_V1 = """CREATE OR REPLACE PACKAGE BODY billing AS
  g_calls PLS_INTEGER := 0;
  FUNCTION premium(p_base NUMBER) RETURN NUMBER IS
  BEGIN
    g_calls := g_calls + 1;
    RETURN p_base * 1.1;
  END premium;
END billing;
/
"""
CALLER = """CREATE OR REPLACE FUNCTION doubled(p NUMBER) RETURN NUMBER IS
BEGIN
  RETURN billing.premium(p) * 2;
END doubled;
"""


@pytest.fixture
def target(oracle_url: URL) -> URL:
    admin = sa.create_engine(require_server("oracle").url, poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"GRANT EXECUTE ON SYS.DBMS_LOCK TO {oracle_url.username}")
    admin.dispose()
    eng = sa.create_engine(oracle_url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        for stmt in (SPEC_V1, BODY_V1, CALLER):
            conn.exec_driver_sql(stmt.rstrip().removesuffix("/").rstrip(),
                                 execution_options={"no_parameters": True})
    eng.dispose()
    return oracle_url


@pytest.fixture
def loop(target: URL, tmp_path: Path) -> Iterator[DdlLoop]:
    store = SqlSnapshotStore(f"sqlite:///{tmp_path / 'ledger.db'}")
    with DdlLoop(target, store, sink=ListSink()) as lp:
        yield lp
    store.dispose()


def test_package_loop_with_dependents(loop: DdlLoop) -> None:
    spec = loop.capture(ObjectRef("package", "BILLING"))
    body = loop.capture(ObjectRef("package_body", "BILLING"))
    assert body.source.upper().startswith("CREATE OR REPLACE PACKAGE BODY")
    plan = loop.plan(
        [Change(SPEC_V1, base_snapshot_id=spec.id),
         Change(BODY_V1.replace("1.1", "1.2"), base_snapshot_id=body.id)],
        smoke=[SmokeCall("premium", "SELECT billing.premium(100) FROM dual", 120)],
    )
    assert any(d["key"].endswith(".DOUBLED") for d in plan.dependents)
    assert any("ORA-04068" in w for w in plan.warnings)
    outcome = loop.execute(plan)
    assert outcome.outcome == "applied_verified", outcome.to_dict()
    assert loop.classify(plan).classification == "applied"


def test_compile_errors_are_a_failed_apply_and_compensated(loop: DdlLoop) -> None:
    body = loop.capture(ObjectRef("package_body", "BILLING"))
    broken = BODY_V1.replace("RETURN p_base * 1.1;", "RETURN p_base * no_such_var;")
    plan = loop.plan([Change(broken, base_snapshot_id=body.id)])
    outcome = loop.execute(plan)
    assert outcome.outcome == "compensated", outcome.to_dict()
    assert outcome.error is not None and outcome.error["code"] == "CG510"
    assert outcome.error["details"]["errors"]
    assert outcome.restored
    with loop.engine.connect() as conn:
        st = loop.adapter.status(conn, ObjectRef("package_body", "BILLING"))
    assert st.state == "valid"


# --- issue 15: what a snapshot keeps, what the sweep recompiles -----------------------------


TRIGGER = """CREATE OR REPLACE TRIGGER pol_stamp BEFORE INSERT ON pol FOR EACH ROW
BEGIN
  :new.base := billing.premium(:new.base);
END;
"""


def _run(url: URL, *statements: str) -> None:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        for stmt in statements:
            conn.exec_driver_sql(stmt.rstrip().removesuffix("/").rstrip(),
                                 execution_options={"no_parameters": True})
    eng.dispose()


def test_snapshot_keeps_editionable_trigger_state_and_compiler_settings(
        loop: DdlLoop, target: URL) -> None:
    _run(target, "CREATE TABLE pol (id NUMBER PRIMARY KEY, base NUMBER)", TRIGGER,
         "ALTER TRIGGER pol_stamp DISABLE",
         "ALTER PACKAGE billing COMPILE BODY PLSQL_OPTIMIZE_LEVEL = 1 REUSE SETTINGS")
    trig = loop.capture(ObjectRef("trigger", "POL_STAMP"))
    assert trig.attributes["trigger_status"] == "DISABLED"
    body = loop.capture(ObjectRef("package_body", "BILLING"))
    assert body.attributes["plsql_optimize_level"] == "1"
    assert "editionable" in body.attributes
    # a change, then its compensation: the settings and the disabled state come back
    plan = loop.plan([Change(BODY_V1.replace("1.1", "1.3"), base_snapshot_id=body.id),
                      Change(TRIGGER.replace("premium(:new.base)", "premium(:new.base) + 0"),
                             base_snapshot_id=trig.id)])
    assert loop.execute(plan).outcome == "applied_verified"
    comp = loop.compensate(plan)
    assert comp.ok, comp.to_dict()
    assert loop.capture(ObjectRef("trigger", "POL_STAMP")).id == trig.id
    assert loop.capture(ObjectRef("package_body", "BILLING")).id == body.id


def test_sweep_recompiles_only_invalid_dependents(loop: DdlLoop, target: URL) -> None:
    _run(target, "CREATE OR REPLACE FUNCTION other(p NUMBER) RETURN NUMBER IS BEGIN "
                 "RETURN billing.premium(p); END other;")
    spec = loop.capture(ObjectRef("package", "BILLING"))
    body = loop.capture(ObjectRef("package_body", "BILLING"))
    plan = loop.plan([Change(SPEC_V1, base_snapshot_id=spec.id),
                      Change(BODY_V1, base_snapshot_id=body.id)])
    outcome = loop.execute(plan)
    assert outcome.outcome == "applied_verified", outcome.to_dict()
    assert outcome.verify is not None
    deps = [c for c in outcome.verify.checks if c.name == "dependent"]
    assert deps and all(c.verdict == "passed" for c in deps)
