"""A seeded, time-bounded soak: 200 calls killed at random boundaries, resumed after each.

Across SQLite, PostgreSQL and MariaDB targets (the PostgreSQL target keeps a
PostgreSQL ledger, the shared-store setup), each call runs in a real child
process that is killed with SIGKILL at a random boundary -- or not at all --
and the case is resumed right after -- sometimes first by a resume that is itself
killed inside its retry.  Now and then a request is sent again
with the same idempotency key.  At the end: every intent is resolved, every
effect is present exactly once (no duplicate, none lost), document numbers
have no gap, the marker table has one row per write, and the ledger verifies.

``CAPGATE_SOAK_SEED`` replays a run; ``CAPGATE_SOAK_CALLS`` changes its size.  New
calls stop after 80 s on a slow machine (never before 100 calls); the final
checks always run.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from capgate.executor.call import CRASH_POINTS, Executor
from capgate.executor.recovery.resume import resume
from tests.crash_child import Zygote
from tests.fix_db import fresh_mariadb, fresh_pg, require_server

pytestmark = [pytest.mark.crash, pytest.mark.slow, pytest.mark.postgresql, pytest.mark.mariadb]

CALLS = int(os.environ.get("CAPGATE_SOAK_CALLS", "200"))
BUDGET_SECONDS = 80.0
"""New calls stop after this long (the checks at the end still run), ..."""
MIN_CALLS = min(CALLS, 100)
"""... but not before this many calls were made."""
ACTIVE = (1, 2, 5)


@dataclass
class Target:
    name: str
    url: URL
    ledger: str
    ex: Executor
    cases: int = 0
    calls_in_case: int = 0
    expected: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """(operation, unique key) -> the request, for every call made."""
    used_notes: set[tuple[str, int]] = field(default_factory=set)
    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def case(self) -> str:
        return f"SOAK-{self.name}-{self.cases}"

    def scalar(self, sql: str, **binds: Any) -> Any:
        with self.ex.connectors.get("insurance").engine.connect() as conn:
            return conn.execute(sa.text(sql), binds).scalar_one()


@pytest.fixture
def targets(tmp_path: Path, gate: Callable[..., Executor]) -> Iterator[list[Target]]:
    with ExitStack() as stack:
        sqlite_url = make_url(f"sqlite:///{tmp_path / 'soak.db'}")
        pg = stack.enter_context(fresh_pg(require_server("postgresql")))
        pg_ledger = stack.enter_context(fresh_pg(require_server("postgresql")))
        maria = stack.enter_context(fresh_mariadb(require_server("mariadb")))
        made = []
        for name, url, ledger in [
            ("sqlite", sqlite_url, f"sqlite:///{tmp_path / 'ledger-sqlite.db'}"),
            ("postgresql", pg, pg_ledger.render_as_string(hide_password=False)),
            ("mariadb", maria, f"sqlite:///{tmp_path / 'ledger-mariadb.db'}"),
        ]:
            made.append(Target(name, url, ledger, gate(url, ledger)))
        yield made
        for t in made:  # close before the schemas are dropped
            t.ex.connectors.dispose()
            t.ex.ledger.close()


def next_request(rng: random.Random, t: Target, i: int) -> tuple[str, dict[str, Any], str]:
    """A random valid request: (operation, inputs, unique key of its effect)."""
    op = rng.choice(["policy.add_note", "claim.register", "document.issue"])
    policy = rng.choice(ACTIVE)
    if op == "policy.add_note" and (t.case, policy) in t.used_notes:
        op = "claim.register"
    if op == "policy.add_note":
        t.used_notes.add((t.case, policy))
        body = f"soak note {t.name} {i}"
        return op, {"policy_id": policy, "author": "soak", "body": body}, body
    if op == "claim.register":
        ref = f"CLM-2026-{i:05d}"
        return op, {"policy_id": policy, "claim_ref": ref, "reported_on": "2026-11-30",
                    "amount": rng.randint(100, 5000)}, ref
    ref = f"REQ-SOAK-{t.name}-{i}"
    return op, {"policy_id": policy, "series": rng.choice(["POL", "END"]),
                "kind": rng.choice(["schedule", "certificate", "endorsement"]),
                "request_ref": ref}, ref


def count_effect(t: Target, op: str, key: str) -> int:
    if op == "policy.add_note":
        return int(t.scalar("SELECT count(*) FROM policy_note WHERE body = :k", k=key))
    if op == "claim.register":
        return int(t.scalar("SELECT count(*) FROM claim WHERE claim_ref = :k", k=key))
    return int(t.scalar("SELECT count(*) FROM issued_document WHERE request_ref = :k", k=key))


def test_soak_random_sigkills(targets: list[Target], tmp_path: Path) -> None:
    seed = int(os.environ.get("CAPGATE_SOAK_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\ncrash soak seed {seed} (CAPGATE_SOAK_SEED={seed} replays it)")
    rng = random.Random(seed)
    why = f"(seed {seed})"
    points: list[str | None] = [*CRASH_POINTS, None]
    started = time.monotonic()
    zygote = Zygote()
    killed = replays = resume_kills = done = 0
    try:
        for i in range(CALLS):
            if time.monotonic() - started > BUDGET_SECONDS:  # a slow machine: stop early
                assert i >= MIN_CALLS, f"only {i} calls within {BUDGET_SECONDS} s {why}"
                break
            done = i + 1
            t = rng.choice(targets)
            if t.calls_in_case >= 8:
                t.cases, t.calls_in_case = t.cases + 1, 0
            t.calls_in_case += 1
            if t.expected and rng.random() < 0.1:  # the same request again: nothing runs
                op, key = rng.choice(sorted(t.expected))
                request = t.expected[(op, key)]
                if request["case"] == t.case:
                    out = t.ex.call(op, request["inputs"], case=t.case, who="agent")
                    assert out.replayed, f"{op} {key} ran again {why}"
                    replays += 1
            op, inputs, key = next_request(rng, t, i)
            point = rng.choice(points)
            ended = zygote.run({
                "target": t.url.render_as_string(hide_password=False), "ledger": t.ledger,
                "operation": op, "inputs": inputs, "case": t.case, "who": "agent",
                "out": str(tmp_path / "out.json"), "crash_at": point})
            t.expected[(op, key)] = {"case": t.case, "inputs": inputs}
            if point is None:
                assert ended.state == "exited" and ended.code == 0, f"{ended} {why}"
            else:
                assert ended.killed, f"{ended} {why}"
                killed += 1
                if rng.random() < 0.3:  # a resume that is itself killed inside its retry
                    again = zygote.run({
                        "target": t.url.render_as_string(hide_password=False),
                        "ledger": t.ledger, "case": t.case, "resume": True,
                        "out": str(tmp_path / "out.json"),
                        "crash_at": rng.choice(CRASH_POINTS[1:])})
                    assert again.killed or (again.state == "exited" and again.code == 0), \
                        f"{again} {why}"
                    resume_kills += again.killed
            report = resume(t.ex, t.case)
            assert report.exit_code == 0, f"{t.name} {op} killed {point}: " \
                f"{report.to_dict()} {why}"
            for item in report.intents:
                t.outcomes[item.classification] = t.outcomes.get(item.classification, 0) + 1
            assert count_effect(t, op, key) == 1, f"{t.name} {op} {key} killed {point} {why}"
    finally:
        zygote.close()

    for t in targets:
        assert not t.ex.ledger.cases(open_only=True), f"{t.name}: open cases {why}"
        verified = t.ex.ledger.verify()
        assert verified.ok, f"{t.name}: {verified.to_dict()} {why}"
        for (op, key) in t.expected:
            assert count_effect(t, op, key) == 1, f"{t.name}: {op} {key} {why}"
        by_op = {op: sum(1 for o, _ in t.expected if o == op)
                 for op in ("policy.add_note", "claim.register", "document.issue")}
        assert t.scalar("SELECT count(*) FROM policy_note") == 4 + by_op["policy.add_note"]
        assert t.scalar("SELECT count(*) FROM claim") == 1 + by_op["claim.register"]
        assert t.scalar("SELECT count(*) FROM issued_document") == 5 + by_op["document.issue"]
        assert t.scalar("SELECT count(*) FROM capgate_landed") == sum(by_op.values())
        for series, first in (("POL", 1001), ("END", 16)):
            numbers = t.scalar("SELECT count(DISTINCT doc_no) FROM issued_document"
                               " WHERE series = :s", s=series)
            top = t.scalar("SELECT max(doc_no) FROM issued_document WHERE series = :s",
                           s=series)
            following = t.scalar("SELECT next_no FROM document_number WHERE series = :s",
                                 s=series)
            assert top - first + 1 == numbers and following == top + 1, \
                f"{t.name}: gap or duplicate in {series} {why}"
    elapsed = time.monotonic() - started
    print(f"crash soak: {done} calls, {killed} SIGKILLs, {resume_kills} inside a resume, "
          f"{replays} replays in {elapsed:.1f} s; "
          + "; ".join(f"{t.name}: {t.outcomes}" for t in targets))
