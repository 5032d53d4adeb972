"""Child processes for the crash tests: real processes that die at real boundaries.

Two ways to run it:

``python -m tests.crash_child SPEC_JSON``
    Run one call and print its outcome (or refusal) as JSON (``"resume": true``:
    resume the case instead, so a crash lands inside resume's retry).  With
    ``"crash_at"`` the executor's own test hook (``CAPGATE_CRASH_AT``) kills
    the process with SIGKILL at that boundary; with ``"stop_at"`` the process
    stops itself with SIGSTOP there instead -- a hung executor whose socket
    and transaction stay open until someone sends SIGCONT or SIGKILL.

``python -m tests.crash_child --serve``
    A zygote: imports everything and loads the registry once, then forks one
    child per request read from stdin (one JSON object a line) and answers
    with how the child ended.  Forking from a warm process makes a child cost
    milliseconds instead of an interpreter start, which is what lets the soak
    run hundreds of real SIGKILLs in a minute.  The zygote never opens a
    database connection itself, so no socket is shared with a child.

:class:`Zygote` is the tests' side of the protocol.

``python -m tests.crash_child --table FILE`` prints the crash matrix recorded
by ``tests/test_crash_matrix.py`` (``CAPGATE_CRASH_MATRIX_OUT=FILE``) as Markdown.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _install_stop(stop_at: str | None) -> None:
    """Make the executor's boundary hook stop (SIGSTOP) this process at ``stop_at``."""
    if not stop_at:
        return
    import capgate.executor.context as context

    original = context.crash_point

    def hook(name: str) -> None:
        if name == stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        original(name)

    context.crash_point = hook


def _install_idle_grace(seconds: float | None) -> None:
    """Give a stopped child's idle transaction ``seconds`` before the server ends it.

    The executor keeps the server's idle-in-transaction timeout short (0.75 s on
    PostgreSQL, 1 s on MariaDB), so a stopped session is ended by the server soon
    after it stops.  A test that must see resume itself end the session (not the
    server racing it on a loaded machine) asks for a longer grace; the operation's
    own timeout still bounds it.
    """
    if not seconds:
        return
    from capgate.executor.dialects import dialect_classes

    for cls in dialect_classes():
        cls.idle_grace_seconds = float(seconds)


def _install_nth_crash(point: str | None, nth: int) -> None:
    """Die (SIGKILL) at the ``nth`` time the executor reaches boundary ``point``."""
    if not point:
        return
    import capgate.executor.context as context

    seen = {"n": 0}

    def hook(name: str) -> None:
        if name == point:
            seen["n"] += 1
            if seen["n"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    context.crash_point = hook


def run(spec: Mapping[str, Any]) -> int:
    """Run the call ``spec`` describes; write its outcome as JSON; return an exit code."""
    from capgate.registry.errors import CapgateError
    from tests.fix_capgate import make_executor

    nth = int(spec.get("crash_nth") or 1)
    if spec.get("crash_at") and nth == 1:
        os.environ["CAPGATE_CRASH_AT"] = str(spec["crash_at"])
    else:
        os.environ.pop("CAPGATE_CRASH_AT", None)
        _install_nth_crash(spec.get("crash_at"), nth)  # (issue 16: a simulation's 2nd commit)
    _install_stop(spec.get("stop_at"))
    _install_idle_grace(spec.get("idle_grace_seconds"))
    executor = make_executor(spec["target"], spec["ledger"], schema=False)
    if spec.get("capabilities"):  # extra capability files (e.g. a never_retry row)
        from capgate.executor.call import Executor
        from capgate.registry.loader import load_registry

        executor = Executor(load_registry(spec["capabilities"], check_lock=False),
                            executor.connectors, executor.ledger, executor.grants)
    try:
        if spec.get("simulate"):  # issue 16: the whole simulation cycle, killed inside it
            from capgate.executor.simulation.cycle import simulate
            from tests.sim_support import SIM_GRANTS

            executor.grants = SIM_GRANTS
            simulated = simulate(executor, spec["operation"], spec["inputs"],
                                 case=spec["case"], who=spec.get("who", "agent"))
            result: dict[str, Any] = simulated.to_dict()
            code = simulated.exit_code
        elif spec.get("resume"):  # resume the case instead: a crash inside resume's retry
            from capgate.executor.recovery.resume import resume

            report = resume(executor, spec["case"])
            result = report.to_dict()
            code = report.exit_code
        else:
            outcome = executor.call(spec["operation"], spec["inputs"], case=spec["case"],
                                    who=spec.get("who", "agent"), key=spec.get("key"))
            result = outcome.to_dict()
            code = outcome.exit_code
    except CapgateError as exc:
        result = {"status": "failed", **exc.to_dict()}
        code = exc.exit_code
    finally:
        executor.connectors.dispose()
        executor.ledger.close()
    text = json.dumps(result, default=str)
    if spec.get("out"):
        Path(spec["out"]).write_text(text, "utf-8")
    else:
        print(text)
    return code


def _describe(pid: int, status: int) -> dict[str, Any]:
    if os.WIFSTOPPED(status):
        return {"pid": pid, "state": "stopped", "signal": os.WSTOPSIG(status), "code": None}
    if os.WIFSIGNALED(status):
        return {"pid": pid, "state": "signaled", "signal": os.WTERMSIG(status), "code": None}
    return {"pid": pid, "state": "exited", "signal": None, "code": os.WEXITSTATUS(status)}


def serve() -> None:
    """The zygote loop (see the module docstring)."""
    import capgate.executor.recovery.resume  # noqa: F401  (warm the imports the children need)
    from tests.fix_capgate import registry

    registry()
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        cmd = request["cmd"]
        if cmd == "quit":
            break
        if cmd == "run":
            pid = os.fork()
            if pid == 0:  # the child: never returns into the loop
                code = 70
                try:
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, 1)
                    code = run(request["spec"])
                except BaseException as exc:  # report, then die with a distinct code
                    print(f"crash_child: {type(exc).__name__}: {exc}", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
                finally:
                    os._exit(code)
        else:
            pid = int(request["pid"])
            os.kill(pid, signal.SIGCONT if cmd == "cont" else signal.SIGKILL)
        _, status = os.waitpid(pid, os.WUNTRACED)
        out.write(json.dumps(_describe(pid, status)) + "\n")
        out.flush()


@dataclass(frozen=True)
class Ended:
    """How a child ended (or stopped), and the outcome it wrote, if it got that far."""

    pid: int
    state: str
    signal: int | None
    code: int | None
    outcome: dict[str, Any] | None

    @property
    def killed(self) -> bool:
        return self.state == "signaled" and self.signal == signal.SIGKILL

    @property
    def stopped(self) -> bool:
        return self.state == "stopped"


class Zygote:
    """The tests' handle on a ``--serve`` process."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("CAPGATE_CRASH_AT", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.crash_child", "--serve"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._out: dict[int, str | None] = {}

    def _ask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            raise TimeoutError(f"the crash child did not answer {request.get('cmd')!r} "
                               f"within {self.timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died (exit {self.proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _ended(self, answer: Mapping[str, Any]) -> Ended:
        pid = int(answer["pid"])
        outcome = None
        path = self._out.get(pid)
        if path and answer["state"] != "stopped" and Path(path).exists():
            outcome = json.loads(Path(path).read_text("utf-8"))
        return Ended(pid, str(answer["state"]), answer.get("signal"), answer.get("code"),
                     outcome)

    def run(self, spec: Mapping[str, Any]) -> Ended:
        """Fork a child for ``spec``; return when it exits, is killed, or stops itself."""
        answer = self._ask({"cmd": "run", "spec": dict(spec)})
        self._out[int(answer["pid"])] = spec.get("out")
        return self._ended(answer)

    def cont(self, pid: int) -> Ended:
        """SIGCONT a stopped child; return when it ends (or stops again)."""
        return self._ended(self._ask({"cmd": "cont", "pid": pid}))

    def kill(self, pid: int) -> Ended:
        """SIGKILL a (stopped) child and reap it."""
        return self._ended(self._ask({"cmd": "kill", "pid": pid}))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def table(path: str) -> str:
    """The crash matrix (boundary x target -> classification, action) as Markdown."""
    rows = [json.loads(line) for line in Path(path).read_text("utf-8").splitlines() if line]
    targets = ["sqlite", "postgresql", "mariadb"]
    ops = sorted({r["operation"] for r in rows})
    points = ["after_prepared", "after_attempt_started", "before_commit", "after_commit",
              "after_observed"]
    out = []
    for op in ops:
        out.append(f"**{op}**\n")
        out.append("| killed (SIGKILL) | " + " | ".join(targets) + " |")
        out.append("|---|" + "---|" * len(targets))
        for point in points:
            cells = []
            for t in targets:
                hit = [r for r in rows if r["operation"] == op and r["point"] == point
                       and r["target"] == t]
                cells.append(hit[0]["cell"] if hit else "(not run)")
            out.append(f"| `{point}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        serve()
        return 0
    if argv[:1] == ["--table"]:
        print(table(argv[1]))
        return 0
    return run(json.loads(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
