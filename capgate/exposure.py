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


@dataclass(frozen=True)
class Hidden:
    """A current row the identity does not get, and why."""

    ref: str
    reason: str
    """:data:`NO_CONNECTOR`, :data:`ENVIRONMENT` or :data:`NO_GRANT`."""
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


def exposure(registry: Registry, connectors: Connectors, grants: Grants, who: str
             ) -> Exposure:
    """The current rows ``who`` may use, and each other current row with its reason."""
    from capgate.registry.errors import NotAuthorized, UnknownConnector

    out = Exposure(who)
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
        try:
            grants.check_call(who, row, config.name, config.environment)
        except NotAuthorized:
            access = "write" if row.is_write else "read"
            out.hidden.append(Hidden(row.ref, NO_GRANT, f"{who!r} holds no {access} grant on "
                                     f"{config.name!r} in {config.environment!r}"))
            continue
        out.usable.append(row)
    return out
