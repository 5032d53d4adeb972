"""The CI samples in ``docs/ci/`` run (STYLE: test the docs).

* ``test_capabilities.py`` -- the pytest example -- runs in a child pytest
  against a fresh PostgreSQL schema (``CAPGATE_CI_DATABASE_URL`` instead of a
  container) over a copy of ``capabilities/``.
* ``capgate-ci.yml`` -- the workflow -- parses, and every ``capgate`` command
  line in it is accepted by the real argument parser.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.engine import URL

from capgate.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_pytest_sample_rehearses_against_a_database(pg_url: URL, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "capabilities", repo / "capabilities")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env.update(CAPGATE_CI_DATABASE_URL=pg_url.render_as_string(hide_password=False),
               CAPGATE_CI_REPO=str(repo))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         str(DOCS / "ci" / "test_capabilities.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    report = ET.parse(repo / "reports" / "rehearse.xml").getroot()
    assert int(report.get("tests", "0")) > 20 and report.get("failures") == "0"


def test_the_workflow_sample_uses_real_commands() -> None:
    workflow = yaml.safe_load((DOCS / "ci" / "capgate-ci.yml").read_text())
    assert set(workflow["jobs"]) == {"review", "rehearse"}
    env = workflow["jobs"]["rehearse"]["env"]
    assert {"CAPGATE_CONNECTOR_INSURANCE_URL", "CAPGATE_GRANTS", "CAPGATE_AGENT"} <= set(env)
    parser = build_parser()
    seen: list[str] = []
    for job in workflow["jobs"].values():
        for step in job["steps"]:
            for line in _commands(step):
                argv = shlex.split(line.replace('"git:${{ github.event.pull_request.base.sha }}:'
                                                'capabilities"', "git:HEAD:capabilities"))
                args = parser.parse_args(argv[1:])
                seen.append(args.command)
    assert seen == ["validate", "diff", "target", "rehearse"]


def _commands(step: dict[str, Any]) -> list[str]:
    run = step.get("run", "")
    joined = run.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.strip().split("|")[0].strip()
        if line.startswith("capgate "):
            out.append(line)
    return out
