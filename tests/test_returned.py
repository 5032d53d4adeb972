"""Returned keys (issue 16): recorded as named values, bound by later calls, crash-proof.

A statement that declares ``returns`` gives the key it wrote (``RETURNING``)
to the outcome and -- before COMMIT -- to the ledger, so a real process killed
with SIGKILL between COMMIT and ``observed`` loses nothing: ``resume`` proves the
write from its marker, and a later call of the case binds its input to the key
that attempt returned, read from the ledger, never predicted.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor import outcome as oc
from capgate.executor.bindings import call_bound
from capgate.executor.call import Executor
from capgate.executor.recovery.resume import resume
from capgate.executor.returned import Binding, parse_binding
from capgate.registry import errors
from capgate.registry import errors as serr
from capgate.registry.errors import NotSupported
from tests.crash_child import Zygote
from tests.sim_support import NEW_CLAIM, registry_with, venues

__all__ = ["venues"]  # the fixture


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def engine_of(url: URL) -> str:
    return {"mysql": "mariadb"}.get(url.get_backend_name(), url.get_backend_name())


def scalar(ex: Executor, sql: str, **binds: Any) -> Any:
    with ex.connectors.get("insurance").engine.connect() as conn:
        return conn.execute(sa.text(sql), binds).scalar()


def claim(tag: str, policy_id: int = 2) -> dict[str, Any]:
    return {**NEW_CLAIM, "policy_id": policy_id, "claim_ref": f"CLM-2024-{tag}"}


@pytest.fixture
def dev(target_url: URL, tmp_path: Path, venues: Callable[..., Executor]) -> Executor:
    return venues(target_url, f"sqlite:///{tmp_path / 'ledger.db'}", "dev")


def test_the_returned_key_is_the_row_written_and_is_recorded_before_commit(
        dev: Executor) -> None:
    out = dev.call("claim.open", claim("101"), case="RK-1", who="agent")
    assert out.status == oc.APPLIED
    (claim_id,) = out.evidence["returned"]["claim_id"]
    assert scalar(dev, "SELECT claim_ref FROM claim WHERE claim_id = :c", c=claim_id) \
        == "CLM-2024-101"
    events = dev.ledger.events("RK-1")
    kinds = [e.kind for e in events]
    assert kinds.index("keys_returned") < kinds.index("observed")
    (keys,) = [e for e in events if e.kind == "keys_returned"]
    assert keys.payload["state"] == {"returned": {"claim_id": [claim_id]},
                                     "returned_attempt": 1}
    assert dev.ledger.verify().ok


def test_a_later_call_binds_an_input_to_the_returned_key(dev: Executor) -> None:
    dev.call("claim.open", claim("102"), case="RK-2", who="agent")
    opened = scalar(dev, "SELECT claim_id FROM claim WHERE claim_ref = 'CLM-2024-102'")
    out = call_bound(dev, "claim.settle", {}, [parse_binding("claim_id=claim.open.claim_id")],
                     case="RK-2", who="agent")
    assert out.status == oc.APPLIED
    assert scalar(dev, "SELECT status FROM claim WHERE claim_id = :c", c=opened) == "settled"
    assert scalar(dev, "SELECT status FROM claim WHERE claim_id = 1") == "open"  # the other
    (bound,) = [e for e in dev.ledger.events("RK-2") if e.kind == "inputs_bound"]
    assert bound.payload["bindings"][0]["value"] == opened
    assert bound.payload["intent_id"] == out.intent_id


def test_bindings_that_cannot_be_resolved_are_refused(dev: Executor) -> None:
    lapsed = dev.call("claim.open", claim("103", policy_id=3), case="RK-3", who="agent")
    assert lapsed.status == oc.ROLLED_BACK
    settle = "claim.settle"
    with pytest.raises(serr.ReturnedValueUnavailable, match="rolled_back"):
        call_bound(dev, settle, {}, [Binding("claim_id", "claim.open", "claim_id")],
                   case="RK-3", who="agent")
    with pytest.raises(serr.ReturnedValueUnavailable, match="has no intent"):
        call_bound(dev, settle, {}, [Binding("claim_id", "f" * 32, "claim_id")],
                   case="RK-3", who="agent")
    dev.call("claim.open", claim("104"), case="RK-3", who="agent")
    dev.call("claim.open", claim("105"), case="RK-3", who="agent")
    with pytest.raises(serr.ReturnedValueUnavailable, match="2 applied intents") as two:
        call_bound(dev, settle, {}, [Binding("claim_id", "claim.open", "claim_id")],
                   case="RK-3", who="agent")
    assert two.value.code == "CG608" and len(two.value.details["intents"]) == 2
    with pytest.raises(serr.ReturnedValueUnavailable, match="no applied intent"):
        call_bound(dev, settle, {}, [Binding("claim_id", "claim.open", "nothing")],
                   case="RK-3", who="agent")
    with pytest.raises(serr.ReturnedValueUnavailable, match="given and bound"):
        call_bound(dev, settle, {"claim_id": 1}, [Binding("claim_id", two.value.details[
            "intents"][0], "claim_id")], case="RK-3", who="agent")
    with pytest.raises(serr.ReturnedValueUnavailable, match="expected INPUT"):
        parse_binding("claim_id")
    # nothing of the refused calls was recorded or sent
    assert scalar(dev, "SELECT count(*) FROM claim WHERE status = 'settled'") == 0
    assert not [e for e in dev.ledger.events("RK-3") if e.kind == "inputs_bound"]


UPDATE_RETURNING = """
format: 1
connectors: {insurance: {description: insurance}}
rows:
  - operation_id: claim.reprice
    version: 1
    connector: insurance
    description: Reprice an open claim and return its id.
    input:
      type: object
      additionalProperties: false
      required: [claim_id, amount]
      properties:
        claim_id: {type: integer, minimum: 1}
        amount: {type: integer, minimum: 1, maximum: 1000000}
    target: {system: insurance, object: claim, keys: [claim_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{claim_id}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: reprice
        sql: "UPDATE claim SET amount = :amount WHERE claim_id = :claim_id AND status = 'open'"
        expect_rows: 1
        returns: {table: claim, key: claim_id}
"""


def test_an_engine_that_cannot_return_the_keys_refuses_before_anything(
        target_url: URL, tmp_path: Path, venues: Callable[..., Executor]) -> None:
    ex = venues(target_url, f"sqlite:///{tmp_path / 'ledger.db'}", "dev",
                registry=registry_with(tmp_path, UPDATE_RETURNING))
    inputs = {"claim_id": 1, "amount": 999}
    if engine_of(target_url) == "mariadb":  # MariaDB has no UPDATE ... RETURNING
        with pytest.raises(NotSupported) as info:
            ex.call("claim.reprice", inputs, case="RK-U", who="agent")
        assert info.value.code == "CG390" and info.value.details["verb"] == "UPDATE"
        assert ex.ledger.snapshot("RK-U") is None
        assert scalar(ex, "SELECT amount FROM claim WHERE claim_id = 1") == 1200
        return
    out = ex.call("claim.reprice", inputs, case="RK-U", who="agent")
    assert out.evidence["returned"] == {"claim_id": [1]}


@pytest.mark.crash
@pytest.mark.parametrize("point", ["after_commit", "before_commit"])
def test_returned_ids_survive_a_sigkill_between_the_two_calls(
        target_url: URL, tmp_path: Path, point: str, zygote: Zygote,
        venues: Callable[..., Executor]) -> None:
    """A real process opens the claim and is killed (SIGKILL) after COMMIT -- before
    ``observed`` -- or just before COMMIT.  ``resume`` settles it from evidence (applied:
    the marker; not applied: retried, a new key), and the second call binds to the key
    of the attempt that landed."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    ex = venues(target_url, ledger, "dev")
    case = f"RK-CRASH-{point}"
    inputs = claim(uuid.uuid4().hex[:6].translate(str.maketrans("abcdef", "123456")))
    ended = zygote.run({"target": target_url.render_as_string(hide_password=False),
                        "ledger": ledger, "operation": "claim.open", "inputs": inputs,
                        "case": case, "who": "agent", "out": str(tmp_path / "out.json"),
                        "crash_at": point})
    assert ended.killed, ended
    with pytest.raises(errors.ReconciliationRequired):  # the case waits for resume
        call_bound(ex, "claim.settle", {}, [Binding("claim_id", "claim.open", "claim_id")],
                   case=case, who="agent")
    report = resume(ex, case)
    (settled,) = report.intents
    assert settled.classification == ("applied" if point == "after_commit" else "not_applied")
    assert report.resolved
    landed = scalar(ex, "SELECT claim_id FROM claim WHERE claim_ref = :r", r=inputs["claim_ref"])
    assert landed is not None
    out = call_bound(ex, "claim.settle", {}, [Binding("claim_id", "claim.open", "claim_id")],
                     case=case, who="agent")
    assert out.status == oc.APPLIED and out.evidence["counts"] == [1]
    assert scalar(ex, "SELECT status FROM claim WHERE claim_id = :c", c=landed) == "settled"
    assert scalar(ex, "SELECT count(*) FROM claim WHERE status = 'settled'") == 1
    assert ex.ledger.verify().ok


BIG_KEYS = """
format: 1
connectors: {insurance: {description: insurance}}
rows:
  - operation_id: big.add
    version: 1
    connector: insurance
    description: Add a row to a table whose BIGINT identity is beyond 2^53.
    input:
      type: object
      additionalProperties: false
      required: [note]
      properties:
        note: {type: string, maxLength: 40}
    target: {system: insurance, object: big, keys: [note]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{note}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: add
        sql: "INSERT INTO big (note) VALUES (:note)"
        expect_rows: 1
        returns: {table: big, key: id}
  - operation_id: big.note
    version: 1
    connector: insurance
    description: Change the note of one row, named by its (text) id.
    input:
      type: object
      additionalProperties: false
      required: [id, note]
      properties:
        id: {type: string, pattern: "^[0-9]{1,19}$"}
        note: {type: string, maxLength: 40}
    target: {system: insurance, object: big, keys: [id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{id}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: renote
        sql: "UPDATE big SET note = :note WHERE id = :id"
        expect_rows: 1
"""


@pytest.mark.postgresql
def test_a_key_beyond_2_53_is_recorded_exactly_and_still_binds_and_tears_down(
        pg_url: URL, tmp_path: Path, venues: Callable[..., Executor]) -> None:
    """A BIGINT identity past 2^53 cannot be a JSON number without losing digits: it is
    recorded as its decimal text, binds a later call, and the simulation's teardown
    deletes exactly that row."""
    from capgate.executor.simulation.cycle import simulate

    ex = venues(pg_url, f"sqlite:///{tmp_path / 'ledger.db'}", "dev",
                registry=registry_with(tmp_path, BIG_KEYS))
    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE big (id BIGINT GENERATED BY DEFAULT AS IDENTITY "
                             "(START WITH 9007199254740993) PRIMARY KEY, note TEXT)"))
    out = ex.call("big.add", {"note": "first"}, case="RK-BIG", who="agent")
    assert out.evidence["returned"] == {"id": ["9007199254740993"]}
    bound = call_bound(ex, "big.note", {"note": "renamed"}, [Binding("id", "big.add", "id")],
                       case="RK-BIG", who="agent")
    assert bound.status == oc.APPLIED
    report = simulate(ex, "big.add", {"note": "second"}, case="RK-BIG2", who="agent")
    assert report.status == "restored"
    assert report.steps[4]["binds"] == {"capgate_teardown_0": "9007199254740994"}
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, note FROM big ORDER BY id")).fetchall()
    engine.dispose()
    assert [tuple(r) for r in rows] == [(9007199254740993, "renamed")]
    assert ex.ledger.verify().ok
