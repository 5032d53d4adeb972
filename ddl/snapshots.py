"""Immutable, content-addressed snapshots of stored-code objects, and where they are kept.

A snapshot is the exact source the catalog gave (re-appliable DDL), its
attributes (e.g. MariaDB ``sql_mode``), its signature over the normalised
text, and an id that is the canonical hash of all of that -- never of the
time it was taken.  Storing the identical snapshot again is a no-op; a
snapshot id that already holds different content raises ``SnapshotOverwrite``.

``SqlSnapshotStore`` keeps them in table ``cg_ddl_snapshots`` of a ledger
database (SQLite or PostgreSQL through SQLAlchemy; on both, triggers refuse
``UPDATE`` and ``DELETE`` of a row).  ``export(dir)`` writes one ``.sql`` file
per snapshot plus an ``index.json`` for a git mirror.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from capgate.ddl.catalog import ObjectRef
from capgate.ddl.signature import Signature
from capgate.executor.ledger.backends import backend_named
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import ObjectNotFound, SnapshotOverwrite, SnapshotTampered


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Snapshot:
    """One captured object, addressed by its content."""

    id: str
    """``sha256:<hex>``: the canonical hash of dialect, object, source, attributes and signature."""
    dialect: str
    object: ObjectRef
    exists: bool
    """False when the object did not exist at capture (compensation then drops it)."""
    source: str
    """The catalog's source, exactly as read (empty when the object does not exist)."""
    signature: Signature
    attributes: dict[str, str] = field(default_factory=dict)
    captured_at: str = ""
    """When it was taken (informational; not part of the id)."""

    @staticmethod
    def content_id(
        dialect: str,
        obj: ObjectRef,
        exists: bool,
        source: str,
        attributes: Mapping[str, str],
        signature: Signature,
    ) -> str:
        return canonical_hash(
            {
                "kind": "capgate.ddl.snapshot/1",
                "dialect": dialect,
                "object": obj.to_dict(),
                "exists": exists,
                "source_sha256": hashlib.sha256(source.encode("utf-8")).hexdigest(),
                "attributes": dict(sorted(attributes.items())),
                "signature": str(signature),
            }
        )

    @classmethod
    def create(
        cls,
        dialect: str,
        obj: ObjectRef,
        source: str | None,
        signature: Signature,
        attributes: Mapping[str, str] | None = None,
    ) -> Snapshot:
        exists = source is not None
        attrs = dict(attributes or {})
        src = source or ""
        sid = cls.content_id(dialect, obj, exists, src, attrs, signature)
        return cls(sid, dialect, obj, exists, src, signature, attrs, _now())

    def verify(self) -> bool:
        """Whether the id still matches the content."""
        return self.id == self.content_id(
            self.dialect, self.object, self.exists, self.source, self.attributes, self.signature
        )

    def same_content(self, other: Snapshot) -> bool:
        return (
            self.id == other.id
            and self.dialect == other.dialect
            and self.object == other.object
            and self.exists == other.exists
            and self.source == other.source
            and dict(self.attributes) == dict(other.attributes)
            and str(self.signature) == str(other.signature)
            and self.signature.blocks == other.signature.blocks
        )

    def to_dict(self, *, with_source: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "snapshot_id": self.id,
            "dialect": self.dialect,
            "object": self.object.to_dict(),
            "key": self.object.key,
            "exists": self.exists,
            "signature": str(self.signature),
            "blocks": list(self.signature.blocks),
            "lines": self.signature.lines,
            "attributes": dict(self.attributes),
            "captured_at": self.captured_at,
        }
        if with_source:
            out["source"] = self.source
        return out


@runtime_checkable
class SnapshotStore(Protocol):
    """Where snapshots live; ids are content addresses, rows never change."""

    def put(self, snapshot: Snapshot) -> bool:
        """Store it; True if new, False if the identical snapshot was already there.

        Raise SnapshotOverwrite if the id holds different content.
        """
        ...

    def get(self, snapshot_id: str) -> Snapshot:
        """The snapshot with this id; ObjectNotFound if there is none."""
        ...

    def history(self, obj: ObjectRef | None = None, dialect: str | None = None) -> list[Snapshot]:
        """Snapshots (of one object, if given), oldest first."""
        ...

    def export(self, directory: str | Path) -> ExportResult:
        """Write every snapshot as a file under ``directory`` (for a git mirror)."""
        ...


@dataclass(frozen=True)
class ExportResult:
    directory: str
    written: tuple[str, ...]
    unchanged: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "written": list(self.written),
            "unchanged": list(self.unchanged),
        }


_metadata = sa.MetaData()
snapshots_table = sa.Table(
    "cg_ddl_snapshots",
    _metadata,
    sa.Column("snapshot_id", sa.String(80), primary_key=True),
    sa.Column("dialect", sa.String(32), nullable=False),
    sa.Column("object_key", sa.String(600), nullable=False, index=True),
    sa.Column("object_json", sa.Text, nullable=False),
    sa.Column("exists_flag", sa.Boolean, nullable=False),
    sa.Column("signature", sa.String(100), nullable=False),
    sa.Column("signature_json", sa.Text, nullable=False),
    sa.Column("source", sa.Text, nullable=False),
    sa.Column("attributes_json", sa.Text, nullable=False),
    sa.Column("captured_at", sa.String(40), nullable=False),
    sa.Column("seq", sa.Integer, nullable=True),
)

baselines_table = sa.Table(
    "cg_ddl_baselines",
    _metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("target", sa.String(600), nullable=False),
    sa.Column("object_key", sa.String(600), nullable=False, index=True),
    sa.Column("plan_hash", sa.String(80), nullable=False),
    sa.Column("statuses_json", sa.Text, nullable=False),
    sa.Column("recorded_at", sa.String(40), nullable=False),
)
"""The statuses an apply found *before* it changed an object (the object's and its
dependents'), so that ``ddl verify OBJECT`` later judges a dependent that was already
invalid then exactly as that apply did -- a warning, not a failure."""


def _row_to_snapshot(row: Any) -> Snapshot:
    """A stored row as a snapshot, refused (SnapshotTampered) unless it is what its id says.

    Checked on every read -- the base of a plan, an apply, a compensation, an
    export -- not only at apply: a snapshot is what compensation restores.
    """
    sid = str(row.snapshot_id)
    try:
        snap = Snapshot(
            id=sid,
            dialect=str(row.dialect),
            object=ObjectRef.from_dict(json.loads(row.object_json)),
            exists=bool(row.exists_flag),
            source=str(row.source),
            signature=Signature.from_dict(json.loads(row.signature_json)),
            attributes=dict(json.loads(row.attributes_json)),
            captured_at=str(row.captured_at),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotTampered(
            f"stored snapshot {sid} is damaged ({exc}); it is refused -- restore the store from "
            "a backup or capture the object again", snapshot_id=sid, problem=str(exc)) from None
    if not snap.verify() or str(row.signature) != str(snap.signature) or (
            str(row.object_key) != snap.object.key):
        raise SnapshotTampered(
            f"stored snapshot {sid} of {row.object_key} does not match its content address "
            "(its source, attributes or signature were edited in the store); it is refused -- "
            "restore the store from a backup or capture the object again",
            snapshot_id=sid, object=str(row.object_key),
            computed=Snapshot.content_id(snap.dialect, snap.object, snap.exists, snap.source,
                                         snap.attributes, snap.signature))
    return snap


class SqlSnapshotStore:
    """Snapshots in table ``cg_ddl_snapshots`` of a ledger database (SQLite or PostgreSQL)."""

    def __init__(self, url: str | URL | Engine) -> None:
        if isinstance(url, Engine):
            self.engine = url
        else:
            self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self._ready = False

    def _setup(self) -> None:
        if self._ready:
            return
        with self.engine.begin() as conn:
            backend = backend_named(conn.dialect.name)
            if backend is not None:
                backend.lock_setup(conn, snapshots_table.name)
            _metadata.create_all(conn, checkfirst=True)
            statements = () if backend is None else backend.append_only_sql(
                conn, snapshots_table.name)
            for stmt in statements:
                conn.exec_driver_sql(stmt, execution_options={"no_parameters": True})
        self._ready = True

    def put(self, snapshot: Snapshot) -> bool:
        self._setup()
        existing = self._get(snapshot.id)
        if existing is not None:
            if existing.same_content(snapshot):
                return False
            raise SnapshotOverwrite(
                f"snapshot {snapshot.id} already exists with different content; snapshots are "
                "immutable -- capture again to get a new snapshot",
                snapshot_id=snapshot.id,
                stored_signature=str(existing.signature),
                offered_signature=str(snapshot.signature),
                object=snapshot.object.key,
            )
        t = snapshots_table
        try:
            with self.engine.begin() as conn:
                seq = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                conn.execute(
                    t.insert().values(
                        snapshot_id=snapshot.id,
                        dialect=snapshot.dialect,
                        object_key=snapshot.object.key,
                        object_json=json.dumps(snapshot.object.to_dict(), sort_keys=True),
                        exists_flag=snapshot.exists,
                        signature=str(snapshot.signature),
                        signature_json=json.dumps(snapshot.signature.to_dict(), sort_keys=True),
                        source=snapshot.source,
                        attributes_json=json.dumps(dict(snapshot.attributes), sort_keys=True),
                        captured_at=snapshot.captured_at or _now(),
                        seq=int(seq) + 1,
                    )
                )
        except sa.exc.IntegrityError:
            # Another process stored the same id in between: compare again.
            return self.put(snapshot)
        return True

    def _get(self, snapshot_id: str) -> Snapshot | None:
        t = snapshots_table
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(t).where(t.c.snapshot_id == snapshot_id)).first()
        return None if row is None else _row_to_snapshot(row)

    def get(self, snapshot_id: str) -> Snapshot:
        self._setup()
        snap = self._get(snapshot_id)
        if snap is None:
            raise ObjectNotFound(f"no snapshot {snapshot_id}", snapshot_id=snapshot_id)
        return snap

    def history(self, obj: ObjectRef | None = None, dialect: str | None = None) -> list[Snapshot]:
        self._setup()
        t = snapshots_table
        q = sa.select(t).order_by(t.c.captured_at, t.c.seq, t.c.snapshot_id)
        if obj is not None:
            q = q.where(t.c.object_key == obj.key)
        if dialect is not None:
            q = q.where(t.c.dialect == dialect)
        with self.engine.connect() as conn:
            return [_row_to_snapshot(r) for r in conn.execute(q)]

    def export(self, directory: str | Path) -> ExportResult:
        return export_snapshots(self.history(), directory)

    def record_baseline(self, target: str, object_key: str, plan_hash: str,
                        statuses: Mapping[str, Mapping[str, Any]]) -> None:
        """Keep the statuses found before an apply of ``object_key`` on ``target``."""
        self._setup()
        with self.engine.begin() as conn:
            conn.execute(baselines_table.insert().values(
                target=target, object_key=object_key, plan_hash=plan_hash,
                statuses_json=json.dumps({k: dict(v) for k, v in statuses.items()},
                                         sort_keys=True),
                recorded_at=_now()))

    def baseline(self, target: str, object_key: str) -> dict[str, dict[str, Any]] | None:
        """The statuses found before the latest apply of the object on ``target``."""
        self._setup()
        t = baselines_table
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(t.c.statuses_json).where(
                t.c.target == target, t.c.object_key == object_key).order_by(
                t.c.seq.desc()).limit(1)).first()
        return None if row is None else dict(json.loads(row[0]))

    def dispose(self) -> None:
        self.engine.dispose()


_SAFE = re.compile(r"[^A-Za-z0-9_.$#-]+")


def _safe(part: str) -> str:
    return _SAFE.sub("_", part).strip("._") or "_"


def export_snapshots(snapshots: Iterable[Snapshot], directory: str | Path) -> ExportResult:
    """Write ``<dialect>/<schema>/<kind>/<name>/<id>.sql`` per snapshot and ``index.json``.

    Files are content addressed, so exporting again rewrites nothing; the
    index lists every snapshot in capture order with its signature and path.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    unchanged: list[str] = []
    index: list[dict[str, Any]] = []
    for snap in snapshots:
        obj = snap.object
        name = obj.name + (f"({obj.args})" if obj.args else "")
        rel = Path(
            _safe(snap.dialect), _safe(obj.schema or "_"), _safe(obj.kind), _safe(name),
            snap.id.split(":", 1)[-1][:24] + ".sql",
        )
        path = root / rel
        content = snap.source if snap.exists else "-- (object did not exist at capture)\n"
        if path.exists() and path.read_text(encoding="utf-8") == content:
            unchanged.append(str(rel))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8", newline="")
            written.append(str(rel))
        entry = snap.to_dict(with_source=False)
        entry["path"] = str(rel)
        index.append(entry)
    index_text = json.dumps({"snapshots": index}, indent=2, sort_keys=True) + "\n"
    index_path = root / "index.json"
    if index_path.exists() and index_path.read_text(encoding="utf-8") == index_text:
        unchanged.append("index.json")
    else:
        index_path.write_text(index_text, encoding="utf-8")
        written.append("index.json")
    return ExportResult(str(root), tuple(written), tuple(unchanged))
