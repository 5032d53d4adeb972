"""The CI samples in ``docs/ci/`` run (STYLE: test the docs).

* ``test_capabilities.py`` -- the pytest example -- runs in a child pytest
  against a fresh PostgreSQL schema (``CAPGATE_CI_DATABASE_URL`` instead of a
  container) over a copy of ``capabilities/``.
* ``test_capabilities.py`` again, as a user's CI runs it: no database given, so it
  starts its own PostgreSQL through testcontainers, from ``CAPGATE_TEST_PG_IMAGE``
  (the locally built image where no registry answers), under the project's pytest
  settings (``filterwarnings = error``), and leaves no container behind.
* ``capgate-ci.yml`` -- the workflow -- parses, and every ``capgate`` command
  line in it is accepted by the real argument parser; its ``rehearse`` job runs:
  the service container as the workflow declares it (image, settings, health
  check), then each step's commands against it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import URL

from capgate.cli import build_parser
from tests.fix_db import (
    OWNER_LABEL,
    containers_mode,
    docker_available,
    ensure_docker_session,
    image_for,
    process_token,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _need_docker() -> None:
    """Skip without a Docker daemon -- unless the run asked for containers."""
    if docker_available():
        ensure_docker_session()  # Ryuk or not, decided and exported for the child
        return
    if containers_mode():
        pytest.fail("CAPGATE_TEST_DB=containers and no Docker daemon answers")
    pytest.skip("no Docker daemon answers (scripts/start-docker starts one)")


def _containers_of(image: str) -> set[str]:
    """Ids of the containers of ``image`` that these fixtures did not start."""
    import docker

    client = docker.from_env()
    try:
        return {c.id for c in client.containers.list(all=True, filters={"ancestor": image})
                if OWNER_LABEL not in c.labels}
    finally:
        client.close()


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


@pytest.mark.postgresql
def test_the_pytest_sample_starts_its_own_container(tmp_path: Path) -> None:
    """The path a user's CI copies: testcontainers, then ``capgate rehearse --junit``."""
    _need_docker()
    image = image_for("postgresql")
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "capabilities", repo / "capabilities")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env.update(CAPGATE_TEST_PG_IMAGE=image, CAPGATE_CI_REPO=str(repo))
    before = _containers_of(image)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-c", str(ROOT / "pyproject.toml"), str(DOCS / "ci" / "test_capabilities.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    report = ET.parse(repo / "reports" / "rehearse.xml").getroot()
    assert int(report.get("tests", "0")) > 20 and report.get("failures") == "0"
    assert report.get("errors") == "0"
    assert _containers_of(image) == before, "the sample left its container behind"


def _resolve(expression: str, variables: dict[str, str]) -> str:
    """``${{ vars.NAME || 'default' }}`` as GitHub Actions evaluates it (only that form)."""
    inner = expression.strip()
    if not (inner.startswith("${{") and inner.endswith("}}")):
        return inner
    name, _, default = inner[3:-2].partition("||")
    name = name.strip()
    assert name.startswith("vars."), f"unexpected expression {expression!r}"
    return variables.get(name[len("vars."):]) or default.strip().strip("'")


def _health_check(options: str) -> dict[str, Any]:
    """The service's ``--health-*`` options as Docker's API takes them."""
    argv = shlex.split(options)
    given = dict(zip(argv[::2], argv[1::2], strict=True))
    nanos = {"s": 1_000_000_000, "ms": 1_000_000}

    def duration(text: str) -> int:
        unit = "ms" if text.endswith("ms") else "s"
        return int(float(text[: -len(unit)]) * nanos[unit])

    return {"test": ["CMD-SHELL", given["--health-cmd"]],
            "interval": duration(given["--health-interval"]),
            "timeout": duration(given["--health-timeout"]),
            "retries": int(given["--health-retries"])}


@pytest.fixture
def workflow_service(tmp_path: Path) -> Iterator[tuple[dict[str, Any], int]]:
    """The ``rehearse`` job's PostgreSQL service, started as the workflow declares it.

    Its image is the workflow's expression with ``vars.CAPGATE_TEST_PG_IMAGE`` set to
    this run's image, as a runner that cannot pull would set it; the published port
    is Docker's choice.  Yields the job and the host port.
    """
    _need_docker()
    import docker

    job = yaml.safe_load((DOCS / "ci" / "capgate-ci.yml").read_text())["jobs"]["rehearse"]
    service = job["services"]["postgres"]
    image = _resolve(service["image"], {"CAPGATE_TEST_PG_IMAGE": image_for("postgresql")})
    assert _resolve(service["image"], {}) == "postgres:16"  # unchanged where images pull
    client = docker.from_env()
    container = client.containers.run(
        image, detach=True, environment=service["env"],
        ports={f"{service['ports'][0].split(':')[1]}/tcp": ("127.0.0.1", None)},
        healthcheck=_health_check(service["options"]),
        labels={OWNER_LABEL: process_token(os.getpid())})
    try:
        deadline = time.monotonic() + 120
        while True:
            container.reload()
            health = container.attrs["State"].get("Health", {}).get("Status")
            if health == "healthy":
                break
            assert container.status == "running", container.logs().decode()[-2000:]
            assert time.monotonic() < deadline, f"service still {health} after 120 s"
            time.sleep(0.5)
        port = int(container.ports["5432/tcp"][0]["HostPort"])
        yield job, port
    finally:
        container.remove(force=True)
        client.close()


@pytest.mark.postgresql
def test_the_workflow_rehearse_job_runs_on_its_service_image(
        workflow_service: tuple[dict[str, Any], int], tmp_path: Path) -> None:
    job, port = workflow_service
    if shutil.which("psql") is None:
        pytest.skip("the workflow's schema step needs psql (postgresql-client)")
    work = tmp_path / "checkout"
    shutil.copytree(ROOT / "capabilities", work / "capabilities")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env.update({k: str(v).replace("localhost:5432", f"127.0.0.1:{port}")
                for k, v in job["env"].items()})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    ran = []
    for step in job["steps"]:
        script = step.get("run")
        if script is None or script.strip() == "pip install capgate":
            continue  # actions (checkout, setup-python, upload) and the install: done here
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, f"{step.get('name', script)}: {done.stdout}{done.stderr}"
        ran.append(step.get("name", script))
    assert len(ran) == 4, ran  # schema, target install, grants, rehearse
    report = ET.parse(work / "reports" / "rehearse.xml").getroot()
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
