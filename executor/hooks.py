"""The call's interceptors: impact claims and session budgets plug in here.

The executor walks a call one way -- context, ``prepared``, the transaction,
``observed`` -- and at fixed points asks its hooks.  A hook is an object with
any of these methods (:class:`CallHooks` gives them all as no-ops); the
executor owns a :class:`HookSet` of them, built in :mod:`capgate.api` (by
default :class:`~executor.budget.SessionBudgets` then
:class:`~executor.claims.ImpactClaims`).

==================  ==============================================================
``attach``           once, when the executor is built: the resolver of rows (issue 17)
``within_planned``   inside the transaction that records a plan's ``plan_recorded`` event
                     in its case (case-held claims take keys here: a claim always belongs
                     to a case the ledger knows)
``plan_refused``     that transaction was refused (a coordination decision is recorded)
``before_prepared``  before anything is recorded; a refusal here records nothing
``check_case``       inside ``prepared``, sees the case state the intent follows (a
                     registered symptom is re-read here, issue 17)
``within_prepared``  inside the transaction that records ``prepared`` (same store)
``within_observed``  inside the transaction that records ``observed``: releases ride there
``check_target``     before a write opens its target session for the first time
``before_write``     before a write transaction opens (a write reached without a call:
                     resume's retry, a compensation, takes its claims here)
``open_session``     wraps opening a target session (``open_`` does the opening)
``before_commit``    in the write's transaction, after its last statement
``after_observed``   after ``observed`` was recorded
``after_call``       at the very end of ``Executor.call`` (``error``: how it ended)
==================  ==============================================================

Hooks keep their own state (no module globals), so two executors in one
process never share claims or budgets by accident.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import sqlalchemy as sa

if TYPE_CHECKING:
    from capgate.executor.connectors import Connector
    from capgate.executor.context import CallContext
    from capgate.executor.ledger.backends import HotTx
    from capgate.registry.model import Row

__all__ = ["CallHooks", "HasHooks", "HookSet", "Resolver", "RetryOutside"]


class Resolver(Protocol):
    """What a hook may ask of its executor: a row and its connector (the runtime has it)."""

    def resolve(self, operation_id: str, version: int | None = None
                ) -> tuple[Row, Connector]: ...

_H = TypeVar("_H", bound="CallHooks")


class RetryOutside(Exception):
    """Raised by a ``within_*`` hook: undo the transaction, run ``prepare`` outside any
    transaction (it may wait, or refuse with a CapgateError), then try again."""

    def __init__(self, prepare: Callable[[], None]) -> None:
        super().__init__("retry outside the transaction")
        self.prepare = prepare


class CallHooks:
    """Every hook point, doing nothing: subclass and override what you need."""

    def attach(self, resolver: Resolver) -> None:
        """The executor this hook belongs to was built (``resolver`` finds rows)."""

    def within_planned(self, ctx: CallContext, tx: HotTx) -> None:
        """In the transaction that records a plan of ``ctx`` in its case (no intent:
        ``ctx.intent_id`` names the plan); raising undoes it."""

    def plan_refused(self, ctx: CallContext, error: BaseException) -> None:
        """Recording the plan was refused with ``error`` (nothing of it was kept)."""

    def before_prepared(self, ctx: CallContext) -> None:
        """Before ``prepared``: refuse (raise) here and nothing is recorded."""

    def check_case(self, ctx: CallContext, state: Mapping[str, Any] | None) -> None:
        """In the ``prepared`` transaction, with the case state the intent follows (None:
        a new case); raise to refuse, or RetryOutside to do work outside and prepare again."""

    def within_prepared(self, ctx: CallContext, tx: HotTx) -> None:
        """In the ``prepared`` transaction, on the ledger's connection; raising undoes it.

        A hook that needs a statement's answer to decide should send the statement
        and hand the decision to ``tx.defer(check)``: the ledger reads every answer
        of ``prepared`` together (one round trip on PostgreSQL) and runs the checks
        in the order they were deferred, after the idempotency key's own -- a check
        that raises (RetryOutside included) refuses the whole transaction.
        """

    def after_prepared(self, ctx: CallContext) -> None:
        """``prepared`` (and what ``within_prepared`` did) committed."""

    def check_target(self, connector: Connector, ctx: CallContext | None) -> None:
        """Before the first write session on ``connector`` in this process."""

    def before_write(self, ctx: CallContext) -> None:
        """A write transaction of ``ctx`` is about to open."""

    def open_session(self, connector: Connector, ctx: CallContext | None,
                     open_: Callable[[], sa.Connection]) -> sa.Connection:
        """Open a target session (call ``open_``); a budget takes its slot around it."""
        return open_()

    def before_commit(self, ctx: CallContext, conn: sa.Connection) -> None:
        """In the write's own transaction after its last statement; raising rolls it back."""

    def within_observed(self, ctx: CallContext, tx: HotTx) -> None:
        """In the transaction that records ``observed`` (or its stand-ins): release here,
        so a call's releases cost no transaction of their own."""

    def after_observed(self, ctx: CallContext) -> None:
        """After the intent's ``observed`` was recorded."""

    def after_call(self, ctx: CallContext, error: BaseException | None) -> None:
        """At the end of ``Executor.call``, however it ended."""


class HookSet(CallHooks):
    """Several hooks as one, in order (``open_session`` nests: the first is outermost)."""

    def __init__(self, hooks: Sequence[CallHooks] = ()) -> None:
        self.hooks: tuple[CallHooks, ...] = tuple(hooks)

    def __iter__(self) -> Iterator[CallHooks]:
        return iter(self.hooks)

    def find(self, kind: type[_H]) -> _H | None:
        """The first hook of ``kind`` (e.g. the executor's ``ImpactClaims``), if any."""
        for hook in self.hooks:
            if isinstance(hook, kind):
                return hook
        return None

    def attach(self, resolver: Resolver) -> None:
        for hook in self.hooks:
            hook.attach(resolver)

    def within_planned(self, ctx: CallContext, tx: HotTx) -> None:
        for hook in self.hooks:
            hook.within_planned(ctx, tx)

    def plan_refused(self, ctx: CallContext, error: BaseException) -> None:
        for hook in self.hooks:
            hook.plan_refused(ctx, error)

    def before_prepared(self, ctx: CallContext) -> None:
        for hook in self.hooks:
            hook.before_prepared(ctx)

    def check_case(self, ctx: CallContext, state: Mapping[str, Any] | None) -> None:
        for hook in self.hooks:
            hook.check_case(ctx, state)

    def within_prepared(self, ctx: CallContext, tx: HotTx) -> None:
        for hook in self.hooks:
            hook.within_prepared(ctx, tx)

    def within_observed(self, ctx: CallContext, tx: HotTx) -> None:
        for hook in self.hooks:
            hook.within_observed(ctx, tx)

    def after_prepared(self, ctx: CallContext) -> None:
        for hook in self.hooks:
            hook.after_prepared(ctx)

    def check_target(self, connector: Connector, ctx: CallContext | None) -> None:
        for hook in self.hooks:
            hook.check_target(connector, ctx)

    def before_write(self, ctx: CallContext) -> None:
        for hook in self.hooks:
            hook.before_write(ctx)

    def open_session(self, connector: Connector, ctx: CallContext | None,
                     open_: Callable[[], sa.Connection]) -> sa.Connection:
        opener = open_
        for hook in reversed(self.hooks):
            opener = _wrap(hook, connector, ctx, opener)
        return opener()

    def before_commit(self, ctx: CallContext, conn: sa.Connection) -> None:
        for hook in self.hooks:
            hook.before_commit(ctx, conn)

    def after_observed(self, ctx: CallContext) -> None:
        for hook in self.hooks:
            hook.after_observed(ctx)

    def after_call(self, ctx: CallContext, error: BaseException | None) -> None:
        for hook in reversed(self.hooks):
            hook.after_call(ctx, error)


def _wrap(hook: CallHooks, connector: Connector, ctx: CallContext | None,
          inner: Callable[[], sa.Connection]) -> Callable[[], sa.Connection]:
    return lambda: hook.open_session(connector, ctx, inner)


class HasHooks(Protocol):
    """Anything that carries a :class:`HookSet` (an executor, its runtime)."""

    @property
    def hooks(self) -> HookSet: ...
