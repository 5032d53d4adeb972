"""The approver sees what they sign: ``plan show``, ``approvals``, ``approve`` that shows
and asks, and the HTML case view of a pending plan.

Before, ``capgate approve sha256:...`` printed nothing of the plan it approved and no
command showed a recorded plan by its hash: an approver signed a hash, blind.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capgate.commands.project import init_project

ROOT = Path(__file__).resolve().parent.parent
PURGE = ["policy.purge_orphan", "--input", '{"policy_id": 9}', "--case", "TICKET-2"]


def env_for(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    return {**env, "CAPGATE_CACHE_DIR": str(tmp / "cache"), "PYTHONPATH": str(ROOT)}


def run(proj: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "capgate", *args], cwd=proj,
                          env=env_for(proj.parent), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300, check=False)
    assert proc.returncode == code, (args, proc.stdout, proc.stderr)
    return proc


@pytest.fixture
def gated(tmp_path: Path) -> tuple[Path, str]:
    """A project made by ``capgate init`` and the hash of a refused gated call's plan."""
    init_project(tmp_path / "proj")
    proj = tmp_path / "proj"
    refused = run(proj, "call", *PURGE, "--json", code=4)
    return proj, json.loads(refused.stdout)["details"]["plan_hash"]


def test_plan_show_prints_what_the_approver_signs(gated: tuple[Path, str]) -> None:
    proj, plan_hash = gated
    shown = json.loads(run(proj, "plan", "show", plan_hash, "--json").stdout)
    body = shown["plan"]
    assert shown["plan_hash"] == plan_hash and shown["status"] == "awaiting approval"
    assert (shown["case"], shown["requester"]) == ("TICKET-2", "claims-agent")
    assert shown["created_at"] and shown["approval_ttl_seconds"] == 1800
    assert (body["operation_id"], body["version"], body["environment"]) == (
        "policy.purge_orphan", 2, "dev")
    assert body["row_hash"].startswith("sha256:")
    assert [s["binds"] for s in body["statements"]] == [{"policy_id": 9}] * 5
    assert [c["name"] for c in body["verify"]] == ["policy_gone", "nothing_left_behind"]
    text = run(proj, "plan", "show", plan_hash).stdout
    for needle in (plan_hash, "awaiting approval", "case TICKET-2", "claims-agent",
                   "policy.purge_orphan@2", body["row_hash"], "(dev)",
                   "DELETE FROM policy WHERE policy_id = :policy_id AND status = 'void'",
                   'binds {"policy_id": 9}; expect 1', "verify policy_gone",
                   "an approval of it lasts 1800 s", "four eyes"):
        assert needle in text, needle
    missing = run(proj, "plan", "show", "sha256:" + "0" * 64, code=1)
    assert "CG207" in missing.stdout + missing.stderr


def test_approvals_lists_what_waits_and_forgets_what_was_used(
        gated: tuple[Path, str]) -> None:
    proj, plan_hash = gated
    waiting = json.loads(run(proj, "approvals", "--json").stdout)
    assert [(p["plan_hash"], p["status"]) for p in waiting] == [(plan_hash, "awaiting approval")]
    assert plan_hash in run(proj, "approvals").stdout
    run(proj, "approve", plan_hash, "--by", "bob", "--role", "dba", "--key", "keys/bob.key")
    approved = json.loads(run(proj, "approvals", "--json").stdout)
    assert [p["status"] for p in approved] == ["approved, not yet used"]
    run(proj, "call", *PURGE)
    assert json.loads(run(proj, "approvals", "--json").stdout) == []


def test_approve_prints_the_plan_before_the_approval(gated: tuple[Path, str]) -> None:
    proj, plan_hash = gated
    out = run(proj, "approve", plan_hash, "--by", "bob", "--role", "dba", "--key",
              "keys/bob.key").stdout
    shown_at = out.index("DELETE FROM policy WHERE policy_id")
    assert shown_at < out.index(f"approved {plan_hash} by bob")
    assert "case TICKET-2, requested by claims-agent" in out


def _on_a_terminal(proj: Path, args: list[str], answer: str | None) -> tuple[int, str]:
    """Run capgate with a pseudo-terminal as its stdin and stdout; type ``answer`` once
    it has asked (None: expect no question)."""
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "capgate", *args], cwd=proj,
                            env=env_for(proj.parent), stdin=sub, stdout=sub, stderr=sub,
                            close_fds=True)
    os.close(sub)
    said = b""
    deadline = time.monotonic() + 300
    answered = answer is None
    try:
        while True:
            if time.monotonic() > deadline:
                pytest.fail(f"capgate {args} did not finish in 300 s: {said.decode()!r}")
            ready, _, _ = select.select([main], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                said += chunk
                if not answered and b"[y/N]" in said:
                    os.write(main, answer.encode() + b"\n")  # type: ignore[union-attr]
                    answered = True
                if not chunk and proc.poll() is not None:
                    break
            elif proc.poll() is not None:
                break
    finally:
        os.close(main)
        proc.wait(30)
    return proc.returncode, said.decode(errors="replace")


def test_approve_asks_on_a_terminal_and_a_no_records_nothing(
        gated: tuple[Path, str]) -> None:
    proj, plan_hash = gated
    approve = ["approve", plan_hash, "--by", "bob", "--role", "dba", "--key", "keys/bob.key"]
    code, said = _on_a_terminal(proj, approve, "n")
    assert code == 1 and "CG220" in said and "approve this plan as bob (dba)?" in said
    assert "DELETE FROM policy WHERE policy_id" in said.split("[y/N]")[0]
    assert [p["status"] for p in json.loads(run(proj, "approvals", "--json").stdout)] == [
        "awaiting approval"]  # declined: nothing recorded
    code, said = _on_a_terminal(proj, approve, "y")
    assert code == 0 and f"approved {plan_hash} by bob" in said
    run(proj, "call", *PURGE)


def test_approve_yes_does_not_ask_on_a_terminal(gated: tuple[Path, str]) -> None:
    proj, plan_hash = gated
    code, said = _on_a_terminal(proj, ["approve", plan_hash, "--by", "bob", "--role", "dba",
                                       "--key", "keys/bob.key", "--yes"], None)
    assert code == 0 and "[y/N]" not in said and f"approved {plan_hash}" in said


def test_the_case_page_shows_a_pending_plans_text(gated: tuple[Path, str]) -> None:
    proj, plan_hash = gated
    page = proj / "TICKET-2.html"
    run(proj, "ledger", "show", "TICKET-2", "--html", str(page))
    html = page.read_text("utf-8")
    section = html[html.index('<section id="plans">'):]
    section = section[:section.index("</section>")]
    assert plan_hash in section and "awaiting approval" in section
    assert "DELETE FROM policy WHERE policy_id = :policy_id AND status = &#x27;void&#x27;" \
        in section
    assert "binds {&quot;policy_id&quot;: 9}" in section


