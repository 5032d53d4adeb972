"""Agents and CI: serve the declared operations over MCP; rehearse every row's examples.

Both build their own executor from the settings -- the MCP server holds one
for its lifetime, a rehearsal loads the capability files without the lock --
and close it when done.  The server itself is :mod:`capgate.mcp_server`; a
rehearsal is :func:`executor.rehearse.rehearse`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from capgate.api import build_executor
from capgate.config import Settings
from capgate.registry.errors import UsageError

if TYPE_CHECKING:
    from capgate.executor.rehearse import RehearsalReport


def serve_mcp(settings: Settings, *, who: str | None = None, http: str | None = None,
              tokens: str | None = None, case: str | None = None,
              poll_seconds: float = 2.0, tls_cert: str | None = None,
              tls_key: str | None = None) -> None:
    """Serve one MCP tool per row the caller may use, until the client or the process stops.

    stdio by default, as ``who`` (default: the configured agent); ``http``
    (``HOST:PORT``): streamable HTTP, each caller's identity from its bearer token
    (``tokens``: a JSON file ``{token: identity}``, default ``CAPGATE_MCP_TOKENS``).
    ``case``: the case of calls whose request names none.  The capability files are
    looked at every ``poll_seconds`` and reloaded when they change.  Beyond a loopback
    address HTTP needs ``tls_cert`` and ``tls_key`` (PEM files): the tokens are the
    identities, and plain HTTP would carry them in cleartext.
    """
    from capgate import mcp_server

    if poll_seconds <= 0:
        raise UsageError("--poll must be a positive number of seconds")
    if http is not None and who is not None:
        raise UsageError("over HTTP the identity comes from the bearer token; drop --as")
    endpoint = None
    if http is not None:  # checked (and refused) before anything opens
        endpoint = mcp_server.http_endpoint(http, tls_cert, tls_key)
    elif tls_cert is not None or tls_key is not None:
        raise UsageError("--tls-cert and --tls-key are for --http")
    with build_executor(settings) as gate:
        mcp_server.serve(settings, gate, who=who or settings.agent, http=endpoint,
                         tokens_path=tokens, default_case=case, poll_seconds=poll_seconds)


def rehearse(settings: Settings, paths: Sequence[str] = (), *, who: str | None = None,
             connectors: Sequence[str] | None = None, operations: Sequence[str] | None = None,
             case: str | None = None) -> RehearsalReport:
    """Run every row's examples (of ``paths``, default the configured files) and roll back.

    The same path as a call, stopped before commit; a row without examples gets a
    zero-row probe.  ``who`` (default: the configured agent) needs the grants a call
    needs.  The lock is not checked: that is ``validate``'s business, and a rehearsal
    tests behaviour, also before a bump.  Every rehearsal is recorded in the ledger.
    """
    from capgate.executor.rehearse import rehearse as rehearse_rows
    from capgate.registry.loader import load_registry

    who = who or settings.agent
    if not who:
        raise UsageError("say who rehearses: --as WHO (or CAPGATE_AGENT / config `agent`)")
    registry = load_registry(list(paths) or list(settings.capabilities), check_lock=False)
    with build_executor(settings, registry=registry) as gate:
        return rehearse_rows(gate, who=str(who), connectors=connectors, operations=operations,
                             case=case)
