"""The HTTP endpoint's limits: a slow or silent client cannot hold the server.

uvicorn closes an idle keep-alive connection, but a connection that never
finishes its request -- opened and left silent, or fed one header byte at a
time -- stays open as long as its client likes, and enough of them exhaust the
process.  So ``capgate mcp --http`` serves through :class:`GuardedH11Protocol`
(uvicorn's h11 protocol with three limits, :class:`Limits`, set from the
configuration's ``[mcp]`` section):

* **read timeout** -- a request's headers and body must arrive within
  ``read_timeout_seconds`` of the connection opening, or of the request's first
  byte on a kept-alive connection; otherwise the connection is closed;
* **idle timeout** -- a kept-alive connection with no request for
  ``idle_timeout_seconds`` is closed (uvicorn's ``timeout_keep_alive``);
* **connection cap** -- at most ``max_connections`` connections at once.  A new
  connection beyond the cap evicts the oldest connection that is still reading
  its request (a stalled client, never one being answered); only when every
  connection is busy answering is the new one turned away with ``503``.

A slow client therefore never blocks the others: its connection is closed when
its time is up, or as soon as a newer client needs the slot.

Failed bearer authentications (a missing or unknown token, answered ``401``)
are logged on stderr by :class:`AuthFailureLog`: the first at once, then at most
one line per ``auth_failure_log_seconds`` with the count and the peers since the
last line -- never the token, nor any part of it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["AuthFailureLog", "GuardedH11Protocol", "Limits", "guarded_protocol"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """The endpoint's limits (``[mcp]`` in ``capgate.toml``)."""

    max_connections: int = 64
    """Connections open at once; beyond it the oldest one still reading its request goes."""
    read_timeout_seconds: float = 10.0
    """A request's headers and body arrive within this, or the connection is closed."""
    idle_timeout_seconds: float = 30.0
    """A kept-alive connection with no request for this long is closed."""
    auth_failure_log_seconds: float = 60.0
    """At most one log line per this many seconds about failed authentications."""

    @classmethod
    def from_settings(cls, values: MutableMapping[str, float] | Any) -> Limits:
        given = dict(values or {})
        return cls(
            max_connections=int(given.get("max_connections", cls.max_connections)),
            read_timeout_seconds=float(given.get("read_timeout_seconds",
                                                 cls.read_timeout_seconds)),
            idle_timeout_seconds=float(given.get("idle_timeout_seconds",
                                                 cls.idle_timeout_seconds)),
            auth_failure_log_seconds=float(given.get("auth_failure_log_seconds",
                                                     cls.auth_failure_log_seconds)))


@dataclass
class _Guard:
    """The connections of one server, oldest first, and what each is doing."""

    limits: Limits
    open: dict[GuardedH11Protocol, float] = field(default_factory=dict)
    """Every open connection -> when it opened (insertion order: oldest first)."""
    evicted: int = 0
    timed_out: int = 0

    def admit(self, proto: GuardedH11Protocol) -> bool:
        """Room for ``proto``: evict the oldest stalled reader if needed; False if none."""
        self.open[proto] = time.monotonic()
        if len(self.open) <= self.limits.max_connections:
            return True
        for other in list(self.open):
            if other is not proto and other.reading:
                self.evicted += 1
                other.close("evicted: the connection cap was reached and it had not sent "
                            "its request")
                return True
        return False


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read timeout and a connection cap (see the module)."""

    guard: _Guard
    """Set on the subclass :func:`guarded_protocol` makes (one per server)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        if not self.guard.admit(self):
            self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n"
                                 b"connection: close\r\n\r\n")
            self.close("refused: every connection is busy")
            return
        self._arm()

    @property
    def reading(self) -> bool:
        """Still waiting for (part of) a request -- not answering one."""
        return self._read_deadline is not None

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.guard.limits.read_timeout_seconds,
                                                   self._read_timeout)

    def _disarm(self) -> None:
        deadline = getattr(self, "_read_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._read_deadline = None

    def _read_timeout(self) -> None:
        self._read_deadline = None
        self.guard.timed_out += 1
        self.close("timed out: the request did not arrive within "
                   f"{self.guard.limits.read_timeout_seconds:g} s")

    def close(self, _why: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self.conn.their_state is h11.IDLE \
                and not self.transport.is_closing():
            self._arm()  # a new request on a kept-alive connection: its own deadline
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()  # the whole request is in: answering it is not reading

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.open.pop(self, None)
        super().connection_lost(exc)


def guarded_protocol(limits: Limits) -> type[GuardedH11Protocol]:
    """A protocol class for one server's ``uvicorn.Config(http=...)``, sharing one guard."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": _Guard(limits)})


class AuthFailureLog:
    """ASGI middleware: log failed bearer authentications (401s), rate-limited, no token."""

    def __init__(self, app: App, every_seconds: float,
                 log: Callable[[str], None] | None = None):
        self.app = app
        self.every = every_seconds
        self.log = log or (lambda m: print(f"capgate mcp: {m}", file=sys.stderr, flush=True))
        self._last = float("-inf")
        self._count = 0
        self._peers: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        peer = str(client[0]) if client else "unknown peer"
        presented = any(k.lower() == b"authorization" for k, _ in scope.get("headers") or ())

        async def watch(message: Message) -> None:
            if message.get("type") == "http.response.start" and message.get("status") == 401:
                self.failed(peer, presented)
            await send(message)

        await self.app(scope, receive, watch)

    def failed(self, peer: str, presented: bool) -> None:
        self._count += 1
        self._peers[peer] = self._peers.get(peer, 0) + 1
        now = time.monotonic()
        if now - self._last < self.every:
            return
        peers = ", ".join(f"{p} ({n})" for p, n in sorted(self._peers.items()))
        what = "an unknown bearer token" if presented else "no bearer token"
        self.log(f"failed bearer authentication: {self._count} request(s) refused with 401 "
                 f"since the last report (latest: {what}) from {peers}; tokens are never "
                 "logged")
        self._last = now
        self._count = 0
        self._peers.clear()
