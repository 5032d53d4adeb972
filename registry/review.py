"""What a DBA reads: a row's review card, and a diff of two sets of rows.

The card lists what a reviewer must approve -- statements with their binds and
expected counts, effect class, shape, recovery, timeout, authorization,
environments.  The diff is Markdown fit for a pull-request comment: added,
changed (field by field) and retired rows.  ``OLD``/``NEW`` may be files,
directories or ``git:REV`` (the same paths as of a git revision).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from registry.checks import binds_of
from registry.errors import CapabilityPathError
from registry.loader import DEFAULT_PATH, SUFFIXES, validate_paths, validate_texts
from registry.model import ExpectRows, Row


def card(row: Row) -> str:
    """A plain-text review card for one row."""
    lines = [f"{row.ref}  [{row.effect_class}{'/' + row.shape if row.shape else ''}]"
             f"{'  RETIRED' if row.retired else ''}"]
    lines.append(f"  {row.description}")
    lines.append(f"  source:        {row.source_path}:{row.source_line}")
    lines.append(f"  connector:     {row.connector}")
    lines.append(f"  environments:  {', '.join(row.environments)}")
    auth = row.authorization
    auth_text = str(auth.kind)
    if auth.approver_roles:
        auth_text += f" (approvers: {', '.join(auth.approver_roles)}"
        auth_text += ", four eyes)" if auth.four_eyes else ")"
    lines.append(f"  authorization: {auth_text}")
    lines.append(f"  target:        {row.target.system}.{row.target.object}"
                 f" keys [{', '.join(row.target.keys)}]")
    if row.idempotency_key:
        lines.append(f"  idempotency:   {row.idempotency_key}")
    lines.append(f"  timeout:       {row.timeout.seconds:g}s, on timeout: {row.timeout.on_timeout}")
    lines.append(f"                 {row.timeout_meaning()}")
    lines.append(f"  recovery:      {row.recovery}")
    if row.max_rows:
        lines.append(f"  row cap:       {row.max_rows}")
    lines.append(f"  row hash:      {row.row_hash}")
    inputs = row.input.get("properties", {})
    required = set(row.input.get("required", ()))
    if inputs:
        lines.append("  inputs:")
        for name, spec in inputs.items():
            kind = spec.get("type", "any") if hasattr(spec, "get") else "any"
            lines.append(f"    {name}: {kind}{' (required)' if name in required else ''}")
    sections: list[tuple[str, list[tuple[str, str, str]]]] = [
        ("statements", [(s.name or f"#{i + 1}", s.sql, _count_note(s.expect_rows))
                        for i, s in enumerate(row.statements)]),
        ("steps", [(s.name, s.sql or s.check or f"function {s.function}", _step_note(s))
                   for s in row.steps]),
        ("verify (same session, before commit)",
         [(c.name, c.sql, f"expect {json.dumps(c.expect.to_dict())}") for c in row.verify]),
        ("compensation", [(s.name or f"#{i + 1}", s.sql, _count_note(s.expect_rows))
                          for i, s in enumerate(row.compensation)]),
        ("post-commit checks",
         [(c.name, c.sql, f"expect {json.dumps(c.expect.to_dict())}") for c in row.post_commit]),
    ]
    if row.replay:
        sections.append(("replay", [("replay", row.replay.sql, "")]))
    if row.landed_probe:
        probe = row.landed_probe
        probe_note = f"expect {json.dumps(probe.expect.to_dict())}"
        sections.append(("landed probe", [("probe", probe.sql, probe_note)]))
    for title, items in sections:
        if not items:
            continue
        lines.append(f"  {title}:")
        for name, sql, note in items:
            binds = ", ".join(f":{b}" for b in sorted(binds_of(sql))) or "none"
            lines.append(f"    {name}: {' '.join(sql.split())}")
            lines.append(f"        binds {binds}{'; ' + note if note else ''}")
    if row.ddl:
        lines.append("  ddl objects: " + ", ".join(f"{o.type} {o.name}" for o in row.ddl.objects))
    if row.examples:
        lines.append("  examples: " + ", ".join(e.name for e in row.examples))
    return "\n".join(lines)


def _count_note(expect_rows: ExpectRows | None) -> str:
    """A read statement has no expected count; say nothing rather than ``expect None``."""
    return "" if expect_rows is None else f"expect {expect_rows}"


def _step_note(step: Any) -> str:
    if step.check:
        otherwise = f"abort: {step.abort}" if step.abort else f"skip to {step.skip_to}"
        return f"expect {json.dumps(step.expect.to_dict())}, otherwise {otherwise}"
    if step.expect_rows is not None:
        return f"expect {step.expect_rows}"
    return ""


def rows_from(spec: str, *, repo: Path | None = None) -> list[Row]:
    """Rows from a path, or from ``git:REV`` / ``git:REV:PATH`` in the repository at ``repo``."""
    if spec.startswith("git:"):
        rest = spec[4:]
        rev, _, sub = rest.partition(":")
        return _rows_from_git(rev, sub or DEFAULT_PATH, repo or Path.cwd())
    result = validate_paths([spec], check_lock=False)
    result.raise_for_problems()
    return result.rows


def _git(args: Sequence[str], cwd: Path) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CapabilityPathError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def _rows_from_git(rev: str, sub: str, repo: Path) -> list[Row]:
    # --full-name: SUB is relative to the working directory, `git show REV:NAME` to the root;
    # -z: names are not quoted (a non-ASCII name would otherwise end in a quote)
    names = _git(["ls-tree", "-r", "-z", "--name-only", "--full-name", rev, "--", sub],
                 repo).split("\0")
    files = [n for n in names if n.endswith(SUFFIXES)]
    if not files:
        raise CapabilityPathError(f"no capability files under {sub} at {rev}")
    texts = [(f"{rev}:{n}", _git(["show", f"{rev}:{n}"], repo)) for n in files]
    result = validate_texts(texts)
    result.raise_for_problems()
    return result.rows


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out or {prefix: {}}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    text = " ".join(text.split())
    return "`" + _cell(text.replace("`", "'")) + "`"


def _cell(text: str) -> str:
    """Escape ``|`` for a Markdown table cell (SQL's ``||`` would split the cell)."""
    return text.replace("|", "\\|")


def diff(old: Iterable[Row], new: Iterable[Row]) -> str:
    """Markdown review of what changed between two sets of rows."""
    before = {r.key: r for r in old}
    after = {r.key: r for r in new}
    added = [after[k] for k in sorted(after) if k not in before]
    removed = [before[k] for k in sorted(before) if k not in after]
    retired = [after[k] for k in sorted(after)
               if k in before and after[k].retired and not before[k].retired]
    changed = [k for k in sorted(after)
               if k in before and before[k].row_hash != after[k].row_hash]
    out = ["## Capability changes", ""]
    out.append(f"{len(added)} added, {len(changed)} changed, {len(retired)} retired, "
               f"{len(removed)} removed")
    if added:
        out += ["", "### Added", ""]
        for r in added:
            shape = f"/{r.shape}" if r.shape else ""
            out.append(f"- **{r.ref}** ({r.effect_class}{shape}, {r.authorization.kind}, "
                       f"{', '.join(r.environments)}): {' '.join(r.description.split())}")
    if changed:
        out += ["", "### Changed", "",
                "> A published row changed in place. Unless it is unpublished, it needs a new "
                "version (`capgate validate` refuses it against the lock).", ""]
        for k in changed:
            a, b = _flatten(before[k].to_dict()), _flatten(after[k].to_dict())
            out.append(f"#### {after[k].ref}")
            out.append("")
            out.append("| field | before | after |")
            out.append("|---|---|---|")
            for field in sorted(set(a) | set(b)):
                if field == "retired" or a.get(field) == b.get(field):
                    continue
                old_v = _show(a[field]) if field in a else "—"
                new_v = _show(b[field]) if field in b else "—"
                out.append(f"| `{_cell(field)}` | {old_v} | {new_v} |")
            out.append("")
    if retired:
        out += ["", "### Retired", ""]
        for r in retired:
            out.append(f"- **{r.ref}** is retired (kept, refused at call time)")
    if removed:
        out += ["", "### Removed", "",
                "> Published rows should be retired, not removed.", ""]
        for r in removed:
            out.append(f"- **{r.ref}**")
    return "\n".join(out).rstrip() + "\n"
