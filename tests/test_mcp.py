"""``capgate mcp`` through a real MCP client (the SDK's ``ClientSession``).

The server runs as a subprocess -- over stdio, and over streamable HTTP on
127.0.0.1 with bearer tokens -- with a capgate.toml in a temp directory: a
copy of ``capabilities/``, a grants file, a SQLite ledger and a seeded target
(SQLite, or PostgreSQL).  Approvals go through ``capgate approve`` in another
subprocess, as a person would do it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
import sqlalchemy as sa
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp import types as mtypes
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from sqlalchemy.engine import URL

from capgate.mcp_server import CASE_META_KEY, OUTPUT_SCHEMA
from capgate.registry.loader import load_registry
from capgate.registry.model import thaw
from capgate.registry.sql_effects import destructive
from capgate.sqlfiles import apply_schema
from tests.fix_capgate import approval_key_line, approver_key_file, install_target, table_dump

ROOT = Path(__file__).resolve().parent.parent
CAPABILITIES = ROOT / "capabilities"
TOKENS = {"agent-token-0123456789abcdef": "agent", "reader-token-0123456789abcdef": "reader"}

GRANTS = f"""
[principals.agent]
grants = [{{ connector = "*", environments = ["dev"], access = "write" }}]
[principals.reader]
grants = [{{ connector = "*", environments = ["dev"], access = "read" }}]
[principals.alice]
roles = ["dba", "underwriting_lead"]
{approval_key_line("alice")}
"""

EXTRA_ROW = """
format: 1
connectors:
  insurance:
    description: the insurance back office
    dialects: [sqlite, postgresql, mariadb]
rows:
  - operation_id: policy.count_active
    version: 1
    connector: insurance
    description: Count the active policies.
    input: {type: object, additionalProperties: false, properties: {}}
    target: {system: insurance, object: policy}
    effect_class: read
    authorization: {kind: read_grant}
    environments: [dev]
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: active
        sql: "SELECT count(*) AS active FROM policy WHERE status = 'active'"
    evidence: [rows]
"""


class Place:
    """A temp directory with capgate.toml, grants, capabilities copy, ledger and target."""

    def __init__(self, tmp_path: Path, target: URL, *, code: bool = False):
        self.dir = tmp_path
        self.target = target
        self.code = code
        self.caps = tmp_path / "caps"
        shutil.copytree(CAPABILITIES, self.caps)
        engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
        try:
            apply_schema(engine)
            install_target(engine)
        finally:
            engine.dispose()
        (tmp_path / "grants.toml").write_text(GRANTS)
        url = target.render_as_string(hide_password=False)
        text = (f'[capgate]\ncapabilities = ["caps"]\ngrants = "grants.toml"\nagent = "agent"\n'
                f'ledger = "sqlite:///ledger.db"\n'
                f'[connectors.insurance]\nurl = "{url}"\nenvironment = "dev"\n')
        if code:
            text += f'[connectors.insurance_code]\nurl = "{url}"\nenvironment = "dev"\n'
        self.config = tmp_path / "capgate.toml"
        self.config.write_text(text)
        self.errlog = tmp_path / "server.err"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
        return {**env, **extra}

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "capgate", *args, "--config", str(self.config)]

    async def approve(self, plan_hash: str, by: str = "alice", role: str = "dba") -> Any:
        done = await anyio.run_process(
            self.command("approve", plan_hash, "--by", by, "--role", role, "--json",
                         "--key", str(approver_key_file(by))),
            cwd=ROOT, env=self.env(), check=False)
        assert done.returncode == 0, done.stderr.decode()
        return json.loads(done.stdout)


Notes = list[mtypes.ServerNotification]


@asynccontextmanager
async def stdio_session(place: Place, *extra: str) -> AsyncIterator[tuple[ClientSession, Notes]]:
    notes: Notes = []

    async def on_message(message: Any) -> None:
        if not isinstance(message, Exception):
            notes.append(message)

    params = StdioServerParameters(command=sys.executable,
                                   args=place.command("mcp", "--poll", "0.2", *extra)[1:],
                                   cwd=ROOT, env=place.env())
    with place.errlog.open("a") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), \
                ClientSession(read, write, message_handler=on_message) as session:
            await session.initialize()
            yield session, notes


def structured(res: mtypes.CallToolResult) -> dict[str, Any]:
    assert isinstance(res.structured_content, dict), res
    assert json.loads(res.content[0].text) == res.structured_content  # type: ignore[union-attr]
    return res.structured_content


async def call(session: ClientSession, name: str, arguments: dict[str, Any],
               case: str | None = None) -> dict[str, Any]:
    meta: Any = {CASE_META_KEY: case} if case else None
    return structured(await session.call_tool(name, arguments, meta=meta))


# --- the scenario every transport runs ------------------------------------------


async def check_tools(session: ClientSession, *, code: bool = False) -> dict[str, mtypes.Tool]:
    listed = {t.name: t for t in (await session.list_tools()).tools}
    registry = load_registry([CAPABILITIES], check_lock=False)
    expected = {r.operation_id for r in registry.current_rows()
                if code or r.connector == "insurance"}
    assert set(listed) == expected
    for row in registry.current_rows():
        if row.operation_id not in listed:
            continue
        tool = listed[row.operation_id]
        assert tool.input_schema == thaw(row.input)
        assert tool.output_schema == OUTPUT_SCHEMA
        assert tool.description and tool.description.startswith(row.description[:40])
        ann = tool.annotations
        assert ann is not None
        assert ann.read_only_hint is (row.effect_class == "read")
        if row.effect_class != "read":  # from the statements as well as the effect class
            assert ann.destructive_hint is destructive(row), row.ref
        assert ann.idempotent_hint is row.idempotent
        assert (tool.meta or {}).get("capgate/version") == row.version
    assert listed["policy.cancel"].title == "policy.cancel (v2)"  # the current, not the retired
    assert listed["policy.get"].annotations.read_only_hint is True  # type: ignore[union-attr]
    assert listed["document.issue"].annotations.destructive_hint is True  # type: ignore[union-attr]
    # an UPDATE or DELETE is destructive whatever the effect class; an INSERT alone is not
    for name, hint in (("policy.cancel", True), ("policy.purge_orphan", True),
                       ("premium.mark_paid", True), ("cover.add", True),
                       ("policy.add_note", False), ("claim.register", False)):
        assert listed[name].annotations.destructive_hint is hint, name  # type: ignore[union-attr]
    return listed


async def scenario(session: ClientSession, place: Place) -> None:
    await check_tools(session, code=place.code)

    # a read
    got = await call(session, "policy.get", {"policy_id": 1}, case="TICKET-1")
    assert (got["status"], got["case"]) == ("ok", "TICKET-1")
    assert got["evidence"]["rows"][0][1] == "Ada Lovelace"

    # a collapsed write
    got = await call(session, "policy.add_note",
                     {"policy_id": 2, "author": "agent", "body": "Called about the renewal."},
                     case="TICKET-1")
    assert (got["status"], got["case"], got["reason"]) == ("applied_verified", "TICKET-1", None)
    assert got["intent_id"] and got["evidence"]["counts"] == [1]
    assert got["evidence"]["replay"]["rows"][-1] == ["agent", "Called about the renewal."]
    notes = table_dump(place.target, "policy_note")
    assert [r for r in notes if "Called about the renewal." in r]

    # malformed inputs: a schema error naming the field; nothing written
    for bad, field in (({"policy_id": 2, "author": "agent"}, "body"),
                       ({"policy_id": "two", "author": "agent", "body": "x"}, "policy_id"),
                       ({"policy_id": 2, "author": "agent", "body": "x", "sql": "1"}, "sql")):
        res = await session.call_tool("policy.add_note", bad)
        assert res.is_error
        got = structured(res)
        assert got["status"] == "refused" and got["intent_id"] is None
        assert got["error"]["code"] == "CG300"
        assert got["error"]["details"]["field"] == field and field in got["error"]["message"]
    assert table_dump(place.target, "policy_note") == notes

    # a case id that is no short line of printable text (a forged row in `capgate cases`,
    # a message filled with it): refused before anything runs
    for bad_case in ("A\nTICKET-9  closed", "x" * 201, "\u202eevil"):
        with pytest.raises(MCPError, match="a case id"):
            await session.call_tool("policy.add_note",
                                    {"policy_id": 1, "author": "a", "body": "b"},
                                    meta={CASE_META_KEY: bad_case})
    assert table_dump(place.target, "policy_note") == notes

    # an unlisted name: an error, never a fallback
    for name in ("sql.execute", "policy.cancel@1", "policy_get"):
        with pytest.raises(MCPError, match="unknown tool"):
            await session.call_tool(name, {"sql": "DELETE FROM policy"})
    assert table_dump(place.target, "policy_note") == notes

    # a gated write: approval_required -> a person approves -> the call succeeds
    before = table_dump(place.target, "policy")
    case_meta: Any = {CASE_META_KEY: "TICKET-2"}
    res = await session.call_tool("policy.purge_orphan", {"policy_id": 9}, meta=case_meta)
    got = structured(res)
    assert res.is_error and got["status"] == "approval_required"
    assert got["plan_hash"].startswith("sha256:") and got["four_eyes"] is True
    assert [s["expect_rows"] for s in got["plan"]["statements"]] == [2, 3, 2, 1, 1]
    assert got["approver_roles"] == ["dba", "underwriting_lead"]
    assert table_dump(place.target, "policy") == before  # nothing happened yet
    approval = await place.approve(got["plan_hash"])
    assert approval["case"] == "TICKET-2"
    got = await call(session, "policy.purge_orphan", {"policy_id": 9}, case="TICKET-2")
    assert got["status"] == "applied_verified", got
    assert got["evidence"]["counts"] == [2, 3, 2, 1, 1]
    assert [r for r in table_dump(place.target, "policy") if r[0] == 9] == []
    # the same request again (same idempotency key): the recorded outcome, nothing executed
    again = await call(session, "policy.purge_orphan", {"policy_id": 9}, case="TICKET-3")
    assert (again["status"], again["replayed"]) == ("applied_verified", True)
    assert again["intent_id"] == got["intent_id"]


# --- stdio ----------------------------------------------------------------------


def test_stdio_sqlite(sqlite_url: URL, tmp_path: Path) -> None:
    place = Place(tmp_path, sqlite_url)

    async def main() -> None:
        async with stdio_session(place) as (session, notes):
            caps = session.initialize_result
            assert caps is not None and caps.capabilities.tools is not None
            assert caps.capabilities.tools.list_changed is True
            await scenario(session, place)

            # without a case in _meta the call lands in the server's default case
            got = await call(session, "policy.get", {"policy_id": 1})
            assert got["case"].startswith("mcp-agent-")

            # a new capability file: the list follows, with tools/list_changed
            (place.caps / "extra.yaml").write_text(EXTRA_ROW)
            with anyio.fail_after(10):
                while not any(isinstance(n, mtypes.ToolListChangedNotification)
                              for n in notes):
                    await anyio.sleep(0.05)
            names = {t.name for t in (await session.list_tools()).tools}
            assert "policy.count_active" in names
            got = await call(session, "policy.count_active", {})
            active = sum(1 for r in table_dump(place.target, "policy") if r[3] == "active")
            assert got["status"] == "ok" and got["evidence"]["rows"] == [[active]]

            # an invalid new file: its own rows cannot run (it has none that parse), the
            # others keep running, and the server says what is wrong
            (place.caps / "broken.yaml").write_text("format: 1\nrows: [{operation_id: 1}]\n")
            with anyio.fail_after(10):
                while "capability files do not validate" not in place.errlog.read_text():
                    await anyio.sleep(0.05)
            assert {t.name for t in (await session.list_tools()).tools} == names

    anyio.run(main)
    assert "broken.yaml" in place.errlog.read_text()


def test_stdio_identity_limits_the_tools(sqlite_url: URL, tmp_path: Path) -> None:
    place = Place(tmp_path, sqlite_url)

    async def main() -> None:
        async with stdio_session(place, "--as", "reader", "--case", "READS") as (session, _):
            names = {t.name for t in (await session.list_tools()).tools}
            assert names == {"policy.get", "policy.search_by_holder", "cover.list",
                             "document.list", "premium.list_overdue"}
            got = await call(session, "policy.get", {"policy_id": 3})
            assert (got["status"], got["case"]) == ("ok", "READS")
            with pytest.raises(MCPError, match="unknown tool"):
                await session.call_tool("policy.add_note",
                                        {"policy_id": 1, "author": "r", "body": "x"})

    anyio.run(main)


def test_stdio_postgresql(pg_url: URL, tmp_path: Path) -> None:
    place = Place(tmp_path, pg_url, code=True)

    async def main() -> None:
        async with stdio_session(place) as (session, _):
            listed = await check_tools(session, code=True)
            ddl = listed["code.policy_overview"].annotations
            assert ddl is not None and ddl.destructive_hint is True
            await scenario(session, place)
            res = await session.call_tool("code.policy_overview", {"source": "CREATE VIEW x"})
            got = structured(res)
            assert res.is_error and got["status"] == "refused"
            assert got["error"]["code"] == "CG500" and "DDL loop" in got["error"]["message"]

    anyio.run(main)


# --- streamable HTTP ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def http_session(url: str, token: str) -> AsyncIterator[ClientSession]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        yield session


def test_streamable_http(sqlite_url: URL, tmp_path: Path) -> None:
    place = Place(tmp_path, sqlite_url)
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    with place.errlog.open("w") as errlog:
        proc = subprocess.Popen(
            place.command("mcp", "--http", f"127.0.0.1:{port}"), cwd=ROOT,
            env=place.env(CAPGATE_MCP_TOKENS=json.dumps(TOKENS)),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errlog)
    try:
        wait_for_port(port, proc)
        anyio.run(http_scenario, place, url)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "serving streamable HTTP" in place.errlog.read_text()


async def http_scenario(place: Place, url: str) -> None:
    agent, reader = list(TOKENS)
    async with http_session(url, agent) as session:
        await scenario(session, place)

    async with http_session(url, reader) as session:
        names = {t.name for t in (await session.list_tools()).tools}
        assert names and all(n.split(".")[-1] in ("get", "search_by_holder", "list",
                                                  "list_overdue") for n in names)
        with pytest.raises(MCPError, match="unknown tool"):
            await session.call_tool("policy.add_note", {"policy_id": 1, "author": "r",
                                                        "body": "x"})

    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                             "clientInfo": {"name": "t", "version": "0"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient() as http:
        for auth in ({"Authorization": "Bearer wrong-token-0123456789abcdef"},
                     {"Authorization": agent}, {}):
            resp = await http.post(url, json=initialize, headers={**headers, **auth})
            assert resp.status_code == 401, (auth, resp.text)
            assert resp.json()["error"] == "invalid_token"
        ok = await http.post(url, json=initialize,
                             headers={**headers, "Authorization": f"Bearer {agent}"})
        assert ok.status_code == 200
    # through the SDK client the refused handshake surfaces as an MCPError
    with pytest.raises(BaseException) as refused:
        async with http_session(url, "wrong-token-0123456789abcdef"):
            pass
    assert MCPError in {type(e) for e in leaves(refused.value)}


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files (the test's own CA)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "capgate test")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)  # a private key open to others is refused (CG920)
    return cert_path, key_path


def test_http_beyond_loopback_needs_tls(sqlite_url: URL, tmp_path: Path) -> None:
    """Bearer tokens are identities: plain HTTP on a non-loopback address is refused
    (CG902, exit 2, nothing listens); before, `--http 0.0.0.0:PORT` served them in
    cleartext to the network.  With --tls-cert/--tls-key it serves https there."""
    place = Place(tmp_path, sqlite_url)
    env = place.env(CAPGATE_MCP_TOKENS=json.dumps(TOKENS))
    cert, key = self_signed(tmp_path)
    for args, said in (
            (["--http", "0.0.0.0:{port}"], "cleartext"),
            (["--http", "[::]:{port}"], "cleartext"),
            (["--http", "capgate.example.org:{port}"], "cleartext"),
            (["--http", "0.0.0.0:{port}", "--tls-cert", str(cert)], "go together"),
            (["--http", "0.0.0.0:{port}", "--tls-cert", str(cert), "--tls-key",
              str(tmp_path / "missing.key")], "no such file")):
        port = free_port()
        ran = subprocess.run(place.command("mcp", *[a.format(port=port) for a in args]),
                             cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=60, check=False)
        assert ran.returncode == 2, (args, ran.stdout, ran.stderr)
        assert "CG902" in ran.stdout + ran.stderr and said in ran.stdout + ran.stderr, args
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, "something listened"

    stdio = subprocess.run(place.command("mcp", "--tls-cert", str(cert), "--tls-key", str(key)),
                           cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=60, check=False)
    assert stdio.returncode == 2 and "are for --http" in stdio.stdout + stdio.stderr

    port = free_port()
    with place.errlog.open("w") as errlog:
        proc = subprocess.Popen(
            place.command("mcp", "--http", f"0.0.0.0:{port}", "--tls-cert", str(cert),
                          "--tls-key", str(key)), cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errlog)
    try:
        wait_for_port(port, proc)
        anyio.run(https_scenario, f"https://127.0.0.1:{port}/mcp", cert)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert f"serving streamable HTTP at https://0.0.0.0:{port}/mcp" in place.errlog.read_text()


async def https_scenario(url: str, ca: Path) -> None:
    import ssl

    agent = next(iter(TOKENS))
    trust = ssl.create_default_context(cafile=str(ca))
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {agent}"},
                                  verify=trust) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        assert "policy.add_note" in {t.name for t in (await session.list_tools()).tools}
    async with httpx2.AsyncClient(verify=trust) as http:
        refused = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                                  headers={"Accept": "application/json, text/event-stream"})
        assert refused.status_code == 401
    async with httpx2.AsyncClient() as http:  # plain HTTP to the TLS port gets nothing
        with pytest.raises(httpx2.HTTPError):
            await http.post(url.replace("https://", "http://"), json={})


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")

