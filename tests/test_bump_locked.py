"""``capgate bump`` after a published row was edited in place: the edit becomes the new
version and the published row reads again as it was locked -- or nothing is written and
the message says what to run.

Before, ``bump`` copied the *edited* row into the new version and left the published one
edited, so ``validate`` kept refusing (CG130) whatever the user bumped: a loop.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from capgate.commands.project import init_project
from capgate.registry.errors import LockedRowEdited
from capgate.registry.loader import update_lock, validate_paths
from capgate.registry.lock import read_lock
from capgate.registry.review import bump
from tests.test_init import ROOT, capgate, clean_env

TTL, EDITED_TTL = "approval_ttl_seconds: 1800", "approval_ttl_seconds: 900"


def edit_in_place(policies: Path, version: int = 2) -> None:
    """Shorten policy.purge_orphan@VERSION's approval lifetime, in place."""
    text = policies.read_text("utf-8")
    at = text.index(f"operation_id: policy.purge_orphan\n    version: {version}")
    cut = text.index(TTL, at)
    policies.write_text(text[:cut] + EDITED_TTL + text[cut + len(TTL):], "utf-8")


def purge(caps: Path) -> dict[int, int]:
    rows = validate_paths([caps], check_lock=False).rows
    return {r.version: r.authorization.approval_ttl_seconds for r in rows
            if r.operation_id == "policy.purge_orphan"}


def test_bump_puts_an_init_projects_edited_row_back_and_moves_the_edit(
        tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    init_project(tmp_path / "proj")
    proj = tmp_path / "proj"
    caps = proj / "capabilities"
    edit_in_place(caps / "policies.yaml")
    refused = capgate(["validate", "--json"], proj, env, code=1)
    assert [p["code"] for p in json.loads(refused.stdout)["problems"]] == ["CG130"]
    said = capgate(["bump", "policy.purge_orphan"], proj, env).stdout
    assert "@2 had been edited in place: the edit is @3 now" in said
    capgate(["validate"], proj, env)  # the loop is broken: @2 is as locked
    assert purge(caps) == {1: 1800, 2: 1800, 3: 900}
    locked = read_lock(caps / "capabilities.lock")
    rows = {r.key: r for r in validate_paths([caps], check_lock=False).rows}
    assert rows[("policy.purge_orphan", 2)].row_hash == locked[("policy.purge_orphan", 2)].hash


def test_bump_finds_the_locked_text_in_git_history(tmp_path: Path) -> None:
    caps = tmp_path / "repo" / "capabilities"
    shutil.copytree(ROOT / "capabilities", caps,
                    ignore=shutil.ignore_patterns("schema", "capabilities.lock"))
    policies = caps / "policies.yaml"
    # a team's own wording (and its own lock): the packaged examples do not hold this text
    policies.write_text(policies.read_text("utf-8").replace(
        "Delete one orphaned", "Remove one orphaned"), "utf-8")
    update_lock([caps])
    git = ["git", "-C", str(tmp_path / "repo")]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm",
                    "rows"], check=True)
    edit_in_place(policies)
    done = bump([caps], "policy.purge_orphan")
    assert done["restored_previous"] and done["version"] == 3
    assert purge(caps) == {1: 1800, 2: 1800, 3: 900}
    assert "Remove one orphaned" in policies.read_text("utf-8")
    assert validate_paths([caps]).ok


def test_without_the_locked_text_bump_writes_nothing_and_says_what_to_run(
        tmp_path: Path) -> None:
    caps = tmp_path / "capabilities"
    shutil.copytree(ROOT / "capabilities", caps,
                    ignore=shutil.ignore_patterns("schema", "capabilities.lock"))
    policies = caps / "policies.yaml"
    policies.write_text(policies.read_text("utf-8").replace(
        "Delete one orphaned", "Remove one orphaned"), "utf-8")
    update_lock([caps])
    edit_in_place(policies)
    before = policies.read_text("utf-8")
    with pytest.raises(LockedRowEdited) as refused:
        bump([caps], "policy.purge_orphan")
    assert refused.value.code == "CG152"
    message = refused.value.message
    assert "policy.purge_orphan@2" in message and "Undo your edit" in message
    assert "`capgate bump policy.purge_orphan`" in message and "policy.purge_orphan@3" in message
    assert policies.read_text("utf-8") == before


def test_an_older_version_edited_in_place_is_named_not_copied(tmp_path: Path) -> None:
    init_project(tmp_path / "proj")
    caps = tmp_path / "proj" / "capabilities"
    edit_in_place(caps / "policies.yaml", version=1)
    before = (caps / "policies.yaml").read_text("utf-8")
    with pytest.raises(LockedRowEdited) as refused:
        bump([caps], "policy.purge_orphan")
    assert "policy.purge_orphan@1" in refused.value.message
    assert (caps / "policies.yaml").read_text("utf-8") == before
