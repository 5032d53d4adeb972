"""A claim always belongs to a case the ledger knows, and a person can release it.

Before, ``capgate plan OP --case C1`` (no ``--dry-run``) claimed the target for
``case_claim_seconds`` but wrote nothing in case C1: ``case close C1`` and ``case release
C1`` answered CG412 "no case in ledger", another case's call on the target was refused
(CG330) until the claim expired, and ``capgate cases`` said C1 was closed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capgate.commands.project import init_project
from capgate.config import load_settings
from capgate.executor.claims import ClaimStore
from capgate.executor.ledger import open_ledger

ROOT = Path(__file__).resolve().parent.parent
NOTE = ["--input", '{"policy_id": 2, "author": "a", "body": "b"}']
KEY = "dev/insurance/policy_note/policy_id=2"


def run(proj: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env.update(CAPGATE_CACHE_DIR=str(proj.parent / "cache"), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "capgate", *args], cwd=proj, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == code, (args, proc.stdout, proc.stderr)
    return proc


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    """An init project whose cases hold their targets across calls (900 s, no wait)."""
    init_project(tmp_path / "proj")
    config = tmp_path / "proj" / "capgate.toml"
    text = config.read_text("utf-8")
    for old, new in (("case_claim_seconds = 0 ", "case_claim_seconds = 900 "),
                     ("claim_wait_seconds = 10 ", "claim_wait_seconds = 0 ")):
        assert old in text
        text = text.replace(old, new)
    config.write_text(text, "utf-8")
    return tmp_path / "proj"


def test_a_plans_claim_is_its_cases_and_can_be_released(proj: Path) -> None:
    run(proj, "plan", "policy.add_note", *NOTE, "--case", "C1")
    cases = {c["case"]: c for c in json.loads(run(proj, "cases", "--json").stdout)}
    assert cases["C1"]["state"] == "holding"
    assert [c["impact_key"] for c in cases["C1"]["claims"]] == [KEY]
    assert f"holds 1 claim(s): {KEY}" in run(proj, "cases").stdout
    timeline = json.loads(run(proj, "ledger", "show", "C1", "--json").stdout)["timeline"]
    assert [e["kind"] for e in timeline] == ["plan_recorded"]
    # another case meets the hold (coordination, as designed) ...
    refused = run(proj, "call", "policy.add_note", *NOTE, "--case", "C2", code=1)
    assert "CG330" in refused.stdout + refused.stderr
    # ... and the case that planned -- its requester -- gives it back
    released = json.loads(run(proj, "case", "release", "C1", "--json").stdout)
    assert released["released"] == [KEY]
    assert json.loads(run(proj, "call", "policy.add_note", *NOTE, "--case", "C2",
                          "--json").stdout)["status"] == "applied_verified"


def test_a_plans_claim_is_given_back_by_closing_its_case(proj: Path) -> None:
    run(proj, "plan", "policy.add_note", *NOTE, "--case", "C1")
    closed = json.loads(run(proj, "case", "close", "C1", "--json").stdout)
    assert closed["released"] == [KEY] and closed["closed"]
    cases = {c["case"]: c for c in json.loads(run(proj, "cases", "--json").stdout)}
    assert cases["C1"]["state"] == "closed" and cases["C1"]["claims"] == []


def test_a_refused_plan_keeps_no_claim_and_records_the_decision(proj: Path) -> None:
    run(proj, "call", "policy.add_note", *NOTE, "--case", "HOLDER")
    refused = run(proj, "plan", "policy.add_note", *NOTE, "--case", "ASKER", code=1)
    assert "CG330" in refused.stdout + refused.stderr
    asker = json.loads(run(proj, "ledger", "show", "ASKER", "--json").stdout)
    assert [e["kind"] for e in asker["timeline"]] == ["coordination_requested"]
    assert json.loads(run(proj, "approvals", "--json").stdout) == []


def test_claims_without_a_record_are_listed_and_a_person_releases_them(proj: Path) -> None:
    """Claims a case holds with no record of it (taken by an older capgate's plan):
    `cases` lists them, and a person signing with their key gives them back."""
    settings = load_settings(proj / "capgate.toml", {})
    with open_ledger(settings.ledger_url) as ledger:
        ClaimStore(ledger).acquire([KEY], case_id="GHOST", intent_id=None,
                                   operation_id="policy.add_note", ttl=900, case_mode=True)
    ghost = {c["case"]: c for c in json.loads(run(proj, "cases", "--json").stdout)}["GHOST"]
    assert ghost["state"] == "holding" and ghost["events"] == 0
    shown = json.loads(run(proj, "case", "show", "GHOST", "--json").stdout)
    assert [c["impact_key"] for c in shown["claims"]] == [KEY]
    unsigned = run(proj, "case", "release", "GHOST", "--as", "claims-agent", code=1)
    assert "CG338" in unsigned.stdout + unsigned.stderr
    done = json.loads(run(proj, "case", "release", "GHOST", "--as", "bob", "--key",
                          "keys/bob.key", "--json").stdout)
    assert done["released"] == [KEY]
    timeline = json.loads(run(proj, "ledger", "show", "GHOST", "--json").stdout)["timeline"]
    assert [e["kind"] for e in timeline] == ["claims_released"]
