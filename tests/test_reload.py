"""A long-lived process runs what the files say now: grants, rows and the lock re-read.

Before, ``capgate mcp`` (and an executor held by a Python caller) read the
grants once: an agent whose write grant was withdrawn kept writing, and an
approver removed from ``grants.toml`` still had their approval consumed.  Now
every call stats the files first; a change is re-read and swapped in, a file
that fails validation fails closed (a coded refusal naming the file and line)
while the process keeps running, and the MCP clients whose tools changed get
``notifications/tools/list_changed``.

Everything runs against real PostgreSQL and MariaDB, and the server is the
process a user starts (``python -m capgate mcp``, stdio and ``--http``), driven
by the ``mcp`` SDK's client.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy.engine import URL

import capgate
from capgate.registry import errors
from tests.fix_capgate import KEYS, in_threads
from tests.server_support import (
    TOKENS,
    Project,
    call,
    grants_text,
    http_session,
    list_changed,
    server_url,
    tool_names,
    until,
)

__all__ = ["server_url"]  # the fixture, imported for pytest

NOTE = {"policy_id": 2, "author": "agent", "body": "Called about the renewal."}


def note(n: int) -> dict[str, Any]:
    return {**NOTE, "body": f"note {n}"}


# --- the Python API: one executor, held ------------------------------------------------


def test_a_withdrawn_write_grant_takes_effect_at_once(server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)
    with capgate.open(project.config) as ex:
        assert ex.call("policy.add_note", note(1), case="C-1", who="agent").status \
            == "applied_verified"
        project.grants.write_text(grants_text("dev", agent="read"))
        before = project.dump("policy_note")
        with pytest.raises(errors.NotAuthorized, match="holds no write grant"):
            ex.call("policy.add_note", note(2), case="C-2", who="agent")
        assert project.dump("policy_note") == before
        assert ex.call("policy.get", {"policy_id": 1}, case="C-2", who="agent").status == "ok"
        # given back: the same executor writes again
        project.grants.write_text(grants_text("dev"))
        assert ex.call("policy.add_note", note(3), case="C-3", who="agent").status \
            == "applied_verified"


def test_a_removed_approver_has_no_approval_consumed(server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)
    with capgate.open(project.config) as ex:
        with pytest.raises(errors.ApprovalRequired) as asked:
            ex.call("policy.purge_orphan", {"policy_id": 9}, case="T-2", who="agent")
        plan_hash = asked.value.details["plan_hash"]
        ex.approve(plan_hash, by="alice", role="dba", key=KEYS["alice"])
        # alice leaves: her principal (role and key) is gone from the grants file
        project.grants.write_text(grants_text("dev", approvers=False)
                                  + '[principals.bob]\nroles = ["dba"]\n')
        before = project.dump("policy")
        with pytest.raises(errors.CapgateError) as refused:
            ex.call("policy.purge_orphan", {"policy_id": 9}, case="T-2", who="agent")
        assert refused.value.code in ("CG208", "CG201"), refused.value
        assert project.dump("policy") == before
        assert [a.used_by_intent for a in ex.ledger.approvals_for(plan_hash)] == [None]


def test_a_grants_file_that_fails_validation_fails_closed(server_url: URL,
                                                          tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)
    with capgate.open(project.config) as ex:
        assert ex.call("policy.get", {"policy_id": 1}, case="C-1", who="agent").status == "ok"
        text = project.grants.read_text()
        project.grants.write_text(text.replace('access = "write"', 'access = "root"'))
        before = project.dump("policy_note")
        for name, inputs in (("policy.get", {"policy_id": 1}), ("policy.add_note", note(1))):
            with pytest.raises(errors.GrantsFileInvalid) as bad:
                ex.call(name, inputs, case="C-2", who="agent")
            assert bad.value.code == "CG209"
            assert bad.value.details["path"] == str(project.grants)
            assert bad.value.details["line"] == 1  # [principals.agent] is on line 1
            assert f"{project.grants}:1: principals.agent.grants[0]" in bad.value.message
        with pytest.raises(errors.GrantsFileInvalid):  # no plan, no approval either
            ex.plan("policy.purge_orphan", {"policy_id": 9}, case="C-2", who="agent")
        assert project.dump("policy_note") == before
        # a TOML syntax error names its line too
        project.grants.write_text("[principals.agent]\ngrants = [\n")
        with pytest.raises(errors.GrantsFileInvalid, match=r"grants\.toml:\d+:"):
            ex.call("policy.get", {"policy_id": 1}, case="C-2", who="agent")
        project.grants.write_text(text)  # fixed: the next call runs
        assert ex.call("policy.add_note", note(2), case="C-3", who="agent").status \
            == "applied_verified"


def test_a_capability_file_that_fails_validation_fails_closed_for_its_operations(
        server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)
    policies = project.caps / "policies.yaml"
    with capgate.open(project.config) as ex:
        assert ex.call("policy.get", {"policy_id": 1}, case="C-1", who="agent").status == "ok"
        text = policies.read_text()
        project.edit(policies, "recovery: reconcile_first", "recovery: sometimes", count=text.count(
            "recovery: reconcile_first"))
        line = next(i for i, ln in enumerate(policies.read_text().splitlines(), 1)
                    if "recovery: sometimes" in ln)
        before = project.dump("policy_note")
        for name, inputs in (("policy.get", {"policy_id": 1}), ("policy.add_note", note(1))):
            with pytest.raises(errors.CapabilityFilesInvalid) as bad:
                ex.call(name, inputs, case="C-2", who="agent")
            assert bad.value.code == "CG138"
            assert bad.value.details["path"] == str(policies)
            assert bad.value.details["line"] == line
            assert f"{policies}:{line}:" in bad.value.message
        assert project.dump("policy_note") == before
        # an operation whose file still validates keeps running
        out = ex.call("premium.list_overdue", {"as_of": "2030-01-01"}, case="C-2", who="agent")
        assert out.status == "ok"
        policies.write_text(text)  # fixed
        assert ex.call("policy.add_note", note(2), case="C-3", who="agent").status \
            == "applied_verified"


def test_calls_from_eight_threads_after_a_revocation_are_all_refused(server_url: URL,
                                                                     tmp_path: Path) -> None:
    """One reload for all of them, and none runs on the grants the change replaced."""
    project = Project(tmp_path, server_url)
    with capgate.open(project.config) as ex:
        assert ex.call("policy.add_note", note(0), case="W-0", who="agent").status \
            == "applied_verified"
        before_generation = ex.generation
        project.grants.write_text(grants_text("dev", agent="read"))
        before = project.dump("policy_note")
        start = threading.Barrier(8)
        refused: list[str] = []

        def work(n: int) -> None:
            start.wait()
            try:
                ex.call("policy.add_note", note(n + 1), case=f"W-{n + 1}", who="agent")
            except errors.NotAuthorized as exc:
                refused.append(exc.code)

        assert in_threads(8, work) == []
        assert refused == ["CG200"] * 8
        assert project.dump("policy_note") == before
        assert ex.generation == before_generation + 1  # one swap, not eight


def test_a_same_size_rewrite_with_the_old_mtime_is_still_seen(tmp_path: Path) -> None:
    """The stat alone could miss it (git's racy entries): a recent file is compared by
    content as well, until it is older than the filesystem's timestamp granularity."""
    from capgate.executor.sources import FileWatch

    path = tmp_path / "grants.toml"
    path.write_text('access = "write"\n')
    watch = FileWatch([path], lambda _: True)
    watch.commit(watch.take())
    assert not watch.changed()
    st = path.stat()
    path.write_text('access = "read!"\n')  # the same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime
    assert path.stat().st_size == st.st_size
    assert watch.changed()


# --- the server a user starts ---------------------------------------------------------


def test_stdio_server_follows_a_withdrawn_grant(server_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)

    async def main() -> None:
        async with project.stdio() as (session, notes):
            assert "policy.add_note" in await tool_names(session)
            got = await call(session, "policy.add_note", note(1), "C-1")
            assert got["status"] == "applied_verified", got
            project.grants.write_text(grants_text("dev", agent="read"))
            await until(lambda: list_changed(notes) >= 1, "tools/list_changed after the edit")
            assert "policy.add_note" not in await tool_names(session)
            assert "policy.get" in await tool_names(session)
            before = project.dump("policy_note")
            got = await call(session, "policy.add_note", note(2), "C-2")
            assert got["status"] == "refused" and got["error"]["code"] == "CG200", got
            assert project.dump("policy_note") == before

            # a grants file that does not validate: refused with file and line, still serving
            project.grants.write_text("[principals.agent]\ngrants = [\n")
            await until(lambda: list_changed(notes) >= 2, "tools/list_changed (grants broken)")
            got = await call(session, "policy.get", {"policy_id": 1}, "C-3")
            assert got["status"] == "refused" and got["error"]["code"] == "CG209", got
            assert f"{project.grants}:" in got["error"]["message"]
            project.grants.write_text(grants_text("dev"))
            await until(lambda: list_changed(notes) >= 3, "tools/list_changed (grants fixed)")
            got = await call(session, "policy.add_note", note(3), "C-4")
            assert got["status"] == "applied_verified", got

    anyio.run(main)
    log = project.errlog.read_text()
    assert "files reloaded" in log


def test_stdio_server_does_not_consume_a_removed_approvers_approval(server_url: URL,
                                                                    tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)

    async def main() -> None:
        async with project.stdio() as (session, _):
            asked = await call(session, "policy.purge_orphan", {"policy_id": 9}, "T-2")
            assert asked["status"] == "approval_required", asked
            approved = project.approve(asked["plan_hash"])
            assert approved.code == 0, approved.err
            project.grants.write_text(grants_text("dev", approvers=False)
                                      + '[principals.bob]\nroles = ["dba"]\n')
            before = project.dump("policy")
            got = await call(session, "policy.purge_orphan", {"policy_id": 9}, "T-2")
            assert got["status"] in ("refused", "approval_required"), got
            assert got["error"]["code"] in ("CG208", "CG201"), got
            assert project.dump("policy") == before

    anyio.run(main)


def test_stdio_server_fails_closed_on_an_invalid_capability_file(server_url: URL,
                                                                 tmp_path: Path) -> None:
    project = Project(tmp_path, server_url)
    documents = project.caps / "documents.yaml"

    async def main() -> None:
        async with project.stdio() as (session, notes):
            assert "document.list" in await tool_names(session)
            text = documents.read_text()
            documents.write_text(text.replace("effect_class: read", "effect_class: peek", 1))
            await until(lambda: list_changed(notes) >= 1, "tools/list_changed")
            names = await tool_names(session)
            assert "document.list" not in names and "policy.get" in names
            got = await call(session, "document.list", {"policy_id": 1}, "D-1")
            assert got["status"] == "refused" and got["error"]["code"] == "CG138", got
            assert str(documents) in got["error"]["message"]
            assert (await call(session, "policy.get", {"policy_id": 1}, "D-1"))["status"] == "ok"
            documents.write_text(text)
            await until(lambda: list_changed(notes) >= 2, "tools/list_changed (fixed)")
            assert "document.list" in await tool_names(session)

    anyio.run(main)


def test_http_server_follows_a_withdrawn_grant_per_identity(server_url: URL,
                                                            tmp_path: Path) -> None:
    """Over HTTP each identity is told only when its own tools changed."""
    project = Project(tmp_path, server_url)
    agent, reader = list(TOKENS)

    async def main(url: str) -> None:
        agent_notes: list[Any] = []
        reader_notes: list[Any] = []
        async with http_session(url, agent, agent_notes) as as_agent, \
                http_session(url, reader, reader_notes) as as_reader:
            assert "policy.add_note" in await tool_names(as_agent)
            reads = await tool_names(as_reader)
            got = await call(as_agent, "policy.add_note", note(1), "H-1")
            assert got["status"] == "applied_verified", got
            project.grants.write_text(grants_text("dev", agent="read"))
            await until(lambda: list_changed(agent_notes) >= 1, "the agent's tools/list_changed")
            assert "policy.add_note" not in await tool_names(as_agent)
            before = project.dump("policy_note")
            got = await call(as_agent, "policy.add_note", note(2), "H-2")
            assert got["status"] == "refused" and got["error"]["code"] == "CG200", got
            assert project.dump("policy_note") == before
            assert await tool_names(as_reader) == reads
            assert list_changed(reader_notes) == 0  # the reader's list did not change

    with project.http() as (url, _):
        anyio.run(main, url)


def test_a_file_that_does_not_matter_reloads_nothing(tmp_path: Path) -> None:
    """An editor's swap file beside the rows changes the folder, not the files."""
    import shutil

    from capgate.executor.sources import RACY_SECONDS, capability_watch
    from tests.server_support import CAPABILITIES

    caps = tmp_path / "capabilities"
    shutil.copytree(CAPABILITIES, caps)
    watch = capability_watch([caps])
    watch.commit(watch.take())
    (caps / ".policies.yaml.swp").write_text("editor state")
    assert not watch.changed()
    (caps / "new.yaml").write_text("format: 1\nrows: []\n")
    assert watch.changed()  # a capability file appeared: that matters
    watch.commit(watch.take())
    (caps / "new.yaml").unlink()
    assert watch.changed()  # and so does one going away
    watch.commit(watch.take())
    import time

    time.sleep(RACY_SECONDS + 0.1)  # past the racy window: stats alone decide
    assert not watch.changed()
    lock = caps / "capabilities.lock"
    lock.write_text(lock.read_text() + " ")
    assert watch.changed()
