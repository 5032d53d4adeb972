"""The README's first page, run as written: its install block and its quick start.

The README is the contract with a newcomer, so its commands are read from it, never
copied into a test where the two could drift::

    python scripts/readme_quickstart.py install-block README.md
        prints the ``sh`` block under "## Install" (what ``scripts/wheel-check`` runs
        verbatim in a fresh copy of the checkout)
    python scripts/readme_quickstart.py walk README.md WORKDIR
        runs every ``$ `` line of the "## Quick start" ``console`` block in WORKDIR
        with the ``capgate`` on PATH, and checks each answer against what the README
        shows under it

Only the standard library: it runs with any Python, the wheel's fresh environment
included.  ``tests/test_readme.py`` imports it.

How a line is checked: a command shown answering ``FAILED: CGnnn`` must exit non-zero
and print that code; one shown answering ``applied_verified`` or ``ok`` must say so;
every other command must exit 0.  ``PLAN_HASH`` stands for the plan hash the last
answer named, as a person copies it from the screen; ``cd DIR`` changes the folder the
next lines run in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

INSTALL = "## Install"
QUICK_START = "## Quick start"


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    start = text.index(f"\n{heading}\n") + 1
    level = len(heading) - len(heading.lstrip("#"))
    rest = text[start + len(heading):]
    end = re.search(rf"\n#{{1,{level}}} ", rest)
    return text[start:start + len(heading) + (end.start() if end else len(rest))]


def install_block(text: str) -> str:
    """The first ``sh`` block under "## Install"."""
    found = re.search(r"```sh\n(.*?)```", section(text, INSTALL), re.S)
    if found is None:
        raise ValueError("the README has no ```sh block under '## Install'")
    return found.group(1)


@dataclass
class Step:
    """One ``$ `` line of the quick start and what the README shows it answering."""

    command: str
    shown: list[str] = field(default_factory=list)

    @property
    def refused(self) -> str | None:
        """The code the README shows it refused with (``FAILED: CGnnn``), if any."""
        for line in self.shown:
            found = re.search(r"FAILED: (CG\d{3})", line)
            if found:
                return found.group(1)
        return None

    @property
    def says(self) -> list[str]:
        """Words the answer must contain: its status as the README shows it."""
        words = []
        for line in self.shown:
            for word in ("applied_verified", "approved sha256", "awaiting approval"):
                if word in line:
                    words.append(word)
            if line.startswith("ok:"):
                words.append("ok:")
        return words


def quickstart(text: str, heading: str = QUICK_START) -> list[Step]:
    """Every ``$ `` line of the ``console`` blocks under ``heading``, in order."""
    steps: list[Step] = []
    for block in re.findall(r"```console\n(.*?)```", section(text, heading), re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append(Step(line[2:].split("  #")[0].strip()))
            elif steps:
                steps[-1].shown.append(line)
    if not steps:
        raise ValueError("the README's quick start shows no `$ ` command")
    return steps


class Failed(Exception):
    pass


PLACEHOLDERS = {
    "PLAN_HASH": re.compile(r"(sha256:[0-9a-f]{64})"),
    "HOLD_ID": re.compile(r"\(hold ([0-9a-f]{32})\)"),
}
"""What a person copies from an answer into a later command: the first one an answer
names (a plan hash: the refusal's plan, the first of `approvals`, `plan show`'s)."""


def walk(text: str, workdir: Path, env: dict[str, str] | None = None,
         log: bool = True, heading: str = QUICK_START) -> dict[str, float]:
    """Run the ``$ `` lines under ``heading`` in ``workdir``; each step's seconds (Failed
    on an answer other than the one shown)."""
    env = dict(os.environ if env is None else env)
    cwd = workdir
    cwd.mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}
    took: dict[str, float] = {}
    for step in quickstart(text, heading):
        command = step.command
        for name in PLACEHOLDERS:
            if name in command:
                if name not in seen:
                    raise Failed(f"`{command}` needs {name} and no answer named one yet")
                command = command.replace(name, seen[name])
        if command.startswith("cd "):
            cwd = (cwd / command[3:].strip()).resolve()
            continue
        started = time.monotonic()
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300, check=False, stdin=subprocess.DEVNULL)
        took[command] = time.monotonic() - started
        said = proc.stdout + proc.stderr
        if log:
            print(f"$ {command}  -> exit {proc.returncode} ({took[command]:.1f} s)")
        wrong = None
        if step.refused is not None:
            if proc.returncode == 0 or step.refused not in said:
                wrong = f"the README shows it refused with {step.refused}"
        elif proc.returncode != 0:
            wrong = "the README shows it succeed"
        missing = [w for w in step.says if w not in said]
        if wrong is None and missing:
            wrong = f"the README shows {missing} in its answer"
        if wrong is not None:
            raise Failed(f"`{command}` in {cwd} exited {proc.returncode}; {wrong}\n"
                         f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        for name, pattern in PLACEHOLDERS.items():
            found = pattern.search(said)
            if found and "approved sha256" not in said:
                seen[name] = found.group(1)
    return took


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "install-block":
        print(install_block(Path(argv[1]).read_text("utf-8")), end="")
        return 0
    if len(argv) >= 3 and argv[0] == "walk":
        text = Path(argv[1]).read_text("utf-8")
        try:
            took = walk(text, Path(argv[2]))
        except Failed as failed:
            print(f"FAILED: {failed}", file=sys.stderr)
            return 1
        print(json.dumps({"steps": len(took), "seconds": round(sum(took.values()), 1)}))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
