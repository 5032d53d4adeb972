"""Every failing capability file under ``tests/data/bad/`` reports exactly what it says.

Each bad file (or directory, for the lock rules) states what it must produce
in comments at its top::

    # expect: CG110 23                      -- code and line in this file
    # expect: CG133 capabilities.lock:1     -- code, file (relative) and line

The loader must report exactly that set of ``(file, code, line)`` -- nothing
missing and nothing extra -- and ``capgate validate`` on the same path must
exit 1 and print ``path:line:col: CODE`` for each.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from capgate.registry import errors
from capgate.registry.loader import validate_paths

ROOT = Path(__file__).resolve().parent.parent
BAD = Path("tests/data/bad")  # relative to ROOT, as a DBA would type it
EXPECT = re.compile(r"^#\s*expect:\s*(CG\d{3})\s+(?:(\S+):)?(\d+)\s*$")


@dataclass(frozen=True)
class Expected:
    path: str  # relative to ROOT, exactly as the loader and the CLI print it
    code: str
    line: int


def entries() -> list[Path]:
    found = sorted(p for p in (ROOT / BAD).iterdir()
                   if p.is_dir() or p.suffix in (".yaml", ".yml"))
    return [p.relative_to(ROOT) for p in found]


def expectations(entry: Path) -> set[Expected]:
    files = sorted((ROOT / entry).glob("*.yaml")) if (ROOT / entry).is_dir() else [ROOT / entry]
    out: set[Expected] = set()
    for file in files:
        for raw in file.read_text("utf-8").splitlines():
            if not raw.startswith("#"):
                break
            m = EXPECT.match(raw)
            if m:
                code, other, line = m.groups()
                where = file.parent / other if other else file
                out.add(Expected(str(where.relative_to(ROOT)), code, int(line)))
    return out


ENTRIES = entries()
IDS = [e.name for e in ENTRIES]


def test_there_are_bad_files() -> None:
    assert len(ENTRIES) >= 25
    for entry in ENTRIES:
        assert expectations(entry), f"{entry} has no `# expect: CODE LINE` comment"


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_loader_reports_exact_code_and_line(entry: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = validate_paths([entry])
    assert not result.ok
    got = {Expected(p.path, p.code, p.line) for p in result.problems}
    assert got == expectations(entry), "\n".join(p.render() for p in result.problems)
    for problem in result.problems:
        assert problem.col >= 1
        # every reported code is a registered error, so `capgate explain` knows it
        assert errors.lookup(problem.code).code == problem.code


# One Python process imports the CLI once, then forks a child per entry that runs the
# console script's function, `capgate.cli:main(["validate", ENTRY])`, and exits with what it
# returns: every entry gets its own process and real exit status, without paying the
# interpreter start and imports (~0.5 s) thirty times.  `tests/test_cli_registry.py` runs
# `python -m capgate validate` itself.
_FORKING_DRIVER = r"""
import json, os, sys, tempfile
from capgate.cli import main
results = {}
for entry in sys.argv[1:]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = 70
            try:
                code = main(["validate", entry])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        out.seek(0)
        err.seek(0)
        results[entry] = [status, out.read().decode(), err.read().decode()]
print(json.dumps(results))
"""


@cache
def _cli_results() -> dict[Path, tuple[int, str, str]]:
    """`capgate validate ENTRY` for every entry, each in its own process."""
    proc = subprocess.run([sys.executable, "-c", _FORKING_DRIVER, *map(str, ENTRIES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    raw = json.loads(proc.stdout)
    out: dict[Path, tuple[int, str, str]] = {}
    for entry in ENTRIES:
        code, stdout, stderr = raw[str(entry)]
        out[entry] = (int(code), str(stdout), str(stderr))
    return out


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_cli_validate_exits_1_with_located_codes(entry: Path) -> None:
    code, stdout, stderr = _cli_results()[entry]
    assert code == 1, stdout + stderr
    assert "Traceback" not in stderr
    for exp in expectations(entry):
        pattern = rf"^{re.escape(exp.path)}:{exp.line}:\d+: {exp.code}: "
        assert re.search(pattern, stdout, re.M), f"{pattern!r} not in:\n{stdout}"
    assert "FAILED:" in stdout


def _file_checks() -> Iterator[str]:
    """Every located code a capability file (or its lock) can trigger."""
    for cls in errors.all_codes():
        number = int(cls.code[2:])
        if 101 <= number <= 129 or number in (130, 131, 133):
            yield cls.code


def test_every_file_check_has_a_bad_file() -> None:
    covered = {e.code for entry in ENTRIES for e in expectations(entry)}
    missing = sorted(set(_file_checks()) - covered)
    assert not missing, f"no file under {BAD} exercises {missing}"


def test_the_issue_example_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = validate_paths([BAD / "cg104_expect_rows_many.yaml"])
    (problem,) = result.problems
    assert problem.render() == (
        f"{BAD / 'cg104_expect_rows_many.yaml'}:29:22: CG104: statements[1].expect_rows: "
        "expected an integer or a range, got 'many'"
    )


def test_several_errors_are_all_reported_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = validate_paths([BAD / "several_errors.yaml"])
    assert [(p.line, p.code) for p in result.problems] == [
        (18, "CG102"), (29, "CG104"), (41, "CG119"), (48, "CG122"), (52, "CG110"),
    ]
    # rows in one file are independent: the clean row is still built
    assert result.rows == []  # none is clean here; each of the three rows has a finding
    fields = [p.field for p in result.problems]
    assert fields == ["max_row", "environments[1]", "connector", "shape", "statements[0].sql"]


def test_all_bad_files_at_once_report_every_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating many files keeps going after the first bad one."""
    monkeypatch.chdir(ROOT)
    files = [e for e in ENTRIES if e.is_file()]
    result = validate_paths(files)
    reported = {p.path for p in result.problems}
    assert reported == {str(f) for f in files}
