"""Write the v1 ledger fixtures the migration test upgrades (issue 13).

Run once, with the code of ledger format v1 (commit fed1d66 and before), from
the repository root::

    .venv/bin/python tests/data/ledger_v1/make.py

It drives the real executor against a throw-away SQLite target and writes, with
the heads HMAC-signed under ``KEY``:

* ``ledger.db`` -- a SQLite ledger;
* ``postgresql.sql`` -- the same scenario written by a PostgreSQL ledger, as
  ``INSERT`` statements for the v1 tables (loaded into a fresh schema by the test);
* ``manifest.json`` -- what the scenario left: each case, its intents' statuses
  and outcomes, which cases are open.

The scenario: three applied notes in one case; a rolled-back note; an intent
killed after ``attempt_started`` (left open); an intent killed after COMMIT and
then resumed (``reconciled``); a gated purge planned, approved with a signed
approval and run.  It touches every v1 table (events, cases, idempotency, plans,
approvals and their proofs, claims, budget slots, meta).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
KEY = "v1-fixture-hmac-key"
PG_ADMIN = os.environ.get("CAPGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
TABLES = ("cg_meta", "cg_cases", "cg_events", "cg_idempotency", "cg_plans", "cg_approvals",
          "cg_approval_proofs", "cg_claims", "cg_budget_slots")


def scenario(target: str, ledger: str, work: Path) -> dict[str, Any]:
    """Run the calls; return the manifest."""
    sys.path.insert(0, str(ROOT))
    os.environ["CAPGATE_LEDGER_HMAC_KEY"] = KEY
    from capgate.executor.recovery.resume import resume
    from tests.fix_capgate import KEYS, make_executor

    ex = make_executor(target, ledger)
    try:
        for i in range(3):
            out = ex.call("policy.add_note", {"policy_id": 1 + i, "author": "jdoe",
                                              "body": f"v1 note {i}"}, case="V1-APPLIED",
                          who="agent")
            assert out.status == "applied_verified", out
        out = ex.call("policy.add_note", {"policy_id": 9, "author": "jdoe",
                                          "body": "on a void policy"}, case="V1-ROLLED",
                      who="agent")
        assert out.status == "rolled_back", out
        plan = ex.plan("policy.purge_orphan", {"policy_id": 9}, case="V1-GATED", who="agent")
        ex.approve(plan.plan_hash, by="bob", role="dba", key=KEYS["bob"])
        out = ex.call("policy.purge_orphan", {"policy_id": 9}, case="V1-GATED", who="agent",
                      plan_hash=plan.plan_hash)
        assert out.status == "applied_verified", out
        for case, point in (("V1-OPEN", "after_attempt_started"),
                            ("V1-RESUMED", "after_commit")):
            spec = {"target": target, "ledger": ledger, "operation": "policy.add_note",
                    "inputs": {"policy_id": 2 if case == "V1-OPEN" else 3, "author": "jdoe",
                               "body": f"crash {case}"},
                    "case": case, "who": "agent", "crash_at": point,
                    "out": str(work / f"{case}.json")}
            (work / f"{case}.spec.json").write_text(json.dumps(spec))
            child = subprocess.run(
                [sys.executable, "-c",
                 "import json, sys; from tests.crash_child import run; "
                 f"sys.exit(run(json.load(open({str(work / f'{case}.spec.json')!r}))))"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False,
                capture_output=True, text=True)
            out_file = work / f"{case}.json"
            written = out_file.read_text() if out_file.exists() else ""
            assert child.returncode < 0, \
                f"the child was not killed: {child.returncode} {child.stderr} {written}"
        report = resume(ex, "V1-RESUMED")
        assert report.resolved, report.to_dict()
        manifest: dict[str, Any] = {"hmac_key": KEY, "cases": {}}
        for summary in ex.ledger.cases():
            snap = ex.ledger.snapshot(summary.case_id) or {}
            manifest["cases"][summary.case_id] = {
                "open": summary.open,
                "head_seq": summary.head_seq,
                "intents": {i: {"status": s.get("status"), "outcome": s.get("outcome"),
                                "operation_id": s.get("operation_id")}
                            for i, s in (snap.get("intents") or {}).items()},
            }
        assert ex.ledger.verify().ok
        return manifest
    finally:
        ex.connectors.dispose()
        ex.ledger.close()


def dump_pg(schema_url: str) -> str:
    """The v1 tables of a PostgreSQL ledger as INSERT statements (schema-free names)."""
    import sqlalchemy as sa

    engine = sa.create_engine(schema_url)
    lines: list[str] = []
    with engine.connect() as conn:
        for table in TABLES:
            rows = conn.execute(sa.text(f"SELECT * FROM {table}")).mappings().all()
            for row in rows:
                cols = ", ".join(row.keys())
                vals = ", ".join(_literal(v) for v in row.values())
                lines.append(f"INSERT INTO {table} ({cols}) VALUES ({vals});")
    engine.dispose()
    return "\n".join(lines) + "\n"


def _literal(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


def main() -> None:
    import uuid

    import sqlalchemy as sa

    work = Path(tempfile.mkdtemp(prefix="capgate-v1-"))
    try:
        sqlite_ledger = HERE / "ledger.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{sqlite_ledger}{suffix}").unlink(missing_ok=True)
        manifest = scenario(f"sqlite:///{work / 'target.db'}", f"sqlite:///{sqlite_ledger}",
                            work)
        # fold the WAL into the file: the fixture is one self-contained file
        con = __import__("sqlite3").connect(sqlite_ledger)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.execute("PRAGMA journal_mode=DELETE")
        con.close()
        (HERE / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

        schema = f"cgv1_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(PG_ADMIN.replace("postgresql://", "postgresql+psycopg://"),
                                 isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        try:
            url = (PG_ADMIN.replace("postgresql://", "postgresql+psycopg://")
                   + f"?options=-csearch_path%3D{schema}")
            pg_manifest = scenario(f"sqlite:///{work / 'target-pg.db'}", url, work)
            assert set(pg_manifest["cases"]) == set(manifest["cases"]), pg_manifest
            (HERE / "postgresql.sql").write_text(dump_pg(url))
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
            admin.dispose()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(manifest, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
