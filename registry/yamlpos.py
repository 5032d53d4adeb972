"""YAML loading that remembers where every node came from.

A DBA fixes a capability file from an error message, so every error must name
the file, line and column.  PyYAML's composer keeps marks on nodes; we build
plain Python data from the node tree and keep a side table from each node's
path (a tuple of keys and indexes) to its 1-based line and column.

Duplicate keys are errors (PyYAML would silently keep the last one, which
would let a second ``expect_rows`` hide the first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from registry.errors import Problem

Path = tuple[str | int, ...]


@dataclass
class Located:
    """Plain data plus the position of every value and every mapping key."""

    data: Any
    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def where(self, path: Path, *, key: bool = False) -> tuple[int, int]:
        """Position of ``path``; falls back to the nearest ancestor that has one."""
        table = self.keys if key else self.values
        p = path
        while p:
            if p in table:
                return table[p]
            if p in self.values:
                return self.values[p]
            p = p[:-1]
        return self.values.get((), (1, 1))


class _Constructor(yaml.constructor.SafeConstructor):
    pass


def _mark(node: yaml.Node) -> tuple[int, int]:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


def load_located(text: str, source: str) -> tuple[Located | None, list[Problem]]:
    """Parse ``text``; return the located data, or the syntax problems found."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        msg = f"{exc.problem or exc.context or 'invalid YAML'}"
        return None, [Problem(source, line, col, "CG101", "(file)", msg)]
    except yaml.YAMLError as exc:  # pragma: no cover - non-marked errors are rare
        return None, [Problem(source, 1, 1, "CG101", "(file)", str(exc))]
    located = Located(data=None)
    problems: list[Problem] = []
    if root is None:
        located.data = {}
        located.values[()] = (1, 1)
        return located, problems
    constructor = _Constructor()
    located.data = _build(root, (), located, problems, source, constructor)
    return located, problems


def _build(
    node: yaml.Node,
    path: Path,
    located: Located,
    problems: list[Problem],
    source: str,
    constructor: _Constructor,
) -> Any:
    located.values[path] = _mark(node)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                line, col = _mark(key_node)
                problems.append(Problem(source, line, col, "CG101", render_path(path),
                                        "mapping keys must be plain scalars"))
                continue
            key = constructor.construct_object(key_node)
            if not isinstance(key, str):
                key = str(key)
            if key in out:
                line, col = _mark(key_node)
                problems.append(Problem(source, line, col, "CG101", render_path((*path, key)),
                                        f"duplicate key {key!r}"))
                continue
            located.keys[(*path, key)] = _mark(key_node)
            out[key] = _build(value_node, (*path, key), located, problems, source, constructor)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _build(item, (*path, i), located, problems, source, constructor)
            for i, item in enumerate(node.value)
        ]
    return constructor.construct_object(node, deep=True)


def render_path(path: Path) -> str:
    """``("statements", 1, "expect_rows")`` → ``statements[1].expect_rows``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(file)"
