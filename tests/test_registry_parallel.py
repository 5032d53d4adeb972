"""Checking files in forked workers, and with row-level positions only, changes nothing.

A large registry is checked in several processes and a clean file is loaded
with the positions of its rows only (``registry.fastload.parallel``,
``yamlpos.load_located(positions="rows")``).  These tests hold both to the
plain path: the same rows with the same hashes and lines, the same findings at
the same lines and columns.  The parallel runs happen in a fresh interpreter,
since the loader refuses to fork a process that has other threads (and a test
session may have some).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import rfc8785
import yaml
from hypothesis import given, settings

from capgate.registry.canonical import canonical_bytes
from capgate.registry.errors import ConfigError
from capgate.registry.fastload.filecheck import _check_file, check_file
from capgate.registry.fastload.parallel import WORKERS_ENV, worker_count
from capgate.registry.fastload.yamlpos import load_located
from capgate.registry.loader import validate_texts
from tests.test_canonical import json_values

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted([*ROOT.glob("capabilities/*.yaml"), *ROOT.glob("tests/data/good/*.yaml"),
                *ROOT.glob("tests/data/bad/*.yaml"), *ROOT.glob("tests/data/bad/*/*.yaml")])


def _texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text("utf-8")) for p in FILES]


def _summary(items: list[tuple[str, str]], workers: int) -> dict[str, Any]:
    result = validate_texts(items, workers=workers)
    return {
        "problems": [p.render() for p in result.problems],
        "rows": [[r.ref, r.row_hash, r.source_path, r.source_line] for r in result.rows],
    }


def test_row_positions_only_give_the_same_data_and_findings() -> None:
    assert len(FILES) >= 39
    for source, text in _texts():
        fast, fast_problems = load_located(text, source, positions="rows")
        full, full_problems = load_located(text, source, positions="all")
        assert [p.render() for p in fast_problems] == [p.render() for p in full_problems]
        assert (fast is None) == (full is None)
        if fast is not None and full is not None:
            assert fast.data == full.data
            assert fast.json_plain == full.json_plain
        checked, located_all = check_file(source, text), _check_file(source, text, "all")
        assert [p.render() for p in checked.problems] == \
            [p.render() for p in located_all.problems], source
        assert checked.rows == located_all.rows, source


def _run(script: str, *args: str,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


PARALLEL = """
    import json, sys
    sys.path.insert(0, "tests")
    from test_registry_parallel import _summary, _texts
    from capgate.registry.fastload.parallel import worker_count
    items = _texts()
    assert worker_count(items, 3) == 3, "the fresh interpreter must be allowed to fork"
    print(json.dumps(_summary(items, 3)))
"""


def test_parallel_workers_give_the_same_registry_and_findings() -> None:
    run = _run(PARALLEL)
    assert run.returncode == 0, run.stderr
    parallel = json.loads(run.stdout)
    serial = _summary(_texts(), 1)
    assert parallel == serial
    # The comparison covers both clean rows and findings of every kind.
    assert len(serial["rows"]) >= 17
    codes = {line.split(": ")[1] for line in serial["problems"]}
    assert {"CG101", "CG104", "CG110", "CG117", "CG118"} <= codes


DYING_WORKER = """
    import os, signal, sys
    import capgate.registry.fastload.parallel as parallel
    from capgate.registry.errors import LoadWorkerFailed
    real = parallel.check_file

    def check_or_die(source, text):
        if source == "die.yaml":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(source, text)

    parallel.check_file = check_or_die
    from capgate.registry.loader import validate_texts
    items = [(f"f{i}.yaml", "connectors: {}\\nrows: []\\n") for i in range(5)]
    items.append(("die.yaml", "rows: []\\n"))  # the workers take files from the back
    try:
        validate_texts(items, workers=2)
    except LoadWorkerFailed as exc:
        print(exc.code, exc)
        sys.exit(0)
    sys.exit("the load did not fail")
"""


def test_a_killed_worker_fails_the_load_instead_of_hanging_it() -> None:
    run = _run(DYING_WORKER)
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.startswith("CG151 ") and WORKERS_ENV in run.stdout


def test_worker_count() -> None:
    small = [("a.yaml", "rows: []\n"), ("b.yaml", "rows: []\n")]
    assert worker_count(small) == 1  # too little text to be worth a process
    assert worker_count(small, 0) == 1
    assert worker_count(small, 64) <= 2  # never more than one process per file
    assert worker_count([("a.yaml", "x" * 2_000_000)], 4) == 1


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_bad_worker_setting_is_a_configuration_error(value: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, value)
    with pytest.raises(ConfigError) as caught:
        worker_count([("a.yaml", "rows: []\n")])
    assert WORKERS_ENV in str(caught.value) and caught.value.code == "CG902"


def test_the_worker_setting_is_obeyed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "1")
    big = [(f"{i}.yaml", "x" * 1_000_000) for i in range(3)]
    assert worker_count(big) == 1


@settings(max_examples=300, deadline=None)
@given(json_values)  # integers beyond 2**53 make a finding: those examples end early
def test_the_loaders_plain_flag_only_skips_what_rfc8785_agrees_with(value: Any) -> None:
    text = yaml.safe_dump({"rows": [value]}, allow_unicode=True)
    for positions in ("rows", "all"):
        located, problems = load_located(text, "f.yaml", positions=positions)
        if located is None or problems:
            return  # e.g. a text that reads back as a date: reported, never hashed
        data = located.data["rows"][0]
        try:
            expected = rfc8785.dumps(data)
        except Exception:
            return  # values RFC 8785 rejects (lone surrogates) are not hashed
        assert canonical_bytes(data, known_plain=located.json_plain) == expected


ORPHANED_WORKER = """
    import os, sys, time
    import capgate.registry.fastload.parallel as parallel
    real = parallel.check_file

    def slow_check(source, text):
        if os.getpid() != PARENT:  # a worker: say who it is
            with open(sys.argv[1], "a") as out:
                out.write(f"{os.getpid()}\\n")
        time.sleep(0.5)  # both sides slow: most files are unclaimed when the parent dies
        return real(source, text)

    PARENT = os.getpid()
    parallel.check_file = slow_check
    from capgate.registry.loader import validate_texts
    validate_texts([(f"f{i}.yaml", "rows: []\\n") for i in range(40)], workers=2)
"""


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status  # exited; waiting to be reaped by whoever adopted it


def test_workers_stop_when_the_loading_process_is_killed(tmp_path: Path) -> None:
    pids_file = tmp_path / "workers"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(ORPHANED_WORKER),
                             str(pids_file)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (pids_file.exists() and pids_file.read_text().strip()):
            assert time.monotonic() < deadline, "no worker started"
            assert proc.poll() is None, "the load ended before a worker started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        workers = {int(p) for p in pids_file.read_text().split()}
        deadline = time.monotonic() + 5  # a worker finishes its file (0.5 s), then stops
        while not all(_gone(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} outlived their parent"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


RAISING_WORKER = """
    import os
    import capgate.registry.fastload.parallel as parallel
    real = parallel.check_file
    PARENT = os.getpid()

    def check_or_raise(source, text):
        if source == "odd.yaml" and os.getpid() != PARENT:
            raise RuntimeError("only in a worker")
        if source == "bad.yaml":
            raise LookupError("everywhere")
        return real(source, text)

    parallel.check_file = check_or_raise
    from capgate.registry.loader import validate_texts
    items = [(f"f{i}.yaml", "connectors: {}\\nrows: []\\n") for i in range(4)]
    result = validate_texts([*items, ("odd.yaml", "rows: []\\n")], workers=2)
    print("odd.yaml checked by the caller:", result.files[-1])
    try:
        validate_texts([*items, ("bad.yaml", "rows: []\\n")], workers=2)
    except LookupError as exc:
        print("raised:", exc)
"""


def test_an_exception_in_a_worker_is_raised_by_the_caller() -> None:
    run = _run(RAISING_WORKER)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["odd.yaml checked by the caller: odd.yaml",
                                       "raised: everywhere"]
