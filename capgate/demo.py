"""``capgate demo``: the whole loop on the embedded default, printed step by step.

Everything happens in a temporary folder: a SQLite target with the example
insurance schema, a SQLite ledger, and a grants set with an agent and two
approvers.  No server is needed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from capgate.sqlfiles import apply_schema, schema_file
from executor.approvals import generate, load_signing_key
from executor.call import Executor
from executor.connectors import ConnectorConfig, Connectors
from executor.grants import Grants
from executor.ledger import open_ledger
from executor.outcome import Outcome
from executor.target import install_at
from registry.errors import ApprovalRequired, CapgateError
from registry.loader import DEFAULT_PATH, validate_paths
from registry.registry import Registry

DEMO_GRANTS: dict[str, dict[str, dict[str, Any]]] = {"principals": {
    "claims-agent": {"grants": [{"connector": "*", "environments": ["dev"], "access": "write"}]},
    "alice": {"roles": ["dba", "underwriting_lead"]},
    "bob": {"roles": ["dba"]},
}}


def _say(title: str) -> None:
    print(f"\n== {title}")


def _brief(outcome: Outcome) -> str:
    lines = [f"   -> {outcome.status}  intent {outcome.intent_id[:12]}"
             f"{'  (recorded outcome replayed)' if outcome.replayed else ''}"]
    ev = outcome.evidence
    if "counts" in ev:
        lines.append(f"      counts {ev['counts']}")
    for check in ev.get("verify", []):
        lines.append(f"      verify {check['name']}: expected {json.dumps(check['expected'])}, "
                     f"got {json.dumps(check['actual'])}")
    if "rows" in ev:
        lines.append(f"      rows {json.dumps(ev['rows'])[:150]}")
    if "replay" in ev:
        lines.append(f"      replay {json.dumps(ev['replay']['rows'])[:150]}")
    if outcome.reason:
        lines.append(f"      reason {json.dumps(outcome.reason, default=str)[:300]}")
    return "\n".join(lines)


def build_demo_executor(folder: Path, capabilities: str = DEFAULT_PATH) -> Executor:
    """A SQLite target and ledger in ``folder`` with the example schema and grants."""
    result = validate_paths([capabilities])
    result.raise_for_problems()
    target = f"sqlite:///{folder / 'insurance.db'}"
    engine = sa.create_engine(target, poolclass=sa.pool.NullPool)
    apply_schema(engine, schema_file("sqlite"))
    engine.dispose()
    install_at(target)
    connectors = Connectors({n: ConnectorConfig(name=n, url=target, environment="dev")
                             for n in ("insurance", "insurance_code")})
    grants: dict[str, Any] = {"principals": {k: dict(v) for k, v in
                                             DEMO_GRANTS["principals"].items()}}
    for approver in ("alice", "bob"):  # each approver's own signing key, in the sandbox
        grants["principals"][approver]["approval_key"] = generate(
            folder / "keys" / f"{approver}.key", force=True)
    return Executor(Registry(result.rows), connectors,
                    open_ledger(f"sqlite:///{folder / 'ledger.db'}"),
                    Grants.from_dict(grants, source="demo grants"))


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="capgate-demo-") as tmp:
        folder = Path(tmp)
        result = validate_paths([DEFAULT_PATH])
        result.raise_for_problems()
        _say(f"capgate validate: {len(result.rows)} rows in {len(result.files)} files, all valid")
        ex = build_demo_executor(folder)
        print(f"   target and ledger: SQLite files in {folder}")
        try:
            _run(ex, folder)
        finally:
            ex.connectors.dispose()
            ex.ledger.close()
    print(f"\ndemo finished in {time.monotonic() - started:.1f}s")
    return 0


def _run(ex: Executor, folder: Path) -> None:
    case = "TICKET-4711"
    agent = "claims-agent"

    _say("1. a read (engine-enforced read-only transaction, row cap)")
    print("   capgate call policy.get --input '{\"policy_id\": 1}'")
    print(_brief(ex.call("policy.get", {"policy_id": 1}, case=case, who=agent)))

    note = {"policy_id": 1, "author": "claims-agent", "body": "Holder asked for a callback."}
    _say("2. a collapsed write: statements, verify, replay, landing marker, COMMIT")
    print(_brief(ex.call("policy.add_note", note, case=case, who=agent)))
    print("   the same call again returns the recorded outcome and executes nothing:")
    print(_brief(ex.call("policy.add_note", note, case=case, who=agent)))

    _say("3. a write whose verify fails: rolled back, with the evidence of why")
    print("   (policy 9 is void; the row's verify demands a non-void policy)")
    print(_brief(ex.call("policy.add_note", {**note, "policy_id": 9}, case=case, who=agent)))

    _say("4. a gated write (four eyes): refused until approved, then it runs")
    try:
        ex.call("policy.purge_orphan", {"policy_id": 9}, case=case, who=agent)
    except ApprovalRequired as refused:
        plan_hash = refused.details["plan_hash"]
        print(f"   refused: {refused.code} approval required for plan {plan_hash[:23]}...")
        for st in refused.details["plan"]["statements"]:
            print(f"      {' '.join(st['sql'].split())[:70]:<70} expect {st['expect_rows']}")
        bob_key = load_signing_key(folder / "keys" / "bob.key")
        try:
            ex.approve(plan_hash, by=agent, role="dba", key=bob_key)
        except CapgateError as exc:
            print(f"   the agent cannot approve: {exc.code} {exc.message[:80]}")
        try:
            ex.approve(plan_hash, by="alice", role="dba", key=bob_key)
        except CapgateError as exc:
            print(f"   nor can anyone approve in another's name: {exc.code} "
                  f"{exc.message[:70]}")
        approval = ex.approve(plan_hash, by="bob", role="dba", key=bob_key)
        print(f"   capgate approve {plan_hash[:23]}... --by bob --role dba --key bob.key "
              f"(signed, single use, expires {approval['expires_at'][:19]})")
        print(_brief(ex.call("policy.purge_orphan", {"policy_id": 9}, case=case, who=agent)))

    _crash_demo(ex, folder, agent)

    _say("6. capgate ledger verify")
    report = ex.ledger.verify()
    print(f"   {'ok' if report.ok else 'FAILED'}: {report.cases_checked} case(s), "
          f"{report.events_checked} hash-chained event(s), {len(report.findings)} finding(s)")
    for event in ex.ledger.events(case)[:6]:
        print(f"   {event.seq:>3} {event.kind:<16} {event.digest[:23]}... "
              f"<- {event.prev_digest[:16]}...")


def _crash_demo(ex: Executor, folder: Path, agent: str) -> None:
    _say("5. a crash: a `capgate call` process is killed (SIGKILL) after attempt_started")
    from capgate.commands_resume import crash_and_resume_demo

    config = _demo_config(folder)
    for line in crash_and_resume_demo(config, who=agent):
        print(f"   {line}")


def _demo_config(folder: Path) -> Path:
    """The demo's executor as configuration, for the child process the crash kills."""
    grants = folder / "grants.toml"
    lines = []
    for name, spec in DEMO_GRANTS["principals"].items():
        lines.append(f'[principals."{name}"]')
        if "roles" in spec:
            lines.append(f"roles = {json.dumps(spec['roles'])}")
        if "grants" in spec:
            items = ", ".join(
                f'{{ connector = "{g["connector"]}", '
                f'environments = {json.dumps(g["environments"])}, access = "{g["access"]}" }}'
                for g in spec["grants"])
            lines.append(f"grants = [{items}]")
    grants.write_text("\n".join(lines) + "\n", "utf-8")
    config = folder / "capgate.toml"
    caps = Path(DEFAULT_PATH).resolve()
    target = f"sqlite:///{folder / 'insurance.db'}"
    config.write_text(
        "[capgate]\n"
        f"capabilities = [{json.dumps(str(caps))}]\n"
        'grants = "grants.toml"\n'
        f'ledger = "sqlite:///{folder / "ledger.db"}"\n'
        f'[connectors.insurance]\nurl = "{target}"\nenvironment = "dev"\n'
        f'[connectors.insurance_code]\nurl = "{target}"\nenvironment = "dev"\n', "utf-8")
    return config
