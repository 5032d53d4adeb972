"""Scaffold a working project in one command (``capgate init [DIR]``).

It writes ``capgate.toml``, ``grants.toml`` and ``capabilities/`` (the
packaged insurance examples, or with ``--empty`` an annotated template with
one read row), makes the target -- an embedded SQLite file with the example
schema by default, or the user's own database with ``--target URL`` --
installs capgate's tables there, and says what to run next.

"Working" is the contract: right after ``init``, ``capgate call`` and
``capgate mcp`` work in DIR with no edits.  That is why the environment
label is written once and used three times -- the connectors' ``environment``,
every grant's ``environments``, and (checked here) the rows' ``environments``
-- since a connector labelled ``prod`` with grants for ``dev`` is an MCP
server with no tools.  ``capgate demo`` builds its sandbox with the same
function (:func:`init_project`), so the demo also proves ``init``.

Nothing is overwritten: if DIR already holds any of the files, ``init`` names
them and changes nothing (``ProjectExists``).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capgate.registry.errors import (
    ConnectorUnavailable,
    ProjectExists,
    TargetPrivilegeMissing,
    UsageError,
)

ENVIRONMENTS = ("dev", "qa", "staging", "prod")
EXAMPLE_AGENT = "claims-agent"
#: The sample approvers and their roles (the example rows' gates accept dba and
#: underwriting_lead; four eyes needs an approver who is not the requester).
EXAMPLE_APPROVERS = {"alice": ["dba", "underwriting_lead"], "bob": ["dba"]}
EXAMPLE_CONNECTORS = ("insurance", "insurance_code")
TEMPLATE_CONNECTORS = ("app",)

TEMPLATE = """\
# A capability file: the operations an agent may run on connector `app`.
#
# Each row is one (operation_id, version).  A DBA reviews it; `capgate validate`
# checks it; `capgate lock` pins its hash so that a published row can only change
# through a new version (`capgate bump OPERATION` writes the next one).
# Every key is described in docs/capability-file.md.
format: 1
connectors:
  app:
    description: the application database (configured in capgate.toml)
rows:
  - operation_id: app.ping                 # the tool / operation name
    version: 1                             # grows with every change
    connector: app                         # the only database this row may touch
    description: >
      Check that the application database answers.  A read: it runs in a
      read-only transaction and can change nothing.
    input:                                 # JSON Schema of the inputs (closed)
      type: object
      additionalProperties: false
      properties: {}
    target: {system: app, object: database, keys: []}
    effect_class: read                     # read | transactional | compensable | irreversible | ddl
    authorization: {kind: read_grant}      # read_grant | write_grant | gate
    environments: [dev, qa, staging, prod] # where it may run (the connector's label)
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    max_rows: 1
    statements:
      - name: ping
        sql: SELECT 1 AS ok
        expect_rows: 1
    evidence: [counts, rows]

# A write, to copy and adapt (uncomment, then `capgate validate`):
#
#  - operation_id: app.add_note
#    version: 1
#    connector: app
#    description: >
#      Append a note to a customer.
#    input:
#      type: object
#      additionalProperties: false
#      required: [customer_id, body]
#      properties:
#        customer_id: {type: integer, minimum: 1}
#        body: {type: string, minLength: 1, maxLength: 2000}
#    target: {system: app, object: customer_note, keys: [customer_id]}
#    effect_class: transactional
#    shape: collapsed                      # statements, verify, replay, marker, COMMIT in one call
#    authorization: {kind: write_grant}    # or {kind: gate, approver_roles: [dba], four_eyes: true}
#    environments: [dev, qa, staging, prod]
#    idempotency_key: "{case}:{operation_id}:{customer_id}"
#    timeout: {seconds: 5, lock_seconds: 2, on_timeout: rolled_back}
#    recovery: retryable
#    statements:
#      - name: insert_note
#        sql: INSERT INTO customer_note (customer_id, body) VALUES (:customer_id, :body)
#        expect_rows: 1
#    verify:
#      - name: customer_exists
#        sql: SELECT count(*) FROM customer WHERE customer_id = :customer_id
#        expect: {value: 1}
"""


@dataclass
class InitReport:
    """What ``init`` made, and what to run next."""

    folder: Path
    files: list[str] = field(default_factory=list)
    connectors: dict[str, str] = field(default_factory=dict)
    """connector -> URL (password hidden)."""
    environment: str = "dev"
    agent: str = EXAMPLE_AGENT
    rows: int = 0
    pinned: int = 0
    """rows pinned in ``capabilities/capabilities.lock``."""
    target_tables: list[str] = field(default_factory=list)
    example_schema: bool = False
    next_steps: list[str] = field(default_factory=list)
    mcp_client: dict[str, Any] = field(default_factory=dict)
    ddl_checks: str | None = None
    """What a person must do before the example DDL rows can be verified in the target
    (PostgreSQL: install plpgsql_check's package); None when ready."""

    def to_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "files": self.files, "connectors": self.connectors,
                "environment": self.environment, "agent": self.agent, "rows": self.rows,
                "pinned": self.pinned,
                "target_tables": self.target_tables, "example_schema": self.example_schema,
                "next_steps": self.next_steps, "mcp_client": self.mcp_client,
                "ddl_checks": self.ddl_checks}


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


CONNECTOR_DEFAULTS = (
    "session_budget = 4                      # sessions capgate opens at once here",
    "budget_wait_seconds = 10                # a call waits in line this long for a session, "
    "then CG321",
    "claim_wait_seconds = 10                 # ... and this long for a target another case's "
    "call is writing, then CG320",
    "case_claim_seconds = 0                  # a write holds its target for its call; N > 0: "
    "a case holds its",
    "                                        # targets N s between its calls (docs/cases.md)",
)
"""What ``init`` writes for every connector: settings that pass a first load test.

Many agents on a few hot targets, each call its own case: a call that finds its
target or the budget busy waits its turn (fair, bounded) instead of being refused
at once, and a case holds a target for the length of its call.  A case that works
on a target across calls and agent turns is the design's stronger promise
(``case_claim_seconds`` > 0): then a second case on that target waits
``claim_wait_seconds`` and is refused with a coordination decision for a person --
right for long cases, a stall for one-call cases, so ``init`` leaves it to the
person who knows which kind theirs are."""


def config_text(connectors: dict[str, str], environment: str, agent: str) -> str:
    """The annotated ``capgate.toml`` for ``connectors`` (name -> URL)."""
    lines = [
        "# capgate configuration (made by `capgate init`; docs/configuration.md).",
        "# Check it at any time with `capgate doctor`.",
        "[capgate]",
        'capabilities = ["capabilities"]          # capability files, relative to this file',
        'grants = "grants.toml"                   # who may read/write, who approves',
        'ledger = "sqlite:///.capgate/ledger.db"  # the ledger; postgresql://... to share it',
        f"agent = {_toml_str(agent)}".ljust(41) + "# the default caller identity (--as overrides)",
        "",
        "# A connector is a named target database; a row names the one it may touch.",
        "# Its `environment` must be among the rows' `environments` and the grants'.",
        "# URLs: sqlite:///file.db, postgresql://user@host/db, mysql://user@host/db",
        "# (MariaDB), oracle://user@host:1521/?service_name=NAME.",
    ]
    for name, url in connectors.items():
        lines += ["", f"[connectors.{name}]"]
        if name == "insurance_code":
            lines.append("# the DDL rows (capabilities/ddl.yaml) change stored code through a "
                         "connector of their own")
        lines += [f"url = {_toml_str(url)}", f"environment = {_toml_str(environment)}",
                  *CONNECTOR_DEFAULTS]
    return "\n".join(lines) + "\n"


def grants_text(connectors: list[str], environment: str, agent: str,
                approvers: dict[str, list[str]], keys: dict[str, str] | None = None) -> str:
    """The annotated ``grants.toml``: the agent writes in ``environment``; approvers approve."""
    items = "".join(
        f"\n  {{ connector = {_toml_str(c)}, environments = [{_toml_str(environment)}], "
        'access = "write" },' for c in connectors)
    lines = [
        "# Who may do what (docs/configuration.md).  A grant names a connector (or \"*\"),",
        "# the environments it covers and read or write access; roles are what approvers hold.",
        f"[principals.{_toml_str(agent)}]",
        f"grants = [{items}\n]",
    ]
    for who, roles in approvers.items():
        lines += ["", f"[principals.{_toml_str(who)}]",
                  f"roles = [{', '.join(_toml_str(r) for r in roles)}]"]
        if keys and who in keys:
            lines.append(f"approval_key = {_toml_str(keys[who])}   # keys/{who}.key signs")
    return "\n".join(lines) + "\n"


def _approver_keys(folder: Path, approvers: dict[str, list[str]]) -> dict[str, str]:
    """One signing key per sample approver: ``keys/NAME.key``; name -> public key text.

    Approvals are signed (``capgate approve --key FILE``): the private key is
    the approver's alone (mode 0600) and the grants file names its public half
    as ``approval_key``.  In a real project each person makes their own with
    ``capgate approver keygen`` and keeps it where agents cannot read it; the
    sample keys live in the project so that the first gated write works.
    """
    from capgate.executor.approvals import generate

    (folder / "keys").mkdir(mode=0o700, exist_ok=True)  # covered by the .gitignore init writes
    return {who: generate(folder / "keys" / f"{who}.key") for who in approvers}


def _ignore(gitignore: Path, entries: tuple[str, ...]) -> bool:
    """``entries`` in ``gitignore`` (made, or the missing ones appended): the ledger and
    the private keys stay out of version control.  True when the file was created."""
    created = not gitignore.exists()
    text = "" if created else gitignore.read_text("utf-8")
    have = {line.strip() for line in text.splitlines()}
    missing = [e for e in entries if e not in have and e.rstrip("/") not in have]
    if missing:
        gap = "" if not text or text.endswith("\n") else "\n"
        gitignore.write_text(text + gap + "".join(f"{e}\n" for e in missing), "utf-8")
    return created


def _capgate_command() -> str:
    """The ``capgate`` executable beside this interpreter (a venv), else on PATH."""
    beside = Path(sys.executable).with_name("capgate")
    if beside.exists():
        return str(beside)
    return shutil.which("capgate") or "capgate"


def init_project(folder: str | Path, *, target: str | None = None, empty: bool = False,
                 environment: str = "dev", example_schema: bool = False,
                 agent: str | None = None) -> InitReport:
    """Scaffold a working project in ``folder``; returns what was made.

    ``target``: the user's database URL (default: an embedded SQLite file in
    ``folder``).  ``example_schema``: also create the example tables there (a
    new SQLite target always gets them unless ``empty``).  Raises
    ProjectExists (nothing written) when a file it would write exists.
    """
    import sqlalchemy as sa

    from capgate.executor.connectors import safe_url
    from capgate.executor.dialects import normalise_url
    from capgate.executor.target import first_line, install_at, prepare_ddl_checks_at
    from capgate.registry.loader import update_lock, validate_texts
    from capgate.sqlfiles import apply_schema, example_capability_files

    if environment not in ENVIRONMENTS:
        raise UsageError(f"--environment must be one of {', '.join(ENVIRONMENTS)}, "
                         f"got {environment!r}")
    root = Path(folder).expanduser().resolve()
    names = list(TEMPLATE_CONNECTORS if empty else EXAMPLE_CONNECTORS)
    database = "app.db" if empty else "insurance.db"
    planned = ["capgate.toml", "grants.toml", "capabilities", "keys"]
    if target is None:
        planned.append(database)
    if root.exists() and not root.is_dir():
        raise ProjectExists(f"{root} is a file, not a folder", folder=str(root), found=[])
    found = [n for n in planned if (root / n).exists()]
    if found:
        raise ProjectExists(f"{root} already has {', '.join(found)}; capgate init writes "
                            "only into a folder without them (nothing was changed)",
                            folder=str(root), found=found)
    agent = agent or ("agent" if empty else EXAMPLE_AGENT)
    approvers = {"alice": ["dba"], "bob": ["dba"]} if empty else EXAMPLE_APPROVERS
    report = InitReport(folder=root, environment=environment, agent=agent)
    if target is not None:
        try:
            parsed = normalise_url(target)
        except Exception as exc:
            from capgate.executor.dialects import safe_url_text

            shown = safe_url_text(target)  # never the password, even of a URL that fails
            raise UsageError(f"--target {shown!r} is not a database URL this capgate "
                             f"knows: {str(exc).replace(target, shown)}") from None
        written_url = target
        live_url = parsed
    else:
        written_url = f"sqlite:///{database}"
        live_url = normalise_url(f"sqlite:///{root / database}")

    # 1. the capability files, checked before anything is written
    if empty:
        texts = [("capabilities/app.yaml", TEMPLATE)]
    else:
        texts = [(f"capabilities/{p.name}", p.read_text("utf-8"))
                 for p in example_capability_files()]
    result = validate_texts(texts)
    result.raise_for_problems()
    report.rows = len(result.rows)
    outside = sorted({r.ref for r in result.rows if environment not in r.environments})
    if outside:  # the contract is "works with no edits": say it here, not as a missing tool
        raise UsageError(f"rows {', '.join(outside)} do not allow environment "
                         f"{environment!r}; choose another --environment")

    # 2. the target: the database work first, so that a refusal leaves no files behind
    root.mkdir(parents=True, exist_ok=True)
    try:
        if (target is None and not empty) or example_schema:
            engine = sa.create_engine(live_url, poolclass=sa.pool.NullPool)
            try:
                apply_schema(engine)
            finally:
                engine.dispose()
            report.example_schema = True
        report.target_tables = install_at(live_url)
        if not empty:  # the example DDL rows: what their checks need (plpgsql_check)
            report.ddl_checks = prepare_ddl_checks_at(live_url)
    except sa.exc.DBAPIError as exc:
        if target is None:
            (root / database).unlink(missing_ok=True)
        where = safe_url(live_url)
        if isinstance(exc, sa.exc.OperationalError) and target is not None and not (
                report.example_schema):
            raise ConnectorUnavailable(f"the target {where} is unreachable: {first_line(exc)}; "
                                       "nothing was written", url=where) from None
        raise TargetPrivilegeMissing(
            f"could not prepare the target {where}: {first_line(exc)}; use an account that "
            "may create tables, or let a DBA run what `capgate target install CONNECTOR "
            "--sql` prints (after init); nothing was written", url=where) from None
    if target is None:
        report.files.append(database)

    # 3. the files
    caps = root / "capabilities"
    caps.mkdir()
    for name, text in texts:
        (root / name).write_text(text, "utf-8")
    # The rows start published: pinned, so that one edited in place is refused (CG130)
    # instead of taking effect unreviewed; a change is a new version (`capgate bump`).
    lock_path, _, pins = update_lock([caps])
    report.pinned = len(pins)
    report.files[:0] = [name for name, _ in texts] + [str(lock_path.relative_to(root))]

    connectors = {name: written_url for name in names}
    report.connectors = {name: safe_url(live_url) for name in names}
    (root / "capgate.toml").write_text(config_text(connectors, environment, agent), "utf-8")
    keys = _approver_keys(root, approvers)
    (root / "grants.toml").write_text(grants_text(names, environment, agent, approvers, keys),
                                      "utf-8")
    report.files[:0] = ["capgate.toml", "grants.toml"]
    report.files += [f"keys/{who}.key" for who in keys]
    gitignore = root / ".gitignore"
    if _ignore(gitignore, (".capgate/", "keys/")):
        report.files.append(".gitignore")

    command = _capgate_command()
    report.mcp_client = {"mcpServers": {"capgate": {
        "command": command, "args": ["mcp", "--config", str(root / "capgate.toml")]}}}
    report.next_steps = _next_steps(root, empty=empty)
    return report


def _next_steps(root: Path, *, empty: bool) -> list[str]:
    steps = [f"cd {root}", "capgate validate", "capgate doctor"]
    if empty:
        return [*steps, "capgate call app.ping --case FIRST-1",
                "edit capabilities/app.yaml (a write row is there to copy), then "
                "capgate validate && capgate lock"]
    return [
        *steps,
        "capgate call policy.get --input '{\"policy_id\": 1}' --case TICKET-1",
        "capgate call policy.add_note --input '{\"policy_id\": 1, \"author\": \"me\", "
        "\"body\": \"First note.\"}' --case TICKET-1",
        "capgate call policy.purge_orphan --input '{\"policy_id\": 9}' --case TICKET-2"
        "    # gated: refused with the approve command",
        "capgate approve PLAN_HASH --by bob --role dba --key keys/bob.key",
        "capgate call policy.purge_orphan --input '{\"policy_id\": 9}' --case TICKET-2",
        "capgate cases && capgate ledger show TICKET-2 --html TICKET-2.html",
    ]
