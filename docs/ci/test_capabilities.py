"""Prove the capability files against a containerised copy of the schema.

Copy this file into your repository's tests.  It starts PostgreSQL with
testcontainers (``pip install capgate "testcontainers[postgres]" pytest``),
creates the schema, installs capgate's own two tables
(``capgate target install``) and runs ``capgate rehearse``: every example of every row
runs in write-and-rollback with its expected counts, verify and replay
checks.  The JUnit report lands in ``reports/rehearse.xml`` for the CI to
publish.

Set ``CAPGATE_CI_DATABASE_URL`` to use a database you already have instead of
a container (an empty one: the schema is created in it).

The container's image is ``CAPGATE_TEST_PG_IMAGE``, by default the official
``postgres:16``: where no registry can be reached, name an image built locally
(capgate's own CI builds one from Debian's packages, ``scripts/build-test-images``).
Where testcontainers' reaper image (Ryuk) cannot be pulled either, set
``TESTCONTAINERS_RYUK_DISABLED=true``: the ``with`` block below removes the
container all the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from capgate.sqlfiles import apply_schema

REPO = Path(os.environ.get("CAPGATE_CI_REPO", Path.cwd()))
CAPABILITIES = REPO / "capabilities"
SCHEMA = CAPABILITIES / "schema" / "postgresql.sql"  # or run your migrations instead
REPORTS = REPO / "reports"
IMAGE = os.environ.get("CAPGATE_TEST_PG_IMAGE") or "postgres:16"


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    given = os.environ.get("CAPGATE_CI_DATABASE_URL")
    if given:
        yield given
        return
    try:  # testcontainers 4.15 and later
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:  # earlier 4.x: the old path (it warns on import in 4.15)
        from testcontainers.postgres import PostgresContainer

    with PostgresContainer(IMAGE, driver="psycopg") as pg:
        yield pg.get_connection_url()


@pytest.fixture(scope="session")
def schema(database_url: str) -> str:
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        apply_schema(engine, SCHEMA)
    finally:
        engine.dispose()
    return database_url


def test_every_capability_example_rehearses(schema: str, tmp_path: Path) -> None:
    grants = tmp_path / "grants.toml"
    grants.write_text('[principals.ci]\n'
                      'grants = [{ connector = "insurance", environments = ["dev"], '
                      'access = "write" }]\n')
    REPORTS.mkdir(exist_ok=True)
    junit = REPORTS / "rehearse.xml"
    env = {**os.environ,
           "CAPGATE_CONNECTOR_INSURANCE_URL": schema,
           "CAPGATE_CONNECTOR_INSURANCE_ENVIRONMENT": "dev",
           "CAPGATE_GRANTS": str(grants),
           "CAPGATE_AGENT": "ci"}
    installed = subprocess.run([sys.executable, "-m", "capgate", "target", "install",
                                "insurance"], env=env, capture_output=True, text=True,
                               check=False)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    done = subprocess.run(
        [sys.executable, "-m", "capgate", "rehearse", str(CAPABILITIES),
         "--connector", "insurance", "--junit", str(junit)],
        env=env, capture_output=True, text=True, check=False)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
