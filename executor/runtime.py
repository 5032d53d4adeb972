"""What every part of a call shares: the registry, connectors, ledger, grants, hooks, clock.

The :class:`~executor.call.Executor` builds one :class:`Runtime` and hands it
down; the modules below it (the boundaries, the transaction, the shapes,
recovery) take the runtime, never the executor, so the call path runs one
way: ``call`` -> shapes -> transaction -> boundaries -> ledger.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import sqlalchemy as sa

from capgate.executor.connectors import Connector, Connectors
from capgate.executor.context import now_utc
from capgate.executor.grants import Grants
from capgate.executor.hooks import HookSet
from capgate.executor.ledger import Ledger
from capgate.registry.errors import BudgetExhausted, LockMissing, RowUnpinned
from capgate.registry.model import Row
from capgate.registry.registry import Registry

if TYPE_CHECKING:
    from capgate.executor.context import CallContext
    from capgate.executor.sources import LiveSources

__all__ = ["APPROVAL_TTL_MAX_SECONDS", "MAX_REQUEST_BYTES", "UNLOCKED_ENVIRONMENTS",
           "HasRuntime", "Runtime"]

APPROVAL_TTL_MAX_SECONDS = 86_400
"""The longest an approval may live (``[capgate] approval_ttl_max_seconds``): a day."""

UNLOCKED_ENVIRONMENTS = frozenset({"rig", "dev"})
"""Where a row runs without a pin in ``capabilities.lock`` (a draft being tried out),
unless the configuration says otherwise (``[capgate] unlocked_environments``)."""

MAX_REQUEST_BYTES = 1_048_576
"""Default bound on a request's inputs as recorded (canonical JSON); see RequestTooLarge."""


@dataclass
class Runtime:
    """The parts of one executor, shared by everything a call runs through."""

    registry: Registry
    connectors: Connectors
    ledger: Ledger
    grants: Grants
    hooks: HookSet = field(default_factory=HookSet)
    clock: Callable[[], dt.datetime] = now_utc
    max_request_bytes: int = MAX_REQUEST_BYTES
    """Largest request (canonical JSON bytes of the inputs) a call accepts."""
    unlocked_environments: frozenset[str] = UNLOCKED_ENVIRONMENTS
    """Where a row the lock does not pin may run; everywhere else it is refused."""
    sources: LiveSources | None = None
    """The files the registry and grants were read from, re-read when they change
    (None: the parts were handed in and stay as they are)."""
    approval_ttl_max_seconds: int = APPROVAL_TTL_MAX_SECONDS
    """The longest lifetime an approval may be given (its ``--ttl`` or the row's)."""

    def refresh(self) -> bool:
        """Re-read the grants, capability files and lock if they changed (a stat each).

        Called before every call, plan and approval; True when anything was swapped.
        """
        if self.sources is None:
            return False
        return self.sources.refresh(self)

    def resolve(self, operation_id: str, version: int | None = None,
                venue: str | None = None, *, pinned: bool = True) -> tuple[Row, Connector]:
        """The row and its connector; the row reaches only its own connector's database.

        ``venue`` (issue 16) picks the instance of that connector in another
        environment, when one configuration names several (``Connectors.venue``).
        ``pinned``: outside the unlocked environments the row must be pinned by the
        lock (:meth:`check_pinned`); only a rehearsal, which commits nothing, skips it.
        """
        self.refresh()
        registry = self.registry  # one registry for the whole resolution, even mid-swap
        candidate = registry.resolve(operation_id, version)
        if venue is not None:
            connector = self.connectors.venue(candidate.connector, venue)
            row = registry.resolve(operation_id, version, connector.environment)
        else:
            config = self.connectors.config(candidate.connector)
            row = registry.resolve(operation_id, version, config.environment)
            connector = self.connectors.get(row.connector)
        if pinned:
            self.check_pinned(row, connector.environment, registry)
        return row, connector

    def check_pinned(self, row: Row, environment: str,
                     registry: Registry | None = None) -> None:
        """Outside the unlocked environments, refuse a row that ``capabilities.lock`` does
        not pin as it is: with no lock, or an edited or draft row, nothing was reviewed."""
        if environment in self.unlocked_environments:
            return
        lock = (registry or self.registry).lock
        allowed = ", ".join(sorted(self.unlocked_environments)) or "none"
        if not lock.present:
            where = f" at {lock.path}" if lock.path is not None else ""
            raise LockMissing(
                f"{row.ref} is refused in {environment!r}: no capabilities.lock{where} pins "
                f"the rows, and only {allowed} run unpinned rows; review the rows, run "
                "`capgate lock` and commit the lock; nothing was executed",
                operation_id=row.operation_id, version=row.version, environment=environment,
                lock=str(lock.path) if lock.path is not None else None)
        if not lock.pinned(row):
            pin = lock.pins.get(row.key)
            why = (f"the lock pins {pin.hash}, the row is {row.row_hash}" if pin is not None
                   else "the lock does not pin it (a draft)")
            raise RowUnpinned(
                f"{row.ref} is refused in {environment!r}: {why}; only {allowed} run unpinned "
                "rows -- review it, run `capgate lock` and commit the lock; nothing was "
                "executed", operation_id=row.operation_id, version=row.version,
                environment=environment, row_hash=row.row_hash,
                locked=pin.hash if pin is not None else None, source=row.source_path)

    def connect(self, connector: Connector, ctx: CallContext | None = None) -> sa.Connection:
        """A target session, through the hooks (a session budget takes its slot here).

        Refused before anything was sent: ``ConnectorUnavailable``.
        """
        def open_() -> sa.Connection:
            try:
                return connector.engine.connect()
            except sa.exc.TimeoutError:  # the pool (sized to the budget) had no session
                raise BudgetExhausted(
                    f"connector {connector.name!r} has no free session within its budget of "
                    f"{connector.config.session_budget}", connector=connector.name,
                    budget=connector.config.session_budget) from None
            except sa.exc.DBAPIError as exc:  # refused before any statement was sent
                raise connector.unavailable(exc) from None

        return self.hooks.open_session(connector, ctx, open_)

    def check_target(self, connector: Connector, ctx: CallContext | None = None) -> None:
        """capgate's tables are in the target (hooks first: a budget slot for the probe)."""
        self.hooks.check_target(connector, ctx)
        connector.check_target()


class HasRuntime(Protocol):
    """Anything that carries a runtime (the executor does)."""

    @property
    def rt(self) -> Runtime: ...
