"""Snapshots: content addressed, immutable, exported for a git mirror (SQLite and PostgreSQL)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.ddl.catalog import ObjectRef, adapter_for
from capgate.ddl.signature import Signature, sign
from capgate.ddl.snapshots import Snapshot, SqlSnapshotStore
from capgate.registry.errors import ObjectNotFound, SnapshotOverwrite

REF = ObjectRef("package_body", "billing", "app")
SOURCE = 'CREATE OR REPLACE DEFINER="root"@"%" PACKAGE BODY "billing" AS\n  x INT := 0;\nEND'


def _snap(source: str | None = SOURCE) -> Snapshot:
    ad = adapter_for("mariadb")
    sig = sign(ad.normalise(REF, source)) if source is not None else Signature.absent()
    return Snapshot.create("mariadb", REF, source, sig, {"sql_mode": "ORACLE"})


def test_snapshot_id_is_content_not_time() -> None:
    a, b = _snap(), _snap()
    assert a.id == b.id and a.id.startswith("sha256:")
    assert a.verify()
    assert _snap(SOURCE + "\n-- edit").id != a.id
    absent = _snap(None)
    assert not absent.exists and str(absent.signature) == "v2:absent" and absent.id != a.id


def test_store_put_is_idempotent_and_refuses_overwrite(ledger_url: URL) -> None:
    store = SqlSnapshotStore(ledger_url)
    snap = _snap()
    assert store.put(snap) is True
    assert store.put(snap) is False
    assert store.put(dataclasses.replace(snap, captured_at="2030-01-01T00:00:00Z")) is False
    forged = dataclasses.replace(snap, source=snap.source + "\n-- changed in place")
    with pytest.raises(SnapshotOverwrite) as exc:
        store.put(forged)
    assert exc.value.code == "CG506"
    assert exc.value.details["snapshot_id"] == snap.id
    got = store.get(snap.id)
    assert got.same_content(snap) and got.source == SOURCE
    assert [s.id for s in store.history(REF)] == [snap.id]
    with pytest.raises(ObjectNotFound):
        store.get("sha256:" + "0" * 64)
    store.dispose()


def test_rows_cannot_be_updated_or_deleted(ledger_url: URL) -> None:
    store = SqlSnapshotStore(ledger_url)
    snap = _snap()
    store.put(snap)
    eng = sa.create_engine(ledger_url, poolclass=sa.pool.NullPool)
    for stmt in ("UPDATE cg_ddl_snapshots SET source = 'x'", "DELETE FROM cg_ddl_snapshots"):
        with pytest.raises(sa.exc.DBAPIError, match="immutable"), eng.begin() as conn:
            conn.execute(sa.text(stmt))
    eng.dispose()
    assert store.get(snap.id).source == SOURCE
    store.dispose()


def test_export_writes_one_file_per_snapshot_and_is_stable(ledger_url: URL,
                                                           tmp_path: Path) -> None:
    store = SqlSnapshotStore(ledger_url)
    first, second = _snap(), _snap(SOURCE.replace("0", "1"))
    store.put(first)
    store.put(second)
    out = store.export(tmp_path / "mirror")
    sql_files = sorted(p for p in out.written if p.endswith(".sql"))
    assert len(sql_files) == 2 and "index.json" in out.written
    assert all(p.startswith("mariadb/app/package_body/billing/") for p in sql_files)
    index = json.loads((tmp_path / "mirror" / "index.json").read_text())
    assert [s["snapshot_id"] for s in index["snapshots"]] == [first.id, second.id]
    path = tmp_path / "mirror" / index["snapshots"][0]["path"]
    assert path.read_text() == first.source
    again = store.export(tmp_path / "mirror")
    assert again.written == () and len(again.unchanged) == 3
    store.dispose()
