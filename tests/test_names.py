"""A case id or an identity is a short line of printable text (registry.names).

Both come from the caller and are shown to the people who review what happened:
a newline in a case id printed a forged row in ``capgate cases``, and a
100,000-character one filled every message naming it.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.ledger import open_ledger
from capgate.executor.ledger import store as ledger_store
from capgate.registry import errors
from capgate.registry.names import NAME_LIMIT, name_problem
from tests.fix_capgate import table_dump

NOTE = {"policy_id": 1, "author": "jdoe", "body": "Called the holder."}


@pytest.mark.parametrize("good", ["TICKET-1", "a b", "Ünïcode-Fall", "\U0001F600-case",
                                  "x" * NAME_LIMIT, "日本語のケース"])
def test_a_line_of_printable_text_is_a_name(good: str) -> None:
    assert name_problem(good) is None


@pytest.mark.parametrize(("bad", "says"), [
    ("", "empty"), ("   ", "blank"), ("x" * (NAME_LIMIT + 1), "at most 200"),
    ("A\nB", "control character (U+000A)"), ("A\tB", "U+0009"), ("A\x7fB", "U+007F"),
    ("A\x85B", "U+0085"), ("\u202eevil", "formatting character (U+202E)"),
    ("A\u200bB", "U+200B"), ("A\u2028B", "line separator"), ("A\u2029B", "paragraph"),
    ("A\ud800", "lone surrogate"), (7, "must be text"), (None, "must be text"),
])
def test_anything_else_is_refused_and_says_why(bad: object, says: str) -> None:
    problem = name_problem(bad)
    assert problem is not None and says in problem, problem


@pytest.mark.parametrize(("case", "who"), [
    ("A\nTICKET-9  closed  3  policy.add_note@1 applied_verified", "agent"),
    ("C" * 100_000, "agent"), ("OK-CASE", "agent\n"), ("OK-CASE", "x" * 10_000),
])
def test_a_call_with_such_a_name_records_nothing(gate: Callable[..., Executor], sqlite_url: URL,
                                                 case: str, who: str) -> None:
    ex = gate(sqlite_url)
    notes = table_dump(sqlite_url, "policy_note")
    for attempt in (lambda: ex.call("policy.add_note", NOTE, case=case, who=who),
                    lambda: ex.plan("policy.add_note", NOTE, case=case, who=who),
                    lambda: ex.call("no.such.operation", NOTE, case=case, who=who)):
        with pytest.raises(errors.InputInvalid) as refused:
            attempt()
        assert refused.value.code == "CG300"
        assert refused.value.details["field"] == ("case" if who == "agent" else "who")
        assert len(str(refused.value)) < 300  # an excerpt, never the whole value
    assert ex.ledger.cases() == [] and table_dump(sqlite_url, "policy_note") == notes


def test_a_task_is_a_name_too(gate: Callable[..., Executor], sqlite_url: URL) -> None:
    ex = gate(sqlite_url)
    with pytest.raises(errors.InputInvalid) as refused:
        ex.call("policy.add_note", NOTE, case="T-1", who="agent", task="fix\nthe other")
    assert refused.value.details["field"] == "task" and ex.ledger.cases() == []
    assert ex.call("policy.add_note", NOTE, case="T-1", who="agent",
                   task="fix the note").status == "applied_verified"


def test_the_ledger_opens_no_case_under_such_an_id_but_keeps_an_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_ledger(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        with pytest.raises(errors.LedgerError, match="a case id holds a control character"):
            ledger.append("A\nB", "opened", {})
        with pytest.raises(errors.LedgerError, match="at most 200"):
            ledger.append_each([("C" * 201, "opened", {}, None)])
        assert ledger.cases() == []
        # a case opened before the rule stays readable, continuable and verifiable
        monkeypatch.setattr(ledger_store, "_check_new_case_id", lambda case_id: None)
        ledger.append("OLD\tCASE", "opened", {})
        monkeypatch.undo()
        ledger.append("OLD\tCASE", "note", {"n": 1})
        assert [e.kind for e in ledger.events("OLD\tCASE")] == ["opened", "note"]
        assert ledger.verify("OLD\tCASE").findings == ()


def test_the_cli_refuses_such_a_case_and_lists_no_forged_row(tmp_path: Path) -> None:
    from capgate.cli import main
    from tests.test_adversarial import CAPABILITIES_DIR

    config = tmp_path / "capgate.toml"
    config.write_text(f'[capgate]\nledger = "sqlite:///{tmp_path / "l.db"}"\n'
                      f'capabilities = ["{CAPABILITIES_DIR}"]\n'
                      f'[connectors.insurance]\nurl = "sqlite:///{tmp_path / "t.db"}"\n'
                      'environment = "dev"\n')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["call", "policy.get", "--input", '{"policy_id": 1}', "--case",
                     "A\nTICKET-9  closed", "--as", "agent", "--json", "--config", str(config)])
    assert code == errors.EXIT_REFUSED, out.getvalue()
    assert json.loads(out.getvalue())["code"] == "CG300"
