"""Changed outside the case: the symptom a case starts from, re-read before the fix and the send.

A row may declare a ``symptom`` query -- what the screen shows for its target
(``registry.model.Symptom``).  A case registers the symptom it starts from
(:func:`register`, ``capgate case symptom``): the query's rows are read in an
engine-enforced read-only transaction and their digest is recorded in the
case (``symptom_registered``; case state ``symptom:<impact key>``).  From then
on capgate re-reads it

* **before the fix** -- every write of the case whose impact keys include a
  registered symptom's key (:class:`SymptomWatch`, a hook of the executor);
* **before the send** -- a declared checkpoint (:func:`checkpoint`, ``capgate
  case checkpoint CASE --name send``).

A different digest means someone else changed the target meanwhile (the
customer, the vendor's IT, another case).  The ledger then records
``changed_outside_case`` with the before and after digests and the actor
where the target can say -- the row's declared ``actor`` query (a
last-modified-by column), and capgate's own record in the target (the fence
row and landing marker of another case's intent that wrote the key) -- and
the case is *held*: the event opens a hold (an intent of its own, status
``changed_outside_case``), so the case takes no new work until a person
accepts the new state or re-opens the case from it (:func:`resolve_hold`,
signed with the person's approver key).  Every grant or withholding is a
``continuation`` event.

The case's own fix changes the symptom too.  So the symptom is read again
inside the write's own transaction, just before COMMIT, and the new digest
becomes the case's baseline (``symptom_updated``) -- whatever another session
committed between the re-read before the fix and that COMMIT is, honestly,
indistinguishable from the fix and becomes part of the baseline.  Should the
process die between COMMIT and recording the new baseline, the baseline still
names the write (``writing_intent``), and a later difference is recorded as
possibly the case's own (``may_be_own_write``), never silently as another's.

The re-read before the fix happens for the writes whose impact keys include
the symptom's key: rows that change what one screen shows declare the same
target (system, object, keys), or a write through another row would move the
symptom without moving its baseline.

Cost: nothing for a write whose case registered no symptom on its keys (one
dictionary look-up in the ``prepared`` transaction's case check).  With one,
the re-read happens outside that transaction
(:class:`~executor.hooks.RetryOutside`), one query on its own read-only
session (like resume's evidence sessions, not counted against a budget), one
``continuation`` append, and one query inside the write before COMMIT.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from capgate.executor import outcome as oc
from capgate.executor.claims import ClaimStore, key_hash
from capgate.executor.context import TERMINAL, CallContext
from capgate.executor.coordination import CONTINUATION
from capgate.executor.dialects import SessionTag
from capgate.executor.dialects.base import FENCE_TABLE, MARKER_TABLE
from capgate.executor.hooks import CallHooks, Resolver, RetryOutside
from capgate.executor.outcome import jsonable
from capgate.executor.plan import binds_for, impact_keys
from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import (
    CapgateError,
    InputInvalid,
    LedgerError,
    NoSymptom,
    ReconciliationRequired,
    SymptomChanged,
    UnknownCase,
    UnknownIntent,
    UsageError,
)
from capgate.registry.excerpt import bounded

if TYPE_CHECKING:
    from capgate.executor.connectors import Connector
    from capgate.executor.ledger import Ledger
    from capgate.executor.runtime import Runtime
    from capgate.registry.model import Row

__all__ = ["HOLD_KIND", "PREFIX", "Reading", "SymptomWatch", "checkpoint", "entries",
           "is_hold", "read_symptom", "register", "resolve_hold"]

PREFIX = "symptom:"
"""Case-state key prefix of a registered symptom (``symptom:<impact key>``)."""
HOLD_KIND = "symptom"
"""``state["hold"]`` of a hold intent opened by a changed symptom."""
CHANGED = "changed_outside_case"
_DEFAULT_ROWS = 100
_READ_TIMEOUT = 10.0


def _now() -> str:
    return datetime.now(UTC).isoformat()


def entries(state: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """Impact key -> registered symptom, of a case state."""
    case = (state or {}).get("case") or {}
    return {k[len(PREFIX):]: v for k, v in case.items()
            if k.startswith(PREFIX) and isinstance(v, Mapping)}


def is_hold(state: Mapping[str, Any]) -> bool:
    """Whether an intent state is a hold opened by a changed symptom (not a call)."""
    return state.get("hold") == HOLD_KIND


# --- reading --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One reading of a symptom: its digest, and the rows as recorded (bounded)."""

    digest: str
    columns: tuple[str, ...]
    rows: tuple[Any, ...]
    truncated: bool

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "columns": list(self.columns),
                "rows": bounded(list(self.rows)), "truncated": self.truncated}


def _reading(columns: Sequence[str], fetched: Sequence[Sequence[Any]], cap: int) -> Reading:
    rows = [jsonable(list(r)) for r in fetched[:cap]]
    truncated = len(fetched) > cap
    digest = canonical_hash({"columns": list(columns), "rows": rows, "truncated": truncated})
    return Reading(digest, tuple(columns), tuple(rows), truncated)


def read_symptom(connector: Connector, row: Row, inputs: Mapping[str, Any],
                 tag: SessionTag, conn: sa.Connection | None = None) -> Reading:
    """The row's symptom for ``inputs``: read-only on its own session, or -- with ``conn``
    -- inside that (write) transaction, where the write's own changes are visible."""
    symptom = row.symptom
    assert symptom is not None
    cap = symptom.max_rows or _DEFAULT_ROWS
    dialect = connector.dialect
    binds = binds_for(symptom.sql, inputs)
    if conn is not None:
        cursor = dialect.execute(conn, symptom.sql, binds, tag)
        columns = [d[0] for d in cursor.description or ()]
        return _reading(columns, cursor.fetchmany(cap + 1), cap)
    try:
        own = connector.engine.connect()
    except sa.exc.DBAPIError as exc:  # nothing was sent: the database is not reachable
        raise connector.unavailable(exc) from None
    with own:
        try:
            dialect.begin_read(own, tag, _READ_TIMEOUT)
            result = own.execute(sa.text(dialect.sql(symptom.sql, tag)), binds)
            columns = list(result.keys())
            return _reading(columns, result.fetchmany(cap + 1), cap)
        finally:
            own.rollback()
            dialect.end_read(own)


def find_actor(connector: Connector, row: Row, inputs: Mapping[str, Any], impact_key: str,
               *, case_id: str, namespace: str, tag: SessionTag) -> dict[str, Any]:
    """Who changed the target, where the target can say.

    * ``declared``: the row's ``symptom.actor`` query (e.g. a last-modified-by
      column) -- its first row's first value is the actor;
    * ``capgate``: the target's own record of the last capgate write of the key
      -- its fence row names the intent, whose landing marker names the case --
      when that is another case's.
    """
    out: dict[str, Any] = {"known": False, "declared": None, "capgate": None}
    dialect = connector.dialect
    with connector.engine.connect() as conn:
        try:
            dialect.begin_read(conn, tag, _READ_TIMEOUT)
            actor_sql = row.symptom.actor_sql if row.symptom is not None else None
            if actor_sql is not None:
                found = conn.execute(sa.text(dialect.sql(actor_sql, tag)),
                                     binds_for(actor_sql, inputs)).fetchmany(5)
                rows = [jsonable(list(r)) for r in found]
                out["declared"] = {"rows": bounded(rows),
                                   "who": rows[0][0] if rows and rows[0] else None}
            fence = conn.execute(sa.text(dialect.sql(
                f"SELECT token, intent_id FROM {FENCE_TABLE} WHERE key_hash = :h", tag)),
                {"h": key_hash(f"{namespace}\n{impact_key}")}).first()
            if fence is not None and fence[1] is not None:
                marker = conn.execute(sa.text(dialect.sql(
                    f"SELECT case_id, operation_id, landed_at FROM {MARKER_TABLE}"
                    " WHERE intent_id = :i", tag)), {"i": str(fence[1])}).first()
                if marker is not None and str(marker[0]) != case_id:
                    out["capgate"] = {"case": str(marker[0]), "intent_id": str(fence[1]),
                                      "operation_id": str(marker[1]),
                                      "landed_at": jsonable(marker[2]), "token": int(fence[0])}
        except sa.exc.SQLAlchemyError as exc:
            out["error"] = str(getattr(exc, "orig", None) or exc).splitlines()[0][:300]
        finally:
            conn.rollback()
            dialect.end_read(conn)
    declared = out["declared"]
    out["known"] = bool((declared and declared.get("who") is not None) or out["capgate"])
    out["engine"] = None  # no engine here keeps who committed a row, once it committed
    return out


# --- registering ----------------------------------------------------------------------


def _symptom_inputs(row: Row, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs the symptom needs -- its binds, the actor's, the target's keys and
    dimensions -- checked against the row's own contract for each; InputInvalid names the
    field."""
    symptom = row.symptom
    assert symptom is not None
    from capgate.registry.binds import binds_of

    needed = set(binds_of(symptom.sql)) | set(row.target.keys) \
        | {v for _, v in row.target.dimensions}
    if symptom.actor_sql is not None:
        needed |= set(binds_of(symptom.actor_sql))
    props = row.input.get("properties") or {}
    extra = sorted(set(inputs) - needed)
    if extra:
        raise InputInvalid(f"the symptom of {row.ref} takes {', '.join(sorted(needed))}; not "
                           f"{', '.join(extra)}", field=", ".join(extra),
                           operation_id=row.operation_id, version=row.version)
    missing = sorted(needed - set(inputs))
    if missing:
        raise InputInvalid(f"the symptom of {row.ref} needs {', '.join(missing)}",
                           field=", ".join(missing), operation_id=row.operation_id,
                           version=row.version)
    import json

    import jsonschema

    from capgate.registry.model import thaw

    for name in sorted(needed):
        schema = thaw(props.get(name, {}))
        problems = list(jsonschema.Draft202012Validator(json.loads(json.dumps(schema)))
                        .iter_errors(inputs[name]))
        if problems:
            raise InputInvalid(f"input does not satisfy the contract of {row.ref}: {name}: "
                               f"{problems[0].message[:300]}", field=name,
                               operation_id=row.operation_id, version=row.version)
    return {name: inputs[name] for name in sorted(needed)}


def _no_open_intent(case_id: str) -> Any:
    def guard(state: Mapping[str, Any] | None) -> None:
        open_ = sorted(i for i, s in ((state or {}).get("intents") or {}).items()
                       if s.get("status") not in TERMINAL)
        if open_:
            raise ReconciliationRequired(
                f"case {case_id!r} has {len(open_)} unresolved intent(s) or hold(s); settle "
                f"them first (`capgate resume {case_id}`)", case=case_id, intents=open_)
    return guard


def register(rt: Runtime, case_id: str, operation_id: str, inputs: Mapping[str, Any], *,
             who: str, version: int | None = None) -> dict[str, Any]:
    """Register the symptom ``case_id`` starts from: read it now, record its digest.

    The caller needs a read grant on the row's connector (the symptom is a
    read).  Registering again replaces the baseline (a case may start over
    only while nothing of it is open).
    """
    if not case_id:
        raise UsageError("say which case the symptom belongs to", field="case")
    row, connector = rt.resolve(operation_id, version)
    if row.symptom is None:
        raise NoSymptom(f"{row.ref} declares no symptom query; nothing to register",
                        field="symptom", operation_id=row.operation_id, version=row.version)
    given = _symptom_inputs(row, inputs)
    if not any(g.allows(connector.name, connector.environment, "read")
               for g in rt.grants.principal(who).grants):
        from capgate.registry.errors import NotAuthorized

        raise NotAuthorized(f"{who!r} holds no read grant on connector {connector.name!r} in "
                            f"{connector.environment!r} (reading the symptom of {row.ref})",
                            principal=who, access="read", connector=connector.name)
    key = impact_keys(row, given, connector.environment)[0]
    tag = SessionTag(case_id, row.operation_id, "symptom", row.date_inputs)
    try:
        reading = read_symptom(connector, row, given, tag)
    except sa.exc.DBAPIError as exc:
        raise connector.unavailable(exc) if exc.connection_invalidated else UsageError(
            f"the symptom query of {row.ref} failed: "
            f"{str(exc.orig or exc).splitlines()[0][:300]}", operation_id=row.operation_id
        ) from None
    entry = {"operation_id": row.operation_id, "version": row.version,
             "row_hash": row.row_hash, "connector": connector.name, "inputs": given,
             "digest": reading.digest, "reading": reading.to_dict(), "registered_by": who,
             "registered_at": _now(), "writing_intent": None}
    rt.ledger.append(case_id, "symptom_registered", {
        "symptom": {"impact_key": key, **entry},
        "case_state": {PREFIX + key: entry}}, guard=_no_open_intent(case_id))
    return {"case": case_id, "impact_key": key, **entry}


# --- the hold -------------------------------------------------------------------------


def _resolve_entry(resolver: Resolver | None, entry: Mapping[str, Any]
                   ) -> tuple[Row, Connector]:
    """The registered symptom's row, exactly as registered (its SQL comes from the row)."""
    if resolver is None:
        raise LedgerError("this executor's symptom watch was never attached to its rows")
    row, connector = resolver.resolve(str(entry["operation_id"]), int(entry["version"]))
    if row.row_hash != entry.get("row_hash") or row.symptom is None:
        raise LedgerError(f"the symptom was registered with {row.ref} hash "
                          f"{entry.get('row_hash')}; the registry now has {row.row_hash}")
    return row, connector


def _changed(resolver: Resolver | None, ledger: Ledger, case_id: str,
             found: Mapping[str, Mapping[str, Any]], namespace: str, *, where: str
             ) -> tuple[dict[str, dict[str, Any]], dict[str, Reading]]:
    """Re-read each registered symptom; the differences (with actors) and the readings."""
    changed: dict[str, dict[str, Any]] = {}
    readings: dict[str, Reading] = {}
    for key, entry in found.items():
        try:
            row, connector = _resolve_entry(resolver, entry)
        except CapgateError as exc:
            changed[key] = {"impact_key": key, "before": entry.get("digest"), "after": None,
                            "error": f"cannot re-read the symptom: {exc.message}",
                            "actor": {"known": False}}
            continue
        inputs = dict(entry.get("inputs") or {})
        tag = SessionTag(case_id, row.operation_id, "symptom-recheck", row.date_inputs)
        try:
            reading = read_symptom(connector, row, inputs, tag)
        except sa.exc.DBAPIError as exc:
            if exc.connection_invalidated:
                raise connector.unavailable(exc) from None
            changed[key] = {"impact_key": key, "before": entry.get("digest"), "after": None,
                            "error": "cannot re-read the symptom: "
                                     f"{str(exc.orig or exc).splitlines()[0][:300]}",
                            "actor": {"known": False}}
            continue
        readings[key] = reading
        if reading.digest == entry.get("digest"):
            continue
        actor = find_actor(connector, row, inputs, key, case_id=case_id, namespace=namespace,
                           tag=tag)
        item: dict[str, Any] = {"impact_key": key, "before": entry.get("digest"),
                                "after": reading.digest, "reading": reading.to_dict(),
                                "registered_reading": entry.get("reading"), "actor": actor,
                                "detected": where}
        if entry.get("writing_intent"):
            item["may_be_own_write"] = entry["writing_intent"]
        changed[key] = item
    return changed, readings


def _hold(ledger: Ledger, case_id: str, changed: Mapping[str, Mapping[str, Any]], *,
          where: str, refused: Mapping[str, Any] | None = None) -> str:
    """Open the hold: ``changed_outside_case`` (its own intent) and ``continuation``
    withheld, in one transaction."""
    hold_id = uuid.uuid4().hex
    items = [dict(v) for v in changed.values()]
    own = [i["may_be_own_write"] for i in items if i.get("may_be_own_write")]
    why = ("the symptom changed outside the case" if not own else
           "the symptom changed after the case's own write, whose new state was never "
           "recorded (it may be the case's own change)")
    ledger.append_many(case_id, [
        (CHANGED, {"changed": items, "refused": dict(refused) if refused else None,
                   "state": {"hold": HOLD_KIND, "symptom": {
                       "changed": items, "detected": where, "at": _now(),
                       "refused": dict(refused) if refused else None}}}, hold_id),
        (CONTINUATION, {"continuation": {
            "decision": "withheld", "after": "recheck", "where": where, "why": why,
            "hold": hold_id, "keys": sorted(changed), "at": _now()}}, None)])
    return hold_id


def _granted(ledger: Ledger, case_id: str, found: Mapping[str, Mapping[str, Any]],
             readings: Mapping[str, Reading], *, where: str,
             writing_intent: str | None) -> None:
    state = {PREFIX + k: {**dict(e), "writing_intent": writing_intent}
             for k, e in found.items()} if writing_intent else {}
    payload: dict[str, Any] = {"continuation": {
        "decision": "granted", "after": "recheck", "where": where,
        "why": "the registered symptom(s) read as registered",
        "digests": {k: r.digest for k, r in readings.items()},
        "intent_id": writing_intent, "at": _now()}}
    if state:
        payload["case_state"] = state
    ledger.append(case_id, CONTINUATION, payload)


def checkpoint(rt: Runtime, case_id: str, *, name: str = "send", who: str) -> dict[str, Any]:
    """A declared checkpoint (the send): re-read every registered symptom of the case.

    The same: ``continuation`` granted.  Changed: the case is held
    (``changed_outside_case`` with the digests and actors) and the answer says
    so (``held``).  Refused (ReconciliationRequired) while the case has open
    work or holds.
    """
    if not name or len(name) > 100:
        raise UsageError("a checkpoint needs a name of 1 to 100 characters", field="name")
    state = rt.ledger.verified_snapshot(case_id)
    if state is None:
        raise UnknownCase(f"no case {case_id!r} in the ledger", case_id=case_id)
    _no_open_intent(case_id)(state)
    found = entries(state)
    if not found:
        raise NoSymptom(f"case {case_id!r} registered no symptom; nothing to re-read "
                        f"(`capgate case symptom {case_id} OPERATION --input ...`)",
                        field="symptom", case=case_id)
    namespace = ClaimStore(rt.ledger).ledger_id()
    changed, readings = _changed(rt, rt.ledger, case_id, found, namespace,
                                 where=f"checkpoint {name}")
    if changed:
        hold = _hold(rt.ledger, case_id, changed, where=f"checkpoint {name}",
                     refused={"checkpoint": name, "who": who})
        return {"case": case_id, "checkpoint": name, "held": True, "hold": hold,
                "changed": list(changed.values())}
    _granted(rt.ledger, case_id, found, readings, where=f"checkpoint {name}",
             writing_intent=None)
    return {"case": case_id, "checkpoint": name, "held": False,
            "digests": {k: r.digest for k, r in readings.items()}}


RESOLUTIONS = ("accepted", "reopened")


def resolve_hold(ledger: Ledger, case_id: str, hold_id: str, *, decision: str, by: str,
                 proof: Mapping[str, Any], note: str = "") -> dict[str, Any]:
    """A person's answer to a hold: ``accepted`` (the case continues from the target as it
    is now) or ``reopened`` (the case starts over from it).  Either way the re-read state
    becomes the case's baseline and a ``continuation`` event says why it may go on.
    ``proof`` is the person's signature (:mod:`executor.cases` checks it)."""
    if decision not in RESOLUTIONS:
        raise UsageError(f"decision must be one of {', '.join(RESOLUTIONS)}, not {decision!r}",
                         field="decision")
    state = ledger.intent(case_id, hold_id)
    if not is_hold(state) or state.get("status") != CHANGED:
        raise UnknownIntent(f"{hold_id} is not an open symptom hold of case {case_id!r} "
                            f"({state.get('status')})", case=case_id, intent_id=hold_id)
    snapshot = ledger.verified_snapshot(case_id) or {}
    registered = entries(snapshot)
    rebased: dict[str, Any] = {}
    for item in (state.get("symptom") or {}).get("changed") or []:
        key = str(item.get("impact_key"))
        if key in registered and item.get("after"):
            reading = item.get("reading") or {}
            rebased[PREFIX + key] = {**dict(registered[key]), "digest": item["after"],
                                     "reading": reading, "writing_intent": None,
                                     "rebased_by": by, "rebased_at": _now()}
    resolution = {"by": by, "decision": decision, "note": note, "at": _now(),
                  "proof": dict(proof)}
    case_state: dict[str, Any] = dict(rebased)
    if decision == "reopened":
        case_state["reopened"] = {"by": by, "at": resolution["at"], "hold": hold_id,
                                  "note": note}
    ledger.append_many(case_id, [
        ("escalation_resolved", {"state": {"resolution": resolution}, "case_state": case_state},
         hold_id),
        (CONTINUATION, {"continuation": {
            "decision": "granted", "after": "symptom_hold", "hold": hold_id,
            "why": (f"{by} accepted the target as it is now" if decision == "accepted" else
                    f"{by} re-opened the case from the target as it is now"),
            "note": note, "at": resolution["at"]}}, None)])
    return {"case": case_id, "hold": hold_id, **resolution}


# --- the executor's hook --------------------------------------------------------------


class SymptomWatch(CallHooks):
    """The executor's re-read before the fix (see the module docstring), with its own state.

    * ``check_case`` (in ``prepared``): a registered symptom on the write's keys
      sends the re-read outside the transaction (RetryOutside), once per intent;
    * ``before_commit``: the symptom read in the write's own transaction (the
      new baseline);
    * ``after_observed``: the new baseline recorded (``symptom_updated``).
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.claims = ClaimStore(ledger)
        self.resolver: Resolver | None = None
        self._cleared: dict[str, dict[str, Mapping[str, Any]]] = {}
        self._post: dict[str, dict[str, Reading | None]] = {}
        self._lock = threading.Lock()

    def attach(self, resolver: Resolver) -> None:
        self.resolver = resolver

    def check_case(self, ctx: CallContext, state: Mapping[str, Any] | None) -> None:
        if state is None or ctx.rehearse or ctx.resumed or not ctx.row.is_write:
            return
        case = state.get("case")
        if not case:
            return
        found = {k: e for k in impact_keys(ctx.row, ctx.inputs, ctx.connector.environment)
                 if isinstance(e := case.get(PREFIX + k), Mapping)}
        if not found:
            return
        with self._lock:
            cleared = self._cleared.get(ctx.intent_id)
        if cleared is not None and all(k in cleared and cleared[k].get("digest")
                                       == e.get("digest") for k, e in found.items()):
            return
        raise RetryOutside(lambda: self._recheck(ctx, found))

    def _recheck(self, ctx: CallContext, found: Mapping[str, Mapping[str, Any]]) -> None:
        """Outside ``prepared``: re-read; the same -- granted, prepare again; changed -- hold."""
        changed, readings = _changed(self.resolver, self.ledger, ctx.case_id, found,
                                     self.claims.ledger_id(), where="before the fix")
        if changed:
            refused = {"intent_id": ctx.intent_id, "operation_id": ctx.row.operation_id,
                       "version": ctx.row.version, "who": ctx.who}
            hold = _hold(self.ledger, ctx.case_id, changed, where="before the fix",
                         refused=refused)
            first = next(iter(changed.values()))
            actor = first.get("actor") or {}
            who = ((actor.get("declared") or {}).get("who")
                   or (actor.get("capgate") or {}).get("case"))
            raise SymptomChanged(
                f"the symptom of {first['impact_key']} changed outside case {ctx.case_id!r}"
                + (f" (by {who})" if who else "")
                + f"; the case is held (hold {hold}) until a person accepts the new state or "
                f"re-opens the case: `capgate case accept|reopen {ctx.case_id} {hold} --by "
                f"NAME --key FILE`; nothing of {ctx.row.ref} was sent",
                case=ctx.case_id, hold=hold, changed=list(changed.values()))
        _granted(self.ledger, ctx.case_id, found, readings, where="before the fix",
                 writing_intent=ctx.intent_id)
        marked: dict[str, Mapping[str, Any]] = {
            k: {**dict(e), "writing_intent": ctx.intent_id} for k, e in found.items()}
        with self._lock:
            self._cleared[ctx.intent_id] = marked

    def before_commit(self, ctx: CallContext, conn: sa.Connection) -> None:
        with self._lock:
            found = self._cleared.get(ctx.intent_id)
        if not found:
            return
        post: dict[str, Reading | None] = {}
        for key, entry in found.items():
            try:
                row, connector = _resolve_entry(self.resolver, entry)
            except CapgateError:
                post[key] = None
                continue
            if connector.name != ctx.connector.name:
                post[key] = None  # another database: not in this transaction
                continue
            post[key] = read_symptom(connector, row, dict(entry.get("inputs") or {}),
                                     ctx.tag, conn=conn)
        with self._lock:
            self._post[ctx.intent_id] = post

    def after_observed(self, ctx: CallContext) -> None:
        with self._lock:
            found = self._cleared.pop(ctx.intent_id, None)
            post = self._post.pop(ctx.intent_id, None) or {}
        if not found:
            return
        with contextlib.suppress(CapgateError):
            snapshot = self.ledger.snapshot(ctx.case_id) or {}
            last = snapshot.get("last") or {}
            applied = last.get("intent_id") == ctx.intent_id and last.get("outcome") in (
                oc.APPLIED,)
            updates: dict[str, Any] = {}
            for key, entry in found.items():
                new = {**dict(entry), "writing_intent": None}
                reading = post.get(key)
                if applied and reading is not None:
                    new.update(digest=reading.digest, reading=reading.to_dict(),
                               updated_by_intent=ctx.intent_id, updated_at=_now())
                elif applied:  # applied, but its new state could not be read with it
                    new["writing_intent"] = ctx.intent_id
                updates[PREFIX + key] = new
            self.ledger.append(ctx.case_id, "symptom_updated", {
                "symptom": {"intent_id": ctx.intent_id, "applied": applied,
                            "digests": {k: v["digest"] for k, v in
                                        ((k[len(PREFIX):], v) for k, v in updates.items())}},
                "case_state": updates})

    def after_call(self, ctx: CallContext, error: BaseException | None) -> None:
        with self._lock:
            self._cleared.pop(ctx.intent_id, None)
            self._post.pop(ctx.intent_id, None)

