"""What a DBA reads: a row's review card, a diff of two sets of rows, and a bump.

The card lists what a reviewer must approve -- statements with their binds and
expected counts, effect class, shape, recovery, timeout, authorization,
environments.  The diff is Markdown fit for a pull-request comment: new
versions compared with the version before them, added, changed and retired
rows -- field by field, with the changed SQL as line diffs and the inserted
and removed words spelt out, because a version bump is where a reviewer must
see that a verify check grew a ``pg_sleep(2)``.  ``OLD``/``NEW`` may be files,
directories or ``git:REV`` (the same paths as of a git revision).

:func:`bump` writes the next version of a row as a copy of the current one,
right after it in the same file, so that a change is made on a new version
and reviewed as a diff against the old one.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from capgate.registry.checks import binds_of
from capgate.registry.errors import CapabilityPathError, RegistryError, UnknownOperation
from capgate.registry.loader import DEFAULT_PATH, SUFFIXES, validate_paths, validate_texts
from capgate.registry.model import ExpectRows, Row


def card(row: Row, pinned: bool | None = None) -> str:
    """A plain-text review card for one row (``pinned``: what the lock says of it)."""
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
    if pinned is not None:
        lines.append("  lock:          " + (
            "pinned in capabilities.lock" if pinned else
            "UNPINNED: capabilities.lock does not pin this row as it is (a draft: it runs "
            "only in the unlocked environments until it is reviewed and `capgate lock`ed)"))
    inputs = row.input.get("properties", {})
    required = set(row.input.get("required", ()))
    if inputs:
        lines.append("  inputs:")
        for name, spec in inputs.items():
            kind = spec.get("type", "any") if hasattr(spec, "get") else "any"
            lines.append(f"    {name}: {kind}{' (required)' if name in required else ''}")
    sections: list[tuple[str, list[tuple[str, str, str]]]] = [
        ("statements", [(s.name or f"#{i + 1}", s.sql, _count_note(s.expect_rows)
                         + (f"; returns {s.returns.key} ({s.returns.table})" if s.returns
                            else ""))
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
    lines.extend(_simulation_lines(row))
    if row.ddl:
        lines.append("  ddl objects: " + ", ".join(f"{o.type} {o.name}" for o in row.ddl.objects))
    if row.examples:
        lines.append("  examples: " + ", ".join(e.name for e in row.examples))
    return "\n".join(lines)


def _simulation_lines(row: Row) -> list[str]:
    """Issue 16: the effects no transaction covers, the required context, the simulation."""
    lines: list[str] = []
    if row.expected_effects:
        lines.append("  expected effects (not covered by the transaction):")
        for e in row.expected_effects:
            lines.append(f"    {e.name} [{e.effect_class}]: {e.description}")
            lines.append(f"        observed by {e.observed_by}; verifiable after the fact: "
                         f"{'yes' if e.verifiable else 'no'}; customer-visible: "
                         f"{'yes' if e.visible else 'no'}"
                         + (f"; {e.unobservable}" if e.unobservable else ""))
    if row.required_context:
        lines.append("  required context:")
        lines.extend(f"    {c.name}: {c.description}" for c in row.required_context)
    spec = row.simulation
    if spec is not None:
        lines.append("  simulation:")
        if not spec.target_baseline:
            lines.append("    baseline: the target's rows are not read (not a table)")
        for q in spec.baseline:
            lines.append(f"    baseline {q.name}: {' '.join(q.sql.split())}")
        for number, name, point in ((4, "no downstream consumer", spec.no_downstream_consumer),
                                    (5, "no customer-visible effect",
                                     spec.no_customer_visible_effect)):
            if point is not None:
                lines.append(f"    exemption ({number}) {name}: declared "
                             f"{'holds' if point.holds else 'fails'} -- {point.because}")
        if spec.reconciliation is not None:
            r = spec.reconciliation
            lines.append(f"    reconciliation {r.name}: {' '.join(r.sql.split())}; expect "
                         f"{json.dumps(r.expect.to_dict())}")
    return lines


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


def _is_sql(field: str, value: Any) -> bool:
    return isinstance(value, str) and (field.endswith(("sql", "check"))
                                       or "\n" in value.strip())


def _sql_lines(sql: str) -> list[str]:
    """SQL as lines for a diff: as written, or split before its clauses when on one line."""
    lines = [line.rstrip() for line in sql.strip().splitlines()]
    if len(lines) == 1 and len(lines[0]) > 60:
        lines = [p.strip() for p in re.split(
            r"\s+(?=(?:FROM|WHERE|AND|OR|ORDER BY|GROUP BY|HAVING|JOIN|LEFT JOIN|VALUES|SET|"
            r"RETURNING|UNION)\b)", lines[0], flags=re.IGNORECASE)]
    return lines


def _word_changes(old: str, new: str) -> list[str]:
    """The inserted and removed runs of words, each spelt out whole."""
    a, b = old.split(), new.split()
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            out.append(f"removed `{' '.join(a[i1:i2])}`")
        if tag in ("replace", "insert"):
            out.append(f"inserted `{' '.join(b[j1:j2])}`")
    return out


def field_changes(before: Row, after: Row) -> list[str]:
    """Markdown lines: every field that differs, SQL as a line diff, the rest in a table."""
    a, b = _flatten(before.to_dict()), _flatten(after.to_dict())
    table: list[str] = []
    sql_blocks: list[str] = []
    for field in sorted(set(a) | set(b), key=_field_order):
        if field in ("version", "retired") or a.get(field) == b.get(field):
            continue
        old_v, new_v = a.get(field), b.get(field)
        if _is_sql(field, old_v) or _is_sql(field, new_v):
            old_text = old_v if isinstance(old_v, str) else ""
            new_text = new_v if isinstance(new_v, str) else ""
            what = "added" if field not in a else "removed" if field not in b else "changed"
            sql_blocks.append(f"**`{field}`** {what}:")
            if old_text and new_text:
                for change in _word_changes(old_text, new_text):
                    sql_blocks.append(f"- {change}")
            sql_blocks.append("")
            sql_blocks.append("```diff")
            old_lines, new_lines = _sql_lines(old_text), _sql_lines(new_text)
            diffed = difflib.unified_diff(old_lines, new_lines, lineterm="",
                                          n=max(len(old_lines), len(new_lines)))
            sql_blocks += [line for line in diffed if not line.startswith(("---", "+++", "@@"))]
            sql_blocks.append("```")
            sql_blocks.append("")
            continue
        shown_old = _show(old_v) if field in a else "—"
        shown_new = _show(new_v) if field in b else "—"
        table.append(f"| `{_cell(field)}` | {shown_old} | {shown_new} |")
    out: list[str] = []
    if table:
        out += ["| field | before | after |", "|---|---|---|", *table, ""]
    out += sql_blocks
    if not out:
        out.append("_no field changed except the version_")
    return out


def _field_order(field: str) -> tuple[int, str]:
    """Fields in the order a row is read: statements before verify before the rest."""
    head = re.split(r"[.\[]", field, maxsplit=1)[0]
    order = ["description", "input", "target", "effect_class", "shape", "authorization",
             "environments", "idempotency_key", "timeout", "recovery", "statements", "steps",
             "verify", "replay", "landed_probe", "compensation", "post_commit"]
    return (order.index(head) if head in order else len(order), field)


def _previous(row: Row, *pools: dict[tuple[str, int], Row]) -> Row | None:
    """The newest version of ``row``'s operation below it, from the first pool that has one."""
    for pool in pools:
        lower = [r for k, r in pool.items() if k[0] == row.operation_id and k[1] < row.version]
        if lower:
            return max(lower, key=lambda r: r.version)
    return None


def diff(old: Iterable[Row], new: Iterable[Row]) -> str:
    """Markdown review of what changed between two sets of rows."""
    before = {r.key: r for r in old}
    after = {r.key: r for r in new}
    added_keys = [k for k in sorted(after) if k not in before]
    bumped = [(_previous(after[k], before,
                         {kk: r for kk, r in after.items() if kk not in added_keys}), after[k])
              for k in added_keys]
    versions = [(prev, row) for prev, row in bumped if prev is not None]
    added = [row for prev, row in bumped if prev is None]
    removed = [before[k] for k in sorted(before) if k not in after]
    retired = [after[k] for k in sorted(after)
               if k in before and after[k].retired and not before[k].retired]
    changed = [k for k in sorted(after)
               if k in before and before[k].row_hash != after[k].row_hash]
    out = ["## Capability changes", ""]
    out.append(f"{len(versions)} new version(s), {len(added)} added, {len(changed)} changed, "
               f"{len(retired)} retired, {len(removed)} removed")
    if versions:
        out += ["", "### New versions", ""]
        for prev, row in versions:
            assert prev is not None
            out.append(f"#### {prev.ref} → {row.ref}")
            out.append("")
            out += field_changes(prev, row)
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
            out.append(f"#### {after[k].ref}")
            out.append("")
            out += field_changes(before[k], after[k])
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


def diff_versions(rows: Iterable[Row], old: tuple[str, int], new: tuple[str, int]) -> str:
    """Markdown: two versions of one registry's operations compared field by field."""
    found = {r.key: r for r in rows}
    for key in (old, new):
        if key not in found:
            raise UnknownOperation(f"no row {key[0]}@{key[1]} in the capability files",
                                   operation_id=key[0], version=key[1])
    a, b = found[old], found[new]
    return "\n".join([f"## {a.ref} → {b.ref}", "", *field_changes(a, b)]).rstrip() + "\n"


# --- bump -------------------------------------------------------------------------------------

_VERSION = re.compile(r"^(?P<indent>\s*)(?P<dash>-\s+)?version:\s*(?P<n>\d+)(?P<rest>.*)$")


def _row_block(lines: list[str], start: int) -> tuple[int, int, int]:
    """(first, end, key column) of the YAML list item whose first key is on line ``start``."""
    first = start
    while first > 0 and not lines[first].lstrip().startswith("-"):
        first -= 1
    dash_col = len(lines[first]) - len(lines[first].lstrip())
    key_col = dash_col + len(lines[first].lstrip()) - len(lines[first].lstrip()[1:].lstrip())
    end = first + 1
    while end < len(lines):
        text = lines[end]
        stripped = text.strip()
        indent = len(text) - len(text.lstrip())
        if stripped and not stripped.startswith("#") and indent <= dash_col:
            break
        end += 1
    while end > first + 1 and (not lines[end - 1].strip() or
                               lines[end - 1].strip().startswith("#")):
        end -= 1
    return first, end, key_col


def bump(paths: Sequence[str | Path], operation_id: str, *, retire: bool = False,
         originals: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Write ``operation_id``'s next version after its newest one, as a copy to edit.

    The copy keeps every comment and the layout of the original; only
    ``version`` changes (and, with ``retire``, the old row gains ``retired:
    true``).  The result is validated before anything is written; an invalid
    result writes nothing and raises the problems.

    A newest row edited in place (its hash no longer the one ``capabilities.lock``
    pins, CG130) is the usual way to get here: the edit belongs in the new version,
    and the published one must read again as it was locked.  So the edited text
    becomes the new version and the published row is put back from its locked
    text -- found in the file's git history or among ``originals`` (``(name,
    text)`` pairs, e.g. the packaged examples ``capgate init`` copied) by its hash.
    Where that text is nowhere, nothing is written: :class:`LockedRowEdited` says
    what to run.
    """
    result = validate_paths(paths, check_lock=False)
    result.raise_for_problems()
    mine = [r for r in result.rows if r.operation_id == operation_id]
    if not mine:
        from capgate.registry.registry import Registry

        Registry(result.rows).resolve(operation_id)  # the refusal, with its did-you-mean
    current = max(mine, key=lambda r: r.version)
    path = Path(current.source_path)
    text = path.read_text("utf-8")
    lines = text.splitlines()
    first, end, key_col = _row_block(lines, current.source_line - 1)
    block = lines[first:end]
    restored = _published_block(paths, mine, current, path, originals)
    new_version = max(r.version for r in mine) + 1
    copy = list(block)
    version_at = None
    for n, line in enumerate(copy):
        m = _VERSION.match(line)
        if m and (len(m.group("indent")) + len(m.group("dash") or "")) == key_col:
            copy[n] = f"{m.group('indent')}{m.group('dash') or ''}version: {new_version}" \
                      f"{m.group('rest')}"
            version_at = n
            break
    if version_at is None:
        raise RegistryError(f"{path}:{current.source_line}: cannot find the `version:` line of "
                            f"{current.ref} to bump")
    copy = [line.replace("retired: true", "retired: false") if line.strip().startswith(
        "retired:") else line for line in copy]
    original = list(block) if restored is None else list(restored)
    if retire and not any(line.strip().startswith("retired:") for line in original):
        at = next((n for n, line in enumerate(original) if _VERSION.match(line)), version_at)
        original.insert(at + 1, " " * key_col + "retired: true")
    new_lines = lines[:first] + original + [""] + copy + lines[end:]
    new_text = "\n".join(new_lines) + ("\n" if text.endswith("\n") else "")
    texts = [(f, Path(f).read_text("utf-8") if f != str(path) else new_text)
             for f in result.files]
    check = validate_texts(texts)
    if check.problems:
        raise RegistryError(f"the bumped file would not validate: {check.problems[0].render()}",
                            problems=check.problems)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(new_text)
    os.replace(tmp, path)
    at_line = first + len(original) + 2
    return {"operation_id": operation_id, "from": current.version, "version": new_version,
            "file": str(path), "line": at_line, "retired_previous": retire,
            "restored_previous": restored is not None}


def _published_block(paths: Sequence[str | Path], mine: Sequence[Row], current: Row,
                     path: Path, originals: Sequence[tuple[str, str]]) -> list[str] | None:
    """The locked text of ``current`` when it was edited in place (None: it was not).

    LockedRowEdited when it was and no source holds the locked text, or when an older
    version of the operation was edited (bump copies the newest; that one is a
    separate mistake to undo).
    """
    from capgate.registry.errors import LockedRowEdited
    from capgate.registry.loader import discover
    from capgate.registry.lock import read_lock

    _, lock_path = discover(paths)
    locked = read_lock(lock_path) if lock_path is not None else {}
    edited = [r for r in mine if r.key in locked and locked[r.key].hash != r.row_hash]
    if not edited:
        return None
    lock_name = str(lock_path)
    older = [r for r in edited if r is not current]
    if older:
        r = older[0]
        raise LockedRowEdited(
            f"{r.ref} ({r.source_path}:{r.source_line}) was edited in place: its hash is "
            f"not the one {lock_name} pins.  A published row never changes; put it back as "
            f"it was (`git checkout -- {r.source_path}` if it is in git), then `capgate "
            f"bump {r.operation_id}` writes {r.operation_id}@{current.version + 1} to "
            "change", ref=r.ref, file=r.source_path, lock=lock_name)
    want = locked[current.key].hash
    for name, text in [*_git_versions(path), *originals]:
        try:
            found = validate_texts([(name, text)])
        except RegistryError:
            continue
        for row in found.rows:
            if row.key == current.key and row.row_hash == want:
                candidate = text.splitlines()
                first, end, _ = _row_block(candidate, row.source_line - 1)
                return candidate[first:end]
    nxt = f"{current.operation_id}@{current.version + 1}"
    raise LockedRowEdited(
        f"{current.ref} ({path}:{current.source_line}) was edited in place: its hash is not "
        f"the one {lock_name} pins, and its locked text is in no git history of the file nor "
        f"among the packaged examples, so bump cannot put it back.  Undo your edit of "
        f"{current.ref} (so that `capgate validate` passes again), run `capgate bump "
        f"{current.operation_id}`, and make the change in {nxt}",
        ref=current.ref, file=str(path), lock=lock_name, locked_hash=want,
        found_hash=current.row_hash)


def _git_versions(path: Path, limit: int = 50) -> list[tuple[str, str]]:
    """The file's text in the index and in its last ``limit`` commits, newest first
    (empty outside a git work tree)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(path.parent), *args], capture_output=True,
                                  text=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if not top:
        return []
    rel = path.resolve().relative_to(Path(top.strip()).resolve()).as_posix()
    out: list[tuple[str, str]] = []
    staged = git("show", f":{rel}")
    if staged is not None:
        out.append((f"git:index:{rel}", staged))
    for rev in (git("log", f"-n{limit}", "--format=%H", "--", rel) or "").split():
        shown = git("show", f"{rev}:{rel}")
        if shown is not None:
            out.append((f"git:{rev[:12]}:{rel}", shown))
    return out
