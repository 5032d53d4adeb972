"""Executors wired to real databases, for every suite that calls operations.

``make_executor(target_url, ledger_url)`` applies the example schema to the
target and returns an Executor over ``capabilities/`` with a grants set in
which ``agent`` may write everywhere, ``alice`` (dba, underwriting_lead,
reporting_lead) and ``bob`` (dba) may approve, and ``reader`` may only read.
Fixtures: ``executor`` (parametrised over SQLite, PostgreSQL, MariaDB and Oracle
targets and over SQLite and PostgreSQL ledgers), ``gate`` (a factory), ``sent_sql``
(what a call actually sent to its targets); ``table_dump`` gives a table's rows, to
compare before and after.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.engine import URL, make_url

from capgate.executor.approvals import SigningKey
from capgate.executor.call import Executor
from capgate.executor.connectors import ConnectorConfig, Connectors
from capgate.executor.dialects import dialect_for
from capgate.executor.grants import Grants
from capgate.executor.ledger import open_ledger
from capgate.executor.target import install
from capgate.registry.loader import load_registry
from capgate.registry.registry import Registry
from capgate.sqlfiles import apply_schema

ROOT = Path(__file__).resolve().parent.parent
CAPABILITIES = ROOT / "capabilities"

def approver_key(name: str) -> SigningKey:
    """The test approver's signing key: derived from the name, the same in every process.

    Crash tests run calls in child processes that build their own grants; a
    derived key makes every process agree on each approver's public key.
    """
    seed = hashlib.sha256(f"capgate-test-approver:{name}".encode()).digest()
    return SigningKey(Ed25519PrivateKey.from_private_bytes(seed), f"test key of {name}")


def approver_key_file(name: str) -> Path:
    """The approver's key as a PEM file (for ``capgate approve --key``), mode 0600."""
    folder = Path(tempfile.gettempdir()) / f"capgate-test-keys-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{name}.key"
    if not path.exists():
        pem = approver_key(name).key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pem)
        tmp.chmod(0o600)
        tmp.replace(path)
    return path


def approval_key_line(name: str) -> str:
    """``approval_key = "ed25519:..."`` for a grants file written by a test."""
    return f'approval_key = "{approver_key(name).public_text}"'


GRANTS = Grants.from_dict({"principals": {
    "agent": {"grants": [{"connector": "*", "environments": ["dev", "qa", "staging", "prod"],
                          "access": "write"}]},
    "other-agent": {"grants": [{"connector": "*",
                                "environments": ["dev", "qa", "staging", "prod"],
                                "access": "write"}]},
    "reader": {"grants": [{"connector": "*", "environments": ["dev", "qa", "staging", "prod"],
                           "access": "read"}]},
    "alice": {"roles": ["dba", "underwriting_lead", "reporting_lead"],
              "approval_key": approver_key("alice").public_text,
              "grants": [{"connector": "*", "environments": ["dev", "qa", "staging", "prod"],
                          "access": "write"}]},
    "bob": {"roles": ["dba"], "approval_key": approver_key("bob").public_text},
}}, source="tests")

KEYS = {name: approver_key(name) for name in ("alice", "bob")}
"""The test approvers' signing keys, for ``Executor.approve(..., key=KEYS["bob"])``."""

_REGISTRY: Registry | None = None


def registry() -> Registry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = load_registry([CAPABILITIES], check_lock=False)
    return _REGISTRY


def in_threads(count: int, work: Callable[[int], None], *,
               timeout: float | None = 60.0) -> list[BaseException]:
    """Run ``work(0) .. work(count - 1)`` in ``count`` threads at once, wait for them all,
    and return what they raised (empty: every one finished cleanly)."""
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors


def install_target(engine: sa.Engine) -> list[str]:
    """capgate's tables in a target, as ``capgate target install`` creates them."""
    dialect = dialect_for(engine.dialect.name)
    dialect.prepare_engine(engine)
    return install(engine, dialect)


def make_executor(target_url: URL | str, ledger_url: URL | str, *, environment: str = "dev",
                  schema: bool = True, **connector_opts: Any) -> Executor:
    target = make_url(target_url)
    if schema:
        engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
        try:
            apply_schema(engine)
            install_target(engine)
        finally:
            engine.dispose()
    url = target.render_as_string(hide_password=False)
    # the suites written before issue 17 run many cases on one target: their claims last
    # a call unless a test asks for case-held claims (case_claim_seconds=...)
    connector_opts.setdefault("case_claim_seconds", 0.0)
    # ... and are refused at once when a target or the budget is busy, as they were
    # written to see (tests/test_waits.py tests the wait line)
    connector_opts.setdefault("claim_wait_seconds", 0.0)
    connector_opts.setdefault("budget_wait_seconds", 0.0)
    connectors = Connectors({
        name: ConnectorConfig(name=name, url=url, environment=environment, **connector_opts)
        for name in ("insurance", "insurance_code")
    })
    return Executor(registry(), connectors, open_ledger(ledger_url), GRANTS)


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Callable[..., Executor]]:
    """A factory: ``gate(target_url, ledger_url=None, **opts)``; closed afterwards."""
    made: list[Executor] = []

    def factory(target_url: URL | str, ledger_url: URL | str | None = None,
                **opts: Any) -> Executor:
        ledger = ledger_url or f"sqlite:///{tmp_path / f'ledger{len(made)}.db'}"
        ex = make_executor(target_url, ledger, **opts)
        made.append(ex)
        return ex

    yield factory
    for ex in made:
        ex.connectors.dispose()
        ex.ledger.close()


@pytest.fixture
def executor(target_url: URL, ledger_url: URL, gate: Callable[..., Executor]) -> Executor:
    """An executor over a fresh target on each engine, with each ledger backend."""
    return gate(target_url, ledger_url)


SentSql = list[tuple[str, Any]]
"""``(statement, parameters)`` as the driver got them, in order."""


@pytest.fixture
def sent_sql() -> Iterator[Callable[[Executor], SentSql]]:
    """``sent_sql(ex)``: a list that fills with every statement sent to ``ex``'s targets.

    Recorded with SQLAlchemy's ``before_cursor_execute`` on each connector's engine:
    what reached the driver (statement text and bind parameters), not what the code
    meant to send.  The listeners are removed afterwards.
    """
    listening: list[tuple[sa.Engine, Callable[..., None]]] = []

    def record(ex: Executor) -> SentSql:
        sent: SentSql = []

        def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
                   executemany: bool) -> None:
            sent.append((statement, parameters))

        for name in ex.connectors.names():
            engine = ex.connectors.get(name).engine
            sa.event.listen(engine, "before_cursor_execute", before)
            listening.append((engine, before))
        return sent

    yield record
    for engine, listener in listening:
        sa.event.remove(engine, "before_cursor_execute", listener)


def table_dump(url: URL | str, table: str) -> list[tuple[Any, ...]]:
    """Every row of ``table`` in a stable order, for before/after comparisons."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT * FROM {table}")).fetchall()
        return sorted((tuple(r) for r in rows), key=repr)
    finally:
        engine.dispose()


_GENERIC = ("registry", "executor", "ddl")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if anything loaded registry/executor/ddl under a bare name.

    The checkout's root is on ``sys.path``, so a stray ``import executor`` (or a
    dynamic import of ``"executor.x"``) would work here, load a second copy of
    every module, and fail only once the wheel is installed.
    """
    import sys

    bare = sorted(m for m in sys.modules if m.split(".")[0] in _GENERIC)
    if bare:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nFAILED: modules loaded under a bare name (import them as capgate.*): {bare}",
              file=sys.stderr)
