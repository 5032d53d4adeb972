"""The README and docs/ run as they are written (STYLE: test the docs).

* The README is one page for a newcomer (at most 300 lines): what capgate is, the two
  commands, install, a quick start from ``capgate init`` to an approved gated write
  that lands, then links -- every one of which leads somewhere.
* Its quick start runs verbatim (``scripts/readme_quickstart.py``: each ``$`` line,
  each answer checked against the one shown), in a new folder, with no ``CAPGATE_*``
  variable -- as a person following it would.
* Its install block is what ``scripts/wheel-check`` (CI) runs in a fresh copy of the
  checkout; ``test_the_install_block_installs_capgate`` runs it here too.
* Every ``capgate`` command line shown in the README and docs/ parses.
* docs/cases.md's symptom walk-through runs verbatim on a project made by init.

Before, the README was a 1,550-line manual whose install line (``pip install
capgate``) could not work: capgate is not on the public index.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from capgate.cli import build_parser
from capgate.commands.project import init_project

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def walker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_quickstart",
                                                  ROOT / "scripts" / "readme_quickstart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("readme_quickstart", module)
    spec.loader.exec_module(module)
    return module


def person_env(tmp: Path) -> dict[str, str]:
    """A shell as a person has it after ``. .venv/bin/activate``: this environment's
    ``capgate`` first on PATH, no CAPGATE_* variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPGATE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["CAPGATE_CACHE_DIR"] = str(tmp / "cache")
    return env


# --- the page ----------------------------------------------------------------------------


def test_the_readme_is_one_page_for_a_newcomer() -> None:
    text = README.read_text("utf-8")
    assert len(text.splitlines()) <= 300
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:3] == ["Two commands", "Install", "Quick start"], headings
    assert headings[-1] == "Read on", headings
    assert "make demo" in text and "make test" in text
    assert "pip install capgate" not in text  # not on the public index


def _links(page: Path) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text("utf-8"))
            if "://" not in m]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_link_leads_somewhere(page: Path) -> None:
    broken = [link for link in _links(page) if not (page.parent / link).exists()]
    assert broken == [], broken


def test_the_docs_index_names_every_page() -> None:
    index = (ROOT / "docs" / "index.md").read_text("utf-8")
    missing = [p.name for p in DOCS if p.name != "index.md" and f"({p.name})" not in index]
    assert missing == []
    readme = README.read_text("utf-8")
    assert "(docs/index.md)" in readme


# --- every command line shown parses ------------------------------------------------------


def _code_blocks(text: str) -> list[list[str]]:
    """The lines of each shell-like fenced block (console, sh, text, bash or none): a fence
    is closed by the same fence, so a ``` inside a ~~~ block stays inside."""
    blocks: list[list[str]] = []
    fence: str | None = None
    keep = False
    for line in text.splitlines():
        if fence is None:
            m = re.match(r"^\s*(```|~~~)\s*(\w*)", line)
            if m:
                fence, keep = m.group(1), m.group(2) in ("console", "sh", "text", "bash", "")
                blocks.append([])
        elif line.strip().startswith(fence):
            fence = None
        elif keep:
            blocks[-1].append(line.strip())
    return blocks


def _shown_commands(page: Path) -> list[str]:
    """``capgate ...`` command lines of a page's code blocks (``$ `` prompts and sh
    blocks), one per ``&&``/``;``/``|`` segment, comments dropped."""
    found: list[str] = []
    for block in _code_blocks(page.read_text("utf-8")):
        prompted = any(raw.startswith("$ ") for raw in block)  # a session: the rest is output
        for raw in block:
            if prompted and not raw.startswith("$ "):
                continue
            line = raw[2:] if raw.startswith("$ ") else raw
            if "capgate " not in line or line.startswith(("FAILED", "#", " ")) \
                    or re.match(r"capgate [\w-]+: ", line):  # a log line it printed
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # a quoted sample spread over lines: not a command line
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";", "|"):
                    if command and (command[0] == "capgate"
                                    or command[0].endswith("/capgate")):
                        found.append(shlex.join(command))
                    command = []
                else:
                    command.append(word)
    return found


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_capgate_command_shown_parses(page: Path) -> None:
    parser = build_parser()
    bad = []
    for line in _shown_commands(page):
        words = shlex.split(line)[1:]
        if not words or words[0] in ("--version", "--help"):
            continue
        try:
            args = parser.parse_args(words)
        except SystemExit:
            bad.append(line)
            continue
        if not callable(getattr(args, "handler", None)):
            bad.append(line)
    assert bad == [], bad


# --- the quick start, as written ----------------------------------------------------------


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    """From `capgate init` to an approved gated write that landed, each line as the README
    shows it, each answer as the README shows it -- and then the MCP server it names."""
    walk = walker()
    started = time.monotonic()
    took = walk.walk(README.read_text("utf-8"), tmp_path / "home", person_env(tmp_path))
    seconds = time.monotonic() - started
    assert any("approve" in c for c in took) and sum(1 for c in took if " call " in c) >= 3
    print(f"the quick start took {seconds:.1f} s ({len(took)} commands)")
    project = tmp_path / "home" / "myproject"
    assert (project / "TICKET-2.html").exists()

    from tests.test_init import mcp_tools

    tools = mcp_tools(project, person_env(tmp_path), tmp_path / "mcp.err")
    assert {"policy.get", "policy.add_note", "policy.purge_orphan"} <= set(tools)
    assert "ready:" in (tmp_path / "mcp.err").read_text("utf-8")


def test_the_symptom_walk_through_runs_as_written(tmp_path: Path) -> None:
    walk = walker()
    text = (ROOT / "docs" / "cases.md").read_text("utf-8")
    heading = "### Trying it: a support desk's ticket"
    (row_file,) = re.findall(r"```yaml\n(format: 1.*?)```", walk.section(text, heading), re.S)
    init_project(tmp_path / "proj")
    (tmp_path / "proj" / "capabilities" / "support.yaml").write_text(row_file, "utf-8")
    walk.walk(text, tmp_path / "proj", person_env(tmp_path), heading=heading)


# --- install -----------------------------------------------------------------------------


def test_wheel_check_runs_the_readme_install_block() -> None:
    """CI's wheel step reads the install block from the README: the two cannot drift."""
    walk = walker()
    block = walk.install_block(README.read_text("utf-8"))
    assert "pip install ." in block and "capgate --version" in block
    script = (ROOT / "scripts" / "wheel-check").read_text("utf-8")
    assert "readme_quickstart.py\" install-block" in script


@pytest.mark.slow
def test_the_install_block_installs_capgate(tmp_path: Path) -> None:
    """The README's install block, run verbatim by bash in a fresh copy of the checkout
    (dependencies from the package index, as on a new machine), gives a capgate that
    runs the quick start."""
    if os.environ.get("CAPGATE_OFFLINE"):
        pytest.skip("CAPGATE_OFFLINE: no package index to install the dependencies from")
    walk = walker()
    block = walk.install_block(README.read_text("utf-8"))
    checkout = tmp_path / "capgate"
    shutil.copytree(ROOT, checkout, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CAPGATE_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT)))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^capgate \d", done.stdout, re.M), done.stdout
    bin_dir = checkout / ".venv" / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["CAPGATE_CACHE_DIR"] = str(tmp_path / "cache")
    walk.walk(README.read_text("utf-8"), tmp_path / "home", env)
