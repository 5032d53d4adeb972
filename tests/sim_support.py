"""What the simulation-first suites share: venues, grants with scoped roles, dumps, SQL seen.

``venue(url, ledger, environment, **opts)`` is one environment's configuration
of the logical connector ``insurance`` -- its own database, the shared ledger
-- as a deployment with one configuration per environment has it.
``dump(url)`` reads every table of the example schema (and capgate's marker
table) in a stable order, to compare a target byte for byte; ``Statements``
records every statement that reaches an engine (SQLAlchemy's cursor event:
the executor's own driver path fires it too).
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.grants import Grants
from capgate.registry.loader import load_registry, update_lock
from capgate.registry.registry import Registry
from tests.fix_capgate import CAPABILITIES, GRANTS, approver_key, make_executor, table_dump

TABLES = ("policy", "cover", "premium", "document_number", "issued_document", "policy_note",
          "claim")
"""The example schema's tables (capabilities/schema)."""
EVERYWHERE = ["rig", "dev", "qa", "staging", "prod"]

SIM_GRANTS = Grants.from_dict({"principals": {
    **{name: {"roles": list(p.roles), "grants": [
        {"connector": g.connector, "environments": EVERYWHERE, "access": g.access}
        for g in p.grants], **({"approval_key": p.approval_key} if p.approval_key else {})}
       for name, p in GRANTS.principals.items()},
    # production simulation approvers: two roles, neither held by a requester
    "carol": {"roles": ["support_lead"], "approval_key": approver_key("carol").public_text,
              "grants": [{"connector": "*", "environments": EVERYWHERE, "access": "write"}]},
    "dave": {"roles": ["system_owner"], "approval_key": approver_key("dave").public_text},
    # a release manager for staging and prod only; an approver whose dba role is prod's only
    "rita": {"roles": [{"role": "release_manager", "environments": ["staging", "prod"]}],
             "grants": [{"connector": "*", "environments": EVERYWHERE, "access": "write"}]},
    "quinn": {"roles": [{"role": "dba", "environments": ["prod"]}],
              "approval_key": approver_key("quinn").public_text},
}}, source="tests (simulation)")

NEW_CLAIM = {"policy_id": 2, "claim_ref": "CLM-2024-500", "reported_on": "2024-08-20",
             "amount": 800}


def venue(url: URL | str, ledger: str, environment: str, *, schema: bool = True,
          registry: Registry | None = None, **opts: Any) -> Executor:
    """One environment's executor over its own database and the shared ledger."""
    ex = make_executor(url, ledger, environment=environment, schema=schema, **opts)
    ex.grants = SIM_GRANTS
    if registry is not None:
        ex.registry = registry
    return ex


@pytest.fixture
def venues() -> Iterator[Callable[..., Executor]]:
    """A factory of :func:`venue` executors, each closed when the test ends."""
    made: list[Executor] = []

    def factory(*args: Any, **kwargs: Any) -> Executor:
        ex = venue(*args, **kwargs)
        made.append(ex)
        return ex

    yield factory
    for ex in made:
        ex.close()


def registry_with(tmp: Path, extra: str) -> Registry:
    """The example rows plus the capability file text ``extra`` (rows on ``insurance``),
    published: pinned in the copy's ``capabilities.lock``, as a reviewed change would be
    -- outside rig and dev only pinned rows run."""
    caps = tmp / f"caps-{uuid.uuid4().hex[:8]}"
    shutil.copytree(CAPABILITIES, caps)
    (caps / "extra.yaml").write_text(extra, "utf-8")
    update_lock([caps])
    return load_registry([caps])


def dump(url: URL | str) -> dict[str, list[tuple[Any, ...]]]:
    """Every table of the example schema, rows sorted: a target compared byte for byte."""
    return {t: table_dump(url, t) for t in TABLES}


class Statements:
    """Every statement an engine was sent while recording (text, first keyword)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.seen.append(statement)

    @property
    def writes(self) -> list[str]:
        """The statements that change data (comments and whitespace skipped)."""
        from capgate.registry.model import leading_keyword

        return [s for s in self.seen if leading_keyword(s) in
                ("INSERT", "UPDATE", "DELETE", "MERGE", "REPLACE", "CREATE", "DROP", "ALTER")]


@contextlib.contextmanager
def recording(*engines: sa.Engine) -> Iterator[Statements]:
    """Record the statements sent to each engine (SQLAlchemy's ``before_cursor_execute``)."""
    seen = Statements()
    for engine in engines:
        sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        yield seen
    finally:
        for engine in engines:
            sa.event.remove(engine, "before_cursor_execute", seen)
