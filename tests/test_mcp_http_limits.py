"""The HTTP endpoint has caps: a slow or silent client never holds the server.

Before, 200 half-open unauthenticated connections were held for 40 s.  Now a
request must arrive within the read timeout, an idle kept-alive connection is
closed, and beyond the connection cap the oldest connection still reading its
request is evicted -- so a client that finishes its request promptly is served
while the stalled ones wait to be closed.  Failed bearer authentications are
logged (rate-limited, never the token).  The server is ``capgate mcp --http`` as
a user starts it; the limits come from ``[mcp]`` in capgate.toml.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import anyio
import httpx2
from sqlalchemy.engine import URL

from tests.server_support import TOKENS, Project, http_session, tool_names

LIMITS = ("[mcp]\nmax_connections = 40\nread_timeout_seconds = 2\nidle_timeout_seconds = 3\n"
          "auth_failure_log_seconds = 60\n")


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (a read returns EOF or a reset)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def wait_until_closed(socks: list[socket.socket], deadline_s: float) -> float:
    start = time.monotonic()
    while True:
        open_ = [s for s in socks if not closed_by_peer(s)]
        if not open_:
            return time.monotonic() - start
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"{len(open_)} of {len(socks)} stalled connection(s) still open "
                                 f"after {time.monotonic() - start:.1f} s")
        time.sleep(0.1)


def half_open(port: int, count: int, partial: bytes = b"") -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if partial:
            s.sendall(partial)
        socks.append(s)
    return socks


def test_stalled_connections_are_closed_and_never_block_a_client(pg_url: URL,
                                                                 tmp_path: Path) -> None:
    project = Project(tmp_path, pg_url, extra_config="")
    project.config.write_text(project.config.read_text() + LIMITS)
    agent = next(iter(TOKENS))
    with project.http() as (url, _):
        port = int(url.split(":")[2].split("/")[0])
        # 200 connections: silent ones, and ones that send half a request and stop
        stalled = half_open(port, 100) + half_open(
            port, 100, b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: applica")
        try:
            # a prompt client is served meanwhile (the oldest stalled ones make room)
            async def served() -> set[str]:
                async with http_session(url, agent) as session:
                    return await tool_names(session)

            started = time.monotonic()
            assert "policy.add_note" in anyio.run(served)
            assert time.monotonic() - started < 15, "the client waited on stalled ones"
            took = wait_until_closed(stalled, deadline_s=15)
            # a silent connection gets the read timeout (2 s), not forever
            assert took < 15, took
        finally:
            for s in stalled:
                s.close()

        # a kept-alive connection that goes idle is closed after idle_timeout_seconds
        async def idle_is_closed() -> None:
            async with httpx2.AsyncClient() as http:
                resp = await http.get(url.replace("/mcp", "/health-none"))
                assert resp.status_code in (401, 404)
        anyio.run(idle_is_closed)
        (s,) = half_open(port, 1, b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            s.settimeout(10)
            assert b"HTTP/1.1" in s.recv(4096)  # answered, then kept alive ...
            wait_until_closed([s], deadline_s=12)  # ... until idle too long
        finally:
            s.close()
    log = project.errlog.read_text()
    assert "at most 40 connections, 2 s to send a request, 3 s idle" in log


def test_failed_authentications_are_logged_without_the_token(pg_url: URL,
                                                             tmp_path: Path) -> None:
    project = Project(tmp_path, pg_url)
    project.config.write_text(project.config.read_text() + LIMITS)
    secret = "wrong-token-0123456789abcdef-SECRET"
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                             "clientInfo": {"name": "t", "version": "0"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    with project.http() as (url, _):
        async def knock() -> None:
            async with httpx2.AsyncClient() as http:
                for _ in range(5):
                    resp = await http.post(url, json=initialize,
                                           headers={**headers, "Authorization": f"Bearer {secret}"})
                    assert resp.status_code == 401
                resp = await http.post(url, json=initialize, headers=headers)
                assert resp.status_code == 401
        anyio.run(knock)
        deadline = time.monotonic() + 10
        while "failed bearer authentication" not in project.errlog.read_text():
            assert time.monotonic() < deadline, "no log line about the failed authentication"
            time.sleep(0.1)
    log = project.errlog.read_text()
    lines = [ln for ln in log.splitlines() if "failed bearer authentication" in ln]
    assert len(lines) == 1, lines  # rate-limited: six failures, one line this minute
    assert "127.0.0.1" in lines[0]
    assert secret not in log and "SECRET" not in log and "0123456789abcdef" not in log
