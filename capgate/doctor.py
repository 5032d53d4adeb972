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

The live probes are read-only catalog queries, one set per dialect
(:data:`_PROBES`).  The Oracle probes follow Oracle's documented views
(``ALL_SERVICES.COMMIT_OUTCOME``, ``USER_RESOURCE_LIMITS``, ``SESSION_PRIVS``,
``ALL_TAB_PRIVS``, ``GV$SESSION``, ``DBA_2PC_PENDING``) and report the driver's
version and mode and whether the session has an LTXID; they run only where an
Oracle answers (``tests/test_oracle_executor.py``), and every query parses with
sqlglot's Oracle dialect (``tests/test_oracle_offline.py``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capgate.cli import emit

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

    kind: str | None = None
    target: str | None = None
    names: set[str] = set()
    for dialect in (None, "postgres", "mysql", "oracle", "sqlite"):
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
    from registry.errors import CapgateError, ConfigMissing

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
        for name, connector in sorted(settings.connectors.items()):
            _check_connector(report, connector, needs.get(name, Needs()))
    return report


def _check_grants(report: Report, settings: Any) -> Any:
    from executor.connectors import ENVIRONMENTS
    from executor.grants import Grants
    from registry.errors import CapgateError, GrantUnknownConnector

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


def _check_capabilities(report: Report, settings: Any) -> Any:
    from registry.errors import CapgateError, GrantUnknownRole, UnknownConnector
    from registry.loader import validate_paths
    from registry.registry import Registry

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
        from executor.grants import Grants

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
    from capgate.exposure import ENVIRONMENT, exposure
    from executor.connectors import Connectors
    from registry.errors import EnvironmentMismatch

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


def _check_connector(report: Report, config: Any, needs: Needs) -> None:
    import sqlalchemy as sa

    from executor.dialects import dialect_for, normalise_url
    from executor.target import first_line, table_states
    from registry.errors import (
        ConnectorUnavailable,
        TargetNotInstalled,
        TargetPrivilegeMissing,
    )

    subject = f"connector {config.name}"
    url = normalise_url(config.url)
    backend = url.get_backend_name()
    dialect = dialect_for(backend)
    if backend == "sqlite" and url.database and not Path(url.database).exists():
        report.add(ERROR, ConnectorUnavailable.code, subject,
                   f"the SQLite file {url.database} does not exist")
        return
    from executor.connectors import connector_engine
    from registry.errors import CapgateError

    try:
        engine = connector_engine(config, dialect, poolclass=sa.pool.NullPool)
    except CapgateError as exc:  # a driver too old, a secret's variable unset, a mode clash
        report.add(ERROR, exc.code, subject, exc.message)
        return
    try:
        with engine.connect() as conn:
            probes = _PROBES.get(backend)
            identity = probes.identity(conn) if probes else backend
            report.add(OK, "OK", subject, f"reachable ({config.safe_url}); server: {identity}; "
                       f"environment label {config.environment!r}")
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
            if all(s.state == "ok" for s in states):
                report.add(OK, "OK", subject, "capgate's tables are installed and usable")
            if probes is not None:
                probes.check(report, subject, conn, config, needs)
            conn.rollback()
    except sa.exc.DBAPIError as exc:
        report.add(ERROR, ConnectorUnavailable.code, subject,
                   f"unreachable ({config.safe_url}): {first_line(exc)}")
    finally:
        engine.dispose()


@dataclass(frozen=True)
class Probes:
    """The read-only catalog queries of one dialect."""

    identity: Callable[[Any], str]
    check: Callable[[Report, str, Any, Any, Needs], None]


def _text(sql: str) -> Any:
    import sqlalchemy as sa

    return sa.text(sql)


def _scalar(conn: Any, sql: str, **binds: Any) -> Any:
    return conn.execute(_text(sql), binds).scalar()


def _privilege_findings(report: Report, subject: str, needs: Needs,
                        has: Callable[[str, str], bool | None]) -> None:
    """One finding per missing (table, privilege); ``has`` answers None for no such table."""
    from registry.errors import PrivilegeMissing

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
    from registry.errors import SessionLimitTooLow

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


# PostgreSQL


def _pg_identity(conn: Any) -> str:
    version = _scalar(conn, "SHOW server_version")
    system = _scalar(conn, "SELECT system_identifier FROM pg_control_system()")
    where = conn.execute(_text("SELECT current_database(), current_user")).one()
    return f"PostgreSQL {version}, system {system}, database {where[0]}, user {where[1]}"


def _pg_check(report: Report, subject: str, conn: Any, config: Any, needs: Needs) -> None:
    from registry.errors import ExtensionMissing, PrivilegeMissing

    def has(table: str, privilege: str) -> bool | None:
        if _scalar(conn, "SELECT to_regclass(:t) IS NOT NULL", t=table) is not True:
            return None
        return bool(_scalar(conn, "SELECT has_table_privilege(:t, :p)", t=table, p=privilege))

    _privilege_findings(report, subject, needs, has)
    # ending a session: resume terminates exactly the recorded backend, which runs as the
    # connector's own role -- allowed for the same role, for pg_signal_backend, superusers
    if needs.writes:
        report.add(OK, "OK", subject, "resume may end the account's own sessions "
                   "(pg_terminate_backend on a backend of the same role)")
    limits = conn.execute(_text(
        "SELECT r.rolconnlimit, d.datconnlimit, current_setting('max_connections')::int "
        "- current_setting('superuser_reserved_connections')::int, r.rolsuper "
        "FROM pg_roles r, pg_database d WHERE r.rolname = current_user "
        "AND d.datname = current_database()")).one()
    _budget_finding(report, subject, config, int(limits[0]), "the role's CONNECTION LIMIT")
    _budget_finding(report, subject, config, int(limits[1]), "the database's CONNECTION LIMIT")
    _budget_finding(report, subject, config, int(limits[2]),
                    "max_connections (less superuser_reserved_connections)")
    if needs.ddl_rows:
        installed = _scalar(conn, "SELECT extversion FROM pg_extension "
                                  "WHERE extname = 'plpgsql_check'")
        if installed is None:
            available = _scalar(conn, "SELECT count(*) FROM pg_available_extensions "
                                      "WHERE name = 'plpgsql_check'")
            report.add(ERROR, ExtensionMissing.code, subject,
                       f"the DDL rows ({', '.join(needs.ddl_rows)}) need plpgsql_check: "
                       + ("run CREATE EXTENSION plpgsql_check" if available else
                          "install its package (postgresql-NN-plpgsql-check), then "
                          "CREATE EXTENSION plpgsql_check"))
        else:
            report.add(OK, "OK", subject, f"plpgsql_check {installed} is installed (DDL rows)")
        create = _scalar(conn, "SELECT has_schema_privilege(current_schema(), 'CREATE') "
                               "OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)")
        if not create:
            report.add(ERROR, PrivilegeMissing.code, subject,
                       "the DDL rows need CREATE on the schema (to replace stored code); "
                       f"the account lacks it on {_scalar(conn, 'SELECT current_schema()')}")
        else:
            report.add(OK, "OK", subject, "DDL capture (pg_proc, pg_views) and apply (CREATE "
                       "on the schema) are allowed")


# MariaDB


def _my_identity(conn: Any) -> str:
    return (f"MariaDB/MySQL {_scalar(conn, 'SELECT VERSION()')}, server_id "
            f"{_scalar(conn, 'SELECT @@server_id')}, database {_scalar(conn, 'SELECT DATABASE()')},"
            f" user {_scalar(conn, 'SELECT CURRENT_USER()')}")


def _my_grantee(conn: Any) -> str:
    user, _, host = str(_scalar(conn, "SELECT CURRENT_USER()")).rpartition("@")
    return f"'{user}'@'{host}'"


def _my_check(report: Report, subject: str, conn: Any, config: Any, needs: Needs) -> None:
    from registry.errors import PrivilegeMissing

    grantee = _my_grantee(conn)
    schema = _scalar(conn, "SELECT DATABASE()")

    def held(privilege: str, table: str | None = None) -> bool:
        if _scalar(conn, "SELECT count(*) FROM information_schema.USER_PRIVILEGES WHERE "
                         "GRANTEE = :g AND PRIVILEGE_TYPE = :p", g=grantee, p=privilege):
            return True
        if _scalar(conn, "SELECT count(*) FROM information_schema.SCHEMA_PRIVILEGES WHERE "
                         "GRANTEE = :g AND TABLE_SCHEMA = :s AND PRIVILEGE_TYPE = :p",
                   g=grantee, s=schema, p=privilege):
            return True
        return table is not None and bool(_scalar(
            conn, "SELECT count(*) FROM information_schema.TABLE_PRIVILEGES WHERE GRANTEE = :g "
                  "AND TABLE_SCHEMA = :s AND TABLE_NAME = :t AND PRIVILEGE_TYPE = :p",
            g=grantee, s=schema, t=table, p=privilege))

    def has(table: str, privilege: str) -> bool | None:
        if not _scalar(conn, "SELECT count(*) FROM information_schema.TABLES WHERE "
                             "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t", t=table):
            return None
        return held(privilege, table)

    _privilege_findings(report, subject, needs, has)
    if needs.writes:
        report.add(OK, "OK", subject, "resume may end the account's own connections "
                   "(KILL needs no privilege for one's own threads)")
    per_user = _scalar(conn, "SELECT @@max_user_connections")
    _budget_finding(report, subject, config, int(per_user) or None, "max_user_connections")
    try:
        row_limit = _scalar(conn, "SELECT max_user_connections FROM mysql.user WHERE "
                                  "CONCAT(User, '@', Host) = CURRENT_USER()")
    except Exception:  # mysql.user is not readable by a least-privilege account
        conn.rollback()
        row_limit = None
    if row_limit:
        _budget_finding(report, subject, config, int(row_limit),
                        "the account's MAX_USER_CONNECTIONS")
    _budget_finding(report, subject, config, int(_scalar(conn, "SELECT @@max_connections")),
                    "max_connections")
    if needs.ddl_rows:
        lacking = [p for p in ("CREATE ROUTINE", "ALTER ROUTINE") if not held(p)]
        if lacking:
            report.add(ERROR, PrivilegeMissing.code, subject,
                       f"the DDL rows need {' and '.join(lacking)} on {schema}")
        else:
            report.add(OK, "OK", subject, "DDL capture (SHOW CREATE) and apply (CREATE/ALTER "
                       "ROUTINE) are allowed")


# SQLite


def _lite_identity(conn: Any) -> str:
    return f"SQLite {_scalar(conn, 'SELECT sqlite_version()')}"


def _lite_check(report: Report, subject: str, conn: Any, config: Any, needs: Needs) -> None:
    from registry.errors import PrivilegeMissing

    database = conn.engine.url.database or ""

    def has(table: str, privilege: str) -> bool | None:
        if not _scalar(conn, "SELECT count(*) FROM sqlite_master WHERE type IN "
                             "('table', 'view') AND lower(name) = :t", t=table):
            return None
        return privilege == "SELECT" or os.access(database, os.W_OK)

    _privilege_findings(report, subject, needs, has)
    if needs.writes and not os.access(Path(database).parent, os.W_OK):
        report.add(ERROR, PrivilegeMissing.code, subject,
                   f"the folder of {database} is not writable: SQLite cannot keep its journal")


# Oracle (written against Oracle's documentation; run wherever an Oracle answers)

ORA_IDENTITY = ("SELECT SYS_CONTEXT('USERENV', 'DB_UNIQUE_NAME'), SYS_CONTEXT('USERENV', "
                "'SERVICE_NAME'), SYS_CONTEXT('USERENV', 'INSTANCE_NAME'), USER FROM dual")
ORA_PRIVS = "SELECT privilege FROM session_privs"
ORA_OWNER = ("SELECT owner FROM all_objects WHERE object_name = UPPER(:t) "
             "AND object_type IN ('TABLE', 'VIEW', 'SYNONYM') AND ROWNUM = 1")
ORA_TAB_PRIV = "SELECT count(*) FROM all_tab_privs WHERE table_name = UPPER(:t) AND privilege = :p"
ORA_SESSIONS_PER_USER = ('SELECT "LIMIT" FROM user_resource_limits '
                         "WHERE resource_name = 'SESSIONS_PER_USER'")
ORA_COMMIT_OUTCOME = ("SELECT commit_outcome FROM all_services "
                      "WHERE name = SYS_CONTEXT('USERENV', 'SERVICE_NAME')")
ORA_APP_CONT = ("SELECT count(*) FROM all_objects WHERE owner = 'SYS' "
                "AND object_name = 'DBMS_APP_CONT' AND object_type = 'PACKAGE'")
ORA_GV_SESSION = "SELECT count(*) FROM gv$session WHERE ROWNUM = 1"
ORA_2PC_PENDING = "SELECT count(*) FROM dba_2pc_pending WHERE ROWNUM = 1"
ORA_QUERIES = {"identity": ORA_IDENTITY, "privs": ORA_PRIVS, "owner": ORA_OWNER,
               "tab_priv": ORA_TAB_PRIV, "sessions_per_user": ORA_SESSIONS_PER_USER,
               "commit_outcome": ORA_COMMIT_OUTCOME, "app_cont": ORA_APP_CONT,
               "gv_session": ORA_GV_SESSION, "2pc_pending": ORA_2PC_PENDING}
"""Every query the Oracle checks send (the offline tests parse each with sqlglot)."""


def _ora_identity(conn: Any) -> str:
    db, service, instance, user = conn.execute(_text(ORA_IDENTITY)).one()
    raw = conn.connection.driver_connection
    return f"Oracle {raw.version}, database {db}, service {service}, instance {instance}, " \
           f"user {user}"


def _ora_readable(conn: Any, sql: str) -> bool:
    """Whether the account may read a view (ORA-00942 / ORA-01031 when not)."""
    import sqlalchemy as sa

    try:
        conn.execute(_text(sql)).scalar()
        return True
    except sa.exc.DatabaseError:
        conn.rollback()
        return False


def _ora_check(report: Report, subject: str, conn: Any, config: Any, needs: Needs) -> None:
    from executor.dialects.oracle import driver
    from registry.errors import (
        CommitOutcomeUnavailable,
        LeaseNotEnforceable,
        PrivilegeMissing,
    )

    raw = conn.connection.driver_connection
    mode = "Thin" if raw.thin else "Thick"
    report.add(OK, "OK", subject, f"python-oracledb {driver().__version__}, {mode} mode",
               driver=driver().__version__, mode=mode.lower())
    privs = {r[0] for r in conn.execute(_text(ORA_PRIVS))}
    user = conn.execute(_text("SELECT USER FROM dual")).scalar()

    def has(table: str, privilege: str) -> bool | None:
        owner = _scalar(conn, ORA_OWNER, t=table)
        if owner is None:
            return None
        if owner == user or f"{privilege} ANY TABLE" in privs:
            return True
        return bool(_scalar(conn, ORA_TAB_PRIV, t=table, p=privilege))

    _privilege_findings(report, subject, needs, has)
    if needs.leased_rows:
        report.add(WARNING, LeaseNotEnforceable.code, subject,
                   f"leased rows are refused on Oracle (nothing ends a hung executor's "
                   f"transaction at its deadline): {', '.join(sorted(needs.leased_rows))}",
                   rows=sorted(needs.leased_rows))
    # liveness: GV$SESSION (every RAC instance) sees whether the recorded session is
    # still ours and in a transaction; without it resume proves it privilege-free
    if needs.writes:
        if _ora_readable(conn, ORA_GV_SESSION):
            report.add(OK, "OK", subject, "GV$SESSION is readable: resume sees the recorded "
                       "session on its instance, its CLIENT_INFO tag and its transaction")
        else:
            report.add(WARNING, PrivilegeMissing.code, subject,
                       "GV$SESSION is not readable (GRANT SELECT ON SYS.GV_$SESSION): resume "
                       "falls back on DBMS_SESSION.IS_SESSION_ALIVE and a rolled-back insert "
                       "of the marker's key, and cannot end a session that may still commit")
        if "ALTER SYSTEM" in privs:
            report.add(OK, "OK", subject, "resume may end a recorded session "
                       "(ALTER SYSTEM KILL SESSION, on its own instance)")
        else:
            report.add(WARNING, PrivilegeMissing.code, subject,
                       "without ALTER SYSTEM, resume cannot end a recorded session that may "
                       "still commit; it waits, and answers unknown while the session lives")
        if not _ora_readable(conn, ORA_2PC_PENDING):
            report.add(WARNING, PrivilegeMissing.code, subject,
                       "DBA_2PC_PENDING is not readable: an in-doubt distributed commit "
                       "(ORA-02050/ORA-02054) stays unknown until a person resolves it")
    limit = _scalar(conn, ORA_SESSIONS_PER_USER)
    if limit is not None and str(limit).isdigit():
        # ORA-02391 counts every session of the user in the database: resume's two
        # evidence sessions (never refused by a budget) must fit beside the budget
        _budget_finding(report, subject, config, int(limit), "the profile's SESSIONS_PER_USER",
                        reserve=2)
    else:
        report.add(OK, "OK", subject, f"the profile's SESSIONS_PER_USER is {limit or 'unknown'}")
    ltxid = bytes(raw.ltxid or b"")
    try:
        outcome = _scalar(conn, ORA_COMMIT_OUTCOME)
    except Exception:  # ALL_SERVICES not readable: the driver's LTXID still tells
        conn.rollback()
        outcome = None
    executes = _scalar(conn, ORA_APP_CONT)
    if not ltxid:
        report.add(WARNING, CommitOutcomeUnavailable.code, subject,
                   "the service does not record commit outcomes: no LTXID on this session "
                   f"(COMMIT_OUTCOME is {outcome or 'not readable'}); enable it with "
                   "DBMS_SERVICE.MODIFY_SERVICE(..., commit_outcome => TRUE) or connect to a "
                   "service that has it", commit_outcome=outcome)
    elif not executes:
        report.add(WARNING, CommitOutcomeUnavailable.code, subject,
                   "the service records commit outcomes but the account may not read them: "
                   "GRANT EXECUTE ON DBMS_APP_CONT")
    else:
        report.add(OK, "OK", subject, "Transaction Guard records commit outcomes (LTXID on "
                   "the session, EXECUTE on DBMS_APP_CONT)")
    if needs.ddl_rows:
        if not ({"CREATE PROCEDURE", "CREATE ANY PROCEDURE"} & privs):
            report.add(ERROR, PrivilegeMissing.code, subject,
                       "the DDL rows need CREATE PROCEDURE (or CREATE ANY PROCEDURE)")
        else:
            report.add(OK, "OK", subject, "DDL apply (CREATE PROCEDURE) is allowed")


_PROBES: dict[str, Probes] = {
    "postgresql": Probes(_pg_identity, _pg_check),
    "mysql": Probes(_my_identity, _my_check),
    "mariadb": Probes(_my_identity, _my_check),
    "sqlite": Probes(_lite_identity, _lite_check),
    "oracle": Probes(_ora_identity, _ora_check),
}


# --- the command --------------------------------------------------------------------------


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("doctor", parents=[common],
                       help="check configuration, grants and every connector's live access",
                       description="Every configuration key, the grants, the capability "
                                   "files, what each identity gets, and per connector: "
                                   "reachable, server, environment, capgate's tables, "
                                   "privileges, session limits, extensions.  Exit 1 on any "
                                   "error.")
    p.add_argument("--offline", action="store_true",
                   help="check the configuration and files only; connect to nothing")
    p.set_defaults(handler=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from registry.errors import EXIT_OK, EXIT_REFUSED, ConfigMissing

    report = run_doctor(args.config, live=not args.offline)
    emit(args, report.to_dict(), report.text())
    if any(f.code == ConfigMissing.code for f in report.errors):
        return ConfigMissing.exit_code
    return EXIT_OK if report.ok else EXIT_REFUSED
