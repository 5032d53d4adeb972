"""Secrets stay secret: open key files refused, keys ignored by git, approvals bounded,
refusals without another case's ids, URLs that never echo a password.

* a key or token file readable by its group or others is refused, as ssh refuses
  one, naming the file and the ``chmod`` (``CG920``);
* ``capgate init`` writes its keys under ``keys/``, which its ``.gitignore``
  covers;
* an approval lives at most ``approval_ttl_max_seconds`` (default a day,
  ``CG210``); nothing is recorded beyond it;
* a refusal never shows another case's id or intent (``CG330`` named them);
* a connector URL that fails to parse is never echoed with its password
  (``CG902`` printed it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from sqlalchemy.engine import URL

import capgate
from capgate.commands.project import init_project
from capgate.executor.claims import store_for
from capgate.registry import errors
from tests.fix_capgate import KEYS, approver_key_file
from tests.server_support import TOKENS, Project, call, server_url
from tests.test_init import clean_env

__all__ = ["server_url"]  # the fixture, imported for pytest


def open_copy(src: Path, dest: Path, mode: int) -> Path:
    shutil.copyfile(src, dest)
    dest.chmod(mode)
    return dest


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_an_approver_key_open_to_others_is_refused(mode: int, pg_url: URL,
                                                   tmp_path: Path) -> None:
    project = Project(tmp_path, pg_url)
    asked = project.cli("plan", "policy.purge_orphan", "--input", '{"policy_id": 9}',
                        "--case", "S-1", "--json")
    assert asked.code == 0, asked.err
    plan_hash = asked.json()["plan_hash"]
    key = open_copy(approver_key_file("alice"), tmp_path / "alice.key", mode)
    ran = project.cli("approve", plan_hash, "--by", "alice", "--role", "dba", "--key", str(key),
                      "--json")
    assert ran.code == 2, (ran.out, ran.err)
    refusal = ran.json()
    assert refusal["code"] == "CG920"
    assert str(key) in refusal["message"] and f"chmod 600 {key}" in refusal["message"]
    assert f"{mode:04o}" in refusal["message"]
    with capgate.open(project.config) as ex:
        assert ex.ledger.approvals_for(plan_hash) == []
    key.chmod(0o600)  # as ssh: once only its owner can read it, it is used
    assert project.cli("approve", plan_hash, "--by", "alice", "--role", "dba",
                       "--key", str(key)).code == 0


def test_a_tokens_file_open_to_others_is_refused(pg_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, pg_url)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    tokens.chmod(0o644)
    ran = subprocess.run(project.command("mcp", "--http", "127.0.0.1:15199", "--tokens",
                                         str(tokens)),
                         cwd=tmp_path, env=project.env(), stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 2, (ran.stdout, ran.stderr)
    said = ran.stdout + ran.stderr
    assert "CG920" in said and f"chmod 600 {tokens}" in said
    assert next(iter(TOKENS)) not in said


def test_init_keeps_its_keys_out_of_git(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    report = init_project(proj)
    assert "keys/alice.key" in report.files or any(f.startswith("keys/") for f in report.files)
    ignored = (proj / ".gitignore").read_text().splitlines()
    assert "keys/" in ignored and ".capgate/" in ignored
    assert (proj / "keys").stat().st_mode & 0o077 == 0
    for key in (proj / "keys").iterdir():
        assert key.stat().st_mode & 0o077 == 0, key
    if shutil.which("git"):
        subprocess.run(["git", "init", "-q", str(proj)], check=True)
        checked = subprocess.run(["git", "-C", str(proj), "check-ignore", "keys/alice.key"],
                                 capture_output=True, text=True, check=False)
        assert checked.returncode == 0 and "keys/alice.key" in checked.stdout


def test_init_adds_keys_to_an_existing_gitignore(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / ".gitignore").write_text("node_modules")
    init_project(proj)
    assert (proj / ".gitignore").read_text().splitlines() == ["node_modules", ".capgate/",
                                                              "keys/"]


def test_an_approval_lives_at_most_the_configured_maximum(pg_url: URL, tmp_path: Path) -> None:
    project = Project(tmp_path, pg_url)
    with capgate.open(project.config) as ex:
        with pytest.raises(errors.ApprovalRequired) as asked:
            ex.call("policy.purge_orphan", {"policy_id": 9}, case="TTL-1", who="agent")
        plan_hash = asked.value.details["plan_hash"]
        with pytest.raises(errors.ApprovalTtlTooLong) as refused:
            ex.approve(plan_hash, by="alice", role="dba", key=KEYS["alice"],
                       ttl_seconds=86_401)
        assert refused.value.code == "CG210" and "86400" in refused.value.message
        assert ex.ledger.approvals_for(plan_hash) == []
        assert ex.approve(plan_hash, by="alice", role="dba", key=KEYS["alice"],
                          ttl_seconds=86_400)["approval_id"]
    # the CLI, with a configured maximum
    project.config.write_text(project.config.read_text().replace(
        "[capgate]\n", "[capgate]\napproval_ttl_max_seconds = 600\n", 1))
    ran = project.cli("approve", plan_hash, "--by", "bob", "--role", "dba", "--ttl", "11m",
                      "--key", str(approver_key_file("bob")), "--json")
    assert ran.code == 2 and ran.json()["code"] == "CG210", ran.out


def test_a_coordination_refusal_shows_no_other_case(server_url: URL, tmp_path: Path) -> None:
    """CG330 named the holding case and its intent; the asking agent sees neither."""
    project = Project(tmp_path, server_url)
    project.config.write_text(project.config.read_text().replace("case_claim_seconds = 0\n",
                                                                 "case_claim_seconds = 600\n"))
    with capgate.open(project.config) as ex:
        held = ex.call("policy.add_note", {"policy_id": 2, "author": "a", "body": "mine"},
                       case="SECRET-CASE-OF-BOB", who="agent")
        assert held.status == "applied_verified"
        holder_intent = held.intent_id
        with pytest.raises(errors.CoordinationRequired) as refused:
            ex.call("policy.add_note", {"policy_id": 2, "author": "b", "body": "theirs"},
                    case="ASKER", who="agent")
        shown = json.dumps(refused.value.to_dict())
        assert "SECRET-CASE-OF-BOB" not in shown and holder_intent not in shown
        assert refused.value.details["requested_by_case"] == "ASKER"
        assert refused.value.holder["case_id"] == "SECRET-CASE-OF-BOB"  # kept for the ledger
        # the coordination decision is still recorded in both cases, with the holder
        asked = ex.ledger.snapshot("ASKER")
        assert asked is not None and "SECRET-CASE-OF-BOB" in json.dumps(asked)
        assert store_for(ex) is not None

    # the same through the MCP server
    async def main() -> None:
        async with project.stdio() as (session, _):
            got = await call(session, "policy.add_note",
                             {"policy_id": 2, "author": "c", "body": "via mcp"}, "ASKER-2")
            assert got["status"] == "refused" and got["error"]["code"] == "CG330", got
            text = json.dumps(got)
            assert "SECRET-CASE-OF-BOB" not in text and holder_intent not in text

    anyio.run(main)


def test_an_unparseable_connector_url_never_shows_its_password(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    proj = tmp_path / "proj"
    init_project(proj)
    config = proj / "capgate.toml"
    config.write_text(config.read_text().replace(
        'url = "sqlite:///insurance.db"',
        'url = "postgresql://app:Sup3rS3cret@db.internal:notaport/insurance"', 1))
    def run(args: list[str], cwd: Path) -> str:
        done = subprocess.run([sys.executable, "-m", "capgate", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode != 0, (args, done.stdout)
        return done.stdout + done.stderr

    for args in (["validate"], ["doctor"], ["doctor", "--json"], ["cases"]):
        out = run(args, proj)
        assert "CG902" in out, (args, out)
        assert "Sup3rS3cret" not in out, (args, out)
        assert "app:***@db.internal:notaport" in out
    made = run(["init", str(tmp_path / "other"), "--target",
                "postgresql://app:Sup3rS3cret@db:bad/x"], tmp_path)
    assert "Sup3rS3cret" not in made and "app:***@db:bad" in made
