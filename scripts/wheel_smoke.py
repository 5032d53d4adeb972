"""What a new user does after ``pip install capgate``, run against an installed capgate.

Run it with the Python of the environment the wheel was installed into, from
outside the checkout (``.ci/run`` and ``tests/test_wheel.py`` do)::

    /tmp/venv/bin/python scripts/wheel_smoke.py WORKDIR

In WORKDIR (created, must be new) it runs, each as a new process of the
installed ``capgate`` command:

1. ``capgate --version`` and ``capgate --help``;
2. a command that needs a configuration, in a folder without one: refused
   with CG903, and nothing created;
3. ``capgate demo`` in an empty folder, and ``capgate demo --keep DIR``;
4. ``capgate init proj``, then in proj with no edits: ``validate``,
   ``doctor``, a read, a gated write refused, approved by another person and
   applied, ``cases``, ``ledger show`` (text, JSON and HTML);
5. ``capgate mcp`` through a real MCP client (the ``mcp`` SDK's stdio
   client): ``tools/list``, and a ``tools/call`` of a read.

It checks that ``capgate`` is imported from that environment, not from a
checkout.  Exit 0 when every step passed; the first failure is printed with
the command's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
CAPGATE = str(BIN / "capgate")
ENV: dict[str, str] = {}


class Failed(Exception):
    pass


def run(args: list[str], cwd: Path, *, code: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([CAPGATE, *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=300, check=False)
    shown = " ".join(args)
    print(f"$ capgate {shown}  -> exit {proc.returncode}")
    if proc.returncode != code:
        raise Failed(f"`capgate {shown}` in {cwd} exited {proc.returncode}, expected {code}\n"
                     f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


def smoke(work: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import capgate, capgate.executor.dialects; "
                            "print(capgate.__file__)"], cwd=work, capture_output=True,
                           text=True, check=False)
    check(probe.returncode == 0, f"capgate does not import: {probe.stderr}")
    # one import name: nothing generic beside capgate in site-packages
    for generic in ("registry", "executor", "ddl"):
        bare = subprocess.run([sys.executable, "-c", f"import {generic}"], cwd=work,
                              capture_output=True, text=True, check=False)
        check(bare.returncode != 0, f"the wheel installed a top-level `{generic}` package")
    where = Path(probe.stdout.strip()).resolve()
    check(Path(sys.prefix).resolve() in where.parents,
          f"capgate was imported from {where}, not from the environment {sys.prefix}")

    version = run(["--version"], work)
    check(version.stdout.startswith("capgate "), f"--version said {version.stdout!r}")
    helped = run(["--help"], work)
    check("init" in helped.stdout and "doctor" in helped.stdout, "--help lists no init/doctor")

    bare = work / "no-config"
    bare.mkdir()
    refused = run(["cases"], bare, code=2)
    check("CG903" in refused.stderr, f"cases without a configuration said {refused.stderr!r}")
    check(not any(bare.iterdir()), f"cases without a configuration created "
                                   f"{[p.name for p in bare.iterdir()]}")

    empty = work / "empty"
    empty.mkdir()
    demo = run(["demo"], empty)
    check("demo finished" in demo.stdout and "applied_verified" in demo.stdout,
          f"the demo did not finish: {demo.stdout[-500:]}")
    kept = work / "kept"
    run(["demo", "--keep", str(kept)], empty)
    check((kept / "capgate.toml").is_file() and (kept / ".capgate" / "ledger.db").is_file(),
          "demo --keep left no sandbox")
    shown = run(["ledger", "show", "TICKET-4711"], kept)
    check("applied_verified" in shown.stdout, "the kept ledger does not show the demo's case")

    run(["init", "proj"], work)
    proj = work / "proj"
    run(["validate"], proj)
    run(["doctor"], proj)
    read = run(["call", "policy.get", "--input", '{"policy_id": 1}', "--case", "T-1",
                "--json"], proj)
    check(json.loads(read.stdout)["status"] == "ok", f"the read said {read.stdout}")
    gated = run(["call", "policy.purge_orphan", "--input", '{"policy_id": 9}', "--case", "T-2",
                 "--json"], proj, code=4)
    plan_hash = json.loads(gated.stdout)["details"]["plan_hash"]
    run(["approve", plan_hash, "--by", "bob", "--role", "dba", "--key", "keys/bob.key"], proj)
    applied = run(["call", "policy.purge_orphan", "--input", '{"policy_id": 9}', "--case",
                   "T-2", "--json"], proj)
    check(json.loads(applied.stdout)["status"] == "applied_verified",
          f"the approved write said {applied.stdout}")
    cases = run(["cases"], proj)
    check("T-2" in cases.stdout and "applied_verified" in cases.stdout,
          f"cases said {cases.stdout}")
    run(["ledger", "show", "T-2", "--json"], proj)
    run(["ledger", "show", "T-2", "--html", str(proj / "T-2.html")], proj)
    check("<html" in (proj / "T-2.html").read_text("utf-8"), "no HTML view written")

    tools, answer = _mcp(proj)
    for name in ("policy.get", "policy.add_note", "policy.purge_orphan"):
        check(name in tools, f"tools/list has no {name}: {sorted(tools)}")
    check(answer.get("status") == "ok", f"tools/call policy.get answered {answer}")
    print(f"MCP: {len(tools)} tools listed; policy.get answered {answer['status']}")


def _mcp(proj: Path) -> tuple[list[str], dict[str, Any]]:
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client

    result: dict[str, Any] = {}

    async def main() -> None:
        params = StdioServerParameters(command=CAPGATE, args=["mcp"], cwd=str(proj), env=ENV)
        with (proj / "mcp.err").open("w") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                listed = await session.list_tools()
                result["tools"] = [t.name for t in listed.tools]
                called = await session.call_tool("policy.get", {"policy_id": 1})
                result["answer"] = dict(called.structured_content or {})

    anyio.run(main)
    return list(result["tools"]), dict(result["answer"])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    work = Path(argv[0]).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ENV.update({k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")})
    ENV["CAPGATE_CACHE_DIR"] = str(work / ".cache")
    try:
        smoke(work)
    except Failed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print("wheel smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
