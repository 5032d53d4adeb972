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

Reading is strict and complete: every unknown key (with the known key it most
resembles), every value of the wrong type and every missing ``url`` is
collected with its file and line, and all of them are reported at once -- a
typo found one run at a time, at call time, costs a user an afternoon.

Reading creates nothing.  A command that needs a configuration and finds
none raises :class:`~registry.errors.ConfigMissing` (``require=True``, the
default) instead of quietly running on defaults and leaving a ``.capgate/``
folder wherever it was started.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capgate.executor.connectors import ENVIRONMENTS, ConnectorConfig
from capgate.registry.errors import ConfigError, ConfigMissing

DEFAULT_CONFIG = "capgate.toml"
DEFAULT_LEDGER = "sqlite:///.capgate/ledger.db"
#: The known keys of ``[capgate]``, each with what it takes (for the messages).
TOP_KEYS: dict[str, str] = {
    "capabilities": "a list of capability paths",
    "grants": "the grants file",
    "ledger": "the ledger URL",
    "agent": "the default caller identity",
    "max_request_bytes": "the largest request the MCP server accepts",
    "unlocked_environments": "a list of environments where rows the lock does not pin may "
                             "run (default rig, dev)",
    "production_environments": "a list of environments held to production's rules (default "
                               "prod): an over-privileged account there is a doctor error",
    "approval_ttl_max_seconds": "the longest an approval may live, in seconds (default 86400)",
}
#: The known keys of ``[mcp]``: the HTTP endpoint's limits.
MCP_KEYS: dict[str, str] = {
    "max_connections": "an integer >= 1: concurrent HTTP connections (default 64)",
    "read_timeout_seconds": "a number of seconds > 0: to send a request's headers and "
                            "body (default 10)",
    "idle_timeout_seconds": "a number of seconds > 0: an idle keep-alive connection is "
                            "closed (default 30)",
    "auth_failure_log_seconds": "a number of seconds >= 0: at most one log line per "
                                "interval about failed bearer authentications (default 60)",
}
CONNECTOR_KEYS: dict[str, str] = {
    "url": "the database URL",
    "environment": f"one of {', '.join(ENVIRONMENTS)}",
    "session_budget": "an integer >= 1",
    "db_user_budget": "an integer >= 1",
    "budget_wait_seconds": "a number of seconds >= 0 (a call waits in line for a session)",
    "claim_wait_seconds": "a number of seconds >= 0 (a call waits in line for a target "
                          "another case's call holds)",
    "case_session_budget": "an integer >= 1",
    "case_claim_seconds": "a number of seconds >= 0 (0: a write's claim lasts one call)",
    "statement_timeout": "a number of seconds > 0",
    "connect_timeout": "a number of seconds > 0: how long opening a session may take",
    "network_timeout": "a number of seconds > 0: how long a statement outside a call may "
                       "go unanswered before its connection is cut",
    "simulation_approver_roles": "a list of role names",
    "connect_args": "a table of driver connect() arguments; a secret as { env = \"VAR\" }",
    "thick_mode": "true, or a table (lib_dir, config_dir, driver_name): python-oracledb Thick",
    "current_schema": "Oracle: the schema unqualified names resolve in",
    # simulation first (issue 16)
    "requires_simulation": "true or false: a write here needs simulation evidence "
                           "(default: true on staging and prod)",
    "simulation_max_age_seconds": "a number of seconds > 0: the oldest evidence promoted",
    "promotion_roles": "a list of role names a promoting caller must hold here",
    "production_simulation_approver_roles": "a list of (two) role names",
    "business_timezone": "an IANA time zone (e.g. Europe/Sofia): where the business day ends",
    "venues": "a table of environment -> { url = ..., ... }: this connector's other instances",
}
VENUE_EXCLUDED = ("venues", "environment")
"""Keys a venue table cannot set: its environment is its name, and venues do not nest."""
THICK_KEYS = ("lib_dir", "config_dir", "driver_name")
SECTIONS = ("capgate", "connectors", "mcp")
#: Environment variables that configure capgate without a file.
CONFIG_ENV = ("CAPGATE_CONFIG", "CAPGATE_LEDGER_URL", "CAPGATE_CAPABILITIES", "CAPGATE_GRANTS")
_CONNECTOR_ENV = re.compile(r"^CAPGATE_CONNECTOR_(?P<name>.+)_URL$")


@dataclass(frozen=True)
class Settings:
    """What ``capgate.toml`` and the ``CAPGATE_*`` environment say, checked (``read_settings``)."""

    capabilities: tuple[str, ...] = ("capabilities",)
    """The capability files and folders the registry is loaded from, relative ones resolved
    against the configuration file's folder (``CAPGATE_CAPABILITIES`` overrides)."""
    grants: str | None = None
    """The grants file: which person or agent may read or write which connector in which
    environment.  None: no grants file, so nobody is granted anything."""
    ledger_url: str = DEFAULT_LEDGER
    """Where the ledger lives (SQLAlchemy URL): every case, intent, outcome and DDL plan.  A
    relative SQLite file is resolved against the configuration file's folder."""
    agent: str | None = None
    """The caller identity used when a command names none (``--as``); grants are checked
    against it, and the ledger records it as the one who acted."""
    connectors: Mapping[str, ConnectorConfig] = field(default_factory=dict)
    """Each target database by connector name (venues included, as their own names): its
    URL, environment and session budget -- where the executor sends a row's SQL."""
    max_request_bytes: int = 1_048_576
    """Largest request a call accepts (canonical JSON bytes of its inputs)."""
    source: str = "(defaults)"
    """Where these settings came from, as findings and ``capgate doctor`` name it: the
    file's path, ``(environment)`` or ``(defaults)``."""
    configured: bool = False
    """Whether a file or the environment configured anything (else these are defaults)."""
    unlocked_environments: tuple[str, ...] = ("rig", "dev")
    """Where a row ``capabilities.lock`` does not pin (a draft) may run; everywhere else a
    missing lock or an unpinned row is refused."""
    production_environments: tuple[str, ...] = ("prod",)
    """Environments held to production's rules: ``capgate doctor`` reports an
    over-privileged database account there as an error (a warning elsewhere)."""
    approval_ttl_max_seconds: int = 86_400
    """The longest an approval may live; a longer ``--ttl`` (or row default) is refused."""
    mcp: Mapping[str, float] = field(default_factory=dict)
    """``[mcp]``: the HTTP endpoint's limits (``max_connections``, ``read_timeout_seconds``,
    ``idle_timeout_seconds``, ``auth_failure_log_seconds``); absent keys take defaults."""


@dataclass(frozen=True)
class ConfigProblem:
    """One finding in the configuration, located where possible."""

    source: str
    line: int | None
    key: str
    message: str
    code: str = ConfigError.code

    def render(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        return f"{where}: {self.code}: {self.key}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "line": self.line, "key": self.key,
                "message": self.message, "code": self.code}


def _resolve_sqlite(url: str, base: Path) -> str:
    """A relative database file (SQLite's) resolved against the config's folder (nothing
    created); a server's URL as it is."""
    from sqlalchemy.engine import make_url

    from capgate.executor.dialects import dialect_class

    parsed = make_url(url)
    dialect = dialect_class(parsed)
    database = dialect.database_file(parsed) if dialect is not None else None
    if database:
        db = Path(database).expanduser()
        if not db.is_absolute():
            db = base / db
        return parsed.set(database=str(db)).render_as_string(hide_password=False)
    return url


def _shown(url: str) -> str:
    """A URL as a message may show it, even one that does not parse: no password."""
    from capgate.executor.dialects import safe_url_text

    return safe_url_text(url)


def _suggest(key: str, known: Mapping[str, str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else f" (known: {', '.join(known)})"


class _Lines:
    """Where a key is written in the TOML text: ``[section]`` then ``key =``."""

    _HEADER = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]\s*(#.*)?$")
    _KEY = re.compile(r"^\s*(\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+)\s*=")

    def __init__(self, text: str) -> None:
        self.entries: list[tuple[tuple[str, ...], str | None, int]] = []
        section: tuple[str, ...] = ()
        for number, line in enumerate(text.splitlines(), start=1):
            header = self._HEADER.match(line)
            if header and not line.lstrip().startswith("[["):
                section = tuple(p.strip().strip("\"'") for p in header.group(1).split("."))
                self.entries.append((section, None, number))
                continue
            key = self._KEY.match(line)
            if key:
                self.entries.append((section, key.group(1).strip("\"'"), number))

    def find(self, section: tuple[str, ...], key: str | None = None) -> int | None:
        for where, name, number in self.entries:
            if where == section and name == key:
                return number
        if not section and key is not None:  # a table named by a header: [key] or [key.x]
            for where, name, number in self.entries:
                if name is None and where[:1] == (key,):
                    return number
        if key is not None:  # a key of an inline table, or written as a dotted key
            return self.find(section, None)
        return None


def configured_by_env(env: Mapping[str, str]) -> bool:
    """Whether the environment alone configures capgate (a ledger, paths or a connector)."""
    return any(env.get(k) for k in CONFIG_ENV) or any(
        _CONNECTOR_ENV.match(k) and v for k, v in env.items())


def config_file(path: str | Path | None = None, env: Mapping[str, str] | None = None
                ) -> Path | None:
    """The configuration file in force, or None when there is none to read.

    Raises ConfigError when a file was named (``--config``, ``CAPGATE_CONFIG``)
    and does not exist: a named file that is missing is a mistake, not a default.
    """
    env = os.environ if env is None else env
    chosen = path or env.get("CAPGATE_CONFIG")
    if chosen is not None:
        file = Path(chosen)
        if not file.is_file():
            raise ConfigError(f"{file}: configuration file not found", path=str(file))
        return file
    file = Path(DEFAULT_CONFIG)
    return file if file.is_file() else None


def read_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None
                  ) -> tuple[Settings, list[ConfigProblem]]:
    """The settings and every problem found on the way (the settings skip bad values).

    ``capgate doctor`` and ``capgate validate`` report the problems;
    :func:`load_settings` refuses when there is any.
    """
    env = os.environ if env is None else env
    file = config_file(path, env)
    problems: list[ConfigProblem] = []
    data: dict[str, Any] = {}
    lines = _Lines("")
    source = str(file) if file is not None else "(environment)"
    if file is not None:
        text = file.read_text("utf-8")
        lines = _Lines(text)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            m = re.search(r"line (\d+)", str(exc))
            problems.append(ConfigProblem(source, int(m.group(1)) if m else None, "(syntax)",
                                          str(exc)))
            data = {}
    base = file.resolve().parent if file is not None else Path.cwd()

    def problem(section: tuple[str, ...], key: str | None, message: str,
                code: str = ConfigError.code) -> None:
        name = ".".join((*section, key) if key else section) or "(top)"
        problems.append(ConfigProblem(source, lines.find(section, key), name, message, code))

    for name, value in data.items():
        if name not in SECTIONS:
            problem((), name, f"unknown section [{name}]"
                    + _suggest(name, {s: "" for s in SECTIONS}))
        elif not isinstance(value, dict):
            problem((), name, f"[{name}] must be a table")
    top = data.get("capgate") if isinstance(data.get("capgate"), dict) else {}
    assert isinstance(top, dict)
    for key in top:
        if key not in TOP_KEYS:
            problem(("capgate",), key, "unknown key" + _suggest(key, TOP_KEYS))

    def text_value(key: str) -> str | None:
        value = top.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            problem(("capgate",), key, f"must be a non-empty string ({TOP_KEYS[key]}), "
                                       f"got {value!r}")
            return None
        return value

    caps_raw = env.get("CAPGATE_CAPABILITIES")
    caps: list[str] = ["capabilities"]
    if caps_raw:
        caps = caps_raw.split(os.pathsep)
    elif "capabilities" in top:
        raw = top["capabilities"]
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list) or not raw or not all(
                isinstance(c, str) and c for c in raw):
            problem(("capgate",), "capabilities", "must be a list of paths, got "
                                                  f"{top['capabilities']!r}")
        else:
            caps = list(raw)
    caps = [str(base / c) if not Path(c).is_absolute() and file is not None else c
            for c in caps]
    grants = env.get("CAPGATE_GRANTS") or text_value("grants")
    if grants and not Path(grants).is_absolute():
        grants = str(base / grants)
    ledger = env.get("CAPGATE_LEDGER_URL") or text_value("ledger") or DEFAULT_LEDGER
    try:
        ledger = _resolve_sqlite(ledger, base)
    except Exception:
        problem(("capgate",), "ledger", f"cannot be parsed as a URL: {_shown(ledger)!r} "
                                        "(expected sqlite:///path or postgresql://user@host/db)")
    agent = env.get("CAPGATE_AGENT") or text_value("agent")
    max_bytes = top.get("max_request_bytes", 1_048_576)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        problem(("capgate",), "max_request_bytes",
                f"must be a positive integer of bytes, got {max_bytes!r}")
        max_bytes = 1_048_576

    environment_lists: dict[str, tuple[str, ...]] = {}
    for key, default in (("unlocked_environments", ("rig", "dev")),
                         ("production_environments", ("prod",))):
        raw_list = top.get(key, list(default))
        if not isinstance(raw_list, list) or not all(
                isinstance(e, str) and e in ENVIRONMENTS for e in raw_list):
            problem(("capgate",), key, f"must be a list of environments ({', '.join(ENVIRONMENTS)}"
                                       f"), got {raw_list!r}")
            raw_list = list(default)
        environment_lists[key] = tuple(raw_list)
    ttl_max = top.get("approval_ttl_max_seconds", 86_400)
    if not isinstance(ttl_max, int) or isinstance(ttl_max, bool) or ttl_max < 1:
        problem(("capgate",), "approval_ttl_max_seconds",
                f"must be a positive integer of seconds, got {ttl_max!r}")
        ttl_max = 86_400
    mcp = _mcp_settings(data.get("mcp"), problem)

    connectors: dict[str, ConnectorConfig] = {}
    raw_connectors = data.get("connectors", {})
    if not isinstance(raw_connectors, dict):
        raw_connectors = {}
    names = set(raw_connectors)
    for key, value in env.items():
        m = _CONNECTOR_ENV.match(key)
        if m and value:
            names.add(m.group("name").lower())
    for name in sorted(names):
        section = ("connectors", name)
        spec_raw = raw_connectors.get(name, {})
        if not isinstance(spec_raw, dict):
            problem(section, None, "must be a table")
            continue
        spec = dict(spec_raw)
        for key in sorted(set(spec) - set(CONNECTOR_KEYS)):
            problem(section, key, "unknown key" + _suggest(key, CONNECTOR_KEYS))
        prefix = f"CAPGATE_CONNECTOR_{name.upper()}_"
        for key in ("url", "environment", "session_budget"):
            if env.get(prefix + key.upper()):
                spec[key] = env[prefix + key.upper()]
        venues = spec.pop("venues", {})
        connector = _connector(name, spec, base,
                               lambda k, msg, code=ConfigError.code, s=section:
                               problem(s, k, msg, code))
        if connector is not None:
            connectors[name] = connector
        for venue in _venues(name, spec, venues, base, problem):
            connectors[venue.name] = venue
    _driver_modes(connectors, problem)
    configured = file is not None or configured_by_env(env)
    settings = Settings(capabilities=tuple(caps), grants=grants, ledger_url=ledger, agent=agent,
                        connectors=connectors, max_request_bytes=max_bytes,
                        source=str(file) if file else "(environment)"
                        if configured else "(defaults)", configured=configured,
                        unlocked_environments=environment_lists["unlocked_environments"],
                        production_environments=environment_lists["production_environments"],
                        approval_ttl_max_seconds=ttl_max, mcp=mcp)
    return settings, problems


def _mcp_settings(raw: Any, problem: Any) -> dict[str, float]:
    """``[mcp]``: the HTTP endpoint's limits, checked (absent keys: the server's defaults)."""
    out: dict[str, float] = {}
    if not isinstance(raw, dict):
        return out
    for key, value in raw.items():
        if key not in MCP_KEYS:
            problem(("mcp",), key, "unknown key" + _suggest(key, MCP_KEYS))
            continue
        integer = key == "max_connections"
        ok = isinstance(value, int | float) and not isinstance(value, bool) and (
            (integer and isinstance(value, int) and value >= 1)
            or (not integer and (value > 0 or (key == "auth_failure_log_seconds"
                                               and value == 0))))
        if not ok:
            problem(("mcp",), key, f"must be {MCP_KEYS[key]}, got {value!r}")
            continue
        out[key] = float(value)
    return out


def _connector(name: str, spec: Mapping[str, Any], base: Path,
               problem: Any) -> ConnectorConfig | None:
    """One connector from its table, or None after reporting what is wrong with it."""
    ok = True
    url = spec.get("url")
    if url is None:
        problem(None, "missing `url` (e.g. postgresql://user@host/db, "
                      "mysql://user@host/db for MariaDB, oracle://user@host/?service_name=S, "
                      "sqlite:///file.db)")
        ok = False
    elif not isinstance(url, str) or not url:
        problem("url", f"must be a URL string, got {url!r}")
        ok = False
    environment = spec.get("environment", "dev")
    if environment not in ENVIRONMENTS:
        problem("environment", f"must be one of {', '.join(ENVIRONMENTS)}, got {environment!r}")
        ok = False

    def number(key: str, default: float | None, kind: type, minimum: float,
               strict: bool = False) -> Any:
        nonlocal ok
        value = spec.get(key, default)
        if value is None:
            return None
        try:
            if isinstance(value, bool):
                raise ValueError
            converted = kind(value)
            if kind is int and isinstance(value, float) and value != int(value):
                raise ValueError
        except (TypeError, ValueError):
            problem(key, f"must be {CONNECTOR_KEYS[key]}, got {value!r}")
            ok = False
            return default
        if converted < minimum or (strict and converted == minimum):
            problem(key, f"must be {CONNECTOR_KEYS[key]}, got {value!r}")
            ok = False
        return converted

    roles = spec.get("simulation_approver_roles", [])
    if not isinstance(roles, list) or not all(isinstance(r, str) and r for r in roles):
        problem("simulation_approver_roles", f"must be a list of role names, got {roles!r}")
        ok = False
    simulation = _simulation_settings(spec, problem)
    if simulation is None:
        ok = False
    session_budget = number("session_budget", 6, int, 1)
    db_user_budget = number("db_user_budget", None, int, 1)
    wait = number("budget_wait_seconds", 10.0, float, 0)
    claim_wait = number("claim_wait_seconds", 10.0, float, 0)
    case_budget = number("case_session_budget", None, int, 1)
    case_claims = number("case_claim_seconds", 900.0, float, 0)
    timeout = number("statement_timeout", 30.0, float, 0, strict=True)
    connect_timeout = number("connect_timeout", 5.0, float, 0, strict=True)
    network_timeout = number("network_timeout", 10.0, float, 0, strict=True)
    driver = _driver_settings(spec, url if isinstance(url, str) else None, problem)
    if driver is None:
        ok = False
    if not ok:
        return None
    assert driver is not None
    try:
        resolved = _resolve_sqlite(str(url), base)
    except Exception:
        problem("url", f"cannot be parsed as a URL: {_shown(str(url))!r}")
        return None
    try:
        return ConnectorConfig(name=name, url=resolved, environment=str(environment),
                               session_budget=session_budget, db_user_budget=db_user_budget,
                               budget_wait_seconds=wait, claim_wait_seconds=claim_wait,
                               statement_timeout=timeout,
                               connect_timeout=connect_timeout,
                               network_timeout=network_timeout,
                               case_session_budget=case_budget,
                               case_claim_seconds=case_claims,
                               simulation_approver_roles=tuple(roles), **driver,
                               **(simulation or {}))
    except ConfigError as exc:
        problem(None, exc.message)
        return None


def _simulation_settings(spec: Mapping[str, Any], problem: Any) -> dict[str, Any] | None:
    """The simulation-first keys of a connector (issue 16), checked; None after a problem."""
    ok = True
    out: dict[str, Any] = {}
    if "requires_simulation" in spec:
        if not isinstance(spec["requires_simulation"], bool):
            problem("requires_simulation", f"must be true or false, got "
                                           f"{spec['requires_simulation']!r}")
            ok = False
        else:
            out["requires_simulation"] = spec["requires_simulation"]
    if "simulation_max_age_seconds" in spec:
        age = spec["simulation_max_age_seconds"]
        if isinstance(age, bool) or not isinstance(age, int | float) or age <= 0:
            problem("simulation_max_age_seconds", f"must be a number of seconds > 0, got {age!r}")
            ok = False
        else:
            out["simulation_max_age_seconds"] = float(age)
    for key in ("promotion_roles", "production_simulation_approver_roles"):
        roles = spec.get(key, [])
        if not isinstance(roles, list) or not all(isinstance(r, str) and r for r in roles):
            problem(key, f"must be a list of role names, got {roles!r}")
            ok = False
        else:
            out[key] = tuple(roles)
    import zoneinfo

    zone = spec.get("business_timezone", "UTC")
    try:
        if not isinstance(zone, str) or not zone:
            raise ValueError
        zoneinfo.ZoneInfo(zone)
        out["business_timezone"] = zone
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        problem("business_timezone", f"must be an IANA time zone such as Europe/Sofia, got "
                                     f"{zone!r}")
        ok = False
    return out if ok else None


def _venues(name: str, spec: Mapping[str, Any], venues: Any, base: Path,
            problem: Any) -> list[ConnectorConfig]:
    """``[connectors.NAME.venues.ENV]``: the logical connector's instance in each environment.

    Each venue is connector ``NAME@ENV`` (its own database: ``url``), taking the
    connector's other settings unless it sets them itself; rows that name
    ``NAME`` run there when a call or simulation asks for venue ``ENV``.
    """
    if not isinstance(venues, dict):
        problem(("connectors", name), "venues", f"must be a table of environments, got "
                                                f"{venues!r}")
        return []
    out: list[ConnectorConfig] = []
    own = spec.get("environment", "dev")
    for environment, raw in sorted(venues.items()):
        section = ("connectors", name, "venues", environment)
        if environment not in ENVIRONMENTS:
            problem(section, None, f"a venue is an environment, one of {', '.join(ENVIRONMENTS)}"
                                   f"; got {environment!r}")
            continue
        if environment == own:
            problem(section, None, f"the connector itself is the {environment} venue")
            continue
        if not isinstance(raw, dict):
            problem(section, None, "must be a table")
            continue
        for key in sorted(set(raw) - set(CONNECTOR_KEYS) | (set(raw) & set(VENUE_EXCLUDED))):
            problem(section, key, "not a venue setting" if key in VENUE_EXCLUDED
                    else "unknown key" + _suggest(key, CONNECTOR_KEYS))
        merged = {k: v for k, v in spec.items() if k not in ("url",)}
        merged.update({k: v for k, v in raw.items() if k not in VENUE_EXCLUDED})
        merged["environment"] = environment
        venue = _connector(f"{name}@{environment}", merged, base,
                           lambda k, msg, code=ConfigError.code, s=section:
                           problem(s, k, msg, code))
        if venue is not None:
            out.append(ConnectorConfig(**{**venue.__dict__, "logical": name}))
    return out


def _driver_settings(spec: Mapping[str, Any], url: str | None,
                     problem: Any) -> dict[str, Any] | None:
    """``connect_args``, ``thick_mode`` and ``current_schema``, checked; None after a problem.

    No secret in a URL (it is printed and named in plans) nor written in the file:
    a secret ``connect_args`` value is ``{ env = "VARIABLE" }``, read when the
    connector opens.  ``thick_mode`` and ``current_schema`` are Oracle's.
    """
    from sqlalchemy.engine import make_url

    from capgate.executor.connectors import secret_query_keys
    from capgate.executor.dialects import SECRET_KEY, dialect_class, dialect_classes
    from capgate.registry.errors import SecretInUrl

    ok = True
    backend = None
    takes: frozenset[str] = frozenset()
    if url:
        try:
            backend = make_url(url).get_backend_name()
            found = dialect_class(backend)
            takes = found.connector_settings if found is not None else frozenset()
            secrets = secret_query_keys(url)
        except Exception:
            secrets = []
        if secrets:
            problem("url", f"carries the secret {', '.join(secrets)} in its query string "
                           "(a URL is printed and named in plans): move it to connect_args as "
                           f'{secrets[0]} = {{ env = "VARIABLE" }}', SecretInUrl.code)
            ok = False
    raw_args = spec.get("connect_args", {})
    args: dict[str, Any] = {}
    if not isinstance(raw_args, dict):
        problem("connect_args", f"must be a table, got {raw_args!r}")
        ok = False
        raw_args = {}
    for key, value in raw_args.items():
        if isinstance(value, dict):
            if set(value) != {"env"} or not isinstance(value["env"], str) or not value["env"]:
                problem("connect_args", f"{key}: a table value must be {{ env = \"VARIABLE\" }}, "
                                        f"got {value!r}")
                ok = False
                continue
            args[key] = {"env": value["env"]}
        elif isinstance(value, str | int | float | bool):
            if SECRET_KEY.search(key):
                problem("connect_args", f"{key} is a secret written in the file: name the "
                                        f'environment variable that holds it, {key} = '
                                        '{ env = "VARIABLE" }', SecretInUrl.code)
                ok = False
                continue
            args[key] = value
        else:
            problem("connect_args", f"{key}: must be a string, number, boolean or "
                                    f'{{ env = "VARIABLE" }}, got {value!r}')
            ok = False
    thick = spec.get("thick_mode", False)
    if isinstance(thick, dict):
        unknown = sorted(set(thick) - set(THICK_KEYS))
        if unknown or not all(isinstance(v, str) for v in thick.values()):
            problem("thick_mode", f"a table takes {', '.join(THICK_KEYS)} (strings), "
                                  f"got {thick!r}")
            ok = False
    elif not isinstance(thick, bool):
        problem("thick_mode", f"must be true, false or a table, got {thick!r}")
        ok = False
    schema = spec.get("current_schema")
    if schema is not None and (not isinstance(schema, str) or not schema):
        problem("current_schema", f"must be a schema name, got {schema!r}")
        ok = False
    for key, given in (("thick_mode", bool(thick)), ("current_schema", schema is not None)):
        if given and backend is not None and key not in takes:
            owners = " or ".join(c.title for c in dialect_classes() if key in c.connector_settings)
            problem(key, f"is an {owners} setting; this connector's URL is {backend}")
            ok = False
    if not ok:
        return None
    return {"connect_args": args, "thick_mode": dict(thick) if isinstance(thick, dict)
            else bool(thick), "current_schema": schema}


def _driver_modes(connectors: Mapping[str, ConnectorConfig], problem: Any) -> None:
    """Every Oracle connector of one configuration asks for the same python-oracledb mode."""
    from capgate.executor.dialects import dialect_class
    from capgate.registry.errors import DriverModeConflict

    def takes_driver_mode(url: str) -> bool:
        from sqlalchemy.exc import ArgumentError

        try:
            found = dialect_class(url)
        except ArgumentError:  # an unparseable URL is reported on its own
            return False
        return found is not None and "thick_mode" in found.connector_settings

    modes = {name: c.thick_mode for name, c in connectors.items()
             if takes_driver_mode(c.url)}
    kinds = {repr(bool(m)) + repr(sorted(m.items()) if isinstance(m, Mapping) else "")
             for m in modes.values()}
    if len(kinds) > 1:
        thick = sorted(n for n, m in modes.items() if m)
        thin = sorted(n for n, m in modes.items() if not m)
        problem(("connectors", (thick or thin)[0]), "thick_mode",
                f"python-oracledb runs Thin or Thick for the whole process: Thick for "
                f"{', '.join(thick) or 'none'}, Thin for {', '.join(thin) or 'none'} "
                "(or different Oracle Client settings); give every Oracle connector the "
                "same thick_mode", DriverModeConflict.code)


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None, *,
                  require: bool = True) -> Settings:
    """Read the config file (if any) and apply environment overrides.

    Raises ConfigError listing every problem, and -- with ``require`` --
    ConfigMissing when neither a file nor the environment configures anything.
    """
    env = os.environ if env is None else env
    settings, problems = read_settings(path, env)
    if problems:
        raise config_error(problems)
    if require and not settings.configured:
        raise ConfigMissing(
            f"no configuration: no {DEFAULT_CONFIG} in {Path.cwd()}, no --config, no "
            "CAPGATE_CONFIG and no CAPGATE_LEDGER_URL / CAPGATE_CONNECTOR_<NAME>_URL; run "
            "`capgate init DIR` to create a working project (then `cd DIR`), or pass "
            "--config FILE; nothing was created", cwd=str(Path.cwd()))
    return settings


def config_error(problems: list[ConfigProblem]) -> ConfigError:
    """One ConfigError that lists every problem, one per line."""
    first = problems[0]
    if len(problems) == 1:
        return ConfigError(first.render(), problems=[p.to_dict() for p in problems])
    text = "\n".join("  " + p.render() for p in problems)
    return ConfigError(f"{len(problems)} problems in the configuration:\n{text}",
                       problems=[p.to_dict() for p in problems])
