"""YAML loading that remembers where every node came from.

A DBA fixes a capability file from an error message, so every error must name
the file, line and column.  We build plain Python data straight from the
parser's events (libyaml's when PyYAML has it; composing PyYAML's node tree
costs ten times more) and keep a side table from each value's path (a tuple of
keys and indexes) to its 1-based line and column.  Scalars get the tags
PyYAML's SafeLoader would give them.

Duplicate keys are errors (PyYAML would silently keep the last one, which
would let a second ``expect_rows`` hide the first).  So are aliases and
explicit tags, and values that have no JSON form (dates, ``.nan``, ``.inf``):
a capability file is JSON data written as YAML, and its rows are hashed as
canonical JSON.

A block mapping or sequence is located at its key (``input:``), not at its
first child, so that the line of a finding is the line of the field it names.

Positions cost as much as the data (a tuple path and two table entries per
node), and a clean file needs only one per row (where the row starts).  So
``load_located(..., positions="rows")`` locates the file down to the start of
each row and builds everything inside rows as bare data; on anything it would
have to report there, it starts over with every position.  A caller that
finds a problem later (schema, semantics, the lock) does the same.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from capgate.registry.canonical import float_is_plain
from capgate.registry.errors import Problem

Path = tuple[str | int, ...]


@dataclass
class Located:
    """Plain data plus the position of every value and every mapping key."""

    data: Any
    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)
    #: the data meets ``canonical._plain`` (no float ECMAScript prints differently,
    #: no key outside the BMP), so its rows can be hashed without that walk
    json_plain: bool = True

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


MAX_SAFE_INTEGER = 2**53 - 1  # RFC 8785 hashes integers as IEEE doubles
MAX_DEPTH = 200  # deeper nesting is not a capability file; refuse it before Python's stack does
_TAG = "tag:yaml.org,2002:"
_STR = _TAG + "str"
_JSON_SCALAR_TAGS = frozenset(_TAG + t for t in ("str", "int", "float", "bool", "null"))
_MAP, _SEQ = _TAG + "map", _TAG + "seq"

# libyaml's parser when PyYAML has it (an order of magnitude faster), else PyYAML's own.
_LOADER: Any = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader
# The implicit resolvers of SafeLoader by first character, as ``Resolver.resolve`` uses them.
_WILDCARD = list(yaml.SafeLoader.yaml_implicit_resolvers.get(None, []))
_IMPLICIT: dict[str | None, list[tuple[str, Any]]] = {
    k: list(v) + _WILDCARD for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_NO_WILDCARD = not _WILDCARD  # then a plain scalar whose first character has no resolver is a str
_KEYS: dict[str, str] = {}  # plain mapping keys known to resolve to themselves
# Plain scalars that resolve to a clean value (``1``, ``true``, ``-x``), so that the
# resolver's regexes and PyYAML's constructors run once per distinct text.
_PLAIN: dict[str, Any] = {}
_PLAIN_LIMIT = 65536
_PLAIN_TEXT_LIMIT = 64  # numbers and words repeat; a long text is not worth keeping
_MISS = object()


def _resolve(value: str, implicit: tuple[bool, bool]) -> str:
    """The tag PyYAML's SafeLoader gives an untagged scalar."""
    if implicit[0]:
        for tag, regexp in _IMPLICIT.get(value[0] if value else "", _WILDCARD):
            if regexp.match(value):
                return str(tag)
    return _STR


class _TooDeep(Exception):
    pass


class _NeedsPositions(Exception):
    """The position-free part met something to report: load again with every position."""


#: ``positions="rows"`` locates the file's top level and where each row starts
#: (``("rows", i)``), nothing deeper.
ROW_DEPTH = 2


_Scalar, _Alias = yaml.ScalarEvent, yaml.AliasEvent
_MapStart, _MapEnd = yaml.MappingStartEvent, yaml.MappingEndEvent
_SeqStart, _SeqEnd = yaml.SequenceStartEvent, yaml.SequenceEndEvent


class _Builder:
    """Plain data and positions from the parser's event stream (no node tree).

    This is the hot path of loading 10,000 rows, hence the local names and the
    inlined common case (an untagged scalar that resolves to a string).
    """

    def __init__(self, loader: Any, located: Located, problems: list[Problem], source: str,
                 located_depth: int = MAX_DEPTH + 2):
        self.next = loader.get_event
        self.located = located
        self.problems = problems
        self.source = source
        self.constructor = _Constructor()
        self.located_depth = located_depth

    def problem(self, at: tuple[int, int], code: str, path: Path, message: str) -> None:
        self.problems.append(Problem(self.source, at[0], at[1], code, _field(path), message))

    def value(self, event: Any, path: Path, depth: int = 0) -> Any:
        mark = event.start_mark
        at = (mark.line + 1, mark.column + 1)
        values = self.located.values
        values[path] = at
        cls = event.__class__
        if cls is _Scalar:
            return self.scalar(event, path, at)
        if cls is _Alias:
            at = self.located.keys.get(path, at)
            self.problem(at, "CG101", path, "aliases (*name) are not allowed; write the value out")
            return None
        if depth > MAX_DEPTH:
            raise _TooDeep(at)
        if depth >= self.located_depth:
            return self.bare(event, depth)
        is_map = cls is _MapStart
        if event.tag not in (None, "!", _MAP if is_map else _SEQ):
            self.problem(at, "CG101", path, f"tags are not allowed here ({event.tag})")
            self.skip(event)
            return None
        get = self.next
        depth += 1
        if not is_map:
            out_list: list[Any] = []
            item = get()
            while item.__class__ is not _SeqEnd:
                sub = (*path, len(out_list))
                if item.__class__ is _Scalar and item.tag is None and _NO_WILDCARD and not (
                        item.implicit[0] and item.value[:1] in _IMPLICIT):
                    item_mark: Any = item.start_mark
                    values[sub] = (item_mark.line + 1, item_mark.column + 1)
                    out_list.append(item.value)  # a plain string
                else:
                    out_list.append(self.value(item, sub, depth))
                item = get()
            return out_list
        keys = self.located.keys
        out: dict[str, Any] = {}
        key_event = get()
        while key_event.__class__ is not _MapEnd:
            mark = key_event.start_mark
            key_at = (mark.line + 1, mark.column + 1)
            if key_event.__class__ is not _Scalar:
                self.problem(key_at, "CG101", path, "mapping keys must be plain scalars")
                self.skip(key_event)
                self.skip(get())
                key_event = get()
                continue
            key = _KEYS.get(key_event.value) if key_event.tag is None else None
            if key is None:
                key = self.scalar(key_event, path, key_at)
                if key.__class__ is not str:
                    key = str(key)
                elif key_event.tag is None and key_event.implicit[0] and len(_KEYS) < 4096:
                    _KEYS[key] = key  # a plain key that resolves to itself (not `on`, `null`)
            sub = (*path, key)
            value_event = get()
            if key in out:
                self.problem(key_at, "CG101", sub, f"duplicate key {key!r}")
                self.skip(value_event)
                key_event = get()
                continue
            keys[sub] = key_at
            vcls = value_event.__class__
            if vcls is _Scalar and value_event.tag is None and _NO_WILDCARD and not (
                    value_event.implicit[0] and value_event.value[:1] in _IMPLICIT):
                mark = value_event.start_mark
                values[sub] = (mark.line + 1, mark.column + 1)
                out[key] = value_event.value  # the common case: a plain string
            else:
                out[key] = self.value(value_event, sub, depth)
                if (vcls is _MapStart or vcls is _SeqStart) and not value_event.flow_style:
                    values[sub] = key_at
            key_event = get()
        return out

    def bare(self, event: Any, depth: int) -> Any:
        """The value that starts with ``event``, without positions (``value``'s fast twin).

        It builds exactly what ``value`` builds for a clean value and raises
        ``_NeedsPositions`` wherever ``value`` would record a problem.
        """
        cls = event.__class__
        if cls is _Scalar:
            return self.bare_scalar(event)
        if cls is _Alias or depth > MAX_DEPTH:
            raise _NeedsPositions
        is_map = cls is _MapStart
        if event.tag not in (None, "!", _MAP if is_map else _SEQ):
            raise _NeedsPositions
        get = self.next
        bare = self.bare
        depth += 1
        if not is_map:
            out_list: list[Any] = []
            item = get()
            while item.__class__ is not _SeqEnd:
                if item.__class__ is _Scalar and item.tag is None and _NO_WILDCARD:
                    text = item.value
                    if not item.implicit[0] or text[:1] not in _IMPLICIT:
                        out_list.append(text)  # a string
                    else:
                        known = _PLAIN.get(text, _MISS)
                        out_list.append(known if known is not _MISS else self.bare_scalar(item))
                else:
                    out_list.append(bare(item, depth))
                item = get()
            return out_list
        out: dict[str, Any] = {}
        key_event = get()
        while key_event.__class__ is not _MapEnd:
            if key_event.__class__ is not _Scalar:
                raise _NeedsPositions
            key = _KEYS.get(key_event.value) if key_event.tag is None else None
            if key is None:
                key = self.bare_scalar(key_event)
                if key.__class__ is not str:
                    key = str(key)
                elif key_event.tag is None and key_event.implicit[0] and len(_KEYS) < 4096:
                    _KEYS[key] = key
            if key in out:
                raise _NeedsPositions
            value_event = get()
            if value_event.__class__ is _Scalar and value_event.tag is None and _NO_WILDCARD:
                text = value_event.value
                if not value_event.implicit[0] or text[:1] not in _IMPLICIT:
                    out[key] = text  # a string
                else:
                    known = _PLAIN.get(text, _MISS)
                    out[key] = known if known is not _MISS else self.bare_scalar(value_event)
            else:
                out[key] = bare(value_event, depth)
            key_event = get()
        return out

    def bare_scalar(self, event: Any) -> Any:
        """``scalar`` without positions: a problem there raises ``_NeedsPositions``."""
        problems = len(self.problems)
        result = self.scalar(event, (), (0, 0))
        if len(self.problems) != problems:
            del self.problems[problems:]
            raise _NeedsPositions
        return result

    def skip(self, event: Any) -> None:
        """Consume the rest of the value that starts with ``event``."""
        depth = 1 if isinstance(event, yaml.CollectionStartEvent) else 0
        while depth:
            event = self.next()
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1

    def scalar(self, event: Any, path: Path, at: tuple[int, int]) -> Any:
        """A scalar with a JSON form; anything else is a problem (and ``None``)."""
        value: str = event.value
        tag = event.tag
        plain = tag is None and event.implicit[0]
        if plain:
            known = _PLAIN.get(value, _MISS)
            if known is not _MISS:
                return known
        if tag is None or tag == "!":
            tag = _resolve(value, event.implicit)
        if tag == _STR:
            result: Any = value
        elif tag == _TAG + "timestamp":
            self.problem(at, "CG104", path,
                         f"{value!r} reads as a date; quote it to make it a string")
            return None
        elif tag not in _JSON_SCALAR_TAGS:
            self.problem(at, "CG101", path, f"tags are not allowed here ({tag})")
            return None
        else:
            node = yaml.ScalarNode(tag, value)
            result = self.constructor.yaml_constructors[tag](self.constructor, node)
            if isinstance(result, float):
                if not math.isfinite(result):
                    self.problem(at, "CG104", path, f"{value!r} is not a finite number")
                    return None
                if not float_is_plain(result):
                    self.located.json_plain = False
                    return result  # not remembered in _PLAIN: each must reach this line
            if isinstance(result, int) and not isinstance(result, bool) \
                    and abs(result) > MAX_SAFE_INTEGER:
                self.problem(at, "CG104", path,
                             f"{value} is outside the range of a JSON integer "
                             f"(at most {MAX_SAFE_INTEGER} in magnitude)")
                return None
        if plain and len(_PLAIN) < _PLAIN_LIMIT and len(value) <= _PLAIN_TEXT_LIMIT:
            _PLAIN[value] = result  # immutable: str, int, float, bool or None
        return result


def _at(mark: Any) -> tuple[int, int]:
    return (mark.line + 1, mark.column + 1)


def load_located(text: str, source: str, *,
                 positions: str = "all") -> tuple[Located | None, list[Problem]]:
    """Parse ``text``; return the located data, or the syntax problems found.

    ``positions="rows"`` locates only down to the start of each row (see the
    module's docstring); the data and the problems are the same either way.
    """
    if positions == "rows":
        try:
            return _load(text, source, ROW_DEPTH)
        except _NeedsPositions:
            pass
    return _load(text, source, MAX_DEPTH + 2)


def _load(text: str, source: str, located_depth: int) -> tuple[Located | None, list[Problem]]:
    located = Located(data={})
    located.values[()] = (1, 1)
    # Keys outside the BMP sort differently in RFC 8785 (UTF-16 code units).
    located.json_plain = text.isascii() or not text or max(text) <= "\uffff"
    problems: list[Problem] = []
    loader = _LOADER(text)
    try:
        builder = _Builder(loader, located, problems, source, located_depth)
        event = builder.next()  # StreamStart
        event = builder.next()
        if isinstance(event, yaml.DocumentStartEvent):
            located.data = builder.value(builder.next(), ())
            builder.next()  # DocumentEnd
            event = builder.next()
            if not isinstance(event, yaml.StreamEndEvent):
                line, col = _at(event.start_mark)
                return None, [Problem(source, line, col, "CG101", "(file)",
                                      "a capability file holds one YAML document, found another")]
        if located.data is None:  # an empty document
            located.data = {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = _at(mark) if mark else (1, 1)
        msg = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
        return None, [Problem(source, line, col, "CG101", "(file)", msg)]
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        index = max(0, min(int(exc.position), len(text)))
        line = text.count("\n", 0, index) + 1
        col = index - (text.rfind("\n", 0, index) + 1) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character or "\0")
        return None, [Problem(source, line, col, "CG101", "(file)",
                              f"unacceptable character #x{char:04x}: {exc.reason}")]
    except _TooDeep as exc:
        line, col = exc.args[0]
        return None, [Problem(source, line, col, "CG101", "(file)",
                              f"nested more than {MAX_DEPTH} levels deep")]
    except yaml.YAMLError as exc:  # pragma: no cover - every YAML error above is marked
        return None, [Problem(source, 1, 1, "CG101", "(file)", " ".join(str(exc).split()))]
    finally:
        loader.dispose()
    return located, problems


def field_path(path: Path) -> Path:
    """Inside a row, fields are named relative to the row: ``statements[1].expect_rows``."""
    if len(path) > 2 and path[0] == "rows" and isinstance(path[1], int):
        return path[2:]
    return path


def _field(path: Path) -> str:
    return render_path(field_path(path))


_NAME = re.compile(r"[A-Za-z0-9_$-]+\Z")


def render_path(path: Path) -> str:
    """``("statements", 1, "expect_rows")`` → ``statements[1].expect_rows``.

    A key that is not a plain name is quoted (``input.properties['a b']``), so a
    rendered problem stays on one line and its field reads unambiguously.
    """
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _NAME.match(part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out or "(file)"
