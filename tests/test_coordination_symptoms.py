"""Changed outside the case (issue 17, item 2): the symptom re-read before the fix and the send.

A case registers the symptom it starts from; its own fix moves the baseline
(read inside the write before COMMIT); another session changing the target
between two calls holds the case, with the before and after digests and the
actor -- from the row's actor query, and from capgate's own record in the
target when another case wrote it -- until a person accepts or re-opens it.
On PostgreSQL and MariaDB targets.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor import cases, symptoms
from capgate.executor.recovery.resume import resolve_escalation, resume
from capgate.registry import errors
from capgate.registry.canonical import canonical_hash
from tests.fix_capgate import KEYS
from tests.fix_db import engine_params
from tests.test_coordination import (
    _first_target,
    events_of,
    executors,
    kinds,
    rows,
    scalar,
    server_url,
)

KEY = "dev/lab/ticket/ticket_id=1"


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_target(request: pytest.FixtureRequest) -> URL:
    return server_url(request)


@pytest.fixture
def made(tmp_path: Path) -> Iterator[Any]:
    yield from executors(tmp_path)


def digest_of(*values: str) -> str:
    return canonical_hash({"columns": ["status"], "rows": [[v] for v in values],
                           "truncated": False})


def outside(url: URL, status: str, by: str) -> None:
    """Another session (the customer, the vendor's IT) changes the ticket."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE lab_ticket SET status = :s, modified_by = :b"
                                 " WHERE ticket_id = 1"), {"s": status, "b": by})
    finally:
        engine.dispose()


def entry(ex: Any, case: str) -> dict[str, Any]:
    found = symptoms.entries(ex.ledger.snapshot(case))
    return dict(found[KEY])


def test_a_symptom_changed_by_another_session_holds_the_case_with_the_actor(
        made: Any, server_target: URL) -> None:
    ex = made(_first_target(server_target))
    case = "SYM-1"
    registered = symptoms.register(ex.rt, case, "lab.ticket_set", {"ticket_id": 1}, who="agent")
    assert registered["impact_key"] == KEY and registered["digest"] == digest_of("open")
    assert registered["reading"]["rows"] == [["open"]]

    # the case's own fix: re-read before it (granted), the new state is the new baseline
    fix = ex.call("lab.ticket_set", {"ticket_id": 1, "status": "in_progress"}, case=case,
                  who="agent")
    assert fix.status == "applied_verified", fix.reason
    assert kinds(ex, case) == ["symptom_registered", "continuation", "prepared", "observed",
                               "symptom_updated"]
    (granted,) = events_of(ex, case, "continuation")
    assert granted["continuation"]["decision"] == "granted"
    assert granted["continuation"]["after"] == "recheck"
    baseline = entry(ex, case)
    assert baseline["digest"] == digest_of("in_progress") and baseline["writing_intent"] is None

    # someone else changes it between two calls of the case
    outside(server_target, "closed", "bulstrad-it")
    with pytest.raises(errors.SymptomChanged) as held:
        ex.call("lab.ticket_set", {"ticket_id": 1, "status": "resolved"}, case=case,
                who="agent")
    assert held.value.code == "CG335" and held.value.exit_code == 3
    assert "bulstrad-it" in held.value.message
    hold = held.value.details["hold"]
    assert scalar(server_target, "SELECT status FROM lab_ticket WHERE ticket_id = 1") == \
        "closed"  # nothing of the refused call was sent
    (changed,) = events_of(ex, case, "changed_outside_case")
    (item,) = changed["changed"]
    assert (item["impact_key"], item["before"], item["after"]) == (
        KEY, digest_of("in_progress"), digest_of("closed"))
    assert item["actor"]["known"] and item["actor"]["declared"]["who"] == "bulstrad-it"
    assert item["detected"] == "before the fix"
    assert changed["refused"]["operation_id"] == "lab.ticket_set"
    withheld = events_of(ex, case, "continuation")[-1]["continuation"]
    assert (withheld["decision"], withheld["hold"]) == ("withheld", hold)

    # held: no new work in the case, resume leaves it to a person
    with pytest.raises(errors.ReconciliationRequired):
        ex.call("lab.ticket_set", {"ticket_id": 1, "status": "resolved"}, case=case,
                who="agent")
    with pytest.raises(errors.ReconciliationRequired):
        symptoms.checkpoint(ex.rt, case, who="agent")
    report = resume(ex, case)
    assert report.exit_code == 3
    assert [(i.intent_id, i.action) for i in report.intents] == [(hold, "awaiting_person")]
    assert report.recovery[case]["continuation"]["decision"] == "withheld"
    # resume's own recheck agrees: the fix's verify check no longer holds either
    assert [c["intent_id"] for c in report.changed_outside_case] == [fix.intent_id]
    point = report.recovery[case]["recovery_point"]
    assert point["chosen"] is None and point["latest_recorded"]["step"] == fix.intent_id
    with pytest.raises(errors.UsageError):  # a person signs the answer to a hold
        resolve_escalation(ex, case, hold, by="bob", decision="accepted")
    with pytest.raises(errors.DecisionNotAuthenticated):
        cases.resolve_hold(ex, case, hold, decision="accepted", by="alice", key=KEYS["bob"])
    with pytest.raises(errors.UsageError) as bad:
        cases.resolve_hold(ex, case, hold, decision="ignore", by="bob", key=KEYS["bob"])
    assert bad.value.details["field"] == "decision"

    done = cases.resolve_hold(ex, case, hold, decision="accepted", by="bob", key=KEYS["bob"],
                              note="the customer closed it themselves")
    assert done["proof"]["signed_by"] == "bob"
    assert entry(ex, case)["digest"] == digest_of("closed")  # the accepted state
    assert events_of(ex, case, "continuation")[-1]["continuation"]["decision"] == "granted"
    resolve_escalation(ex, case, fix.intent_id, by="bob", decision="accepted")  # resume's
    again = ex.call("lab.ticket_set", {"ticket_id": 1, "status": "resolved"}, case=case,
                    who="agent")
    assert again.status == "applied_verified", again.reason
    assert symptoms.checkpoint(ex.rt, case, name="send", who="agent")["held"] is False
    assert ex.ledger.verify().ok


def test_the_checkpoint_names_another_case_that_wrote_the_target(made: Any,
                                                                  server_target: URL) -> None:
    ex = made(_first_target(server_target))
    case = "SYM-2"
    symptoms.register(ex.rt, case, "lab.ticket_set", {"ticket_id": 1}, who="agent")
    assert symptoms.checkpoint(ex.rt, case, who="agent")["held"] is False
    assert ex.call("lab.ticket_set", {"ticket_id": 1, "status": "triaged"}, case=case,
                   who="agent").status == "applied_verified"
    cases.release(ex, case, by="agent")  # the case lets go of the ticket for a while
    other = ex.call("lab.ticket_set", {"ticket_id": 1, "status": "reassigned"}, case="OTHER",
                    who="other-agent")
    assert other.status == "applied_verified"
    found = symptoms.checkpoint(ex.rt, case, name="send", who="agent")
    assert found["held"] is True
    (item,) = found["changed"]
    assert item["actor"]["declared"]["who"] == "capgate"  # the column only says "capgate"...
    assert item["actor"]["capgate"]["case"] == "OTHER"  # ... the target's record says which
    assert item["actor"]["capgate"]["intent_id"] == other.intent_id
    assert item["detected"] == "checkpoint send"
    reopened = cases.resolve_hold(ex, case, found["hold"], decision="reopened", by="alice",
                                  key=KEYS["alice"])
    assert reopened["decision"] == "reopened"
    state = ex.ledger.snapshot(case) or {}
    assert state["case"]["reopened"]["hold"] == found["hold"]
    assert entry(ex, case)["digest"] == digest_of("reassigned")


def test_registering_a_symptom_checks_its_inputs_and_changes_nothing(made: Any,
                                                                     sqlite_url: URL) -> None:
    ex = made(_first_target(sqlite_url))
    for inputs, field in (({}, "ticket_id"), ({"ticket_id": "one"}, "ticket_id"),
                          ({"ticket_id": 1, "status": "x"}, "status")):
        with pytest.raises(errors.InputInvalid) as bad:
            symptoms.register(ex.rt, "SYM-3", "lab.ticket_set", inputs, who="agent")
        assert bad.value.details["field"] == field
    with pytest.raises(errors.NoSymptom) as none:
        symptoms.register(ex.rt, "SYM-3", "lab.count", {"target_id": 1}, who="agent")
    assert none.value.details["field"] == "symptom"
    with pytest.raises(errors.NotAuthorized):
        symptoms.register(ex.rt, "SYM-3", "lab.ticket_set", {"ticket_id": 1}, who="nobody")
    with pytest.raises(errors.UnknownCase):
        symptoms.checkpoint(ex.rt, "SYM-3", who="agent")
    assert ex.ledger.snapshot("SYM-3") is None
    # a case that registered nothing pays nothing: its calls record no re-read
    assert ex.call("lab.ticket_set", {"ticket_id": 2, "status": "x"}, case="PLAIN",
                   who="agent").status == "applied_verified"
    assert kinds(ex, "PLAIN") == ["prepared", "observed"]
    assert rows(sqlite_url, "SELECT status FROM lab_ticket WHERE ticket_id = 2") == [("x",)]
