"""Reviewing a version bump: ``capgate bump`` writes it, ``capgate diff`` shows what changed.

A new version used to appear in the diff as "Added @2 / Retired @1", which
hid a change to a verify check (then a ``pg_sleep(2)``, which validation now
refuses outright: CG139).  A new version is now compared field by field with
the version before it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from capgate.registry.errors import RegistryError, UnknownOperation
from capgate.registry.loader import validate_paths
from capgate.registry.review import bump, diff, rows_from
from tests.test_init import ROOT, capgate, clean_env

VERIFY = "sql: \"SELECT count(*) FROM policy WHERE policy_id = :policy_id AND status <> 'void'\""
SLOW = ("sql: \"SELECT count(*) FROM policy WHERE policy_id = :policy_id AND status <> 'void' "
        "AND holder NOT LIKE 'A%'\"")


@pytest.fixture
def caps(tmp_path: Path) -> Path:
    folder = tmp_path / "capabilities"
    shutil.copytree(ROOT / "capabilities", folder, ignore=shutil.ignore_patterns("schema"))
    return folder


def _edit_new_version(path: Path) -> None:
    text = path.read_text("utf-8")
    at = text.index("    version: 2")
    assert VERIFY in text[at:]
    path.write_text(text[:at] + text[at:].replace(VERIFY, SLOW, 1), "utf-8")


def test_bump_writes_the_next_version_after_the_current_one(caps: Path) -> None:
    policies = caps / "policies.yaml"
    before = policies.read_text("utf-8")
    done = bump([caps], "policy.add_note", retire=True)
    assert (done["from"], done["version"]) == (1, 2)
    rows = {r.key: r for r in validate_paths([caps], check_lock=False).rows}
    assert rows[("policy.add_note", 1)].retired and not rows[("policy.add_note", 2)].retired
    assert rows[("policy.add_note", 2)].source_line == done["line"]
    # a copy: the same content but its version, and every comment of the file kept
    def content(version: int) -> dict[str, object]:
        body = rows[("policy.add_note", version)].to_dict()
        return {k: v for k, v in body.items() if k not in ("version", "retired")}

    assert content(1) == content(2)
    after = policies.read_text("utf-8")
    comments = [line for line in before.splitlines() if line.lstrip().startswith("#")]
    assert all(c in after for c in comments)
    with pytest.raises(UnknownOperation) as caught:
        bump([caps], "policy.add_nte")
    assert "did you mean `policy.add_note`?" in caught.value.message


def test_diff_shows_what_a_new_version_changed(caps: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(caps, old)
    bump([caps], "policy.add_note", retire=True)
    _edit_new_version(caps / "policies.yaml")
    text = diff(rows_from(str(old)), rows_from(str(caps)))
    assert "1 new version(s), 0 added, 0 changed, 1 retired, 0 removed" in text
    assert "#### policy.add_note@1 → policy.add_note@2" in text
    assert "- inserted `AND holder NOT LIKE 'A%'`" in text
    assert "+AND holder NOT LIKE 'A%'" in text
    assert "**`verify[0].sql`** changed:" in text


def test_diff_across_git_revisions_and_between_two_versions(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    capgate(["init", "proj"], tmp_path, env)
    proj = tmp_path / "proj"
    git = ["git", "-c", "user.email=t@example.org", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=proj, check=True)
    subprocess.run([*git, "add", "-A"], cwd=proj, check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], cwd=proj, check=True)
    capgate(["bump", "policy.add_note", "--retire"], proj, env)
    _edit_new_version(proj / "capabilities" / "policies.yaml")
    capgate(["validate"], proj, env)
    against_git = capgate(["diff", "git:HEAD", "capabilities"], proj, env).stdout
    assert "+AND holder NOT LIKE 'A%'" in against_git
    versions = json.loads(capgate(["diff", "policy.add_note@1", "policy.add_note@2", "--json"],
                                  proj, env).stdout)["markdown"]
    assert versions.startswith("## policy.add_note@1 → policy.add_note@2")
    assert "- inserted `AND holder NOT LIKE 'A%'`" in versions


def test_a_bump_among_invalid_files_writes_nothing(caps: Path) -> None:
    policies = caps / "policies.yaml"
    before = policies.read_text("utf-8")
    (caps / "extra.yaml").write_text("format: 1\nconnectors: {}\nrows: [oops\n", "utf-8")
    with pytest.raises(RegistryError) as caught:
        bump([caps], "policy.add_note")
    assert caught.value.problems[0].path.endswith("extra.yaml")
    assert policies.read_text("utf-8") == before
