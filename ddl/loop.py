"""The DDL loop: capture, plan, preflight, apply, verify, compensate, and recovery.

``DdlLoop`` works on one target database through its catalog adapter, keeps
snapshots in a ``SnapshotStore`` and reports every boundary to a
``DdlEventSink`` (the ledger, once wired).

* ``capture(obj)`` -- read, normalise, sign, store an immutable snapshot.
* ``plan(changes)`` -- no DDL is committed: objects with their current
  signatures, local and remote dependents, the caller search as evidence, a
  warning for stateful packages, the prohibition checks; a plain dict with a
  canonical ``plan_hash``.  (On PostgreSQL the new source is rendered in a
  savepoint that is always rolled back, so the plan knows the exact text the
  catalog will show.)
* ``execute(plan)`` -- under a session-scoped lock on its own connection:
  preflight (live signature == snapshot signature, else ``MergeRequired``
  with a three-way merge proposal), apply, verify.  Transactional DDL
  (PostgreSQL, SQLite): apply and verify in one transaction, a failed verify
  rolls back.  Otherwise (MariaDB, Oracle): ``on_apply_started(snapshot_ids)``
  and the ``ddl.apply_started`` event come *before* the DDL, and a failed
  apply or verify is compensated from the snapshots.
* ``compensate(plan)`` / ``verify(plan)`` / ``classify(plan)`` -- for a
  resumed case: restore, re-check, or tell ``applied`` / ``not_applied`` /
  ``partly_applied`` / ``unknown`` from the live signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url

from ddl import events as ev
from ddl import prohibitions
from ddl.catalog import (
    MISSING,
    BaseAdapter,
    Dependent,
    LiveObject,
    ObjectRef,
    ObjectStatus,
    Progress,
    adapter_for,
    first_line,
    lock_key,
)
from ddl.errors import (
    ApplyFailed,
    CompensationFailed,
    DdlProhibition,
    LockNotAcquired,
    MergeRequired,
    ObjectNotFound,
    PlanTampered,
    SchemaWideRecompile,
    VerifyFailed,
    error_details,
)
from ddl.events import DdlEventSink, NullSink
from ddl.merge import MergeProposal, propose
from ddl.results import (
    APPLIED_VERIFIED,
    COMPENSATED,
    COMPENSATION_FAILED,
    ROLLED_BACK,
    Change,
    Check,
    CompensationReport,
    DdlOutcome,
    FarSideStep,
    ObjectApply,
    ObjectRecovery,
    PreflightResult,
    RecoveryReport,
    SmokeCall,
    StatusChange,
    VerifyReport,
)
from ddl.signature import RECIPE, Signature, diff, sign
from ddl.snapshots import Snapshot, SnapshotStore
from registry.canonical import canonical_hash

PLAN_FORMAT = "capgate.ddl.plan/1"
_PLAN_KEYS = frozenset({
    "format", "dialect", "target", "recipe", "transactional_ddl", "objects", "dependents",
    "caller_search", "far_side_steps", "smoke", "recompile", "warnings", "approval",
    "prohibitions", "plan_hash",
})
OnApplyStarted = Callable[[list[str]], None]


def plan_hash(plan: Mapping[str, Any]) -> str:
    """The canonical hash of a plan (everything but the ``plan_hash`` field)."""
    return canonical_hash({k: v for k, v in plan.items() if k != "plan_hash"})


def check_plan(plan: Mapping[str, Any]) -> None:
    """Refuse a plan whose content no longer matches its hash, or of an unknown format."""
    if plan.get("format") != PLAN_FORMAT:
        raise PlanTampered(f"not a DDL plan of format {PLAN_FORMAT}", found=plan.get("format"))
    if plan.get("plan_hash") != plan_hash(plan):
        raise PlanTampered(
            "the plan's content does not match its plan_hash; make a new plan",
            recorded=plan.get("plan_hash"),
            computed=plan_hash(plan),
        )


@dataclass(frozen=True)
class _Item:
    """One object of a plan, as the apply needs it."""

    ref: ObjectRef
    base_snapshot_id: str
    base_signature: str
    new_source: str
    new_signature: str
    expected_signature: str | None
    attributes: dict[str, str]

    @property
    def key(self) -> str:
        return self.ref.key

    @classmethod
    def from_plan(cls, o: Mapping[str, Any]) -> _Item:
        return cls(
            ref=ObjectRef.from_dict(o["object"]),
            base_snapshot_id=str(o["base_snapshot_id"]),
            base_signature=str(o["base_signature"]),
            new_source=str(o["new_source"]),
            new_signature=str(o["new_signature"]),
            expected_signature=o.get("expected_signature"),
            attributes=dict(o.get("attributes") or {}),
        )


def _order(refs: Sequence[ObjectRef]) -> list[int]:
    """Indexes in apply order: as given, but a body always right after its spec."""
    keys = [r.key for r in refs]
    spec_at = {k: i for i, k in enumerate(keys)}
    deferred: dict[str, int] = {}
    out: list[int] = []
    for i, r in enumerate(refs):
        spec = r.spec()
        if spec is not None and spec.key in spec_at and spec_at[spec.key] > i:
            deferred[spec.key] = i
            continue
        out.append(i)
        if r.key in deferred:
            out.append(deferred.pop(r.key))
    out.extend(deferred.values())
    return out


def _same(value: Any, expect: Any) -> bool:
    if value == expect:
        return True
    return str(value) == str(expect)


def _redacted(url: URL) -> str:
    return url.render_as_string(hide_password=True)


class DdlLoop:
    """The DDL loop on one target database."""

    def __init__(
        self,
        target: str | URL,
        store: SnapshotStore,
        *,
        sink: DdlEventSink | None = None,
        adapter: BaseAdapter | None = None,
        scope: Sequence[str] | None = None,
        target_label: str | None = None,
        lock_timeout: float = 10.0,
        progress: Progress | None = None,
        far_side: Mapping[str, str | URL] | None = None,
    ) -> None:
        """
        :param target: SQLAlchemy URL of the target database.
        :param store: where snapshots are kept (the ledger database).
        :param sink: receives every event (``ddl.*``); the ledger in production.
        :param adapter: the catalog adapter; chosen from the URL when None.
        :param scope: schemas searched for callers and dependents (default: the object's own).
        :param target_label: the target's name in plans and lock keys (default: the URL
            without password).
        :param lock_timeout: seconds to wait for the per-object session lock.
        :param progress: ``progress(done, total, label)`` during dependent sweeps.
        :param far_side: database link name -> URL of the far database, for remote
            dependents and far-side steps.
        """
        self.url = make_url(target)
        self.adapter = adapter or adapter_for(self.url, scope=scope)
        self.store = store
        self.sink: DdlEventSink = sink or NullSink()
        self.target = target_label or _redacted(self.url)
        self.lock_timeout = lock_timeout
        self.progress = progress
        self.far_side = {k: make_url(v) for k, v in (far_side or {}).items()}
        self.engine: Engine = self.adapter.engine(self.url)

    # -- plumbing ----------------------------------------------------------------------------
    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> DdlLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dialect(self) -> str:
        return self.adapter.dialect

    def _emit(self, kind: str, payload: dict[str, Any]) -> None:
        self.sink.record(kind, {"dialect": self.dialect, "target": self.target, **payload})

    def _signature(self, ref: ObjectRef, live: LiveObject | None) -> Signature:
        if live is None:
            return Signature.absent()
        return sign(self.adapter.normalise(ref, live.source))

    def _live(self, conn: Connection, ref: ObjectRef) -> tuple[LiveObject | None, Signature]:
        live = self.adapter.read(conn, ref)
        return live, self._signature(ref, live)

    def _snapshot(self, ref: ObjectRef, live: LiveObject | None) -> Snapshot:
        return Snapshot.create(
            self.dialect,
            ref,
            None if live is None else live.source,
            self._signature(ref, live),
            None if live is None else live.attributes,
        )

    def _status(self, conn: Connection, ref: ObjectRef) -> ObjectStatus:
        return self.adapter.status(conn, ref)

    @contextmanager
    def _locked(self, refs: Sequence[ObjectRef]) -> Iterator[None]:
        """Session-scoped locks on every object, taken on a connection of their own."""
        names = sorted({lock_key(self.dialect, r) for r in refs})
        conn = self.engine.connect()
        if self.dialect != "sqlite":
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        held: list[str] = []
        try:
            for name in names:
                if not self.adapter.acquire_lock(conn, name, self.lock_timeout):
                    raise LockNotAcquired(
                        f"could not take the DDL lock on {[r.key for r in refs]} within "
                        f"{self.lock_timeout:g}s; another DDL loop holds it",
                        lock=name,
                        objects=[r.key for r in refs],
                        timeout=self.lock_timeout,
                    )
                held.append(name)
            yield
        finally:
            for name in reversed(held):
                with suppress(sa.exc.DBAPIError):
                    self.adapter.release_lock(conn, name)
            conn.close()

    # -- capture -------------------------------------------------------------------------------
    def capture(self, obj: ObjectRef | str) -> Snapshot:
        """Read the object, store its snapshot (a no-op if identical) and return it."""
        ref = ObjectRef.parse(obj) if isinstance(obj, str) else obj
        with self.engine.connect() as conn:
            ref = self.adapter.resolve(conn, ref)
            live = self.adapter.read(conn, ref)
            if live is not None:
                ref = live.object
            conn.rollback()
        snap = self._snapshot(ref, live)
        new = self.store.put(snap)
        self._emit(ev.CAPTURED, {"snapshot_id": snap.id, "object": ref.key,
                                 "signature": str(snap.signature), "exists": snap.exists,
                                 "new": new})
        return snap

    def capture_many(self, objs: Sequence[ObjectRef | str]) -> list[Snapshot]:
        out = []
        for i, obj in enumerate(objs, start=1):
            out.append(self.capture(obj))
            if self.progress is not None:
                self.progress(i, len(objs), str(obj))
        return out

    # -- plan ------------------------------------------------------------------------------------
    def plan(
        self,
        changes: Sequence[Change],
        *,
        far_side_steps: Sequence[FarSideStep] = (),
        smoke: Sequence[SmokeCall] = (),
        recompile: Sequence[str] = (),
        remote_dependents: Sequence[Dependent] = (),
        search_callers: bool = True,
        render: bool = True,
        refuse: bool = True,
        bind: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Make the plan for ``changes``; raise the first prohibition it violates (``refuse``).

        ``remote_dependents`` are declared by the row or the DBA (the local
        catalog cannot see them); dependents found through ``far_side``
        catalogs are added.  ``search_callers=False`` records no caller search
        -- the plan is then refused as ungrepped.  ``bind`` adds the caller's
        fields to the plan, covered by its hash (the executor binds the row's
        ``operation_id``, ``version``, ``row_hash``, connector and environment,
        so an approval of the hash is an approval of that row on that target).
        """
        if not changes:
            raise ValueError("a plan needs at least one change")
        if bind and set(bind) & _PLAN_KEYS:
            raise ValueError(f"bind may not set the plan's own fields "
                             f"{sorted(set(bind) & _PLAN_KEYS)}")
        objects: list[dict[str, Any]] = []
        warnings: list[str] = []
        searches: list[dict[str, Any]] = []
        merges: list[dict[str, Any]] = []
        deps: dict[str, dict[str, Any]] = {}
        with self.engine.connect() as conn:
            refs: list[ObjectRef] = []
            for ch in changes:
                if ch.object is not None:
                    ref = self.adapter.resolve(conn, ch.object)
                else:
                    ref = self.adapter.identify(conn, ch.source)
                live, live_sig = self._live(conn, ref)
                if live is not None:
                    ref = live.object
                refs.append(ref)
                if ch.base_snapshot_id:
                    base = self.store.get(ch.base_snapshot_id)
                    if base.object.key != ref.key or base.dialect != self.dialect:
                        raise ObjectNotFound(
                            f"snapshot {base.id} is of {base.dialect} {base.object.key}, "
                            f"not of {self.dialect} {ref.key}",
                            snapshot_id=base.id,
                        )
                else:
                    base = self._snapshot(ref, live)
                    new = self.store.put(base)
                    self._emit(ev.CAPTURED, {"snapshot_id": base.id, "object": ref.key,
                                             "signature": str(base.signature),
                                             "exists": base.exists, "new": new})
                attributes = {**self._default_attributes(ref), **base.attributes,
                              **dict(ch.attributes)}
                new_norm = self.adapter.normalise(ref, ch.source)
                new_sig = sign(new_norm)
                expected: str | None = None
                entry: dict[str, Any] = {}
                rendered: str | None = None
                if render:
                    try:
                        rendered = self.adapter.render(conn, ref, ch.source)
                    except ApplyFailed as exc:
                        warnings.append(f"{ref.key}: the new source does not apply: "
                                        f"{exc.message}")
                        entry["render_error"] = exc.message
                    if rendered is not None:
                        expected = str(sign(rendered))
                        if rendered != new_norm:
                            entry["rendered_source"] = rendered
                status_before = self._status(conn, ref) if live is not None else None
                state = self.adapter.holds_state(ref, live.source if live else "")
                state += [s for s in self.adapter.holds_state(ref, ch.source) if s not in state]
                if state and live is not None:
                    warnings.append(
                        f"{ref.key}: the package holds state ({'; '.join(state[:3])}); "
                        "replacing it discards that state in every session using it "
                        "(Oracle ORA-04068)"
                    )
                to_sig = sign(rendered) if rendered is not None else new_sig
                entry.update({
                    "key": ref.key,
                    "object": ref.to_dict(),
                    "change": "replace" if live is not None else "create",
                    "base_snapshot_id": base.id,
                    "base_signature": str(base.signature),
                    "live_signature": str(live_sig),
                    "new_source": ch.source,
                    "new_signature": str(new_sig),
                    "expected_signature": expected,
                    "changed_blocks": [c.to_dict() for c in diff(base.signature, to_sig).changed]
                    if base.signature.exists else [],
                    "attributes": attributes,
                    "status_before": None if status_before is None else status_before.to_dict(),
                    "holds_state": state,
                })
                if ref.is_spec:
                    body = ref.body()
                    assert body is not None
                    entry["body_exists"] = self.adapter.read(conn, body) is not None
                if str(base.signature) != str(live_sig):
                    merges.append(self._merge(ref, base, ch.source, live,
                                              entry.get("rendered_source")).to_dict())
                objects.append(entry)
            plan_keys = {r.key for r in refs}
            for ref in refs:
                for d in self.adapter.dependents(conn, ref, self.progress):
                    if d.object.key in plan_keys or d.object.key in deps:
                        continue
                    row = d.to_dict()
                    row["status_before"] = self._status(conn, d.object).to_dict()
                    deps[d.object.key] = row
                if search_callers:
                    searches.append(self.adapter.search_callers(conn, ref).to_dict())
            conn.rollback()
        for d in list(remote_dependents) + self._far_dependents(refs):
            if d.object.key not in deps:
                row = d.to_dict()
                row["status_before"] = None
                deps[d.object.key] = row
        for s in searches:
            if s["hits"]:
                warnings.append(f"{s['object']}: {len(s['hits'])} caller line(s) found in "
                                f"{len({h['object'] for h in s['hits']})} object(s); review them")
        plan: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "dialect": self.dialect,
            "target": self.target,
            "recipe": RECIPE,
            "transactional_ddl": self.adapter.transactional_ddl,
            "objects": [objects[i] for i in _order(refs)],
            "dependents": sorted(deps.values(), key=lambda d: str(d["key"])),
            "caller_search": searches if search_callers else None,
            "far_side_steps": [s.to_dict() for s in far_side_steps],
            "smoke": [s.to_dict() for s in smoke],
            "recompile": list(recompile),
            "warnings": warnings,
            "approval": {"required": True, "reason": "DDL rows are gated: a person approves "
                         "this plan hash before it is applied"},
        }
        plan.update(bind or {})
        plan["prohibitions"] = prohibitions.summary(plan)
        plan["plan_hash"] = plan_hash(plan)
        self._emit(ev.PLANNED, {"plan_hash": plan["plan_hash"],
                                "objects": [o["key"] for o in plan["objects"]],
                                "snapshot_ids": [o["base_snapshot_id"] for o in plan["objects"]],
                                "warnings": warnings})
        if refuse:
            try:
                prohibitions.refuse(plan, {"plan_hash": plan["plan_hash"], "merge": merges}
                                    if merges else {"plan_hash": plan["plan_hash"]})
            except DdlProhibition as exc:
                self._emit(ev.REFUSED, {"plan_hash": plan["plan_hash"], "code": exc.code,
                                        "message": exc.message})
                raise
        return plan

    def _default_attributes(self, ref: ObjectRef) -> dict[str, str]:
        if self.dialect == "mariadb" and ref.kind in ("package", "package_body"):
            return {"sql_mode": "ORACLE"}
        return {}

    def _far_dependents(self, refs: Sequence[ObjectRef]) -> list[Dependent]:
        out: list[Dependent] = []
        for link, url in self.far_side.items():
            far_adapter = adapter_for(url)
            eng = far_adapter.engine(url)
            try:
                with eng.connect() as far:
                    for ref in refs:
                        out += self.adapter.remote_dependents(far, ref, link)
            finally:
                eng.dispose()
        return out

    def _merge(
        self, ref: ObjectRef, base: Snapshot, new_source: str, live: LiveObject | None,
        rendered: str | None = None,
    ) -> MergeProposal:
        norm = self.adapter.normalise
        return propose(
            ref.key,
            base.id,
            norm(ref, base.source) if base.exists else "",
            rendered if rendered is not None else norm(ref, new_source),
            norm(ref, live.source) if live is not None else "",
        )

    # -- preflight ----------------------------------------------------------------------------
    def _preflight(
        self, conn: Connection, items: Sequence[_Item], snaps: Mapping[str, Snapshot],
        plan: Mapping[str, Any],
    ) -> PreflightResult:
        live_sigs: dict[str, str] = {}
        proposals: list[MergeProposal] = []
        rendered = {str(o["key"]): o.get("rendered_source") for o in plan["objects"]}
        for it in items:
            live, sig = self._live(conn, it.ref)
            live_sigs[it.key] = str(sig)
            if str(sig) != it.base_signature:
                proposals.append(self._merge(it.ref, snaps[it.key], it.new_source, live,
                                             rendered.get(it.key)))
        return PreflightResult(not proposals, live_sigs, tuple(proposals))

    def preflight(self, plan: Mapping[str, Any]) -> PreflightResult:
        """Re-read the live objects under the DDL lock and compare them with the snapshots."""
        check_plan(plan)
        items = [_Item.from_plan(o) for o in plan["objects"]]
        snaps = {it.key: self.store.get(it.base_snapshot_id) for it in items}
        with self._locked([it.ref for it in items]), self.engine.connect() as conn:
            result = self._preflight(conn, items, snaps, plan)
            conn.rollback()
        return result

    def _refuse_merge(self, plan: Mapping[str, Any], pre: PreflightResult) -> MergeRequired:
        keys = [m.object for m in pre.mismatches]
        err = MergeRequired(
            f"{', '.join(keys)} changed since the snapshot; a three-way merge proposal is "
            "attached -- review it, capture again and make a new plan",
            plan_hash=plan["plan_hash"],
            objects=keys,
            live=dict(pre.live),
            merge=[m.to_dict() for m in pre.mismatches],
        )
        self._emit(ev.REFUSED, {"plan_hash": plan["plan_hash"], "code": err.code,
                                "message": err.message, "objects": keys})
        return err

    # -- execute --------------------------------------------------------------------------------
    def execute(
        self, plan: Mapping[str, Any], *, on_apply_started: OnApplyStarted | None = None
    ) -> DdlOutcome:
        """Preflight, apply and verify the plan (and roll back or compensate on failure).

        Refusals before any DDL raise (PlanTampered, a prohibition, LockNotAcquired,
        MergeRequired).  Once DDL has run, the result is an outcome carrying its
        evidence; ``outcome.raise_for_outcome()`` raises the error behind a failure.
        ``on_apply_started(snapshot_ids)`` is called before the first DDL statement.
        """
        check_plan(plan)
        if plan.get("dialect") != self.dialect or plan.get("target") != self.target:
            raise PlanTampered(
                f"the plan is for {plan.get('dialect')} {plan.get('target')}, not for "
                f"{self.dialect} {self.target}",
                plan_target=plan.get("target"),
                target=self.target,
            )
        prohibitions.refuse(plan, {"plan_hash": plan["plan_hash"]})
        items = [_Item.from_plan(o) for o in plan["objects"]]
        snaps = {it.key: self.store.get(it.base_snapshot_id) for it in items}
        for it in items:
            if not snaps[it.key].verify():
                raise PlanTampered(f"snapshot {it.base_snapshot_id} does not match its id")
        with self._locked([it.ref for it in items]):
            if self.adapter.transactional_ddl:
                return self._execute_transactional(plan, items, snaps, on_apply_started)
            return self._execute_committing(plan, items, snaps, on_apply_started)

    def _dependent_refs(
        self, conn: Connection, plan: Mapping[str, Any], items: Sequence[_Item]
    ) -> list[ObjectRef]:
        keys = {it.key for it in items}
        found: dict[str, ObjectRef] = {}
        for d in plan.get("dependents") or []:
            if not d.get("remote"):
                ref = ObjectRef.from_dict(d["object"])
                found.setdefault(ref.key, ref)
        for it in items:
            for d in self.adapter.dependents(conn, it.ref, self.progress):
                found.setdefault(d.object.key, d.object)
        return [r for k, r in sorted(found.items()) if k not in keys]

    def _statuses(self, conn: Connection, refs: Sequence[ObjectRef]) -> dict[str, ObjectStatus]:
        return {r.key: self._status(conn, r) for r in refs}

    def _apply_items(
        self, conn: Connection, items: Sequence[_Item], plan_hash_: str
    ) -> tuple[list[ObjectApply], ApplyFailed | None]:
        done: list[ObjectApply] = []
        for it in items:
            try:
                self.adapter.apply(conn, it.ref, it.new_source, it.attributes)
            except ApplyFailed as exc:
                self._emit(ev.APPLY_FAILED, {"plan_hash": plan_hash_, "object": it.key,
                                             "error": exc.to_dict()})
                done.append(ObjectApply(it.key, it.base_snapshot_id, it.base_signature,
                                        it.expected_signature, None))
                return done, exc
            _, sig = self._live(conn, it.ref)
            done.append(ObjectApply(it.key, it.base_snapshot_id, it.base_signature,
                                    it.expected_signature, str(sig)))
            self._emit(ev.OBJECT_APPLIED, {"plan_hash": plan_hash_, "object": it.key,
                                           "snapshot_id": it.base_snapshot_id,
                                           "applied_signature": str(sig),
                                           "expected_signature": it.expected_signature})
        return done, None

    def _execute_transactional(
        self, plan: Mapping[str, Any], items: list[_Item], snaps: Mapping[str, Snapshot],
        on_apply_started: OnApplyStarted | None,
    ) -> DdlOutcome:
        ph = str(plan["plan_hash"])
        with self.engine.connect() as conn:
            self.adapter.begin(conn)
            dep_refs, before = self._start_apply(conn, plan, items, snaps, on_apply_started,
                                                 transactional=True)
            applied, failure, report, after, error = self._apply_and_verify(
                conn, plan, items, dep_refs, before, far_side=False, then="rolled back")
            if error is not None:
                conn.rollback()
                if failure is None and report is not None:
                    self._emit(ev.VERIFY_FAILED, {"plan_hash": ph, "checks": [
                        c.to_dict() for c in report.failures]})
                restored = self._restored(items, snaps)
                self._emit(ev.ROLLED_BACK, {"plan_hash": ph, "restored": restored,
                                            "error": error_details(error)})
                return self._finish(self._outcome(ROLLED_BACK, plan, applied, items, dep_refs,
                                                  before, after, report, None, error, restored))
            self._emit(ev.VERIFIED, {"plan_hash": ph,
                                     "checks": len(report.checks) if report else 0})
            conn.commit()
            self._emit(ev.COMMITTED, {"plan_hash": ph})
        far = self._far_side_checks(plan)
        if far and not all(c.passed for c in far):
            report = VerifyReport((report.checks if report else ()) + tuple(far))
            error = VerifyFailed(f"far-side step failed after commit: {_failure_text(report)}",
                                 plan_hash=ph, checks=[c.to_dict() for c in report.failures])
            return self._compensate_outcome(plan, items, snaps, dep_refs, before, after,
                                            applied, report, error)
        if far:
            report = VerifyReport((report.checks if report else ()) + tuple(far))
        return self._finish(self._outcome(APPLIED_VERIFIED, plan, applied, items, dep_refs,
                                          before, after, report, None, None, None))

    def _start_apply(
        self, conn: Connection, plan: Mapping[str, Any], items: list[_Item],
        snaps: Mapping[str, Snapshot], on_apply_started: OnApplyStarted | None,
        *, transactional: bool,
    ) -> tuple[list[ObjectRef], dict[str, ObjectStatus]]:
        """Preflight, dependents and their statuses before, then "apply started".

        "Apply started" (with the snapshot ids) is recorded BEFORE the DDL: where DDL
        commits on its own, a crash from here on is resolved by classify().
        """
        ph = str(plan["plan_hash"])
        pre = self._preflight(conn, items, snaps, plan)
        if not pre.ok:
            if transactional:
                conn.rollback()
            raise self._refuse_merge(plan, pre)
        self._emit(ev.PREFLIGHT, {"plan_hash": ph, "live": dict(pre.live), "ok": True})
        dep_refs = self._dependent_refs(conn, plan, items)
        before = self._statuses(conn, [it.ref for it in items] + dep_refs)
        snapshot_ids = [it.base_snapshot_id for it in items]
        if on_apply_started is not None:
            on_apply_started(snapshot_ids)
        self._emit(ev.APPLY_STARTED, {"plan_hash": ph, "snapshot_ids": snapshot_ids,
                                      "objects": [it.key for it in items],
                                      "transactional": transactional})
        return dep_refs, before

    def _apply_and_verify(
        self, conn: Connection, plan: Mapping[str, Any], items: list[_Item],
        dep_refs: list[ObjectRef], before: dict[str, ObjectStatus], *, far_side: bool,
        then: str,
    ) -> tuple[list[ObjectApply], ApplyFailed | None, VerifyReport | None,
               dict[str, ObjectStatus],
               DdlErrorLike | None]:
        """Apply every object, then verify; ``then`` says what a failed verify leads to.

        Returns (applied, apply failure, verify report, statuses after, the error to act on).
        """
        ph = str(plan["plan_hash"])
        applied, failure = self._apply_items(conn, items, ph)
        report: VerifyReport | None = None
        after: dict[str, ObjectStatus] = {}
        error: DdlErrorLike | None = failure
        if failure is None:
            report, after = self._verify(conn, plan, items, dep_refs, before, smoke=True,
                                         far_side=far_side)
            if not report.passed:
                error = VerifyFailed(
                    f"verify failed: {_failure_text(report)}; {then}",
                    plan_hash=ph, checks=[c.to_dict() for c in report.failures],
                )
        return applied, failure, report, after, error

    def _execute_committing(
        self, plan: Mapping[str, Any], items: list[_Item], snaps: Mapping[str, Snapshot],
        on_apply_started: OnApplyStarted | None,
    ) -> DdlOutcome:
        ph = str(plan["plan_hash"])
        with self.engine.connect() as conn:
            dep_refs, before = self._start_apply(conn, plan, items, snaps, on_apply_started,
                                                 transactional=False)
            applied, failure, report, after, error = self._apply_and_verify(
                conn, plan, items, dep_refs, before, far_side=True, then="compensating")
            if failure is None and error is not None and report is not None:
                self._emit(ev.VERIFY_FAILED, {"plan_hash": ph, "checks": [
                    c.to_dict() for c in report.failures]})
        if error is not None:
            return self._compensate_outcome(plan, items, snaps, dep_refs, before, after,
                                            applied, report, error)
        self._emit(ev.VERIFIED, {"plan_hash": ph, "checks": len(report.checks) if report else 0})
        return self._finish(self._outcome(APPLIED_VERIFIED, plan, applied, items, dep_refs,
                                          before, after, report, None, None, None))

    def _compensate_outcome(
        self, plan: Mapping[str, Any], items: list[_Item], snaps: Mapping[str, Snapshot],
        dep_refs: list[ObjectRef], before: Mapping[str, ObjectStatus],
        after: Mapping[str, ObjectStatus], applied: list[ObjectApply],
        report: VerifyReport | None, error: DdlErrorLike,
    ) -> DdlOutcome:
        comp = self._compensate(plan, items, snaps, dep_refs, before)
        if comp.ok:
            return self._finish(self._outcome(COMPENSATED, plan, applied, items, dep_refs,
                                              before, after, report, comp, error, True))
        failed = CompensationFailed(
            "compensation did not restore the snapshot(s); escalate -- do not apply again",
            plan_hash=plan["plan_hash"],
            snapshot_ids=dict(comp.snapshot_ids),
            live_signatures=dict(comp.live_signatures),
            snapshot_signatures=dict(comp.snapshot_signatures),
            cause=error_details(error),
        )
        return self._finish(self._outcome(COMPENSATION_FAILED, plan, applied, items, dep_refs,
                                          before, after, report, comp, failed, False))

    def _finish(self, outcome: DdlOutcome) -> DdlOutcome:
        self._emit(ev.OUTCOME, {"plan_hash": outcome.plan_hash, "outcome": outcome.outcome,
                                "restored": outcome.restored,
                                "error": None if outcome.error is None else dict(outcome.error)})
        return outcome

    def _outcome(
        self, outcome: str, plan: Mapping[str, Any], applied: list[ObjectApply],
        items: Sequence[_Item], dep_refs: Sequence[ObjectRef],
        before: Mapping[str, ObjectStatus], after: Mapping[str, ObjectStatus],
        report: VerifyReport | None, comp: CompensationReport | None,
        error: DdlErrorLike | None, restored: bool | None,
    ) -> DdlOutcome:
        statuses = tuple(
            StatusChange(r.key, role, before.get(r.key), after.get(r.key))
            for role, refs in (("changed", [it.ref for it in items]), ("dependent", dep_refs))
            for r in refs
        )
        result = DdlOutcome(
            outcome=outcome,
            plan_hash=str(plan["plan_hash"]),
            dialect=self.dialect,
            objects=tuple(applied),
            statuses=statuses,
            verify=report,
            compensation=comp,
            error=None if error is None else error_details(error),
            restored=restored,
        )
        return result

    def _restored(self, items: Sequence[_Item], snaps: Mapping[str, Snapshot]) -> bool:
        with self.engine.connect() as conn:
            ok = all(str(self._live(conn, it.ref)[1]) == str(snaps[it.key].signature)
                     for it in items)
            conn.rollback()
        return ok

    # -- verify ------------------------------------------------------------------------------
    def _verify(
        self, conn: Connection, plan: Mapping[str, Any], items: Sequence[_Item],
        dep_refs: Sequence[ObjectRef], before: Mapping[str, ObjectStatus], *, smoke: bool,
        far_side: bool,
    ) -> tuple[VerifyReport, dict[str, ObjectStatus]]:
        checks: list[Check] = []
        after: dict[str, ObjectStatus] = {}
        for it in items:
            st = self._status(conn, it.ref)
            after[it.key] = st
            checks.append(Check("compile", it.key, st.ok,
                                f"{st.state} ({st.method})" + (f": {'; '.join(st.errors)}"
                                                               if st.errors else "")))
            _, sig = self._live(conn, it.ref)
            if it.expected_signature is not None:
                checks.append(Check("landed", it.key, str(sig) == it.expected_signature,
                                    f"live {sig}, planned {it.expected_signature}"))
            else:
                matches = self.adapter.source_matches(conn, it.ref, it.new_source)
                if matches is None:
                    checks.append(Check("landed", it.key, True,
                                        f"live {sig}; the catalog re-renders this object, "
                                        "its text cannot be compared", severity="warning"))
                else:
                    word = "matches" if matches else "differs from"
                    checks.append(Check("landed", it.key, matches,
                                        f"live {sig}; the stored body {word} the new source"))
        total = len(dep_refs)
        for i, ref in enumerate(dep_refs, start=1):
            if self.progress is not None:
                self.progress(i, total, ref.key)
            st = self.adapter.recompile(conn, ref)
            after[ref.key] = st
            prior = before.get(ref.key)
            was_ok = prior is None or prior.ok
            if st.ok:
                checks.append(Check("dependent", ref.key, True, f"{st.state} ({st.method})"))
            elif st.state == MISSING and prior is not None and prior.state == MISSING:
                checks.append(Check("dependent", ref.key, True, "missing before and after",
                                    severity="warning"))
            elif not was_ok:
                checks.append(Check("dependent", ref.key, False,
                                    f"{st.state} after, already {prior.state if prior else '?'} "
                                    "before the apply", severity="warning"))
            else:
                checks.append(Check("dependent", ref.key, False,
                                    f"{st.state} after the apply, "
                                    f"{prior.state if prior else 'unknown'} before"
                                    + (f": {'; '.join(st.errors)}" if st.errors else "")))
        if smoke:
            checks += self._smoke(conn, plan)
        if far_side:
            checks += self._far_side_checks(plan)
        return VerifyReport(tuple(checks)), after

    def _smoke(self, conn: Connection, plan: Mapping[str, Any]) -> list[Check]:
        out: list[Check] = []
        for s in plan.get("smoke") or []:
            name = f"smoke:{s['name']}"
            binds = dict(s.get("binds") or {})
            try:
                with self.adapter.session(conn, dict(s.get("session") or {})):
                    if self.adapter.transactional_ddl:
                        with conn.begin_nested() as sp:
                            try:
                                value = conn.execute(sa.text(s["sql"]), binds).scalar()
                            finally:
                                if sp.is_active:
                                    sp.rollback()
                    else:
                        value = conn.execute(sa.text(s["sql"]), binds).scalar()
            except sa.exc.DBAPIError as exc:
                out.append(Check(name, str(s["name"]), False, f"error: {first_line(exc.orig)}"))
                continue
            ok = s.get("expect") is None or _same(value, s.get("expect"))
            out.append(Check(name, str(s["name"]), ok,
                             f"returned {value!r}, expected {s.get('expect')!r}"))
        return out

    def _far_side_checks(self, plan: Mapping[str, Any]) -> list[Check]:
        out: list[Check] = []
        for s in plan.get("far_side_steps") or []:
            name = f"far_side:{s['name']}"
            url = self.far_side.get(str(s["link"]))
            if url is None:
                out.append(Check(name, str(s["dependent"]), False,
                                 f"no connection configured for link {s['link']}"))
                continue
            far_adapter = adapter_for(url)
            dep = ObjectRef.from_dict({**s["dependent_object"], "link": None})
            eng = far_adapter.engine(url)
            try:
                with eng.connect() as far:
                    if s.get("recompile", True):
                        st = far_adapter.recompile(far, dep)
                        if not st.ok:
                            out.append(Check(name, str(s["dependent"]), False,
                                             f"far-side recompile: {st.state} {st.errors}"))
                            continue
                    value = far.execute(sa.text(s["assertion"])).scalar()
                    ok = _same(value, s.get("expect"))
                    out.append(Check(name, str(s["dependent"]), ok,
                                     f"assertion returned {value!r}, expected {s.get('expect')!r}"))
                    far.rollback()
            except sa.exc.DBAPIError as exc:
                out.append(Check(name, str(s["dependent"]), False,
                                 f"error: {first_line(exc.orig)}"))
            finally:
                eng.dispose()
            self._emit(ev.FAR_SIDE, {"plan_hash": plan["plan_hash"], "step": s["name"],
                                     "passed": out[-1].passed, "detail": out[-1].detail})
        return out

    def verify_object(self, obj: ObjectRef | str) -> VerifyReport:
        """Check one live object outside any plan: its compile status and the dependent sweep.

        Every local dependent is re-checked one by one (``progress`` is called per
        dependent); an invalid dependent fails the report, since no status from
        before a change is known here.  Nothing is changed on PostgreSQL and
        MariaDB (a re-check); Oracle recompiles each dependent (``ALTER ...
        COMPILE``), never the schema.
        """
        ref = ObjectRef.parse(obj) if isinstance(obj, str) else obj
        checks: list[Check] = []
        with self.engine.connect() as conn:
            ref = self.adapter.resolve(conn, ref)
            live, sig = self._live(conn, ref)
            if live is None:
                conn.rollback()
                raise ObjectNotFound(f"{ref.key} does not exist on {self.target}",
                                     object=ref.key)
            ref = live.object
            st = self._status(conn, ref)
            checks.append(Check("compile", ref.key, st.ok,
                                f"{st.state} ({st.method}); live {sig}"
                                + (f": {'; '.join(st.errors)}" if st.errors else "")))
            deps = self.adapter.dependents(conn, ref, self.progress)
            seen: set[str] = {ref.key}
            refs = []
            for d in deps:
                if d.object.key not in seen and not d.remote:
                    seen.add(d.object.key)
                    refs.append(d.object)
            refs.sort()
            for i, dep in enumerate(refs, start=1):
                if self.progress is not None:
                    self.progress(i, len(refs), dep.key)
                st = self.adapter.recompile(conn, dep)
                checks.append(Check("dependent", dep.key, st.ok, f"{st.state} ({st.method})"
                                    + (f": {'; '.join(st.errors)}" if st.errors else "")))
            conn.rollback()
        return VerifyReport(tuple(checks))

    def verify(self, plan: Mapping[str, Any]) -> VerifyReport:
        """Check the live state against the plan: compile status, landed text, dependents, smoke."""
        check_plan(plan)
        items = [_Item.from_plan(o) for o in plan["objects"]]
        before = {str(d["key"]): _status_from(d) for d in plan.get("dependents") or []
                  if d.get("status_before")}
        with self.engine.connect() as conn:
            dep_refs = self._dependent_refs(conn, plan, items)
            report, _ = self._verify(conn, plan, items, dep_refs, before, smoke=True,
                                     far_side=True)
            conn.rollback()
        return report

    # -- compensate ------------------------------------------------------------------------
    def _compensate(
        self, plan: Mapping[str, Any], items: Sequence[_Item], snaps: Mapping[str, Snapshot],
        dep_refs: Sequence[ObjectRef], before: Mapping[str, ObjectStatus],
    ) -> CompensationReport:
        ph = plan["plan_hash"]
        snapshot_ids = {it.key: it.base_snapshot_id for it in items}
        self._emit(ev.COMPENSATION_STARTED, {"plan_hash": ph, "snapshot_ids": snapshot_ids})
        actions: list[dict[str, Any]] = []
        live_sigs: dict[str, str] = {}
        snap_sigs = {it.key: str(snaps[it.key].signature) for it in items}
        report: VerifyReport | None = None
        with self.engine.connect() as conn:
            self.adapter.begin(conn)
            for it in items:  # spec before body: re-creating a MariaDB spec drops the body
                snap = snaps[it.key]
                _, sig = self._live(conn, it.ref)
                if str(sig) == str(snap.signature):
                    actions.append({"object": it.key, "action": "none",
                                    "reason": "live equals snapshot"})
                    continue
                try:
                    if snap.exists:
                        self.adapter.apply(conn, it.ref, snap.source, snap.attributes)
                        actions.append({"object": it.key, "action": "re-applied snapshot",
                                        "snapshot_id": snap.id})
                    else:
                        self.adapter.drop(conn, it.ref)
                        actions.append({"object": it.key, "action": "dropped",
                                        "snapshot_id": snap.id,
                                        "reason": "it did not exist before"})
                except (ApplyFailed, sa.exc.DBAPIError) as exc:
                    actions.append({"object": it.key, "action": "failed",
                                    "snapshot_id": snap.id, "error": error_details(exc)})
                    if self.adapter.transactional_ddl:
                        conn.rollback()
                        break
            if self.adapter.transactional_ddl and all(a["action"] != "failed" for a in actions):
                conn.commit()
            for it in items:
                live_sigs[it.key] = str(self._live(conn, it.ref)[1])
            plain = {**plan, "smoke": [], "far_side_steps": []}
            report, _ = self._verify(conn, plain, [
                _Item(it.ref, it.base_snapshot_id, it.base_signature, snaps[it.key].source,
                      it.base_signature, it.base_signature if snaps[it.key].exists else None,
                      it.attributes)
                for it in items if snaps[it.key].exists
            ], dep_refs, before, smoke=False, far_side=False)
            if self.adapter.transactional_ddl:
                conn.rollback()
        ok = (all(a["action"] != "failed" for a in actions)
              and all(live_sigs[k] == snap_sigs[k] for k in snap_sigs)
              and report.passed)
        comp = CompensationReport(ok, snapshot_ids, tuple(actions), live_sigs, snap_sigs, report)
        self._emit(ev.COMPENSATED if ok else ev.COMPENSATION_FAILED,
                   {"plan_hash": ph, **comp.to_dict()})
        return comp

    def compensate(self, plan: Mapping[str, Any]) -> CompensationReport:
        """Restore every object of the plan from its snapshot (where it differs), then verify.

        For a case resumed as ``partly_applied``; each snapshot is applied at most once.
        """
        check_plan(plan)
        items = [_Item.from_plan(o) for o in plan["objects"]]
        snaps = {it.key: self.store.get(it.base_snapshot_id) for it in items}
        before = {str(d["key"]): _status_from(d) for d in plan.get("dependents") or []
                  if d.get("status_before")}
        with self._locked([it.ref for it in items]):
            with self.engine.connect() as conn:
                dep_refs = self._dependent_refs(conn, plan, items)
                conn.rollback()
            return self._compensate(plan, items, snaps, dep_refs, before)

    # -- recovery -----------------------------------------------------------------------------
    def classify(
        self, plan: Mapping[str, Any], observed: Mapping[str, str] | None = None
    ) -> RecoveryReport:
        """After a crash past "apply started": what landed, judged by live signatures.

        ``observed`` maps object keys to applied signatures the ledger recorded
        (``ddl.object_applied`` events), as extra evidence.
        """
        check_plan(plan)
        items = [_Item.from_plan(o) for o in plan["objects"]]
        rows: list[ObjectRecovery] = []
        with self.engine.connect() as conn:
            for it in items:
                live, sig = self._live(conn, it.ref)
                s = str(sig)
                expected = it.expected_signature
                if expected is not None and expected == it.base_signature:
                    state, why = "unchanged", "the plan leaves this object as it was"
                    if s != it.base_signature:
                        state, why = ("absent", "missing now") if live is None else (
                            "unknown", "differs from the snapshot the plan keeps")
                elif s == it.base_signature:
                    state, why = "not_applied", "live signature equals the snapshot's"
                elif expected is not None and s == expected:
                    state, why = "applied", "live signature equals the planned one"
                elif observed and observed.get(it.key) == s:
                    state, why = "applied", "live signature equals the one the ledger recorded"
                elif live is None:
                    state, why = "absent", "the object is missing"
                else:
                    m = self.adapter.source_matches(conn, it.ref, it.new_source)
                    if m:
                        state, why = "applied", "the stored body is the new source's"
                    else:
                        state, why = "unknown", "matches neither the snapshot nor the new source"
                rows.append(ObjectRecovery(it.key, state, s, it.base_signature, expected, why))
            conn.rollback()
        states = {r.state for r in rows}
        moving = {r.state for r in rows if r.state != "unchanged"}
        if "unknown" in states:
            cls = "unknown"
        elif not moving or moving == {"not_applied"}:
            cls = "not_applied"
        elif moving == {"applied"}:
            cls = "applied"
        else:
            cls = "partly_applied"
        return RecoveryReport(cls, str(plan["plan_hash"]), tuple(rows))

    # -- guard for callers that build their own recompile lists --------------------------
    @staticmethod
    def refuse_schema_wide(request: str) -> None:
        """Raise SchemaWideRecompile for any request that covers a whole schema."""
        plan_like = {"recompile": [request], "objects": []}
        if prohibitions.check_schema_wide_recompile(plan_like):
            raise SchemaWideRecompile(
                f"recompile request {request!r} covers a whole schema; the dependent sweep "
                "recompiles dependents one by one",
                request=request,
            )


DdlErrorLike = ApplyFailed | VerifyFailed | CompensationFailed


def _failure_text(report: VerifyReport) -> str:
    return "; ".join(f"{c.name} {c.object}: {c.detail}" for c in report.failures[:5])


def _status_from(d: Mapping[str, Any]) -> ObjectStatus:
    st = d["status_before"]
    return ObjectStatus(ObjectRef.from_dict(d["object"]), str(st["state"]),
                        tuple(st.get("errors") or ()), str(st.get("method", "")))
