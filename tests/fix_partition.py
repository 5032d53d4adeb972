"""A network partition between capgate and a database: a small TCP proxy the tests steer.

Killing a process closes its sockets, and the server cleans up at once.  A
partition closes nothing: the server may commit while the client hears
nothing, and each side waits for the other.  :class:`PartitionProxy` sits
between capgate and PostgreSQL or MariaDB (``proxy.url(url)`` is ``url``
through it) and can

* :meth:`~PartitionProxy.freeze` -- hold every byte both ways, every
  connection (new ones too: their handshake never completes), closing nothing;
  an end of stream is held too (a FIN does not cross a partition);
* :meth:`~PartitionProxy.heal` -- deliver what was held and go on;
* :meth:`~PartitionProxy.reset` -- close every connection with a reset (RST),
  both ways, as a router that forgot the connection does;
* freeze at a protocol message: :meth:`~PartitionProxy.freeze_when` arms a
  trigger on the client's messages (PostgreSQL frontend messages -- ``Q``,
  ``P`` (Parse), ``B``, ``E``, ``S`` (Sync) ... -- or MariaDB command packets),
  freezing just before (or just after) the first message that matches, so a
  batch can be split between two of its messages;
* drop the reply to a COMMIT: :meth:`~PartitionProxy.drop_reply_when` (and
  :meth:`~PartitionProxy.drop_commit_reply`) forwards the client's message,
  then freezes and discards everything the server sends on that connection:
  the server commits, the client never hears it.  A connection that lost a
  reply cannot be healed (TCP never loses bytes on a live connection), so
  :meth:`heal` resets it.

No library here does this (toxiproxy needs its own server): it is test
infrastructure, on a port of ``PARTITION_PORTS``.  ``partition_proxy`` is a
factory fixture that starts proxies and stops them after the test.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy.engine import URL, make_url

PARTITION_PORTS = range(15300, 15400)
"""Where the proxies listen (this branch's assigned range)."""

_PG_SSL_REQUEST = 80877103
_PG_GSS_REQUEST = 80877104
_PG_CANCEL_REQUEST = 80877102
_POLL = 0.02


@dataclass(frozen=True)
class Message:
    """One message the client sent, as the proxy framed it."""

    conn: int
    """The connection's number (in order of acceptance, from 0)."""
    index: int
    """The message's number on its connection (from 0)."""
    seq: int
    """The message's number across the proxy (from 0)."""
    kind: str
    """PostgreSQL: the frontend message type (``Q``, ``P``, ``B``, ``D``, ``E``, ``S``,
    ``X``...) or ``startup`` / ``ssl_request`` / ``cancel``; MariaDB: ``command``
    (sequence 0: ``COM_QUERY`` and friends) or ``handshake``."""
    sql: str | None
    """The statement text of a simple query, a Parse, or a MariaDB ``COM_QUERY``."""
    size: int

    @property
    def is_commit(self) -> bool:
        text = _strip_comments(self.sql or "").upper()
        return text.startswith("COMMIT")

    def mentions(self, word: str) -> bool:
        return word.upper() in (self.sql or "").upper()


def _strip_comments(sql: str) -> str:
    text = sql.strip()
    while text.startswith("/*"):
        end = text.find("*/")
        if end < 0:
            return text
        text = text[end + 2:].strip()
    return text


Predicate = Callable[[Message], bool]


@dataclass
class _Trigger:
    match: Predicate
    action: str
    """``before`` (freeze, the message held), ``after`` (forward it, then freeze),
    ``drop_reply`` (forward it, freeze, discard the server's bytes on that connection)."""
    fired: threading.Event = field(default_factory=threading.Event)
    message: Message | None = None


class _Framer:
    """Splits a client byte stream into protocol messages."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.startup = True
        self.statements: dict[bytes, str] = {}
        """PostgreSQL: the SQL of each statement the client parsed, by name (a Bind
        names its statement: psycopg prepares a statement after a few runs, and then
        sends only Bind and Execute)."""

    def next(self, buf: bytearray) -> tuple[int, str, str | None] | None:
        """(size, kind, sql) of the first whole message in ``buf``; None if incomplete."""
        if self.protocol == "postgresql":
            return self._pg(buf)
        if self.protocol == "mariadb":
            return self._mariadb(buf)
        return (len(buf), "bytes", None) if buf else None

    def _pg(self, buf: bytearray) -> tuple[int, str, str | None] | None:
        if self.startup:
            if len(buf) < 8:
                return None
            (length,) = struct.unpack("!I", buf[:4])
            if len(buf) < length:
                return None
            (code,) = struct.unpack("!I", buf[4:8])
            if code in (_PG_SSL_REQUEST, _PG_GSS_REQUEST):
                return length, "ssl_request", None
            self.startup = False
            return length, "cancel" if code == _PG_CANCEL_REQUEST else "startup", None
        if len(buf) < 5:
            return None
        kind = chr(buf[0])
        (length,) = struct.unpack("!I", buf[1:5])
        size = 1 + length
        if len(buf) < size:
            return None
        body = bytes(buf[5:size])
        sql: str | None = None
        if kind == "Q":
            sql = body.split(b"\0", 1)[0].decode("utf-8", "replace")
        elif kind == "P":
            parts = body.split(b"\0", 2)
            if len(parts) >= 2:
                sql = parts[1].decode("utf-8", "replace")
                self.statements[parts[0]] = sql
        elif kind == "B":
            parts = body.split(b"\0", 2)
            if len(parts) >= 2:
                sql = self.statements.get(parts[1])
        return size, kind, sql

    @staticmethod
    def _mariadb(buf: bytearray) -> tuple[int, str, str | None] | None:
        if len(buf) < 4:
            return None
        length = buf[0] | (buf[1] << 8) | (buf[2] << 16)
        size = 4 + length
        if len(buf) < size:
            return None
        seq = buf[3]
        payload = bytes(buf[4:size])
        if seq != 0 or not payload:
            return size, "handshake", None
        sql = payload[1:].decode("utf-8", "replace") if payload[0] in (0x03, 0x16) else None
        return size, "command", sql


class _Pipe:
    """One proxied connection: the client's socket, the server's, and what each holds."""

    def __init__(self, proxy: PartitionProxy, number: int, client: socket.socket,
                 server: socket.socket) -> None:
        self.proxy = proxy
        self.number = number
        self.client = client
        self.server = server
        self.framer = _Framer(proxy.protocol)
        self.to_server = bytearray()  # read from the client, not yet forwarded
        self.to_client = bytearray()
        self.client_eof = False
        self.server_eof = False
        self.discard_replies = False
        self.dropping: _Trigger | None = None
        """A drop-reply trigger waiting for the Sync of its batch before it freezes."""
        self.up_done = False  # the client's end of stream delivered to the server
        self.down_done = False
        self.closed = False
        self.index = 0
        self.threads = [threading.Thread(target=self._pump, args=(True,), daemon=True,
                                         name=f"partition-{number}-c2s"),
                        threading.Thread(target=self._pump, args=(False,), daemon=True,
                                         name=f"partition-{number}-s2c")]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _pump(self, upstream: bool) -> None:
        src = self.client if upstream else self.server
        try:
            while not self.closed:
                if self.client_eof if upstream else self.server_eof:
                    time.sleep(_POLL)  # nothing more to read: only what is held to deliver
                else:
                    ready, _, _ = select.select([src], [], [], _POLL)
                    data = b""
                    if ready:
                        try:
                            data = src.recv(65536)
                        except OSError:
                            data = b""
                    with self.proxy.lock:
                        if data:
                            (self.to_server if upstream else self.to_client).extend(data)
                        elif ready and upstream:
                            self.client_eof = True
                        elif ready:
                            self.server_eof = True
                with self.proxy.lock:
                    if self.closed:
                        return
                    if upstream:
                        self._forward_up()
                    else:
                        self._forward_down()
                    if self.up_done and self.down_done:
                        self.proxy.forget(self)
                        self.close()
                        return
        except OSError:
            self.close()

    def _forward_up(self) -> None:
        """Client to server, message by message, stopping where a trigger or a freeze says."""
        proxy = self.proxy
        while not proxy.frozen:
            framed = self.framer.next(self.to_server)
            if framed is None:
                break
            size, kind, sql = framed
            message = Message(self.number, self.index, next(proxy.seq), kind, sql, size)
            proxy.received = message.seq + 1
            trigger = proxy.match(message)
            if trigger is not None and trigger.action == "before":
                proxy.fire(trigger, message)
                return
            self.index += 1
            proxy.sent.append(message)
            self.server.sendall(bytes(self.to_server[:size]))
            del self.to_server[:size]
            if self.dropping is not None and kind == "S":  # the batch's end reached the server
                trigger, self.dropping = self.dropping, None
            if trigger is not None:
                if trigger.action == "drop_reply":
                    self.discard_replies = True
                    self.to_client.clear()
                    if kind in ("P", "B", "E", "D"):  # extended protocol: the statement runs
                        self.dropping = trigger       # at its Sync; forward up to it first
                        continue
                proxy.fire(trigger, message)
                return
        if self.client_eof and not self.to_server and not proxy.frozen and not self.up_done:
            self.up_done = True
            with contextlib.suppress(OSError):
                self.server.shutdown(socket.SHUT_WR)

    def _forward_down(self) -> None:
        if self.discard_replies:
            self.to_client.clear()
            return
        if self.proxy.frozen:
            return
        if self.to_client:
            self.client.sendall(bytes(self.to_client))
            self.to_client.clear()
        if self.server_eof and not self.down_done:
            self.down_done = True
            with contextlib.suppress(OSError):
                self.client.shutdown(socket.SHUT_WR)

    def close(self, *, rst: bool = False) -> None:
        self.closed = True
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                if rst:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()


class PartitionProxy:
    """A TCP proxy in front of one database server that can freeze, heal, reset and drop."""

    def __init__(self, upstream: tuple[str, int], protocol: str) -> None:
        if protocol not in ("postgresql", "mariadb", "bytes"):
            raise ValueError(f"unknown protocol {protocol!r}")
        self.upstream = upstream
        self.protocol = protocol
        self.lock = threading.RLock()
        self.frozen = False
        self.frozen_at: float | None = None
        self.seq = itertools.count()
        self.received = 0
        """How many client messages the proxy has framed (forwarded or held)."""
        self.sent: list[Message] = []
        """Every client message forwarded, in order."""
        self.pipes: list[_Pipe] = []
        self.triggers: list[_Trigger] = []
        self._listener = _listen()
        self.port = self._listener.getsockname()[1]
        self._stopped = False
        self._accepting = threading.Thread(target=self._accept, daemon=True,
                                           name=f"partition-accept-{self.port}")
        self._accepting.start()

    # --- where it is -------------------------------------------------------------

    def url(self, url: URL | str) -> URL:
        """``url`` through the proxy (PostgreSQL without TLS, so messages can be framed)."""
        parsed = make_url(url).set(host="127.0.0.1", port=self.port)
        if self.protocol == "postgresql":
            parsed = parsed.update_query_dict({"sslmode": "disable", "gssencmode": "disable"})
        return parsed

    # --- the faults -------------------------------------------------------------

    def freeze(self) -> None:
        """Hold every byte, both ways, on every connection; close nothing."""
        with self.lock:
            if not self.frozen:
                self.frozen, self.frozen_at = True, time.monotonic()

    def heal(self) -> None:
        """Deliver what was held and go on (a connection that lost a reply is reset)."""
        with self.lock:
            self.triggers.clear()
            self.frozen, self.frozen_at = False, None
            for pipe in list(self.pipes):
                if pipe.discard_replies:
                    pipe.close(rst=True)
                    self.pipes.remove(pipe)

    def reset(self) -> None:
        """Reset every connection (RST both ways), disarm the triggers, unfreeze."""
        with self.lock:
            self.triggers.clear()
            pipes, self.pipes = self.pipes, []
            for pipe in pipes:
                pipe.close(rst=True)
            self.frozen, self.frozen_at = False, None

    def freeze_when(self, match: Predicate, *, after: bool = False) -> _Trigger:
        """Freeze everything at the first client message that ``match``es: held (the
        default) or forwarded first (``after``)."""
        return self._arm(match, "after" if after else "before")

    def freeze_at(self, count: int, *, after: bool = False) -> _Trigger:
        """Freeze at the ``count``-th client message from now (0: the next one)."""
        with self.lock:
            first = self.received
        return self.freeze_when(lambda m: m.seq >= first + count, after=after)

    def drop_reply_when(self, match: Predicate) -> _Trigger:
        """Forward the first client message that ``match``es, then freeze, discarding what
        the server answers on that connection."""
        return self._arm(match, "drop_reply")

    def drop_commit_reply(self) -> _Trigger:
        """The sharpest partition: the client's COMMIT reaches the server, the answer never
        comes back."""
        return self.drop_reply_when(lambda m: m.is_commit)

    def _arm(self, match: Predicate, action: str) -> _Trigger:
        trigger = _Trigger(match, action)
        with self.lock:
            self.triggers.append(trigger)
        return trigger

    # --- used by the pipes (under the lock) --------------------------------------

    def match(self, message: Message) -> _Trigger | None:
        for trigger in self.triggers:
            if not trigger.fired.is_set() and trigger.match(message):
                return trigger
        return None

    def forget(self, pipe: _Pipe) -> None:
        if pipe in self.pipes:
            self.pipes.remove(pipe)

    def fire(self, trigger: _Trigger, message: Message) -> None:
        trigger.message = message
        self.freeze()
        trigger.fired.set()

    # --- lifecycle ---------------------------------------------------------------

    def _accept(self) -> None:
        number = itertools.count()
        while not self._stopped:
            ready, _, _ = select.select([self._listener], [], [], _POLL)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipe = _Pipe(self, next(number), client, server)
            with self.lock:
                if self._stopped:
                    pipe.close(rst=True)
                    return
                self.pipes.append(pipe)
            pipe.start()

    def stop(self) -> None:
        """Stop listening and reset every connection."""
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.reset()

    def __enter__(self) -> PartitionProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_NEXT_PORT = itertools.count()


def _listen() -> socket.socket:
    """A listening socket on a free port of :data:`PARTITION_PORTS`."""
    start = next(_NEXT_PORT)
    for i in range(len(PARTITION_PORTS)):
        port = PARTITION_PORTS[(start + i) % len(PARTITION_PORTS)]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen(64)
        return sock
    raise RuntimeError(f"no free port in {PARTITION_PORTS.start}-{PARTITION_PORTS.stop - 1}")


def proxy_for(url: URL | str) -> PartitionProxy:
    """A proxy in front of ``url``'s server (its protocol from the URL's scheme)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    protocol = {"postgresql": "postgresql", "mysql": "mariadb", "mariadb": "mariadb"}[backend]
    default = 5432 if protocol == "postgresql" else 3306
    return PartitionProxy((parsed.host or "127.0.0.1", parsed.port or default), protocol)


@pytest.fixture
def partition_proxy() -> Iterator[Callable[[URL | str], PartitionProxy]]:
    """``partition_proxy(url)``: a proxy in front of ``url``'s server, stopped afterwards."""
    made: list[PartitionProxy] = []

    def make(url: URL | str) -> PartitionProxy:
        proxy = proxy_for(url)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.stop()


def wait_until(what: str, check: Callable[[], Any], timeout: float,
               every: float = 0.02) -> tuple[Any, float]:
    """Poll ``check`` until it answers truthy; (the answer, seconds it took).

    Fails with the measured figure when ``timeout`` passes first.
    """
    started = time.monotonic()
    while True:
        answer = check()
        elapsed = time.monotonic() - started
        if answer:
            return answer, elapsed
        if elapsed > timeout:
            raise AssertionError(f"{what}: not within {timeout:.1f} s "
                                 f"(waited {elapsed:.2f} s, last answer {answer!r})")
        time.sleep(every)
