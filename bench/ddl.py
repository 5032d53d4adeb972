"""The DDL loop: capture + signature of a 50,000-line package, a 1,000-dependent sweep, sqitch.

Three measurements, each the median of ``--repeat`` runs after a warm-up:

1. **Capture and signature of a 50,000-line package source.**
   ``normalise + sign`` of the package body text (MariaDB's normalisation, the
   v1 block signature) -- the work capgate itself does -- and a full
   ``DdlLoop.capture`` (catalog read, normalise, sign, snapshot stored in a
   SQLite ledger) of a 50,000-line PL/pgSQL function on PostgreSQL.  With
   ``--mariadb`` the same package (spec + body, ``sql_mode=ORACLE``) is
   created on MariaDB and captured once: there the catalog read (``SHOW CREATE
   PACKAGE BODY``, which makes the server parse the whole package) dominates.
2. **A dependent sweep over 1,000 dependents on PostgreSQL**: one PL/pgSQL
   function ``base_rate(numeric)`` used by 500 views (found through
   ``pg_depend``) and 500 PL/pgSQL functions (found by ``plpgsql_check``'s
   dependency listing, since PL/pgSQL bodies are not in ``pg_depend``):
   ``ddl verify`` of the function (discovery + one re-check per dependent).
3. **Side by side with sqitch** (Debian package ``sqitch``, PostgreSQL engine,
   a throwaway project in a temp dir), the same function change on the same
   schema: ``sqitch deploy --verify`` (run the deploy script, then the verify
   script that calls the function) against capgate's gated loop -- plan
   (snapshot, dependents, caller search, prohibitions), approve, apply (lock,
   preflight, apply, verify with the 1,000-dependent sweep, commit), recorded
   in a SQLite ledger -- in process (``DdlService``) and as three ``capgate``
   processes (``ddl plan``, ``approve``, ``ddl apply``).  Each run is
   reverted untimed (``sqitch revert``, ``capgate ddl compensate``).

Results are printed and written to a dated ``## DDL loop against sqitch, DATE`` section at
the top of ``bench/RESULTS.md`` (other sections are kept).  The target (issue 28): plan +
apply of the change with 1,000 dependents within 2x ``sqitch deploy --verify``.

    .venv/bin/python bench/ddl.py [--dsn postgresql://postgres@127.0.0.1:5432/test]
        [--mariadb mysql://root@127.0.0.1:3306/] [--lines 50000] [--dependents 1000]
        [--repeat 3] [--no-results]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capgate.api import open as open_executor  # noqa: E402
from capgate.ddl.catalog import ObjectRef, adapter_for  # noqa: E402
from capgate.ddl.loop import DdlLoop  # noqa: E402
from capgate.ddl.service import DdlService  # noqa: E402
from capgate.ddl.signature import sign  # noqa: E402
from capgate.ddl.snapshots import SqlSnapshotStore  # noqa: E402
from capgate.executor.approvals import generate, load_signing_key  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## DDL loop against sqitch"
"""Each run writes a dated section (``## DDL loop against sqitch, YYYY-MM-DD``) at the top of
RESULTS.md, replacing only a section of the same date; older sections are kept."""

V1 = ("CREATE OR REPLACE FUNCTION base_rate(x numeric) RETURNS numeric LANGUAGE plpgsql AS $$\n"
      "BEGIN\n  RETURN x * 1.10;\nEND $$;\n")
V2 = V1.replace("1.10", "1.20")
ROW = """\
format: 1
connectors:
  bench_code:
    description: the bench schema's stored code
    dialects: [postgresql]
rows:
  - operation_id: code.base_rate
    version: 1
    connector: bench_code
    description: Replace base_rate(x), used by 1,000 views and functions.
    input:
      type: object
      additionalProperties: false
      required: [source]
      properties:
        source: {type: string, minLength: 1}
    target: {system: bench, object: base_rate}
    effect_class: ddl
    authorization: {kind: gate, approver_roles: [dba]}
    environments: [dev]
    timeout: {seconds: 600, lock_seconds: 10, on_timeout: unknown}
    recovery: reconcile_first
    ddl:
      objects:
        - {type: function, name: base_rate}
"""
GRANTS = """\
[principals.agent]
grants = [{ connector = "bench_code", environments = ["dev"], access = "write" }]

[principals.bob]
roles = ["dba"]
"""


def median_of(runs: int, fn: Callable[[], Any], *, warmup: bool = True) -> float:
    if warmup:
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


# --- 1. capture and signature of a 50,000-line package ------------------------------------------


def package_sources(lines: int) -> tuple[str, str]:
    """A MariaDB (sql_mode=ORACLE) package spec and a body of ``lines`` lines."""
    n = max(1, (lines - 2) // 6)
    spec = ["CREATE OR REPLACE PACKAGE big AS"]
    spec += [f"  FUNCTION f{i}(x INT) RETURN INT;" for i in range(n)] + ["END big;"]
    body = ["CREATE OR REPLACE PACKAGE BODY big AS"]
    for i in range(n):
        body += [f"  FUNCTION f{i}(x INT) RETURN INT AS", "  BEGIN", f"    -- step {i}",
                 f"    RETURN x + {i};", "  END;", ""]
    body += ["  -- padding"] * (lines - len(body) - 1) + ["END big;"]
    return "\n".join(spec) + "\n", "\n".join(body) + "\n"


def plpgsql_source(lines: int) -> str:
    out = ["CREATE OR REPLACE FUNCTION big_calc(x numeric) RETURNS numeric LANGUAGE plpgsql AS $$",
           "DECLARE", "  t numeric := x;", "BEGIN"]
    while len(out) < lines - 2:
        i = len(out)
        out += [f"  -- step {i}", f"  t := t + {i % 97};"]
    out += ["  RETURN t;", "END $$;"]
    return "\n".join(out) + "\n"


def bench_capture(pg: URL, maria: URL | None, lines: int, repeat: int,
                  tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"lines": lines}
    spec, body = package_sources(lines)
    adapter = adapter_for("mariadb")
    ref = ObjectRef("package_body", "big", "bench")
    sig = sign(adapter.normalise(ref, body))
    assert sig.lines == lines, sig.lines
    out["sign"] = median_of(repeat, lambda: sign(adapter.normalise(ref, body)))
    out["blocks"] = len(sig.blocks)

    store = SqlSnapshotStore(f"sqlite:///{tmp / 'capture-ledger.db'}")
    try:
        with _pg_schema(pg) as target:
            _exec(target, [plpgsql_source(lines)])
            with DdlLoop(target, store) as lp:
                t0 = time.perf_counter()
                first = lp.capture("function:big_calc")
                out["pg_first"] = time.perf_counter() - t0
                assert first.signature.lines >= lines, first.signature.lines
                out["pg_capture"] = median_of(repeat, lambda: lp.capture("function:big_calc"),
                                              warmup=False)
        if maria is not None:
            db = f"cg_bench_{uuid.uuid4().hex[:8]}"
            admin = sa.create_engine(maria, isolation_level="AUTOCOMMIT",
                                     poolclass=sa.pool.NullPool)
            with admin.connect() as conn:
                conn.exec_driver_sql(f"CREATE DATABASE `{db}`")
            try:
                target = maria.set(database=db)
                t0 = time.perf_counter()
                _exec(target, [spec, body], mariadb_mode="ORACLE")
                out["maria_create"] = time.perf_counter() - t0
                with DdlLoop(target, store) as lp:
                    t0 = time.perf_counter()
                    snap = lp.capture("package_body:big")
                    out["maria_capture"] = time.perf_counter() - t0
                    # the signature covers sql_mode and definer too (recipe v2): same text
                    assert sign(adapter.normalise(snap.object, snap.source)) == sig
            finally:
                with admin.connect() as conn:
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{db}`")
                admin.dispose()
    finally:
        store.dispose()
    return out


# --- 2 and 3. the 1,000-dependent sweep, and sqitch ---------------------------------------------


@contextlib.contextmanager
def _pg_schema(pg: URL) -> Iterator[URL]:
    schema = f"cg_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS plpgsql_check SCHEMA public")
    try:
        yield pg.set(query={"options": f"-csearch_path={schema}"})
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


def _exec(url: URL, statements: list[str], mariadb_mode: str | None = None) -> None:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as conn:
            if mariadb_mode:
                conn.exec_driver_sql(f"SET SESSION sql_mode = '{mariadb_mode}'")
            for stmt in statements:
                conn.exec_driver_sql(stmt.rstrip().rstrip(";") if mariadb_mode else stmt,
                                     execution_options={"no_parameters": True})
    finally:
        eng.dispose()


def dependents_sql(n: int) -> str:
    views = n // 2
    parts = [V1]
    parts += [f"CREATE VIEW dep_v{i} AS SELECT base_rate({i}::numeric) AS r;" for i in range(views)]
    parts += [f"CREATE FUNCTION dep_f{i}() RETURNS numeric LANGUAGE plpgsql AS $$\n"
              f"BEGIN\n  RETURN base_rate({i});\nEND $$;" for i in range(n - views)]
    return "\n".join(parts)


class Sqitch:
    """A throwaway sqitch project whose one change replaces ``schema.base_rate``."""

    def __init__(self, root: Path, pg: URL, schema: str) -> None:
        self.root = root
        self.registry = f"{schema}_sqitch"
        self.target = (f"db:pg://{pg.username or 'postgres'}@{pg.host or '127.0.0.1'}:"
                       f"{pg.port or 5432}/{pg.database}")
        self.env = {**os.environ, "SQITCH_FULLNAME": "capgate bench",
                    "SQITCH_EMAIL": "bench@example.invalid", "PGPASSWORD": pg.password or ""}
        self.run("init", "bench", "--engine", "pg")
        self.run("add", "base_rate_v2", "-n", "base_rate: rate 1.20")
        q = f'"{schema}".'
        (root / "deploy" / "base_rate_v2.sql").write_text(
            "BEGIN;\n" + V2.replace("FUNCTION base_rate", f"FUNCTION {q}base_rate") + "COMMIT;\n")
        (root / "revert" / "base_rate_v2.sql").write_text(
            "BEGIN;\n" + V1.replace("FUNCTION base_rate", f"FUNCTION {q}base_rate") + "COMMIT;\n")
        (root / "verify" / "base_rate_v2.sql").write_text(
            f"SELECT 1 / ({q}base_rate(100) = 120)::int;\n")

    def run(self, *argv: str) -> float:
        t0 = time.perf_counter()
        done = subprocess.run(["sqitch", *argv], cwd=self.root, env=self.env,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sqitch {' '.join(argv)} failed: {done.stdout}{done.stderr}")
        return time.perf_counter() - t0

    def deploy_verify(self) -> float:
        return self.run("deploy", "--verify", "--registry", self.registry, self.target)

    def revert(self) -> None:
        self.run("revert", "-y", "--registry", self.registry, self.target)

    def drop_registry(self, pg: URL) -> None:
        admin = sa.create_engine(pg, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{self.registry}" CASCADE')
        admin.dispose()


def bench_sweep(pg: URL, n: int, repeat: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"dependents": n}
    with _pg_schema(pg) as target:
        schema = str(target.query["options"]).split("=", 1)[1]
        t0 = time.perf_counter()
        _exec(target, [dependents_sql(n)])
        out["setup"] = time.perf_counter() - t0
        work = tmp / "sweep"
        work.mkdir()
        (work / "caps").mkdir()
        (work / "caps" / "bench.yaml").write_text(ROW)
        bob_key = work / "bob.key"  # the approver's own signing key
        (work / "grants.toml").write_text(
            GRANTS + f'approval_key = "{generate(bob_key, force=True)}"\n')
        (work / "v2.sql").write_text(V2)
        (work / "capgate.toml").write_text(textwrap.dedent(f"""\
            [capgate]
            capabilities = ["caps"]
            grants = "grants.toml"
            ledger = "sqlite:///ledger.db"

            [connectors.bench_code]
            url = {json.dumps(target.render_as_string(hide_password=False))}
            environment = "dev"
            """))
        with open_executor(work / "capgate.toml") as executor:
            svc = DdlService(executor)
            deps = svc.verify_object("bench_code", "function:base_rate")
            assert deps.passed and sum(c.name == "dependent" for c in deps.checks) == n
            out["verify"] = median_of(repeat, lambda: svc.verify_object(
                "bench_code", "function:base_rate"))

            def capgate_loop(case: str) -> tuple[float, float, float, str]:
                t0 = time.perf_counter()
                plan = svc.plan("code.base_rate", [V2], case=case, who="agent", fresh=True)
                t1 = time.perf_counter()
                executor.approve(plan.plan_hash, by="bob", role="dba",
                                 key=load_signing_key(bob_key))
                t2 = time.perf_counter()
                outcome, _ = svc.apply(plan.plan_hash, case=case, who="agent")
                t3 = time.perf_counter()
                assert outcome.status == "applied_verified", outcome.to_dict()
                return t3 - t0, t1 - t0, t3 - t2, outcome.intent_id

            runs = []
            for i in range(repeat + 1):  # the first run is the warm-up
                total, plan_t, apply_t, intent = capgate_loop(f"BENCH-{i}")
                svc.compensate(f"BENCH-{i}", intent, who="agent")  # untimed: back to v1
                if i:
                    runs.append((total, plan_t, apply_t))
            out["capgate"] = statistics.median(r[0] for r in runs)
            out["capgate_plan"] = statistics.median(r[1] for r in runs)
            out["capgate_apply"] = statistics.median(r[2] for r in runs)
            out["capgate_plan_apply"] = statistics.median(r[1] + r[2] for r in runs)

        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
        env.update(CAPGATE_CONFIG=str(work / "capgate.toml"), PYTHONPATH=str(ROOT))

        def cli(*argv: str) -> Any:
            done = subprocess.run([sys.executable, "-m", "capgate", *argv, "--json"], cwd=work,
                                  env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"capgate {' '.join(argv)}: {done.stdout}{done.stderr}")
            return json.loads(done.stdout)

        cli_times = []
        for i in range(repeat):
            case = f"CLI-{i}"
            t0 = time.perf_counter()
            plan = cli("ddl", "plan", "v2.sql", "--operation", "code.base_rate", "--case", case,
                       "--as", "agent", "--fresh")
            t1 = time.perf_counter()
            cli("approve", plan["plan_hash"], "--by", "bob", "--role", "dba", "--key",
                str(bob_key))
            t2 = time.perf_counter()
            applied = cli("ddl", "apply", plan["plan_hash"], "--case", case, "--as", "agent")
            t3 = time.perf_counter()
            cli_times.append((t3 - t0, (t1 - t0) + (t3 - t2)))
            assert applied["status"] == "applied_verified"
            cli("ddl", "compensate", applied["intent_id"], "--case", case, "--as", "agent")
        out["capgate_cli"] = statistics.median(t[0] for t in cli_times)
        out["capgate_cli_plan_apply"] = statistics.median(t[1] for t in cli_times)
        out["cli_startup"] = median_of(repeat, lambda: cli("ddl", "prohibitions"))

        (tmp / "sqitch").mkdir()
        sq = Sqitch(tmp / "sqitch", pg, schema)
        try:
            sq.deploy_verify()  # warm-up: creates sqitch's registry schema
            sq.revert()
            sq_times = []
            for _ in range(repeat):
                sq_times.append(sq.deploy_verify())
                sq.revert()
            out["sqitch"] = statistics.median(sq_times)
        finally:
            sq.drop_registry(pg)
    return out


# --- report -------------------------------------------------------------------------------------


Row = tuple[str, str, str]


def report(cap: dict[str, Any], sw: dict[str, Any], repeat: int) -> tuple[str, list[Row]]:
    lines = cap["lines"]
    n = sw["dependents"]
    sq = sw["sqitch"]
    rows: list[Row] = [
        (f"normalise + sign, {lines:,}-line package body ({cap['blocks']:,} blocks)",
         ms(cap["sign"]), "target < 200 ms"),
        (f"capture {lines:,}-line PL/pgSQL function (catalog read, sign, snapshot stored)",
         ms(cap["pg_capture"]), f"first capture (stores it) {ms(cap['pg_first'])}"),
    ]
    if "maria_capture" in cap:
        rows.append((f"capture {lines:,}-line MariaDB package body (SHOW CREATE PACKAGE BODY)",
                     ms(cap["maria_capture"]),
                     "the server parses the whole package to answer SHOW CREATE; one run"))
    rows += [
        (f"`ddl verify` of a function with {n:,} dependents ({n // 2} views, "
         f"{n - n // 2} PL/pgSQL functions)", ms(sw["verify"]),
         f"{sw['verify'] / n * 1000:.2f} ms per dependent"),
        (f"capgate `ddl plan` of the change, {n:,} dependents (in process)",
         ms(sw["capgate_plan"]), "target < 2 s"),
        (f"capgate `ddl apply` of the change, {n:,} dependents (in process)",
         ms(sw["capgate_apply"]), "target < 2 s"),
        ("capgate plan + apply (in process, SQLite ledger)", ms(sw["capgate_plan_apply"]),
         f"{sw['capgate_plan_apply'] / sq:.2f}x sqitch (target <= 2x)"),
        ("capgate plan + approve + apply (in process, SQLite ledger)", ms(sw["capgate"]),
         f"{sw['capgate'] / sq:.2f}x sqitch"),
        ("capgate `ddl plan` + `ddl apply` (2 processes)", ms(sw["capgate_cli_plan_apply"]),
         f"{sw['capgate_cli_plan_apply'] / sq:.2f}x sqitch (target <= 2x); one capgate "
         f"process starts in {ms(sw['cli_startup'])}"),
        ("capgate `ddl plan` + `approve` + `ddl apply` (3 processes)", ms(sw["capgate_cli"]),
         f"{sw['capgate_cli'] / sq:.2f}x sqitch"),
        ("sqitch `deploy --verify` of the same change", ms(sq), "1.0x"),
    ]
    width = max(len(r[0]) for r in rows)
    out = [f"DDL loop bench ({dt.date.today().isoformat()}, {platform.machine()}, "
           f"{os.cpu_count()} CPUs, median of {repeat})"]
    out += [f"  {a:<{width}}  {b:>12}  {c}" for a, b, c in rows]
    return "\n".join(out), rows


def write_results(rows: list[Row], repeat: int, args: argparse.Namespace) -> None:
    heading = f"{SECTION}, {dt.date.today().isoformat()}"
    body = [
        heading,
        "",
        f"`bench/ddl.py` ({platform.machine()}, {os.cpu_count()} CPUs; PostgreSQL "
        f"{_pg_version(args.dsn)} with plpgsql_check{', MariaDB' if args.mariadb else ''}; "
        f"sqitch {_sqitch_version()}; median of {repeat} runs after a warm-up; load average "
        f"{args.load:.1f} at the start -- the machine is shared, so read the ratios, which "
        "come from one run, rather than the absolute times).",
        "",
        "| measurement | time | note |",
        "|---|---:|---|",
    ]
    body += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    body += [
        "",
        "The same work on both sides: one function used by 500 views and 500 PL/pgSQL "
        "functions is replaced.  sqitch runs its deploy script and then its verify script "
        "(one call of the function).  capgate's plan parses the source (pglast), snapshots "
        "the function, finds every dependent transitively, checks each one now and -- with "
        "the new source tried in a rolled-back savepoint -- after the change, by compiling "
        "it (plpgsql_check) and running it (a row fetched from each view, each function "
        "without arguments called, contained in a read-only savepoint), searches the "
        "callers, checks the prohibitions and records the plan; the apply takes the session "
        "lock, re-reads the live signature, applies, checks every dependent again in the "
        "same transaction (compiled and run), commits, records the applied object as the "
        "next base and appends each boundary to the hash-chained ledger.  `approve` is a "
        "person's step sqitch has no counterpart for; it is shown apart.  The process "
        "figures are dominated by Python's start-up and the imports of the capgate CLI "
        "(SQLAlchemy alone is about a third of it), paid once per command.",
        "",
    ]
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    start = text.find(heading + "\n")
    if start >= 0:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + (text[nxt + 1:] if nxt >= 0 else "")
    title_end = text.find("\n") + 1 if text.startswith("# ") else 0
    new = text[:title_end] + "\n" + "\n".join(body) + "\n" + text[title_end:].lstrip("\n")
    RESULTS.write_text(new.rstrip("\n") + "\n", encoding="utf-8")


def _pg_version(dsn: str) -> str:
    eng = sa.create_engine(_pg_url(dsn), poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            return str(conn.exec_driver_sql("SHOW server_version").scalar()).split()[0]
    finally:
        eng.dispose()


def _sqitch_version() -> str:
    done = subprocess.run(["sqitch", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip().rsplit(" ", 1)[-1] if done.returncode == 0 else "?"


def _pg_url(dsn: str) -> URL:
    return sa.make_url(dsn).set(drivername="postgresql+psycopg")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test",
                    help="a PostgreSQL database with plpgsql_check available")
    ap.add_argument("--mariadb", default="mysql://root@127.0.0.1:3306/",
                    help="a MariaDB server for the package capture ('' to skip)")
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--dependents", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-results", action="store_true", help="do not touch bench/RESULTS.md")
    args = ap.parse_args()
    if shutil.which("sqitch") is None:
        print("sqitch is not installed (Debian package sqitch)", file=sys.stderr)
        return 2
    args.load = os.getloadavg()[0]
    pg = _pg_url(args.dsn)
    maria = sa.make_url(args.mariadb).set(drivername="mysql+pymysql") if args.mariadb else None
    tmp = Path(tempfile.mkdtemp(prefix="capgate-bench-ddl-"))
    try:
        cap = bench_capture(pg, maria, args.lines, args.repeat, tmp)
        sw = bench_sweep(pg, args.dependents, args.repeat, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text, rows = report(cap, sw, args.repeat)
    print(text)
    if not args.no_results:
        write_results(rows, args.repeat, args)
        print(f"written to {RESULTS.relative_to(ROOT)} ({SECTION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
