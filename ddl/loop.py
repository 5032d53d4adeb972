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

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url

from capgate.ddl import events as ev
from capgate.ddl import prohibitions, sqltext
from capgate.ddl.catalog import (
    BaseAdapter,
    Dependent,
    LiveObject,
    ObjectRef,
    ObjectStatus,
    Probe,
    Progress,
    adapter_for,
    first_line,
    lock_key,
)
from capgate.ddl.events import DdlEventSink, NullSink
from capgate.ddl.merge import MergeProposal, propose
from capgate.ddl.plan import PLAN_FIELDS, PLAN_FORMAT, DdlPlan, plan_hash
from capgate.ddl.results import (
    APPLIED_VERIFIED,
    COMPARED,
    COMPENSATED,
    COMPENSATION_FAILED,
    EXECUTED,
    FAILED,
    PASSED,
    ROLLED_BACK,
    UNVERIFIED,
    WARNING,
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
    accepted_reason,
    judge,
)
from capgate.ddl.signature import RECIPE, Signature, diff, sign
from capgate.ddl.smoke import ContainedCall, Ran
from capgate.ddl.snapshots import Snapshot, SnapshotStore
from capgate.registry.errors import (
    ApplyFailed,
    CompensationFailed,
    DdlProhibition,
    LockNotAcquired,
    MergeRequired,
    NothingToApply,
    ObjectNotFound,
    PlanTampered,
    SchemaWideRecompile,
    SmokeNotContained,
    SourceDoesNotParse,
    VerifyFailed,
    error_details,
)

OnApplyStarted = Callable[[list[str]], None]
#: A plan as the loop's steps take it: a DdlPlan, or its JSON data (checked, then read).
PlanLike = DdlPlan | Mapping[str, Any]


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


def _unified(base: str, new: str, key: str) -> list[str]:
    """The source diff against the base, as the approver reads it (unified, 3 lines of context)."""
    return [line.rstrip("\n") for line in difflib.unified_diff(
        base.splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile=f"{key} (base)", tofile=f"{key} (new)", n=3)]


def _redacted(url: URL) -> str:
    """The target as plans and events name it: no password, no secret query value."""
    from capgate.executor.dialects.base import safe_url

    return safe_url(url)


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
        check_timeout: float = 30.0,
        progress: Progress | None = None,
        far_side: Mapping[str, str | URL] | None = None,
        engine_options: Mapping[str, Any] | None = None,
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
        :param check_timeout: seconds one contained call may run (a smoke call, a fetch
            from a dependent view, a call of a dependent function) before the database
            stops it.
        :param progress: ``progress(done, total, label)`` during dependent sweeps.
        :param far_side: database link name -> URL of the far database, for remote
            dependents and far-side steps.
        :param engine_options: for the target's engine: the connector's driver settings
            (``connect_args`` -- a TNS alias's ``config_dir``, a wallet --, never in the URL).
        """
        self.url = make_url(target)
        self.adapter = adapter or adapter_for(self.url, scope=scope)
        self.store = store
        self.sink: DdlEventSink = sink or NullSink()
        self.target = target_label or _redacted(self.url)
        self.lock_timeout = lock_timeout
        self.check_timeout = check_timeout
        self.progress = progress
        self.far_side = {k: make_url(v) for k, v in (far_side or {}).items()}
        self.adapter.run_timeout = check_timeout
        self.engine: Engine = self.adapter.engine(self.url, **dict(engine_options or {}))

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
        return sign(self.adapter.signed_text(ref, live.source, live.attributes))

    def snapshot_signature(self, snap: Snapshot) -> Signature:
        """The snapshot's signature by today's recipe (an older recipe is re-signed from the
        stored source and attributes, so a recipe change never looks like drift)."""
        if snap.signature.recipe == RECIPE:
            return snap.signature
        if not snap.exists:
            return Signature.absent()
        return sign(self.adapter.signed_text(snap.object, snap.source, snap.attributes))

    def live_signature(self, conn: Connection, ref: ObjectRef) -> Signature:
        return self._live(conn, ref)[1]

    def base_for(self, conn: Connection, ref: ObjectRef) -> Snapshot | None:
        """The base of a plan that names none: the latest snapshot whose signature matches the
        live object (A -> B -> A plans against A again); when none matches, the latest one --
        so that a save made since that capture is refused as a stale extract."""
        history = self.store.history(ref, self.dialect)
        if not history:
            return None
        live = str(self.live_signature(conn, ref))
        for snap in reversed(history):
            if str(self.snapshot_signature(snap)) == live:
                return snap
        return history[-1]

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
        return self.adapter.statuses(conn, [ref])[ref.key]

    @contextmanager
    def _locked(self, refs: Sequence[ObjectRef]) -> Iterator[None]:
        """Session-scoped locks on every object, taken on a connection of their own."""
        names = sorted({lock_key(self.dialect, r) for r in refs})
        conn = self.adapter.lock_session(self.engine)
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
    def capture(self, obj: ObjectRef | str, *, allow_absent: bool = False) -> Snapshot:
        """Read the object, store its snapshot (a no-op if identical) and return it.

        An object that does not exist is refused (``ObjectNotFound``), so that a
        misspelt name is an error rather than an "absent" snapshot;
        ``allow_absent=True`` records the absence (a plan that creates the object).
        """
        ref = ObjectRef.parse(obj) if isinstance(obj, str) else obj
        with self.engine.connect() as conn:
            ref = self.adapter.resolve(conn, ref)
            live = self.adapter.read(conn, ref)
            if live is not None:
                ref = live.object
            conn.rollback()
        if live is None and not allow_absent:
            raise ObjectNotFound(
                f"{ref.key} does not exist on {self.target}; check the kind and the name "
                "(nothing was captured)", object=ref.key)
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
        accepted_warnings: Sequence[Mapping[str, Any]] = (),
    ) -> DdlPlan:
        """Make the plan for ``changes``; raise the first prohibition it violates (``refuse``).

        ``remote_dependents`` are declared by the row or the DBA (the local
        catalog cannot see them); dependents found through ``far_side``
        catalogs are added.  ``search_callers=False`` records no caller search
        -- the plan is then refused as ungrepped.  ``bind`` adds the caller's
        fields to the plan, covered by its hash (the executor binds the row's
        ``operation_id``, ``version``, ``row_hash``, connector and environment,
        so an approval of the hash is an approval of that row on that target).
        ``accepted_warnings`` are the row's declared checker false positives
        (``{"object": "function:f", "message": ..., "reason": ...}``): shown in
        the plan, and a verify finding them reports a warning, not a failure.
        """
        if not changes:
            raise ValueError("a plan needs at least one change")
        for call in smoke:  # what verification runs must be containable: refused now
            self.adapter.check_smoke(call.name, call.sql)
        if bind and set(bind) & PLAN_FIELDS:
            raise ValueError(f"bind may not set the plan's own fields "
                             f"{sorted(set(bind) & PLAN_FIELDS)}")
        objects: list[dict[str, Any]] = []
        warnings: list[str] = []
        searches: list[dict[str, Any]] = []
        merges: list[dict[str, Any]] = []
        deps: dict[str, dict[str, Any]] = {}
        accepted = [dict(a) for a in accepted_warnings]
        with self.engine.connect() as conn:
            refs: list[ObjectRef] = []
            prepared: list[tuple[Change, ObjectRef, LiveObject | None, Signature, Snapshot,
                                 dict[str, str]]] = []
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
                attributes = {**self.adapter.default_attributes(conn, ref), **base.attributes,
                              **dict(ch.attributes)}
                # one definition per source, refused before anything is rendered or applied
                self.adapter.parse_definition(conn, ref, ch.source, attributes)
                self._refuse_create_over_existing(ref, ch.source, live)
                warnings += self.adapter.preconditions(conn, ref, ch.source, attributes,
                                                       live is not None)
                prepared.append((ch, ref, live, live_sig, base, attributes))
            # the dependents and their statuses before, then the sources tried (where the
            # engine can) with the dependents checked under them: what the change breaks and
            # what no check covers is known before anyone approves it
            plan_keys = {r.key for r in refs}
            catalog = self.adapter.catalog_version(conn, refs)
            found = [d for d in self.adapter.dependents_many(conn, refs, self.progress)
                     if d.object.key not in plan_keys]
            recompile_objects = self._recompile_objects(conn, recompile)
            checked = [d.object for d in found] + [
                r for r in recompile_objects if r.key not in {d.object.key for d in found}]
            before = self.adapter.statuses(conn, checked)
            probes: Sequence[Probe | None]
            predicted: dict[str, ObjectStatus] | None = None
            changed_after: dict[str, ObjectStatus] = {}
            if render:
                probes, predicted = self.adapter.probe_many(
                    conn, [(ref, ch.source, attrs) for ch, ref, _, _, _, attrs in prepared],
                    checked)
            else:
                probes = [None] * len(prepared)
            for (ch, ref, live, live_sig, base, attributes), probe in zip(
                    prepared, probes, strict=True):
                base_sig = self.snapshot_signature(base)
                new_norm = self.adapter.normalise(ref, ch.source)
                new_sig = sign(self.adapter.signed_text(ref, ch.source, attributes))
                expected: str | None = None
                entry: dict[str, Any] = {}
                rendered: str | None = None
                if probe is not None:
                    if probe.error is not None:
                        raise SourceDoesNotParse(
                            f"{ref.key}: the new source does not apply: {probe.error} (tried "
                            "in a savepoint that was rolled back; nothing was planned)",
                            object=ref.key, database_error=probe.error)
                    rendered = probe.rendered
                    if rendered is not None:
                        expected = str(sign(self.adapter.signed_text(
                            ref, self.adapter.appliable(ref, rendered), attributes)))
                        if rendered != new_norm:
                            entry["rendered_source"] = rendered
                    if probe.status is not None and probe.status.errors:
                        findings = [{"error": e, "accepted": accepted_reason(ref, e, accepted)}
                                    for e in probe.status.errors]
                        entry["checker_findings"] = findings
                        for f in findings:
                            why = (f"accepted on the row ({f['accepted']})" if f["accepted"]
                                   else "NOT accepted on the row: the apply will fail unless "
                                   "ddl.accepted_warnings declares it")
                            warnings.append(f"{ref.key}: {probe.status.method} reports for the "
                                            f"new source: {f['error']} -- {why}")
                if probe is not None and probe.status is not None:
                    changed_after[ref.key] = probe.status
                status_before = self._status(conn, ref) if live is not None else None
                state = self.adapter.holds_state(ref, live.source if live else "")
                state += [s for s in self.adapter.holds_state(ref, ch.source) if s not in state]
                if state and live is not None:
                    warnings.append(
                        f"{ref.key}: the package holds state ({'; '.join(state[:3])}); "
                        "replacing it discards that state in every session using it "
                        "(Oracle ORA-04068)"
                    )
                warnings += self.adapter.privilege_changes(
                    ref, base.source if base.exists else None,
                    rendered if rendered is not None else ch.source)
                to_sig = new_sig if rendered is None else sign(self.adapter.signed_text(
                    ref, self.adapter.appliable(ref, rendered), attributes))
                base_text = self.adapter.normalise(ref, base.source) if base.exists else ""
                entry.update({
                    "key": ref.key,
                    "object": ref.to_dict(),
                    "change": "replace" if live is not None else "create",
                    "base_snapshot_id": base.id,
                    "base_signature": str(base_sig),
                    "live_signature": str(live_sig),
                    "new_source": ch.source,
                    "new_signature": str(new_sig),
                    "expected_signature": expected,
                    "changed_blocks": [c.to_dict() for c in diff(base_sig, to_sig).changed]
                    if base_sig.exists else [],
                    "diff": _unified(base_text, rendered if rendered is not None else new_norm,
                                     ref.key),
                    "attributes": attributes,
                    "status_before": None if status_before is None else status_before.to_dict(),
                    "holds_state": state,
                })
                if ref.is_spec:
                    body = ref.body()
                    assert body is not None
                    entry["body_exists"] = self.adapter.read(conn, body) is not None
                if str(base_sig) != str(live_sig):
                    merges.append(self._merge(ref, base, ch.source, live,
                                              entry.get("rendered_source"),
                                              attributes).to_dict())
                objects.append(entry)
            unverified = self._unverified(objects, changed_after, found, recompile_objects,
                                          before, predicted, accepted, warnings)
            for d in found:
                row = d.to_dict()
                row["status_before"] = before[d.object.key].to_dict()
                deps.setdefault(d.object.key, row)
            if search_callers:
                for ref in refs:
                    searches.append(self.adapter.search_callers(conn, ref).to_dict())
            conn.rollback()
        for d in list(remote_dependents) + self._far_dependents(refs):
            if d.object.key not in deps:
                row = d.to_dict()
                row["status_before"] = None
                deps[d.object.key] = row
        for s in searches:
            if s["hits"]:
                callers = sorted({h["object"] for h in s["hits"]})
                warnings.append(f"{s['object']}: {len(s['hits'])} caller line(s) found in "
                                f"{len(callers)} object(s): {', '.join(callers[:10])}"
                                f"{' ...' if len(callers) > 10 else ''}; review them")
            for note in s.get("notes") or []:
                warnings.append(f"{s['object']}: caller search: {note}")
        data: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "dialect": self.dialect,
            "target": self.target,
            "recipe": RECIPE,
            "transactional_ddl": self.adapter.transactional_ddl,
            "objects": [objects[i] for i in _order(refs)],
            "dependents": sorted(deps.values(), key=lambda d: (int(d.get("depth", 1)),
                                                               str(d["key"]))),
            "caller_search": searches if search_callers else None,
            "far_side_steps": [s.to_dict() for s in far_side_steps],
            "smoke": [s.to_dict() for s in smoke],
            "recompile": list(recompile),
            "recompile_objects": [r.to_dict() for r in recompile_objects],
            "accepted_warnings": accepted,
            "unverified": unverified,
            "warnings": warnings,
            "approval": {"required": True, "reason": "DDL rows are gated: a person approves "
                         "this plan hash before it is applied"},
        }
        if catalog is not None:
            data["catalog_version"] = catalog
        data.update(bind or {})
        data["prohibitions"] = prohibitions.summary(data)
        data["plan_hash"] = plan_hash(data)
        plan = DdlPlan.from_dict(data)
        if refuse and all(p["passed"] for p in data["prohibitions"]) and all(
                o["change"] == "replace" and o["live_signature"] == (
                    o["expected_signature"] or o["new_signature"]) for o in plan.objects):
            keys = [str(o["key"]) for o in plan.objects]
            raise NothingToApply(
                f"nothing to apply: {', '.join(keys)} already "
                f"{'is' if len(keys) == 1 else 'are'} the new source (live signature equals "
                "the planned one); nothing was planned",
                objects=keys, live={str(o["key"]): o["live_signature"] for o in plan.objects})
        self._emit(ev.PLANNED, {"plan_hash": plan.plan_hash,
                                "objects": [o["key"] for o in plan.objects],
                                "snapshot_ids": [o["base_snapshot_id"] for o in plan.objects],
                                "warnings": warnings})
        if refuse:
            try:
                prohibitions.refuse(data, {"plan_hash": plan.plan_hash, "merge": merges}
                                    if merges else {"plan_hash": plan.plan_hash})
            except DdlProhibition as exc:
                self._emit(ev.REFUSED, {"plan_hash": plan.plan_hash, "code": exc.code,
                                        "message": exc.message})
                raise
        return plan

    def _unverified(
        self, objects: Sequence[Mapping[str, Any]], changed_after: Mapping[str, ObjectStatus],
        found: Sequence[Dependent], recompile: Sequence[ObjectRef],
        before: Mapping[str, ObjectStatus],
        predicted: Mapping[str, ObjectStatus] | None, accepted: Sequence[Mapping[str, Any]],
        warnings: list[str],
    ) -> list[dict[str, Any]]:
        """What the plan lists as unverified (and, as warnings, the dependents it breaks).

        Each object is judged as the apply will judge it: under the new sources where
        the engine could try them (``predicted``), else by its status now (an engine
        whose DDL commits cannot try first; whether a check can be made rarely depends
        on the change).  Approving the plan accepts exactly the objects listed.
        """
        out: list[dict[str, Any]] = []
        for o in objects:
            if o.get("status_before") is None:
                continue
            ref = ObjectRef.from_dict(o["object"])
            now = ObjectStatus.from_dict(ref, o["status_before"])
            after = changed_after.get(ref.key, now)
            c = judge("compile", ref.key, after, now, accepted, same_as_before_is_fine=False)
            if c.verdict == UNVERIFIED:
                out.append({"object": ref.key, "role": "changed", "why": c.detail})
        roles = [(d.object, "dependent") for d in found] + [(r, "recompile") for r in recompile]
        seen: set[str] = set()
        for ref, role in roles:
            if ref.key in seen or ref.key not in before:
                continue
            seen.add(ref.key)
            now = before[ref.key]
            after = now if predicted is None else predicted.get(ref.key, now)
            c = judge(role, ref.key, after, now, accepted)
            if c.verdict == UNVERIFIED:
                out.append({"object": ref.key, "role": role, "why": c.detail})
            elif c.verdict == FAILED and predicted is not None:
                warnings.append(f"{ref.key}: the new source breaks this {role}: {c.detail} -- "
                                "the apply will fail its verify and be undone")
        return out

    def _refuse_create_over_existing(self, ref: ObjectRef, source: str,
                                     live: LiveObject | None) -> None:
        """A ``CREATE`` without ``OR REPLACE`` of an existing object can only fail: say so now."""
        if live is None:
            return
        m = sqltext.header_match(source)
        if m is not None and not m.group("replace") and not self.adapter.apply_replaces_existing:
            raise SourceDoesNotParse(
                f"{ref.key} exists, and the source creates it without OR REPLACE: the apply "
                "would fail -- write CREATE OR REPLACE", object=ref.key)

    def _recompile_objects(self, conn: Connection, requests: Sequence[str]) -> list[ObjectRef]:
        """The objects named by ``--recompile``, each resolved and required to exist.

        A request that covers a schema (``*``, ``DBMS_UTILITY.COMPILE_SCHEMA(...)``, ...)
        is left to the schema-wide-recompile prohibition; anything else must name
        one existing object.
        """
        out: list[ObjectRef] = []
        for req in requests:
            if prohibitions.is_schema_wide(str(req)):
                continue
            try:
                ref = ObjectRef.parse(str(req))
            except ValueError as exc:
                raise ObjectNotFound(f"recompile request {req!r} does not name one object: "
                                     f"{exc}", request=req) from None
            ref = self.adapter.resolve(conn, ref)
            live = self.adapter.read(conn, ref)
            if live is None:
                raise ObjectNotFound(f"recompile request {req!r}: {ref.key} does not exist on "
                                     f"{self.target}", request=req, object=ref.key)
            out.append(live.object)
        return out

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
        rendered: str | None = None, attributes: Mapping[str, str] | None = None,
    ) -> MergeProposal:
        """A three-way merge whose merged text applies as it is (``CREATE OR REPLACE``)."""
        norm = self.adapter.normalise
        attrs = dict(attributes if attributes is not None else base.attributes)
        ours_text = rendered if rendered is not None else norm(ref, new_source)
        ours_sig = sign(self.adapter.signed_text(ref, self.adapter.appliable(ref, ours_text),
                                                 attrs))
        return propose(
            ref.key,
            base.id,
            norm(ref, base.source) if base.exists else "",
            ours_text,
            norm(ref, live.source) if live is not None else "",
            signatures=(str(self.snapshot_signature(base)), str(ours_sig),
                        str(self._signature(ref, live))),
            appliable=lambda text: self.adapter.appliable(ref, text),
        )

    # -- preflight ----------------------------------------------------------------------------
    def _preflight(
        self, conn: Connection, items: Sequence[_Item], snaps: Mapping[str, Snapshot],
        plan: DdlPlan,
    ) -> PreflightResult:
        live_sigs: dict[str, str] = {}
        proposals: list[MergeProposal] = []
        rendered = {str(o["key"]): o.get("rendered_source") for o in plan.objects}
        for it in items:
            live, sig = self._live(conn, it.ref)
            live_sigs[it.key] = str(sig)
            if str(sig) != it.base_signature:
                proposals.append(self._merge(it.ref, snaps[it.key], it.new_source, live,
                                             rendered.get(it.key), it.attributes))
        return PreflightResult(not proposals, live_sigs, tuple(proposals))

    def preflight(self, plan: PlanLike) -> PreflightResult:
        """Re-read the live objects under the DDL lock and compare them with the snapshots."""
        plan = DdlPlan.of(plan)
        items = [_Item.from_plan(o) for o in plan.objects]
        snaps = {it.key: self.store.get(it.base_snapshot_id) for it in items}
        with self._locked([it.ref for it in items]), self.engine.connect() as conn:
            result = self._preflight(conn, items, snaps, plan)
            conn.rollback()
        return result

    def _refuse_merge(self, plan: DdlPlan, pre: PreflightResult) -> MergeRequired:
        keys = [m.object for m in pre.mismatches]
        err = MergeRequired(
            f"{', '.join(keys)} changed since the snapshot; a three-way merge proposal is "
            "attached -- review it, capture again and make a new plan",
            plan_hash=plan.plan_hash,
            objects=keys,
            live=dict(pre.live),
            merge=[m.to_dict() for m in pre.mismatches],
        )
        self._emit(ev.REFUSED, {"plan_hash": plan.plan_hash, "code": err.code,
                                "message": err.message, "objects": keys})
        return err

    # -- execute --------------------------------------------------------------------------------
    def execute(
        self, plan: PlanLike, *, on_apply_started: OnApplyStarted | None = None
    ) -> DdlOutcome:
        """Preflight, apply and verify the plan (and roll back or compensate on failure).

        Refusals before any DDL raise (PlanTampered, a prohibition, LockNotAcquired,
        MergeRequired).  Once DDL has run, the result is an outcome carrying its
        evidence; ``outcome.raise_for_outcome()`` raises the error behind a failure.
        ``on_apply_started(snapshot_ids)`` is called before the first DDL statement.
        """
        plan = DdlPlan.of(plan)
        if plan.dialect != self.dialect or plan.target != self.target:
            raise PlanTampered(
                f"the plan is for {plan.dialect} {plan.target}, not for "
                f"{self.dialect} {self.target}",
                plan_target=plan.target,
                target=self.target,
            )
        prohibitions.refuse(plan.to_dict(), {"plan_hash": plan.plan_hash})
        self._check_smokes(plan)
        items = [_Item.from_plan(o) for o in plan.objects]
        snaps = {it.key: self.store.get(it.base_snapshot_id) for it in items}
        for it in items:
            if not snaps[it.key].verify():
                raise PlanTampered(f"snapshot {it.base_snapshot_id} does not match its id")
        with self._locked([it.ref for it in items]):
            if self.adapter.transactional_ddl:
                return self._execute_transactional(plan, items, snaps, on_apply_started)
            return self._execute_committing(plan, items, snaps, on_apply_started)

    def _check_smokes(self, plan: DdlPlan) -> None:
        """Refuse (CG531), before any DDL runs, a plan whose smoke calls could not be contained
        (a plan recorded before capgate checked them when planning)."""
        for s in plan.smoke:
            self.adapter.check_smoke(str(s["name"]), str(s["sql"]))

    def _dependent_refs(
        self, conn: Connection, plan: DdlPlan, items: Sequence[_Item]
    ) -> list[ObjectRef]:
        keys = {it.key for it in items}
        found: dict[str, ObjectRef] = {}
        for recorded in plan.dependents:
            if not recorded.get("remote"):
                ref = ObjectRef.from_dict(recorded["object"])
                found.setdefault(ref.key, ref)
        for d in self.adapter.dependents_many(conn, [it.ref for it in items], self.progress):
            found.setdefault(d.object.key, d.object)
        return [r for k, r in sorted(found.items()) if k not in keys]

    def _statuses(self, conn: Connection, refs: Sequence[ObjectRef]) -> dict[str, ObjectStatus]:
        return self.adapter.statuses(conn, refs) if refs else {}

    def _apply_items(
        self, conn: Connection, items: Sequence[_Item], plan_hash_: str
    ) -> tuple[list[ObjectApply], ApplyFailed | None]:
        done: list[ObjectApply] = []
        with self.adapter.ddl_session(conn, self.lock_timeout):
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

    def _record_bases(self, items: Sequence[_Item], plan: DdlPlan,
                      before: Mapping[str, ObjectStatus]) -> dict[str, str]:
        """Snapshot what capgate just applied: the base of the next plan of these objects.

        The statuses found before the apply are kept too (where the store keeps
        them), so that ``verify OBJECT`` later judges a dependent as this apply did.
        """
        record = getattr(self.store, "record_baseline", None)
        if callable(record):
            statuses = {k: v.to_dict() for k, v in before.items()}
            for it in items:
                record(self.target, it.key, plan.plan_hash, statuses)
        out: dict[str, str] = {}
        with self.engine.connect() as conn:
            for it in items:
                live, _ = self._live(conn, it.ref)
                if live is None:
                    continue
                snap = self._snapshot(live.object, live)
                new = self.store.put(snap)
                out[it.key] = snap.id
                self._emit(ev.CAPTURED, {"snapshot_id": snap.id, "object": it.key,
                                         "signature": str(snap.signature), "exists": True,
                                         "new": new, "reason": "applied by capgate"})
            conn.rollback()
        return out

    def _execute_transactional(
        self, plan: DdlPlan, items: list[_Item], snaps: Mapping[str, Snapshot],
        on_apply_started: OnApplyStarted | None,
    ) -> DdlOutcome:
        ph = plan.plan_hash
        with self.engine.connect() as conn:
            self.adapter.begin(conn)
            dep_refs, before = self._start_apply(conn, plan, items, snaps, on_apply_started,
                                                 transactional=True)
            applied, failure, report, after, error = self._apply_and_verify(
                conn, plan, items, dep_refs, before, far_side=False, then="rolled back")
            if error is None:
                self._emit(ev.VERIFIED, {"plan_hash": ph,
                                         "checks": len(report.checks) if report else 0,
                                         "counts": report.counts() if report else {}})
                conn.commit()
                self._emit(ev.COMMITTED, {"plan_hash": ph})
            else:
                with suppress(sa.exc.DBAPIError, sa.exc.InvalidRequestError):
                    conn.rollback()
        if error is not None:
            if failure is None and report is not None:
                self._emit(ev.VERIFY_FAILED, {"plan_hash": ph, "checks": [
                    c.to_dict() for c in report.failures]})
            escapes = _escape_causes(report)
            restored = self._restored(items, snaps)
            if restored and not escapes:
                self._emit(ev.ROLLED_BACK, {"plan_hash": ph, "restored": True,
                                            "error": error_details(error)})
                return self._finish(self._outcome(ROLLED_BACK, plan, applied, items, dep_refs,
                                                  before, after, report, None, error, True))
            # "rolled back" only when the catalog says so.  Here the rollback did not bring
            # the snapshots back (something ended the verification transaction), so the
            # change is compensated like a committed one -- and escalated when code run
            # during verification may have committed writes of its own.
            self._emit(ev.ROLLBACK_INCOMPLETE, {"plan_hash": ph, "restored": restored,
                                                "escapes": escapes,
                                                "error": error_details(error)})
            return self._compensate_outcome(plan, items, snaps, dep_refs, before, after,
                                            applied, report, error, escalate=escapes)
        far = self._far_side_checks(plan)
        if far and not all(c.passed for c in far):
            report = VerifyReport((report.checks if report else ()) + tuple(far))
            error = VerifyFailed(f"far-side step failed after commit: {_failure_text(report)}",
                                 plan_hash=ph, checks=[c.to_dict() for c in report.failures])
            return self._compensate_outcome(plan, items, snaps, dep_refs, before, after,
                                            applied, report, error,
                                            escalate=_escape_causes(report))
        if far:
            report = VerifyReport((report.checks if report else ()) + tuple(far))
        bases = self._record_bases(items, plan, before)
        return self._finish(self._outcome(APPLIED_VERIFIED, plan, applied, items, dep_refs,
                                          before, after, report, None, None, None, bases))

    def _start_apply(
        self, conn: Connection, plan: DdlPlan, items: list[_Item],
        snaps: Mapping[str, Snapshot], on_apply_started: OnApplyStarted | None,
        *, transactional: bool,
    ) -> tuple[list[ObjectRef], dict[str, ObjectStatus]]:
        """Preflight, dependents and their statuses before, then "apply started".

        "Apply started" (with the snapshot ids) is recorded BEFORE the DDL: where DDL
        commits on its own, a crash from here on is resolved by classify().
        """
        ph = plan.plan_hash
        pre = self._preflight(conn, items, snaps, plan)
        if not pre.ok:
            if transactional:
                conn.rollback()
            raise self._refuse_merge(plan, pre)
        extra = [ObjectRef.from_dict(r) for r in plan.recompile_objects or ()]
        as_planned = plan.catalog_version is not None and plan.catalog_version == \
            self.adapter.catalog_version(conn, [it.ref for it in items])
        self._emit(ev.PREFLIGHT, {"plan_hash": ph, "live": dict(pre.live), "ok": True,
                                  "catalog": "as planned" if as_planned else "swept again"})
        if as_planned:
            # nothing in the scope's catalog moved since the plan: its dependents are still
            # the dependents, and their statuses then are their statuses before (for a run
            # check that depends on data, an older "before" can only make a failure more
            # likely to be blamed on this change, never excuse one)
            dep_refs = sorted((ObjectRef.from_dict(d["object"]) for d in plan.dependents
                               if not d.get("remote")), key=lambda r: r.key)
            before = _plan_before(plan)
            missing = [r for r in [it.ref for it in items] + dep_refs + extra
                       if r.key not in before]
            before.update(self._statuses(conn, missing))
        else:
            dep_refs = self._dependent_refs(conn, plan, items)
            before = self._statuses(conn, [it.ref for it in items] + dep_refs + [
                r for r in extra if r.key not in {d.key for d in dep_refs}])
        snapshot_ids = [it.base_snapshot_id for it in items]
        if on_apply_started is not None:
            on_apply_started(snapshot_ids)
        self._emit(ev.APPLY_STARTED, {"plan_hash": ph, "snapshot_ids": snapshot_ids,
                                      "objects": [it.key for it in items],
                                      "transactional": transactional})
        return dep_refs, before

    def _apply_and_verify(
        self, conn: Connection, plan: DdlPlan, items: list[_Item],
        dep_refs: list[ObjectRef], before: dict[str, ObjectStatus], *, far_side: bool,
        then: str,
    ) -> tuple[list[ObjectApply], ApplyFailed | None, VerifyReport | None,
               dict[str, ObjectStatus],
               DdlErrorLike | None]:
        """Apply every object, then verify; ``then`` says what a failed verify leads to.

        Returns (applied, apply failure, verify report, statuses after, the error to act on).
        """
        ph = plan.plan_hash
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
        self, plan: DdlPlan, items: list[_Item], snaps: Mapping[str, Snapshot],
        on_apply_started: OnApplyStarted | None,
    ) -> DdlOutcome:
        ph = plan.plan_hash
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
                                            applied, report, error,
                                            escalate=_escape_causes(report))
        self._emit(ev.VERIFIED, {"plan_hash": ph, "checks": len(report.checks) if report else 0,
                                 "counts": report.counts() if report else {}})
        bases = self._record_bases(items, plan, before)
        return self._finish(self._outcome(APPLIED_VERIFIED, plan, applied, items, dep_refs,
                                          before, after, report, None, None, None, bases))

    def _compensate_outcome(
        self, plan: DdlPlan, items: list[_Item], snaps: Mapping[str, Snapshot],
        dep_refs: list[ObjectRef], before: Mapping[str, ObjectStatus],
        after: Mapping[str, ObjectStatus], applied: list[ObjectApply],
        report: VerifyReport | None, error: DdlErrorLike, *, escalate: Sequence[str] = (),
    ) -> DdlOutcome:
        comp = self._compensate(plan, items, snaps, dep_refs, before, escalate)
        if comp.ok:
            return self._finish(self._outcome(COMPENSATED, plan, applied, items, dep_refs,
                                              before, after, report, comp, error, True))
        failed = CompensationFailed(
            "compensation did not restore the snapshot(s): " + "; ".join(comp.causes[:5])
            + " -- escalate, do not apply again",
            plan_hash=plan.plan_hash,
            snapshot_ids=dict(comp.snapshot_ids),
            live_signatures=dict(comp.live_signatures),
            snapshot_signatures=dict(comp.snapshot_signatures),
            causes=list(comp.causes),
            cause=error_details(error),
        )
        return self._finish(self._outcome(COMPENSATION_FAILED, plan, applied, items, dep_refs,
                                          before, after, report, comp, failed, False))

    def _finish(self, outcome: DdlOutcome) -> DdlOutcome:
        self._emit(ev.OUTCOME, {"plan_hash": outcome.plan_hash, "outcome": outcome.outcome,
                                "restored": outcome.restored,
                                "error": None if outcome.error is None else dict(outcome.error),
                                "new_bases": dict(outcome.new_bases)})
        return outcome

    def _outcome(
        self, outcome: str, plan: DdlPlan, applied: list[ObjectApply],
        items: Sequence[_Item], dep_refs: Sequence[ObjectRef],
        before: Mapping[str, ObjectStatus], after: Mapping[str, ObjectStatus],
        report: VerifyReport | None, comp: CompensationReport | None,
        error: DdlErrorLike | None, restored: bool | None,
        new_bases: Mapping[str, str] | None = None,
    ) -> DdlOutcome:
        statuses = tuple(
            StatusChange(r.key, role, before.get(r.key), after.get(r.key))
            for role, refs in (("changed", [it.ref for it in items]), ("dependent", dep_refs))
            for r in refs
        )
        return DdlOutcome(
            outcome=outcome,
            plan_hash=plan.plan_hash,
            dialect=self.dialect,
            objects=tuple(applied),
            statuses=statuses,
            verify=report,
            compensation=comp,
            error=None if error is None else error_details(error),
            restored=restored,
            new_bases=dict(new_bases or {}),
        )

    def _restored(self, items: Sequence[_Item], snaps: Mapping[str, Snapshot]) -> bool:
        with self.engine.connect() as conn:
            ok = all(str(self._live(conn, it.ref)[1]) == str(self.snapshot_signature(
                snaps[it.key])) for it in items)
            conn.rollback()
        return ok

    # -- verify ------------------------------------------------------------------------------
    def _verify(
        self, conn: Connection, plan: DdlPlan, items: Sequence[_Item],
        dep_refs: Sequence[ObjectRef], before: Mapping[str, ObjectStatus], *, smoke: bool,
        far_side: bool, restoring: bool = False,
    ) -> tuple[VerifyReport, dict[str, ObjectStatus]]:
        """Every check of a plan, with one verdict rule (``results.judge``).

        ``restoring`` (a compensation): a restored object that is exactly as
        invalid as it was before the apply is a warning, not a failure -- the
        compensation's job is to bring back what was, checker false positives
        included.
        """
        checks: list[Check] = []
        accepted = list(plan.accepted_warnings or ())
        after = self._statuses(conn, [it.ref for it in items])
        for it in items:
            checks.append(judge("compile", it.key, after.get(it.key), before.get(it.key),
                                accepted, same_as_before_is_fine=restoring))
            _, sig = self._live(conn, it.ref)
            if it.expected_signature is not None:
                checks.append(Check.of("landed", it.key, str(sig) == it.expected_signature,
                                       f"live {sig}, planned {it.expected_signature}",
                                       COMPARED))
            else:
                matches = self.adapter.source_matches(conn, it.ref, it.new_source)
                if matches is None:
                    checks.append(Check("landed", it.key, WARNING,
                                        f"live {sig}; the catalog re-renders this object, "
                                        "its text cannot be compared", COMPARED))
                else:
                    word = "matches" if matches else "differs from"
                    checks.append(Check.of("landed", it.key, matches,
                                           f"live {sig}; the stored body {word} the new source",
                                           COMPARED))
        swept = self.adapter.sweep(conn, dep_refs, before) if dep_refs else {}
        after.update(swept)
        for i, ref in enumerate(dep_refs, start=1):
            if self.progress is not None:
                self.progress(i, len(dep_refs), ref.key)
            checks.append(judge("dependent", ref.key, swept.get(ref.key), before.get(ref.key),
                                accepted))
        extra = [ObjectRef.from_dict(r) for r in plan.recompile_objects or ()]
        if extra:
            rec = self.adapter.sweep(conn, extra, before)
            for ref in extra:
                checks.append(judge("recompile", ref.key, rec.get(ref.key), before.get(ref.key),
                                    accepted))
        if not restoring:
            checks = _accept_listed_unverified(checks, plan)
        if smoke:
            checks += self._smoke(conn, plan)
        if far_side:
            checks += self._far_side_checks(plan)
        return VerifyReport(tuple(checks)), after

    def _smoke(self, conn: Connection, plan: DdlPlan) -> list[Check]:
        """Each smoke call run contained (``adapter.run_contained``), nothing of it kept.

        Its SQL was checked again before anything ran (``_check_smokes``: a plan
        recorded before the rule never runs a ``COMMIT``).  A call whose code tries to write
        fails (the engine refuses the write) and leaves nothing; a call that returns
        no rows (or no result set, like ``CALL``) passes unless it declared an
        ``expect``; a call that left its containment is a failed, ``escaped`` check.
        """
        out: list[Check] = []
        if not plan.smoke:
            return out
        calls = [ContainedCall(str(s["sql"]), dict(s.get("binds") or {}),
                               {str(k): str(v) for k, v in (s.get("session") or {}).items()})
                 for s in plan.smoke]
        ran = self.adapter.run_contained(conn, calls, self.check_timeout)
        for s, r in zip(plan.smoke, ran, strict=True):
            out.append(_smoke_check(f"smoke:{s['name']}", str(s["name"]), r, s.get("expect")))
        return out

    def _far_side_checks(self, plan: DdlPlan) -> list[Check]:
        out: list[Check] = []
        for s in plan.far_side_steps:
            name = f"far_side:{s['name']}"
            url = self.far_side.get(str(s["link"]))
            if url is None:
                out.append(Check(name, str(s["dependent"]), FAILED,
                                 f"no connection configured for link {s['link']}", ""))
                continue
            far_adapter = adapter_for(url)
            dep = ObjectRef.from_dict({**s["dependent_object"], "link": None})
            eng = far_adapter.engine(url)
            try:
                with eng.connect() as far:
                    if s.get("recompile", True) and dep.kind in far_adapter.kinds:
                        st = far_adapter.recompile(far, dep)
                        if not st.ok:
                            out.append(Check(name, str(s["dependent"]), FAILED,
                                             f"far-side recompile: {st.state} {st.errors}",
                                             st.checked))
                            continue
                    (r,) = far_adapter.run_contained(far, [ContainedCall(str(s["assertion"]))],
                                                     self.check_timeout)
                    out.append(_smoke_check(name, str(s["dependent"]), r, s.get("expect"),
                                            what="assertion returned", exact=True))
                    far.rollback()
            except sa.exc.DBAPIError as exc:
                out.append(Check(name, str(s["dependent"]), FAILED,
                                 f"error: {first_line(exc.orig)}", EXECUTED))
            finally:
                eng.dispose()
            self._emit(ev.FAR_SIDE, {"plan_hash": plan.plan_hash, "step": s["name"],
                                     "passed": out[-1].passed, "detail": out[-1].detail})
        return out

    def verify_object(self, obj: ObjectRef | str,
                      before: Mapping[str, ObjectStatus] | None = None) -> VerifyReport:
        """Check one live object outside any plan: its compile status and the dependent sweep.

        The verdicts are the apply's (``results.judge``).  ``before`` is the
        last known status of each object (the service passes the statuses
        recorded before the object's last apply), so a dependent that was
        already invalid then is a ``warning`` here as it was in that apply;
        without one, an invalid dependent ``failed``.  Nothing is changed on
        PostgreSQL and MariaDB (a re-check); Oracle recompiles only what is invalid.
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
            if before is None:
                before = self._baseline(ref)
            st = self._status(conn, ref)
            c = judge("compile", ref.key, st, before.get(ref.key))
            checks.append(Check(c.name, c.object, c.verdict, f"{c.detail}; live {sig}",
                                c.checked))
            refs = [d.object for d in self.adapter.dependents_many(conn, [ref], self.progress)]
            refs.sort()
            if refs:
                swept = self.adapter.sweep(conn, refs, before)
                for i, dep in enumerate(refs, start=1):
                    if self.progress is not None:
                        self.progress(i, len(refs), dep.key)
                    checks.append(judge("dependent", dep.key, swept.get(dep.key),
                                        before.get(dep.key)))
            conn.rollback()
        return VerifyReport(tuple(checks))

    def _baseline(self, ref: ObjectRef) -> dict[str, ObjectStatus]:
        """The statuses found before the latest apply of ``ref`` (none if the store keeps none)."""
        get = getattr(self.store, "baseline", None)
        found = get(self.target, ref.key) if callable(get) else None
        if not found:
            return {}
        return {k: ObjectStatus.from_dict(ObjectRef.parse(k) if ":" in k else ref, v)
                for k, v in found.items()}

    def verify(self, plan: PlanLike) -> VerifyReport:
        """Check the live state against the plan: compile status, landed text, dependents, smoke."""
        plan = DdlPlan.of(plan)
        refused: list[Check] = []
        try:
            self._check_smokes(plan)
        except SmokeNotContained as exc:  # a plan recorded before the rule: not run, failed
            refused = [Check(f"smoke:{s['name']}", str(s["name"]), FAILED,
                             f"not run: {exc.message}", "") for s in plan.smoke]
        items = [_Item.from_plan(o) for o in plan.objects]
        before = _plan_before(plan)
        with self.engine.connect() as conn:
            dep_refs = self._dependent_refs(conn, plan, items)
            report, _ = self._verify(conn, plan, items, dep_refs, before, smoke=not refused,
                                     far_side=True)
            conn.rollback()
        return VerifyReport(report.checks + tuple(refused)) if refused else report

    # -- compensate ------------------------------------------------------------------------
    def _compensate(
        self, plan: DdlPlan, items: Sequence[_Item], snaps: Mapping[str, Snapshot],
        dep_refs: Sequence[ObjectRef], before: Mapping[str, ObjectStatus],
        escalate: Sequence[str] = (),
    ) -> CompensationReport:
        """Re-apply the snapshots, read the live signatures, verify again.

        ``escalate``: what the compensation cannot undo whatever it does (code run
        during verification that left its containment and may have committed writes
        of its own): it is a cause, so the outcome is escalated, never ``compensated``.
        """
        ph = plan.plan_hash
        snapshot_ids = {it.key: it.base_snapshot_id for it in items}
        self._emit(ev.COMPENSATION_STARTED, {"plan_hash": ph, "snapshot_ids": snapshot_ids})
        actions: list[dict[str, Any]] = []
        live_sigs: dict[str, str] = {}
        snap_sigs = {it.key: str(self.snapshot_signature(snaps[it.key])) for it in items}
        report: VerifyReport | None = None
        with self.engine.connect() as conn:
            self.adapter.begin(conn)
            with self.adapter.ddl_session(conn, self.lock_timeout):
                for it in items:  # spec before body: re-creating a MariaDB spec drops the body
                    snap = snaps[it.key]
                    _, sig = self._live(conn, it.ref)
                    if str(sig) == snap_sigs[it.key]:
                        actions.append({"object": it.key, "action": "none",
                                        "reason": "live equals snapshot"})
                        continue
                    try:
                        if snap.exists:
                            notes = self.adapter.restore(conn, it.ref, snap.source,
                                                         snap.attributes)
                            actions.append({"object": it.key, "action": "re-applied snapshot",
                                            "snapshot_id": snap.id, "notes": notes})
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
            plain = replace(plan, smoke=(), far_side_steps=())
            report, _ = self._verify(conn, plain, [
                _Item(it.ref, it.base_snapshot_id, snap_sigs[it.key], snaps[it.key].source,
                      snap_sigs[it.key], snap_sigs[it.key] if snaps[it.key].exists else None,
                      it.attributes)
                for it in items if snaps[it.key].exists
            ], dep_refs, before, smoke=False, far_side=False, restoring=True)
            if self.adapter.transactional_ddl:
                conn.rollback()
        causes: list[str] = []
        for a in actions:
            if a["action"] == "failed":
                causes.append(f"{a['object']}: re-applying snapshot {a['snapshot_id']} failed: "
                              f"{a['error'].get('message', '')}")
        for k in snap_sigs:
            if live_sigs[k] != snap_sigs[k]:
                causes.append(f"{k}: live {live_sigs[k]} differs from snapshot {snap_sigs[k]}")
        causes += [f"{c.name} {c.object}: {c.detail}" for c in report.failures]
        causes += list(escalate)
        ok = not causes
        comp = CompensationReport(ok, snapshot_ids, tuple(actions), live_sigs, snap_sigs, report,
                                  tuple(causes))
        self._emit(ev.COMPENSATED if ok else ev.COMPENSATION_FAILED,
                   {"plan_hash": ph, **comp.to_dict()})
        return comp

    def compensate(self, plan: PlanLike) -> CompensationReport:
        """Restore every object of the plan from its snapshot (where it differs), then verify.

        For a case resumed as ``partly_applied``; each snapshot is applied at most once.
        The restored objects and the dependents are judged against their statuses
        before the apply (recorded in the plan).
        """
        plan = DdlPlan.of(plan)
        items = [_Item.from_plan(o) for o in plan.objects]
        snaps = {it.key: self.store.get(it.base_snapshot_id) for it in items}
        before = _plan_before(plan)
        with self._locked([it.ref for it in items]):
            with self.engine.connect() as conn:
                dep_refs = self._dependent_refs(conn, plan, items)
                conn.rollback()
            return self._compensate(plan, items, snaps, dep_refs, before)

    # -- recovery -----------------------------------------------------------------------------
    def classify(
        self, plan: PlanLike, observed: Mapping[str, str] | None = None
    ) -> RecoveryReport:
        """After a crash past "apply started": what landed, judged by live signatures.

        ``observed`` maps object keys to applied signatures the ledger recorded
        (``ddl.object_applied`` events), as extra evidence.
        """
        plan = DdlPlan.of(plan)
        items = [_Item.from_plan(o) for o in plan.objects]
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
        return RecoveryReport(cls, plan.plan_hash, tuple(rows))

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


def _smoke_check(name: str, obj: str, r: Ran, expect: Any, *, what: str = "returned",
                 exact: bool = False) -> Check:
    """The verdict on one contained call (a smoke call; ``exact``: a far-side assertion,
    whose first value must equal ``expect`` even when that is None)."""
    if r.escaped is not None:
        return Check(name, obj, FAILED, f"left its containment: {r.escaped}; what it wrote may "
                     "be committed", EXECUTED, escaped=True)
    if r.error is not None:
        why = (" (the engine refused a write: the code tried to write)" if r.writes
               else " (the check's time limit)" if r.timed_out else "")
        return Check(name, obj, FAILED, f"error: {r.error}{why}", EXECUTED)
    value = None if r.row is None else r.row[0]
    if exact:
        ok = _same(value, expect)
    else:
        ok = expect is None or (r.row is not None and _same(value, expect))
    detail = (f"{what} no rows" if r.row is None else f"{what} {value!r}") + (
        "" if expect is None and not exact else f", expected {expect!r}")
    return Check(name, obj, PASSED if ok else FAILED, detail + " (contained, read-only)",
                 EXECUTED)


def _accept_listed_unverified(checks: Sequence[Check], plan: DdlPlan) -> list[Check]:
    """An ``unverified`` object passes only when the approved plan lists it as unverified.

    Approving a plan's hash accepts what it says nothing covers; an object found
    unverified only at apply (a view that no longer gives a row, a dependent that
    appeared since the plan) is something nobody accepted, so the verify fails.
    """
    listed = {str(u.get("object")) for u in plan.unverified or ()}
    out: list[Check] = []
    for c in checks:
        if c.verdict == UNVERIFIED and c.name in ("compile", "dependent", "recompile") \
                and c.object not in listed:
            c = Check(c.name, c.object, FAILED, f"{c.detail} -- unverified, and not listed as "
                      "unverified in the approved plan", c.checked)
        out.append(c)
    return out


def _escape_causes(report: VerifyReport | None) -> list[str]:
    """What no compensation of stored code can undo: checks whose code left containment."""
    return [f"{c.name} {c.object} {c.detail}; a person checks what it wrote"
            for c in (report.escapes if report is not None else ())]


def _failure_text(report: VerifyReport) -> str:
    return "; ".join(f"{c.name} {c.object}: {c.detail}" for c in report.failures[:5])


def _status_from(d: Mapping[str, Any]) -> ObjectStatus:
    return ObjectStatus.from_dict(ObjectRef.from_dict(d["object"]), d["status_before"])


def _plan_before(plan: DdlPlan) -> dict[str, ObjectStatus]:
    """The statuses a plan recorded before the change: its objects' and its dependents'."""
    out = {str(d["key"]): _status_from(d) for d in plan.dependents
           if d.get("status_before")}
    for o in plan.objects:
        if o.get("status_before"):
            out[str(o["key"])] = _status_from(o)
    return out
