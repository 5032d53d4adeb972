"""The DDL loop for stored code: capture, plan, preflight, apply, verify, compensate.

Public API::

    from capgate.ddl import DdlLoop, SqlSnapshotStore, Change, ObjectRef

    store = SqlSnapshotStore("sqlite:///.capgate/ledger.db")
    with DdlLoop("mysql+pymysql://app@db/app", store) as loop:
        snap = loop.capture(ObjectRef("package_body", "billing"))
        plan = loop.plan([Change(new_source, base_snapshot_id=snap.id)])
        outcome = loop.execute(plan, on_apply_started=ledger_hook)

See ``ddl.loop`` for the steps, ``ddl.plan`` for the plan a person approves,
``ddl.catalog`` for the adapters' protocol, ``ddl.signature`` for the content
signature and ``ddl.prohibitions`` for the six standing prohibitions.
"""

from capgate.ddl.catalog import (
    CallerSearch,
    CatalogAdapter,
    Dependent,
    LiveObject,
    ObjectRef,
    ObjectStatus,
    adapter_for,
)
from capgate.ddl.events import DdlEventSink, ListSink, NullSink
from capgate.ddl.loop import DdlLoop
from capgate.ddl.merge import MergeProposal
from capgate.ddl.plan import DdlPlan, check_plan, plan_hash
from capgate.ddl.prohibitions import PROHIBITIONS, Prohibition
from capgate.ddl.results import (
    Change,
    CompensationReport,
    DdlOutcome,
    FarSideStep,
    PreflightResult,
    RecoveryReport,
    SmokeCall,
    VerifyReport,
)
from capgate.ddl.signature import Signature, normalise, sign, signature_of
from capgate.ddl.snapshots import Snapshot, SnapshotStore, SqlSnapshotStore, export_snapshots

__all__ = [
    "PROHIBITIONS",
    "CallerSearch",
    "CatalogAdapter",
    "Change",
    "CompensationReport",
    "DdlEventSink",
    "DdlLoop",
    "DdlOutcome",
    "DdlPlan",
    "Dependent",
    "FarSideStep",
    "ListSink",
    "LiveObject",
    "MergeProposal",
    "NullSink",
    "ObjectRef",
    "ObjectStatus",
    "PreflightResult",
    "Prohibition",
    "RecoveryReport",
    "Signature",
    "SmokeCall",
    "Snapshot",
    "SnapshotStore",
    "SqlSnapshotStore",
    "VerifyReport",
    "adapter_for",
    "check_plan",
    "export_snapshots",
    "normalise",
    "plan_hash",
    "sign",
    "signature_of",
]
