"""Start-up: what ``--help`` imports, ``--version``, did-you-mean, the validation cache.

No test here measures time (``bench/startup.py`` does): they check the causes
of a slow start -- modules imported for nothing, files validated again.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capgate.registry.errors import RegistryError, UnknownOperation
from capgate.registry.fastload import cache
from capgate.registry.fastload.cache import LazyRegistry, entry_key
from capgate.registry.loader import load_registry
from tests.test_init import ROOT, capgate, clean_env

HEAVY = ("sqlalchemy", "sqlglot", "jsonschema", "executor", "mcp", "yaml", "ddl")


def test_help_imports_no_command_module(tmp_path: Path) -> None:
    probe = ("import sys\nfrom capgate.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             f"print('LOADED', sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=clean_env(tmp_path),
                          capture_output=True, text=True, check=True)
    assert "usage: capgate" in proc.stdout
    assert proc.stdout.strip().endswith("LOADED []"), proc.stdout[-300:]


def test_version_and_did_you_mean(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    assert capgate(["--version"], tmp_path, env).stdout.startswith("capgate ")
    typo = capgate(["cal"], tmp_path, env, code=2)
    assert "unknown command 'cal'; did you mean `call`?" in typo.stderr
    capgate(["init", "proj"], tmp_path, env)
    wrong = capgate(["call", "policy.ad_note", "--case", "T", "--json"], tmp_path / "proj", env,
                    code=1)
    assert json.loads(wrong.stdout)["code"] == "CG140"
    assert "did you mean `policy.add_note`?" in json.loads(wrong.stdout)["message"]
    with pytest.raises(UnknownOperation) as caught:
        load_registry([ROOT / "capabilities"], check_lock=False).resolve("polcy.get")
    assert caught.value.details["suggestions"] == ["policy.get"]


@pytest.fixture
def caps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "caps"
    shutil.copytree(ROOT / "capabilities", folder, ignore=shutil.ignore_patterns("schema"))
    monkeypatch.setenv("CAPGATE_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def test_a_cached_load_equals_a_full_one_and_builds_only_what_is_used(caps: Path) -> None:
    full = load_registry([caps], check_lock=False)
    first = load_registry([caps], check_lock=False, cache=True)   # validates, then records
    again = load_registry([caps], check_lock=False, cache=True)   # from the cache
    assert isinstance(again, LazyRegistry)
    assert again._rows._built == {}  # type: ignore[attr-defined]
    row = again.resolve("policy.add_note")
    assert len(again._rows._built) == 1  # type: ignore[attr-defined]
    assert row.to_dict() == full.resolve("policy.add_note").to_dict()
    assert row.row_hash == full.resolve("policy.add_note").row_hash
    assert [(r.key, r.row_hash, r.retired, r.source_line) for r in again.rows()] == \
        [(r.key, r.row_hash, r.retired, r.source_line) for r in full.rows()]
    assert [r.key for r in first.current_rows()] == [r.key for r in full.current_rows()]


def test_the_cache_cannot_go_stale(caps: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_registry([caps], check_lock=False, cache=True)
    policies = caps / "policies.yaml"
    text = policies.read_text("utf-8")
    # a changed file is a different key: it is validated again, and its problem reported
    policies.write_text(text.replace("recovery: retryable", "recovery: sometimes", 1), "utf-8")
    with pytest.raises(RegistryError) as caught:
        load_registry([caps], check_lock=False, cache=True)
    assert caught.value.problems[0].code == "CG104"
    policies.write_text(text, "utf-8")
    before = entry_key(text)
    # other validating code (or schema, or library versions) is a different key too
    monkeypatch.setattr(cache, "validator_digest", lambda: "other-code")
    assert entry_key(text) != before
    assert load_registry([caps], check_lock=False, cache=True).resolve("policy.get")


def test_a_file_with_problems_is_never_cached(caps: Path, tmp_path: Path) -> None:
    bad = caps / "policies.yaml"
    bad.write_text(bad.read_text("utf-8").replace("recovery: retryable", "recovery: x", 1),
                   "utf-8")
    for _ in range(2):
        with pytest.raises(RegistryError):
            load_registry([caps], check_lock=False, cache=True)
    stored = list((tmp_path / "cache").rglob("*.jsonl"))
    assert entry_key(bad.read_text("utf-8")) not in {p.stem for p in stored}


def test_a_row_is_still_built_when_the_cache_is_cleared_under_a_process(
        caps: Path, tmp_path: Path) -> None:
    load_registry([caps], check_lock=False, cache=True)
    lazy = load_registry([caps], check_lock=False, cache=True)
    shutil.rmtree(tmp_path / "cache")
    assert lazy.resolve("policy.get").operation_id == "policy.get"


def test_a_read_call_loads_neither_jsonschema_nor_cryptography(tmp_path: Path) -> None:
    """A valid request is accepted by the compiled contract; no key is used by a read."""
    env = clean_env(tmp_path)
    capgate(["init", "proj"], tmp_path, env)
    capgate(["call", "policy.get", "--input", "{\"policy_id\": 1}", "--case", "T-0"],
            tmp_path / "proj", env)  # records the files in the validation cache
    probe = ("import sys\nfrom capgate.cli import main\n"
             "code = main(['call', 'policy.get', '--input', '{\"policy_id\": 1}', "
             "'--case', 'T-1', '--json'])\n"
             "names = {m.split('.')[0] for m in sys.modules}\n"
             "print('LOADED', code, sorted(names & {'jsonschema', 'cryptography', 'yaml', "
             "'sqlglot'}))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path / "proj", env=env,
                          capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1].startswith("LOADED 0 []"), proc.stdout[-400:]


def test_installed_versions_agree_with_importlib_metadata() -> None:
    from importlib.metadata import version

    names = ("sqlglot", "jsonschema", "PyYAML", "SQLAlchemy", "capgate", "no-such-dist-x")
    found = cache.installed_versions(names)
    for name in names[:-1]:
        assert found[name] == version(name), name
    assert found["no-such-dist-x"] == "-"
