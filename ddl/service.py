"""The DDL loop behind the executor's gates: rows, approvals, the ledger and recovery.

``ddl.loop`` knows stored code; ``executor`` knows rows, grants, approvals
and the ledger.  This module joins them, so that a ``ddl`` row is used the
way every other row is -- declared, gated, recorded -- while the DDL loop
does the work:

* **Plan** (``DdlService.plan``): the row is resolved for its connector's
  environment (``effect_class: ddl`` only), each new source is validated
  against the row's ``input`` contract, the caller needs a write grant, and
  every object a source creates or replaces must be in the row's scope
  (``ddl.objects`` or ``ddl.pattern``, in the connector's own schema) -- checked
  on the source's header before the catalog is read, and again on the plan.
  The plan binds the case, the requester, ``operation_id``, ``version``,
  ``row_hash``, connector and environment into its hash (the same change
  planned in another case is another plan) and is recorded with
  ``Ledger.record_plan``, so
  ``capgate approve PLAN_HASH`` approves it like any gated plan.  Unless a
  base snapshot is named (or ``fresh``), each object's base is its latest
  stored snapshot: the one an operator captured and edited, so that a save
  made since is refused as a stale extract instead of being overwritten.
* **Apply** (``DdlService.apply``): the recorded plan (intact, same case,
  same row hash, connector and environment, objects still in scope), a
  valid approval not given by the caller where four eyes apply, and a
  preflight under the session lock -- all before anything is recorded.  Then,
  per intent, in the case's chain:

  ``prepared`` (plan hash, snapshot ids, row hash) -- ``ddl_apply_started``
  (snapshot ids; written by the loop's ``on_apply_started`` hook, *before*
  the first DDL statement, which on MariaDB and Oracle commits on its own)
  -- the loop's events (``ddl.preflight``, ``ddl.object_applied``,
  ``ddl.verified`` / ``ddl.verify_failed``, ``ddl.committed`` /
  ``ddl.rolled_back``, ``ddl.compensation_started``, ``ddl.compensated`` /
  ``ddl.compensation_failed``, ``ddl.outcome``) -- and finally ``observed``
  with the outcome (``applied_verified``, ``rolled_back``, ``compensated``),
  or ``escalated`` for ``compensation_failed``.

  An error after ``ddl_apply_started`` is never guessed at: the intent stays
  open and the caller gets ``OutcomeUnknown``; :func:`classify_ddl_intent`
  (for ``resume``) and :func:`settle_ddl_intent` tell what landed from the
  live signatures.
* **Compensate** (``DdlService.compensate``): re-apply an intent's snapshots
  and verify, refused when the live objects match neither the snapshots nor
  the new sources (somebody else's change would be overwritten).
* **Simulate** (``DdlService.simulate``): on a lower venue, apply + verify and
  then compensate an approved plan, and record the evidence; a plan on a
  promotion venue names its stage and rests on that evidence (the same source
  in the same case) or on the exemption test (:mod:`ddl.promotion`).
* **Refusals**: every refused plan is recorded in its case (``ddl.refused``);
  a refused apply whose objects moved proposes the merge as a plan of its own.

Snapshots are kept in the ledger's own store (``SqlSnapshotStore`` on the
ledger engine, table ``cg_ddl_snapshots``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from capgate.ddl import events as ev
from capgate.ddl.catalog import SPEC_OF_BODY, Dependent, ObjectRef, Progress
from capgate.ddl.events import ListSink
from capgate.ddl.loop import DdlLoop
from capgate.ddl.plan import PLAN_FORMAT, DdlPlan
from capgate.ddl.results import (
    APPLIED_VERIFIED,
    COMPENSATED,
    COMPENSATION_FAILED,
    ROLLED_BACK,
    Change,
    DdlOutcome,
    FarSideStep,
    PreflightResult,
    RecoveryReport,
    SmokeCall,
    VerifyReport,
)
from capgate.ddl.snapshots import ExportResult, Snapshot, SqlSnapshotStore
from capgate.executor.call import TERMINAL, Executor, crash_point, validate_input
from capgate.executor.connectors import ConnectorConfig, driver_options, normalise_url
from capgate.executor.outcome import Outcome
from capgate.executor.plan import fingerprint
from capgate.registry.errors import (
    ApprovalExpired,
    ApprovalMismatch,
    ApprovalRequired,
    ApprovalUsed,
    CapgateError,
    CaseConflict,
    DdlError,
    MergeRequired,
    ObjectOutOfScope,
    OutcomeUnknown,
    PlanTampered,
    PromoterLacksRole,
    PromotionRefused,
    ReconciliationRequired,
    SelfApproval,
    SimulationVenueRefused,
    StaleExtract,
    UsageError,
    error_details,
)
from capgate.registry.model import EffectClass, Row
from capgate.registry.vocabulary import RollbackReason

__all__ = [
    "APPLY_STARTED",
    "CRASH_POINTS",
    "DdlService",
    "LedgerSink",
    "check_scope",
    "classify_ddl_intent",
    "in_scope",
    "settle_ddl_intent",
]

APPLY_STARTED = "ddl_apply_started"
"""The ledger event written before the first DDL statement of an apply."""
COMPENSATION_REQUESTED = "ddl_compensation_requested"
CRASH_POINTS = ("ddl_after_apply_started", "ddl_after_object_applied")
"""Test-only boundaries for ``CAPGATE_CRASH_AT`` (see ``executor.call.crash_point``)."""
DEFAULT_LOCK_TIMEOUT = 10.0

_RULES = {
    "applied": "every object's live signature equals the planned (or recorded) one",
    "not_applied": "every object's live signature equals its snapshot's",
    "partly_applied": "some objects carry the new source while others still equal their snapshot",
    "unknown": "an object matches neither its snapshot nor the new source",
}


# --- scope ---------------------------------------------------------------------------------


def in_scope(row: Row, kind: str, name: str) -> bool:
    """Whether the row's ``ddl`` scope covers an object of this kind and name.

    ``ddl.objects`` entries match on type and name (names compared without
    case); a ``package`` (``type``) entry also covers its body, since a spec is
    never changed without its body.  ``ddl.pattern`` is a shell-style glob over
    the name (``billing_*``), or over ``kind:name`` when it contains a colon
    (``function:calc_*``).
    """
    scope = row.ddl
    if scope is None:
        return False
    kinds = {kind}
    if kind in SPEC_OF_BODY:
        kinds.add(SPEC_OF_BODY[kind])
    folded = name.casefold()
    if any(o.type in kinds and o.name.casefold() == folded for o in scope.objects):
        return True
    if scope.pattern:
        pattern = scope.pattern.casefold()
        subjects = [f"{k}:{folded}" for k in kinds] if ":" in pattern else [folded]
        return any(fnmatch.fnmatchcase(s, pattern) for s in subjects)
    return False


def check_scope(row: Row, ref: ObjectRef, default_schema: str | None) -> None:
    """Refuse (ObjectOutOfScope) an object the row may not change.

    ``default_schema`` is the connector's own schema; an object in another
    schema, or across a database link, is out of scope whatever its name.
    """
    why: str | None = None
    if ref.link is not None:
        why = f"it is reached over database link {ref.link}"
    elif (ref.schema is not None and default_schema is not None
          and ref.schema.casefold() != default_schema.casefold()):
        why = f"it is in schema {ref.schema}, not in the connector's schema {default_schema}"
    elif not in_scope(row, ref.kind, ref.name):
        why = "the row's ddl scope does not name it"
    if why is None:
        return
    scope = row.ddl
    raise ObjectOutOfScope(
        f"{row.ref} may not change {ref.key}: {why} (it may change "
        f"{_scope_text(row)}); use the row that covers it",
        object=ref.key,
        operation_id=row.operation_id,
        version=row.version,
        allowed=[{"type": o.type, "name": o.name} for o in scope.objects] if scope else [],
        pattern=scope.pattern if scope else None,
        schema=default_schema,
    )


def _scope_text(row: Row) -> str:
    scope = row.ddl
    if scope is None:
        return "nothing"
    names = [f"{o.type} {o.name}" for o in scope.objects]
    if scope.pattern:
        names.append(f"names matching {scope.pattern!r}")
    return ", ".join(names) or "nothing"


# --- the ledger as the loop's event sink -------------------------------------------------------


class LedgerSink:
    """Appends the loop's events to the case chain, on one intent (or on the case).

    ``ddl.apply_started`` is not forwarded: the apply's own hook records it
    as ``ddl_apply_started`` at the same point, before the DDL.  The applied
    signatures are carried in the intent's state (``applied_signatures``) as
    evidence for recovery.
    """

    def __init__(self, executor: Executor, case_id: str, intent_id: str | None = None,
                 *, extra: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.executor = executor
        self.case_id = case_id
        self.intent_id = intent_id
        self.extra = {k: dict(v) for k, v in (extra or {}).items()}
        self.applied: dict[str, str] = {}
        self.recorded: list[str] = []

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == ev.APPLY_STARTED:
            return
        body = {k: v for k, v in payload.items() if k not in ("state", "case_state")}
        if "outcome" in body and not isinstance(body["outcome"], Mapping):
            body["result"] = body.pop("outcome")  # "outcome" is an outcome record in the ledger
        body.update(self.extra.get(kind, {}))
        if kind == ev.OBJECT_APPLIED and payload.get("applied_signature"):
            self.applied[str(payload["object"])] = str(payload["applied_signature"])
            if self.intent_id is not None:
                body["state"] = {"applied_signatures": dict(self.applied)}
        self.executor.ledger.append(self.case_id, kind, body, intent_id=self.intent_id)
        self.recorded.append(kind)
        if kind == ev.OBJECT_APPLIED:
            crash_point("ddl_after_object_applied")


# --- the service ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompensationResult:
    """What ``ddl compensate`` did to one intent."""

    case_id: str
    intent_id: str
    outcome: str
    """``compensated`` or ``compensation_failed``."""
    before: RecoveryReport
    record: Mapping[str, Any]

    @property
    def ok(self) -> bool:
        return self.outcome == COMPENSATED

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case_id, "intent_id": self.intent_id, "outcome": self.outcome,
                "before": self.before.to_dict(), "record": dict(self.record)}


class DdlService:
    """The DDL loop for an executor's rows, connectors, grants and ledger."""

    def __init__(self, executor: Executor, *, progress: Progress | None = None) -> None:
        """
        :param executor: supplies the registry, connectors, grants, ledger and clock.
        :param progress: ``progress(done, total, label)`` during sweeps over many objects.
        """
        self.executor = executor
        self.progress = progress
        self.store = SqlSnapshotStore(executor.ledger.engine)

    # -- wiring ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def loop(self, connector: str | ConnectorConfig, *, row: Row | None = None,
             sink: ev.DdlEventSink | None = None,
             far_side: Mapping[str, str | URL] | None = None) -> Iterator[DdlLoop]:
        """A DDL loop on the connector's database, its snapshots in the ledger store.

        ``far_side`` maps a link name to the URL of the far database (from the
        row's ``ddl.far_side`` connectors); the row's ``lock_seconds`` bound the
        session lock wait and the DDL's own lock wait.
        """
        cfg = connector if isinstance(connector, ConnectorConfig) else \
            self.executor.connectors.config(connector)
        if far_side is None and row is not None:
            far_side = self._far_side(row)
        lock = row.timeout.lock_seconds if row is not None else None
        with DdlLoop(normalise_url(cfg.url), self.store, sink=sink, progress=self.progress,
                     lock_timeout=float(lock or DEFAULT_LOCK_TIMEOUT),
                     far_side=dict(far_side or {}),
                     engine_options=driver_options(cfg)) as lp, \
                self._counted(cfg):
            yield lp

    @contextlib.contextmanager
    def _counted(self, cfg: ConnectorConfig) -> Iterator[None]:
        """The DDL loop's sessions count against the connector's session budget (issue 18:
        the database's per-user limit, e.g. ORA-02391, counts them too): two slots, the
        lock session and the working one, held while the loop runs."""
        from capgate.executor.budget import budgets_of

        try:
            budgets = budgets_of(self.executor)
        except LookupError:  # an executor without budgets
            budgets = None
        if budgets is None or cfg.name not in self.executor.connectors.names():
            yield
            return
        connector = self.executor.connectors.get(cfg.name)
        tickets = [budgets.acquire(connector) for _ in range(min(2, cfg.session_budget))]
        try:
            yield
        finally:
            for ticket in tickets:
                ticket.release()

    # -- the far side of database links, as the row declares it ---------------------------------
    def _far_side(self, row: Row) -> dict[str, str | URL]:
        """link name -> URL of the far connector, for every ``ddl.far_side`` entry of the row."""
        out: dict[str, str | URL] = {}
        for f in (row.ddl.far_side if row.ddl else ()):
            cfg = self.executor.connectors.config(f.connector)
            out[f.link] = normalise_url(cfg.url)
        return out

    @staticmethod
    def _far_side_steps(row: Row) -> list[FarSideStep]:
        out: list[FarSideStep] = []
        for f in (row.ddl.far_side if row.ddl else ()):
            for st in f.steps:
                dep = ObjectRef.parse(st.dependent)
                dep = ObjectRef(dep.kind, dep.name, dep.schema, dep.args, dep.parent, f.link)
                out.append(FarSideStep(st.name, f.link, dep, st.assertion, st.expect,
                                       st.recompile))
        return out

    @staticmethod
    def _declared_remote(row: Row, on: ObjectRef) -> list[Dependent]:
        out: list[Dependent] = []
        for f in (row.ddl.far_side if row.ddl else ()):
            for key in f.dependents:
                dep = ObjectRef.parse(key)
                out.append(Dependent(ObjectRef(dep.kind, dep.name, dep.schema, dep.args,
                                               dep.parent, f.link), on, "declared on the row"))
        return out

    def resolve_row(self, operation_id: str, version: int | None = None
                    ) -> tuple[Row, ConnectorConfig]:
        """The ``ddl`` row allowed in its connector's environment, and that connector
        (outside the unlocked environments, pinned by the lock as it is)."""
        self.executor.refresh()
        registry = self.executor.registry
        candidate = registry.resolve(operation_id, version)
        cfg = self.executor.connectors.config(candidate.connector)
        row = registry.resolve(operation_id, version, cfg.environment)
        self.executor.rt.check_pinned(row, cfg.environment, registry)
        if row.effect_class is not EffectClass.DDL:
            raise UsageError(
                f"{row.ref} is a {row.effect_class} row, not a ddl row; use `capgate plan` / "
                "`capgate call`", operation_id=row.operation_id, version=row.version)
        return row, cfg

    def _row_of_plan(self, plan: DdlPlan) -> tuple[Row, ConnectorConfig]:
        bound = plan.bound
        for name in ("operation_id", "version"):
            if name not in bound:
                raise PlanTampered(f"the plan names no {name}: it was not made for a ddl row "
                                   "(capgate ddl plan); make a new plan", field=name)
        row, cfg = self.resolve_row(str(bound["operation_id"]), int(bound["version"]))
        if row.row_hash != bound.get("row_hash"):
            raise PlanTampered(
                f"the plan was made against {row.ref} with hash {bound.get('row_hash')}, the "
                f"registry now has {row.row_hash}; make a new plan",
                recorded=bound.get("row_hash"), current=row.row_hash)
        if cfg.name != bound.get("connector") or cfg.environment != bound.get("environment"):
            raise PlanTampered(
                f"the plan is for connector {bound.get('connector')} ({bound.get('environment')}),"
                f" the row now runs on {cfg.name} ({cfg.environment}); make a new plan",
                plan_connector=bound.get("connector"), connector=cfg.name)
        return row, cfg

    def _recorded_plan(self, plan_hash: str) -> tuple[DdlPlan, str, str]:
        """The recorded DDL plan (checked intact), its case and its requester."""
        record = self.executor.ledger.get_plan(plan_hash)
        if record.plan.get("format") != PLAN_FORMAT:
            raise UsageError(
                f"plan {plan_hash} is not a DDL plan; run it with `capgate call --plan "
                f"{plan_hash}`", plan_hash=plan_hash)
        plan = DdlPlan.of(record.plan)
        if plan.plan_hash != plan_hash:
            raise PlanTampered(f"plan {plan_hash} is recorded with content of another hash",
                               recorded=plan_hash, computed=plan.plan_hash)
        return plan, record.case_id, record.requester

    @staticmethod
    def _scope_objects(loop: DdlLoop, conn: Connection, row: Row,
                       plan: DdlPlan) -> None:
        default = loop.adapter.default_schema(conn)
        for o in plan.objects:
            check_scope(row, ObjectRef.from_dict(o["object"]), default)

    # -- capture, snapshots, export, verify -----------------------------------------------------
    def capture(self, connector: str, objects: Sequence[str | ObjectRef]) -> list[Snapshot]:
        """Capture each object (an immutable snapshot in the ledger store)."""
        with self.loop(connector) as lp:
            return lp.capture_many(list(objects))

    def snapshots(self, connector: str, obj: str | ObjectRef) -> list[Snapshot]:
        """The stored snapshots of one object, oldest first."""
        ref = ObjectRef.parse(obj) if isinstance(obj, str) else obj
        with self.loop(connector) as lp, lp.engine.connect() as conn:
            ref = lp.adapter.resolve(conn, ref)
            if ref.kind in ("function", "procedure") and ref.args is None:
                # a function that no longer exists: any argument list
                return [s for s in self.store.history(dialect=lp.dialect)
                        if (s.object.kind, s.object.schema, s.object.name)
                        == (ref.kind, ref.schema, ref.name)]
            return self.store.history(ref, lp.dialect)

    def export(self, directory: str | Path) -> ExportResult:
        """Write every snapshot as a file (and ``index.json``) for a git mirror."""
        return self.store.export(directory)

    def verify_object(self, connector: str, obj: str | ObjectRef) -> VerifyReport:
        """The object's compile status and the dependent sweep, outside any plan."""
        with self.loop(connector) as lp:
            return lp.verify_object(obj)

    def verify_plan(self, plan_hash: str) -> VerifyReport:
        """Check the live state against a recorded plan (landed text, dependents, smoke)."""
        plan, _, _ = self._recorded_plan(plan_hash)
        _, cfg = self._row_of_plan(plan)
        with self.loop(cfg) as lp:
            return lp.verify(plan)

    # -- plan --------------------------------------------------------------------------------------
    def plan(
        self,
        operation_id: str,
        sources: Sequence[str],
        *,
        case: str,
        who: str,
        version: int | None = None,
        bases: Sequence[str] = (),
        fresh: bool = False,
        smoke: Sequence[SmokeCall] = (),
        recompile: Sequence[str] = (),
    ) -> DdlPlan:
        """Make, check and record the plan for new sources of a ddl row's objects.

        No DDL is committed.  Returns the plan (with ``plan_hash``).  Every refusal --
        an unknown row, no grant, a source out of scope or not one definition, a smoke
        call that cannot be contained, a prohibition, nothing to apply -- is recorded
        in the case as ``ddl.refused`` (code, message, who, the operation) and raised.
        """
        if not sources:
            raise UsageError("a DDL plan needs at least one source")
        sink = ListSink()
        row: Row | None = None
        try:
            row, cfg = self.resolve_row(operation_id, version)
            return self._plan(row, cfg, sources, sink, case=case, who=who, bases=bases,
                              fresh=fresh, smoke=smoke, recompile=recompile)
        except CapgateError as exc:
            self._record_refusal(case, who, operation_id, version, row, sink, exc)
            raise

    def _record_refusal(self, case: str, who: str, operation_id: str, version: int | None,
                        row: Row | None, sink: ListSink, exc: CapgateError) -> None:
        """The case's record of a refused plan: the loop's events so far and ``ddl.refused``."""
        if not any(k == ev.REFUSED for k, _ in sink.events):
            sink.record(ev.REFUSED, {"code": exc.code, "message": exc.message,
                                     "error": type(exc).__name__})
        items: list[tuple[str, Mapping[str, Any], str | None]] = []
        for kind, payload in sink.events:
            if kind in (ev.PLANNED, ev.REFUSED):
                payload = {**payload, "operation_id": row.operation_id if row else operation_id,
                           "version": row.version if row else version, "by": who}
            items.append((kind, payload, None))
        self.executor.ledger.append_many(case, items)

    def _plan(self, row: Row, cfg: ConnectorConfig, sources: Sequence[str], sink: ListSink,
              *, case: str, who: str, bases: Sequence[str], fresh: bool,
              smoke: Sequence[SmokeCall], recompile: Sequence[str]) -> DdlPlan:
        for source in sources:
            validate_input(row, {"source": source})
        self.executor.grants.check_call(who, row, cfg.name, cfg.environment)
        with self.loop(cfg, row=row, sink=sink) as lp:
            # the header names the object: refuse out-of-scope sources before the catalog
            for source in sources:
                head = lp.adapter.header(source)
                check_scope(row, ObjectRef(head.kind, head.name, head.schema), None)
            named = {}
            for sid in bases:
                snap = self.store.get(sid)
                named[snap.object.key] = snap.id
            changes: list[Change] = []
            with lp.engine.connect() as conn:
                default = lp.adapter.default_schema(conn)
                for source in sources:
                    ref = lp.adapter.identify(conn, source)
                    check_scope(row, ref, default)
                    base = named.pop(ref.key, None)
                    if base is None and not fresh:
                        found = lp.base_for(conn, ref)
                        base = None if found is None else found.id
                    changes.append(Change(source, object=ref, base_snapshot_id=base))
                conn.rollback()
            if named:
                raise UsageError(f"base snapshot(s) of objects the plan does not change: "
                                 f"{', '.join(sorted(named))}", objects=sorted(named))
            stage = self._stage(lp, row, cfg, case, [
                (c.object, c.source) for c in changes if c.object is not None])
            bind = {
                "stage": stage,
                "case": case,
                "requested_by": who,
                "operation_id": row.operation_id,
                "version": row.version,
                "row_hash": row.row_hash,
                "connector": cfg.name,
                "environment": cfg.environment,
                "effect_class": str(row.effect_class),
                "authorization": {"kind": str(row.authorization.kind),
                                  "approver_roles": list(row.authorization.approver_roles),
                                  "four_eyes": row.authorization.four_eyes},
            }
            scope = row.ddl
            plan = lp.plan(changes, smoke=smoke, recompile=recompile, bind=bind,
                           accepted_warnings=[a.to_dict() for a in scope.accepted_warnings]
                           if scope else [],
                           far_side_steps=self._far_side_steps(row),
                           remote_dependents=self._declared_remote(row, next(
                               (c.object for c in changes if c.object is not None
                                and not c.object.is_body), changes[0].object or ObjectRef(
                                   "function", "?"))))
            with lp.engine.connect() as conn:
                self._scope_objects(lp, conn, row, plan)
                conn.rollback()
        self.executor.ledger.record_plan(plan.plan_hash, case, who, plan.to_dict())
        self._record_case_events(case, who, row, sink)
        return plan

    # -- simulation first: the stage a plan rests on ---------------------------------------------
    def _stage(self, lp: DdlLoop, row: Row, cfg: ConnectorConfig, case: str,
               changes: Sequence[tuple[ObjectRef, str]]) -> dict[str, Any]:
        """The plan's stage: the environment, and on a promotion venue the simulation evidence
        of the same source (or the exemption test) it rests on; refused without either."""
        from capgate.ddl import promotion

        source_id, parts = promotion.source_identity(lp.adapter, changes)
        decision = promotion.decide(self.executor, row, cfg, case, source_id, None)
        if decision.promotes and decision.evidence is None:
            refs = [ref for ref, _ in changes]
            with lp.engine.connect() as conn:
                keys = {r.key for r in refs}
                deps = [d.object.key for d in lp.adapter.dependents_many(conn, refs)
                        if d.object.key not in keys]
                callers = sorted({h.object.key for r in refs
                                  for h in lp.adapter.search_callers(conn, r).hits
                                  if h.object.key not in keys})
                conn.rollback()
            history = self.executor.ledger.intents(case) if \
                self.executor.ledger.snapshot(case) is not None else {}
            test = promotion.exemption_test(row, cfg.environment, refs, deps, callers, history)
            decision = promotion.decide(self.executor, row, cfg, case, source_id, test)
        if not decision.allowed:
            assert decision.exemption is not None
            failed = "; ".join(f"({p.number}) {p.name}: {p.why}"
                               for p in decision.exemption.failed)
            raise PromotionRefused(
                f"{row.ref} on {cfg.name!r} ({cfg.environment}) is a promotion and case "
                f"{case!r} holds no simulation of this source on a lower venue "
                f"({(decision.missing or 'no_evidence').replace('_', ' ')}); nor is it "
                f"exempt: {failed}. Simulate it first: plan and approve it on a lower venue, "
                f"then `capgate ddl simulate PLAN_HASH --case {case}` (apply, verify, "
                "compensate); nothing was planned",
                operation_id=row.operation_id, version=row.version, case=case,
                environment=cfg.environment, missing=decision.missing, source_id=source_id,
                exemption=decision.exemption.to_dict(),
                evidence_seen=[dict(e) for e in decision.seen])
        return {**decision.to_dict(), "source_id": source_id, "sources": parts}

    def _check_stage(self, plan: DdlPlan, row: Row, cfg: ConnectorConfig, case: str,
                     who: str) -> None:
        """At apply, before anything is recorded: the plan's stage still holds here.

        On a promotion venue the promoting identity must hold one of the connector's
        ``promotion_roles`` for the environment (when it names some), and the plan must
        rest on simulation evidence that is still there, proven and fresh -- or on its
        exemption test, which is recorded in the case (``exemption_claimed``) once.
        """
        from capgate.ddl import promotion

        if not cfg.promotes:
            return
        stage = plan.bound.get("stage")
        roles = cfg.promotion_roles
        if roles:
            principal = self.executor.grants.principal(who)
            if not any(principal.holds(r, cfg.environment) for r in roles):
                raise PromoterLacksRole(
                    f"{who!r} holds none of the promotion roles {', '.join(roles)} for "
                    f"{cfg.environment!r}, which applying stored code on {cfg.name!r} needs; "
                    "nothing was recorded", principal=who, roles=list(roles),
                    environment=cfg.environment)
        if not isinstance(stage, Mapping) or not stage.get("promotes"):
            raise PromotionRefused(
                f"plan {plan.plan_hash} names no stage on the promotion venue "
                f"{cfg.environment!r} (it was made where it was no promotion, or before "
                "capgate recorded stages); make a new plan here", plan_hash=plan.plan_hash,
                environment=cfg.environment)
        if stage.get("evidence") is not None:
            decision = promotion.decide(self.executor, row, cfg, case,
                                        str(stage.get("source_id")), None)
            if decision.evidence is None:
                raise PromotionRefused(
                    f"the simulation evidence plan {plan.plan_hash} rests on no longer holds "
                    f"({(decision.missing or 'no_evidence').replace('_', ' ')}); simulate "
                    "again on a lower venue and make a new plan; nothing was recorded",
                    plan_hash=plan.plan_hash, missing=decision.missing,
                    environment=cfg.environment)
            return
        exemption = stage.get("exemption")
        if not isinstance(exemption, Mapping) or not exemption.get("exempt"):
            raise PromotionRefused(
                f"plan {plan.plan_hash} rests on neither simulation evidence nor an "
                "exemption; make a new plan", plan_hash=plan.plan_hash)
        key = f"exemption:{plan.plan_hash}"
        snapshot = self.executor.ledger.snapshot(case) or {}
        if key not in (snapshot.get("case") or {}):
            self.executor.ledger.append(case, "exemption_claimed", {
                "operation_id": row.operation_id, "version": row.version,
                "row_hash": row.row_hash, "environment": cfg.environment,
                "plan_hash": plan.plan_hash, "by": who, "effect_class": "ddl",
                "case_state": {key: dict(exemption)}})

    def simulate(self, plan_hash: str, *, case: str, who: str) -> dict[str, Any]:
        """A DDL simulation on a lower venue: apply + verify, then compensate; the evidence.

        The plan is applied through every gate (its approval is consumed, the intent
        recorded), and when it ends ``applied_verified`` it is compensated at once
        (snapshots re-applied, verified, the live signatures re-read).  Only when both
        hold is the evidence written to the case (``ddl_simulated``, under
        ``ddl_simulated:INTENT``): the source identity, the row version, the venue and
        the intent, which a promotion cross-checks against the intent's own events.
        A simulation is not a deployment: the venue is left as it was.  Refused on a
        promotion venue (``SimulationVenueRefused``): simulate below it.
        """
        from capgate.ddl import promotion

        plan, _, _ = self._recorded_plan(plan_hash)
        row, cfg = self._row_of_plan(plan)
        if cfg.promotes:
            raise SimulationVenueRefused(
                f"{cfg.name!r} ({cfg.environment}) is a promotion venue: a DDL simulation runs "
                "on a lower venue (rig, dev, qa), and its evidence lets the change be planned "
                "here; nothing ran", environment=cfg.environment, connector=cfg.name)
        outcome, result = self.apply(plan_hash, case=case, who=who)
        out: dict[str, Any] = {"case": case, "plan_hash": plan_hash,
                               "environment": cfg.environment, "applied": outcome.to_dict()}
        if outcome.status != APPLIED_VERIFIED or result is None:
            out.update(simulated=False, why=f"the apply ended {outcome.status}: no evidence "
                       "(a replayed apply is no simulation either)" if result is not None
                       else f"the apply ended {outcome.status}: no evidence")
            return out
        comp = self.compensate(case, outcome.intent_id, who=who)
        out["compensated"] = comp.to_dict()
        if not comp.ok:
            out.update(simulated=False, why="the compensation did not restore the snapshots: "
                       "escalated, no evidence")
            return out
        stage = plan.bound.get("stage") if isinstance(plan.bound.get("stage"), Mapping) else None
        if stage is None or "source_id" not in stage:
            out.update(simulated=False, why="the plan names no source identity (made before "
                       "capgate recorded stages): make a new plan and simulate it")
            return out
        entry = {"operation_id": row.operation_id, "version": row.version,
                 "row_hash": row.row_hash, "source_id": stage["source_id"],
                 "sources": stage.get("sources"), "environment": cfg.environment,
                 "connector": cfg.name, "plan_hash": plan_hash,
                 "intent_id": outcome.intent_id, "by": who,
                 "apply": "applied_verified", "compensation": "compensated",
                 "completed_at": self._now()}
        self.executor.ledger.append(case, "ddl_simulated", {
            **entry, "case_state": {f"{promotion.EVIDENCE_PREFIX}{outcome.intent_id}": entry}})
        out.update(simulated=True, evidence=entry)
        return out

    def _record_case_events(self, case: str, who: str, row: Row, sink: ListSink) -> None:
        items: list[tuple[str, Mapping[str, Any], str | None]] = []
        for kind, payload in sink.events:
            if kind in (ev.PLANNED, ev.REFUSED):
                payload = {**payload, "operation_id": row.operation_id, "version": row.version,
                           "by": who}
            items.append((kind, payload, None))
        if items:
            self.executor.ledger.append_many(case, items)

    # -- apply -------------------------------------------------------------------------------------
    def apply(self, plan_hash: str, *, case: str, who: str) -> tuple[Outcome, DdlOutcome | None]:
        """Apply an approved DDL plan: preflight, apply, verify, and roll back or compensate.

        Refusals before anything is recorded: an unknown or altered plan, another
        case, a changed row, no write grant, an object out of scope, an open
        intent in the case, no usable approval (exit 4), a live object that moved
        since its snapshot (MergeRequired with a three-way merge proposal).
        Returns the recorded outcome (evidence: the loop's ``DdlOutcome``) and
        the ``DdlOutcome`` itself (None when a recorded success is replayed).
        """
        plan, plan_case, requester = self._recorded_plan(plan_hash)
        if plan_case != case:
            raise CaseConflict(
                f"plan {plan_hash} was made for case {plan_case!r}, not {case!r}; apply it "
                "in its own case or make a new plan", case=case, plan_case=plan_case)
        row, cfg = self._row_of_plan(plan)
        self.executor.grants.check_call(who, row, cfg.name, cfg.environment)
        if requester != who:  # one rule for data and DDL plans: bound to case and requester
            raise ApprovalMismatch(
                f"plan {plan_hash} was requested by {requester!r}, not {who!r}: an approval is "
                "worth nothing to another identity; make your own plan", plan_hash=plan_hash,
                requester=requester, caller=who)
        replay = self._replay(case, plan_hash)
        if replay is not None:
            return replay, None
        self._check_case_closed(case)
        self._check_approval(plan_hash, who, row, plan)
        self._check_stage(plan, row, cfg, case, who)
        try:
            return self._apply_approved(plan, row, cfg, case=case, who=who)
        except MergeRequired as exc:
            raise self._merge_packet(plan, row, cfg, exc, case=case, who=who) from None

    def _merge_packet(self, plan: DdlPlan, row: Row, cfg: ConnectorConfig,
                      exc: MergeRequired, *, case: str, who: str) -> MergeRequired:
        """The refusal of a plan whose objects moved, with its merge as a gate packet of its own.

        A merged source is a new source: it is never applied under the approval of
        the plan it replaces.  When every merge is clean, the merged sources (and the
        plan's unmoved objects, against their old bases) are planned in the same case
        against the live objects -- captured now -- with the same smoke calls and
        recompile requests; that plan is recorded with its own hash and needs its own
        approval.  With a conflict, or when planning the merge is refused, the refusal
        says so and no plan is made.
        """
        merges = [m for m in exc.details.get("merge") or [] if isinstance(m, Mapping)]
        details = dict(exc.details)
        moved = {str(m.get("object")) for m in merges}
        if not merges or not all(m.get("clean") for m in merges):
            details["merge_plan"] = None
            details["merge_plan_why"] = ("the merge has conflicts: resolve them, then plan "
                                         "the result (capgate ddl plan FILE --fresh)")
            return MergeRequired(exc.message + "; the merge has conflicts, so no plan was made "
                                 "of it", **details)
        merged = {str(m["object"]): str(m["merged"]) for m in merges}
        sources: list[str] = []
        bases: list[str] = []
        for o in plan.objects:
            key = str(o["key"])
            if key in moved:
                sources.append(merged[key])
            else:
                sources.append(str(o["new_source"]))
                bases.append(str(o["base_snapshot_id"]))
        try:
            self.capture(cfg.name, sorted(moved))  # the live objects: the merge's base
            smoke = [SmokeCall(str(s["name"]), str(s["sql"]), s.get("expect"),
                               dict(s.get("binds") or {}), dict(s.get("session") or {}))
                     for s in plan.smoke]
            merge_plan = self.plan(row.operation_id, sources, case=case, who=who,
                                   version=row.version, bases=bases, smoke=smoke,
                                   recompile=list(plan.recompile))
        except CapgateError as refused:
            details["merge_plan"] = None
            details["merge_plan_why"] = f"planning the merge was refused: {refused}"
            return MergeRequired(exc.message + f"; planning the merge was refused "
                                 f"({refused.code})", **details)
        details["merge_plan"] = merge_plan.plan_hash
        return MergeRequired(
            f"{', '.join(sorted(moved))} changed since the snapshot; the clean three-way merge "
            f"is recorded as plan {merge_plan.plan_hash} in case {case!r}, against the live "
            "object(s): it is a new source and needs its own approval (`capgate approve "
            f"{merge_plan.plan_hash} ...`); the approval of plan {plan.plan_hash} stays unused "
            "and cannot apply it (nothing was recorded or applied for it)", **details)

    def _apply_approved(self, plan: DdlPlan, row: Row, cfg: ConnectorConfig, *, case: str,
                        who: str) -> tuple[Outcome, DdlOutcome | None]:
        plan_hash = plan.plan_hash
        ledger = self.executor.ledger
        intent_id = uuid.uuid4().hex
        sink = LedgerSink(self.executor, case, intent_id)
        started: list[bool] = []

        def on_apply_started(snapshot_ids: list[str]) -> None:
            ledger.append(case, APPLY_STARTED, {
                "snapshot_ids": list(snapshot_ids),
                "objects": [o["key"] for o in plan.objects],
                "transactional": plan.transactional_ddl,
                "state": {"attempt": 1, "apply_started_at": self._now()},
            }, intent_id=intent_id)
            started.append(True)
            crash_point("ddl_after_apply_started")

        with self.loop(cfg, row=row, sink=sink) as lp:
            with lp.engine.connect() as conn:
                self._scope_objects(lp, conn, row, plan)
                conn.rollback()
            pre = lp.preflight(plan)
            if not pre.ok:
                raise _merge_required(plan, pre)
            four_eyes = row.authorization.four_eyes
            approval = ledger.consume_approval(
                plan_hash, intent_id, now=self.executor.clock(),
                exclude_approver=who if four_eyes else None,
                accept=lambda found: self.executor.approval_problem(found, row))
            self._prepared(case, intent_id, row, cfg, plan, who, approval.approval_id)
            try:
                result = lp.execute(plan, on_apply_started=on_apply_started)
            except Exception as exc:
                if started:
                    raise OutcomeUnknown(
                        f"the apply of plan {plan_hash} (intent {intent_id}) stopped after DDL "
                        f"started: {error_details(exc).get('message') or type(exc).__name__}; "
                        f"run `capgate ddl recover {intent_id} --case {case}` to establish what "
                        "landed", case=case, intent_id=intent_id, plan_hash=plan_hash,
                        error=error_details(exc)) from exc
                self._refused_after_prepared(case, intent_id, row, cfg, plan, exc)
                if isinstance(exc, sa.exc.SQLAlchemyError):
                    raise DdlError(
                        f"the target refused before any DDL ran: "
                        f"{error_details(exc).get('message')}; nothing was applied",
                        case=case, intent_id=intent_id, plan_hash=plan_hash) from exc
                raise
            if result.outcome == COMPENSATION_FAILED:
                before = _try_classify(lp, plan, sink.applied)
            else:
                before = None
        return self._observe(case, intent_id, row, cfg, plan, result, before), result

    def _replay(self, case: str, plan_hash: str) -> Outcome | None:
        for state in self.executor.ledger.intents(case).values():
            if (state.get("plan_hash") == plan_hash and state.get("status") in TERMINAL
                    and state.get("outcome") == APPLIED_VERIFIED
                    and isinstance(state.get("outcome_record"), Mapping)):
                return Outcome.from_dict(state["outcome_record"], replayed=True)
        return None

    def _check_case_closed(self, case: str) -> None:
        snap = self.executor.ledger.snapshot(case) or {}
        open_intents = [i for i, s in (snap.get("intents") or {}).items()
                        if s.get("status") not in TERMINAL]
        if open_intents:
            raise ReconciliationRequired(
                f"case {case!r} has {len(open_intents)} unresolved intent(s); run `capgate "
                f"resume {case}` (DDL intents: `capgate ddl recover INTENT --case {case}`) first",
                case=case, intents=open_intents)

    def _check_approval(self, plan_hash: str, who: str, row: Row,
                        plan: DdlPlan) -> None:
        """Refuse (exit 4) unless an unused, unexpired approval usable by ``who`` exists."""
        approvals = self.executor.ledger.approvals_for(plan_hash)
        now = self.executor.clock()
        four_eyes = row.authorization.four_eyes
        valid = [a for a in approvals if a.used_by_intent is None and a.expires_at > now]
        if any(not (four_eyes and a.approver == who) for a in valid):
            return
        roles = "|".join(row.authorization.approver_roles)
        details = {"plan_hash": plan_hash, "approver_roles": list(row.authorization.approver_roles),
                   "four_eyes": four_eyes, "objects": [o["key"] for o in plan.objects]}
        if valid:
            raise SelfApproval(f"the only approval of plan {plan_hash} is {who!r}'s own; four "
                               "eyes requires another approver", **details)
        if any(a.used_by_intent is None for a in approvals):
            raise ApprovalExpired(f"the approval of plan {plan_hash} has expired; ask for a new "
                                  "one", **details)
        if approvals:
            raise ApprovalUsed(f"the approval of plan {plan_hash} was already used (approvals "
                               "are single use); ask for a new one", **details)
        raise ApprovalRequired(
            f"{row.ref} is gated: approve plan {plan_hash} with `capgate approve {plan_hash} "
            f"--by WHO --role {roles} --key FILE`"
            f"{' (four eyes: not the requester)' if four_eyes else ''}",
            **details)

    def _now(self) -> str:
        return self.executor.clock().isoformat()

    def _prepared(self, case: str, intent_id: str, row: Row, cfg: ConnectorConfig,
                  plan: DdlPlan, who: str, approval_id: str) -> None:
        snapshot_ids = {str(o["key"]): str(o["base_snapshot_id"]) for o in plan.objects}
        objects = [str(o["key"]) for o in plan.objects]
        self.executor.ledger.append(case, "prepared", {
            "request": {"operation_id": row.operation_id, "version": row.version,
                        "plan_hash": plan.plan_hash, "objects": objects, "who": who,
                        "connector": cfg.name, "environment": cfg.environment},
            "state": {"operation_id": row.operation_id, "version": row.version,
                      "row_hash": row.row_hash, "effect_class": str(row.effect_class),
                      "recovery": str(row.recovery), "plan_hash": plan.plan_hash,
                      "snapshot_ids": snapshot_ids, "objects": objects,
                      "dialect": plan.dialect,
                      "transactional_ddl": plan.transactional_ddl,
                      "connector": cfg.name, "environment": cfg.environment, "who": who,
                      "approval_id": approval_id, "idempotency_key": None,
                      "fingerprint": _fingerprint(row, cfg, plan.plan_hash),
                      "attempt": 0},
        }, intent_id=intent_id)

    def _refused_after_prepared(self, case: str, intent_id: str, row: Row,
                                cfg: ConnectorConfig, plan: DdlPlan,
                                exc: BaseException) -> None:
        """A refusal between ``prepared`` and the first DDL: nothing applied, close the intent."""
        reason = {"kind": RollbackReason.REFUSED_BEFORE_APPLY, "error": error_details(exc)}
        record = _outcome(case, intent_id, row, cfg, plan.plan_hash, ROLLED_BACK,
                          {"applied": False, "objects": [o["key"] for o in plan.objects]},
                          reason)
        with contextlib.suppress(CapgateError, sa.exc.SQLAlchemyError):
            self.executor.ledger.append(case, "observed", {
                "outcome": record, "state": {"outcome": ROLLED_BACK, "outcome_record": record},
            }, intent_id=intent_id)

    def _observe(self, case: str, intent_id: str, row: Row, cfg: ConnectorConfig,
                 plan: DdlPlan, result: DdlOutcome,
                 classified: RecoveryReport | None) -> Outcome:
        out = Outcome.from_dict(_outcome(case, intent_id, row, cfg, plan.plan_hash,
                                         result.outcome, result.to_dict(),
                                         None if result.error is None else dict(result.error)))
        record = out.to_dict()
        state: dict[str, Any] = {"outcome": result.outcome, "outcome_record": record}
        if result.outcome == COMPENSATION_FAILED:
            comp = result.compensation
            state["escalation"] = {
                "by": "ddl",
                "classification": classified.classification if classified else "unknown",
                "rule": "compensation did not restore the snapshot(s)",
                "snapshot_ids": dict(comp.snapshot_ids) if comp else {},
                "live_signatures": dict(comp.live_signatures) if comp else {},
                "next_action": "a person inspects the objects and restores them from the "
                               "snapshots (capgate ddl export); never re-apply blindly",
                "at": self._now(),
            }
            self.executor.ledger.append(case, "escalated", {"outcome": record, "state": state},
                                        intent_id=intent_id)
        else:
            self.executor.ledger.append(case, "observed", {"outcome": record, "state": state},
                                        intent_id=intent_id)
        return out

    # -- compensate and recover -----------------------------------------------------------------
    def _intent_plan(self, case: str, intent_id: str
                     ) -> tuple[dict[str, Any], DdlPlan, Row, ConnectorConfig]:
        state = self.executor.ledger.intent(case, intent_id)
        if state.get("effect_class") != "ddl" or not state.get("plan_hash"):
            raise UsageError(f"intent {intent_id} of case {case!r} is not a DDL apply",
                             case=case, intent_id=intent_id)
        plan, _, _ = self._recorded_plan(str(state["plan_hash"]))
        row, cfg = self._row_of_plan(plan)
        return state, plan, row, cfg

    def compensate(self, case: str, intent_id: str, *, who: str) -> CompensationResult:
        """Restore an intent's objects from its snapshots, verify, record the result.

        Refused (StaleExtract) when a live object matches neither its snapshot
        nor the new source: compensating then would overwrite somebody else's
        change.  Nothing to compensate when every object equals its snapshot.
        """
        state, plan, row, cfg = self._intent_plan(case, intent_id)
        self.executor.grants.check_call(who, row, cfg.name, cfg.environment)
        sink = LedgerSink(self.executor, case, intent_id)
        ledger = self.executor.ledger
        with self.loop(cfg, row=row, sink=sink) as lp:
            before = lp.classify(plan, _observed(state))
            if before.classification == "unknown":
                raise StaleExtract(
                    f"intent {intent_id}: a live object matches neither its snapshot nor the new "
                    "source; compensating would overwrite a change made outside this intent -- "
                    "escalate", case=case, intent_id=intent_id,
                    objects=[o.to_dict() for o in before.objects])
            if before.classification == "not_applied":
                hint = "" if state.get("status") in TERMINAL else \
                    f"; close the intent with `capgate ddl recover {intent_id} --case {case}`"
                raise DdlError(f"nothing to compensate: every object of intent {intent_id} "
                                 f"equals its snapshot{hint}", case=case, intent_id=intent_id)
            ledger.append(case, COMPENSATION_REQUESTED, {
                "by": who, "classification": before.to_dict(),
                "state": {"compensation_requested_by": who},
            }, intent_id=intent_id)
            comp = lp.compensate(plan)
        status = COMPENSATED if comp.ok else COMPENSATION_FAILED
        reason = None if comp.ok else {
            "kind": RollbackReason.COMPENSATION_FAILED, "code": "CG512",
            "message": "compensation did not restore the snapshot(s): "
                       + "; ".join(comp.causes[:5]),
            "causes": list(comp.causes),
            "snapshot_ids": dict(comp.snapshot_ids),
            "live_signatures": dict(comp.live_signatures)}
        record = _outcome(case, intent_id, row, cfg, plan.plan_hash, status,
                          {"compensation": comp.to_dict(), "before": before.to_dict(),
                           "by": who}, reason)
        new_state: dict[str, Any] = {"outcome": status, "outcome_record": record}
        if comp.ok:
            if state.get("escalation"):
                new_state["escalation"] = None
            ledger.append(case, "observed", {"outcome": record, "state": new_state},
                          intent_id=intent_id)
        else:
            new_state["escalation"] = {
                "by": "ddl", "classification": before.classification,
                "rule": "compensation did not restore the snapshot(s)",
                "snapshot_ids": dict(comp.snapshot_ids),
                "live_signatures": dict(comp.live_signatures), "at": self._now()}
            ledger.append(case, "escalated", {"outcome": record, "state": new_state},
                          intent_id=intent_id)
        return CompensationResult(case, intent_id, status, before, record)

    def classify(self, case: str, intent_id: str) -> tuple[str, dict[str, Any]]:
        """:func:`classify_ddl_intent` for an intent of the ledger."""
        state = self.executor.ledger.intent(case, intent_id)
        return classify_ddl_intent(self.executor, case, intent_id, state)


# --- recovery (called by resume) -----------------------------------------------------------------


def classify_ddl_intent(executor: Executor, case_id: str, intent_id: str,
                        state: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Tell what a DDL intent left on its target, from live signatures; never acts.

    For ``executor.recovery.resume``: ``state`` is the intent's state from the case
    snapshot (``plan_hash``, ``connector``, ``applied_signatures``, ``status``).
    Returns ``(classification, evidence)`` with classification one of
    ``applied``, ``not_applied``, ``partly_applied``, ``unknown`` (the values
    of ``executor.recovery.evidence.Classification``) and evidence a JSON
    dict with ``rule``, ``plan_hash``, ``apply_started``, ``next_action`` and
    per object its live, snapshot and planned signatures.  An unreachable
    target, a missing plan or snapshot is ``unknown`` with the error.
    """
    status = str(state.get("status"))
    started = bool(state.get("apply_started_at"))
    base: dict[str, Any] = {"plan_hash": state.get("plan_hash"), "status": status,
                            "apply_started": started, "case": case_id, "intent_id": intent_id}
    if state.get("effect_class") != "ddl" or not state.get("plan_hash"):
        return "unknown", {**base, "rule": "not a DDL apply intent (no plan hash recorded)"}
    service = DdlService(executor)
    try:
        plan, _, _ = service._recorded_plan(str(state["plan_hash"]))
        connector = str(state.get("connector") or plan.bound["connector"])
        with service.loop(connector) as lp:
            report = lp.classify(plan, _observed(state))
    except (CapgateError, sa.exc.SQLAlchemyError) as exc:
        return "unknown", {**base, "rule": "the target or the plan could not be read",
                           "error": error_details(exc),
                           "next_action": "escalate: no evidence either way"}
    rule = _RULES[report.classification]
    if report.classification == "not_applied" and not started:
        rule = "no DDL was started (no ddl_apply_started) and " + rule
    return report.classification, {**base, **report.to_dict(), "rule": rule}


def settle_ddl_intent(executor: Executor, case_id: str, intent_id: str, *,
                      who: str = "resume") -> dict[str, Any]:
    """Classify an open DDL intent and record what that settles (for ``resume``).

    * ``applied`` -- the plan is verified again (compile, landed text,
      dependents, smoke); passed: ``reconciled`` as ``applied_verified``;
      failed: ``escalated`` (compensate it with ``capgate ddl compensate``).
    * ``not_applied`` -- ``reconciled`` as ``rolled_back``: nothing landed; the
      plan may be applied again with a new approval.
    * ``partly_applied`` / ``unknown`` -- ``escalated`` with the evidence;
      nothing is re-applied.

    Returns ``{"classification", "evidence", "action", "resolved"}``; a closed
    intent is left as it is (``action: none``).
    """
    ledger = executor.ledger
    state = ledger.intent(case_id, intent_id)
    status = str(state.get("status"))
    if status in TERMINAL:
        return {"case": case_id, "intent_id": intent_id, "classification": None,
                "evidence": {"status": status}, "action": "none", "resolved": True}
    classification, evidence = classify_ddl_intent(executor, case_id, intent_id, state)
    now = executor.clock().isoformat()
    service = DdlService(executor)
    row: Row | None = None
    cfg: ConnectorConfig | None = None
    with contextlib.suppress(CapgateError):
        _, plan, row, cfg = service._intent_plan(case_id, intent_id)
    report: VerifyReport | None = None
    if classification == "applied" and row is not None and cfg is not None:
        with service.loop(cfg, row=row) as lp:
            report = lp.verify(plan)
        evidence["verify"] = report.to_dict()
    elif classification == "partly_applied" and row is not None and cfg is not None:
        # which of the objects that landed also verify: the recovery point's eligibility
        with contextlib.suppress(CapgateError, sa.exc.SQLAlchemyError), \
                service.loop(cfg, row=row) as lp:
            report = lp.verify(plan)
            evidence["verify"] = report.to_dict()
    _record_recovery_point(ledger, case_id, intent_id, state, evidence, report)
    if classification == "applied" and row is not None and cfg is not None:
        assert report is not None
        if report.passed:
            record = _outcome(case_id, intent_id, row, cfg, plan.plan_hash,
                              APPLIED_VERIFIED, {"reconciled": evidence}, None)
            ledger.append(case_id, "reconciled", {"evidence": evidence, "state": {
                "classification": classification, "rule": evidence["rule"],
                "outcome": APPLIED_VERIFIED, "outcome_record": record,
                "reconciled_at": now, "reconciled_by": who}}, intent_id=intent_id)
            return {"case": case_id, "intent_id": intent_id, "classification": classification,
                    "evidence": evidence, "action": "recorded_applied", "resolved": True}
        evidence["rule"] += "; but verify failed"
        evidence["next_action"] = (f"compensate: capgate ddl compensate {intent_id} "
                                   f"--case {case_id}")
    elif classification == "not_applied" and row is not None and cfg is not None:
        record = _outcome(case_id, intent_id, row, cfg, str(evidence["plan_hash"]), ROLLED_BACK,
                          {"reconciled": evidence}, {"kind": RollbackReason.NOT_APPLIED,
                                                     "rule": evidence["rule"]})
        ledger.append(case_id, "reconciled", {"evidence": evidence, "state": {
            "classification": classification, "rule": evidence["rule"],
            "outcome": ROLLED_BACK, "outcome_record": record, "reconciled_at": now,
            "reconciled_by": who}}, intent_id=intent_id)
        return {"case": case_id, "intent_id": intent_id, "classification": classification,
                "evidence": evidence, "action": "closed_not_applied", "resolved": True}
    ledger.append(case_id, "escalated", {"evidence": evidence, "state": {"escalation": {
        "by": "ddl", "classification": classification, "rule": evidence.get("rule"),
        "next_action": evidence.get("next_action"), "at": now}}}, intent_id=intent_id)
    return {"case": case_id, "intent_id": intent_id, "classification": classification,
            "evidence": evidence, "action": "escalated", "resolved": False}


def _record_recovery_point(ledger: Any, case_id: str, intent_id: str, state: Mapping[str, Any],
                           evidence: Mapping[str, Any], report: VerifyReport | None) -> None:
    """Issue 17: the plan's latest *eligible* object -- applied and verified -- as its own
    fact, next to the latest one the ledger recorded as applied (``ddl.object_applied``)."""
    from capgate.executor.recovery.eligibility import ddl_objects

    objects = [o for o in evidence.get("objects") or [] if isinstance(o, Mapping)]
    if not objects:
        return
    failed = {c.object for c in report.checks if not c.passed} if report is not None else set()
    verified = {str(o.get("object")): report is not None and str(o.get("object")) not in failed
                for o in objects}
    point = ddl_objects(objects, verified, (_observed(state) or {}).keys())
    with contextlib.suppress(CapgateError):
        ledger.append(case_id, "recovery_point", {"recovery_point": {
            "intent_id": intent_id, "plan_hash": state.get("plan_hash"), **point}})


# --- helpers -------------------------------------------------------------------------------------


def _observed(state: Mapping[str, Any]) -> dict[str, str] | None:
    applied = state.get("applied_signatures")
    if isinstance(applied, Mapping) and applied:
        return {str(k): str(v) for k, v in applied.items()}
    return None


def _try_classify(lp: DdlLoop, plan: DdlPlan,
                  applied: Mapping[str, str]) -> RecoveryReport | None:
    try:
        return lp.classify(plan, dict(applied) or None)
    except (CapgateError, sa.exc.SQLAlchemyError):
        return None


def _fingerprint(row: Row, cfg: ConnectorConfig, plan_hash: str) -> str:
    return fingerprint(row, {"plan_hash": plan_hash}, cfg.name, cfg.environment)


def _outcome(case: str, intent_id: str, row: Row, cfg: ConnectorConfig, plan_hash: str,
             status: str, evidence: Mapping[str, Any],
             reason: Mapping[str, Any] | None) -> dict[str, Any]:
    """An executor outcome record (``Outcome.to_dict``) for a DDL intent."""
    return Outcome(status=status, intent_id=intent_id, case_id=case,
                   operation_id=row.operation_id, version=row.version, row_hash=row.row_hash,
                   idempotency_key=None, fingerprint=_fingerprint(row, cfg, plan_hash),
                   attempt=1, evidence={"plan_hash": plan_hash, **evidence},
                   reason=reason).to_dict()


def _merge_required(plan: DdlPlan, pre: PreflightResult) -> MergeRequired:
    keys = [m.object for m in pre.mismatches]
    return MergeRequired(
        f"{', '.join(keys)} changed since the snapshot; a three-way merge proposal is attached "
        "-- review it, capture again and make a new plan (nothing was recorded or applied)",
        plan_hash=plan.plan_hash,
        objects=keys,
        live=dict(pre.live),
        merge=[m.to_dict() for m in pre.mismatches],
    )
