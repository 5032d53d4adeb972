"""Per-case session budgets (issue 17, item 3): counted across processes sharing the ledger.

A case may hold at most ``case_session_budget`` sessions at once on a
connector.  Another process holds the case's one session; a call of that case
waits ``budget_wait_seconds`` and is refused (CG321, scope ``case``), while
another case's call runs.  On PostgreSQL and MariaDB targets, one PostgreSQL
ledger.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from capgate.executor import cases
from capgate.registry import errors
from tests.fix_db import engine_params
from tests.test_coordination import (
    _first_target,
    executors,
    rows,
    scalar,
    server_url,
    url_text,
)
from tests.test_lease_support import spawn, wait_for_file

BUDGET = {"case_session_budget": 1, "budget_wait_seconds": 1.0}


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_target(request: pytest.FixtureRequest) -> URL:
    return server_url(request)


@pytest.fixture
def shared_ledger(pg_ledger_url: URL) -> URL:
    return pg_ledger_url


@pytest.fixture
def made(tmp_path: Path) -> Iterator[Any]:
    yield from executors(tmp_path)


@pytest.mark.crash
def test_a_case_over_its_session_budget_waits_then_is_refused(
        server_target: URL, shared_ledger: URL, made: Any, tmp_path: Path) -> None:
    ex = made(_first_target(server_target), shared_ledger, **BUDGET)
    ready = tmp_path / "ready.json"
    holder = spawn("hold", {"target": url_text(server_target), "ledger": url_text(shared_ledger),
                            "sessions": {"insurance": 1}, "case": "BUSY", "seconds": 6,
                            "ready": str(ready), "opts": {**BUDGET, "case_claim_seconds": 60}})
    try:
        wait_for_file(ready, holder)
        scope = "case:insurance:BUSY"
        assert rows(shared_ledger, "SELECT count(*) FROM cg_budget_slots WHERE scope = :s"
                                   " AND ticket IS NOT NULL", s=scope) == [(1,)]
        started = time.monotonic()
        with pytest.raises(errors.BudgetExhausted) as refused:
            ex.call("lab.count", {"target_id": 1, "call_ref": "busy-1"}, case="BUSY",
                    who="agent")
        waited = time.monotonic() - started
        assert waited >= 1.0, waited  # it waited its budget_wait_seconds first
        d = refused.value.details
        assert (d["scope"], d["name"], d["budget"]) == ("case", scope, 1)
        assert [h["case_id"] for h in d["holders"]] == ["BUSY"]
        assert "case 'BUSY' on connector 'insurance'" in refused.value.message
        assert not (ex.ledger.snapshot("BUSY") or {}).get("intents")  # nothing recorded
        assert scalar(server_target, "SELECT n FROM lab_counter WHERE target_id = 1") == 0
        # the connector's own budget has room: another case's call runs meanwhile
        other = ex.call("lab.count", {"target_id": 2, "call_ref": "free-1"}, case="FREE",
                        who="agent")
        assert other.status == "applied_verified", other.reason
    finally:
        holder.communicate(timeout=60)
    # the other process let go: the case has its session again
    out = ex.call("lab.count", {"target_id": 1, "call_ref": "busy-1"}, case="BUSY", who="agent")
    assert out.status == "applied_verified", out.reason
    assert rows(shared_ledger, "SELECT count(*) FROM cg_budget_slots WHERE scope = :s"
                               " AND ticket IS NOT NULL", s="case:insurance:BUSY") == [(0,)]
    cases.close(ex, "BUSY", by="agent")  # a closed case's slot rows go
    assert rows(shared_ledger, "SELECT count(*) FROM cg_budget_slots WHERE scope = :s",
                s="case:insurance:BUSY") == [(0,)]
