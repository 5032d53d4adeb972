"""The registry commands through a real process: ``python -m capgate ...``.

Exit codes: 0 ok, 1 refused or invalid, 2 usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from capgate.cli import build_parser
from capgate.registry import errors

ROOT = Path(__file__).resolve().parent.parent
GOOD = ROOT / "tests" / "data" / "good"
BAD = ROOT / "tests" / "data" / "bad"
GET_SQL = "SELECT id, holder, status FROM policy WHERE id = :policy_id"


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> object:
        return json.loads(self.out)


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "capgate", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> Run:
    out, err = proc.communicate(timeout=120)
    return Run(proc.returncode, out, err)


def capgate(*args: str | Path, cwd: Path = ROOT) -> Run:
    return _finish(_start([str(a) for a in args], cwd))


def capgate_many(argvs: list[list[str]], cwd: Path = ROOT) -> list[Run]:
    """Independent commands, run side by side."""
    procs = [_start(a, cwd) for a in argvs]
    return [_finish(p) for p in procs]


# Commands that need no private files, started together once (each is its own process).
BATCH: dict[str, list[str]] = {
    "validate": ["validate", str(GOOD)],
    "validate-json": ["validate", "--json", str(GOOD)],
    "invalid": ["validate", "tests/data/bad/several_errors.yaml"],
    "invalid-json": ["validate", "tests/data/bad/several_errors.yaml", "--json"],
    "list": ["list", "--capabilities", str(GOOD)],
    "list-all": ["list", "--capabilities", str(GOOD), "--all"],
    "list-json": ["list", "--capabilities", str(GOOD), "--all", "--json"],
    "show": ["show", "policy.rename_holder", "--capabilities", str(GOOD)],
    "show-retired": ["show", "policy.rename_holder@1", "--capabilities", str(GOOD)],
    "show-json": ["show", "cover.add@1", "--capabilities", str(GOOD), "--json"],
    "show-unknown": ["show", "policy.drop_everything", "--capabilities", str(GOOD)],
    "show-version": ["show", "policy.get@7", "--capabilities", str(GOOD)],
    "show-bad-version": ["show", "policy.get@latest", "--capabilities", str(GOOD)],
    "explain": ["explain", "CG110"],
    "explain-all": ["explain", "--all"],
    "explain-json": ["explain", "--json", "cg143"],
    "explain-unknown": ["explain", "CG998"],
    "usage-none": [],
    "usage-command": ["no-such-command"],
    "usage-flag": ["validate", "--no-such-flag"],
    "usage-missing": ["show"],
    "usage-diff": ["diff", "only-one"],
    "help": ["--help"],
}


@pytest.fixture(scope="module")
def batch() -> dict[str, Run]:
    return dict(zip(BATCH, capgate_many(list(BATCH.values())), strict=True))


@pytest.fixture
def caps(tmp_path: Path) -> Path:
    target = tmp_path / "caps"
    shutil.copytree(GOOD, target)
    return target


# --- validate --------------------------------------------------------------------------------


def test_validate_ok_and_its_json(batch: dict[str, Run]) -> None:
    text, js = batch["validate"], batch["validate-json"]
    assert (text.code, text.err) == (0, "")
    assert text.out == "ok: 7 rows in 2 file(s)\n"
    assert js.code == 0
    assert js.json() == {
        "ok": True,
        "files": [str(GOOD / "office.yaml"), str(GOOD / "stored_code.yaml")],
        "rows": 7,
        "problems": [],
        "warnings": [],
    }


def test_validate_invalid_and_its_json(batch: dict[str, Run]) -> None:
    path = "tests/data/bad/several_errors.yaml"
    text, js = batch["invalid"], batch["invalid-json"]
    assert text.code == 1
    lines = text.out.splitlines()
    assert lines[-1] == "FAILED: 5 problem(s) in 1 file(s)"
    assert all(re.match(rf"{re.escape(path)}:\d+:\d+: CG\d{{3}}: ", x) for x in lines[:-1])
    assert js.code == 1
    doc = js.json()
    assert isinstance(doc, dict)
    assert doc["ok"] is False and doc["rows"] == 0 and doc["files"] == [path]
    assert [(p["code"], p["line"]) for p in doc["problems"]] == [
        ("CG102", 18), ("CG104", 29), ("CG119", 41), ("CG122", 48), ("CG110", 52)]
    assert set(doc["problems"][0]) == {"path", "line", "col", "code", "field", "message"}


def test_validate_a_missing_path(tmp_path: Path) -> None:
    run, empty = capgate_many([["validate", str(tmp_path / "nowhere")],
                               ["validate", "--json", str(tmp_path)]])
    assert run.code == 1
    assert "FAILED: CG150: " in run.err and "no such file or directory" in run.err
    run = empty  # a directory without capability files
    assert run.code == 1
    doc = run.json()
    assert isinstance(doc, dict)
    assert (doc["status"], doc["code"], doc["error"]) == ("failed", "CG150", "CapabilityPathError")


def test_validate_defaults_to_capabilities_in_the_working_directory(caps: Path) -> None:
    shutil.copytree(caps, caps.parent / "capabilities")
    run = capgate("validate", cwd=caps.parent)
    assert (run.code, run.out) == (0, "ok: 7 rows in 2 file(s)\n")


# --- list and show ---------------------------------------------------------------------------


def test_list(batch: dict[str, Run]) -> None:
    plain, every, js = batch["list"], batch["list-all"], batch["list-json"]
    assert plain.code == every.code == js.code == 0
    head, *rows, note = plain.out.splitlines()
    assert head.split() == ["OPERATION", "VER", "EFFECT", "SHAPE", "AUTH", "LOCK",
                            "ENVIRONMENTS"]
    # tests/data/good has no capabilities.lock: every row is marked, and the list says why
    assert all(r.split()[5] == "UNPINNED" for r in rows)
    assert note.startswith("UNPINNED rows are drafts")
    assert [r.split()[:2] for r in rows] == [
        ["code.replace_premium_fn", "3"], ["cover.add", "1"], ["document.number", "1"],
        ["policy.delete_orphan", "1"], ["policy.get", "1"], ["policy.rename_holder", "2"]]
    assert "(retired)" not in plain.out
    assert len(every.out.splitlines()) == 9
    assert "policy.rename_holder               1  transactional collapsed write_grant UNPINNED  " \
           "dev,qa  (retired)" in every.out
    doc = js.json()
    assert isinstance(doc, list) and len(doc) == 7
    assert set(doc[0]) == {"operation_id", "version", "effect_class", "shape", "connector",
                           "authorization", "environments", "retired", "row_hash", "source",
                           "pinned"}
    assert {d["pinned"] for d in doc} == {False}
    by_ref = {f"{d['operation_id']}@{d['version']}": d for d in doc}
    assert by_ref["policy.rename_holder@1"]["retired"] is True
    assert by_ref["document.number@1"]["shape"] == "leased"
    assert by_ref["policy.get@1"]["shape"] is None
    assert {d["effect_class"] for d in doc} == {"read", "transactional", "compensable",
                                                "irreversible", "ddl"}


def test_show(batch: dict[str, Run]) -> None:
    current, old, js = batch["show"], batch["show-retired"], batch["show-json"]
    unknown, version, bad = batch["show-unknown"], batch["show-version"], batch["show-bad-version"]
    assert current.code == 0
    assert current.out.startswith("policy.rename_holder@2  [transactional/collapsed]\n")
    assert "binds :holder, :policy_id; expect 1" in current.out
    assert old.code == 0  # a retired row can still be reviewed
    assert old.out.startswith("policy.rename_holder@1  [transactional/collapsed]  RETIRED\n")
    assert js.code == 0
    doc = js.json()
    assert isinstance(doc, dict)
    assert doc["operation_id"] == "cover.add" and doc["version"] == 1
    assert doc["row"]["compensation"][0]["expect_rows"] == {"min": 0, "max": 1}
    assert doc["row_hash"].startswith("sha256:")
    assert (unknown.code, unknown.out) == (1, "")
    assert "FAILED: CG140: no capability row declares operation 'policy.drop_everything'" \
        in unknown.err
    assert version.code == 1 and "FAILED: CG141: policy.get has no version 7" in version.err
    assert bad.code == 2 and "CG900" in bad.err


# --- lock ------------------------------------------------------------------------------------


def test_lock_writes_pins_and_then_refuses_an_unversioned_change(caps: Path) -> None:
    first = capgate("lock", "--json", caps)
    assert first.code == 0
    doc = first.json()
    assert isinstance(doc, dict)
    assert doc["lock"] == str(caps / "capabilities.lock") and doc["rows"] == 7
    assert len(doc["added"]) == 7
    again = capgate("lock", caps)
    assert again.code == 0
    assert again.out == f"{caps / 'capabilities.lock'}: 7 rows pinned, 0 new\n"

    office = caps / "office.yaml"
    office.write_text(office.read_text("utf-8").replace(GET_SQL, "SELECT 1"), "utf-8")
    changed, validated = capgate_many([["lock", str(caps)], ["validate", str(caps)]])
    assert changed.code == 1
    assert re.search(rf"^{re.escape(str(office))}:\d+:\d+: CG130: version: policy.get@1 changed "
                     r"without a new version: locked sha256:[0-9a-f]{64}, now sha256:[0-9a-f]{64}",
                     changed.err, re.M), changed.err
    assert changed.err.rstrip().endswith("FAILED: 1 problem(s)")
    assert validated.code == 1 and "CG130" in validated.out


def test_an_unreadable_lock(caps: Path) -> None:
    (caps / "capabilities.lock").write_text("{oops", "utf-8")
    validated, locked = capgate_many([["validate", str(caps)], ["lock", str(caps)]])
    for run in (validated, locked):
        assert run.code == 1
        assert "FAILED: CG132: " in run.err and "cannot read the lock file" in run.err
    assert (caps / "capabilities.lock").read_text("utf-8") == "{oops"


# --- diff ------------------------------------------------------------------------------------


def test_diff_of_two_directories(caps: Path) -> None:
    office = caps / "office.yaml"
    office.write_text(office.read_text("utf-8").replace(GET_SQL, "SELECT 1"), "utf-8")
    text, js = capgate_many([["diff", str(GOOD), str(caps)],
                             ["diff", "--json", str(GOOD), str(caps)]])
    assert text.code == 0 and js.code == 0
    assert text.out.startswith("## Capability changes\n\n0 new version(s), 0 added, 1 changed, "
                               "0 retired, 0 removed")
    assert "```diff\n-" + GET_SQL + "\n+SELECT 1\n```" in text.out
    doc = js.json()
    assert isinstance(doc, dict)
    assert doc["markdown"].rstrip() == text.out.rstrip()


def test_diff_against_git(caps: Path) -> None:
    assert shutil.which("git"), "git is part of the development set-up (diff reads git:REV)"
    repo = caps.parent
    shutil.move(str(caps), str(repo / "capabilities"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "one"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    stored = repo / "capabilities" / "stored_code.yaml"
    stored.write_text(stored.read_text("utf-8").replace(
        "  - operation_id: policy.delete_orphan\n    version: 1\n",
        "  - operation_id: policy.delete_orphan\n    version: 1\n    retired: true\n"), "utf-8")
    run, bad_rev = capgate_many([["diff", "git:HEAD", "capabilities"],
                                 ["diff", "git:nope", "capabilities"]], cwd=repo)
    assert run.code == 0, run.err
    assert "0 added, 0 changed, 1 retired, 0 removed" in run.out
    assert "- **policy.delete_orphan@1** is retired" in run.out
    assert bad_rev.code == 1 and "CG150" in bad_rev.err


# --- explain ---------------------------------------------------------------------------------


def test_explain(batch: dict[str, Run]) -> None:
    one, everything = batch["explain"], batch["explain-all"]
    js, unknown = batch["explain-json"], batch["explain-unknown"]
    assert one.code == 0
    assert one.out.startswith("CG110 UnknownBind (exit 1)\n\nA ``:bind`` in SQL names no input")
    assert everything.code == 0
    listed = [line.split()[0] for line in everything.out.splitlines()]
    assert listed == [c.code for c in errors.all_codes()]
    doc = js.json()
    assert isinstance(doc, dict)
    assert (doc["code"], doc["name"], doc["exit_code"]) == ("CG143", "EnvironmentNotAllowed", 1)
    assert "environments" in doc["explanation"]
    assert unknown.code == 2 and "CG901" in unknown.err


# --- usage and help ----------------------------------------------------------------------


def test_usage_errors_exit_2(batch: dict[str, Run]) -> None:
    for name in [n for n in BATCH if n.startswith("usage-")]:
        run = batch[name]
        assert run.code == 2, (name, run)
        assert "usage: capgate" in run.err
        assert run.out == ""


def _commands(parser: argparse.ArgumentParser,
              prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every registered (sub)command, nested groups included, by its words."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[(*prefix, name)] = sub
                found.update(_commands(sub, (*prefix, name)))
    return found


def _is_group(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


COMMANDS = _commands(build_parser())


def test_the_registry_commands_are_registered() -> None:
    assert {("validate",), ("lock",), ("list",), ("show",), ("diff",), ("explain",)} \
        <= set(COMMANDS)


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=[" ".join(w) for w in sorted(COMMANDS)])
def test_every_command_has_help(words: tuple[str, ...],
                                capsys: pytest.CaptureFixture[str]) -> None:
    """STYLE 11: every command is documented; STYLE 7: every command takes --json."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*words, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: capgate {' '.join(words)}")
    parent = COMMANDS.get(words[:-1]) if len(words) > 1 else None
    if parent is not None or len(words) == 1:
        # listed, with a one-line help, by the command above it
        above = (parent or build_parser()).format_help()
        assert re.search(rf"^\s+{re.escape(words[-1])}\s+\S", above, re.M), above
    if not _is_group(COMMANDS[words]):
        assert "--json" in out, f"capgate {' '.join(words)} has no --json"


def test_top_level_help_through_a_process(batch: dict[str, Run]) -> None:
    run = batch["help"]
    assert run.code == 0 and run.out.startswith("usage: capgate")
    for words in COMMANDS:
        if len(words) == 1:
            assert words[0] in run.out
