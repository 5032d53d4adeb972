"""The lock fails closed: outside the unlocked environments only pinned rows run.

Before, in qa with ``capabilities.lock`` deleted, a pinned gated row edited in
place to ``authorization: {kind: write_grant}`` was applied without any
approval -- from the CLI and through ``capgate mcp`` -- and a running server
kept the edited row after the lock was restored; ``retired`` was outside the
hash and the lock, so deleting ``retired: true`` un-retired a row unseen; and
rows the lock did not pin were served unmarked.  Now a missing lock (``CG135``)
or an unpinned row (``CG136``) is refused outside ``rig`` and ``dev``, the
lock records retirements (``CG137``), and unpinned rows are marked wherever
rows are listed.  Real PostgreSQL and MariaDB; the server as a user starts it.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from sqlalchemy.engine import URL

import capgate
from capgate.registry import errors
from tests.server_support import (
    Project,
    call,
    list_changed,
    server_url,
    tool_names,
    until,
)

__all__ = ["server_url"]  # the fixture, imported for pytest

GATE = """    authorization:
      kind: gate
      approver_roles: [dba, underwriting_lead]
      four_eyes: true
      approval_ttl_seconds: 1800
"""
PURGE_V2 = "  - operation_id: policy.purge_orphan\n    version: 2\n"


def ungate(project: Project) -> None:
    """The attack: policy.purge_orphan@2 (pinned, gated) edited in place to a write grant."""
    policies = project.caps / "policies.yaml"
    text = policies.read_text()
    start = text.index(PURGE_V2)
    at = text.index(GATE, start)
    policies.write_text(text[:at] + "    authorization: {kind: write_grant}\n"
                        + text[at + len(GATE):])


def test_cli_in_qa_refuses_when_the_lock_is_missing(server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url, environment="qa")
    (project.caps / "capabilities.lock").unlink()
    ungate(project)
    before = project.dump("policy")
    ran = project.cli("call", "policy.purge_orphan", "--input", '{"policy_id": 9}',
                      "--case", "Q-1", "--json")
    assert ran.code == 1, (ran.out, ran.err)
    refusal = ran.json()
    assert refusal["code"] == "CG135", refusal
    assert "capabilities.lock" in refusal["message"] and "'qa'" in refusal["message"]
    assert project.dump("policy") == before
    # reads too: nothing runs unpinned in qa
    ran = project.cli("call", "policy.get", "--input", '{"policy_id": 1}', "--case", "Q-1",
                      "--json")
    assert ran.code == 1 and ran.json()["code"] == "CG135"


def test_cli_in_dev_runs_unpinned_rows_and_says_so(server_url: URL, tmp_path: Path) -> None:
    """dev is unlocked by default: a draft runs there, and every listing marks it."""
    project = Project(tmp_path, server_url, environment="dev", lock=False)
    ran = project.cli("call", "policy.get", "--input", '{"policy_id": 1}', "--case", "D-1")
    assert ran.code == 0, (ran.out, ran.err)
    listed = project.cli("list", "--json")
    assert {r["pinned"] for r in listed.json()} == {False}
    shown = project.cli("show", "policy.get")
    assert "lock:          UNPINNED" in shown.out


def test_an_unpinned_row_is_refused_in_qa_and_the_unlocked_list_is_configurable(
        server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url, environment="qa")
    policies = project.caps / "policies.yaml"
    # a new row nobody pinned yet (a draft): v2 of policy.get
    text = policies.read_text()
    start = text.index("  - operation_id: policy.get\n")
    end = text.index("  - operation_id:", start + 10)
    draft = text[start:end].replace("version: 1", "version: 2", 1)
    policies.write_text(text[:end] + draft + text[end:])
    assert project.cli("validate").code == 0  # a draft is valid; it is only not pinned
    ran = project.cli("call", "policy.get", "--input", '{"policy_id": 1}', "--case", "Q-2",
                      "--json")
    assert ran.code == 1 and ran.json()["code"] == "CG136", ran.out
    assert "does not pin" in ran.json()["message"]
    assert "UNPINNED" in project.cli("list").out
    pinned = {f"{r['operation_id']}@{r['version']}": r["pinned"]
              for r in project.cli("list", "--json").json()}
    assert pinned["policy.get@2"] is False and pinned["policy.add_note@1"] is True
    # a configuration that declares qa unlocked runs it (the rule is the config's to set)
    config = project.config.read_text().replace(
        '[capgate]\n', '[capgate]\nunlocked_environments = ["rig", "dev", "qa"]\n', 1)
    project.config.write_text(config)
    ran = project.cli("call", "policy.get", "--input", '{"policy_id": 1}', "--case", "Q-2")
    assert ran.code == 0, (ran.out, ran.err)


def test_retired_state_is_pinned(server_url: URL, tmp_path: Path) -> None:
    """Deleting `retired: true` from a row the lock records as retired is refused."""
    project = Project(tmp_path, server_url, environment="qa")
    policies = project.caps / "policies.yaml"
    old = "  - operation_id: policy.cancel\n    version: 1\n    retired: true\n"
    project.edit(policies, old, old.replace("    retired: true\n", ""))
    ran = project.cli("validate")
    assert ran.code == 1 and "CG137" in ran.out, ran.out
    assert "policy.cancel@1" in ran.out
    before = project.dump("premium")
    called = project.cli("call", "policy.cancel@1", "--input", '{"policy_id": 2}', "--case",
                         "R-1", "--json")
    assert called.code != 0 and called.json()["code"] == "CG100", called.out
    assert "CG137" in called.out
    assert project.dump("premium") == before
    # retiring stays one step: a row retired without touching the lock is retired at once
    project.edit(policies, old.replace("    retired: true\n", ""), old)
    current = "  - operation_id: policy.cancel\n    version: 2\n"
    project.edit(policies, current, current + "    retired: true\n")
    assert project.cli("validate").code == 0
    ran = project.cli("call", "policy.cancel", "--input", '{"policy_id": 2}', "--case", "R-2",
                      "--json")
    assert ran.code == 1 and ran.json()["code"] == "CG142", ran.out


def test_running_server_in_qa_fails_closed_on_the_lock(server_url: URL, tmp_path: Path) -> None:
    """The MCP server: the lock deleted and a gated row ungated -> refused; the lock
    restored -> the edited row is refused (it no longer matches its pin), never applied."""
    project = Project(tmp_path, server_url, environment="qa")
    lock = project.caps / "capabilities.lock"
    pins = lock.read_text()

    async def main() -> None:
        async with project.stdio() as (session, notes):
            assert "policy.purge_orphan" in await tool_names(session)
            asked = await call(session, "policy.purge_orphan", {"policy_id": 9}, "Q-9")
            assert asked["status"] == "approval_required", asked
            before = project.dump("policy")

            lock.unlink()
            ungate(project)
            await until(lambda: list_changed(notes) >= 1, "tools/list_changed (lock gone)")
            assert await tool_names(session) == set()  # qa runs pinned rows only
            got = await call(session, "policy.purge_orphan", {"policy_id": 9}, "Q-9")
            assert got["status"] == "refused" and got["error"]["code"] == "CG135", got
            assert project.dump("policy") == before

            lock.write_text(pins)  # restored: the edited row no longer matches its pin
            await until(lambda: list_changed(notes) >= 2, "tools/list_changed (lock back)")
            names = await tool_names(session)
            assert "policy.get" in names and "policy.purge_orphan" not in names
            got = await call(session, "policy.purge_orphan", {"policy_id": 9}, "Q-9")
            assert got["status"] == "refused" and got["error"]["code"] == "CG138", got
            assert "CG130" in got["error"]["message"]
            assert project.dump("policy") == before

    anyio.run(main)


def test_tools_of_unpinned_rows_are_marked_in_dev(server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url, environment="dev", lock=False)

    async def main() -> None:
        async with project.stdio() as (session, _):
            tools = {t.name: t for t in (await session.list_tools()).tools}
            tool = tools["policy.add_note"]
            assert (tool.meta or {})["capgate/pinned"] is False
            assert tool.title is not None and "UNPINNED" in tool.title
            assert tool.description is not None and "UNPINNED" in tool.description

    anyio.run(main)


def test_api_executor_in_prod_needs_the_lock(server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url, environment="prod")
    with capgate.open(project.config) as ex:
        assert ex.call("policy.get", {"policy_id": 1}, case="P-1", who="agent").status == "ok"
        (project.caps / "capabilities.lock").unlink()
        with pytest.raises(errors.CapgateError) as refused:
            ex.call("policy.get", {"policy_id": 1}, case="P-1", who="agent")
        assert refused.value.code == "CG135"
