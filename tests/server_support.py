"""A capgate project on a real target, and the server a user starts on it.

``Project`` is a folder as ``capgate init`` leaves one: ``capgate.toml``,
``grants.toml``, a copy of ``capabilities/`` with its lock, a SQLite ledger, and
a seeded target (PostgreSQL or MariaDB from the test fixtures).  The server is
started as a user starts it -- ``python -m capgate mcp`` over stdio, or
``--http`` -- and driven by the ``mcp`` SDK's client; the CLI runs as a
subprocess.  Ports come from this branch's range (``PORTS``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
import sqlalchemy as sa
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp import types as mtypes
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy.engine import URL

from capgate.mcp_server import CASE_META_KEY
from capgate.sqlfiles import apply_schema
from tests.fix_capgate import approval_key_line, approver_key_file, install_target
from tests.fix_db import FRESH, engine_params, require_server

ROOT = Path(__file__).resolve().parent.parent
CAPABILITIES = ROOT / "capabilities"
PORTS = range(15100, 15200)
"""The ports this suite may listen on (one range per branch on a shared machine)."""
TOKENS = {"agent-token-0123456789abcdef": "agent", "reader-token-0123456789abcdef": "reader"}


def grants_text(environment: str, *, agent: str = "write", approvers: bool = True,
                alice_roles: str = '"dba", "underwriting_lead"') -> str:
    """The project's grants: ``agent`` (write by default), ``reader``, and the approvers."""
    text = (f'[principals.agent]\ngrants = [{{ connector = "*", environments = '
            f'["{environment}"], access = "{agent}" }}]\n'
            f'[principals.reader]\ngrants = [{{ connector = "*", environments = '
            f'["{environment}"], access = "read" }}]\n')
    if approvers:
        text += (f"[principals.alice]\nroles = [{alice_roles}]\n{approval_key_line('alice')}\n"
                 f'[principals.bob]\nroles = ["dba"]\n{approval_key_line("bob")}\n')
    return text


def free_port() -> int:
    """A port of this branch's range that nothing listens on now."""
    for port in PORTS:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"every port of {PORTS} is taken")


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


class Project:
    """A project folder on ``target`` (see the module)."""

    def __init__(self, tmp_path: Path, target: URL, *, environment: str = "dev",
                 lock: bool = True, extra_config: str = ""):
        self.dir = tmp_path
        self.target = target
        self.environment = environment
        self.caps = tmp_path / "capabilities"
        shutil.copytree(CAPABILITIES, self.caps)
        if not lock:
            (self.caps / "capabilities.lock").unlink()
        engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
        try:
            apply_schema(engine)
            install_target(engine)
        finally:
            engine.dispose()
        self.grants = tmp_path / "grants.toml"
        self.grants.write_text(grants_text(environment))
        url = target.render_as_string(hide_password=False)
        self.config = tmp_path / "capgate.toml"
        self.config.write_text(
            f'[capgate]\ncapabilities = ["capabilities"]\ngrants = "grants.toml"\n'
            f'agent = "agent"\nledger = "sqlite:///ledger.db"\n{extra_config}'
            f'[connectors.insurance]\nurl = "{url}"\nenvironment = "{environment}"\n'
            # many cases write one policy here: their claims last a call, not a case
            'case_claim_seconds = 0\n')
        self.errlog = tmp_path / "server.err"

    # --- files -----------------------------------------------------------------------

    def edit(self, path: Path, old: str, new: str, count: int = 1) -> None:
        """Replace ``old`` by ``new`` in ``path`` (exactly ``count`` times), written in place."""
        text = path.read_text("utf-8")
        assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times in {path}"
        path.write_text(text.replace(old, new), "utf-8")

    def dump(self, table: str) -> list[tuple[Any, ...]]:
        engine = sa.create_engine(self.target, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text(f"SELECT * FROM {table}")).fetchall()
            return sorted((tuple(r) for r in rows), key=repr)
        finally:
            engine.dispose()

    # --- processes ---------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
        env["CAPGATE_CACHE_DIR"] = str(self.dir / "cache")
        return {**env, **extra}

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "capgate", *args, "--config", str(self.config)]

    def cli(self, *args: str, timeout: float = 120) -> Ran:
        done = subprocess.run(self.command(*args), cwd=self.dir, env=self.env(),
                              capture_output=True, text=True, timeout=timeout, check=False)
        return Ran(done.returncode, done.stdout, done.stderr)

    def approve(self, plan_hash: str, by: str = "alice", role: str = "dba") -> Ran:
        return self.cli("approve", plan_hash, "--by", by, "--role", role, "--json",
                        "--key", str(approver_key_file(by)))

    @asynccontextmanager
    async def stdio(self, *extra: str) -> AsyncIterator[tuple[ClientSession, Notes]]:
        """``capgate mcp`` over stdio, as an MCP client starts it; the notifications seen."""
        notes: Notes = []

        async def on_message(message: Any) -> None:
            if not isinstance(message, Exception):
                notes.append(message)

        params = StdioServerParameters(command=sys.executable,
                                       args=self.command("mcp", "--poll", "0.2", *extra)[1:],
                                       cwd=self.dir, env=self.env())
        with self.errlog.open("a") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write), \
                    ClientSession(read, write, message_handler=on_message) as session:
                await session.initialize()
                yield session, notes

    @contextmanager
    def http(self, *extra: str, env: dict[str, str] | None = None
             ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
        """``capgate mcp --http`` on a port of this branch's range; its URL and process."""
        port = free_port()
        with self.errlog.open("a") as errlog:
            proc = subprocess.Popen(
                self.command("mcp", "--http", f"127.0.0.1:{port}", "--poll", "0.2", *extra),
                cwd=self.dir, env=env or self.env(CAPGATE_MCP_TOKENS=json.dumps(TOKENS)),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errlog)
        try:
            wait_for_port(port, proc)
            yield f"http://127.0.0.1:{port}/mcp", proc
        finally:
            proc.terminate()
            proc.wait(timeout=20)


Notes = list[mtypes.ServerNotification]


@asynccontextmanager
async def http_session(url: str, token: str,
                       notes: Notes | None = None) -> AsyncIterator[ClientSession]:
    async def on_message(message: Any) -> None:
        if notes is not None and not isinstance(message, Exception):
            notes.append(message)

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write, message_handler=on_message) as session:
        await session.initialize()
        yield session


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def structured(res: mtypes.CallToolResult) -> dict[str, Any]:
    assert isinstance(res.structured_content, dict), res
    return res.structured_content


async def call(session: ClientSession, name: str, arguments: dict[str, Any],
               case: str) -> dict[str, Any]:
    meta: Any = {CASE_META_KEY: case}
    return structured(await session.call_tool(name, arguments, meta=meta))


async def tool_names(session: ClientSession) -> set[str]:
    return {t.name for t in (await session.list_tools()).tools}


async def until(predicate: Any, what: str, timeout: float = 20.0) -> float:
    """Poll ``predicate`` (sync or async) until true; the seconds it took, or fail saying so."""
    start = time.monotonic()
    while True:
        got = predicate()
        if hasattr(got, "__await__"):
            got = await got
        if got:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        await anyio.sleep(0.05)


def list_changed(notes: Notes) -> int:
    return sum(1 for n in notes if isinstance(n, mtypes.ToolListChangedNotification))


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_url(request: pytest.FixtureRequest) -> Iterator[URL]:
    """A fresh target on PostgreSQL, then on MariaDB (the servers a project runs on)."""
    engine = request.param
    with FRESH[engine](require_server(engine)) as url:
        yield url
