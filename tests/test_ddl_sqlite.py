"""The DDL loop on SQLite (the demo's engine): views and triggers, transactional DDL."""

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
from capgate.registry.errors import MergeRequired, UnsupportedObjectType

V_PREM = ObjectRef("view", "v_prem")


@pytest.fixture
def loop(sqlite_url: URL, tmp_path: Path) -> Iterator[DdlLoop]:
    eng = sa.create_engine(sqlite_url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE pol (id INTEGER PRIMARY KEY, base INTEGER)"))
        conn.execute(sa.text("INSERT INTO pol VALUES (1, 100), (2, 200)"))
        conn.execute(sa.text("CREATE VIEW v_prem AS SELECT id, base * 11 / 10 AS p FROM pol"))
        conn.execute(sa.text("CREATE VIEW v_total AS SELECT sum(p) AS total FROM v_prem"))
        conn.execute(sa.text("CREATE TABLE audit (id INTEGER)"))
        conn.execute(sa.text("CREATE TRIGGER pol_audit AFTER INSERT ON pol "
                             "BEGIN INSERT INTO audit VALUES (new.id); END"))
    eng.dispose()
    store = SqlSnapshotStore(f"sqlite:///{tmp_path / 'ledger.db'}")
    with DdlLoop(sqlite_url, store, sink=ListSink()) as lp:
        yield lp
    store.dispose()


def test_view_loop_success_and_dependents(loop: DdlLoop) -> None:
    snap = loop.capture(V_PREM)
    assert snap.source.startswith("CREATE VIEW v_prem AS")
    plan = loop.plan(
        [Change("CREATE VIEW v_prem AS SELECT id, base * 12 / 10 AS p FROM pol;",
                base_snapshot_id=snap.id)],
        smoke=[SmokeCall("total", "SELECT total FROM v_total", 360)],
    )
    assert [d["key"] for d in plan.dependents] == ["view:main.v_total"]
    outcome = loop.execute(plan)
    assert outcome.outcome == "applied_verified", outcome.to_dict()
    assert outcome.objects[0].applied_signature == plan.objects[0]["expected_signature"]
    assert loop.classify(plan).classification == "applied"


def test_broken_dependent_rolls_back(loop: DdlLoop) -> None:
    snap = loop.capture(V_PREM)
    plan = loop.plan([Change("CREATE VIEW v_prem AS SELECT id, base AS premium FROM pol",
                             base_snapshot_id=snap.id)])
    outcome = loop.execute(plan)
    assert outcome.outcome == "rolled_back", outcome.to_dict()
    assert outcome.restored
    failed = outcome.verify.failures if outcome.verify else ()
    assert [c.object for c in failed] == ["view:main.v_total"]
    assert loop.capture(V_PREM).id == snap.id


def test_concurrent_edit_is_refused(loop: DdlLoop, sqlite_url: URL) -> None:
    snap = loop.capture(V_PREM)
    plan = loop.plan([Change("CREATE VIEW v_prem AS SELECT id, base AS p FROM pol",
                             base_snapshot_id=snap.id)])
    eng = sa.create_engine(sqlite_url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        conn.execute(sa.text("DROP VIEW v_prem"))
        conn.execute(sa.text("CREATE VIEW v_prem AS SELECT id, base * 2 AS p FROM pol"))
    eng.dispose()
    with pytest.raises(MergeRequired):
        loop.execute(plan)


def test_trigger_capture_and_unsupported_kinds(loop: DdlLoop) -> None:
    trig = loop.capture(ObjectRef("trigger", "pol_audit"))
    assert trig.attributes == {"table": "pol"}
    with pytest.raises(UnsupportedObjectType):
        loop.capture(ObjectRef("package", "billing"))
