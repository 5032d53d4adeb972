"""``-m "not postgresql and not mariadb and not oracle"`` runs exactly what needs no server.

Server tests carry their engine's marker: an engine parameter is ``engine_param``
(``pytest.param`` with the marker), a test asking for ``pg_url`` and the other server
fixtures is marked at collection, and a whole-file server suite has ``pytestmark``.
A plain ``params=["postgresql", "mariadb"]`` gave no marker, and a run meant to be
offline still tried every server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.fix_db import ENGINES

ROOT = Path(__file__).resolve().parent.parent
NO_SERVER = "not postgresql and not mariadb and not oracle"

# files whose engine-parametrised fixtures put the engine into the test id: target_url
# and ledger_url (test_executor, test_fix_db), server_url, any_target (test_lease),
# parametrize("backend"/"engine") (test_ledger_v2, test_crash_matrix); test_budget asks
# for pg_url (unparametrised), test_ddl_postgresql is a pytestmark suite
FILES = ["tests/test_executor.py", "tests/test_fix_db.py", "tests/test_lease.py",
         "tests/test_ledger_v2.py", "tests/test_crash_matrix.py", "tests/test_budget.py",
         "tests/test_ddl_postgresql.py"]


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "CAPGATE_REQUIRE_DBS"}
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600)


def _collected(*args: str) -> list[str]:
    proc = _pytest("--collect-only", "-q", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def _engines(node_id: str) -> set[str]:
    """The server engines among the test id's parameters (``[sqlite-postgresql]``)."""
    _, _, params = node_id.partition("[")
    return {p for p in re.split(r"[-\]]", params) if p in ENGINES}


def test_the_no_server_expression_deselects_every_server_test() -> None:
    everything = _collected(*FILES)
    kept = _collected(*FILES, "-m", NO_SERVER)
    # the check can fail: without the expression, every engine is there
    assert {e for node in everything for e in _engines(node)} == set(ENGINES)
    assert any(n.startswith("tests/test_ddl_postgresql.py::") for n in everything)
    # these ask for pg_url, unparametrised: marked at collection
    by_fixture = {"tests/test_budget.py::test_a_killed_holders_slots_free_themselves",
                  "tests/test_budget.py::"
                  "test_the_seventh_session_of_a_six_session_user_is_refused_or_waits"}
    assert by_fixture <= set(everything)
    assert [n for n in kept if _engines(n)] == []
    assert [n for n in kept if n.startswith("tests/test_ddl_postgresql.py::")] == []
    assert not by_fixture & set(kept)
    # what needs no server stays
    assert "tests/test_fix_db.py::test_target_is_empty_and_writable[sqlite]" in kept
    assert any(n.startswith("tests/test_executor.py::") and n.endswith("[sqlite-sqlite]")
               for n in kept)
    assert "tests/test_executor.py::test_wrong_environment_is_refused" in kept


def test_each_engine_marker_selects_its_own_tests() -> None:
    for engine in ENGINES:
        selected = _collected("tests/test_executor.py", "-m", engine)
        assert selected, engine
        # an engine-parametrised test is selected only for its own engine's ids; one with no
        # engine parameter (asking for that engine's server fixture, marked at collection)
        # as it is
        assert [n for n in selected if _engines(n) and engine not in _engines(n)] == [], engine


def test_the_selected_tests_touch_no_server() -> None:
    """Run the offline selection with every server out of reach: nothing skips for it."""
    nowhere = {"CAPGATE_TEST_PG_DSN": "postgresql://nobody@127.0.0.1:9/none",
               "CAPGATE_TEST_MARIADB_DSN": "mysql://nobody@127.0.0.1:9/none",
               "CAPGATE_TEST_ORACLE_DSN": "oracle://nobody:x@127.0.0.1:9/?service_name=none"}
    proc = _pytest("-q", "-rs", "-m", NO_SERVER, "tests/test_fix_db.py", "tests/test_budget.py",
                   "tests/test_lease.py", **nowhere)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "passed" in out
    assert "unreachable" not in out and "127.0.0.1:9" not in out, out[-3000:]
