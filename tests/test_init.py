"""``capgate init`` and ``capgate demo``: from nothing to a gated write, with no edits.

Every command runs as a new ``python -m capgate`` process in the project
folder, outside the checkout, with no ``CAPGATE_*`` variable set -- as a user
who follows the README would run it.  The MCP server is listed through the
SDK's real stdio client.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa
from mcp import ClientSession, StdioServerParameters, stdio_client
from sqlalchemy.engine import URL

from capgate.commands.project import init_project
from capgate.registry.errors import ConnectorUnavailable, ProjectExists

ROOT = Path(__file__).resolve().parent.parent


def clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env["CAPGATE_CACHE_DIR"] = str(tmp / "cache")
    env["PYTHONPATH"] = str(ROOT)
    return env


def capgate(args: list[str], cwd: Path, env: dict[str, str], code: int = 0
            ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "capgate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == code, (args, proc.stdout, proc.stderr)
    return proc


def mcp_tools(proj: Path, env: dict[str, str], errlog: Path,
              args: tuple[str, ...] = ()) -> list[str]:
    names: list[str] = []

    async def main() -> None:
        params = StdioServerParameters(command=sys.executable,
                                       args=["-m", "capgate", "mcp", *args], cwd=str(proj),
                                       env=env)
        with errlog.open("w") as err:
            async with stdio_client(params, errlog=err) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                names.extend(t.name for t in (await session.list_tools()).tools)

    anyio.run(main)
    return names


def test_init_then_a_gated_write_and_mcp_work_with_no_edits(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    made = capgate(["init", "proj"], tmp_path, env)
    proj = tmp_path / "proj"
    assert "next:" in made.stdout and '"mcpServers"' in made.stdout
    capgate(["validate"], proj, env)
    read = capgate(["call", "policy.get", "--input", '{"policy_id": 1}', "--case", "T-1",
                    "--json"], proj, env)
    assert json.loads(read.stdout)["status"] == "ok"
    gated = capgate(["call", "policy.purge_orphan", "--input", '{"policy_id": 9}', "--case",
                     "T-2", "--json"], proj, env, code=4)
    plan_hash = json.loads(gated.stdout)["details"]["plan_hash"]
    signed = ["--role", "dba", "--key", "keys/bob.key"]
    capgate(["approve", plan_hash, "--by", "claims-agent", *signed], proj, env, code=1)
    capgate(["approve", plan_hash, "--by", "bob", *signed], proj, env)
    done = capgate(["call", "policy.purge_orphan", "--input", '{"policy_id": 9}', "--case",
                    "T-2", "--json"], proj, env)
    assert json.loads(done.stdout)["status"] == "applied_verified"

    errlog = tmp_path / "mcp.err"
    tools = mcp_tools(proj, env, errlog)
    assert {"policy.get", "policy.add_note", "policy.purge_orphan"} <= set(tools)
    said = errlog.read_text()
    assert f"{len(tools)} tool(s) for 'claims-agent'" in said


def test_init_refuses_an_existing_project_and_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "capgate.toml").write_text("# mine\n", "utf-8")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ProjectExists) as refused:
        init_project(tmp_path)
    assert refused.value.code == "CG904" and "capgate.toml" in refused.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "capgate.toml").read_text("utf-8") == "# mine\n"


def test_init_empty_is_an_annotated_template_that_works(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    capgate(["init", "proj", "--empty"], tmp_path, env)
    proj = tmp_path / "proj"
    template = (proj / "capabilities" / "app.yaml").read_text("utf-8")
    assert "# A write, to copy and adapt" in template
    ping = capgate(["call", "app.ping", "--case", "FIRST-1", "--as", "agent", "--json"], proj,
                   env)
    assert json.loads(ping.stdout)["status"] == "ok"


def test_init_on_an_unreachable_target_writes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "proj"
    with pytest.raises(ConnectorUnavailable):
        init_project(target, target="postgresql://nobody@127.0.0.1:9/none")
    assert not target.exists() or not any(target.iterdir())


@pytest.mark.postgresql
def test_init_on_your_own_postgresql(tmp_path: Path, pg_url: URL) -> None:
    env = clean_env(tmp_path)
    url = pg_url.render_as_string(hide_password=False)
    capgate(["init", "proj", "--target", url, "--example-schema"], tmp_path, env)
    proj = tmp_path / "proj"
    got = capgate(["call", "policy.add_note", "--input",
                   '{"policy_id": 1, "author": "me", "body": "First note."}', "--case", "T-1",
                   "--json"], proj, env)
    assert json.loads(got.stdout)["status"] == "applied_verified"
    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM capgate_landed")).scalar() == 1
    engine.dispose()


@pytest.mark.mariadb
def test_init_on_your_own_mariadb(tmp_path: Path, mariadb_url: URL) -> None:
    env = clean_env(tmp_path)
    url = mariadb_url.render_as_string(hide_password=False)
    capgate(["init", "proj", "--target", url, "--example-schema"], tmp_path, env)
    got = capgate(["call", "policy.get", "--input", '{"policy_id": 1}', "--case", "T-1",
                   "--json"], tmp_path / "proj", env)
    assert json.loads(got.stdout)["status"] == "ok"


def test_demo_runs_from_any_folder_and_keeps_its_sandbox(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ran = capgate(["demo"], elsewhere, env)
    assert "demo finished" in ran.stdout
    assert list(elsewhere.iterdir()) == []
    kept = tmp_path / "kept"
    capgate(["demo", "--keep", str(kept)], elsewhere, env)
    for name in ("capgate.toml", "grants.toml", "insurance.db", ".capgate/ledger.db"):
        assert (kept / name).exists(), name
    shown = capgate(["cases", "--json"], kept, env)
    assert {c["case"] for c in json.loads(shown.stdout)} >= {"TICKET-4711"}
    capgate(["demo", "--keep", str(kept)], elsewhere, env, code=2)  # not empty: refused


def _doc_block(page: str, heading: str, lang: str) -> list[str]:
    text = (ROOT / page).read_text("utf-8")
    section = text[text.index(heading):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def test_the_readme_configuration_gives_the_agent_tools(tmp_path: Path) -> None:
    """The documented capgate.toml and grants.toml (docs/configuration.md), copied as they
    are, serve tools."""
    from capgate.executor.connectors import Connectors
    from capgate.executor.grants import Grants
    from capgate.exposure import exposure
    from capgate.registry.loader import load_registry

    config, grants = _doc_block("docs/configuration.md", "# Configuration", "toml")[:2]
    # the approvers' keys are placeholders there ("ed25519:…"); approving is not tested here
    grants = re.sub(r"^approval_key = .*\n", "", grants, flags=re.M)
    (tmp_path / "capgate.toml").write_text(config, "utf-8")
    (tmp_path / "grants.toml").write_text(grants, "utf-8")
    from capgate.config import load_settings

    settings = load_settings(tmp_path / "capgate.toml", {})
    registry = load_registry([ROOT / "capabilities"], check_lock=False)
    seen = exposure(registry, Connectors(dict(settings.connectors)),
                    Grants.load(tmp_path / "grants.toml"), str(settings.agent))
    assert seen.usable, seen.line()
    assert not [h for h in seen.hidden if h.reason == "environment mismatch"], seen.line()


def _ungate_purge_orphan(policies: Path) -> None:
    """Edit policy.purge_orphan@2 in place: its approval gate becomes a plain write grant."""
    text = policies.read_text("utf-8")
    at = text.index("operation_id: policy.purge_orphan\n    version: 2")
    gate = ("    authorization:\n      kind: gate\n      approver_roles: [dba, underwriting_lead]\n"
            "      four_eyes: true\n      approval_ttl_seconds: 1800\n")
    cut = text.index(gate, at)
    policies.write_text(text[:cut] + "    authorization: {kind: write_grant}\n"
                        + text[cut + len(gate):], "utf-8")


def test_init_pins_its_rows_so_a_row_edited_in_place_is_refused(tmp_path: Path) -> None:
    """A published row is immutable from the first minute of a project.

    ``init`` used to write no ``capabilities.lock``: nothing was pinned, and the
    gated row edited in place (its gate turned into a write grant) ran at once,
    unapproved and unreviewed.  Now the edit is CG130 and the write stays gated.
    """
    env = clean_env(tmp_path)
    made = json.loads(capgate(["init", "proj", "--json"], tmp_path, env).stdout)
    proj = tmp_path / "proj"
    lock = json.loads((proj / "capabilities" / "capabilities.lock").read_text("utf-8"))
    assert made["pinned"] == made["rows"] == len(lock["rows"]) > 0
    assert "capabilities/capabilities.lock" in made["files"]
    assert "policy.purge_orphan@2" in lock["rows"]

    _ungate_purge_orphan(proj / "capabilities" / "policies.yaml")
    refused = capgate(["validate", "--json"], proj, env, code=1)
    assert [p["code"] for p in json.loads(refused.stdout)["problems"]] == ["CG130"]
    call = ["call", "policy.purge_orphan", "--input", '{"policy_id": 9}', "--case", "T-9",
            "--json"]
    said = capgate(call, proj, env, code=1)
    assert "CG130" in said.stdout + said.stderr
    with sa.create_engine(f"sqlite:///{proj / 'insurance.db'}").connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM policy WHERE policy_id = 9")
                            ).scalar_one() == 1, "the edited row ran"


def test_init_empty_pins_its_template_row(tmp_path: Path) -> None:
    made = init_project(tmp_path / "proj", empty=True)
    lock = json.loads((tmp_path / "proj" / "capabilities" / "capabilities.lock")
                      .read_text("utf-8"))
    assert made.pinned == made.rows == len(lock["rows"]) and "app.ping@1" in lock["rows"]
