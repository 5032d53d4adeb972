"""``capgate rehearse``: every example in write-and-rollback on real databases.

Runs the command in-process (``capgate.cli.main``) against a fresh seeded
schema on PostgreSQL and MariaDB (SQLite for the probe), with a config whose
connectors ``insurance`` and ``insurance_code`` both point at it.  Every test
compares the contents of every table before and after.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.cli import main
from capgate.executor.dialects.base import MARKER_TABLE
from capgate.sqlfiles import apply_schema
from tests.fix_capgate import install_target
from tests.fix_db import engine_params

ROOT = Path(__file__).resolve().parent.parent
CAPABILITIES = ROOT / "capabilities"

GRANTS = """
[principals.ci]
grants = [{ connector = "*", environments = ["dev"], access = "write" }]
[principals.reader]
grants = [{ connector = "*", environments = ["dev"], access = "read" }]
"""

PROBE_ROWS = """
format: 1
connectors:
  insurance:
    description: the insurance back office
    dialects: [sqlite, postgresql, mariadb]
rows:
  - operation_id: policy.rename_holder
    version: 1
    connector: insurance
    description: Rename the holder of an active policy.  No examples yet.
    input:
      type: object
      additionalProperties: false
      required: [policy_id, holder]
      properties:
        policy_id: {type: integer, minimum: 1}
        holder: {type: string, minLength: 1, maxLength: 100}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{policy_id}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: rename
        sql: "UPDATE policy SET holder = :holder WHERE policy_id = :policy_id AND status = 'active'"
        expect_rows: 1
      - name: note
        sql: >
          INSERT INTO policy_note (policy_id, author, body)
          VALUES (:policy_id, 'capgate', :holder)
        expect_rows: 1
    verify:
      - name: renamed
        sql: "SELECT count(*) FROM policy WHERE policy_id = :policy_id AND holder = :holder"
        expect: {value: 1}
    evidence: [counts, verify, marker]

  - operation_id: policy.rename_holder_typo
    version: 1
    connector: insurance
    description: The same with a misspelt column, which only the database can notice.
    input:
      type: object
      additionalProperties: false
      required: [policy_id, holder]
      properties:
        policy_id: {type: integer, minimum: 1}
        holder: {type: string, minLength: 1, maxLength: 100}
    target: {system: insurance, object: policy, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{policy_id}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: rename
        sql: "UPDATE policy SET holdr = :holder WHERE policy_id = :policy_id"
        expect_rows: 1
    evidence: [counts, marker]
"""


def write_config(tmp_path: Path, url: URL, caps: Path) -> Path:
    rendered = url.render_as_string(hide_password=False)
    (tmp_path / "grants.toml").write_text(GRANTS)
    cfg = tmp_path / "capgate.toml"
    cfg.write_text(
        f'[capgate]\ncapabilities = ["{caps}"]\ngrants = "grants.toml"\nagent = "ci"\n'
        f'ledger = "sqlite:///ledger.db"\n'
        f'[connectors.insurance]\nurl = "{rendered}"\nenvironment = "dev"\n'
        f'[connectors.insurance_code]\nurl = "{rendered}"\nenvironment = "dev"\n')
    return cfg


def seed(url: URL) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        apply_schema(engine)
        install_target(engine)
    finally:
        engine.dispose()


def everything(url: URL) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows in a stable order (the marker table is capgate's own)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            out: dict[str, list[tuple[Any, ...]]] = {}
            for table in sorted(sa.inspect(conn).get_table_names()):
                rows = conn.execute(sa.text(f"SELECT * FROM {table}")).fetchall()
                out[table] = sorted((tuple(r) for r in rows), key=repr)
            return out
    finally:
        engine.dispose()


def unchanged(before: dict[str, list[tuple[Any, ...]]],
              after: dict[str, list[tuple[Any, ...]]]) -> None:
    assert after.pop(MARKER_TABLE, []) == [], "a rehearsal left a landing marker behind"
    before.pop(MARKER_TABLE, None)
    assert after == before
    assert len(before) >= 7  # the example schema's tables really were compared


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main(["rehearse", "--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(params=engine_params("postgresql", "mariadb"))
def server_url(request: pytest.FixtureRequest) -> URL:
    fixture = {"postgresql": "pg_url", "mariadb": "mariadb_url"}[request.param]
    url: URL = request.getfixturevalue(fixture)
    return url


def test_every_example_passes_and_nothing_changes(
        server_url: URL, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed(server_url)
    cfg = write_config(tmp_path, server_url, CAPABILITIES)
    junit = tmp_path / "rehearse.xml"
    before = everything(server_url)

    rc, report = run(capsys, "--config", str(cfg), "--junit", str(junit))

    assert rc == 0, json.dumps([r for r in report["results"] if r["result"] != "passed"])
    results = report["results"]
    examples = [r for r in results if r["kind"] == "example"]
    assert examples and all(r["result"] == "passed" for r in examples)
    declared = sum(len(r["examples"]) for r in _rows() if not r.get("retired")
                   and r["effect_class"] != "ddl")
    assert len(examples) == declared
    skipped = {(r["operation_id"], r["version"]): r["notes"][0] for r in results
               if r["result"] == "skipped"}
    retired = {("policy.cancel", 1), ("policy.purge_orphan", 1), ("claim.register", 1),
               ("premium.list_overdue", 1), ("premium.move_due_date", 1)}
    assert set(skipped) == {("code.policy_overview", 1), ("code.premium_due_total", 1)} | retired
    assert "ddl row" in skipped[("code.policy_overview", 1)]
    assert "retired" in skipped[("policy.cancel", 1)]
    # the gated row was rehearsed without any approval
    purge = [r for r in examples if r["operation_id"] == "policy.purge_orphan"]
    assert [r["counts"] for r in purge] == [[2, 3, 2, 1, 1], [1]]
    # a leased row's counts are per executed sql step
    cancel = {r["name"]: r for r in examples if r["operation_id"] == "policy.cancel"}
    assert cancel["nothing_due_later"]["labels"] == ["step set_cancelled", "step record_reason"]

    unchanged(before, everything(server_url))

    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) \
        == (str(len(results)), "0", "0", str(2 + len(retired)))
    cases = root.findall("./testsuite/testcase")
    assert len(cases) == len(results)
    assert {c.get("classname") for c in cases} >= {"policy.add_note@1", "policy.cancel@2"}


def test_a_wrong_count_fails_naming_the_row_and_the_statement(
        server_url: URL, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed(server_url)
    caps = tmp_path / "caps"
    shutil.copytree(CAPABILITIES, caps)
    policies = caps / "policies.yaml"
    text = policies.read_text()
    # the row's own count (the executor rolls back at that statement) ...
    anchor = "VALUES (:policy_id, :author, :body)\n        expect_rows: 1\n"
    assert text.count(anchor) == 1
    text = text.replace(anchor, anchor.replace("expect_rows: 1", "expect_rows: 2"))
    # ... and an example's count (the call succeeds, the example disagrees)
    anchor = "input: {policy_id: 1, kind: liability, amount: 10000}\n        expect_rows: [1, 1]"
    assert text.count(anchor) == 1
    text = text.replace(anchor, anchor.replace("[1, 1]", "[1, 2]"))
    policies.write_text(text)
    cfg = write_config(tmp_path, server_url, caps)
    junit = tmp_path / "rehearse.xml"
    before = everything(server_url)

    rc, report = run(capsys, "--config", str(cfg), "--junit", str(junit))

    assert rc == 1 and report["ok"] is False
    failed = {(r["operation_id"], r["name"]): r for r in report["results"]
              if r["result"] == "failed"}
    assert set(failed) == {("policy.add_note", "note_on_active_policy"),
                           ("cover.add", "liability_on_home_policy")}
    note = failed[("policy.add_note", "note_on_active_policy")]["problems"]
    assert note == ["policy.add_note@1 example note_on_active_policy: expected applied_verified, "
                    "got rolled_back: statement 1 (insert_note) affected 1 row(s), the row "
                    "expects 2"]
    cover = failed[("cover.add", "liability_on_home_policy")]["problems"]
    assert cover == ["cover.add@1 example liability_on_home_policy: statement 2 "
                     "(raise_sum_insured): the example expects 2 row(s), got 1"]
    # the other example of the changed row still passes: it expected a rollback anyway
    assert all(r["result"] in ("passed", "skipped") for r in report["results"]
               if (r["operation_id"], r["name"]) not in failed)

    unchanged(before, everything(server_url))

    root = ET.parse(junit).getroot()
    assert root.get("failures") == "2"
    failures = {c.get("classname"): c.find("failure") for c in root.iter("testcase")
                if c.find("failure") is not None}
    assert set(failures) == {"policy.add_note@1", "cover.add@1"}
    element = failures["policy.add_note@1"]
    assert element is not None and "insert_note" in (element.get("message") or "")
    assert element.get("type") == "count"


@pytest.mark.parametrize("engine", engine_params("sqlite", "postgresql"))
def test_rows_without_examples_get_a_zero_row_probe(
        engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        request: pytest.FixtureRequest) -> None:
    url: URL = request.getfixturevalue("sqlite_url" if engine == "sqlite" else "pg_url")
    seed(url)
    caps = tmp_path / "caps"
    shutil.copytree(CAPABILITIES, caps)
    (caps / "probe.yaml").write_text(PROBE_ROWS)
    cfg = write_config(tmp_path, url, caps)
    before = everything(url)

    rc, report = run(capsys, "--config", str(cfg), "--connector", "insurance",
                     "--operation", "policy.rename_holder",
                     "--operation", "policy.rename_holder_typo", "--operation", "policy.get")

    assert rc == 1
    by_op = {r["operation_id"]: r for r in report["results"]}
    assert set(by_op) == {"policy.rename_holder", "policy.rename_holder_typo", "policy.get"}
    good = by_op["policy.rename_holder"]
    assert (good["kind"], good["result"]) == ("probe", "passed")
    # NULL inputs match nothing; the INSERT of literal values meets NOT NULL instead
    assert list(zip(good["labels"], good["counts"], strict=True)) == [
        ("statement 1 (rename)", 0), ("verify renamed", 1)]
    assert any(n.startswith("statement 2 (note): a constraint refused NULL inputs")
               for n in good["notes"])
    bad = by_op["policy.rename_holder_typo"]
    assert (bad["kind"], bad["result"]) == ("probe", "failed")
    assert bad["problems"][0].startswith(
        "policy.rename_holder_typo@1 zero-row probe: statement 1 (rename): ")
    assert "holdr" in bad["problems"][0]
    assert all(r["result"] == "passed" for r in report["results"]
               if r["operation_id"] == "policy.get")
    unchanged(before, everything(url))


def test_refusals_before_anything_runs(
        sqlite_url: URL, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed(sqlite_url)
    cfg = write_config(tmp_path, sqlite_url, CAPABILITIES)
    capsys.readouterr()
    assert main(["rehearse", "--config", str(cfg), "--as", "reader"]) == 1
    assert "holds no write grant" in capsys.readouterr().err
    assert main(["rehearse", "--config", str(cfg), "--connector", "nowhere"]) == 2
    assert "not configured" in capsys.readouterr().err
    assert main(["rehearse", "--config", str(cfg), "--operation", "policy.nope"]) == 1
    assert "CG140" in capsys.readouterr().err
    # only ddl rows on this connector: nothing runs, and that is not a success
    assert main(["rehearse", "--config", str(cfg), "--connector", "insurance_code"]) == 1
    assert "FAILED (nothing was rehearsed): 0 passed" in capsys.readouterr().out


def _rows() -> list[dict[str, Any]]:
    from capgate.registry.loader import load_registry

    return [r.to_dict() for r in load_registry([CAPABILITIES], check_lock=False).rows()]
