"""Cases that coordinate (issue 17): case-held claims, coordination decisions, fencing.

Real databases, real processes.  A case claims a write's impact keys at its
first plan or write and holds them across its calls; a second case touching
them is refused with CG330 and one coordination decision is recorded in both
cases' ledgers; a person decides (signed) -- wait, hand over, override -- and
that is recorded in both too.  Fencing tokens keep working across the longer
claims: a stopped process woken after its claim was taken over cannot land
its write.

Also the shared support of the issue-17 suites (no tests of its own there):
``LAB_ROWS`` (test-only rows with a symptom, dimensions, a 1 s timeout),
``coord_executor`` and a child process mode::

    python -m tests.test_coordination calls SPEC_JSON

runs a list of calls (after a common start time), optionally stopping itself
with SIGSTOP at a boundary of one of them, and prints what each call got.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from capgate.executor import cases
from capgate.executor.call import Executor
from capgate.executor.claims import store_for
from capgate.registry import errors
from tests.fix_capgate import KEYS, make_executor
from tests.fix_db import engine_params

ROOT = Path(__file__).resolve().parent.parent

LAB_ROWS = """
format: 1
connectors: {insurance: {}}
rows:
  - operation_id: lab.ticket_set
    version: 1
    connector: insurance
    description: Set a lab ticket's status (test-only); its screen shows the status.
    input:
      type: object
      additionalProperties: false
      required: [ticket_id, status]
      properties:
        ticket_id: {type: integer}
        status: {type: string, minLength: 1, maxLength: 20}
    target: {system: lab, object: ticket, keys: [ticket_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{operation_id}:{ticket_id}:{status}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: set_status
        sql: "UPDATE lab_ticket SET status = :status, modified_by = 'capgate'
              WHERE ticket_id = :ticket_id"
        expect_rows: 1
    verify:
      - name: status_set
        sql: "SELECT count(*) FROM lab_ticket WHERE ticket_id = :ticket_id AND status = :status"
        expect: {value: 1}
    symptom:
      sql: "SELECT status FROM lab_ticket WHERE ticket_id = :ticket_id"
      actor: {sql: "SELECT modified_by FROM lab_ticket WHERE ticket_id = :ticket_id"}

  - operation_id: lab.count
    version: 1
    connector: insurance
    description: Count one unit of work on a lab counter (test-only); a 1 s timeout.
    input:
      type: object
      additionalProperties: false
      required: [target_id, call_ref]
      properties:
        target_id: {type: integer}
        call_ref: {type: string, minLength: 1, maxLength: 60}
    target: {system: lab, object: counter, keys: [target_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{call_ref}"
    timeout: {seconds: 1, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: bump
        sql: "UPDATE lab_counter SET n = n + 1 WHERE target_id = :target_id"
        expect_rows: 1

  - operation_id: lab.tariff_set
    version: 1
    connector: insurance
    description: "Change one tariff of a product version (test-only); the product version
      as a whole is affected."
    input:
      type: object
      additionalProperties: false
      required: [tariff_id, product, product_version, rate]
      properties:
        tariff_id: {type: integer}
        product: {type: string, minLength: 1, maxLength: 20}
        product_version: {type: integer}
        rate: {type: integer}
    target:
      system: lab
      object: tariff
      keys: [tariff_id]
      dimensions: {product: product, version: product_version}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{operation_id}:{tariff_id}:{rate}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: set_rate
        sql: "UPDATE lab_tariff SET rate = :rate WHERE tariff_id = :tariff_id
              AND product = :product AND product_version = :product_version"
        expect_rows: 1
"""

LAB_DDL = [
    "CREATE TABLE lab_ticket (ticket_id INTEGER NOT NULL PRIMARY KEY,"
    " status VARCHAR(20) NOT NULL, modified_by VARCHAR(40) NOT NULL)",
    "CREATE TABLE lab_tariff (tariff_id INTEGER NOT NULL PRIMARY KEY,"
    " product VARCHAR(20) NOT NULL, product_version INTEGER NOT NULL, rate INTEGER NOT NULL)",
    "CREATE TABLE lab_counter (target_id INTEGER NOT NULL PRIMARY KEY, n INTEGER NOT NULL)",
]

CASE_MODE = {"case_claim_seconds": 60.0}
"""Connector options of the suites that test case-held claims."""


def coord_registry() -> Any:
    from capgate.registry.loader import validate_texts
    from capgate.registry.registry import Registry
    from tests.fix_capgate import registry

    result = validate_texts([("coordination.yaml", LAB_ROWS)])
    result.raise_for_problems()
    return Registry(list(registry().rows()) + list(result.rows))


def coord_executor(target: URL | str, ledger: URL | str, *, schema: bool = True,
                   **opts: Any) -> Executor:
    ex = make_executor(target, ledger, schema=schema, **{**CASE_MODE, **opts})
    ex.registry = coord_registry()
    return ex


def coord_schema(url: URL | str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            for ddl in LAB_DDL:
                conn.execute(sa.text(ddl))
            conn.execute(sa.text("INSERT INTO lab_ticket VALUES (:t, 'open', 'customer')"),
                         [{"t": t} for t in (1, 2, 3)])
            conn.execute(sa.text("INSERT INTO lab_tariff VALUES (:t, :p, :v, 100)"),
                         [{"t": 1, "p": "home", "v": 1}, {"t": 2, "p": "home", "v": 1},
                          {"t": 3, "p": "home", "v": 2}])
            conn.execute(sa.text("INSERT INTO lab_counter VALUES (:t, 0)"),
                         [{"t": t} for t in (1, 2, 3)])
    finally:
        engine.dispose()


def url_text(url: URL | str) -> str:
    return make_url(url).render_as_string(hide_password=False)


def scalar(url: URL | str, sql: str, **binds: Any) -> Any:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql), binds).scalar()
    finally:
        engine.dispose()


def rows(url: URL | str, sql: str, **binds: Any) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql), binds)]
    finally:
        engine.dispose()


def kinds(ex: Executor, case: str) -> list[str]:
    return [e.kind for e in ex.ledger.events(case)]


def events_of(ex: Executor, case: str, kind: str) -> list[Mapping[str, Any]]:
    return [e.payload for e in ex.ledger.events(case) if e.kind == kind]


# --- the child process ------------------------------------------------------------------


def spawn(spec: Mapping[str, Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.test_coordination", "calls",
                             json.dumps(spec)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err[-3000:]}"
    result: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])
    return result


def _child_calls(spec: Mapping[str, Any]) -> int:
    from tests.crash_child import _install_stop

    ex = coord_executor(spec["target"], spec["ledger"], schema=False,
                        **spec.get("opts", {}))
    ex.connectors.get("insurance").check_target()
    ex.ledger.snapshot("warm-up")
    start_at = float(spec.get("start_at", 0))
    while time.time() < start_at:
        time.sleep(0.002)
    results: list[dict[str, Any]] = []
    for i, call in enumerate(spec["calls"]):
        if spec.get("stop_at") and i == int(spec.get("stop_call", 0)):
            _install_stop(spec["stop_at"])
        try:
            out = ex.call(call["operation"], call["inputs"], case=call["case"],
                          who=call.get("who", "agent"))
            results.append({"status": out.status, "intent": out.intent_id,
                            "reason": out.reason, "at": time.time()})
        except errors.CapgateError as exc:
            results.append({"status": "refused", "code": exc.code,
                            "details": exc.details, "at": time.time()})
        pause = float(spec.get("pause", 0))
        if pause:
            time.sleep(pause)
    print(json.dumps(results, default=str))
    ex.connectors.dispose()
    ex.ledger.close()
    return 0


def main(argv: Sequence[str]) -> int:
    mode, raw = argv[0], argv[1]
    return {"calls": _child_calls}[mode](json.loads(raw))


# --- fixtures ---------------------------------------------------------------------------


def server_url(request: pytest.FixtureRequest) -> URL:
    """The ``server_target`` fixture's body (parametrised over PostgreSQL and MariaDB)."""
    url: URL = request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param])
    return url


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_target(request: pytest.FixtureRequest) -> URL:
    return server_url(request)


@pytest.fixture
def shared_ledger(pg_ledger_url: URL) -> URL:
    """A PostgreSQL ledger of its own (a fresh schema): every process shares it."""
    return pg_ledger_url


@pytest.fixture
def made(tmp_path: Path) -> Iterator[Any]:
    yield from executors(tmp_path)


def executors(tmp_path: Path) -> Iterator[Any]:
    """The ``made`` fixture's body: executors a test builds (the first one lays out the
    schema), closed afterwards."""
    built: list[Executor] = []

    def make(target: URL | str, ledger: URL | str | None = None, **opts: Any) -> Executor:
        ex = coord_executor(target, ledger or f"sqlite:///{tmp_path / 'ledger.db'}",
                            schema=not built or opts.pop("schema", False), **opts)
        built.append(ex)
        return ex

    yield make
    for ex in built:
        ex.connectors.dispose()
        ex.ledger.close()


def _first_target(url: URL | str) -> URL | str:
    coord_schema(url)
    return url


# --- the rows ----------------------------------------------------------------------------


def test_rows_declare_dimensions_and_symptoms_as_data() -> None:
    from capgate.executor.plan import impact_keys
    from capgate.registry.loader import validate_texts

    reg = coord_registry()
    tariff = reg.resolve("lab.tariff_set")
    keys = impact_keys(tariff, {"tariff_id": 1, "product": "home", "product_version": 2,
                                "rate": 5}, "dev")
    assert keys == ["dev/lab/tariff/tariff_id=1", "dev/lab/product=home/version=2"]
    ticket = reg.resolve("lab.ticket_set")
    assert ticket.symptom is not None and ticket.symptom.actor_sql is not None
    assert impact_keys(ticket, {"ticket_id": 3}, "dev") == ["dev/lab/ticket/ticket_id=3"]
    # a row without dimensions keeps exactly the keys it had
    note = reg.resolve("policy.add_note")
    assert impact_keys(note, {"policy_id": 4}, "qa") == ["qa/insurance/policy_note/policy_id=4"]

    def problems(text: str) -> list[tuple[str, str]]:
        result = validate_texts([("bad.yaml", text)])
        return [(p.code, p.field) for p in result.problems]

    bad_dimension = LAB_ROWS.replace("dimensions: {product: product, version: product_version}",
                                     "dimensions: {version: product_version, account: who}")
    found = problems(bad_dimension)
    assert ("CG121", "target.dimensions.account") in found  # not an input
    assert ("CG121", "target.dimensions.version") in found  # a version needs its product
    writing = LAB_ROWS.replace('sql: "SELECT status FROM lab_ticket WHERE ticket_id = :ticket_id"',
                               'sql: "DELETE FROM lab_ticket WHERE ticket_id = :ticket_id"')
    assert ("CG117", "symptom.sql") in problems(writing)
    unbound = LAB_ROWS.replace("SELECT modified_by FROM lab_ticket WHERE ticket_id = :ticket_id",
                               "SELECT modified_by FROM lab_ticket WHERE ticket_id = :nope")
    assert ("CG110", "symptom.actor.sql") in problems(unbound)
    unknown_dim = LAB_ROWS.replace("dimensions: {product: product, version: product_version}",
                                   "dimensions: {planet: product}")
    assert any(code == "CG102" or code == "CG101" for code, _ in problems(unknown_dim))


# --- one process ----------------------------------------------------------------------------


def test_a_case_holds_its_keys_across_calls_and_a_second_case_gets_one_decision(
        made: Any, target_url: URL, ledger_url: URL) -> None:
    ex = made(_first_target(target_url), ledger_url)
    store = store_for(ex)
    key = "dev/lab/counter/target_id=1"
    for i in range(3):
        out = ex.call("lab.count", {"target_id": 1, "call_ref": f"a-{i}"}, case="HOLDER",
                      who="agent")
        assert out.status == "applied_verified", out.reason
        held = store.current(key)
        assert held is not None and held["case_id"] == "HOLDER" and held["token"] == 1
        assert held["expires_in"] > 50  # the case's claim, renewed by every call
    decisions = set()
    for i in range(3):  # the agent retries: one decision, recorded once in each ledger
        with pytest.raises(errors.CoordinationRequired) as refused:
            ex.call("lab.count", {"target_id": 1, "call_ref": f"b-{i}"}, case="ASKER",
                    who="other-agent")
        assert refused.value.code == "CG330" and not refused.value.retryable
        assert isinstance(refused.value, errors.ImpactConflict)
        d, holder = refused.value.details, refused.value.holder
        assert (holder["case_id"], d["requested_by_case"], d["impact_key"], holder["token"]) \
            == ("HOLDER", "ASKER", key, 1)
        assert "case_id" not in d and "HOLDER" not in refused.value.message  # not the asker's
        decisions.add(d["decision_id"])
    (decision,) = decisions
    asked = events_of(ex, "ASKER", "coordination_requested")
    holder = events_of(ex, "HOLDER", "coordination_requested")
    assert len(asked) == 1 and len(holder) == 1
    assert asked[0]["coordination"]["role"] == "asker"
    assert holder[0]["coordination"]["role"] == "holder"
    for seen in (asked[0]["coordination"], holder[0]["coordination"]):
        assert seen["decision_id"] == decision and seen["keys"] == [key]
        assert seen["holder"]["case"] == "HOLDER" and seen["asker"]["case"] == "ASKER"
        assert seen["asker"]["who"] == "other-agent" and seen["holder"]["token"] == 1
    assert not (ex.ledger.snapshot("ASKER") or {}).get("intents")  # nothing prepared
    assert scalar(target_url, "SELECT n FROM lab_counter WHERE target_id = 1") == 3
    # reads never claim and are never blocked
    assert ex.call("policy.get", {"policy_id": 1}, case="ASKER", who="other-agent").status == "ok"
    # the fence row carries the case's one token across its calls
    assert rows(target_url, "SELECT impact_key, token FROM capgate_fence") == [(key, 1)]
    assert ex.ledger.verify().ok


def test_a_person_decides_and_the_decision_is_in_both_ledgers(made: Any, sqlite_url: URL
                                                             ) -> None:
    ex = made(_first_target(sqlite_url))
    key = "dev/lab/ticket/ticket_id=1"
    assert ex.call("lab.ticket_set", {"ticket_id": 1, "status": "a"}, case="H",
                   who="agent").status == "applied_verified"
    with pytest.raises(errors.CoordinationRequired) as refused:
        ex.call("lab.ticket_set", {"ticket_id": 1, "status": "b"}, case="W", who="other-agent")
    decision = refused.value.details["decision_id"]

    # bad input names the field and changes nothing
    bad: list[tuple[dict[str, Any], type[errors.CapgateError], str | None]] = [
        ({"decision": "shrug"}, errors.UsageError, "decision"),
        ({"decision": "override"}, errors.UsageError, "reason"),  # an override needs a reason
        ({"decision": "wait", "by": "other-agent"}, errors.SelfDecision, None),
        ({"decision": "wait", "by": "alice"}, errors.DecisionNotAuthenticated, None),  # bob's key
        ({"decision": "wait", "by": "agent"}, errors.DecisionNotAuthenticated, None),  # no key
    ]
    before = kinds(ex, "W"), kinds(ex, "H")
    for kw, error, field in bad:
        with pytest.raises(error) as caught:
            cases.decide(ex, "W", decision, **{"by": "bob", "key": KEYS["bob"], **kw})
        if field:
            assert caught.value.details.get("field") == field
    with pytest.raises(errors.UnknownDecision):
        cases.decide(ex, "W", "cd-nope", decision="wait", by="bob", key=KEYS["bob"])
    with pytest.raises(errors.UnknownDecision):  # decided on the asking case's record
        cases.decide(ex, "H", decision, decision="wait", by="bob", key=KEYS["bob"])
    assert (kinds(ex, "W"), kinds(ex, "H")) == before

    done = cases.decide(ex, "W", decision, decision="wait", by="bob", key=KEYS["bob"])
    assert done["tokens"] == {}
    with pytest.raises(errors.DecisionMade):
        cases.decide(ex, "W", decision, decision="hand_over", by="bob", key=KEYS["bob"])
    for case in ("W", "H"):
        (decided,) = events_of(ex, case, "coordination_decided")
        c = decided["coordination"]
        assert (c["decision"], c["by"], c["decision_id"]) == ("wait", "bob", decision)
        assert c["proof"]["public_key"] == KEYS["bob"].public_text and c["proof"]["signature"]
    (cont,) = events_of(ex, "W", "continuation")
    assert cont["continuation"]["decision"] == "withheld"
    assert cont["continuation"]["after"] == "coordination"
    with pytest.raises(errors.CoordinationRequired):  # waiting: still refused, same decision
        ex.call("lab.ticket_set", {"ticket_id": 1, "status": "b"}, case="W", who="other-agent")
    assert len(events_of(ex, "W", "coordination_requested")) == 1

    # the holder releases: the asking case may now claim it; a new hold, a new decision
    cases.release(ex, "H", by="agent")
    assert ex.call("lab.ticket_set", {"ticket_id": 1, "status": "b"}, case="W",
                   who="other-agent").status == "applied_verified"
    assert store_for(ex).current(key)["token"] == 2
    with pytest.raises(errors.CoordinationRequired) as again:
        ex.call("lab.ticket_set", {"ticket_id": 1, "status": "c"}, case="H", who="agent")
    assert again.value.details["decision_id"] != decision
    overridden = cases.decide(ex, "H", again.value.details["decision_id"], decision="override",
                              by="alice", key=KEYS["alice"], reason="the customer is waiting")
    assert overridden["tokens"] == {key: 3}
    assert ex.call("lab.ticket_set", {"ticket_id": 1, "status": "c"}, case="H",
                   who="agent").status == "applied_verified"
    assert rows(sqlite_url, "SELECT token FROM capgate_fence") == [(3,)]
    assert ex.ledger.verify().ok


def test_a_target_is_handed_over_only_between_the_holders_calls(made: Any, sqlite_url: URL
                                                               ) -> None:
    from tests.test_lease_support import ARRIVED, GATES, _gate, lab_registry, lab_schema

    ex = made(sqlite_url)
    ex.registry = lab_registry()
    lab_schema(sqlite_url)
    assert ex.call("lab.bump", {"target_id": 1, "call_ref": "h-0"}, case="BUSY",
                   who="agent").status == "applied_verified"
    with pytest.raises(errors.CoordinationRequired) as refused:
        ex.call("lab.bump", {"target_id": 1, "call_ref": "w-0"}, case="WANTS", who="other-agent")
    decision = refused.value.details["decision_id"]
    GATES.pop("handover", None)
    ARRIVED.pop("handover", None)
    go, arrived = _gate("handover")
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", ex.call(
        "lab.bump", {"target_id": 1, "call_ref": "h-1", "gate": "handover"}, case="BUSY",
        who="agent")))
    thread.start()
    assert arrived.wait(10)
    with pytest.raises(errors.HolderBusy):  # the holder's write is in flight
        cases.decide(ex, "WANTS", decision, decision="hand_over", by="bob", key=KEYS["bob"])
    go.set()
    thread.join(20)
    assert result["out"].status == "applied_verified"
    done = cases.decide(ex, "WANTS", decision, decision="hand_over", by="bob", key=KEYS["bob"])
    assert done["tokens"] == {"dev/lab/counter/target_id=1": 2}
    assert ex.call("lab.bump", {"target_id": 1, "call_ref": "w-0"}, case="WANTS",
                   who="other-agent").status == "applied_verified"
    with pytest.raises(errors.CoordinationRequired):
        ex.call("lab.bump", {"target_id": 1, "call_ref": "h-2"}, case="BUSY", who="agent")
    assert scalar(sqlite_url, "SELECT n FROM lab_counter WHERE target_id = 1") == 3


def test_a_plan_claims_the_target_for_its_case(made: Any, sqlite_url: URL) -> None:
    ex = made(_first_target(sqlite_url))
    plan = ex.plan("policy.purge_orphan", {"policy_id": 9}, case="PLANNER", who="agent")
    key = plan.to_dict()["impact_keys"][0]
    assert store_for(ex).current(key)["case_id"] == "PLANNER"
    with pytest.raises(errors.CoordinationRequired) as refused:
        ex.plan("policy.purge_orphan", {"policy_id": 9}, case="LATE", who="other-agent")
    assert refused.value.holder["case_id"] == "PLANNER"
    with pytest.raises(errors.CoordinationRequired):  # planned again: the same decision
        ex.plan("policy.purge_orphan", {"policy_id": 9}, case="LATE", who="other-agent")
    assert len(events_of(ex, "LATE", "coordination_requested")) == 1
    with pytest.raises(errors.UnknownPlan):  # the refused plan was never recorded
        ex.ledger.get_plan(ex.plan("policy.purge_orphan", {"policy_id": 9}, case="LATE",
                                   who="other-agent", record=False).plan_hash)
    # a plan without recording claims nothing
    ex.plan("policy.add_note", {"policy_id": 3, "author": "a", "body": "b"}, case="DRY",
            who="agent", record=False)
    assert store_for(ex).current("dev/insurance/policy_note/policy_id=3") is None


def test_dimensions_collide_on_the_product_version(made: Any, sqlite_url: URL) -> None:
    ex = made(_first_target(sqlite_url))
    first = {"tariff_id": 1, "product": "home", "product_version": 1, "rate": 110}
    assert ex.call("lab.tariff_set", first, case="T1", who="agent").status == "applied_verified"
    same_version = {"tariff_id": 2, "product": "home", "product_version": 1, "rate": 120}
    with pytest.raises(errors.CoordinationRequired) as refused:
        ex.call("lab.tariff_set", same_version, case="T2", who="other-agent")
    assert refused.value.details["impact_key"] == "dev/lab/product=home/version=1"
    other_version = {"tariff_id": 3, "product": "home", "product_version": 2, "rate": 130}
    assert ex.call("lab.tariff_set", other_version, case="T2",
                   who="other-agent").status == "applied_verified"
    assert rows(sqlite_url, "SELECT tariff_id, rate FROM lab_tariff ORDER BY tariff_id") == [
        (1, 110), (2, 100), (3, 130)]


def test_an_abandoned_cases_claim_expires(made: Any, sqlite_url: URL) -> None:
    ex = made(_first_target(sqlite_url), case_claim_seconds=1.0)
    key = "dev/lab/counter/target_id=2"
    assert ex.call("lab.count", {"target_id": 2, "call_ref": "gone-1"}, case="GONE",
                   who="agent").status == "applied_verified"
    held = store_for(ex).current(key)
    assert held is not None and 0 < held["expires_in"] <= 4.0  # 1 s lease, its margins
    with pytest.raises(errors.CoordinationRequired):
        ex.call("lab.count", {"target_id": 2, "call_ref": "next-1"}, case="NEXT", who="agent")
    time.sleep(held["expires_in"] + 0.2)
    assert ex.call("lab.count", {"target_id": 2, "call_ref": "next-1"}, case="NEXT",
                   who="agent").status == "applied_verified"
    now = store_for(ex).current(key)
    assert now is not None and (now["case_id"], now["token"]) == ("NEXT", 2)
    with pytest.raises(errors.CoordinationRequired) as back:  # the old case comes back late
        ex.call("lab.count", {"target_id": 2, "call_ref": "gone-2"}, case="GONE", who="agent")
    assert back.value.holder["case_id"] == "NEXT"
    assert scalar(sqlite_url, "SELECT n FROM lab_counter WHERE target_id = 2") == 2


def test_close_and_release_give_claims_back_only_to_those_who_may(made: Any,
                                                                  sqlite_url: URL) -> None:
    ex = made(_first_target(sqlite_url))
    for t in (1, 2):
        assert ex.call("lab.count", {"target_id": t, "call_ref": f"c-{t}"}, case="MINE",
                       who="agent").status == "applied_verified"
    with pytest.raises(errors.CoordinationRequired) as refused:
        ex.call("lab.count", {"target_id": 2, "call_ref": "o-2"}, case="OTHER", who="other-agent")
    with pytest.raises(errors.NotInCase):  # another case's agent cannot free MINE's targets
        cases.close(ex, "MINE", by="other-agent")
    with pytest.raises(errors.UsageError) as unknown:
        cases.release(ex, "MINE", ["dev/lab/counter/target_id=3"], by="agent")
    assert unknown.value.details["field"] == "key"
    done = cases.release(ex, "MINE", ["dev/lab/counter/target_id=2"], by="agent")
    assert done["released"] == ["dev/lab/counter/target_id=2"]
    # the undecided ask against the released key: recorded as released, in both ledgers
    for case in ("OTHER", "MINE"):
        (decided,) = events_of(ex, case, "coordination_decided")
        assert decided["coordination"]["decision"] == "released"
        assert decided["coordination"]["decision_id"] == refused.value.details["decision_id"]
    assert ex.call("lab.count", {"target_id": 2, "call_ref": "o-2"}, case="OTHER",
                   who="other-agent").status == "applied_verified"
    shown = cases.show(ex, "MINE")
    assert [c["impact_key"] for c in shown["claims"]] == ["dev/lab/counter/target_id=1"]
    closed = cases.close(ex, "MINE", by="bob", key=KEYS["bob"])  # a person, signing
    assert closed["released"] == ["dev/lab/counter/target_id=1"]
    assert cases.show(ex, "MINE")["claims"] == [] and cases.show(ex, "MINE")["closed"]
    assert kinds(ex, "MINE")[-1] == "case_closed"


def test_an_edited_ledger_decides_nothing_and_injects_no_query(made: Any,
                                                               sqlite_url: URL) -> None:
    """An edit of a case's snapshot -- a decision marked made, a symptom pointing at
    another row -- is found before anything acts on it."""
    from capgate.executor import symptoms

    ex = made(_first_target(sqlite_url))
    assert ex.call("lab.count", {"target_id": 1, "call_ref": "e-1"}, case="EH",
                   who="agent").status == "applied_verified"
    with pytest.raises(errors.CoordinationRequired) as refused:
        ex.call("lab.count", {"target_id": 1, "call_ref": "e-2"}, case="EA", who="other-agent")
    decision = refused.value.details["decision_id"]
    with ex.ledger.engine.begin() as conn:  # someone marks the decision as made by hand
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = replace(snapshot, :a, :b)"
                             " WHERE case_id = 'EA'"),
                     {"a": '"status":"requested"', "b": '"status":"decided"'})
    fresh = made(sqlite_url, schema=False)  # another process: nothing cached as verified
    with pytest.raises(errors.LedgerTampered):
        cases.decide(fresh, "EA", decision, decision="hand_over", by="bob", key=KEYS["bob"])
    assert store_for(fresh).current("dev/lab/counter/target_id=1")["case_id"] == "EH"

    symptoms.register(ex.rt, "ES", "lab.ticket_set", {"ticket_id": 3}, who="agent")
    with ex.ledger.engine.begin() as conn:  # a registered symptom re-pointed at another row
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = replace(snapshot, :a, :b)"
                             " WHERE case_id = 'ES'"),
                     {"a": '"operation_id":"lab.ticket_set"', "b": '"operation_id":"lab.count"'})
    with pytest.raises(errors.LedgerTampered):
        fresh.call("lab.ticket_set", {"ticket_id": 3, "status": "x"}, case="ES", who="agent")
    assert scalar(sqlite_url, "SELECT status FROM lab_ticket WHERE ticket_id = 3") == "open"


# --- processes and threads ----------------------------------------------------------------


def _calls(case: str, refs: Sequence[str], who: str = "agent",
           target_id: int = 1) -> list[dict[str, Any]]:
    return [{"operation": "lab.count", "case": case, "who": who,
             "inputs": {"target_id": target_id, "call_ref": r}} for r in refs]


WHO = {"ALPHA": "agent", "BETA": "other-agent"}


@pytest.mark.crash
def test_two_cases_in_separate_processes_contend_on_a_shared_postgresql_ledger(
        server_target: URL, shared_ledger: URL, made: Any) -> None:
    ex = made(_first_target(server_target), shared_ledger)
    start = time.time() + 2.0
    procs = {case: spawn({"target": url_text(server_target), "ledger": url_text(shared_ledger),
                          "start_at": start, "pause": 0.05,
                          "calls": _calls(case, [f"{case}-{i}" for i in range(4)],
                                          who=WHO[case])})
             for case in ("ALPHA", "BETA")}
    results = {case: finish(p) for case, p in procs.items()}
    winners = [c for c, r in results.items() if all(x["status"] == "applied_verified" for x in r)]
    assert len(winners) == 1, results
    holder = winners[0]
    asker = "BETA" if holder == "ALPHA" else "ALPHA"
    refusals = results[asker]
    assert all(x["status"] == "refused" and x["code"] == "CG330" for x in refusals), refusals
    assert len({x["details"]["decision_id"] for x in refusals}) == 1  # one decision
    decision = refusals[0]["details"]["decision_id"]
    # nothing written by both: the target holds the holder's four writes only
    assert scalar(server_target, "SELECT n FROM lab_counter WHERE target_id = 1") == 4
    assert {r[0] for r in rows(server_target, "SELECT case_id FROM capgate_landed")} == {holder}
    # the decision in both ledgers
    assert len(events_of(ex, asker, "coordination_requested")) == 1
    assert len(events_of(ex, holder, "coordination_requested")) == 1

    done = cases.decide(ex, asker, decision, decision="hand_over", by="bob", key=KEYS["bob"])
    assert done["tokens"] == {"dev/lab/counter/target_id=1": 2}
    for case in (asker, holder):
        (decided,) = events_of(ex, case, "coordination_decided")
        assert decided["coordination"]["decision"] == "hand_over"
    (granted,) = events_of(ex, asker, "continuation")
    assert granted["continuation"]["decision"] == "granted"

    # after the hand-over: the asking case writes, the old holder is the one refused now
    handed = time.time()
    again = {case: spawn({"target": url_text(server_target), "ledger": url_text(shared_ledger),
                          "calls": _calls(case, [f"{case}-{i}" for i in range(4, 7)],
                                          who=WHO[case])})
             for case in (asker, holder)}
    later = {case: finish(p) for case, p in again.items()}
    assert all(x["status"] == "applied_verified" for x in later[asker]), later
    assert all(x["code"] == "CG330" for x in later[holder]), later
    assert scalar(server_target, "SELECT n FROM lab_counter WHERE target_id = 1") == 7
    landed = rows(server_target, "SELECT case_id, landed_at FROM capgate_landed")
    assert sorted(c for c, _ in landed) == sorted([holder] * 4 + [asker] * 3)
    assert all(x["at"] < handed for x in results[holder])
    assert rows(server_target, "SELECT token FROM capgate_fence") == [(2,)]
    assert len(events_of(ex, holder, "coordination_requested")) == 2  # its own ask, and ...
    assert ex.ledger.verify().ok


@pytest.mark.crash
def test_a_stopped_process_woken_after_a_takeover_cannot_land_its_write(
        server_target: URL, shared_ledger: URL, made: Any, tmp_path: Path) -> None:
    ex = made(_first_target(server_target), shared_ledger)
    key = "dev/lab/ticket/ticket_id=2"
    assert ex.call("lab.ticket_set", {"ticket_id": 2, "status": "early"}, case="SLEEPER",
                   who="agent").status == "applied_verified"
    proc = spawn({"target": url_text(server_target), "ledger": url_text(shared_ledger),
                  "stop_at": "after_prepared", "stop_call": 0,
                  "calls": [{"operation": "lab.ticket_set", "case": "SLEEPER",
                             "inputs": {"ticket_id": 2, "status": "late"}}]})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until it stopped itself, its intent prepared
        with open(f"/proc/{proc.pid}/stat") as fh:
            if fh.read().split(") ")[1].startswith("T"):
                break
        time.sleep(0.02)
    else:
        raise AssertionError("the child never stopped")
    held = store_for(ex).current(key)
    assert held is not None and held["case_id"] == "SLEEPER" and held["token"] == 1
    with ex.ledger.engine.begin() as conn:  # its case's claim outlived -- as if abandoned
        conn.execute(sa.text("UPDATE cg_claims SET expires_at = 0"))
    out = ex.call("lab.ticket_set", {"ticket_id": 2, "status": "taken"}, case="TAKER",
                  who="other-agent")
    assert out.status == "applied_verified", out.reason
    assert store_for(ex).current(key)["token"] == 2
    os.kill(proc.pid, signal.SIGCONT)
    (late,) = finish(proc)
    assert late["status"] == "rolled_back", late
    # the target's fence row carries the taker's newer token: the woken write rolls back
    assert late["reason"]["kind"] == "stale_fence", late
    assert late["reason"]["where"] == "target"
    assert (late["reason"]["token"], late["reason"]["current_token"]) == (1, 2)
    assert scalar(server_target, "SELECT status FROM lab_ticket WHERE ticket_id = 2") == "taken"
    assert scalar(server_target, "SELECT count(*) FROM capgate_landed WHERE case_id = 'SLEEPER'"
                  " AND operation_id = 'lab.ticket_set'") == 1  # only its early write
    assert ex.ledger.verify().ok


@pytest.mark.crash
def test_eight_processes_and_eight_threads_contend_for_one_target(
        pg_url: URL, shared_ledger: URL, made: Any) -> None:
    ex = made(_first_target(pg_url), shared_ledger, budget_wait_seconds=10.0)
    start = time.time() + 2.5
    procs = [spawn({"target": url_text(pg_url), "ledger": url_text(shared_ledger),
                    "start_at": start,
                    "calls": _calls(f"P{i}", [f"p{i}-a", f"p{i}-b"], target_id=3)})
             for i in range(8)]
    results = [finish(p) for p in procs]
    applied = [i for i, r in enumerate(results) if r[0]["status"] == "applied_verified"]
    assert len(applied) == 1, results
    winner = f"P{applied[0]}"
    for i, r in enumerate(results):
        if i == applied[0]:
            assert [x["status"] for x in r] == ["applied_verified"] * 2
            continue
        assert [x.get("code") for x in r] == ["CG330", "CG330"], r
        assert len(events_of(ex, f"P{i}", "coordination_requested")) == 1
    requests = events_of(ex, winner, "coordination_requested")
    assert len(requests) == 7
    assert len({x["coordination"]["decision_id"] for x in requests}) == 7
    assert scalar(pg_url, "SELECT n FROM lab_counter WHERE target_id = 3") == 2

    # eight threads of one executor, eight more cases: the holder stays the only writer
    outcomes: list[Any] = []
    barrier = threading.Barrier(8)

    def run(i: int) -> None:
        barrier.wait()
        try:
            outcomes.append(ex.call("lab.count", {"target_id": 3, "call_ref": f"t{i}"},
                                    case=f"T{i}", who="agent"))
        except errors.CapgateError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(o, errors.CoordinationRequired) for o in outcomes), outcomes
    assert len(events_of(ex, winner, "coordination_requested")) == 15
    assert scalar(pg_url, "SELECT n FROM lab_counter WHERE target_id = 3") == 2

    # the same call of one case from eight threads: one execution, no coordination at all
    same: list[Any] = []
    barrier2 = threading.Barrier(8)

    def again() -> None:
        barrier2.wait()
        same.append(ex.call("lab.count", {"target_id": 3, "call_ref": f"{winner}-same"},
                            case=winner, who="agent"))

    threads = [threading.Thread(target=again) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len({o.intent_id for o in same}) == 1 and all(
        o.status == "applied_verified" for o in same), same
    assert scalar(pg_url, "SELECT n FROM lab_counter WHERE target_id = 3") == 3
    assert len(events_of(ex, winner, "coordination_requested")) == 15
    assert ex.ledger.verify().ok


def test_the_case_commands_on_the_command_line(made: Any, sqlite_url: URL,
                                               tmp_path: Path) -> None:
    from tests.fix_capgate import approval_key_line, approver_key_file

    ex = made(_first_target(sqlite_url))
    ledger = ex.ledger.url
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "coordination.yaml").write_text(LAB_ROWS, "utf-8")
    (tmp_path / "grants.toml").write_text(
        '[principals.agent]\ngrants = [{ connector = "*", environments = ["dev"], '
        'access = "write" }]\n[principals.other-agent]\ngrants = [{ connector = "*", '
        'environments = ["dev"], access = "write" }]\n'
        f'[principals.bob]\nroles = ["dba"]\n{approval_key_line("bob")}\n', "utf-8")
    from tests.fix_capgate import CAPABILITIES

    config = tmp_path / "capgate.toml"
    config.write_text(
        "[capgate]\n"
        f"capabilities = [{json.dumps(str(CAPABILITIES))}, {json.dumps(str(tmp_path / 'lab'))}]\n"
        f'grants = "grants.toml"\nledger = {json.dumps(ledger)}\nagent = "agent"\n'
        f"[connectors.insurance]\nurl = {json.dumps(url_text(sqlite_url))}\n"
        'environment = "dev"\n'
        f"[connectors.insurance_code]\nurl = {json.dumps(url_text(sqlite_url))}\n"
        'environment = "dev"\n', "utf-8")

    def capgate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "capgate", *args, "--config",
                               str(config)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=False, env={**os.environ,
                                                             "PYTHONPATH": str(ROOT)})

    first = capgate("call", "lab.count", "--case", "CLI-H", "--input",
                    '{"target_id": 1, "call_ref": "cli-1"}')
    assert first.returncode == 0, first.stderr
    refused = capgate("call", "lab.count", "--case", "CLI-W", "--as", "other-agent", "--input",
                      '{"target_id": 1, "call_ref": "cli-2"}', "--json")
    assert refused.returncode == 1
    body = json.loads(refused.stdout)
    assert body["code"] == "CG330"
    decision = body["details"]["decision_id"]
    shown = json.loads(capgate("case", "show", "CLI-W", "--json").stdout)
    assert shown["decisions"][0]["decision_id"] == decision
    assert shown["decisions"][0]["status"] == "requested"
    no_key = capgate("case", "decide", "CLI-W", decision, "--decision", "hand_over", "--by",
                     "bob")
    assert no_key.returncode == 2 and "key" in no_key.stderr
    decided = capgate("case", "decide", "CLI-W", decision, "--decision", "hand_over", "--by",
                      "bob", "--key", str(approver_key_file("bob")), "--json")
    assert decided.returncode == 0, decided.stderr
    assert json.loads(decided.stdout)["tokens"] == {"dev/lab/counter/target_id=1": 2}
    assert capgate("call", "lab.count", "--case", "CLI-W", "--as", "other-agent", "--input",
                   '{"target_id": 1, "call_ref": "cli-2"}').returncode == 0
    closed = capgate("case", "close", "CLI-W", "--as", "other-agent", "--json")
    assert closed.returncode == 0 and json.loads(closed.stdout)["released"] == [
        "dev/lab/counter/target_id=1"]
    explained = subprocess.run([sys.executable, "-m", "capgate", "explain", "CG330"],
                               capture_output=True, text=True, check=False, cwd=ROOT)
    assert "coordination decision" in explained.stdout


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
