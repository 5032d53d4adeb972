"""Reading a case: ``cases``, the ``ledger show`` timeline, resume's text, the HTML view.

The HTML view is rendered by a real headless Chromium (Debian's ``chromium``):
``--dump-dom`` gives the document the browser built, ``--screenshot`` the
pixels it drew, and the tests assert on both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from capgate.caseview import clip, compact, resume_lines
from capgate.executor.recovery.resume import IntentReport, ResumeReport
from tests.test_init import capgate, clean_env

LONG_BODY = ("Holder asked for a paper schedule and a second copy for the broker; "
             "reference Zeta-Quasimodo-ABCDEFGHIJKLMNOPQRSTUVWXYZ-0123456789 follows. "
             "<script>document.title='pwned'</script><img src=x onerror=alert(1)>")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The demo's kept sandbox, plus a case whose note body is long and hostile."""
    tmp = tmp_path_factory.mktemp("caseview")
    env = clean_env(tmp)
    capgate(["demo", "--keep", str(tmp / "sb")], tmp, env)
    note = {"policy_id": 2, "author": "claims-agent", "body": LONG_BODY}
    capgate(["call", "policy.add_note", "--input", json.dumps(note), "--case", "LONG-1"],
            tmp / "sb", env)
    return tmp / "sb", env


def test_cases_show_state_and_last_outcome(sandbox: tuple[Path, dict[str, str]]) -> None:
    folder, env = sandbox
    text = capgate(["cases"], folder, env).stdout
    line = next(x for x in text.splitlines() if x.startswith("TICKET-4711"))
    assert "closed" in line and "policy.purge_orphan@2 applied_verified" in line
    rows = json.loads(capgate(["cases", "--json"], folder, env).stdout)
    ticket = next(r for r in rows if r["case"] == "TICKET-4711")
    assert (ticket["state"], ticket["last_outcome"], ticket["intents"]) == (
        "closed", "applied_verified", 4)


def test_ledger_show_is_a_timeline_cut_between_words(sandbox: tuple[Path, dict[str, str]]
                                                     ) -> None:
    folder, env = sandbox
    text = capgate(["ledger", "show", "LONG-1"], folder, env).stdout
    assert "ACTOR" in text and "SUMMARY" in text
    prepared = next(x for x in text.splitlines() if " prepared " in x)
    assert "claims-agent" in prepared and "policy.add_note@1" in prepared
    note = {"policy_id": 2, "author": "claims-agent", "body": LONG_BODY}
    words = set(compact(note).split()) | set(compact(dict(sorted(note.items()))).split())
    summary = prepared.split("policy.add_note@1 inputs ", 1)[1]
    for word in summary.split():
        # every word shown is a whole word of the payload (or the ellipsis)
        assert word == "…" or any(word in w for w in words), word
    assert "Zeta-Quasimodo-ABCDEFGHIJKLMNOPQRSTUVWXYZ-0123456789" in summary or \
        summary.rstrip().endswith("…")
    full = json.loads(capgate(["ledger", "show", "LONG-1", "--json"], folder, env).stdout)
    bodies = [e["payload"]["request"]["inputs"]["body"] for e in full["events"]
              if e["kind"] == "prepared"]
    assert bodies == [LONG_BODY]
    assert {"seq", "at", "actor", "kind", "intent_id", "summary"} <= set(full["timeline"][0])


def test_clip_never_cuts_a_word() -> None:
    assert clip("alpha beta gamma", 11) == "alpha beta …"
    assert clip("alpha beta", 100) == "alpha beta"
    assert clip("sha256:0123456789abcdef rest", 10) == "sha256:0123456789abcdef …"


def test_resume_text_has_json_values_never_python_reprs() -> None:
    evidence = {"rule": "landed probe says absent", "marker": "absent",
                "probe": {"sql": "SELECT 1", "rows": 0, "ok": True},
                "session": {"connection_id": 41, "alive": False},
                "unreachable": {"connector": "insurance", "error": "timeout"}}
    intent = IntentReport("C-1", "a" * 32, "policy.add_note", 1, "attempt_started", 1,
                          "not_applied", evidence, "retried", outcome="applied_verified",
                          resolved=True)
    report = ResumeReport(("C-1",), (intent,))
    text = "\n".join(resume_lines(report.to_dict()))
    assert "{'" not in text and "True" not in text and "False" not in text
    assert '"rows": 0' in text and '"alive": false' in text
    assert "ok: every intent resolved" in text


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is part of CI (.ci/run installs it)")
        pytest.skip("no chromium here (apt-get install chromium)")
    return found


def _browser(page: Path, profile: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--window-size=1400,1600", *mode, page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)


def _pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB(A) non-interlaced PNG: (width, height, rows of pixels)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, data, width, height, channels = 8, b"", 0, 0, 4
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind, body = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            data += body
        pos += 12 + length
    raw = zlib.decompress(data)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        filt = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if filt == 1:
                line[i] = (line[i] + a) & 255
            elif filt == 2:
                line[i] = (line[i] + b) & 255
            elif filt == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if channels == 3 else bytes(
            v for j in range(0, stride, 4) for v in line[j:j + 3]))
        prev = line
    return width, height, rows


def test_the_html_view_in_a_real_browser(sandbox: tuple[Path, dict[str, str]],
                                         tmp_path: Path) -> None:
    folder, env = sandbox
    page = tmp_path / "case.html"
    capgate(["ledger", "show", "TICKET-4711", "--html", str(page)], folder, env)
    source = page.read_text("utf-8")
    assert "<script" not in source and "http://" not in source and "https://" not in source

    dom = _browser(page, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert '<h1>Case <span class="mono" id="case-id">TICKET-4711</span></h1>' in html
    assert '<b id="case-state">closed</b>' in html and 'id="chain">verified<' in html
    # the timeline: a lane per intent, an event mark per event, the approval as a diamond
    assert html.count('class="lane"') == 5
    # (a collapsed call's first attempt is recorded with its intent: no attempt_started;
    # the demo closes the case at the end: case_closed, issue 17)
    assert html.count('class="event ') == 10
    assert 'class="event approval"' in html
    assert html.count('<rect class="attempt bad"') == 1
    # approvals, evidence, reconciliation
    section = html[html.index('id="approvals"'):html.index('id="evidence"')]
    assert "<td>bob</td><td>dba</td>" in section
    evidence = html[html.index('id="evidence"'):html.index('id="reconciliation"')]
    assert 'why: verify policy_not_void expected {"value": 1}, got {"value": 0}' in evidence
    assert "<td>claims-agent</td><td>Holder asked for a callback.</td>" in evidence

    shot = tmp_path / "case.png"
    drawn = _browser(page, tmp_path / "profile2", f"--screenshot={shot}")
    assert drawn.returncode == 0 and shot.exists(), drawn.stderr[-2000:]
    width, height, rows = _pixels(shot.read_bytes())
    assert (width, height) == (1400, 1600)
    colours = {bytes(r[i:i + 3]) for r in rows[:700] for i in range(0, len(r), 3)}
    assert bytes.fromhex("c62828") in colours  # the rolled-back marks and pill
    assert bytes.fromhex("2e7d32") in colours  # the applied ones
    assert bytes.fromhex("5b3cc4") in colours  # the approval diamond


def test_the_html_view_shows_resume_and_escapes_inputs(sandbox: tuple[Path, dict[str, str]],
                                                       tmp_path: Path) -> None:
    folder, env = sandbox
    crash = next(r["case"] for r in json.loads(capgate(["cases", "--json"], folder, env).stdout)
                 if r["case"].startswith("DEMO-CRASH"))
    page = tmp_path / "crash.html"
    capgate(["ledger", "show", crash, "--html", str(page)], folder, env)
    long_page = tmp_path / "long.html"
    capgate(["ledger", "show", "LONG-1", "--html", str(long_page)], folder, env)

    html = _browser(page, tmp_path / "p1", "--dump-dom").stdout
    decisions = html[html.index('id="reconciliation"'):html.index('id="ddl"')]
    assert "<td>resume</td><td>retrying</td>" in decisions
    assert "not_applied: marker absent" in decisions

    hostile = _browser(long_page, tmp_path / "p2", "--dump-dom").stdout
    assert "<title>capgate case LONG-1</title>" in hostile  # the injected script never ran
    assert "<script" not in hostile and "<img" not in hostile
    assert "&lt;script&gt;document.title" in hostile


DDL_SOURCE = """CREATE VIEW policy_overview AS
SELECT p.policy_id, p.holder, p.status, p.sum_insured,
       (SELECT COUNT(*) FROM cover c WHERE c.policy_id = p.policy_id) AS covers,
       (SELECT COUNT(*) FROM premium r WHERE r.policy_id = p.policy_id AND r.paid = 0)
         AS unpaid_instalments,
       p.annual_premium
FROM policy p
"""


def test_the_html_view_shows_ddl_signatures_before_and_after(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    capgate(["init", "proj"], tmp_path, env)
    proj = tmp_path / "proj"
    (proj / "new.sql").write_text(DDL_SOURCE, "utf-8")
    captured = capgate(["ddl", "capture", "view:policy_overview", "--connector",
                        "insurance_code", "--json"], proj, env)
    planned = json.loads(capgate(["ddl", "plan", "new.sql", "--operation",
                                  "code.policy_overview", "--case", "CHG-1", "--json"],
                                 proj, env).stdout)
    plan_hash = planned["plan_hash"]
    capgate(["approve", plan_hash, "--by", "bob", "--role", "dba", "--key", "keys/bob.key"],
            proj, env)
    capgate(["ddl", "apply", plan_hash, "--case", "CHG-1"], proj, env)
    before = json.loads(captured.stdout)
    before_sig = json.dumps(before)
    page = tmp_path / "chg.html"
    capgate(["ledger", "show", "CHG-1", "--html", str(page)], proj, env)
    html = _browser(page, tmp_path / "p", "--dump-dom").stdout
    table = html[html.index('id="ddl"'):html.index('id="events"')]
    assert "view:main.policy_overview" in table
    sigs = re.findall(r"v\d+:sha256:[0-9a-f]{64}", table)
    assert len(sigs) == 2 and sigs[0] != sigs[1]
    assert sigs[0] in before_sig  # before: the captured snapshot's signature
    assert "applied_verified" in table


def test_the_timeline_columns_hold_every_event_kind() -> None:
    """A long event kind (coordination_requested, simulation_escalated) keeps its column."""
    from capgate.caseview import Entry, timeline_text

    entries = [Entry(0, "2026-12-01T10:00:00Z", "agent", "prepared", "a" * 32, "one"),
               Entry(1, "2026-12-01T10:00:01Z", "bob", "coordination_requested", None, "two")]
    lines = timeline_text("C", entries).splitlines()
    starts = {line.index(" one") if " one" in line else line.index(" two")
              for line in lines[2:4]}
    assert len(starts) == 1, lines  # the summaries line up
    assert lines[1].index("INTENT") == lines[2].index("aaaaaaaa")


def test_the_html_view_counts_each_attempt_once(sandbox: tuple[Path, dict[str, str]],
                                                tmp_path: Path) -> None:
    """The crash intent ran twice (attempt 1 killed, attempt 2 by resume): the page says 2
    attempts, as the ledger does -- it once said 3, counting resume's `retrying` and the
    `attempt_started` it announces as two."""
    folder, env = sandbox
    crash = next(r["case"] for r in json.loads(capgate(["cases", "--json"], folder, env).stdout)
                 if r["case"].startswith("DEMO-CRASH"))
    shown = json.loads(capgate(["ledger", "show", crash, "--json"], folder, env).stdout)
    recorded: dict[str, set[int]] = {}
    for e in shown["events"]:
        state = e["payload"].get("state") or {}
        if e.get("intent_id") and "tx" in state:  # an attempt with its transaction
            recorded.setdefault(e["intent_id"], set()).add(state["attempt"])
    retried = next(i for i, n in recorded.items() if len(n) == 2)
    page = tmp_path / "crash.html"
    capgate(["ledger", "show", crash, "--html", str(page)], folder, env)
    html = page.read_text("utf-8")
    table = html[html.index('<section id="intents">'):]
    table = table[:table.index("</section>")]
    row = next(r for r in re.findall(r"<tr>(.*?)</tr>", table, re.S) if retried in r)
    cells = re.findall(r"<td>(.*?)</td>", row, re.S)
    assert cells[4] == "2", cells
