"""The first load test, on the defaults ``capgate init`` writes: many agents, few hot targets.

Usage::

    .venv/bin/python bench/load.py [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
        [--sessions 32] [--calls 10] [--targets 4] [--port 15610] [--prefix capgate_load]

What it does, as a new user would:

1. makes a database of its own on the server ``--dsn`` names, and there a project with
   ``capgate init proj --target URL --example-schema`` -- the configuration untouched;
2. starts ``capgate mcp --http 127.0.0.1:PORT`` (its start-up is timed to the ready
   line it prints on stderr);
3. opens ``--sessions`` MCP sessions at once (the SDK's streamable HTTP client, one
   bearer token each) and has each make ``--calls`` calls of ``policy.add_note`` on
   ``--targets`` hot policies, each call its own case (``_meta capgate/case``);
4. counts, from the answers and then from the database itself: how many applied, the
   latency of every call (p50, p95, max), the refusals by code, rollbacks (and whether
   any was a timeout of capgate's own making, such as the server ending a transaction
   left idle), and duplicates (a case with more than one note or landing marker).

The baseline, in the same run and on the same database: the same writes (insert the
note, read the policy, read the notes back) by the same number of threads through a
pool of ``session_budget`` psycopg connections, each write serialised on its policy
row with ``SELECT ... FOR UPDATE`` -- what a careful hand-written service would do.
Results are printed; ``bench/RESULTS.md`` records them by hand.

Targets (the issue): >= 95 % applied with ``capgate init``'s defaults, the rest refused
with a coded reason, 0 duplicates, no call rolled back by a timeout of capgate's own
making.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import anyio  # noqa: E402
import httpx2  # noqa: E402
import psycopg  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

CAPGATE = [sys.executable, "-m", "capgate"]
OWN_TIMEOUT = ("idle-in-transaction", "idle_in_transaction", "statement timeout",
               "lock timeout", "canceling statement")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- the project -------------------------------------------------------------------------


def make_database(dsn: str, name: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = psycopg.conninfo.conninfo_to_dict(dsn)
    base["dbname"] = name
    parts = {k: v for k, v in base.items() if v}
    user = parts.pop("user", "postgres")
    password = parts.pop("password", None)
    host = parts.pop("host", "127.0.0.1")
    port = parts.pop("port", "5432")
    auth = f"{user}:{password}@" if password else f"{user}@"
    return f"postgresql://{auth}{host}:{port}/{name}"


def drop_database(dsn: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def clean_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env["CAPGATE_CACHE_DIR"] = str(work / "cache")
    env["PYTHONPATH"] = str(ROOT)
    return env


def init_project(work: Path, url: str, env: dict[str, str]) -> Path:
    proc = subprocess.run([*CAPGATE, "init", "proj", "--target", url, "--example-schema"],
                          cwd=work, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"capgate init failed: {proc.stdout}{proc.stderr}")
    return work / "proj"


def change_settings(config: Path, changes: list[str]) -> None:
    """Set ``KEY = VALUE`` in every connector of ``config`` (replacing the key's line, or
    adding one under each ``[connectors.*]`` header)."""
    lines = config.read_text("utf-8").splitlines()
    for change in changes:
        key, _, value = change.partition("=")
        key, value = key.strip(), value.strip()
        hits = [n for n, line in enumerate(lines) if line.split("=")[0].strip() == key]
        if hits:
            for n in hits:
                lines[n] = f"{key} = {value}"
        else:
            lines = [out for line in lines for out in (
                [line, f"{key} = {value}"] if line.startswith("[connectors.") else [line])]
    config.write_text("\n".join(lines) + "\n", "utf-8")


class Server:
    """``capgate mcp --http`` in the project; started and timed to its ready line."""

    def __init__(self, proj: Path, port: int, tokens: dict[str, str], env: dict[str, str]):
        (proj / "tokens.json").write_text(json.dumps(tokens), "utf-8")
        self.errlog = proj / "mcp.err"
        started = time.perf_counter()
        with self.errlog.open("w") as err:
            self.proc = subprocess.Popen(
                [*CAPGATE, "mcp", "--http", f"127.0.0.1:{port}", "--tokens", "tokens.json"],
                cwd=proj, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=err)
        deadline = started + 300
        while not self._up(port):
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                raise SystemExit(f"capgate mcp did not start:\n{self.errlog.read_text()}")
            time.sleep(0.02)
        self.startup = time.perf_counter() - started
        self.url = f"http://127.0.0.1:{port}/mcp"

    def _up(self, port: int) -> bool:
        """The ready line (a capgate that prints one), else the port answering."""
        if "ready:" in self.errlog.read_text("utf-8"):
            return True
        if "serving streamable HTTP" not in self.errlog.read_text("utf-8"):
            return False
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- capgate through MCP ------------------------------------------------------------------


async def session_calls(url: str, token: str, session_no: int, calls: int, targets: int,
                        run: str, out: list[dict[str, Any]]) -> None:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                  timeout=120) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        for j in range(calls):
            policy = (session_no + j) % targets + 1
            case = f"{run}-{session_no:02d}-{j:02d}"
            started = time.perf_counter()
            res = await session.call_tool(
                "policy.add_note",
                {"policy_id": policy, "author": f"agent-{session_no}", "body": f"load {case}"},
                meta={"capgate/case": case})
            seconds = time.perf_counter() - started
            body = res.structured_content or {}
            error = body.get("error") or {}
            out.append({"case": case, "policy": policy, "seconds": seconds,
                        "status": body.get("status"), "code": error.get("code"),
                        "reason": body.get("reason"), "message": error.get("message")})


async def capgate_load(url: str, tokens: list[str], calls: int, targets: int, run: str
                       ) -> tuple[list[dict[str, Any]], float]:
    out: list[dict[str, Any]] = []
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for n, token in enumerate(tokens):
            tg.start_soon(session_calls, url, token, n, calls, targets, run, out)
    return out, time.perf_counter() - started


# --- the baseline ------------------------------------------------------------------------


def baseline(url: str, sessions: int, calls: int, targets: int, pool: int
             ) -> tuple[list[float], float]:
    """The same writes by ``sessions`` threads through ``pool`` connections, each serialised
    on its policy row (FOR UPDATE): insert, verify, read the notes back, commit."""
    dsn = url.replace("postgresql://", "postgresql://", 1)
    conns = [psycopg.connect(dsn) for _ in range(pool)]
    free = list(conns)
    lock = threading.Condition()
    times: list[float] = []

    def worker(n: int) -> None:
        for j in range(calls):
            policy = (n + j) % targets + 1
            started = time.perf_counter()
            with lock:
                while not free:
                    lock.wait()
                conn = free.pop()
            try:
                with conn.transaction():
                    conn.execute("SELECT 1 FROM policy WHERE policy_id = %s FOR UPDATE",
                                 (policy,))
                    conn.execute("INSERT INTO policy_note (policy_id, author, body) "
                                 "VALUES (%s, %s, %s)", (policy, f"raw-{n}", f"raw {n} {j}"))
                    conn.execute("SELECT count(*) FROM policy WHERE policy_id = %s "
                                 "AND status <> 'void'", (policy,)).fetchone()
                    conn.execute("SELECT author, body FROM policy_note WHERE policy_id = %s "
                                 "ORDER BY note_id", (policy,)).fetchall()
            finally:
                with lock:
                    free.append(conn)
                    lock.notify()
            times.append(time.perf_counter() - started)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    for conn in conns:
        conn.close()
    return times, wall


# --- what the database says -----------------------------------------------------------------


def audit(url: str, run: str) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        notes = conn.execute("SELECT body, count(*) FROM policy_note WHERE body LIKE %s "
                             "GROUP BY body", (f"load {run}-%",)).fetchall()
        markers = conn.execute("SELECT case_id, count(*) FROM capgate_landed "
                               "WHERE case_id LIKE %s GROUP BY case_id",
                               (f"{run}-%",)).fetchall()
    return {"notes": {str(b)[len("load "):]: int(n) for b, n in notes},
            "markers": {str(c): int(n) for c, n in markers}}


def report(results: list[dict[str, Any]], wall: float, db: dict[str, Any],
           raw: list[float], raw_wall: float, startup: float, budget: str) -> dict[str, Any]:
    total = len(results)
    applied = [r for r in results if r["status"] == "applied_verified"]
    refused = Counter(r["code"] or r["status"] for r in results
                      if r["status"] not in ("applied_verified", "rolled_back"))
    rolled = [r for r in results if r["status"] == "rolled_back"]
    own = [r for r in rolled
           if any(word in json.dumps(r["reason"] or {}).lower() for word in OWN_TIMEOUT)]
    duplicates = [c for c, n in db["notes"].items() if n > 1] + \
        [c for c, n in db["markers"].items() if n > 1]
    landed_not_applied = sorted(set(db["notes"]) - {r["case"] for r in applied})
    applied_not_landed = sorted({r["case"] for r in applied} - set(db["notes"]))
    secs = [r["seconds"] for r in results]
    ok_secs = [r["seconds"] for r in applied]
    summary = {
        "calls": total, "applied": len(applied),
        "applied_pct": round(100.0 * len(applied) / total, 1) if total else 0.0,
        "refused_by_code": dict(refused), "rolled_back": len(rolled),
        "rolled_back_by_own_timeout": len(own), "duplicates": len(duplicates),
        "landed_but_not_reported_applied": len(landed_not_applied),
        "reported_applied_but_absent": len(applied_not_landed),
        "p50_s": round(pct(secs, 0.5), 3), "p95_s": round(pct(secs, 0.95), 3),
        "max_s": round(max(secs), 3) if secs else None,
        "applied_p50_s": round(pct(ok_secs, 0.5), 3),
        "wall_s": round(wall, 2), "calls_per_s": round(total / wall, 1) if wall else None,
        "baseline_p50_s": round(pct(raw, 0.5), 4), "baseline_p95_s": round(pct(raw, 0.95), 4),
        "baseline_wall_s": round(raw_wall, 2),
        "p50_ratio": round(pct(secs, 0.5) / pct(raw, 0.5), 1) if raw else None,
        "wall_ratio": round(wall / raw_wall, 1) if raw_wall else None,
        "mcp_startup_s": round(startup, 2), "config": budget,
    }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("CAPGATE_TEST_PG_DSN",
                                                    "postgresql://postgres@127.0.0.1:5432/postgres"),
                    help="a PostgreSQL server where a database may be created")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--targets", type=int, default=4)
    ap.add_argument("--port", type=int, default=15610)
    ap.add_argument("--prefix", default="capgate_load",
                    help="the created database's name starts with this")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change one connector setting of init's configuration (repeat), "
                         "e.g. to compare: --set claim_wait_seconds=0")
    ap.add_argument("--keep", action="store_true", help="keep the project and the database")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    name = f"{args.prefix}_{uuid.uuid4().hex[:8]}"
    url = make_database(args.dsn, name)
    work = Path(tempfile.mkdtemp(prefix="capgate-load-"))
    server: Server | None = None
    try:
        env = clean_env(work)
        proj = init_project(work, url, env)
        if args.set:
            change_settings(proj / "capgate.toml", args.set)
        config = (proj / "capgate.toml").read_text("utf-8")
        budget = "; ".join(dict.fromkeys(
            line.split("#")[0].strip() for line in config.splitlines()
            if line.split("=")[0].strip() in ("session_budget", "budget_wait_seconds",
                                              "claim_wait_seconds", "case_claim_seconds")))
        tokens = {secrets.token_hex(16): "claims-agent" for _ in range(args.sessions)}
        server = Server(proj, args.port, tokens, env)
        run = f"L{uuid.uuid4().hex[:6]}"
        results, wall = anyio.run(capgate_load, server.url, list(tokens), args.calls,
                                  args.targets, run)
        server.stop()
        db = audit(url, run)
        pool = int(next((line.split("=")[1].split("#")[0] for line in config.splitlines()
                         if line.startswith("session_budget")), "4"))
        raw, raw_wall = baseline(url, args.sessions, args.calls, args.targets, pool)
        summary = report(results, wall, db, raw, raw_wall, server.startup, budget)
        summary["load_average"] = os.getloadavg()[0]
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            for k, v in summary.items():
                print(f"{k:<34} {v}")
        odd = [r for r in results if r["status"] != "applied_verified"][:5]
        for r in odd:
            print(f"  e.g. {r['case']}: {r['status']} {r['code']} "
                  f"{(r['message'] or json.dumps(r['reason']))[:200]}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
        if args.keep:
            print(f"kept: {work} and database {name}", file=sys.stderr)
        else:
            drop_database(args.dsn, name)
            import shutil

            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
