"""``capabilities.lock``: published rows are immutable, versions only grow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from capgate.registry.canonical import canonical_hash
from capgate.registry.errors import LockFileInvalid, RegistryError, RetiredRow
from capgate.registry.loader import load_registry, update_lock, validate_paths, validate_texts
from capgate.registry.lock import LOCK_NAME, read_lock, row_hash

GOOD = Path(__file__).resolve().parent / "data" / "good"
GET_SQL = "SELECT id, holder, status FROM policy WHERE id = :policy_id"


@pytest.fixture
def caps(tmp_path: Path) -> Path:
    """A private copy of the good files, locked."""
    target = tmp_path / "caps"
    shutil.copytree(GOOD, target)
    update_lock([target])
    return target


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text("utf-8")
    assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times in {path.name}"
    path.write_text(text.replace(old, new), "utf-8")


def lock_doc(caps: Path) -> dict[str, object]:
    doc: dict[str, object] = json.loads((caps / LOCK_NAME).read_text("utf-8"))
    return doc


def line_of(path: Path, needle: str, after: str = "") -> int:
    lines = path.read_text("utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) if after else 0
    return next(i for i in range(start, len(lines)) if needle in lines[i]) + 1


def test_lock_pins_every_row_with_its_canonical_hash(caps: Path) -> None:
    doc = lock_doc(caps)
    assert doc["format"] == 1
    pins = doc["rows"]
    assert isinstance(pins, dict)
    assert list(pins) == sorted(pins)  # stable order, reviewable diffs
    rows = validate_paths([caps]).rows
    assert pins == {r.ref: r.row_hash for r in rows}
    assert len(pins) == 7
    for r in rows:
        assert r.row_hash.startswith("sha256:") and len(r.row_hash) == 7 + 64
        assert r.row_hash == canonical_hash({k: v for k, v in r.to_dict().items()
                                             if k != "retired"})


def test_locked_files_validate(caps: Path) -> None:
    result = validate_paths([caps])
    assert result.ok, [p.render() for p in result.problems]
    assert result.lock_path == caps / LOCK_NAME
    assert len(load_registry([caps])) == 7


def test_relocking_is_idempotent(caps: Path) -> None:
    before = (caps / LOCK_NAME).read_bytes()
    path, added, pins = update_lock([caps])
    assert path == caps / LOCK_NAME
    assert added == []
    assert len(pins) == 7
    assert (caps / LOCK_NAME).read_bytes() == before


def test_a_change_without_a_new_version_names_the_row_and_both_hashes(caps: Path) -> None:
    office = caps / "office.yaml"
    old_hash = lock_doc(caps)["rows"]["policy.get@1"]  # type: ignore[index]
    edit(office, GET_SQL, "SELECT id, holder FROM policy WHERE id = :policy_id")
    result = validate_paths([caps])
    (problem,) = result.problems
    new_hash = next(r.row_hash for r in result.rows if r.ref == "policy.get@1")
    assert new_hash != old_hash
    assert problem.code == "CG130"
    assert problem.path == str(office)
    assert problem.field == "version"
    assert problem.line == line_of(office, "version: 1", after="operation_id: policy.get")
    assert "policy.get@1" in problem.message
    assert old_hash in problem.message
    assert new_hash in problem.message
    assert "publish the change as version 2" in problem.message
    with pytest.raises(RegistryError) as info:
        load_registry([caps])
    assert [p.code for p in info.value.problems] == ["CG130"]


def test_lock_refuses_to_pin_a_changed_row(caps: Path) -> None:
    before = (caps / LOCK_NAME).read_bytes()
    edit(caps / "office.yaml", "environments: [dev, qa, staging, prod]\n    timeout: {seconds: 5",
         "environments: [dev]\n    timeout: {seconds: 5")
    with pytest.raises(RegistryError) as info:
        update_lock([caps])
    assert [p.code for p in info.value.problems] == ["CG130"]
    assert (caps / LOCK_NAME).read_bytes() == before


def test_any_field_change_changes_the_hash(caps: Path) -> None:
    base = {r.ref: r.row_hash for r in validate_paths([caps], check_lock=False).rows}
    edit(caps / "office.yaml", "description: Read one policy by id.",
         "description: Read one policy by its id.")
    edit(caps / "office.yaml", "    max_rows: 1\n    statements:",
         "    max_rows: 2\n    statements:")
    after = {r.ref: r.row_hash for r in validate_paths([caps], check_lock=False).rows}
    assert after["policy.get@1"] != base["policy.get@1"]
    assert {k for k in base if base[k] != after[k]} == {"policy.get@1"}


def test_retiring_is_one_step_and_unretiring_needs_a_reviewed_change(caps: Path) -> None:
    office = caps / "office.yaml"
    before = {r.ref: r.row_hash for r in validate_paths([caps]).rows}
    edit(office, "  - operation_id: policy.get\n    version: 1\n",
         "  - operation_id: policy.get\n    version: 1\n    retired: true\n")
    # one step: the row is retired at once, its hash unchanged, the lock still valid
    result = validate_paths([caps])
    assert result.ok, [p.render() for p in result.problems]
    assert {r.ref: r.row_hash for r in result.rows} == before
    with pytest.raises(RetiredRow):
        load_registry([caps]).resolve("policy.get")
    # `capgate lock` records the retirement (no pin is added: the hash did not change)
    assert update_lock([caps])[1] == []
    assert "policy.get@1" in lock_doc(caps)["retired"]  # type: ignore[operator]
    # deleting the line (or `retired: false`) would bring it back unreviewed: refused
    edit(office, "    retired: true\n", "    retired: false\n", count=2)
    problems = validate_paths([caps]).problems
    assert {p.code for p in problems} == {"CG137"}, [p.render() for p in problems]
    assert {p.path for p in problems} == {str(office)}
    assert any("policy.get@1" in p.message for p in problems)
    with pytest.raises(RegistryError, match="CG137"):
        load_registry([caps])
    with pytest.raises(RegistryError, match="CG137"):  # and `capgate lock` will not record it
        update_lock([caps])
    # the reviewed way back: a lock change that takes it off the `retired` list
    doc = lock_doc(caps)
    doc["retired"] = []
    (caps / LOCK_NAME).write_text(json.dumps(doc), "utf-8")
    assert validate_paths([caps]).ok


def test_a_lock_without_a_retired_list_reads_as_nothing_retired(caps: Path) -> None:
    """Locks written before the `retired` list existed stay valid."""
    doc = lock_doc(caps)
    doc.pop("retired", None)
    (caps / LOCK_NAME).write_text(json.dumps(doc), "utf-8")
    assert validate_paths([caps]).ok
    doc["retired"] = ["no.such@1"]
    (caps / LOCK_NAME).write_text(json.dumps(doc), "utf-8")
    with pytest.raises(LockFileInvalid, match="does not pin"):
        validate_paths([caps])


def test_layout_comments_and_key_order_do_not_change_the_hash() -> None:
    text = (GOOD / "office.yaml").read_text("utf-8")
    doc = yaml.safe_load(text)
    for row in doc["rows"]:
        row_items = list(row.items())
        row.clear()
        row.update(reversed(row_items))
    redone = "# reformatted\n" + yaml.safe_dump(doc, default_flow_style=True, width=60)
    a = validate_texts([("a.yaml", text)])
    b = validate_texts([("b.yaml", redone)])
    assert a.ok and b.ok
    assert [r.row_hash for r in a.rows] == [r.row_hash for r in b.rows]
    assert [r.row_hash for r in a.rows] == [row_hash(r) for r in doc["rows"]]


def test_a_new_version_must_be_greater_than_the_published_ones(caps: Path) -> None:
    stored = caps / "stored_code.yaml"
    text = stored.read_text("utf-8")
    block = text[text.index("  - operation_id: code.replace_premium_fn"):
                 text.index("  - operation_id: policy.delete_orphan")]
    stored.write_text(text + "\n" + block.replace("version: 3", "version: 2"), "utf-8")
    (problem,) = validate_paths([caps]).problems
    assert problem.code == "CG131"
    assert problem.field == "version"
    assert problem.line == line_of(stored, "version: 2")
    assert problem.message == ("new version 2 of code.replace_premium_fn is not greater than "
                               "the published version 3")


def test_a_bump_is_accepted_and_relocking_adds_only_the_new_row(caps: Path) -> None:
    office = caps / "office.yaml"
    text = office.read_text("utf-8")
    start = text.index("  - operation_id: policy.get")
    block = text[start:text.index("  - operation_id: policy.rename_holder")]
    bumped = block.replace("version: 1", "version: 2").replace(
        GET_SQL, "SELECT id, holder FROM policy WHERE id = :policy_id")
    office.write_text(text + "\n" + bumped.rstrip() + "\n", "utf-8")
    assert validate_paths([caps]).ok
    before = lock_doc(caps)["rows"]
    _, added, pins = update_lock([caps])
    assert [p.ref for p in added] == ["policy.get@2"]
    assert len(pins) == 8
    after = lock_doc(caps)["rows"]
    assert isinstance(after, dict) and isinstance(before, dict)
    assert {k: v for k, v in after.items() if k != "policy.get@2"} == before
    reg = load_registry([caps])
    assert reg.resolve("policy.get").version == 2
    assert reg.resolve("policy.get", 1).statements[0].sql == GET_SQL


def test_a_locked_row_must_not_disappear(caps: Path) -> None:
    office = caps / "office.yaml"
    text = office.read_text("utf-8")
    start = text.index("  - operation_id: document.number")
    office.write_text(text[:start], "utf-8")
    (problem,) = validate_paths([caps]).problems
    assert problem.code == "CG133"
    assert problem.path == str(caps / LOCK_NAME)
    assert (problem.line, problem.col) == (1, 1)
    assert problem.field == "document.number@1"
    assert "retired: true" in problem.message
    with pytest.raises(RegistryError):
        update_lock([caps])


def test_without_a_lock_file_nothing_is_pinned(tmp_path: Path) -> None:
    shutil.copytree(GOOD, tmp_path / "caps")
    result = validate_paths([tmp_path / "caps"])
    assert result.ok
    assert not (tmp_path / "caps" / LOCK_NAME).exists()
    assert read_lock(tmp_path / "caps" / LOCK_NAME) == {}


def test_check_lock_false_ignores_the_lock(caps: Path) -> None:
    edit(caps / "office.yaml", GET_SQL, "SELECT id FROM policy WHERE id = :policy_id")
    assert not validate_paths([caps]).ok
    assert validate_paths([caps], check_lock=False).ok
    assert len(load_registry([caps], check_lock=False)) == 7


def test_the_lock_is_found_beside_a_single_file(caps: Path) -> None:
    edit(caps / "office.yaml", GET_SQL, "SELECT id FROM policy WHERE id = :policy_id")
    result = validate_paths([caps / "office.yaml"])
    assert result.lock_path == caps / LOCK_NAME
    # stored_code.yaml was not given, so its pins are "missing" too: the lock covers the set
    assert sorted(p.code for p in result.problems) == ["CG130", "CG133", "CG133"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"format": 2, "rows": {}}',
        '{"format": 1}',
        '{"format": 1, "rows": ["policy.get@1"]}',
        '{"format": 1, "rows": {"policy.get": "sha256:00"}}',
        '{"format": 1, "rows": {"policy.get@one": "sha256:00"}}',
    ],
)
def test_an_unreadable_lock_is_refused(caps: Path, content: str) -> None:
    (caps / LOCK_NAME).write_text(content, "utf-8")
    with pytest.raises(LockFileInvalid) as info:
        validate_paths([caps])
    assert info.value.code == "CG132"
    assert info.value.details["path"] == str(caps / LOCK_NAME)
    assert str(caps / LOCK_NAME) in info.value.message
    # `capgate lock` does not overwrite what it cannot read: the pins would be lost
    with pytest.raises(LockFileInvalid):
        update_lock([caps])
    assert (caps / LOCK_NAME).read_text("utf-8") == content


def test_a_deleted_lock_is_regenerated(caps: Path) -> None:
    before = (caps / LOCK_NAME).read_bytes()
    (caps / LOCK_NAME).unlink()
    _, added, _ = update_lock([caps])
    assert len(added) == 7
    assert (caps / LOCK_NAME).read_bytes() == before
