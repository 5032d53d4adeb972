"""The fixtures give each test an empty place of its own on a real server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from tests.fix_db import OWNER_LABEL, containers_mode, docker_available, image_for

ROOT = Path(__file__).resolve().parent.parent


def test_target_is_empty_and_writable(target_url: URL) -> None:
    eng = sa.create_engine(target_url)
    try:
        with eng.begin() as conn:
            assert sa.inspect(conn).get_table_names() == []
            conn.execute(sa.text("CREATE TABLE t (id INTEGER PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO t (id) VALUES (:id)"), {"id": 1})
        with eng.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 1
    finally:
        eng.dispose()


# --- CAPGATE_TEST_DB=containers: the suites' servers from testcontainers ------------

CHILD_TEST = '''
import sqlalchemy as sa

def test_servers_are_containers(pg_url, mariadb_url):
    for url, default_port in ((pg_url, 5432), (mariadb_url, 3306)):
        assert url.host == "127.0.0.1" and url.port not in (None, default_port), url
        eng = sa.create_engine(url)
        try:
            with eng.connect() as conn:
                assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
        finally:
            eng.dispose()
'''


def _run_child(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], int]:
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
         "-c", str(ROOT / "pyproject.toml"), str(tmp_path / "test_child.py")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None), proc.pid


def _owned_by(pid: int) -> list[str]:
    import docker

    client = docker.from_env()
    try:
        return [c.id for c in client.containers.list(all=True, filters={"label": OWNER_LABEL})
                if c.labels[OWNER_LABEL].startswith(f"{socket.gethostname()}:{pid}:")]
    finally:
        client.close()


@pytest.mark.postgresql
@pytest.mark.mariadb
def test_containers_mode_starts_containers_and_removes_them(tmp_path: Path) -> None:
    """Containers, whatever DSN is set; Ryuk off where it cannot be pulled; nothing left.

    The DSNs point nowhere: a run that used them would fail.  Ryuk's variable is unset:
    where its image cannot be pulled, testcontainers would fail every start without
    the fixtures' decision.  A container left by a dead session (its owner label names
    a process that no longer exists) is removed when the next session starts.
    """
    if not docker_available():
        if containers_mode():
            pytest.fail("CAPGATE_TEST_DB=containers and no Docker daemon answers")
        pytest.skip("no Docker daemon answers (scripts/start-docker starts one)")
    import docker

    client = docker.from_env()
    try:
        stale = client.containers.create(
            image_for("postgresql"), command=["sleep", "600"],
            labels={OWNER_LABEL: f"{socket.gethostname()}:{os.getpid()}:0"})
    finally:
        client.close()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CAPGATE_", "TESTCONTAINERS_"))}
    env.update(CAPGATE_TEST_DB="containers", CAPGATE_REQUIRE_DBS="postgresql,mariadb",
               CAPGATE_TEST_PG_DSN="postgresql://nobody@127.0.0.1:9/none",
               CAPGATE_TEST_MARIADB_DSN="mysql://nobody@127.0.0.1:9/none",
               CAPGATE_TEST_PG_IMAGE=image_for("postgresql"),
               CAPGATE_TEST_MARIADB_IMAGE=image_for("mariadb"))
    done, pid = _run_child(tmp_path, env)
    assert done.returncode == 0, done.stdout
    assert "1 passed" in done.stdout
    assert "container postgresql" in done.stdout and "container mariadb" in done.stdout
    assert _owned_by(pid) == [], "the session left its containers behind"
    client = docker.from_env()
    try:
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(stale.id)
    finally:
        client.close()


def test_containers_mode_without_docker_stops_the_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env.update(CAPGATE_TEST_DB="containers", DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock")
    done, _ = _run_child(tmp_path, env)
    assert done.returncode == 3, done.stdout
    assert "CAPGATE_TEST_DB=containers: no Docker daemon answers" in done.stdout


def test_a_misspelt_test_db_setting_stops_the_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env.update(CAPGATE_TEST_DB="container")
    done, _ = _run_child(tmp_path, env)
    assert done.returncode == 3, done.stdout
    assert "CAPGATE_TEST_DB='container'" in done.stdout
