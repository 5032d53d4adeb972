"""Which face a request came through -- ``api``, ``cli`` or ``mcp`` -- for the records.

A capability gap or a coordination request records how it was asked for, so
that a DBA reading them knows where to look.  The CLI and the MCP server set
the channel around the work they hand to the library (a context variable, so
concurrent requests of one process never mix); a plain Python caller is
``api``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["current", "via"]

_CHANNEL: ContextVar[str] = ContextVar("capgate_channel", default="api")


def current() -> str:
    """The channel of the request being served."""
    return _CHANNEL.get()


@contextlib.contextmanager
def via(channel: str) -> Iterator[None]:
    """Serve the block as a request that came through ``channel``."""
    token = _CHANNEL.set(channel)
    try:
        yield
    finally:
        _CHANNEL.reset(token)
