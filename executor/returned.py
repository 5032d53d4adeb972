"""Returned keys: what a statement returns (``RETURNING``, a generated key), as named values.

A statement that declares ``returns: {table, key}`` is sent with the clause its
engine supports (:meth:`~executor.dialects.base.Dialect.returning_sql`); the
values it returns go to the outcome's ``evidence["returned"][key]`` and --
before COMMIT, durably -- to the ledger as the intent's ``keys_returned``
event (:class:`ReturnedKeys`, a call hook).  So after a crash between COMMIT
and ``observed`` the values are still known: ``capgate resume`` proves the
intent applied from its landing marker, and the keys of that very attempt are
in the ledger.  A later call of the case binds an input to them
(:func:`resolve`), read from the ledger and never predicted; the simulation's
teardown deletes exactly them.

A key drawn from a sequence or an identity stays consumed when the
transaction rolls back (PostgreSQL, MariaDB, Oracle): an expected effect
declared ``returned: KEY`` records those values in the outcome -- rolled back
or not -- with whether they survived the rollback on this engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from capgate.executor.context import TERMINAL, CallContext
from capgate.executor.hooks import CallHooks
from capgate.executor.ledger import Ledger
from capgate.executor.outcome import ALREADY_APPLIED, APPLIED, SIMULATED, jsonable
from capgate.executor.plan import binds_for
from capgate.registry.errors import (
    ReconciliationRequired,
    ReturnedValueUnavailable,
    UnknownCase,
    UnknownIntent,
)
from capgate.registry.model import Statement

__all__ = ["RETURNED_INFO", "Binding", "ReturnedKeys", "parse_binding", "resolve",
           "run_returning"]

RETURNED_INFO = "capgate.returned"
"""Where the open transaction's returned keys wait for the pre-COMMIT record
(``Connection.info``): ``(intent_id, attempt, {key: [values]})``."""


def run_returning(ctx: CallContext, conn: sa.Connection, st: Statement, counts: list[int],
                  evidence: dict[str, Any]) -> int:
    """Run one statement that returns its keys; record its count and the values.

    The count is the number of rows returned (one per affected row).  The
    values land in ``evidence["returned"][key]`` and in the connection's info
    for :class:`ReturnedKeys` to record before COMMIT; an expected effect
    observed by this key records them too, with whether they survive a
    rollback here.
    """
    assert st.returns is not None
    dialect = ctx.connector.dialect
    cursor = dialect.execute(conn, dialect.returning_sql(st.sql, st.returns.key),
                             binds_for(st.sql, ctx.inputs), ctx.tag)
    n, raw = dialect.returned(cursor)
    counts.append(n)
    values = [_recordable(v) for v in jsonable(raw)]
    returned: dict[str, Any] = evidence.setdefault("returned", {})
    returned[st.returns.key] = values
    for effect in ctx.row.expected_effects:
        if effect.returned == st.returns.key:
            evidence.setdefault("effects", []).append({
                "effect": effect.name, "class": effect.effect_class,
                "returned": st.returns.key, "values": values,
                "survives_rollback": dialect.sequences_survive_rollback
                if effect.effect_class == "sequence" else None})
    conn.info[RETURNED_INFO] = (ctx.intent_id, ctx.attempt, returned)
    return n


_SAFE_INT = 2**53 - 1


def _recordable(value: Any) -> Any:
    """A key the ledger can record exactly: an integer beyond 2^53 (a BIGINT identity)
    becomes its decimal text -- JSON numbers are doubles -- which every engine compares
    with the column as the same number."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _SAFE_INT:
        return str(value)
    return value


class ReturnedKeys(CallHooks):
    """The call hook that makes returned keys durable before COMMIT.

    ``before_prepared`` refuses (nothing recorded) a row whose ``returns`` the
    engine cannot give; ``before_commit`` appends ``keys_returned`` -- fenced by
    the attempt, like every event of an executing attempt -- in the ledger
    while the target transaction is still open, so no COMMIT can land keys the
    ledger does not know.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def before_prepared(self, ctx: CallContext) -> None:
        for st in ctx.row.statements:
            if st.returns is not None:
                ctx.connector.dialect.has_returning(st.verb, check=True)

    def before_commit(self, ctx: CallContext, conn: sa.Connection) -> None:
        found = conn.info.pop(RETURNED_INFO, None)
        if found is None or ctx.rehearse:
            return
        intent_id, attempt, values = found
        if (intent_id, attempt) != (ctx.intent_id, ctx.attempt):
            return  # left by an earlier transaction on this pooled session: not ours
        self.ledger.append(ctx.case_id, "keys_returned", {
            "state": {"returned": values, "returned_attempt": ctx.attempt}},
            intent_id=ctx.intent_id, attempt=ctx.attempt)


# --- binding an input to an earlier intent's returned value ---------------------------


@dataclass(frozen=True)
class Binding:
    """``INPUT=SOURCE.NAME``: the input takes the value ``SOURCE`` returned as ``NAME``.

    ``SOURCE`` is an intent id of the case, or an operation id (its one applied
    intent of the case that returned ``NAME``).
    """

    input: str
    source: str
    name: str

    def to_dict(self) -> dict[str, str]:
        return {"input": self.input, "source": self.source, "name": self.name}


def parse_binding(text: str) -> Binding:
    """``INPUT=SOURCE.NAME`` (the CLI's ``--bind``), or the coded refusal naming it."""
    target, sep, ref = text.partition("=")
    source, dot, name = ref.rpartition(".")
    if not sep or not dot or not target.strip() or not source or not name:
        raise ReturnedValueUnavailable(
            f"--bind {text!r}: expected INPUT=INTENT_ID.NAME or INPUT=OPERATION.NAME "
            "(e.g. claim_id=claim.open.claim_id)", binding=text)
    return Binding(target.strip(), source.strip(), name.strip())


def _applied(state: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether an intent's effect is there, and if not, why (its status and outcome)."""
    record = state.get("outcome_record")
    status = record.get("status") if isinstance(record, Mapping) else None
    if str(state.get("status")) not in TERMINAL:
        return False, f"it is still {state.get('status')} (run `capgate resume`)"
    if status == SIMULATED:
        return False, "it was a simulation, torn down since"
    if status not in (APPLIED, ALREADY_APPLIED):
        return False, f"its outcome is {status}"
    return True, ""


def _values(intent_id: str, state: Mapping[str, Any], name: str) -> list[Any] | None:
    """The values ``name`` had in the applied attempt of the intent (None: not returned).

    From the recorded outcome, or -- for an intent resume reconciled as applied
    after a crash -- from the ``keys_returned`` of the attempt that landed.
    """
    record = state.get("outcome_record")
    record = record if isinstance(record, Mapping) else {}
    evidence = record.get("evidence") if isinstance(record.get("evidence"), Mapping) else {}
    returned = evidence.get("returned") if isinstance(evidence, Mapping) else None
    if isinstance(returned, Mapping) and name in returned:
        return list(returned[name])
    keys = state.get("returned")
    if isinstance(keys, Mapping) and name in keys:
        if int(state.get("returned_attempt") or 0) != int(record.get("attempt") or 0):
            raise ReturnedValueUnavailable(
                f"intent {intent_id} returned {name!r} in attempt "
                f"{state.get('returned_attempt')}, but attempt {record.get('attempt')} is the "
                "one that landed: its value is not known", intent_id=intent_id, name=name)
        return list(keys[name])
    return None


def resolve(ledger: Ledger, case: str, bindings: list[Binding]) -> dict[str, Any]:
    """``{input: {"value", "intent_id", "name"}}`` for each binding, read from the ledger of
    ``case`` (ReturnedValueUnavailable, naming what is missing, if one cannot be)."""
    out: dict[str, Any] = {}
    everyone: dict[str, dict[str, Any]] | None = None
    for b in bindings:
        if b.input in out:
            raise ReturnedValueUnavailable(f"input {b.input!r} is bound twice", input=b.input)
        try:
            candidates: dict[str, Mapping[str, Any]]
            if "." in b.source:  # an operation id: its applied intents in the case
                if everyone is None:
                    everyone = ledger.intents(case)
                candidates = {i: s for i, s in everyone.items()
                              if s.get("operation_id") == b.source}
            else:
                candidates = {b.source: ledger.intent(case, b.source)}
        except (UnknownCase, UnknownIntent):
            raise ReturnedValueUnavailable(
                f"--bind {b.input}={b.source}.{b.name}: case {case!r} has no intent "
                f"{b.source!r}", **b.to_dict(), case=case) from None
        found: list[tuple[str, list[Any]]] = []
        why: list[str] = []
        running = sorted(i for i, s in candidates.items() if str(s.get("status")) not in TERMINAL)
        if running:  # what it returned is not known until resume settles it
            raise ReconciliationRequired(
                f"--bind {b.input}={b.source}.{b.name}: intent(s) {', '.join(running)} of case "
                f"{case!r} are unresolved; run `capgate resume {case}` first", case=case,
                intents=running)
        for intent_id, state in candidates.items():
            ok, reason = _applied(state)
            values = _values(intent_id, state, b.name) if ok else None
            if ok and values is not None:
                found.append((intent_id, values))
            elif not ok:
                why.append(f"intent {intent_id}: {reason}")
            else:
                why.append(f"intent {intent_id} returned no {b.name!r}")
        if not found:
            detail = "; ".join(why) or f"no intent of {b.source} in the case"
            raise ReturnedValueUnavailable(
                f"--bind {b.input}={b.source}.{b.name}: no applied intent of case {case!r} "
                f"returned {b.name!r} ({detail})", **b.to_dict(), case=case)
        if len(found) > 1:
            raise ReturnedValueUnavailable(
                f"--bind {b.input}={b.source}.{b.name}: {len(found)} applied intents of "
                f"{b.source} returned {b.name!r} ({', '.join(i for i, _ in found)}); name the "
                "intent id", **b.to_dict(), case=case, intents=[i for i, _ in found])
        intent_id, values = found[0]
        if len(values) != 1:
            raise ReturnedValueUnavailable(
                f"--bind {b.input}={b.source}.{b.name}: intent {intent_id} returned "
                f"{len(values)} values under {b.name!r}, not one", **b.to_dict(),
                intent_id=intent_id, values=values)
        out[b.input] = {"value": values[0], "intent_id": intent_id, "name": b.name}
    return out
