"""One error module, one vocabulary (issue 14 item 2).

Every ``CapgateError`` subclass with a code lives in ``registry.errors``, so
``capgate.lookup`` knows every code right after ``import capgate`` -- before
this, ``lookup("CG501")`` failed unless ``ddl`` had been imported.  Outcome
statuses, recovery classifications and rollback reasons are ``StrEnum``s
defined once in ``registry.vocabulary``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from capgate.ddl import results as ddl_results
from capgate.executor import outcome
from capgate.executor.recovery import evidence
from capgate.registry.canonical import _plain, canonical_bytes
from capgate.registry.vocabulary import Classification, OutcomeStatus, RollbackReason

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("registry", "executor", "ddl", "capgate")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _coded_classes() -> dict[str, tuple[str, str]]:
    """code -> (class name, file) for every class statement that declares ``code="CG..."``."""
    found: dict[str, tuple[str, str]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for kw in node.keywords:
                    if kw.arg == "code" and isinstance(kw.value, ast.Constant):
                        found[str(kw.value.value)] = (node.name, str(path.relative_to(ROOT)))
    return found


def test_every_error_class_is_defined_in_registry_errors() -> None:
    coded = _coded_classes()
    assert len(coded) > 130  # the scan sees the tree (CG1xx..CG9xx)
    elsewhere = {code: where for code, where in coded.items() if where[1] != "registry/errors.py"}
    assert elsewhere == {}


def test_lookup_knows_every_code_right_after_import_capgate() -> None:
    coded = _coded_classes()
    probe = (
        "import json, sys, capgate\n"
        "codes = json.loads(sys.stdin.read())\n"
        "out = {}\n"
        "for code in codes:\n"
        "    try:\n"
        "        out[code] = capgate.lookup(code).__name__\n"
        "    except capgate.CapgateError as exc:\n"
        "        out[code] = 'MISSING ' + exc.code\n"
        "print(json.dumps(out))\n"
        "loaded = [m for m in sys.modules if m.startswith(('capgate.ddl', 'capgate.executor'))]\n"
        "print(json.dumps(sorted(loaded)))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], input=json.dumps(sorted(coded)),
                          capture_output=True, text=True, cwd=ROOT, check=True)
    answers_line, loaded_line = done.stdout.splitlines()[-2:]
    answers = json.loads(answers_line)
    assert answers == {code: name for code, (name, _) in coded.items()}
    # nothing of ddl or the executor had to be imported for it
    assert json.loads(loaded_line) == []


def test_the_outcome_statuses_are_defined_once() -> None:
    assert outcome.APPLIED is OutcomeStatus.APPLIED_VERIFIED is ddl_results.APPLIED_VERIFIED
    assert outcome.ROLLED_BACK is ddl_results.ROLLED_BACK is OutcomeStatus.ROLLED_BACK
    assert outcome.COMPENSATED is ddl_results.COMPENSATED
    assert outcome.COMPENSATION_FAILED is ddl_results.COMPENSATION_FAILED
    assert evidence.Classification is Classification
    assert set(ddl_results.NEXT_ACTION) == set(Classification)
    # a member is its text: equal to what a ledger reads back, same exit code mapping
    assert OutcomeStatus.ROLLED_BACK == "rolled_back"
    assert {str(k): v for k, v in outcome._EXIT.items()}["rolled_back"] == \
        outcome._EXIT[OutcomeStatus.ROLLED_BACK]


def test_a_member_serialises_as_its_text_on_the_fast_path() -> None:
    with_members = {"status": OutcomeStatus.ROLLED_BACK, "reason": {"kind": RollbackReason.TIMEOUT},
                    "seen": [Classification.PARTLY_APPLIED, "\U0001f600"]}
    as_text = json.loads(json.dumps(with_members))
    assert canonical_bytes(with_members) == canonical_bytes(as_text)
    assert _plain(with_members)  # not pushed to the slow encoder for an enum leaf


def test_no_rollback_reason_is_spelled_as_a_bare_string() -> None:
    reasons = {m.value for m in RollbackReason}
    bare: list[str] = []
    for path in _sources():
        if path.name == "vocabulary.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if (isinstance(key, ast.Constant) and key.value == "kind"
                            and isinstance(value, ast.Constant) and value.value in reasons):
                        bare.append(f"{path.relative_to(ROOT)}:{node.lineno}: {value.value}")
    assert bare == []
