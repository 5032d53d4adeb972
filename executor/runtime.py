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
from capgate.registry.errors import BudgetExhausted
from capgate.registry.model import Row
from capgate.registry.registry import Registry

if TYPE_CHECKING:
    from capgate.executor.context import CallContext

__all__ = ["MAX_REQUEST_BYTES", "HasRuntime", "Runtime"]

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

    def resolve(self, operation_id: str, version: int | None = None,
                venue: str | None = None) -> tuple[Row, Connector]:
        """The row and its connector; the row reaches only its own connector's database.

        ``venue`` (issue 16) picks the instance of that connector in another
        environment, when one configuration names several (``Connectors.venue``).
        """
        candidate = self.registry.resolve(operation_id, version)
        if venue is not None:
            connector = self.connectors.venue(candidate.connector, venue)
            return self.registry.resolve(operation_id, version, connector.environment), connector
        config = self.connectors.config(candidate.connector)
        row = self.registry.resolve(operation_id, version, config.environment)
        return row, self.connectors.get(row.connector)

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
