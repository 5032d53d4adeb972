"""The walk-through of ``docs/simulation.md``, run through the real command line.

Two projects made by ``capgate init`` -- qa and prod, one configuration each,
one ledger -- and the commands of the page, each checked for its exit code
and its ``--json``; every ``capgate`` line of the page is accepted by the
parser (STYLE: test the docs).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from capgate.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
CLAIM = {"policy_id": 2, "claim_ref": "CLM-2024-041", "reported_on": "2024-08-20",
         "amount": 800}


def capgate(where: Path, *args: str) -> tuple[int, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env["CAPGATE_CACHE"] = "off"
    done = subprocess.run([sys.executable, "-m", "capgate", *args, "--json"], cwd=where,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    try:
        payload = json.loads(done.stdout) if done.stdout.strip() else None
    except json.JSONDecodeError:
        pytest.fail(f"capgate {' '.join(args)}: not JSON: {done.stdout}{done.stderr}")
    return done.returncode, payload


@pytest.fixture
def projects(tmp_path: Path) -> tuple[Path, Path]:
    for name in ("qa", "prod"):
        code, _ = capgate(tmp_path, "init", name, "--environment", "qa")
        assert code == 0
    prod = tmp_path / "prod"
    config = (prod / "capgate.toml").read_text("utf-8")
    config = config.replace('environment = "qa"', 'environment = "prod"')
    config = re.sub(r'^ledger = .*$', 'ledger = "sqlite:///../qa/.capgate/ledger.db"', config,
                    flags=re.M)
    config = config.replace("[connectors.insurance]\n", "[connectors.insurance]\n"
                            'production_simulation_approver_roles = ["dba", '
                            '"underwriting_lead"]\nbusiness_timezone = "Europe/Sofia"\n')
    (prod / "capgate.toml").write_text(config, "utf-8")
    grants = (prod / "grants.toml").read_text("utf-8").replace('["qa"]', '["prod"]')
    (prod / "grants.toml").write_text(grants, "utf-8")
    return tmp_path / "qa", prod


def test_the_walk_through_runs(projects: tuple[Path, Path]) -> None:
    qa, prod = projects
    claim = json.dumps(CLAIM)
    code, refused = capgate(prod, "call", "claim.open", "--case", "T-41", "--input", claim)
    assert code == 1 and refused["code"] == "CG601"
    code, dry = capgate(qa, "simulate", "claim.open", "--case", "T-41", "--input", claim,
                        "--dry-run")
    assert code == 0 and dry["status"] == "planned" and dry["simulation_id"] is None
    code, report = capgate(qa, "simulate", "claim.open", "--case", "T-41", "--input", claim)
    assert code == 0 and report["status"] == "restored"
    code, plan = capgate(prod, "plan", "claim.open", "--case", "T-41", "--input", claim)
    assert plan["promotion"]["evidence"]["simulation_id"] == report["simulation_id"]
    code, applied = capgate(prod, "call", "claim.open", "--case", "T-41", "--input", claim)
    assert code == 0 and applied["status"] == "applied_verified"
    (claim_id,) = applied["evidence"]["returned"]["claim_id"]
    code, _ = capgate(qa, "simulate", "claim.settle", "--case", "T-41", "--input",
                      '{"claim_id": 1}')
    assert code == 0
    code, settled = capgate(prod, "call", "claim.settle", "--case", "T-41", "--bind",
                            "claim_id=claim.open.claim_id")
    assert code == 0 and settled["status"] == "applied_verified"
    code, bad = capgate(prod, "call", "claim.settle", "--case", "T-41", "--bind", "claim_id")
    assert code == 1 and bad["code"] == "CG608"
    code, show = capgate(prod, "ledger", "show", "T-41")
    bound = [e for e in show["events"] if e["kind"] == "inputs_bound"]
    assert bound[0]["payload"]["bindings"][0]["value"] == claim_id
    code, exempt = capgate(prod, "call", "note.correct", "--case", "T-42", "--input", json.dumps(
        {"note_id": 2, "old_body": "Lapse letter sent.", "body": "Lapse letter sent by post."}))
    assert code == 0 and exempt["status"] == "applied_verified"

    trial = json.dumps({**CLAIM, "policy_id": 5, "claim_ref": "CLM-2024-043"})
    code, missing = capgate(prod, "simulate", "claim.open", "--case", "T-43", "--input", trial)
    assert code == 1 and missing["code"] == "CG606"
    why = "the fraud score exists only on production data"
    code, need = capgate(prod, "simulate", "claim.open", "--case", "T-43", "--input", trial,
                         "--data-dependency", why)
    assert code == 4 and need["code"] == "CG201"
    plan_hash = need["details"]["plan_hash"]
    code, _ = capgate(prod, "approve", plan_hash, "--by", "bob", "--role", "dba", "--key",
                      "keys/bob.key")
    assert code == 0
    code, ran = capgate(prod, "simulate", "claim.open", "--case", "T-43", "--input", trial,
                        "--data-dependency", why)
    assert code == 0 and ran["status"] == "restored"
    code, due = capgate(prod, "reconcile", "--due")
    assert code == 0 and [d["simulation_id"] for d in due] == [ran["simulation_id"]]
    code, record = capgate(prod, "reconcile", "T-43", ran["simulation_id"], "--as", "bob")
    assert code == 0 and record["ok"] and record["on_time"]
    code, due = capgate(prod, "reconcile", "--due")
    assert code == 0 and due == []
    code, verified = capgate(prod, "ledger", "verify")
    assert code == 0 and verified["ok"], verified


def test_every_command_line_of_the_page_parses() -> None:
    text = (ROOT / "docs" / "simulation.md").read_text("utf-8")
    lines = [m.group(1) for m in re.finditer(r"^(?:qa|prod)\$ capgate (.+)$", text, re.M)]
    assert len(lines) >= 12
    parser = build_parser()
    for line in lines:
        args = parser.parse_args(shlex.split(line))
        assert callable(args.handler), line
    readme = (ROOT / "README.md").read_text("utf-8")
    assert "](docs/simulation.md)" in readme  # the README links the page
