"""A small rig for the DDL loop behind its gates: a configuration, a row, a service, and the
one comparison every failure path ends with -- the recorded outcome against the live catalog.

``Rig(tmp_path, {"code": (url, "dev")}, rows)`` writes ``capgate.toml`` (one SQLite ledger,
or the one given), ``grants.toml`` (``agent`` may write everywhere, ``bob`` approves as
``dba`` in every environment) and the rows; ``rig.service()`` opens an executor on them.
:func:`assert_record_matches_catalog` reads an intent's recorded outcome and checks it
against the live signatures of its plan's objects: ``rolled_back`` and ``compensated``
mean every object equals its snapshot, ``applied_verified`` that every object is what was
applied, an escalation that the live signatures it recorded are the live ones.
"""

from __future__ import annotations

import contextlib
import json
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.api import open as open_executor
from capgate.ddl.catalog import ObjectRef
from capgate.ddl.service import DdlService
from capgate.executor.call import Executor
from capgate.registry.loader import update_lock
from tests.fix_capgate import KEYS, approval_key_line

GRANTS = f"""\
[principals.agent]
grants = [{{ connector = "*", environments = ["rig", "dev", "qa", "staging", "prod"], \
access = "write" }}]

[principals.bob]
roles = ["dba"]
{approval_key_line("bob")}
"""

ROW = """\
  - operation_id: {op}
    version: 1
    connector: {connector}
    description: test row
    input:
      type: object
      additionalProperties: false
      required: [source]
      properties:
        source: {{type: string}}
    target: {{system: s, object: o}}
    effect_class: ddl
    authorization: {{kind: gate, approver_roles: [dba]}}
    environments: {environments}
    timeout: {{seconds: 30, lock_seconds: 5, on_timeout: unknown}}
    recovery: reconcile_first
    ddl:
      objects:
{objects}
{extra}"""


def row(op: str, objects: Sequence[tuple[str, str]], *, connector: str = "code",
        environments: str = "[dev]", extra: str = "") -> str:
    """One ddl row in YAML (``objects``: (type, name) pairs)."""
    objs = "".join(f"        - {{type: {k}, name: {n}}}\n" for k, n in objects).rstrip("\n")
    return ROW.format(op=op, connector=connector, environments=environments, objects=objs,
                      extra=extra)


def execute(url: URL, sql: str, *, mode: str | None = None) -> None:
    """Run SQL text as it is (several statements on PostgreSQL; one per call on MariaDB)."""
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        if mode is not None:
            conn.execute(sa.text("SET SESSION sql_mode = :m"), {"m": mode})
        conn.exec_driver_sql(sql, execution_options={"no_parameters": True})
    eng.dispose()


def execute_each(url: URL, statements: Sequence[str], *, mode: str | None = None) -> None:
    for stmt in statements:
        execute(url, stmt, mode=mode)


def scalar(url: URL, sql: str) -> Any:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        value = conn.execute(sa.text(sql)).scalar()
    eng.dispose()
    return value


class Rig:
    """A project on disk: configuration, grants, rows; services opened on it."""

    def __init__(self, tmp: Path, connectors: Mapping[str, tuple[URL, str]], rows: Sequence[str],
                 *, dialects: str = "[postgresql, mariadb]", ledger: str | None = None,
                 connector_extra: Mapping[str, str] | None = None) -> None:
        self.tmp = tmp
        caps = tmp / "caps"
        caps.mkdir(exist_ok=True)
        names = sorted({c for c in connectors} | {"code"})
        decl = "".join(f"  {n}:\n    description: {n}\n    dialects: {dialects}\n"
                       for n in names)
        (caps / "rows.yaml").write_text("format: 1\nconnectors:\n" + decl + "rows:\n"
                                        + "".join(rows))
        update_lock([caps])  # published rows, as a reviewed change pins them
        (tmp / "grants.toml").write_text(GRANTS)
        sections = "".join(
            f"\n[connectors.{n}]\nurl = {json.dumps(u.render_as_string(hide_password=False))}\n"
            f'environment = "{env}"\n' + (connector_extra or {}).get(n, "")
            for n, (u, env) in connectors.items())
        ledger_url = ledger or f"sqlite:///{tmp / 'ledger.db'}"
        self.config = tmp / "capgate.toml"
        self.config.write_text(textwrap.dedent(f"""\
            [capgate]
            capabilities = [{json.dumps(str(caps))}]
            grants = "grants.toml"
            ledger = {json.dumps(ledger_url)}
            """) + sections)

    @contextlib.contextmanager
    def service(self) -> Iterator[DdlService]:
        with open_executor(self.config) as executor:
            yield DdlService(executor)


def approve(svc: DdlService, plan_hash: str) -> None:
    svc.executor.approve(plan_hash, by="bob", role="dba", key=KEYS["bob"])


def events(executor: Executor, case: str) -> list[tuple[str, dict[str, Any]]]:
    return [(e.kind, dict(e.payload)) for e in executor.ledger.events(case)]


def live_signatures(svc: DdlService, connector: str, keys: Sequence[str]) -> dict[str, str]:
    """The live signature of each object (by its plan key) on a connector."""
    out: dict[str, str] = {}
    with svc.loop(connector) as lp, lp.engine.connect() as conn:
        for key in keys:
            out[key] = str(lp.live_signature(conn, ObjectRef.parse(key)))
        conn.rollback()
    return out


def assert_record_matches_catalog(svc: DdlService, case: str, intent_id: str) -> str:
    """The intent's recorded outcome is what the catalog says now; returns the outcome.

    * ``rolled_back`` / ``compensated`` -- every object's live signature is its snapshot's;
    * ``applied_verified`` -- every object's live signature is the one recorded as applied;
    * ``compensation_failed`` (escalated) -- the live signatures the record names are live.
    """
    state = svc.executor.ledger.intent(case, intent_id)
    record = state["outcome_record"]
    status = str(record["status"])
    evidence = record["evidence"]
    plan = svc.executor.ledger.get_plan(str(state["plan_hash"])).plan
    keys = [str(o["key"]) for o in plan["objects"]]
    live = live_signatures(svc, str(state["connector"]), keys)
    base = {str(o["key"]): str(o["base_signature"]) for o in plan["objects"]}
    if status in ("rolled_back", "compensated"):
        assert live == base, (status, live, base, evidence)
        if "restored" in evidence:
            assert evidence["restored"] is True, evidence
    elif status == "applied_verified":
        applied = {str(o["object"]): str(o["applied_signature"]) for o in evidence["objects"]}
        assert live == applied, (live, applied)
    elif status == "compensation_failed":
        assert state.get("escalation"), state
        recorded = evidence["compensation"]["live_signatures"]
        assert live == recorded, (live, recorded)
    else:  # pragma: no cover - a new outcome needs a rule here
        raise AssertionError(f"no catalog rule for outcome {status}")
    return status


def intent_of(svc: DdlService, case: str, plan_hash: str) -> str:
    """The (last) intent of ``case`` that applied ``plan_hash``."""
    found = [i for i, s in svc.executor.ledger.intents(case).items()
             if s.get("plan_hash") == plan_hash]
    assert found, f"no intent applied {plan_hash} in {case}"
    return found[-1]
