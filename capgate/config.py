"""``capgate.toml``: connectors, the ledger, grants and capability paths.

Environment variables override the file, so CI and containers need no file
edits: ``CAPGATE_CONFIG`` (the file), ``CAPGATE_LEDGER_URL``,
``CAPGATE_GRANTS``, ``CAPGATE_CAPABILITIES`` (``:``-separated paths),
``CAPGATE_AGENT`` (the default caller identity), and per connector
``CAPGATE_CONNECTOR_<NAME>_URL`` / ``_ENVIRONMENT`` / ``_SESSION_BUDGET``.
Relative paths (and relative SQLite files) resolve against the config file's
directory.  Example::

    [capgate]
    capabilities = ["capabilities"]
    grants = "grants.toml"
    ledger = "sqlite:///.capgate/ledger.db"

    [connectors.insurance]
    url = "postgresql://app@db.internal/insurance"
    environment = "prod"
    session_budget = 6
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from executor.connectors import ConnectorConfig
from registry.errors import ConfigError

DEFAULT_CONFIG = "capgate.toml"
DEFAULT_LEDGER = "sqlite:///.capgate/ledger.db"
_TOP_KEYS = {"capabilities", "grants", "ledger", "agent", "max_request_bytes"}
_CONNECTOR_KEYS = {"url", "environment", "session_budget", "db_user_budget",
                   "budget_wait_seconds", "statement_timeout", "simulation_approver_roles"}


@dataclass(frozen=True)
class Settings:
    capabilities: tuple[str, ...] = ("capabilities",)
    grants: str | None = None
    ledger_url: str = DEFAULT_LEDGER
    agent: str | None = None
    connectors: Mapping[str, ConnectorConfig] = field(default_factory=dict)
    max_request_bytes: int = 1_048_576
    """Largest request a call accepts (canonical JSON bytes of its inputs)."""
    source: str = "(defaults)"


def _resolve_sqlite(url: str, base: Path) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        db = Path(parsed.database)
        if not db.is_absolute():
            db = base / db
        db.parent.mkdir(parents=True, exist_ok=True)
        return parsed.set(database=str(db)).render_as_string(hide_password=False)
    return url


def _roles(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: simulation_approver_roles must be a list of role names")
    return tuple(value)


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None
                  ) -> Settings:
    """Read the config file (if any) and apply environment overrides."""
    env = os.environ if env is None else env
    chosen = path or env.get("CAPGATE_CONFIG")
    data: dict[str, Any] = {}
    if chosen is not None:
        file = Path(chosen)
        if not file.exists():
            raise ConfigError(f"{file}: configuration file not found")
    else:
        file = Path(DEFAULT_CONFIG)
    if file.exists():
        try:
            data = tomllib.loads(file.read_text("utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: {exc}") from None
    base = file.resolve().parent if file.exists() else Path.cwd()
    source = str(file) if file.exists() else "(defaults)"

    top = data.get("capgate", {})
    unknown = set(top) - _TOP_KEYS
    unknown_sections = set(data) - {"capgate", "connectors"}
    if unknown or unknown_sections:
        bad = sorted(unknown | {f"[{s}]" for s in unknown_sections})
        raise ConfigError(f"{source}: unknown key(s): {', '.join(bad)}")

    caps_raw = env.get("CAPGATE_CAPABILITIES")
    caps = caps_raw.split(os.pathsep) if caps_raw else list(top.get("capabilities",
                                                                     ["capabilities"]))
    caps = [str(base / c) if not Path(c).is_absolute() and file.exists() else c for c in caps]
    grants = env.get("CAPGATE_GRANTS") or top.get("grants")
    if grants and not Path(grants).is_absolute():
        grants = str(base / grants)
    ledger = env.get("CAPGATE_LEDGER_URL") or top.get("ledger") or DEFAULT_LEDGER
    ledger = _resolve_sqlite(ledger, base)

    connectors: dict[str, ConnectorConfig] = {}
    raw_connectors = data.get("connectors", {})
    names = set(raw_connectors)
    for key in env:
        if key.startswith("CAPGATE_CONNECTOR_") and key.endswith("_URL"):
            names.add(key[len("CAPGATE_CONNECTOR_"):-len("_URL")].lower())
    for name in sorted(names):
        spec = dict(raw_connectors.get(name, {}))
        extra = set(spec) - _CONNECTOR_KEYS
        if extra:
            raise ConfigError(f"{source}: connectors.{name}: unknown key(s) "
                              f"{', '.join(sorted(extra))}")
        prefix = f"CAPGATE_CONNECTOR_{name.upper()}_"
        for key in ("url", "environment", "session_budget"):
            if prefix + key.upper() in env:
                spec[key] = env[prefix + key.upper()]
        if "url" not in spec:
            raise ConfigError(f"{source}: connectors.{name}: missing `url`")
        try:
            connectors[name] = ConnectorConfig(
                name=name,
                url=_resolve_sqlite(str(spec["url"]), base),
                environment=str(spec.get("environment", "dev")),
                session_budget=int(spec.get("session_budget", 6)),
                db_user_budget=(int(spec["db_user_budget"])
                                if spec.get("db_user_budget") is not None else None),
                budget_wait_seconds=float(spec.get("budget_wait_seconds", 0.0)),
                statement_timeout=float(spec.get("statement_timeout", 30.0)),
                simulation_approver_roles=_roles(spec.get("simulation_approver_roles", []),
                                                 f"{source}: connectors.{name}"),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: connectors.{name}: {exc}") from None
    max_bytes = top.get("max_request_bytes", 1_048_576)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ConfigError(f"{source}: max_request_bytes must be a positive integer of bytes")
    return Settings(capabilities=tuple(caps), grants=grants, ledger_url=ledger,
                    max_request_bytes=max_bytes,
                    agent=env.get("CAPGATE_AGENT") or top.get("agent"),
                    connectors=connectors, source=source)
