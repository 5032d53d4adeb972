"""``capgate mcp``: the declared operations a caller may use, one MCP tool per row.

Built on the official ``mcp`` SDK (2.x) low-level ``Server``: tools here are
data -- one per capability row -- so each tool's ``inputSchema``,
``outputSchema`` and annotations are set from its row, not derived from a
Python signature.  Served over stdio (default) or streamable HTTP.

Tools
    One per current (newest, not retired) row that the caller holds a grant
    for, whose connector is configured and whose environments include the
    connector's.  The tool name is the ``operation_id`` itself: MCP tool names
    may use ``A-Z a-z 0-9 _ - .`` (SEP-986) and operation ids are lowercase
    dotted words, so no mapping is needed.  ``inputSchema`` is the row's input
    contract verbatim; ``outputSchema`` is ``OUTPUT_SCHEMA``; annotations:
    ``readOnlyHint`` for reads, ``destructiveHint`` for irreversible and ddl
    rows (false for other writes), ``idempotentHint`` from the row,
    ``openWorldHint`` false.  A name not in the caller's list is a protocol
    error (-32602); nothing falls back to SQL.

Results
    Structured content: the executor's outcome (``status``, ``intent_id``,
    ``case``, ``evidence``, ``reason``, ...), ``isError`` unless the status is
    ``ok`` or ``applied_verified``.  A gated row answers
    ``status: approval_required`` with ``plan_hash`` and ``plan``; nothing on
    this server can approve -- a person runs ``capgate approve PLAN_HASH``,
    then the agent calls again with the same arguments.  A refusal (invalid
    input naming the field, no grant, a case awaiting ``resume``) answers
    ``status: refused`` with the error's code, message and details; nothing
    was written.  ``ddl`` rows are listed but refused: they run through the
    DDL loop, which this server does not drive.

Identity
    stdio: ``--as WHO``, else ``CAPGATE_AGENT`` / config ``agent``.  HTTP:
    bearer tokens mapped to identities (``--tokens FILE`` or
    ``CAPGATE_MCP_TOKENS``, a JSON object ``{"token": "identity"}``); a
    missing or unknown token is answered 401, and an HTTP session stays bound
    to the token that opened it.  Each identity sees its own tool list.

Case
    Every call belongs to a case.  The client names it per request in the
    request ``_meta`` under ``capgate/case``; else the server's ``--case``
    applies; else one case per identity and server run
    (``mcp-<who>-<run id>``).  The case used is in every result.  The case is
    not a tool argument: the input contracts are closed
    (``additionalProperties: false``) and the tool schema stays the row's.

Reload
    The capability files are polled (paths, mtimes and sizes -- a stat per
    file) every ``poll_seconds`` and before each ``tools/list`` and
    ``tools/call``.  A changed, valid set replaces the registry and a
    ``notifications/tools/list_changed`` goes out: directly to handshake-era
    connections, and through ``subscriptions/listen`` to 2026-era clients.  An
    invalid set is reported on stderr and the previous registry stays.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import mcp.types as types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPError

from capgate.commands import calls
from capgate.config import Settings
from capgate.executor.call import Executor
from capgate.executor.outcome import APPLIED, READ_OK
from capgate.exposure import exposure
from capgate.internal import internal_error
from capgate.registry.errors import (
    EXIT_APPROVAL_REQUIRED,
    EXIT_UNKNOWN,
    CapgateError,
    ConfigError,
    DdlError,
    SelfApproval,
    UnknownOperation,
)
from capgate.registry.model import AuthKind, EffectClass, Row, thaw
from capgate.registry.names import NAME_LIMIT, name_problem
from capgate.registry.sql_effects import destructive

SERVER_NAME = "capgate"
CASE_META_KEY = "capgate/case"
TOKENS_ENV = "CAPGATE_MCP_TOKENS"
MIN_TOKEN_LENGTH = 16
MAX_CASE_LENGTH = NAME_LIMIT

STATUSES = ("ok", "applied_verified", "rolled_back", "compensated", "compensation_failed",
            "approval_required", "refused", "unknown")

OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["status", "case", "operation_id", "version"],
    "properties": {
        "status": {"enum": list(STATUSES),
                   "description": "ok (a read) or applied_verified: done and verified; "
                                  "rolled_back: nothing landed, see reason and evidence; "
                                  "approval_required: a person must approve plan_hash first; "
                                  "refused: not executed, see error; unknown: run "
                                  "`capgate resume CASE`"},
        "intent_id": {"type": ["string", "null"]},
        "case": {"type": "string"},
        "operation_id": {"type": "string"},
        "version": {"type": "integer"},
        "row_hash": {"type": "string"},
        "idempotency_key": {"type": ["string", "null"]},
        "evidence": {"type": "object",
                     "description": "counts, verify results, replayed rows, rows read"},
        "reason": {"type": ["object", "null"],
                   "description": "why it rolled back: the statement and count, or the check"},
        "replayed": {"type": "boolean",
                     "description": "the recorded outcome of an earlier identical call"},
        "plan_hash": {"type": "string"},
        "plan": {"type": "object",
                 "description": "exactly what the call would send: statements, binds, counts"},
        "approver_roles": {"type": "array", "items": {"type": "string"}},
        "four_eyes": {"type": "boolean"},
        "error": {"type": "object",
                  "properties": {"code": {"type": "string"}, "error": {"type": "string"},
                                 "message": {"type": "string"},
                                 "details": {"type": "object"}}},
    },
}


def log(message: str) -> None:
    """Diagnostics go to stderr: on stdio, stdout is the protocol."""
    print(f"capgate mcp: {message}", file=sys.stderr, flush=True)


_IMPORTED = time.monotonic()


def since_start() -> float:
    """Seconds since this process started (Linux: from ``/proc``; elsewhere since this
    module was imported), for the ready line."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            ticks = int(fh.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def ready(how: str) -> None:
    """The line a client or an operator waits for: the server answers from now on."""
    log(f"ready: {how} (started in {since_start():.2f} s)")


# --- rows as tools -------------------------------------------------------------


def annotations_for(row: Row, title: str | None = None) -> types.ToolAnnotations:
    """``readOnlyHint`` for reads; ``destructiveHint`` from what the row's SQL does as
    well as its effect class (:func:`registry.sql_effects.destructive`): a row that
    only inserts is not destructive, one that updates, deletes, merges or runs DDL is."""
    read = row.effect_class is EffectClass.READ
    return types.ToolAnnotations(
        title=title or f"{row.operation_id} (v{row.version})",
        read_only_hint=read,
        destructive_hint=None if read else destructive(row),
        idempotent_hint=row.idempotent,
        open_world_hint=False,
    )


def description_for(row: Row, connector: str, environment: str) -> str:
    shape = f"/{row.shape}" if row.shape else ""
    lines = [row.description,
             f"Capability {row.ref}: {row.effect_class}{shape} on connector {connector} "
             f"({environment})."]
    if row.effect_class is EffectClass.DDL:
        lines.append("Runs through the DDL loop; this MCP server refuses it.")
    elif row.authorization.kind is AuthKind.GATE:
        lines.append("Gated: the first call answers status approval_required with plan_hash and "
                     "plan; a person approves it out of band (`capgate approve PLAN_HASH`), then "
                     "call again with the same arguments. Approvals are single-use and expire"
                     + (", and the requester cannot approve." if row.authorization.four_eyes
                        else "."))
    if row.idempotency_key:
        lines.append(f"A repeated call with the same key ({row.idempotency_key}) returns the "
                     "recorded outcome and executes nothing.")
    lines.append(f"Timeout: {row.timeout_meaning()}.")
    if row.expected_effects:  # issue 16: what no transaction covers
        lines.append("Effects no transaction covers: " + "; ".join(
            f"{e.name} ({e.effect_class}, observed by {e.observed_by}, "
            f"{'verifiable' if e.verifiable else 'not verifiable'} after the fact"
            f"{', customer-visible' if e.visible else ''}): {e.description}"
            for e in row.expected_effects) + ".")
    if row.required_context:
        lines.append("Required context: " + "; ".join(
            f"{c.name}: {c.description}" for c in row.required_context) + ".")
    return "\n".join(lines)


def tool_for(row: Row, connector: str, environment: str, *, pinned: bool = True
             ) -> types.Tool:
    """The row as an MCP tool; a row the lock does not pin says so in its title,
    description and ``_meta`` (``capgate/pinned``)."""
    title = f"{row.operation_id} (v{row.version})" + ("" if pinned else " [UNPINNED draft]")
    description = description_for(row, connector, environment)
    if not pinned:
        description += ("\nUNPINNED: capabilities.lock does not pin this row (a draft, "
                        f"runnable in {environment} only because it is an unlocked "
                        "environment); it is refused wherever the lock is required.")
    return types.Tool(
        name=row.operation_id,
        title=title,
        description=description,
        input_schema=thaw(row.input),
        output_schema=OUTPUT_SCHEMA,
        annotations=annotations_for(row, title),
        _meta={"capgate/version": row.version, "capgate/row_hash": row.row_hash,
               "capgate/effect_class": str(row.effect_class),
               "capgate/authorization": str(row.authorization.kind),
               "capgate/pinned": pinned},
    )


@dataclass(frozen=True)
class ToolEntry:
    row: Row
    tool: types.Tool


class Catalog:
    """The registry as tools per identity, following the executor's reloads.

    The executor re-reads the grants, the capability files and the lock when
    they change (:mod:`executor.sources`); each reload bumps its generation.
    The tool lists are cached per identity and generation, and :meth:`refresh`
    says whose list actually changed -- those clients are told
    ``notifications/tools/list_changed``.
    """

    def __init__(self, executor: Executor):
        self.executor = executor
        self._generation = executor.generation
        self._tools: dict[str, dict[str, ToolEntry]] = {}
        self._shown: dict[str, dict[str, ToolEntry]] = {}
        """What each identity was last shown (kept across reloads, to compare with)."""
        self._known: dict[str, dict[str, ToolEntry]] = {}
        """Every tool each identity was ever shown: a call to one that left the list is
        answered with the coded reason, not a bare "unknown tool"."""
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        return self._generation

    def refresh(self) -> set[str]:
        """Let the executor re-read what changed; the identities whose tool list changed."""
        self.executor.refresh()
        generation = self.executor.generation
        with self._lock:
            if generation == self._generation:
                return set()
            self._generation = generation
            self._tools.clear()
            shown = dict(self._shown)
        problems = self.executor.registry.problems
        if problems:
            refused = sorted(self.executor.registry.down)
            log(f"capability files do not validate ({len(problems)} problem(s); first: "
                f"{problems[0].render()}); refused until fixed: "
                + (", ".join(refused) if refused else
                   "every operation" if self.executor.registry.failure else "no operation"))
        if self.executor.grants.failure is not None:
            log(f"grants file does not validate: {self.executor.grants.failure.message}")
        changed = {who for who, before in shown.items()
                   if _signature(self.tools(who)) != _signature(before)}
        if changed:
            log(f"files reloaded (generation {generation}): the tools of "
                f"{', '.join(sorted(changed))} changed")
        else:
            log(f"files reloaded (generation {generation}): no identity's tools changed")
        return changed

    def tools(self, who: str) -> dict[str, ToolEntry]:
        """name -> entry for every row ``who`` may call here."""
        with self._lock:
            cached = self._tools.get(who)
            if cached is not None:
                return cached
            generation = self._generation
        ex = self.executor
        registry, grants = ex.registry, ex.grants
        out: dict[str, ToolEntry] = {}
        for row in exposure(registry, ex.connectors, grants, who,
                            unlocked=ex.rt.unlocked_environments).usable:
            config = ex.connectors.config(row.connector)
            out[row.operation_id] = ToolEntry(row, tool_for(row, config.name,
                                                             config.environment,
                                                             pinned=registry.pinned(row)))
        with self._lock:
            if generation == self._generation:
                self._tools[who] = out
                self._shown[who] = out
                self._known.setdefault(who, {}).update(out)
        return out

    def shown(self, who: str, name: str) -> ToolEntry | None:
        """The tool ``who`` was last shown under ``name`` (in this or an earlier list)."""
        with self._lock:
            return self._known.get(who, {}).get(name)


def _signature(tools: Mapping[str, ToolEntry]) -> dict[str, Any]:
    return {name: entry.tool.model_dump(mode="json", by_alias=True)
            for name, entry in tools.items()}


# --- results -------------------------------------------------------------------


def result(payload: Mapping[str, Any], *, is_error: bool) -> types.CallToolResult:
    body = dict(payload)
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(body, ensure_ascii=False, default=str))],
        structured_content=body, is_error=is_error)


def refusal(row: Row, case: str, exc: CapgateError) -> dict[str, Any]:
    """A CapgateError as a structured answer: approval_required, unknown, or refused."""
    error = exc.to_dict()
    base = {"case": case, "operation_id": row.operation_id, "version": row.version,
            "intent_id": None, "error": error}
    details = exc.details
    if "plan_hash" in details and (exc.exit_code == EXIT_APPROVAL_REQUIRED
                                   or isinstance(exc, SelfApproval)):
        error["details"] = {k: v for k, v in details.items() if k != "plan"}  # once is enough
        return {"status": "approval_required", **base, "plan_hash": details["plan_hash"],
                "plan": details.get("plan", {}),
                "approver_roles": list(details.get("approver_roles", ())),
                "four_eyes": bool(details.get("four_eyes", False))}
    if exc.exit_code == EXIT_UNKNOWN:
        return {"status": "unknown", **base, "intent_id": details.get("intent_id")}
    return {"status": "refused", **base}


# --- identities ----------------------------------------------------------------


def load_tokens(path: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Bearer token -> identity, from ``path`` or ``CAPGATE_MCP_TOKENS`` (JSON objects)."""
    env = os.environ if env is None else env
    if path is not None:
        from capgate.executor.secretfiles import read_private

        try:
            raw = read_private(path, "tokens file").decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the tokens file: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: the tokens file is not UTF-8 JSON") from None
        source = path
    elif env.get(TOKENS_ENV):
        raw, source = env[TOKENS_ENV], TOKENS_ENV
    else:
        raise ConfigError("serving MCP over HTTP needs bearer tokens: --tokens FILE or "
                          f"{TOKENS_ENV}, a JSON object {{\"token\": \"identity\"}}")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{source}: expected a non-empty JSON object {{\"token\": \"identity\"}}")
    out: dict[str, str] = {}
    for token, who in data.items():
        if not isinstance(who, str) or not who:
            raise ConfigError(f"{source}: every identity must be a non-empty string")
        if len(token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"{source}: the token for {who!r} is shorter than "
                              f"{MIN_TOKEN_LENGTH} characters")
        out[token] = who
    return out


class TokenIdentities:
    """The SDK's ``TokenVerifier``: a known bearer token becomes its identity."""

    def __init__(self, tokens: Mapping[str, str]):
        self._by_digest = {self._digest(t): who for t, who in tokens.items()}

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    async def verify_token(self, token: str) -> AccessToken | None:
        digest = self._digest(token)
        who = self._by_digest.get(digest)
        if who is None:
            return None
        return AccessToken(token=f"sha256:{digest[:16]}", client_id=who, scopes=[])


# --- the server ----------------------------------------------------------------


class _Server(Server[Any]):
    """The SDK's low-level server, advertising ``tools.listChanged`` on every transport."""

    def create_initialization_options(
        self, notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities, extensions)


class GateServer:
    """Wires a Catalog and an Executor into an MCP server."""

    def __init__(self, settings: Settings, executor: Executor, *, who: str | None = None,
                 tokens: Mapping[str, str] | None = None, default_case: str | None = None,
                 poll_seconds: float = 2.0):
        if tokens is None and not who:
            raise ConfigError("say who the agent is: --as WHO (or CAPGATE_AGENT / config "
                              "`agent`)")
        self.settings = settings
        self.executor = executor
        self.who = who
        self.tokens = dict(tokens) if tokens is not None else None
        self.default_case = default_case
        self.poll_seconds = poll_seconds
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.catalog = Catalog(executor)
        self.bus = InMemorySubscriptionBus()
        self._connections: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        """Each handshake-era connection and the identity it serves (whose tools it lists)."""
        self.server = _Server(
            SERVER_NAME,
            version=_version(),
            instructions=(
                "Declared database operations, one tool per capability row. Each call belongs "
                f"to a case: set request _meta {CASE_META_KEY!r} to your ticket or task id "
                "(else the server's default case is used; the result names it). Results are "
                "status + intent_id + evidence. A gated tool answers approval_required with a "
                "plan_hash: ask a person to run `capgate approve PLAN_HASH`, then call again "
                "with the same arguments. There is no way to run other SQL."),
            lifespan=self._lifespan,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_subscriptions_listen=ListenHandler(self.bus),
        )
        self.server.middleware.append(self._remember_connection)

    # --- handlers --------------------------------------------------------------

    async def _list_tools(self, ctx: ServerRequestContext[Any, Any],
                          params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        await self.refresh()
        who = self.identity(ctx)
        return types.ListToolsResult(tools=[e.tool for e in self.catalog.tools(who).values()])

    async def _call_tool(self, ctx: ServerRequestContext[Any, Any],
                         params: types.CallToolRequestParams) -> types.CallToolResult:
        await self.refresh()
        who = self.identity(ctx)
        entry = self.catalog.tools(who).get(params.name)
        if entry is None:
            hidden = await anyio.to_thread.run_sync(partial(self._why_hidden, who, params.name))
            if hidden is not None:  # a tool this caller knew, refused now: say why, with a code
                shown = self.catalog.shown(who, params.name)
                version = shown.row.version if shown is not None else int(
                    hidden.details.get("version") or 0)
                return result({"status": "refused", "case": self.case(ctx, who),
                               "operation_id": params.name, "version": version,
                               "intent_id": None, "error": hidden.to_dict()}, is_error=True)
            await anyio.to_thread.run_sync(partial(self._record_gap, ctx, who, params))
            raise MCPError(code=types.INVALID_PARAMS,
                           message=f"unknown tool {params.name!r}: no capability row that "
                                   f"{who!r} may call is named so; only declared operations "
                                   "run here (see tools/list)")
        row = entry.row
        case = self.case(ctx, who)
        if row.effect_class is EffectClass.DDL:
            refused = DdlError(f"{row.ref} is a ddl row: stored code changes run through the "
                               "DDL loop, which this MCP server does not drive; nothing was "
                               "executed", operation_id=row.operation_id, version=row.version)
            return result(refusal(row, case, refused), is_error=True)
        arguments = dict(params.arguments or {})
        call = partial(calls.call, self.executor, row.operation_id, arguments, case=case,
                       who=who, version=row.version, via="mcp")
        try:
            outcome = await anyio.to_thread.run_sync(call)
        except CapgateError as exc:
            return result(refusal(row, case, exc), is_error=True)
        except Exception as exc:  # a bug, not a refusal: never claim it did or did not land
            traceback.print_exc(file=sys.stderr)
            bug = internal_error(exc, case, ledger=self.executor.ledger)
            return result({"status": "unknown", "case": case, "operation_id": row.operation_id,
                           "version": row.version, "intent_id": None,
                           "error": bug.to_dict()}, is_error=True)
        return result(outcome.to_dict(), is_error=outcome.status not in (APPLIED, READ_OK))

    def _why_hidden(self, who: str, name: str) -> CapgateError | None:
        """Why a tool ``who`` was shown, or that a reload failed for, is no longer listed.

        The reasons a tool leaves a list after a reload -- a grant withdrawn, a grants
        or capability file that no longer validates, a row the lock no longer pins --
        are each a coded refusal; the caller gets it instead of a bare "unknown tool".
        Nothing is executed: the row is only resolved and its grant checked.
        """
        ex = self.executor
        known = self.catalog.shown(who, name) is not None
        if not (known or name in ex.registry.down or ex.registry.failure is not None
                or ex.grants.failure is not None):
            return None
        try:
            row, connector = ex.resolve(name)
            ex.grants.check_call(who, row, connector.name, connector.environment)
        except UnknownOperation:
            return None  # no such row at all: an unknown tool, as any other name
        except CapgateError as exc:
            return exc
        return None

    def _record_gap(self, ctx: ServerRequestContext[Any, Any], who: str,
                    params: types.CallToolRequestParams) -> None:
        """An unlisted tool is a capability gap to escalate (issue 17): record who asked."""
        from capgate.executor.gaps import record_gap
        from capgate.registry.errors import UnknownOperation

        try:
            case: str | None = self.case(ctx, who)
        except MCPError:
            case = None
        refusal = UnknownOperation(f"no capability row that {who!r} may call is named "
                                   f"{params.name!r}", tool=params.name)
        record_gap(self.executor.ledger, case=case, who=who, operation_id=params.name,
                   version=None, refusal=refusal, inputs=dict(params.arguments or {}),
                   via="mcp")

    async def _remember_connection(self, ctx: ServerRequestContext[Any, Any],
                                   call_next: CallNext) -> HandlerResult:
        # The SDK hands handlers a per-request session proxy; its connection is what a
        # later, unsolicited tools/list_changed must go to (handshake-era clients).
        connection = getattr(ctx.session, "_connection", None)
        if connection is not None and connection not in self._connections:
            with contextlib.suppress(MCPError):  # no identity yet: nothing to tell it
                self._connections[connection] = self.identity(ctx)
        return await call_next(ctx)

    # --- identity and case -------------------------------------------------------

    def identity(self, ctx: ServerRequestContext[Any, Any]) -> str:
        if self.tokens is None:
            assert self.who is not None
            return self.who
        request = ctx.request
        user = request.scope.get("user") if request is not None else None
        if isinstance(user, AuthenticatedUser):
            return str(user.access_token.client_id)
        raise MCPError(code=types.INVALID_REQUEST, message="no authenticated identity")

    def case(self, ctx: ServerRequestContext[Any, Any], who: str) -> str:
        meta = ctx.meta or {}
        value = meta.get(CASE_META_KEY)
        if value is not None:
            problem = name_problem(value)
            if problem is not None:
                raise MCPError(code=types.INVALID_PARAMS,
                               message=f"_meta {CASE_META_KEY!r}: a case id {problem} (a line "
                                       f"of printable text, at most {MAX_CASE_LENGTH} characters)")
            return str(value)
        return self.default_case or f"mcp-{who}-{self.run_id}"

    # --- reload --------------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-read the files if they changed; tell the clients whose tools changed."""
        changed = await anyio.to_thread.run_sync(self.catalog.refresh)
        if changed:
            await self.announce(changed)

    async def announce(self, identities: set[str]) -> None:
        """tools/list_changed to the clients of ``identities``: handshake-era connections
        directly, 2026-era clients through ``subscriptions/listen`` (the bus carries no
        identity, so every listener hears it and re-lists)."""
        await self.bus.publish(ToolsListChanged())
        for connection, who in list(self._connections.items()):
            if who in identities:
                try:
                    await connection.send_tool_list_changed()
                except Exception:  # a connection that went away: nothing to tell
                    self._connections.pop(connection, None)

    async def _watch(self) -> None:
        while True:
            await anyio.sleep(self.poll_seconds)
            try:
                await self.refresh()
            except Exception:  # keep serving; the next poll tries again
                traceback.print_exc(file=sys.stderr)

    @asynccontextmanager
    async def _lifespan(self, _server: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch)
            try:
                yield {}
            finally:
                tg.cancel_scope.cancel()

    def log_exposure(self, identities: Sequence[str]) -> None:
        """Say on stderr how many tools each identity gets, and why rows are hidden."""
        ex = self.executor
        for who in identities:
            seen = exposure(ex.registry, ex.connectors, ex.grants, who,
                            unlocked=ex.rt.unlocked_environments)
            log(seen.line())
            for hidden in seen.hidden:
                log(f"  hidden {hidden.ref}: {hidden.reason}: {hidden.detail}")
            if not seen.usable:
                log(f"  {who!r} gets no tools: run `capgate doctor` to see what to change")

    # --- transports ------------------------------------------------------------------

    async def serve_stdio(self) -> None:
        from mcp.server.stdio import stdio_server

        assert self.who is not None
        self.log_exposure([self.who])
        log(f"serving over stdio; default case "
            f"{self.default_case or f'mcp-{self.who}-{self.run_id}'}")
        async with stdio_server() as (read_stream, write_stream):
            ready("serving over stdio")
            await self.server.run(read_stream, write_stream,
                                  self.server.create_initialization_options())

    async def serve_http(self, endpoint: HttpEndpoint) -> None:
        import uvicorn
        from pydantic import AnyHttpUrl

        from capgate.mcp_http import AuthFailureLog, Limits, guarded_protocol

        assert self.tokens is not None
        host, port, tls = endpoint.host, endpoint.port, endpoint.tls
        shown = f"[{host}]" if ":" in host else host
        base = f"{'https' if tls else 'http'}://{shown}:{port}"
        app = self.server.streamable_http_app(
            host=host,
            auth=AuthSettings(issuer_url=AnyHttpUrl(base), resource_server_url=None),
            token_verifier=TokenIdentities(self.tokens),
        )
        identities = sorted(set(self.tokens.values()))
        self.log_exposure(identities)
        limits = Limits.from_settings(self.settings.mcp)
        log(f"serving streamable HTTP at {base}/mcp for {len(identities)} identit"
            f"{'y' if len(identities) == 1 else 'ies'} ({', '.join(identities)}); at most "
            f"{limits.max_connections} connections, {limits.read_timeout_seconds:g} s to send a "
            f"request, {limits.idle_timeout_seconds:g} s idle")
        config = uvicorn.Config(AuthFailureLog(app, limits.auth_failure_log_seconds, log),
                                host=host, port=port, log_level="warning",
                                lifespan="on", http=guarded_protocol(limits),
                                timeout_keep_alive=int(max(1, limits.idle_timeout_seconds)),
                                ssl_certfile=str(tls.cert) if tls else None,
                                ssl_keyfile=str(tls.key) if tls else None)
        server = uvicorn.Server(config)

        async def say_ready() -> None:
            while not server.started and not server.should_exit:
                await anyio.sleep(0.01)
            if server.started:
                ready(f"listening at {base}/mcp")

        async with anyio.create_task_group() as tg:
            tg.start_soon(say_ready)
            await server.serve()
            tg.cancel_scope.cancel()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("capgate")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0"


def parse_http(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"--http wants HOST:PORT, e.g. 127.0.0.1:8765; got {spec!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Tls:
    """The certificate chain and key the HTTP server presents (PEM files)."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class HttpEndpoint:
    """Where ``--http`` serves: a checked host and port, with TLS beyond loopback."""

    host: str
    port: int
    tls: Tls | None = None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def http_endpoint(spec: str, tls_cert: str | None, tls_key: str | None) -> HttpEndpoint:
    """``--http`` with its TLS files, checked before anything is opened.

    The bearer tokens are the identities: sent in cleartext beyond this machine,
    anyone on the path could take one and call as that agent.  So a host other
    than a loopback one needs TLS (or stays on 127.0.0.1 behind a TLS proxy).
    """
    host, port = parse_http(spec)
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together (the certificate chain and "
                          "its private key, PEM)")
    tls = None
    if tls_cert is not None and tls_key is not None:
        for flag, name in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
            if not Path(name).is_file():
                raise ConfigError(f"{flag} {name}: no such file", path=name)
        from capgate.executor.secretfiles import check_private

        check_private(tls_key, "TLS private key")
        tls = Tls(Path(tls_cert), Path(tls_key))
    if tls is None and not is_loopback(host):
        raise ConfigError(
            f"--http {spec}: serving beyond this machine over plain HTTP would send every "
            "bearer token -- an agent's identity -- in cleartext; bind a loopback address "
            "(127.0.0.1, behind a TLS-terminating proxy for remote clients) or give "
            "--tls-cert FILE --tls-key FILE", host=host)
    return HttpEndpoint(host, port, tls)


def serve(settings: Settings, executor: Executor, *, who: str | None,
          http: HttpEndpoint | None, tokens_path: str | None, default_case: str | None,
          poll_seconds: float) -> None:
    """Run the server until the client hangs up (stdio) or the process is stopped (HTTP)."""
    if http is not None:
        gate = GateServer(settings, executor, tokens=load_tokens(tokens_path),
                          default_case=default_case, poll_seconds=poll_seconds)
        anyio.run(gate.serve_http, http)
        return
    gate = GateServer(settings, executor, who=who, default_case=default_case,
                      poll_seconds=poll_seconds)
    anyio.run(gate.serve_stdio)
