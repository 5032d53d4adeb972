"""Impact claims: two cases never write one target at once, across processes.

A write's impact keys (``environment/system/object/key=value``, from
:func:`executor.plan.impact_keys`) are claimed by its case in the ledger
store *before* ``prepared`` and released at the end of the call.  Reads never
claim.  The store is the ledger's own database, so every executor sharing a
ledger -- any process, any machine, when the ledger is PostgreSQL -- shares
the claims; nothing here relies on an in-process lock.

The claim row (``cg_claims``, one per impact key, never deleted)
-----------------------------------------------------------------

Acquiring is one atomic upsert per key::

    INSERT INTO cg_claims (...) VALUES (..., token = 1, ...)
    ON CONFLICT (impact_key) DO UPDATE SET token = cg_claims.token + 1, <holder>
    WHERE cg_claims.case_id IS NULL              -- free
       OR cg_claims.case_id = excluded.case_id   -- the same case again
       OR cg_claims.expires_at < <store now>     -- the holder's claim expired
    RETURNING token

Nothing returned means another case holds the key: the caller gets
:class:`~registry.errors.ImpactConflict` naming the key and the claim's
expiry -- the holder's case, intent and operation travel on the exception
(``holder``) for the coordination record, never in the refusal the caller sees,
as they may be another identity's -- and nothing was recorded or opened.  Concurrent
claimers serialise on the row (PostgreSQL re-checks the ``WHERE`` against the
committed row; SQLite writers serialise on ``BEGIN IMMEDIATE``); several keys
are taken in one transaction, in sorted order, all or none.

Every acquisition increments the key's ``token``: a *fencing token* that only
grows.  A claim carries an expiry (the lease deadline plus a margin, see
:func:`claim_ttl`) measured on the store's clock, so a dead executor's claim
can be taken over -- with a new token -- once it expired.

The fence: refusing a stale holder's late write
-----------------------------------------------

The claim lives in the ledger's database; the write happens in the target's.
No single transaction spans both, so the fence is built in two parts, both
run after the last statement and before COMMIT (``Executor.run_transaction``):

1. **In the target, in the write's own transaction**: a row per impact key in
   ``capgate_fence`` is moved to our token with
   ``UPDATE capgate_fence SET token = :t WHERE key_hash = :k AND token <= :t``.
   A newer holder that already committed left a larger token, so the update
   matches nothing and the write rolls back (``stale_fence``).  The row lock
   this update takes serialises the fence with any other holder's commit, and
   the check commits atomically with the data: a stale token can never land.
2. **In the ledger**: a conditional renewal
   (``UPDATE cg_claims SET expires_at = max(expires_at, now + margin)
   WHERE impact_key = :k AND token = :t AND case_id = :case``).  If the token
   moved (the claim expired and was taken over) the write rolls back before
   COMMIT; if it did not, nobody can take the key over for ``margin`` seconds,
   which covers the COMMIT.

The window that remains: a holder that passed both checks and then stalls
*between* the fence and COMMIT for longer than the margin, while another case
takes the key over and writes.  The newer holder's own fence update then
waits for the stale transaction's fence-row lock, and on PostgreSQL and
MariaDB the stale session is killed by the server's idle-in-transaction
timeout (re-armed by the lease to the time left) before the margin runs out,
so it cannot COMMIT afterwards.  On engines without a server-side lease
(SQLite, Oracle) that last window is bounded only by the margin.

Same case, same key: a call of a case that already holds the key joins the
hold (same token; the newest claimant becomes the holder that releases it), so
two calls of one case never fence each other out.  Resume's retry of an
attempt takes the key over with a new token: the older attempt of that case
is fenced out exactly like another case's would be.

Case-held claims (issue 17)
---------------------------

A case works on a target across many calls and agent turns, so with
``case_claim_seconds`` > 0 (the default) a claim is the *case's*: taken at the
case's first plan or write, renewed by each later one (the same token, the
expiry moved on), kept after ``observed``, and given back only by ``capgate
case close`` / ``release`` (:mod:`executor.cases`) or by expiry, so that an
abandoned case does not hold a target forever.  Nothing is added to a call:
the claim still rides in ``prepared``, and ``observed`` has no release to
carry.  Another case touching a held key is refused with
:class:`~registry.errors.CoordinationRequired` and a coordination decision is
recorded in both cases' ledgers (:mod:`executor.coordination`).

The fence still holds across the longer claims.  A claim only changes hands
before its expiry through a person's hand-over or override, which
:mod:`executor.cases` performs only while the holder has no open intent,
compare-and-swapped against the claim row it checked -- so no write of the
old holder is in flight when the token moves on, and the ``before_commit``
shortcut below (no renewal while less than half of the claim's life has
passed) stays sound.  After an expiry the takeover moves the token on, and
the old holder's late write is refused by the target's fence row or by the
ledger renewal, exactly as for a per-call claim.

The claims are a hook of the executor (:class:`ImpactClaims`, see
:mod:`executor.hooks`): claimed in the ``prepared`` transaction, fenced before
COMMIT, released after ``observed`` or at the end of the call (per-call
claims), or kept for the case (case-held claims).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection

from capgate.executor import channel, coordination
from capgate.executor.context import CallContext, Rollback
from capgate.executor.dialects.base import FENCE_TABLE
from capgate.executor.hooks import CallHooks, HasHooks, RetryOutside
from capgate.executor.plan import impact_keys
from capgate.executor.waits import NO_TURN, WaitLine, claim_resource, earlier_turn_sql, line_for
from capgate.registry.errors import (
    CoordinationRequired,
    ImpactConflict,
    LedgerBehindTarget,
    LedgerError,
    LedgerUnreachable,
    OutcomeUnknown,
    StaleFence,
)
from capgate.registry.model import EffectClass
from capgate.registry.vocabulary import RollbackReason

if TYPE_CHECKING:
    from capgate.executor.ledger import Ledger
    from capgate.executor.ledger.backends import HotTx

__all__ = [
    "CLAIM_MARGIN_SECONDS",
    "FENCE_TABLE",
    "ClaimStore",
    "HeldClaim",
    "ImpactClaims",
    "case_claim_seconds",
    "case_held",
    "claim_ttl",
    "claims_enabled",
    "set_claims",
    "store_for",
]

CLAIM_MARGIN_SECONDS = 2.0
"""Slack added to a claim beyond the server's own lease enforcement (seconds)."""


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# --- the store --------------------------------------------------------------------


class StoreAccess:
    """The ledger's store, used for coordination rows: short transactions on its driver.

    ``write()`` is one transaction (the ledger's hot path, see
    :class:`executor.ledger.backends.HotConnections`: fork-safe, per thread);
    ``now_sql`` is the store's clock as epoch seconds, so that expiry is
    compared on one clock.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.ledger_url = ledger.url
        self.backend = ledger.backend
        self.now_sql = ledger.sql_now
        self.greatest = ledger.sql_greatest
        self.skip_locked = ledger.sql_skip_locked

    def write(self, action: str, *, many: bool = False
              ) -> contextlib.AbstractContextManager[HotTx]:
        """A write transaction (all its statements, or none).  ``many`` is accepted for
        the callers' clarity; every write is one transaction."""
        return self.ledger.transaction(action)

    def now(self) -> float:
        """The store's clock (epoch seconds)."""
        with self.ledger.transaction("read the clock", write=False) as tx:
            row = tx.run(f"SELECT {self.now_sql}").first()
        assert row is not None
        return float(row[0])


_ACQUIRE_ATTEMPTS = 8


class _Released(Exception):
    """Internal: the key was free by the time the holder was looked up."""


@dataclass(frozen=True)
class HeldClaim:
    """The impact keys one intent holds, each with its fencing token."""

    case_id: str
    intent_id: str | None
    tokens: Mapping[str, int]
    expires_at: float
    release_on_observed: bool = False
    """True when taken by ``run_transaction`` itself (resume, compensation)."""

    def to_dict(self) -> dict[str, Any]:
        return {"keys": dict(self.tokens), "expires_at": self.expires_at}


class ClaimStore:
    """``cg_claims`` in one ledger store."""

    def __init__(self, ledger: Ledger) -> None:
        self.store = StoreAccess(ledger)
        self._ledger_id: str | None = None
        s = self.store
        # ``keep``: the same case holds the key, unexpired, and this is no takeover --
        # then the token stays and only the expiry grows, so two calls of one case
        # never fence each other out; the newest claimant becomes the holder that
        # releases it.  A takeover (another case after expiry, or resume retrying an
        # attempt) moves the token on.
        keep = ("(cg_claims.case_id = excluded.case_id"
                " AND cg_claims.expires_at >= excluded.acquired_at AND :takeover = 0)")
        self._acquire = (
            "INSERT INTO cg_claims (impact_key, token, case_id, intent_id, operation_id, holder,"
            " acquired_at, expires_at)"
            f" VALUES (:k, 1, :case_id, :intent_id, :operation_id, :holder, {s.now_sql},"
            f" {s.now_sql} + :ttl)"
            f" ON CONFLICT (impact_key) DO UPDATE SET"
            f" token = CASE WHEN {keep} THEN cg_claims.token ELSE cg_claims.token + 1 END,"
            f" expires_at = CASE WHEN {keep}"
            f" THEN {s.greatest}(cg_claims.expires_at, excluded.expires_at)"
            " ELSE excluded.expires_at END,"
            " case_id = excluded.case_id, intent_id = excluded.intent_id,"
            " operation_id = excluded.operation_id, holder = excluded.holder,"
            " acquired_at = excluded.acquired_at"
            # the same case, unexpired, joins its hold; a free or expired key goes to the
            # earliest live turn in its wait line (executor.waits), never past it
            " WHERE (cg_claims.case_id = excluded.case_id"
            " AND cg_claims.expires_at >= excluded.acquired_at)"
            " OR ((cg_claims.case_id IS NULL OR cg_claims.case_id = excluded.case_id"
            " OR cg_claims.expires_at < excluded.acquired_at)"
            f" AND {earlier_turn_sql(s.now_sql)})"
            " RETURNING token, expires_at"
        )
        self._renew = (
            f"UPDATE cg_claims SET expires_at = {s.greatest}(expires_at, {s.now_sql} + :margin)"
            " WHERE impact_key = :k AND token = :t AND case_id = :case_id RETURNING impact_key"
        )
        self._held = (
            "SELECT 1 FROM cg_claims WHERE impact_key = :k AND token = :t"
            f" AND case_id = :case_id AND expires_at > {s.now_sql} + :margin"
        )
        self._release = (
            "UPDATE cg_claims SET case_id = NULL, intent_id = NULL, operation_id = NULL,"
            " holder = NULL, expires_at = 0 WHERE impact_key = :k AND token = :t"
            " AND intent_id = :i"
        )
        self._read = (
            "SELECT impact_key, token, case_id, intent_id, operation_id, holder, acquired_at,"
            f" expires_at, {s.now_sql} AS now FROM cg_claims WHERE impact_key = :k"
        )

    def ledger_id(self) -> str:
        """This ledger store's identity (created once, then read), cached per process."""
        if self._ledger_id is None:
            with self.store.write("record the ledger's identity") as tx:
                tx.run("INSERT INTO cg_meta (key, value) VALUES ('ledger_id', :v)"
                       " ON CONFLICT (key) DO NOTHING", {"v": uuid.uuid4().hex})
                row = tx.run("SELECT value FROM cg_meta WHERE key = 'ledger_id'").first()
            assert row is not None
            self._ledger_id = str(row[0])
        return self._ledger_id

    def acquire(self, keys: Sequence[str], *, case_id: str, intent_id: str | None,
                operation_id: str, ttl: float, takeover: bool = False,
                case_mode: bool = False, turn: int = NO_TURN) -> HeldClaim:
        """Claim every key for ``case_id`` (all or none); ImpactConflict (``holder``: who).

        A key the same case already holds stays with its holding intent and
        token (the claim is only extended) unless ``takeover``: resume's retry
        of an attempt takes it over with a new token, fencing the old attempt.
        ``case_mode``: the keys are held by cases (issue 17), so a conflict is a
        :class:`~registry.errors.CoordinationRequired` naming its decision.
        """
        with self.store.write("claim impact keys") as tx:
            return self.acquire_on(tx, keys, case_id=case_id, intent_id=intent_id,
                                   operation_id=operation_id, ttl=ttl, takeover=takeover,
                                   case_mode=case_mode, turn=turn)

    def acquire_on(self, tx: HotTx, keys: Sequence[str], *, case_id: str,
                   intent_id: str | None, operation_id: str, ttl: float,
                   takeover: bool = False, case_mode: bool = False,
                   turn: int = NO_TURN) -> HeldClaim:
        """:meth:`acquire` inside the caller's transaction on the ledger store.

        ``Executor.call`` claims in the transaction that records ``prepared``:
        a conflict raised here undoes the whole transaction (nothing recorded,
        no key kept), and a call that loses its idempotency key to an identical
        call never joins a claim at all.
        """
        return self.ask_on(tx, keys, case_id=case_id, intent_id=intent_id,
                           operation_id=operation_id, ttl=ttl, takeover=takeover,
                           case_mode=case_mode, turn=turn)()

    def ask_on(self, tx: HotTx, keys: Sequence[str], *, case_id: str,
               intent_id: str | None, operation_id: str, ttl: float,
               takeover: bool = False, case_mode: bool = False,
               turn: int = NO_TURN) -> Callable[[], HeldClaim]:
        """:meth:`acquire_on` in two steps: every key's claim is sent now, and the
        function returned reads the answers -- the claim, or the conflict raised as
        :meth:`acquire_on` raises it (a key found held is looked at, and claimed again
        when its holder let go meanwhile).  The ``prepared`` append reads them with the
        rest of its results, in one round trip."""
        ordered = sorted(set(keys))
        params = {"case_id": case_id, "intent_id": intent_id, "operation_id": operation_id,
                  "holder": _holder(), "ttl": float(ttl), "takeover": int(takeover),
                  "turn": int(turn)}
        asked = [tx.run(self._acquire, {**params, "k": key, "wres": claim_resource(key)})
                 for key in ordered]

        def answer() -> HeldClaim:
            tokens: dict[str, int] = {}
            expires = 0.0
            for key, first in zip(ordered, asked, strict=True):
                row = first.first()
                if row is None:
                    row = self._claim_held_key(tx, key, params, case_id, case_mode, ordered)
                tokens[key] = int(row[0])
                expires = float(row[1])
            return HeldClaim(case_id, intent_id, tokens, expires)

        return answer

    def _claim_held_key(self, tx: HotTx, key: str, params: dict[str, Any], case_id: str,
                        case_mode: bool, ordered: list[str]) -> tuple[Any, ...]:
        """A key whose claim came back empty: refuse, or claim it again once its holder
        let go (``_ACQUIRE_ATTEMPTS`` claims in all, the first one included)."""
        for _ in range(_ACQUIRE_ATTEMPTS - 1):
            with contextlib.suppress(_Released):  # the holder let go meanwhile: again
                self._refuse(tx, key, case_id, case_mode, turn=int(params["turn"]))
            row = tx.run(self._acquire, {**params, "k": key,
                                         "wres": claim_resource(key)}).first()
            if row is not None:
                return row
        raise ImpactConflict(f"impact key {key!r} changed hands too often to be "
                             "claimed; retry", impact_keys=ordered,
                             requested_by_case=case_id)

    def _refuse(self, tx: HotTx, key: str, case_id: str, case_mode: bool = False,
                turn: int = NO_TURN) -> None:
        conflict = self._describe(tx, key)
        if conflict["case_id"] is None or conflict["case_id"] == case_id \
                or conflict["expires_in"] <= 0:
            ahead = self._ahead(tx, key, turn)
            if not ahead:
                raise _Released
            raise ImpactConflict(
                f"impact key {key!r} is free, but {ahead} call(s) that came earlier wait "
                "for it; retry, or let the connector's claim_wait_seconds wait in line",
                impact_key=key, expires_in=conflict["expires_in"], requested_by_case=case_id,
                waiting_before=ahead)
        # the refusal names the key and the wait, never the holding case or its intents:
        # they may be another identity's work (the coordination record keeps them)
        shown = {"impact_key": key, "expires_in": conflict["expires_in"]}
        if case_mode:
            decision = coordination.decision_id(case_id, str(conflict["case_id"]), key,
                                                conflict["token"])
            raise CoordinationRequired(
                f"impact key {key!r} is held by another case for "
                f"{conflict['expires_in']:.0f} s more; coordination decision {decision} is "
                f"recorded in both cases -- a person decides: `capgate case decide {case_id} "
                f"{decision} --decision wait|hand_over|override --by NAME --key FILE`; nothing was "
                "recorded as an intent or sent",
                **shown, requested_by_case=case_id, decision_id=decision, holder=conflict)
        raise ImpactConflict(
            f"impact key {key!r} is claimed by another case for "
            f"{conflict['expires_in']:.1f} s more; wait for it to finish or coordinate",
            **shown, requested_by_case=case_id, holder=conflict)

    def _ahead(self, tx: HotTx, key: str, turn: int) -> int:
        """How many live turns earlier than ``turn`` wait in ``key``'s line."""
        row = tx.run("SELECT count(*) FROM cg_waits WHERE resource = :r AND seq < :s"
                     f" AND expires_at > {self.store.now_sql}",
                     {"r": claim_resource(key), "s": int(turn)}).first()
        return int(row[0]) if row is not None else 0

    def free_for(self, tx: HotTx, key: str, case_id: str) -> bool:
        """Whether ``key`` is free for ``case_id`` now (unclaimed, expired, or its own)."""
        found = tx.run(self._read, {"k": key}).mappings()
        if not found:
            return True
        row = found[0]
        return row["case_id"] is None or row["case_id"] == case_id \
            or float(row["expires_at"]) < float(row["now"])

    def _describe(self, tx: HotTx, key: str) -> dict[str, Any]:
        found = tx.run(self._read, {"k": key}).mappings()
        row = found[0] if found else None
        if row is None:  # vanished meanwhile: report it plainly, the caller may retry
            return {"impact_key": key, "case_id": None, "intent_id": None,
                    "operation_id": None, "holder": None, "token": None, "expires_in": 0.0}
        return {"impact_key": key, "case_id": row["case_id"], "intent_id": row["intent_id"],
                "operation_id": row["operation_id"], "holder": row["holder"],
                "token": int(row["token"]),
                "expires_in": max(0.0, float(row["expires_at"]) - float(row["now"]))}

    def still_held(self, held: HeldClaim, *, margin: float) -> bool:
        """Whether every key is still held with our token for ``margin`` seconds more.

        Read-only (no durable commit, no lock): by the store's own clock, so a
        claim that expired early -- the store's clock stepped, or its row was
        edited -- and was taken over is seen.  A False is not a loss: the caller
        then renews (or learns which keys were lost) with :meth:`renew`.
        """
        with self.store.ledger.transaction("check impact claims", write=False) as tx:
            for key, token in held.tokens.items():
                row = tx.run(self._held, {"k": key, "t": token, "case_id": held.case_id,
                                          "margin": float(margin)}).first()
                if row is None:
                    return False
        return True

    def renew(self, held: HeldClaim, *, margin: float) -> list[str]:
        """Re-validate every token and extend the claim by ``margin``; the keys lost."""
        lost: list[str] = []
        with self.store.write("re-validate impact claims") as tx:
            for key, token in held.tokens.items():
                row = tx.run(self._renew, {"k": key, "t": token, "case_id": held.case_id,
                                                 "margin": float(margin)}).first()
                if row is None:
                    lost.append(key)
        return lost

    def release(self, held: HeldClaim) -> None:
        """Free the keys still held with these tokens (a taken-over key is left alone)."""
        with self.store.write("release impact claims") as tx:
            self.release_on(tx, held)

    def release_on(self, tx: HotTx, held: HeldClaim) -> None:
        """:meth:`release` inside the caller's transaction (the ``observed`` append)."""
        for key, token in held.tokens.items():
            # only the intent recorded as holder frees a key: a call of the same case
            # that merely joined that hold (see ``acquire``) leaves it alone
            tx.run(self._release, {"k": key, "t": token, "i": held.intent_id})

    def release_intents(self, intent_ids: Sequence[str]) -> None:
        """Free every key these (closed) intents still hold: one statement per 500."""
        with self.store.write("release the claims of settled intents") as tx:
            for i in range(0, len(intent_ids), 500):
                chunk = list(intent_ids[i:i + 500])
                names = ", ".join(f":i{n}" for n in range(len(chunk)))
                tx.run("UPDATE cg_claims SET case_id = NULL, intent_id = NULL, "
                       f"operation_id = NULL, holder = NULL, expires_at = 0 WHERE intent_id "
                       f"IN ({names})", {f"i{n}": v for n, v in enumerate(chunk)})

    def current(self, key: str) -> dict[str, Any] | None:
        """The claim row of ``key`` as stored (``expires_in`` on the store's clock)."""
        with self.store.write("read an impact claim") as tx:
            found = tx.run(self._read, {"k": key}).mappings()
        if not found:
            return None
        row = found[0]
        out = {k: row[k] for k in ("impact_key", "token", "case_id", "intent_id",
                                   "operation_id", "holder", "acquired_at")}
        out["expires_in"] = float(row["expires_at"]) - float(row["now"])
        return out

    # --- a target's fence rows against these tokens (executor.fences)

    def tokens(self, keys: Sequence[str], chunk: int = 200) -> dict[str, int]:
        """The token of each of ``keys`` that has a claim row, in one transaction."""
        out: dict[str, int] = {}
        with self.store.write("read impact claims' tokens", many=True) as tx:
            for start in range(0, len(keys), chunk):
                names = {f"k{i}": key for i, key in enumerate(keys[start:start + chunk])}
                sql = ("SELECT impact_key, token FROM cg_claims WHERE impact_key IN ("
                       + ", ".join(":" + n for n in names) + ")")
                for row in tx.run(sql, names).all():
                    out[str(row[0])] = int(row[1])
        return out

    def raise_tokens(self, tokens: Mapping[str, int]) -> None:
        """Raise each key's token to at least the one given, in one transaction (a key
        without a claim row gets a free one); a token is never lowered."""
        s = self.store
        with s.write("raise impact claims' tokens", many=True) as tx:
            for key, token in tokens.items():
                tx.run("INSERT INTO cg_claims (impact_key, token, case_id, intent_id,"
                       " operation_id, holder, acquired_at, expires_at) VALUES (:k, :t, NULL,"
                       f" NULL, NULL, NULL, {s.now_sql}, 0) ON CONFLICT (impact_key) DO UPDATE"
                       " SET token = excluded.token WHERE cg_claims.token < excluded.token",
                       {"k": key, "t": token})

    # --- a case's claims (issue 17: case close / release / hand-over, executor.cases)

    def held_by(self, case_id: str) -> list[dict[str, Any]]:
        """The unexpired claims ``case_id`` holds, each with ``acquired_at`` (its CAS value)."""
        s = self.store
        with self.store.write("read a case's impact claims", many=True) as tx:
            rows = tx.run(
                "SELECT impact_key, token, case_id, intent_id, operation_id, holder,"
                f" acquired_at, expires_at - {s.now_sql} AS expires_in FROM cg_claims"
                f" WHERE case_id = :c AND expires_at >= {s.now_sql} ORDER BY impact_key",
                {"c": case_id}).mappings()
        return [dict(r) for r in rows]

    def held_by_cases(self) -> dict[str, list[dict[str, Any]]]:
        """Every unexpired claim, by holding case (``capgate cases``), in one read."""
        s = self.store
        with s.ledger.transaction("read held impact claims", write=False) as tx:
            rows = tx.run(
                "SELECT impact_key, token, case_id, intent_id, operation_id,"
                f" expires_at - {s.now_sql} AS expires_in FROM cg_claims"
                f" WHERE case_id IS NOT NULL AND expires_at >= {s.now_sql}"
                " ORDER BY case_id, impact_key").mappings()
        out: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            out.setdefault(str(row["case_id"]), []).append(dict(row))
        return out

    def release_case_on(self, tx: HotTx, case_id: str, key: str, *, token: int,
                        acquired_at: float) -> bool:
        """Give ``key`` back for ``case_id`` -- only if the claim is still the one read
        (same token, same acquisition): a call of the case that renewed it meanwhile keeps
        it."""
        row = tx.run(
            "UPDATE cg_claims SET case_id = NULL, intent_id = NULL, operation_id = NULL,"
            " holder = NULL, expires_at = 0 WHERE impact_key = :k AND case_id = :c"
            " AND token = :t AND acquired_at = :a RETURNING impact_key",
            {"k": key, "c": case_id, "t": int(token), "a": float(acquired_at)}).first()
        return row is not None

    def transfer_on(self, tx: HotTx, key: str, *, from_case: str, token: int | None,
                    acquired_at: float | None, to_case: str, operation_id: str | None,
                    ttl: float) -> int | None:
        """Hand ``key`` from ``from_case`` to ``to_case``: its token becomes ``token + 1``.

        Compare-and-swapped on the claim the caller checked (holder, token and
        -- when given -- acquisition time): a call of the holder that claimed
        again meanwhile makes it fail (None), so no write of the old holder can
        be in flight when the token moves on.  With ``acquired_at`` None the key
        must still be free or expired at ``token`` (None: no claim row yet).
        The new token is therefore known before the transaction runs, and the
        record of the hand-over can name it.
        """
        s = self.store
        if acquired_at is None:
            cond = (f"cg_claims.token = :t AND (cg_claims.case_id IS NULL"
                    f" OR cg_claims.expires_at < {s.now_sql})")
            binds: dict[str, Any] = {"t": token}
        else:
            cond = "cg_claims.case_id = :fc AND cg_claims.token = :t AND cg_claims.acquired_at = :a"
            binds = {"fc": from_case, "t": token, "a": float(acquired_at)}
        row = tx.run(
            "INSERT INTO cg_claims (impact_key, token, case_id, intent_id, operation_id, holder,"
            f" acquired_at, expires_at) VALUES (:k, 1, :to, NULL, :op, :h, {s.now_sql},"
            f" {s.now_sql} + :ttl) ON CONFLICT (impact_key) DO UPDATE SET"
            " token = cg_claims.token + 1, case_id = excluded.case_id, intent_id = NULL,"
            " operation_id = excluded.operation_id, holder = excluded.holder,"
            " acquired_at = excluded.acquired_at, expires_at = excluded.expires_at"
            f" WHERE {cond} RETURNING token",
            {"k": key, "to": to_case, "op": operation_id, "h": f"handed over to {to_case}",
             "ttl": float(ttl), **binds}).first()
        return None if row is None else int(row[0])

    def renew_case(self, case_id: str, seconds: float) -> list[str]:
        """Move the expiry of every unexpired claim of ``case_id`` to at least now + seconds."""
        s = self.store
        with self.store.write("renew a case's impact claims") as tx:
            rows = tx.run(
                f"UPDATE cg_claims SET expires_at = {s.greatest}(expires_at, {s.now_sql} + :s)"
                f" WHERE case_id = :c AND expires_at >= {s.now_sql} RETURNING impact_key",
                {"c": case_id, "s": float(seconds)}).all()
        return sorted(str(r[0]) for r in rows)


# --- the executor's hook ------------------------------------------------------------


def case_claim_seconds(ctx: CallContext) -> float:
    """How long the case holds its keys between its calls (0: claims last one call)."""
    return float(ctx.connector.config.case_claim_seconds)


def case_held(ctx: CallContext) -> bool:
    """Whether ``ctx``'s claims are the case's (issue 17) rather than the call's."""
    return ctx.connector.config.case_claim_seconds > 0


def claim_ttl(ctx: CallContext) -> float:
    """How long a claim lives without renewal.

    The budget wait, the lease deadline (the row's timeout), and a margin that
    covers the server's own enforcement of that deadline (the idle-in-transaction
    timeout, as long as the timeout again) plus :data:`CLAIM_MARGIN_SECONDS`; a
    case-held claim at least ``case_claim_seconds``.
    """
    seconds = float(ctx.row.timeout.seconds)
    per_call = ctx.connector.config.budget_wait_seconds + seconds + fence_margin(ctx)
    return max(per_call, case_claim_seconds(ctx))


def fence_margin(ctx: CallContext) -> float:
    return float(ctx.row.timeout.seconds) + CLAIM_MARGIN_SECONDS


class ImpactClaims(CallHooks):
    """The executor's impact claims: a hook (see :mod:`executor.hooks`) with its own state.

    * ``within_prepared``: claim the write's keys in the ``prepared`` transaction
      (kept once that transaction committed, ``after_prepared``);
    * ``before_write``: a write reached without a call (resume's retry, a
      compensation) claims now -- resume's retry takes the key over with a new
      token, fencing the older attempt;
    * ``before_commit``: the fence (target row, then ledger renewal);
    * ``after_observed`` / ``after_call``: release (kept until expiry after an
      unknown outcome).
    """

    def __init__(self, ledger: Ledger) -> None:
        self.store = ClaimStore(ledger)
        self.line: WaitLine = line_for(ledger)
        self.enabled = True
        """False turns claims and the fence off (benchmarks only)."""
        self._held: dict[str, HeldClaim] = {}
        self._pending: dict[str, HeldClaim] = {}
        self._lock = threading.Lock()

    def held(self, intent_id: str) -> HeldClaim | None:
        """The claim an intent holds in this executor, if any."""
        with self._lock:
            return self._held.get(intent_id)

    def _wants(self, ctx: CallContext) -> bool:
        return (self.enabled and not ctx.rehearse
                and ctx.row.effect_class is not EffectClass.READ)

    def within_planned(self, ctx: CallContext, tx: HotTx) -> None:
        """A case-held claim starts at the case's first plan (issue 17): claim (or renew)
        the plan's keys in the transaction that records the plan in the case -- so the
        claim is never the claim of a case the ledger does not know, and ``capgate case
        release`` / ``close`` can give it back.  Another case's hold raises
        CoordinationRequired (recorded by :meth:`plan_refused`)."""
        if not self._wants(ctx) or not case_held(ctx):
            return
        keys = impact_keys(ctx.row, ctx.inputs, ctx.connector.environment)
        answer = self.store.ask_on(tx, keys, case_id=ctx.case_id, intent_id=None,
                                   operation_id=ctx.row.operation_id, ttl=claim_ttl(ctx),
                                   case_mode=True)

        def settle() -> None:
            answer()  # the claim, or the refusal raised here, undoing the transaction

        tx.defer(settle)

    def plan_refused(self, ctx: CallContext, error: BaseException) -> None:
        if isinstance(error, CoordinationRequired) and self._wants(ctx):
            self._record_request(ctx, error, refused_intent=None)

    def within_prepared(self, ctx: CallContext, tx: HotTx) -> None:
        if not self._wants(ctx):
            return
        keys = impact_keys(ctx.row, ctx.inputs, ctx.connector.environment)
        self.line.leave_on(tx, ctx.intent_id)  # a call that waited: its places go with this
        answer = self.store.ask_on(tx, keys, case_id=ctx.case_id, intent_id=ctx.intent_id,
                                   operation_id=ctx.row.operation_id, ttl=claim_ttl(ctx),
                                   case_mode=case_held(ctx),
                                   turn=self.line.turn_of(ctx.intent_id))

        def settle() -> None:
            """The claims' answers, read with the rest of ``prepared``'s (one round trip)."""
            try:
                taken = answer()
            except (ImpactConflict, CoordinationRequired) as conflict:
                if self._may_wait(ctx):  # held by another case's call: wait in line, outside
                    raise RetryOutside(functools.partial(
                        self._wait_for_keys, ctx, keys, conflict)) from None
                raise
            with self._lock:  # may run again (a lost race is retried): the last run counts
                self._pending[ctx.intent_id] = taken

        tx.defer(settle)

    def _may_wait(self, ctx: CallContext) -> bool:
        limit = float(ctx.connector.config.claim_wait_seconds)
        return limit > 0 and self.line.waited(ctx.intent_id, "claim") < limit

    def _wait_for_keys(self, ctx: CallContext, keys: Sequence[str],
                       conflict: ImpactConflict | CoordinationRequired) -> None:
        """Stand in the keys' wait line (nothing held, no transaction open) until every key
        is free for this case and no earlier waiter wants it; then ``prepared`` runs again.

        At ``claim_wait_seconds`` the call is refused as the keys stand then: CG320 (a
        call of another case holds one), or CG330 with its coordination decision (a case
        holds one across its calls).
        """
        limit = float(ctx.connector.config.claim_wait_seconds)

        def free(key: str) -> Callable[[HotTx], bool]:
            return lambda tx: self.store.free_for(tx, key, ctx.case_id)

        if self.line.wait(ctx.intent_id, kind="claim", limit=limit, case_id=ctx.case_id,
                          intent_id=ctx.intent_id,
                          resources={claim_resource(k): free(k) for k in sorted(set(keys))}):
            return
        waited = self.line.waited(ctx.intent_id, "claim")
        turn = self.line.turn_of(ctx.intent_id)
        try:
            with self.store.store.ledger.transaction("describe a held impact key",
                                                     write=False) as tx:
                for key in sorted(set(keys)):
                    with contextlib.suppress(_Released):
                        self.store._refuse(tx, key, ctx.case_id, case_held(ctx), turn=turn)
        except (ImpactConflict, CoordinationRequired) as now:
            conflict = now
        else:
            return  # free at the last moment: one more `prepared` decides
        raise type(conflict)(
            f"{conflict.message}; waited {waited:.1f} s in line "
            f"(claim_wait_seconds={limit:g})",
            holder=conflict.holder,
            **{**conflict.details, "waited_seconds": round(waited, 3)}) from None

    def after_prepared(self, ctx: CallContext) -> None:
        self.line.prepared(ctx.intent_id)
        with self._lock:
            taken = self._pending.pop(ctx.intent_id, None)
            if taken is not None:
                self._held[ctx.intent_id] = taken

    def before_write(self, ctx: CallContext) -> None:
        if not self._wants(ctx) or self.held(ctx.intent_id) is not None:
            return
        keys = impact_keys(ctx.row, ctx.inputs, ctx.connector.environment)
        try:
            taken = self.store.acquire(keys, case_id=ctx.case_id, intent_id=ctx.intent_id,
                                       operation_id=ctx.row.operation_id, ttl=claim_ttl(ctx),
                                       takeover=ctx.resumed, case_mode=case_held(ctx))
        except CoordinationRequired as conflict:  # resume's retry, a compensation
            self._record_request(ctx, conflict, refused_intent=ctx.intent_id)
            raise
        with self._lock:
            self._held[ctx.intent_id] = dataclasses.replace(
                taken, release_on_observed=not case_held(ctx))

    def before_commit(self, ctx: CallContext, conn: Connection) -> None:
        """Just before COMMIT: refuse (roll back) a write whose claim was taken over.

        The target's fence row moves to our token first (a newer token there:
        another holder already wrote).  Then one read of the ledger, no commit,
        confirms by the store's own clock that every key is still ours for the
        fence margin past COMMIT: a key handed to another case by a coordination
        decision (``override``, ``hand_over``), or one that expired early (the
        store's clock stepped, its row was edited) and was taken over, is seen
        here even though that holder has not written yet.  Only when the read
        says no does a renewal transaction re-validate the tokens, extending
        what is still ours and refusing (rolling back) when a key was lost.
        """
        claim = self.held(ctx.intent_id)
        if claim is None:
            return
        stale = target_fence(ctx, conn, claim, namespace=self.store.ledger_id())
        if stale is not None:
            behind = self._ledger_behind(stale, ctx.connector.name)
            if behind is not None:
                raise Rollback(behind)
            raise Rollback({"kind": RollbackReason.STALE_FENCE, "code": StaleFence.code,
                            "where": "target",
                            **stale,
                            "message": "a newer claim of this target already wrote; this "
                                       "holder's claim had expired and was taken over"})
        margin = fence_margin(ctx)
        if self.store.still_held(claim, margin=margin):
            return  # every key still ours, by the store's clock, past COMMIT and the margin
        lost = self.store.renew(claim, margin=margin)
        if lost:
            now = self.store.current(lost[0]) or {}
            raise Rollback({"kind": RollbackReason.STALE_FENCE, "code": StaleFence.code,
                            "where": "ledger",
                            "impact_key": lost[0],
                            "token": claim.tokens[lost[0]], "current_token": now.get("token"),
                            "holder_case": now.get("case_id"),
                            "holder_intent": now.get("intent_id"),
                            "message": "the impact claim expired and was taken over before "
                                       "COMMIT; nothing was committed"})

    def _ledger_behind(self, stale: Mapping[str, Any], connector: str) -> dict[str, Any] | None:
        """The rollback reason when the fence that refused us holds a token this ledger
        never issued for the key (None: a genuine newer holder, the usual stale fence).

        Tokens are committed in the ledger before their holders write the target, and
        a key's token only grows, so a fence above the ledger's token means the ledger
        lost history (a restore from an older backup, an edit, a clone): saying "a newer
        claim wrote" would be false, and the key stays refused until a person looks.
        """
        fenced = stale.get("current_token")
        if fenced is None:
            return None
        try:
            row = self.store.current(str(stale["impact_key"]))
        except LedgerError:  # the ledger unreachable now: the refusal stands as it is
            return None
        issued = int(row["token"]) if row is not None else 0
        if fenced <= issued:
            return None
        return {"kind": RollbackReason.LEDGER_BEHIND, "code": LedgerBehindTarget.code,
                "where": "target", **stale, "ledger_token": issued,
                "message": f"the target's fence holds token {fenced} (intent "
                           f"{stale.get('holder_intent')}), but this ledger has issued "
                           f"only up to {issued} for the key: the ledger is behind the "
                           "target (restored from an older backup, edited or cloned), and "
                           "writes the target holds may be missing from it; nothing was "
                           f"committed.  `capgate target fences {connector}` lists the keys "
                           "and their last writers' landing markers; `--realign` moves "
                           "the ledger's tokens up once a person has looked"}

    def within_observed(self, ctx: CallContext, tx: HotTx) -> None:
        """The claim goes back in the transaction that records the outcome (a case-held
        claim stays with the case: nothing to send)."""
        claim = self.held(ctx.intent_id)
        if claim is not None and not case_held(ctx):
            self.store.release_on(tx, claim)

    def after_observed(self, ctx: CallContext) -> None:
        """Released with ``observed`` (see :meth:`within_observed`): forget it."""
        with self._lock:
            self._held.pop(ctx.intent_id, None)

    def after_call(self, ctx: CallContext, error: BaseException | None) -> None:
        """The end of ``Executor.call``: release what ``observed`` did not, unless unknown.

        After ``OutcomeUnknown`` (connection lost around COMMIT) the claim is kept
        until it expires: the target may still be settling, and resume takes the
        key over for the same case.
        """
        with self._lock:
            self._pending.pop(ctx.intent_id, None)
        self.line.leave(ctx.intent_id)
        if isinstance(error, CoordinationRequired) \
                and error.details.get("requested_by_case") == ctx.case_id:
            self._record_request(ctx, error, refused_intent=ctx.intent_id)
        if isinstance(error, OutcomeUnknown | LedgerUnreachable) or case_held(ctx):
            with self._lock:  # kept: until it expires / for the case
                self._held.pop(ctx.intent_id, None)
            return
        self._release(ctx.intent_id)

    def _record_request(self, ctx: CallContext, conflict: CoordinationRequired, *,
                        refused_intent: str | None) -> None:
        """Record the refusal's coordination decision in both cases (never hiding it)."""
        with contextlib.suppress(LedgerError):
            coordination.record_request(
                self.store.store.ledger, {**conflict.holder, **conflict.details},
                asker_who=ctx.who,
                asker_operation=ctx.row.operation_id, refused_intent=refused_intent,
                ttl=claim_ttl(ctx), via=channel.current())

    def _release(self, intent_id: str) -> None:
        with self._lock:
            claim = self._held.pop(intent_id, None)
        if claim is not None:
            with contextlib.suppress(LedgerError):  # it expires on its own
                self.store.release(claim)


def _claims_of(owner: HasHooks) -> ImpactClaims:
    found = owner.hooks.find(ImpactClaims)
    if found is None:
        raise LookupError("this executor has no impact-claims hook")
    return found


def store_for(owner: HasHooks) -> ClaimStore:
    """The claim store of an executor (tests, tools)."""
    return _claims_of(owner).store


def set_claims(owner: HasHooks, enabled: bool) -> None:
    """Turn impact claims (and the fence) on or off for one executor (benchmarks only)."""
    _claims_of(owner).enabled = enabled


def claims_enabled(owner: HasHooks) -> bool:
    return _claims_of(owner).enabled


# --- the target's fence row -------------------------------------------------------------
# One statement per key moves the fence row to our token, or leaves a newer one alone: the
# dialect's upsert (``Dialect.move_fence``; ``executor.dialects.base.FENCE_UPSERT``).


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def target_fence(ctx: CallContext, conn: Connection, claim: HeldClaim,
                 namespace: str = "") -> dict[str, Any] | None:
    """Move each key's fence row to our token in the write's transaction; None if all moved.

    Rows are keyed by ``namespace`` (the ledger's identity) and the impact key:
    tokens are only comparable within the ledger that issued them.
    """
    dialect = ctx.connector.dialect
    for key, token in sorted(claim.tokens.items()):
        binds = {"h": key_hash(f"{namespace}\n{key}" if namespace else key), "k": key[:400],
                 "t": token, "i": ctx.intent_id}
        moved, found = dialect.move_fence(conn, binds, ctx.tag)
        if moved:
            continue
        return {"impact_key": key, "token": token,
                "current_token": int(found[0]) if found is not None else None,
                "holder_intent": str(found[1]) if found is not None else None}
    return None

