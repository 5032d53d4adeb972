"""Which rows an identity can use here, and why each other row is hidden.

A row becomes an MCP tool (and a call succeeds) only when its connector is
configured, the connector's ``environment`` is among the row's
``environments``, and the identity holds a grant for that connector and
environment.  When any of the three disagrees the row is silently absent from
``tools/list`` -- the README's first snippets once gave an MCP server with no
tools and no word why.  :func:`exposure` says why, for ``capgate mcp``'s
start-up message and for ``capgate doctor``; ``capgate.mcp_server.Catalog``
lists exactly the rows it calls usable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capgate.executor.connectors import Connectors
    from capgate.executor.grants import Grants
    from capgate.registry.model import Row
    from capgate.registry.registry import Registry

NO_CONNECTOR = "connector not configured"
ENVIRONMENT = "environment mismatch"
NO_GRANT = "no grant"
UNPINNED = "not pinned by the lock"
GRANTS_INVALID = "grants file invalid"
FILE_INVALID = "capability file invalid"


@dataclass(frozen=True)
class Hidden:
    """A current row the identity does not get, and why."""

    ref: str
    reason: str
    """:data:`NO_CONNECTOR`, :data:`ENVIRONMENT`, :data:`NO_GRANT`, :data:`UNPINNED`
    (outside the unlocked environments), :data:`GRANTS_INVALID` or :data:`FILE_INVALID`
    (a reload found the file invalid: calls are refused until it validates)."""
    detail: str


@dataclass
class Exposure:
    who: str
    usable: list[Row] = field(default_factory=list)
    hidden: list[Hidden] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(Counter(h.reason for h in self.hidden))

    def line(self) -> str:
        """One line: how many tools, and why the rest are hidden."""
        text = f"{len(self.usable)} tool(s) for {self.who!r}"
        if self.hidden:
            reasons = "; ".join(f"{n} {reason}" for reason, n in sorted(self.counts().items()))
            text += f"; {len(self.hidden)} row(s) hidden ({reasons})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"who": self.who, "tools": [r.operation_id for r in self.usable],
                "hidden": [{"row": h.ref, "reason": h.reason, "detail": h.detail}
                           for h in self.hidden]}


def exposure(registry: Registry, connectors: Connectors, grants: Grants, who: str, *,
             unlocked: Iterable[str] | None = None) -> Exposure:
    """The current rows ``who`` may use, and each other current row with its reason.

    ``unlocked``: the environments where a row the lock does not pin may run
    (None: the pins are not considered); elsewhere such a row is hidden, as a
    call would be refused.
    """
    from capgate.registry.errors import CapgateError, NotAuthorized, UnknownConnector

    out = Exposure(who)
    open_environments = None if unlocked is None else frozenset(unlocked)
    for op, refused in sorted(registry.down.items()):
        out.hidden.append(Hidden(op, FILE_INVALID, refused.message))
    for row in registry.current_rows():
        try:
            config = connectors.config(row.connector)
        except UnknownConnector:
            out.hidden.append(Hidden(row.ref, NO_CONNECTOR,
                                     f"connector {row.connector!r} is not in the configuration"))
            continue
        if config.environment not in row.environments:
            out.hidden.append(Hidden(
                row.ref, ENVIRONMENT, f"connector {config.name!r} is {config.environment!r}; "
                f"the row allows {', '.join(row.environments)}"))
            continue
        if grants.failure is not None:
            out.hidden.append(Hidden(row.ref, GRANTS_INVALID, grants.failure.message))
            continue
        try:
            grants.check_call(who, row, config.name, config.environment)
        except NotAuthorized:
            access = "write" if row.is_write else "read"
            out.hidden.append(Hidden(row.ref, NO_GRANT, f"{who!r} holds no {access} grant on "
                                     f"{config.name!r} in {config.environment!r}"))
            continue
        except CapgateError as exc:
            out.hidden.append(Hidden(row.ref, GRANTS_INVALID, exc.message))
            continue
        if open_environments is not None and config.environment not in open_environments \
                and not registry.pinned(row):
            why = ("no capabilities.lock" if not registry.lock.present
                   else "capabilities.lock does not pin it as it is")
            out.hidden.append(Hidden(row.ref, UNPINNED, f"{why}; {config.environment!r} runs "
                                     "pinned rows only"))
            continue
        out.usable.append(row)
    return out
