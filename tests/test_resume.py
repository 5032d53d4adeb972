"""Resume: ambiguity fails closed, recovery policies, the poisoned resume, the CLI.

Every in-flight intent here is made by a real child process killed (SIGKILL)
at a real boundary (``tests/crash_child.py``); the evidence is then shaped
the way a real fault would: a marker whose fingerprint is not the request's,
a transaction id ``pg_xact_status`` cannot answer for, a recorded server
identity that is not the server's any more (re-recorded through the ledger,
so the chain still verifies), a target changed by someone outside the case.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.recovery.evidence import Facts, Pending, classify
from capgate.executor.recovery.resume import resolve_escalation, resume, resume_many
from capgate.registry.errors import (
    CaseConflict,
    LedgerTampered,
    ReconciliationRequired,
    UnknownCase,
    UsageError,
)
from capgate.registry.loader import load_registry
from capgate.registry.vocabulary import Classification
from tests.crash_child import Zygote
from tests.fix_capgate import CAPABILITIES, ROOT

pytestmark = pytest.mark.crash


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def url_text(url: URL | str) -> str:
    return url.render_as_string(hide_password=False) if isinstance(url, URL) else url


def scalar(ex: Executor, sql: str, **binds: Any) -> Any:
    with ex.connectors.get("insurance").engine.connect() as conn:
        return conn.execute(sa.text(sql), binds).scalar_one()


def notes(ex: Executor, body: str) -> int:
    return int(scalar(ex, "SELECT count(*) FROM policy_note WHERE body = :b", b=body))


class Crash:
    """One target, one ledger, and a child process that dies on request."""

    def __init__(self, target: URL, tmp: Path, gate: Callable[..., Executor], zygote: Zygote,
                 capabilities: list[str] | None = None):
        self.target = target
        self.ledger = f"sqlite:///{tmp / 'ledger.db'}"
        self.tmp = tmp
        self.zygote = zygote
        self.capabilities = capabilities
        self.ex = gate(target, self.ledger)
        if capabilities:
            self.ex = Executor(load_registry(capabilities, check_lock=False),
                               self.ex.connectors, self.ex.ledger, self.ex.grants)

    def call(self, case: str, inputs: dict[str, Any], *, operation: str = "policy.add_note",
             crash_at: str | None = None, stop_at: str | None = None) -> str:
        """Run the call in a child; return the intent id it left in the ledger."""
        before = set((self.ex.ledger.snapshot(case) or {}).get("intents", {}))
        spec = {"target": url_text(self.target), "ledger": self.ledger,
                "operation": operation, "inputs": inputs, "case": case, "who": "agent",
                "out": str(self.tmp / "out.json"), "crash_at": crash_at, "stop_at": stop_at,
                "capabilities": self.capabilities}
        ended = self.zygote.run(spec)
        assert ended.killed if crash_at else True, ended
        after = (self.ex.ledger.snapshot(case) or {}).get("intents", {})
        (intent_id,) = set(after) - before
        return str(intent_id)

    def rerecord_tx(self, case: str, intent_id: str, **changes: Any) -> None:
        """Re-record the attempt's transaction identity through the ledger (chain intact)."""
        state = self.ex.ledger.intent(case, intent_id)
        self.ex.ledger.append(case, "attempt_started", {"state": {
            "attempt": state["attempt"], "tx": {**state["tx"], **changes}}},
            intent_id=intent_id)


@pytest.fixture
def crash(target_url: URL, tmp_path: Path, gate: Callable[..., Executor],
          zygote: Zygote) -> Crash:
    return Crash(target_url, tmp_path, gate, zygote)


@pytest.fixture
def sqlite_crash(sqlite_url: URL, tmp_path: Path, gate: Callable[..., Executor],
                 zygote: Zygote) -> Crash:
    return Crash(sqlite_url, tmp_path, gate, zygote)


@pytest.fixture
def pg_crash(pg_url: URL, tmp_path: Path, gate: Callable[..., Executor],
             zygote: Zygote) -> Crash:
    return Crash(pg_url, tmp_path, gate, zygote)


NOTE: dict[str, Any] = {"policy_id": 1, "author": "jdoe", "body": "the note"}


def assert_parked(c: Crash, case: str, intent_id: str, body: str, landed: int) -> None:
    """Unknown: escalated, open, visible, nothing retried, and the case refuses new work."""
    report = resume(c.ex, case)
    (only,) = report.intents
    assert only.intent_id == intent_id
    assert (only.classification, only.action) == ("unknown", "escalated"), only
    assert report.exit_code == 3 and not report.resolved
    assert notes(c.ex, body) == landed, "nothing retried"
    assert c.ex.ledger.intent(case, intent_id)["status"] == "escalated"
    assert case in [s.case_id for s in c.ex.ledger.cases(open_only=True)]
    with pytest.raises(ReconciliationRequired):
        c.ex.call("policy.add_note", {**NOTE, "policy_id": 2}, case=case, who="agent")
    again = resume(c.ex, case)
    assert again.intents[0].action == "still_escalated"
    assert sum(e.kind == "escalated" for e in c.ex.ledger.events(case)) == 1
    assert notes(c.ex, body) == landed
    assert c.ex.ledger.verify().ok


# --- ambiguity fails closed ---------------------------------------------------------------


def test_marker_with_another_fingerprint_is_unknown(crash: Crash) -> None:
    case = "AMB-FP"
    intent = crash.call(case, NOTE, crash_at="after_commit")
    with crash.ex.connectors.get("insurance").engine.begin() as conn:
        conn.execute(sa.text("UPDATE capgate_landed SET fingerprint = 'sha256:another'"
                             " WHERE intent_id = :i"), {"i": intent})
    assert_parked(crash, case, intent, NOTE["body"], landed=1)
    report = resume(crash.ex, case, act=False)
    assert report.intents[0].evidence["marker"] == "mismatch"
    # A person looks, decides, and the case continues; a replay returns the decision.
    resolve_escalation(crash.ex, case, intent, by="alice", decision="applied",
                       note="checked the note by hand")
    assert resume(crash.ex, case).exit_code == 0
    replay = crash.ex.call("policy.add_note", NOTE, case=case, who="agent")
    assert replay.replayed and replay.status == "applied_verified"
    assert notes(crash.ex, NOTE["body"]) == 1


@pytest.mark.parametrize("xid", ["3", "999999999999"], ids=["xid_too_old", "xid_in_future"])
def test_no_answer_from_pg_xact_status_is_unknown(pg_crash: Crash, xid: str) -> None:
    case = f"AMB-XID-{xid}"
    intent = pg_crash.call(case, NOTE, crash_at="before_commit")
    pg_crash.rerecord_tx(case, intent, xid=xid)
    report = resume(pg_crash.ex, case, act=False)
    assert report.intents[0].evidence.get("commit_outcome") is None
    assert_parked(pg_crash, case, intent, NOTE["body"], landed=0)


@pytest.mark.parametrize("change", [{"system_identifier": "7000000000000000001"},
                                    {"timeline": 99}], ids=["system_identifier", "timeline"])
def test_changed_server_identity_is_unknown(pg_crash: Crash, change: dict[str, Any]) -> None:
    case = f"AMB-SYS-{next(iter(change))}"
    intent = pg_crash.call(case, NOTE, crash_at="before_commit")
    pg_crash.rerecord_tx(case, intent, **change)
    report = resume(pg_crash.ex, case, act=False)
    assert report.intents[0].evidence["server_identity"] == "changed"
    assert "server identity changed" in report.intents[0].evidence["rule"]
    assert_parked(pg_crash, case, intent, NOTE["body"], landed=0)


def test_changed_mariadb_server_is_unknown(mariadb_url: URL, tmp_path: Path,
                                           gate: Callable[..., Executor], zygote: Zygote) -> None:
    c = Crash(mariadb_url, tmp_path, gate, zygote)
    case = "AMB-MARIADB"
    intent = c.call(case, NOTE, crash_at="before_commit")
    c.rerecord_tx(case, intent, server_started=1)  # another incarnation (restart or restore)
    assert_parked(c, case, intent, NOTE["body"], landed=0)


def test_a_marker_for_the_key_from_another_intent_is_unknown(crash: Crash) -> None:
    case = "AMB-KEY"
    intent = crash.call(case, NOTE, crash_at="before_commit")
    with crash.ex.connectors.get("insurance").engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO capgate_landed (intent_id, idem_key, fingerprint, attempt, case_id,"
            " operation_id, landed_at) VALUES ('someone-else', :k, 'sha256:x', 1, 'OTHER',"
            " 'policy.add_note', '2026-01-01')"),
            {"k": crash.ex.ledger.intent(case, intent)["idempotency_key"]})
    assert_parked(crash, case, intent, NOTE["body"], landed=0)


def test_an_edited_ledger_is_refused(crash: Crash) -> None:
    case = "TAMPER"
    crash.call(case, NOTE, crash_at="after_attempt_started")
    engine = sa.create_engine(crash.ledger)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE cg_events SET payload = replace(payload, 'jdoe', 'mallory')"
                             " WHERE case_id = :c AND kind = 'prepared'"), {"c": case})
    engine.dispose()
    with pytest.raises(LedgerTampered):
        resume(crash.ex, case)
    assert notes(crash.ex, NOTE["body"]) == 0


# --- recovery policies -------------------------------------------------------------------


NEVER_RETRY = textwrap.dedent("""\
    format: 1
    connectors:
      insurance:
        description: the insurance back office
        dialects: [sqlite, postgresql, mariadb]
    rows:
      - operation_id: policy.add_note_once
        version: 1
        connector: insurance
        description: Append a note; never retried automatically after a fault.
        input:
          type: object
          additionalProperties: false
          required: [policy_id, author, body]
          properties:
            policy_id: {type: integer, minimum: 1}
            author: {type: string, minLength: 1, maxLength: 40}
            body: {type: string, minLength: 1, maxLength: 500}
        target: {system: insurance, object: policy_note, keys: [policy_id]}
        effect_class: transactional
        shape: collapsed
        authorization: {kind: write_grant}
        environments: [dev]
        idempotency_key: "{case}:{operation_id}:{policy_id}"
        timeout: {seconds: 5, on_timeout: rolled_back}
        recovery: never_retry
        statements:
          - name: insert_note
            sql: >
              INSERT INTO policy_note (policy_id, author, body)
              VALUES (:policy_id, :author, :body)
            expect_rows: 1
        evidence: [counts, marker]
    """)


@pytest.mark.parametrize("point,classification,action,outcome", [
    ("before_commit", "not_applied", "closed_not_applied", "rolled_back"),
    ("after_commit", "applied", "recorded_applied", "applied_verified"),
])
def test_never_retry_closes_without_retrying(target_url: URL, tmp_path: Path,
                                             gate: Callable[..., Executor], zygote: Zygote,
                                             point: str, classification: str, action: str,
                                             outcome: str) -> None:
    extra = tmp_path / "caps"
    extra.mkdir()
    (extra / "once.yaml").write_text(NEVER_RETRY, "utf-8")
    c = Crash(target_url, tmp_path, gate, zygote, [str(CAPABILITIES), str(extra)])
    case = f"ONCE-{point}"
    c.call(case, NOTE, operation="policy.add_note_once", crash_at=point)
    report = resume(c.ex, case)
    (only,) = report.intents
    assert (only.classification, only.action, only.outcome) == (classification, action, outcome)
    assert report.exit_code == 0
    landed = 1 if classification == "applied" else 0
    assert notes(c.ex, NOTE["body"]) == landed
    replay = c.ex.call("policy.add_note_once", NOTE, case=case, who="agent")
    assert replay.replayed and replay.status == outcome
    assert notes(c.ex, NOTE["body"]) == landed, "never retried, not even by a replay"
    assert c.ex.ledger.verify().ok


def test_reconcile_first_is_retried_after_reconciliation(crash: Crash) -> None:
    case = "RF"
    inputs = {"policy_id": 2, "series": "END", "kind": "endorsement", "request_ref": "REQ-RF-1"}
    crash.call(case, inputs, operation="document.issue", crash_at="before_commit")
    report = resume(crash.ex, case)
    (only,) = report.intents
    assert (only.classification, only.action, only.outcome) == \
        ("not_applied", "retried", "applied_verified")
    assert only.evidence["probe"] == "absent"  # the row's landed probe agreed
    kinds = [e.kind for e in crash.ex.ledger.events(case)
             if e.kind not in ("recovery_point", "continuation")]  # resume's verdict (issue 17)
    assert kinds[-4:] == ["retrying", "attempt_started", "observed", "post_commit_checked"] or \
        kinds[-3:] == ["retrying", "attempt_started", "observed"]
    assert scalar(crash.ex, "SELECT count(*) FROM issued_document WHERE request_ref = :r",
                  r="REQ-RF-1") == 1


def test_an_intent_killed_after_prepared_was_never_sent(crash: Crash) -> None:
    """Killed after ``prepared``: nothing of the row was sent, and the evidence says so.

    (A collapsed call's ``prepared`` records its first attempt, the transaction
    opened just before -- issue 13 -- so the evidence is asked: no marker, and the
    transaction is over.)
    """
    case = "PREPARED"
    crash.call(case, NOTE, crash_at="after_prepared")
    report = resume(crash.ex, case, act=False)
    (only,) = report.intents
    assert only.classification == "not_applied"
    assert only.evidence["marker"] == "absent", only.evidence
    assert report.intents[0].action == "none" and not report.acted
    assert crash.ex.ledger.intent(case, only.intent_id)["status"] == "prepared"  # dry run
    assert notes(crash.ex, NOTE["body"]) == 0


# --- the poisoned resume -----------------------------------------------------------------


def test_a_target_changed_under_the_case_stops_the_resume(crash: Crash) -> None:
    case = "POISON"
    first = crash.ex.call("policy.add_note", NOTE, case=case, who="agent")
    assert first.status == "applied_verified"
    claim = {"policy_id": 2, "claim_ref": "CLM-2026-101", "reported_on": "2026-11-01",
             "amount": 900}
    intent = crash.call(case, claim, operation="claim.register", crash_at="before_commit")
    with crash.ex.connectors.get("insurance").engine.begin() as conn:  # someone else
        conn.execute(sa.text("UPDATE policy SET status = 'void' WHERE policy_id = 1"))

    report = resume(crash.ex, case)
    (held,) = report.intents
    assert (held.intent_id, held.classification, held.action) == (intent, "not_applied", "held")
    (changed,) = report.changed_outside_case
    assert changed["intent_id"] == first.intent_id
    assert [c["name"] for c in changed["checks"] if not c["ok"]] == ["policy_not_void"]
    assert report.exit_code == 3
    assert crash.ex.ledger.intent(case, first.intent_id)["status"] == "changed_outside_case"
    assert scalar(crash.ex, "SELECT count(*) FROM claim WHERE claim_ref = 'CLM-2026-101'") == 0
    assert "CHANGED OUTSIDE THE CASE" in "\n".join(report.lines())
    with pytest.raises(ReconciliationRequired):
        crash.ex.call("policy.add_note", {**NOTE, "policy_id": 5}, case=case, who="agent")

    with crash.ex.connectors.get("insurance").engine.begin() as conn:  # put right again
        conn.execute(sa.text("UPDATE policy SET status = 'active' WHERE policy_id = 1"))
    report = resume(crash.ex, case)
    assert report.exit_code == 0 and not report.changed_outside_case
    assert report.intents[0].action == "retried"
    assert crash.ex.ledger.intent(case, first.intent_id)["status"] == "reconciled"
    assert scalar(crash.ex, "SELECT count(*) FROM claim WHERE claim_ref = 'CLM-2026-101'") == 1
    assert crash.ex.ledger.verify().ok


def test_a_person_accepts_a_changed_target(crash: Crash) -> None:
    case = "ACCEPT"
    first = crash.ex.call("policy.add_note", NOTE, case=case, who="agent")
    with crash.ex.connectors.get("insurance").engine.begin() as conn:
        conn.execute(sa.text("UPDATE policy SET status = 'void' WHERE policy_id = 1"))
    assert resume(crash.ex, case).exit_code == 3
    with pytest.raises(UsageError):
        resolve_escalation(crash.ex, case, first.intent_id, by="alice", decision="applied")
    resolve_escalation(crash.ex, case, first.intent_id, by="alice", decision="accepted",
                       note="voided on purpose by underwriting")
    assert not crash.ex.ledger.cases(open_only=True)
    assert crash.ex.call("policy.add_note", {**NOTE, "policy_id": 5}, case=case,
                         who="agent").status == "applied_verified"


def test_the_rechecks_read_in_one_batch_read_what_one_by_one_would(target_url: URL) -> None:
    """``Dialect.read_many`` (pipelined on PostgreSQL) answers each statement with its own
    rows, binds and SQLAlchemy's text syntax exactly as ``conn.execute(sa.text())``."""
    from capgate.executor.dialects import dialect_for

    engine = sa.create_engine(target_url, poolclass=sa.pool.NullPool)
    dialect = dialect_for(engine.dialect.name)
    if target_url.get_backend_name() == "oracle":
        statements = [("SELECT :a FROM dual", {"a": 1}),
                      ("SELECT 'x:y' || :b FROM dual", {"b": "\U0001f600"})]
    else:
        statements = [("SELECT :a", {"a": 1}),
                      ("SELECT 'x:y' || :b", {"b": "\U0001f600"}),
                      ("SELECT :n + 1 UNION ALL SELECT :n + 2 UNION ALL SELECT :n + 3",
                       {"n": 2**53 - 10}),
                      ("SELECT '100%' WHERE 1 = :one", {"one": 1}),
                      ("SELECT 1 WHERE 1 = :zero", {"zero": 0})]
    try:
        with engine.connect() as conn:
            one_by_one = [[tuple(r) for r in conn.execute(sa.text(sql), binds).fetchmany(2)]
                          for sql, binds in statements]
            batched = [[tuple(r) for r in rows]
                       for rows in dialect.read_many(conn, statements, 2)]
            conn.rollback()
    finally:
        engine.dispose()
    assert batched == one_by_one
    assert len(batched[0]) == 1 and batched[-1] == []


# --- identity of the case ------------------------------------------------------------------


def test_a_task_id_reused_for_another_task_is_refused(crash: Crash) -> None:
    case = "TASK"
    crash.call(case, NOTE, crash_at="after_attempt_started")
    crash.ex.ledger.append(case, "case_opened", {"case_state": {"task": "TICKET-1"}})
    with pytest.raises(CaseConflict):
        resume(crash.ex, case, task="TICKET-2")
    assert notes(crash.ex, NOTE["body"]) == 0
    assert resume(crash.ex, case, task="TICKET-1").exit_code == 0


def test_unknown_case_and_clean_case(crash: Crash) -> None:
    with pytest.raises(UnknownCase):
        resume(crash.ex, "NO-SUCH-CASE")
    crash.ex.call("policy.add_note", NOTE, case="CLEAN", who="agent")
    report = resume(crash.ex, "CLEAN")
    assert report.intents == () and report.exit_code == 0


def test_resume_many_batches_across_cases(crash: Crash) -> None:
    points = ["after_prepared", "before_commit", "after_commit"]
    for i, point in enumerate(points):  # three targets: a dead call keeps its claim
        crash.call(f"MANY-{i}", {**NOTE, "policy_id": (1, 2, 5)[i], "body": f"many {i}"},
                   crash_at=point)
    report = resume_many(crash.ex)
    assert sorted(report.case_ids) == [f"MANY-{i}" for i in range(3)]
    assert report.counts() == {"not_applied": 2, "applied": 1}
    assert report.exit_code == 0
    assert all(notes(crash.ex, f"many {i}") == 1 for i in range(3))
    # resume freed the dead calls' impact claims: another case may write policy 1 now
    assert crash.ex.call("policy.add_note", {**NOTE, "body": "next"}, case="MANY-NEXT",
                         who="agent").status == "applied_verified"


# --- the rules, as a table ------------------------------------------------------------------


def pending(attempted: bool = True, idem: str | None = "k") -> Pending:
    state: dict[str, Any] = {"status": "attempt_started" if attempted else "prepared",
                             "attempt": 1 if attempted else 0, "idempotency_key": idem,
                             "fingerprint": "f", "tx": {"dialect": "x"} if attempted else None}
    return Pending("C", "i", state, 0)


@pytest.mark.parametrize("facts,attempted,idem,expected", [
    (Facts(marker="present"), True, "k", "applied"),
    (Facts(marker="mismatch"), True, "k", "unknown"),
    (Facts(marker="other_intent"), True, "k", "unknown"),
    # prepared, no attempt recorded: its opening may have run -- settled only once no
    # session of it is alive (``Facts.opening``), never "nothing was sent" unasked
    (Facts(marker="absent", opening="none"), False, "k", "not_applied"),
    (Facts(marker="absent"), False, "k", "unknown"),
    (Facts(marker="absent", opening="alive"), False, "k", "unknown"),
    (Facts(marker="absent", opening="none", unreachable="down"), False, "k", "unknown"),
    (Facts(marker="present"), False, "k", "unknown"),
    (Facts(marker="present", probe="absent"), True, "k", "unknown"),
    (Facts(marker="absent", outcome="committed", finished=True), True, "k", "unknown"),
    (Facts(marker="not_written", outcome="committed", finished=True), True, None, "applied"),
    (Facts(marker="absent", outcome="aborted", finished=True), True, "k", "not_applied"),
    (Facts(marker="absent", outcome="in_progress", finished=False), True, "k", "unknown"),
    (Facts(marker="absent", finished=None), True, "k", "unknown"),
    (Facts(marker="absent", finished=True, identity="changed"), True, "k", "unknown"),
    (Facts(marker="absent", finished=True, probe="present"), True, "k", "unknown"),
    (Facts(marker="absent", outcome="committed_incomplete"), True, "k", "partly_applied"),
    (Facts(marker="absent", finished=True, probe="partial"), True, "k", "partly_applied"),
    (Facts(marker="not_written", finished=True), True, None, "unknown"),
    (Facts(marker="not_written", finished=True, probe="absent"), True, None, "not_applied"),
    (Facts(marker="not_written", finished=True, probe="present"), True, None, "applied"),
    (Facts(marker="absent", unreachable="down"), True, "k", "unknown"),
])
def test_classification_rules(facts: Facts, attempted: bool, idem: str | None,
                              expected: str) -> None:
    classification, rule = classify(pending(attempted, idem), facts)
    assert classification == Classification(expected), rule


# --- the command line ------------------------------------------------------------------------


def write_config(tmp: Path, target: URL, ledger: str) -> Path:
    (tmp / "grants.toml").write_text(
        '[principals.agent]\ngrants = [{ connector = "*", environments = ["dev"], '
        'access = "write" }]\n', "utf-8")
    url = url_text(target)
    config = tmp / "capgate.toml"
    config.write_text(textwrap.dedent(f"""\
        [capgate]
        capabilities = [{json.dumps(str(CAPABILITIES))}]
        grants = "grants.toml"
        ledger = {json.dumps(ledger)}
        agent = "agent"

        [connectors.insurance]
        url = {json.dumps(url)}
        environment = "dev"

        [connectors.insurance_code]
        url = {json.dumps(url)}
        environment = "dev"
        """), "utf-8")
    return config


def capgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capgate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_resume_json_and_exit_codes(sqlite_crash: Crash, tmp_path: Path) -> None:
    crash = sqlite_crash  # the evidence per engine is covered above; this is the CLI
    config = str(write_config(tmp_path, crash.target, crash.ledger))
    ok_case, bad_case = "CLI-OK", "CLI-BAD"
    crash.call(ok_case, NOTE, crash_at="before_commit")
    bad = crash.call(bad_case, {**NOTE, "policy_id": 5, "body": "bad"}, crash_at="after_commit")
    with crash.ex.connectors.get("insurance").engine.begin() as conn:
        conn.execute(sa.text("UPDATE capgate_landed SET fingerprint = 'sha256:x'"
                             " WHERE intent_id = :i"), {"i": bad})

    dry = capgate("resume", ok_case, "--dry-run", "--json", "--config", config)
    assert dry.returncode == 3 and json.loads(dry.stdout)["dry_run"] is True
    done = capgate("resume", ok_case, "--json", "--config", config)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["case"] == ok_case
    (item,) = body["intents"]
    assert {"intent_id", "classification", "evidence", "action"} <= set(item)
    assert (item["classification"], item["action"]) == ("not_applied", "retried")

    parked = capgate("resume", bad_case, "--config", config)
    assert parked.returncode == 3
    assert "unknown" in parked.stdout and "NOT RESOLVED" in parked.stdout
    shown = capgate("ledger", "show", bad_case, "--config", config)
    assert "escalated" in shown.stdout
    open_cases = capgate("cases", "--open", "--config", config)
    assert bad_case in open_cases.stdout and ok_case not in open_cases.stdout
    refused = capgate("call", "policy.add_note", "--input", json.dumps({**NOTE, "policy_id": 2}),
                      "--case", bad_case, "--config", config)
    assert refused.returncode == 3 and "CG400" in refused.stderr
    resolved = capgate("resume", bad_case, "--resolve", bad, "--decision", "applied",
                       "--by", "alice", "--note", "checked", "--config", config)
    assert resolved.returncode == 0, resolved.stderr
    assert capgate("resume", "--all", "--config", config).returncode == 0
    assert capgate("ledger", "verify", "--config", config).returncode == 0


def test_crash_and_resume_demo(sqlite_url: URL, tmp_path: Path,
                               gate: Callable[..., Executor]) -> None:
    from capgate.commands.demo import crash_and_resume_demo

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    gate(sqlite_url, ledger)  # the example schema on the target
    config = write_config(tmp_path, sqlite_url, ledger)
    lines = crash_and_resume_demo(config, case="DEMO-1")
    text = "\n".join(lines)
    assert "killed with SIGKILL at after_attempt_started" in text
    assert "refused: CG400" in text
    assert "not_applied" in text and "retried" in text
    assert "ok: every intent resolved" in text
    assert text.count("applied_verified") >= 2
    assert lines[-1].strip().startswith("ok:")


@pytest.mark.parametrize("point", ["after_attempt_started", "before_commit", "after_commit"])
def test_a_leased_call_is_resumed_through_the_lease(crash: Crash, point: str) -> None:
    case = f"LEASED-{point}"
    inputs: dict[str, Any] = {"policy_id": 1, "cancel_date": "2024-08-15", "author": "jdoe",
                              "reason": f"sold the house ({point})"}
    crash.call(case, inputs, operation="policy.cancel", crash_at=point)
    report = resume(crash.ex, case)
    (only,) = report.intents
    expected = ("applied", "recorded_applied") if point == "after_commit" else \
        ("not_applied", "retried")
    assert (only.classification, only.action) == expected, only
    assert only.outcome == "applied_verified" and report.exit_code == 0
    assert scalar(crash.ex, "SELECT status FROM policy WHERE policy_id = 1") == "cancelled"
    assert notes(crash.ex, inputs["reason"]) == 1
    assert scalar(crash.ex, "SELECT count(*) FROM premium WHERE policy_id = 1 AND paid = 0"
                            " AND due_date > '2024-08-15'") == 0
    assert crash.ex.ledger.verify().ok
