"""What a DBA reads: the review card of a row, and the Markdown diff of two sets of rows."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from capgate.registry.errors import CapabilityPathError, RegistryError
from capgate.registry.loader import load_registry
from capgate.registry.model import Row
from capgate.registry.registry import Registry
from capgate.registry.review import card, diff, rows_from

GOOD = Path(__file__).resolve().parent / "data" / "good"
GET_SQL = "SELECT id, holder, status FROM policy WHERE id = :policy_id"
NEW_ROW = """
  - operation_id: premium.list
    version: 1
    connector: office
    description: List the premiums of a policy.
    input:
      type: object
      additionalProperties: false
      required: [policy_id]
      properties:
        policy_id: {type: integer}
    target: {system: office, object: premium}
    effect_class: read
    authorization: {kind: read_grant}
    environments: [dev, qa]
    timeout: {seconds: 1, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - sql: SELECT amount FROM premium WHERE policy_id = :policy_id
"""


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry([GOOD], check_lock=False)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text("utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), "utf-8")


def rows(path: Path) -> list[Row]:
    return rows_from(str(path))


# --- the review card -----------------------------------------------------------------------


def test_card_of_a_gated_compensable_row(registry: Registry) -> None:
    text = card(registry.resolve("cover.add"))
    lines = text.splitlines()
    assert lines[0] == "cover.add@1  [compensable/collapsed]"
    assert lines[1] == "  Add a cover to a policy; compensated by deleting it."
    for expected in [
        "  connector:     office",
        "  environments:  dev, prod",
        "  authorization: gate (approvers: underwriter, dba, four eyes)",
        "  target:        office.cover keys [policy_id, cover_code]",
        "  idempotency:   {case}:{policy_id}:{cover_code}",
        "  timeout:       10s, on timeout: unknown",
        "  recovery:      reconcile_first",
        "    policy_id: integer (required)",
        "    cover_code: string (required)",
        "  statements:",
        "    #1: INSERT INTO cover (policy_id, code) VALUES (:policy_id, :cover_code)",
        "        binds :cover_code, :policy_id; expect 1",
        "  compensation:",
        "    #1: DELETE FROM cover WHERE policy_id = :policy_id AND code = :cover_code",
        "        binds :cover_code, :policy_id; expect 0..1",
        "  post-commit checks:",
        '        binds :policy_id; expect {"rows": 1}',
        "  landed probe:",
        '        binds :cover_code, :policy_id; expect {"value": 1}',
    ]:
        assert expected in lines, f"{expected!r} not in card:\n{text}"
    assert re.search(r"^  source:        .*office\.yaml:\d+$", text, re.M)
    assert re.search(r"^  row hash:      sha256:[0-9a-f]{64}$", text, re.M)
    assert "RETIRED" not in text


def test_card_of_a_read_row_shows_its_row_cap_and_no_count(registry: Registry) -> None:
    text = card(registry.resolve("policy.get"))
    assert text.splitlines()[0] == "policy.get@1  [read]"
    assert "  row cap:       1" in text
    assert f"    fetch: {GET_SQL}\n        binds :policy_id\n" in text
    assert "None" not in text
    assert "idempotency" not in text
    assert "  examples: one" in text


def test_card_of_a_write_with_verify_and_replay(registry: Registry) -> None:
    text = card(registry.resolve("policy.rename_holder"))
    assert "  verify (same session, before commit):" in text
    assert ("    renamed: SELECT count(*) FROM policy WHERE id = :policy_id AND holder = :holder\n"
            '        binds :holder, :policy_id; expect {"value": 1}') in text
    assert "  replay:\n    replay: SELECT id, holder FROM policy WHERE id = :policy_id" in text


def test_card_of_a_leased_row_shows_every_step_and_branch(registry: Registry) -> None:
    text = card(registry.resolve("document.number"))
    assert text.splitlines()[0] == "document.number@1  [irreversible/leased]"
    assert '        binds :policy_id; expect {"value": 1}, otherwise abort: no such policy' in text
    assert '        binds :policy_id; expect {"value": 0}, otherwise skip to done' in text
    assert "    take: UPDATE counter SET next_no = next_no + 1 WHERE name = 'document'\n" \
           "        binds none; expect 1" in text
    assert "    done: function record_number" in text


def test_card_of_a_ddl_row_and_a_multi_statement_delete(registry: Registry) -> None:
    ddl = card(registry.resolve("code.replace_premium_fn"))
    assert ddl.splitlines()[0] == "code.replace_premium_fn@3  [ddl]"
    assert "  ddl objects: function premium_for" in ddl
    assert "  authorization: gate (approvers: dba)" in ddl
    orphan = card(registry.resolve("policy.delete_orphan"))
    names = re.findall(r"^    (\w+): DELETE", orphan, re.M)
    assert names == ["premiums", "covers", "documents", "notes", "policy"]
    assert orphan.count("expect >= 0") == 4
    # a folded description is shown on one line
    assert "  Delete a policy that has no holder, with everything that hangs off it, in one " \
           "transaction." in orphan


def test_card_of_a_retired_row(registry: Registry) -> None:
    (old,) = [r for r in registry.rows() if r.ref == "policy.rename_holder@1"]
    text = card(old)
    assert text.splitlines()[0] == "policy.rename_holder@1  [transactional/collapsed]  RETIRED"


# --- the diff ------------------------------------------------------------------------------


@pytest.fixture
def new(tmp_path: Path) -> Path:
    target = tmp_path / "new"
    shutil.copytree(GOOD, target)
    return target


def test_no_changes(new: Path) -> None:
    text = diff(rows(GOOD), rows(new))
    assert text == ("## Capability changes\n\n0 new version(s), 0 added, 0 changed, "
                    "0 retired, 0 removed\n")


def test_added_rows(new: Path) -> None:
    stored = new / "stored_code.yaml"
    stored.write_text(stored.read_text("utf-8") + NEW_ROW, "utf-8")
    text = diff(rows(GOOD), rows(new))
    assert "1 added, 0 changed, 0 retired, 0 removed" in text
    assert "### Added\n\n- **premium.list@1** (read, read_grant, dev, qa): " \
           "List the premiums of a policy.\n" in text
    assert "### Changed" not in text


def test_changed_rows_field_by_field(new: Path) -> None:
    office = new / "office.yaml"
    edit(office, GET_SQL, "SELECT id, holder FROM policy WHERE id = :policy_id")
    edit(office, "\n    max_rows: 1\n", "\n    max_rows: 5\n")
    edit(office, "        cover_code: {type: string, pattern: \"^[A-Z]{3}$\"}",
         "        cover_code: {type: string, pattern: \"^[A-Z]{4}$\"}")
    edit(new / "stored_code.yaml", "environments: [dev, staging]",
         "environments: [dev, staging, prod]")
    text = diff(rows(GOOD), rows(new))
    assert "0 added, 3 changed, 0 retired, 0 removed" in text
    assert "needs a new version" in text
    get = text[text.index("#### policy.get@1"):].rstrip("\n")
    get = get.split("\n#### ")[0]
    assert get.splitlines() == [
        "#### policy.get@1",
        "",
        "| field | before | after |",
        "|---|---|---|",
        "| `max_rows` | `1` | `5` |",
        "",
        "**`statements[0].sql`** changed:",
        "- removed `holder, status`",
        "- inserted `holder`",
        "",
        "```diff",
        "-SELECT id, holder, status FROM policy WHERE id = :policy_id",
        "+SELECT id, holder FROM policy WHERE id = :policy_id",
        "```",
    ]
    assert '| `input.properties.cover_code.pattern` | `^[A-Z]{3}$` | `^[A-Z]{4}$` |' in text
    assert '| `environments` | `["dev", "staging"]` | `["dev", "staging", "prod"]` |' in text
    # unchanged fields are not listed
    assert "`description`" not in text


def test_added_and_removed_fields_and_statements(new: Path) -> None:
    office = new / "office.yaml"
    edit(office, "      - name: fetch\n        sql: " + GET_SQL + "\n",
         "      - name: fetch\n        sql: " + GET_SQL + "\n"
         "      - name: covers\n        sql: SELECT code FROM cover WHERE policy_id = :policy_id\n")
    edit(office, "\n    max_rows: 1\n", "\n")
    text = diff(rows(GOOD), rows(new))
    assert "| `max_rows` | `1` | — |" in text
    assert "| `statements[1].name` | — | `covers` |" in text
    assert "**`statements[1].sql`** added:\n\n```diff\n" \
           "+SELECT code FROM cover WHERE policy_id = :policy_id\n```" in text


def test_a_pipe_in_a_value_does_not_break_the_table(new: Path) -> None:
    edit(new / "office.yaml", "        cover_code: {type: string, pattern: \"^[A-Z]{3}$\"}",
         "        cover_code: {type: string, pattern: \"^(ABC|DEF)$\"}")
    text = diff(rows(GOOD), rows(new))
    (line,) = [x for x in text.splitlines() if x.startswith("| `input.properties.cover_code")]
    # a Markdown table row: exactly four unescaped pipes
    assert len(re.findall(r"(?<!\\)\|", line)) == 4, line
    assert "^(ABC\\|DEF)$" in line


def test_sql_with_pipes_is_a_diff_block(new: Path) -> None:
    edit(new / "office.yaml", GET_SQL,
         "SELECT id, holder || ' ' || status FROM policy WHERE id = :policy_id")
    text = diff(rows(GOOD), rows(new))
    assert "+SELECT id, holder || ' ' || status\n+FROM policy\n+WHERE id = :policy_id" in text


def test_retired_rows_are_listed_and_not_changed(new: Path) -> None:
    edit(new / "stored_code.yaml", "  - operation_id: policy.delete_orphan\n    version: 1\n",
         "  - operation_id: policy.delete_orphan\n    version: 1\n    retired: true\n")
    text = diff(rows(GOOD), rows(new))
    assert "0 added, 0 changed, 1 retired, 0 removed" in text
    assert text.endswith(
        "### Retired\n\n- **policy.delete_orphan@1** is retired (kept, refused at call time)\n")
    # a row that was already retired is not reported again
    assert "policy.rename_holder@1" not in text


def test_removed_rows_are_flagged(new: Path) -> None:
    office = new / "office.yaml"
    text = office.read_text("utf-8")
    office.write_text(text[:text.index("  - operation_id: document.number")], "utf-8")
    out = diff(rows(GOOD), rows(new))
    assert "0 added, 0 changed, 0 retired, 1 removed" in out
    assert "### Removed" in out and "should be retired, not removed" in out
    assert "- **document.number@1**" in out


def test_diff_of_an_invalid_side_is_refused(new: Path) -> None:
    edit(new / "office.yaml", "recovery: never_retry", "recovery: sometimes")
    with pytest.raises(RegistryError) as info:
        rows(new)
    assert [p.code for p in info.value.problems] == ["CG104"]
    with pytest.raises(CapabilityPathError):
        rows_from(str(new / "missing"))


# --- git:REV -------------------------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo, capture_output=True, text=True, check=True,
    )
    return proc.stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    assert shutil.which("git"), "git is part of the development set-up (diff reads git:REV)"
    root = tmp_path / "repo"
    shutil.copytree(GOOD, root / "capabilities")
    shutil.copytree(GOOD, root / "other" / "caps")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_git_rev_reads_the_committed_files(repo: Path) -> None:
    committed = rows_from("git:HEAD", repo=repo)
    assert [r.ref for r in committed] == [r.ref for r in rows(GOOD)]
    assert committed[0].source_path.startswith("HEAD:capabilities/")
    assert [r.row_hash for r in committed] == [r.row_hash for r in rows(GOOD)]


def test_diff_of_the_working_tree_against_git(repo: Path) -> None:
    caps = repo / "capabilities"
    edit(caps / "office.yaml", GET_SQL, "SELECT id FROM policy WHERE id = :policy_id")
    (caps / "new.yaml").write_text("connectors:\n  office: {}\nrows:" + NEW_ROW, "utf-8")
    text = diff(rows_from("git:HEAD", repo=repo), rows(caps))
    assert "1 added, 1 changed, 0 retired, 0 removed" in text
    assert "- **premium.list@1**" in text
    assert "#### policy.get@1" in text
    # and between two revisions
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "second")
    assert diff(rows_from("git:HEAD~1", repo=repo), rows_from("git:HEAD", repo=repo)) == text
    assert "0 added" in diff(rows_from("git:HEAD", repo=repo), rows(caps))


def test_git_rev_with_a_path(repo: Path) -> None:
    other = rows_from("git:HEAD:other/caps", repo=repo)
    assert len(other) == 7
    assert all(r.source_path.startswith("HEAD:other/caps/") for r in other)
    # the path is relative to the working directory, like any path the user types
    assert len(rows_from("git:HEAD:caps", repo=repo / "other")) == 7


def test_git_errors_are_capgate_errors(repo: Path) -> None:
    with pytest.raises(CapabilityPathError) as info:
        rows_from("git:no-such-rev", repo=repo)
    assert "git ls-tree" in info.value.message
    with pytest.raises(CapabilityPathError, match="no capability files under nowhere"):
        rows_from("git:HEAD:nowhere", repo=repo)
