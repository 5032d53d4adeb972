"""Capability gaps are escalations (issue 17, item 6): who asked for what, through which face.

A request for an operation no row declares -- through the Python API, the CLI
or the MCP server -- is refused as before, and recorded as a
``capability_gap`` event in the asking case and in the ledger's gap register,
which ``capgate gaps`` lists for the DBAs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from mcp.shared.exceptions import MCPError
from sqlalchemy.engine import URL

from capgate.executor.call import Executor
from capgate.executor.gaps import GAPS_CASE, list_gaps
from capgate.executor.ledger import open_ledger
from capgate.registry import errors
from tests.test_coordination import url_text

ROOT = Path(__file__).resolve().parent.parent


def test_a_request_without_a_row_is_refused_and_recorded(gate: Callable[..., Executor],
                                                        sqlite_url: URL) -> None:
    ex = gate(sqlite_url)
    with pytest.raises(errors.UnknownOperation):
        ex.call("policy.drop_everything", {"policy_id": 1, "why": "x" * 5000}, case="G-1",
                who="agent")
    with pytest.raises(errors.UnknownVersion):
        ex.plan("policy.get", {"policy_id": 1}, case="G-1", who="agent", version=7)
    with pytest.raises(errors.RetiredRow):  # a retired row exists: not a gap
        ex.call("policy.cancel", {"policy_id": 1}, case="G-1", who="agent", version=1)
    assert [e.kind for e in ex.ledger.events("G-1")] == ["capability_gap"] * 2
    gaps = list_gaps(ex.ledger)
    assert [(g["operation_id"], g["version"], g["refusal"], g["via"]) for g in gaps] == [
        ("policy.drop_everything", None, "CG140", "api"), ("policy.get", 7, "CG141", "api")]
    first = gaps[0]
    assert (first["requested_by"], first["case"]) == ("agent", "G-1")
    assert first["input_fields"] == ["policy_id", "why"]  # the fields, not the values
    assert first["inputs_digest"].startswith("sha256:") and "xxxxx" not in json.dumps(first)

    prod = gate(sqlite_url, schema=False, environment="prod")
    with pytest.raises(errors.EnvironmentNotAllowed):
        prod.call("premium.move_due_date", {"policy_id": 1, "premium_id": 1,
                                            "new_due_date": "2024-12-01"},
                  case="G-2", who="agent")
    assert [g["refusal"] for g in list_gaps(prod.ledger)] == ["CG143"]

    # the register verifies like any case: an edited gap is found, not listed
    with ex.ledger.engine.begin() as conn:
        conn.execute(sa.text("UPDATE cg_events SET payload = replace(payload, :a, :b)"
                             " WHERE case_id = :c"),
                     {"a": "drop_everything", "b": "harmless_thing", "c": GAPS_CASE})
    with pytest.raises(errors.LedgerTampered):
        list_gaps(ex.ledger)


def test_gaps_from_the_command_line_and_the_mcp_server(sqlite_url: URL, tmp_path: Path
                                                       ) -> None:
    from tests.test_mcp import Place, stdio_session

    place = Place(tmp_path, sqlite_url)

    def capgate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "capgate", *args, "--config",
                               str(place.config)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=False, env=place.env())

    refused = capgate("call", "sql.execute", "--case", "G-CLI", "--input",
                      '{"sql": "DELETE FROM policy"}')
    assert refused.returncode == 1 and "CG140" in refused.stderr

    async def main() -> None:
        async with stdio_session(place, "--case", "G-MCP") as (session, _):
            with pytest.raises(MCPError, match="unknown tool"):
                await session.call_tool("policy_drop", {"policy_id": 1})

    anyio.run(main)
    listed = capgate("gaps", "--json")
    assert listed.returncode == 0, listed.stderr
    gaps: list[dict[str, Any]] = json.loads(listed.stdout)
    assert [(g["operation_id"], g["case"], g["via"]) for g in gaps] == [
        ("sql.execute", "G-CLI", "cli"), ("policy_drop", "G-MCP", "mcp")]
    text = capgate("gaps").stdout
    assert "2 capability gap(s)" in text and "sql.execute" in text and "via mcp" in text
    with open_ledger(url_text(f"sqlite:///{tmp_path / 'ledger.db'}")) as ledger:
        assert [e.kind for e in ledger.events("G-MCP")] == ["capability_gap"]


def test_an_unknown_operation_with_inputs_no_ledger_can_hold_is_still_a_coded_refusal(
        gate: Callable[..., Executor], sqlite_url: URL, tmp_path: Path) -> None:
    """Inputs beyond what the ledger records exactly (2^53, a lone surrogate, deep nesting)
    never turn the refusal of an unknown operation into an internal error; the gap is
    recorded with the field names (escaped) and no digest."""
    ex = gate(sqlite_url)
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5000):
        inner["n"] = {}
        inner = inner["n"]
    for inputs in ({"x": 2**64}, {"x\ud800": "\ud800"}, deep):
        with pytest.raises(errors.UnknownOperation):
            ex.call("policy.no_such_thing", inputs, case="G-LIMITS", who="agent")
    gaps = list_gaps(ex.ledger)
    assert [g["inputs_digest"] for g in gaps] == [None, None, None]
    assert gaps[1]["input_fields"] == ["x\\ud800"]
    config = tmp_path / "capgate.toml"
    config.write_text(f'[capgate]\nledger = "sqlite:///{tmp_path / "l.db"}"\n'
                      f'capabilities = ["{ROOT / "capabilities"}"]\n'
                      'agent = "agent"\n', "utf-8")
    proc = subprocess.run([sys.executable, "-m", "capgate", "call", "policy.no_such_thing",
                           "--input", '{"x": 99999999999999999999}', "--case", "G-CLI",
                           "--json", "--config", str(config)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert json.loads(proc.stdout)["code"] == "CG140"
