"""``capgate doctor``: is this configuration able to do what its rows declare?

Registering a connector does not establish live access.  The doctor checks,
in order, and reports every finding at once:

1. the configuration: every key (unknown keys are errors, with the key they
   most resemble), every value, the files it names;
2. the grants: connectors and environments that do not exist, roles that no
   row accepts;
3. the capability files (every problem, as ``validate`` reports them), rows
   whose connector is not configured, and what each identity gets (the MCP
   tool count, and why rows are hidden);
4. per connector, live: reachable; the server's identity; the environment
   label; capgate's tables; the privileges the declared rows need (read,
   write, ending a session, DDL capture and apply); session limits against
   ``session_budget``; ``plpgsql_check`` where DDL rows run on PostgreSQL; on
   Oracle whether the service records commit outcomes (Transaction Guard).

Each finding has a severity (``error``, ``warning``, ``ok``) and a code --
the ``CapgateError`` code of the refusal the problem would cause, which
``capgate explain`` describes, or ``OK``.  Exit 1 when there is an error.

The live probes are read-only catalog queries, each dialect's own
(``Dialect.describe_server`` and ``Dialect.diagnose`` in ``executor/dialects``),
reported through :class:`ConnectorDiagnosis`.  The Oracle probes follow Oracle's
documented views (``ALL_SERVICES.COMMIT_OUTCOME``, ``USER_RESOURCE_LIMITS``,
``SESSION_PRIVS``, ``ALL_TAB_PRIVS``, ``GV$SESSION``, ``DBA_2PC_PENDING``) and
report the driver's version and mode and whether the session has an LTXID; they
run only where an Oracle answers (``tests/test_executor.py``), and every
query parses with sqlglot's Oracle dialect (``tests/test_oracle_offline.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ERROR, WARNING, OK = "error", "warning", "ok"


@dataclass(frozen=True)
class Finding:
    severity: str
    code: str
    subject: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "subject": self.subject,
                "message": self.message, "details": dict(self.details)}

    def render(self) -> str:
        mark = {ERROR: "ERROR", WARNING: "warn ", OK: "ok   "}[self.severity]
        return f"{mark} {self.code:<5} {self.subject}: {self.message}"


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    def add(self, severity: str, code: str, subject: str, message: str, **details: Any) -> None:
        self.findings.append(Finding(severity, code, subject, message, details))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "errors": len(self.errors),
                "warnings": sum(1 for f in self.findings if f.severity == WARNING),
                "findings": [f.to_dict() for f in self.findings]}

    def text(self) -> str:
        lines = [f.render() for f in self.findings]
        warnings = sum(1 for f in self.findings if f.severity == WARNING)
        lines.append(("ok" if self.ok else "FAILED") + f": {len(self.errors)} error(s), "
                     f"{warnings} warning(s) in {len(self.findings)} check(s)")
        return "\n".join(lines)


# --- what the rows need ----------------------------------------------------------------


@dataclass
class Needs:
    """What the rows of one connector need from its account."""

    privileges: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """(table, SELECT|INSERT|UPDATE|DELETE) -> the rows that need it."""
    ddl_rows: list[str] = field(default_factory=list)
    leased_rows: list[str] = field(default_factory=list)
    writes: bool = False

    def need(self, table: str, privilege: str, ref: str) -> None:
        self.privileges.setdefault((table.lower(), privilege), set()).add(ref)


def _tables(sql: str) -> tuple[str | None, str | None, set[str]]:
    """(write kind, its target table, every table named) of one statement, via sqlglot."""
    import sqlglot
    from sqlglot import exp

    from capgate.registry.dialect_checks import GRAMMARS

    kind: str | None = None
    target: str | None = None
    names: set[str] = set()
    for dialect in (None, *(grammar.sqlglot for grammar in GRAMMARS.values())):
        try:
            trees = [t for t in sqlglot.parse(sql, read=dialect) if t is not None]
        except sqlglot.errors.SqlglotError:
            continue
        for tree in trees:
            ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
            for table in tree.find_all(exp.Table):
                if table.name and table.name.lower() not in ctes:
                    names.add(table.name.lower())
            for node_type, word in ((exp.Insert, "INSERT"), (exp.Update, "UPDATE"),
                                    (exp.Delete, "DELETE")):
                if isinstance(tree, node_type):
                    kind = word
                    found = tree.find(exp.Table)
                    target = found.name.lower() if found is not None else None
        return kind, target, names
    return None, None, set()


def needs_of(rows: Iterable[Any]) -> dict[str, Needs]:
    """connector -> what its rows need (tables per privilege, DDL rows)."""
    out: dict[str, Needs] = {}
    for row in rows:
        needs = out.setdefault(row.connector, Needs())
        if str(row.effect_class) == "ddl":
            needs.ddl_rows.append(row.ref)
            continue
        if str(row.shape) == "leased":
            needs.leased_rows.append(row.ref)
        writing = [s.sql for s in row.statements] if row.is_write else []
        writing += [s.sql for s in row.compensation]
        writing += [s.sql for s in row.steps if s.sql]
        reading = [] if row.is_write else [s.sql for s in row.statements]
        reading += [c.sql for c in (*row.verify, *row.post_commit)]
        reading += [s.check for s in row.steps if s.check]
        reading += [q.sql for q in (row.replay, row.landed_probe) if q is not None]
        for sql in writing:
            kind, target, names = _tables(sql)
            if kind and target:
                needs.need(target, kind, row.ref)
                needs.writes = True
                names.discard(target)
            for name in names:
                needs.need(name, "SELECT", row.ref)
        for sql in reading:
            for name in _tables(sql)[2]:
                needs.need(name, "SELECT", row.ref)
    return out


# --- the checks --------------------------------------------------------------------------


def run_doctor(config: str | Path | None = None, env: Mapping[str, str] | None = None, *,
               live: bool = True) -> Report:
    """Every check; ``live=False`` skips the connections (configuration and files only)."""
    from capgate.config import read_settings
    from capgate.registry.errors import CapgateError, ConfigMissing

    report = Report()
    env = os.environ if env is None else env
    try:
        settings, problems = read_settings(config, env)
    except CapgateError as exc:
        report.add(ERROR, exc.code, "configuration", exc.message)
        return report
    if not settings.configured:
        report.add(ERROR, ConfigMissing.code, "configuration",
                   f"no capgate.toml in {Path.cwd()} and no configuration in the environment; "
                   "`capgate init DIR` makes one")
        return report
    for p in problems:
        report.add(ERROR, p.code, f"configuration {p.source}" + (f":{p.line}" if p.line else ""),
                   f"{p.key}: {p.message}")
    if not problems:
        report.add(OK, "OK", "configuration", f"{settings.source}: every key known, "
                   f"{len(settings.connectors)} connector(s)")
    grants = _check_grants(report, settings)
    registry = _check_capabilities(report, settings)
    if registry is not None and grants is not None:
        _check_identities(report, settings, registry, grants)
    if live:
        needs = needs_of(registry.rows(include_retired=False)) if registry is not None else {}
        production = frozenset(settings.production_environments)
        for name, connector in sorted(settings.connectors.items()):
            _check_connector(report, connector, needs.get(name, Needs()), production)
    return report


def _check_grants(report: Report, settings: Any) -> Any:
    from capgate.executor.connectors import ENVIRONMENTS
    from capgate.executor.grants import Grants
    from capgate.registry.errors import CapgateError, GrantUnknownConnector

    if not settings.grants:
        report.add(WARNING, "CG902", "grants", "no grants file configured: nobody may call "
                   "anything (set [capgate] grants)")
        return Grants()
    try:
        grants = Grants.load(settings.grants)
    except CapgateError as exc:
        report.add(ERROR, exc.code, "grants", exc.message)
        return None
    bad = 0
    for who, principal in sorted(grants.principals.items()):
        for grant in principal.grants:
            if grant.connector != "*" and grant.connector not in settings.connectors:
                bad += 1
                close = _close(grant.connector, settings.connectors)
                report.add(ERROR, GrantUnknownConnector.code, f"grants {settings.grants}",
                           f"{who}: a grant names connector {grant.connector!r}, which is not "
                           f"configured{close}", principal=who, connector=grant.connector)
            for environment in grant.environments:
                if environment not in ENVIRONMENTS:
                    bad += 1
                    report.add(ERROR, "CG902", f"grants {settings.grants}",
                               f"{who}: environment {environment!r} is not one of "
                               f"{', '.join(ENVIRONMENTS)}", principal=who)
    if not bad:
        report.add(OK, "OK", "grants", f"{settings.grants}: {len(grants.principals)} "
                   "principal(s), every connector and environment known")
    return grants


def _close(word: str, choices: Iterable[str]) -> str:
    import difflib

    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {found[0]!r}?)" if found else ""


def _check_pins(report: Report, result: Any) -> None:
    """Which rows ``capabilities.lock`` pins: only a pinned row is immutable.

    Without a lock a row edited in place (its gate removed, its SQL changed)
    takes effect at once with nothing to review; with one, a row it does not pin
    is a draft.  A warning, not an error: drafts are how a new version starts.
    """
    from capgate.registry.errors import RowsNotPinned
    from capgate.registry.lock import read_lock

    lock_path = result.lock_path
    if lock_path is None:
        return
    if not lock_path.exists():
        report.add(WARNING, RowsNotPinned.code, "capabilities",
                   f"no {lock_path.name} at {lock_path}: none of the {len(result.rows)} "
                   "row(s) is pinned, so a row edited in place (its gate, its SQL) takes "
                   "effect at once with no new version and nothing to review; review the "
                   "rows, then `capgate lock`", lock=str(lock_path), unpinned=len(result.rows))
        return
    locked = read_lock(lock_path)  # (validated above: readable, and no pin broken)
    drafts = sorted(r.ref for r in result.rows if r.key not in locked and not r.retired)
    if drafts:
        report.add(WARNING, RowsNotPinned.code, "capabilities",
                   f"{len(drafts)} row(s) not pinned in {lock_path} yet: "
                   f"{', '.join(drafts)}; drafts until reviewed (`capgate diff`), then "
                   "`capgate lock`", lock=str(lock_path), rows=drafts)
    else:
        report.add(OK, "OK", "capabilities", f"every row is pinned in {lock_path}")


def _check_capabilities(report: Report, settings: Any) -> Any:
    from capgate.registry.errors import CapgateError, GrantUnknownRole, UnknownConnector
    from capgate.registry.loader import validate_paths
    from capgate.registry.registry import Registry

    try:
        result = validate_paths(settings.capabilities)
    except CapgateError as exc:
        report.add(ERROR, exc.code, "capabilities", exc.message)
        return None
    for p in result.problems:
        report.add(ERROR, p.code, f"capabilities {p.path}:{p.line}:{p.col}",
                   f"{p.field}: {p.message}")
    if result.problems:
        return None
    registry = Registry(result.rows)
    report.add(OK, "OK", "capabilities", f"{len(result.rows)} row(s) in "
               f"{len(result.files)} file(s), all valid")
    _check_pins(report, result)
    missing: dict[str, list[str]] = {}
    for row in registry.current_rows():
        if row.connector not in settings.connectors:
            missing.setdefault(row.connector, []).append(row.ref)
    for connector, refs in sorted(missing.items()):
        report.add(ERROR, UnknownConnector.code, "capabilities",
                   f"{len(refs)} row(s) name connector {connector!r}, which is not configured "
                   f"(add [connectors.{connector}]): {', '.join(refs)}",
                   connector=connector, rows=refs)
    accepted = {role for r in registry.rows() for role in r.authorization.approver_roles}
    accepted |= {role for c in settings.connectors.values()  # issue 16: connector roles
                 for role in (*c.simulation_approver_roles, *c.promotion_roles,
                              *c.production_simulation_approver_roles)}
    if settings.grants:
        from capgate.executor.grants import Grants

        try:
            grants = Grants.load(settings.grants)
        except CapgateError:
            return registry
        for who, principal in sorted(grants.principals.items()):
            for role in principal.role_names:
                if role not in accepted:
                    report.add(WARNING, GrantUnknownRole.code, f"grants {settings.grants}",
                               f"{who} holds role {role!r}, which no row accepts as an "
                               f"approver role{_close(role, accepted)}; it can approve nothing",
                               principal=who, role=role)
    return registry


def _check_identities(report: Report, settings: Any, registry: Any, grants: Any) -> None:
    from capgate.executor.connectors import Connectors
    from capgate.exposure import ENVIRONMENT, exposure
    from capgate.registry.errors import EnvironmentMismatch

    connectors = Connectors(dict(settings.connectors))
    identities = sorted({settings.agent} - {None} | {
        who for who, p in grants.principals.items() if p.grants})
    for who in identities:
        seen = exposure(registry, connectors, grants, who)
        mismatch = [h for h in seen.hidden if h.reason == ENVIRONMENT]
        severity = OK if seen.usable else ERROR
        code = "OK" if seen.usable else EnvironmentMismatch.code
        report.add(severity, code, f"identity {who}", seen.line()
                   + ("" if seen.usable else ": an MCP server for it lists no tools"),
                   **seen.to_dict())
        if mismatch and seen.usable:
            report.add(WARNING, EnvironmentMismatch.code, f"identity {who}",
                       f"{len(mismatch)} row(s) hidden by environment labels: "
                       + "; ".join(f"{h.ref} ({h.detail})" for h in mismatch[:3])
                       + (" ..." if len(mismatch) > 3 else ""))


# --- live checks --------------------------------------------------------------------------


def _check_connector(report: Report, config: Any, needs: Needs,
                     production: frozenset[str] = frozenset({"prod"})) -> None:
    import sqlalchemy as sa

    from capgate.executor.dialects import dialect_for, normalise_url
    from capgate.executor.target import first_line, table_states
    from capgate.registry.errors import (
        ConnectorUnavailable,
        TargetNotInstalled,
        TargetPrivilegeMissing,
    )

    subject = f"connector {config.name}"
    url = normalise_url(config.url)
    dialect = dialect_for(url)
    database = dialect.database_file(url)
    if database and not Path(database).exists():
        report.add(ERROR, ConnectorUnavailable.code, subject,
                   f"the {dialect.title} file {database} does not exist")
        return
    from capgate.executor.connectors import connector_engine
    from capgate.registry.errors import CapgateError

    try:
        engine = connector_engine(config, dialect, poolclass=sa.pool.NullPool)
    except CapgateError as exc:  # a driver too old, a secret's variable unset, a mode clash
        report.add(ERROR, exc.code, subject, exc.message)
        return
    try:
        with engine.connect() as conn:
            identity = dialect.describe_server(conn)
            report.add(OK, "OK", subject, f"reachable ({config.safe_url}); server: {identity}; "
                       f"environment label {config.environment!r}")
            if needs.ddl_rows and not (needs.writes or needs.privileges or needs.leased_rows):
                # the DDL loop keeps its records in the ledger: no landing marker, no fence
                report.add(OK, "OK", subject, "capgate's tables are not needed: the "
                           "connector's rows are DDL rows only")
                states = []
            else:
                states = table_states(conn, dialect)
            for s in states:
                if s.state == "missing":
                    report.add(ERROR, TargetNotInstalled.code, subject,
                               f"capgate's table {s.table} is missing: `capgate target install "
                               f"{config.name}` (or `--sql` for a DBA)")
                elif s.state == "no_privilege":
                    report.add(ERROR, TargetPrivilegeMissing.code, subject,
                               f"the account may not use {s.table}: grant what `capgate target "
                               f"install {config.name} --sql --grant-to USER` prints")
            if states and all(s.state == "ok" for s in states):
                report.add(OK, "OK", subject, "capgate's tables are installed and usable")
            dialect.diagnose(conn, ConnectorDiagnosis(report, subject, config, needs))
            conn.rollback()
            _check_least_privilege(report, subject, config, dialect, conn, production)
    except sa.exc.DBAPIError as exc:
        report.add(ERROR, ConnectorUnavailable.code, subject,
                   f"unreachable ({config.safe_url}): {first_line(exc)}")
    finally:
        engine.dispose()


def _check_least_privilege(report: Report, subject: str, config: Any, dialect: Any,
                           conn: Any, production: frozenset[str]) -> None:
    """Least privilege: an account that holds more than rows could need (a superuser,
    server files, other sessions, grant option, ``ANY`` privileges) is a warning in
    development and an error where ``production_environments`` names the environment."""
    import sqlalchemy as sa

    from capgate.executor.target import first_line
    from capgate.registry.errors import ExcessPrivilege

    try:
        excess = dialect.excess_privileges(conn)
    except sa.exc.DBAPIError as exc:  # the catalog is not readable: say so, do not guess
        conn.rollback()
        report.add(WARNING, ExcessPrivilege.code, subject,
                   f"could not read the account's privileges: {first_line(exc)}")
        return
    finally:
        conn.rollback()
    if excess is None:  # no accounts on this engine (SQLite): file permissions decide
        return
    if not excess:
        report.add(OK, "OK", subject, "the account holds no privilege beyond tables "
                   "(no superuser, server files, other sessions or grant option)")
        return
    severe = config.environment in production
    report.add(ERROR if severe else WARNING, ExcessPrivilege.code, subject,
               f"the account holds more than capgate's rows need ({config.environment!r} "
               f"{'is' if severe else 'is not'} a production environment): "
               + "; ".join(excess) + "; give the connector an account with only the table "
               "privileges the rows need", privileges=excess, environment=config.environment,
               production=severe)


@dataclass
class ConnectorDiagnosis:
    """The doctor's side of ``executor.dialects.base.Diagnosis``: one connector's findings.

    A dialect's ``diagnose`` asks its own catalog and reports here; the severity,
    the subject and the comparison with the connector's budgets are the doctor's.
    """

    report: Report
    subject: str
    config: Any
    needs: Needs

    @property
    def writes(self) -> bool:
        return self.needs.writes

    @property
    def ddl_rows(self) -> list[str]:
        return self.needs.ddl_rows

    @property
    def leased_rows(self) -> list[str]:
        return self.needs.leased_rows

    def ok(self, message: str, **details: Any) -> None:
        self.report.add(OK, "OK", self.subject, message, **details)

    def warning(self, code: str, message: str, **details: Any) -> None:
        self.report.add(WARNING, code, self.subject, message, **details)

    def error(self, code: str, message: str, **details: Any) -> None:
        self.report.add(ERROR, code, self.subject, message, **details)

    def privileges(self, has: Callable[[str, str], bool | None]) -> None:
        _privilege_findings(self.report, self.subject, self.needs, has)

    def session_limit(self, limit: int | None, what: str, reserve: int = 0) -> None:
        _budget_finding(self.report, self.subject, self.config, limit, what, reserve)


def _privilege_findings(report: Report, subject: str, needs: Needs,
                        has: Callable[[str, str], bool | None]) -> None:
    """One finding per missing (table, privilege); ``has`` answers None for no such table."""
    from capgate.registry.errors import PrivilegeMissing

    missing = 0
    for (table, privilege), refs in sorted(needs.privileges.items()):
        answer = has(table, privilege)
        if answer is None:
            missing += 1
            report.add(ERROR, PrivilegeMissing.code, subject,
                       f"table {table} (needed by {', '.join(sorted(refs))}) does not exist or "
                       "is not visible to the account", table=table, rows=sorted(refs))
        elif not answer:
            missing += 1
            report.add(ERROR, PrivilegeMissing.code, subject,
                       f"the account lacks {privilege} on {table}, needed by "
                       f"{', '.join(sorted(refs))}", table=table, privilege=privilege,
                       rows=sorted(refs))
    if needs.privileges and not missing:
        tables = {t for t, _ in needs.privileges}
        report.add(OK, "OK", subject, f"the account holds the {len(needs.privileges)} "
                   f"privilege(s) the rows need on {len(tables)} table(s)")


def _budget_finding(report: Report, subject: str, config: Any, limit: int | None,
                    what: str, reserve: int = 0) -> None:
    """``reserve``: sessions beyond the budget the database must still allow (resume's
    evidence sessions, which no budget refuses: recovery is never blocked by it)."""
    from capgate.registry.errors import SessionLimitTooLow

    if limit is None or limit < 0:
        return
    budget = config.db_user_budget or config.session_budget
    if budget + reserve > limit:
        report.add(ERROR, SessionLimitTooLow.code, subject,
                   f"{what} allows {limit} session(s) but session_budget is "
                   f"{config.session_budget}" + (f" (db_user_budget {config.db_user_budget})"
                                                 if config.db_user_budget else "")
                   + (f" and resume needs {reserve} more" if reserve else "")
                   + f"; lower it to {max(limit - 1 - reserve, 1)} or raise the limit",
                   limit=limit)
    else:
        report.add(OK, "OK", subject, f"{what} allows {limit} session(s); session_budget "
                   f"{config.session_budget} fits")
