"""Canonical JSON (RFC 8785) and the hashes built on it.

Row hashes, plan hashes, request fingerprints and ledger digests all use this
one function, so that the same data hashes the same on every machine and in
every process.

It sits on the hot path of every call (each ledger event is hashed), and the
reference implementation (``rfc8785``) serialises in pure Python.  For data
where RFC 8785 and the standard library's C encoder provably agree -- no
floats that ES6 number formatting prints differently from Python's ``repr``
(exponents, integral values), and no object
key outside the Basic Multilingual Plane (RFC 8785 sorts keys by UTF-16 code
units, Python by code points) -- we use ``json.dumps`` with sorted keys and
compact separators; everything else goes through ``rfc8785``.  A property test
checks both paths give identical bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from json.encoder import encode_basestring as _encode_string
from typing import Any

import rfc8785

_encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                           allow_nan=False).encode


_SAFE_INT = 2**53 - 1


def float_is_plain(value: float) -> bool:
    """True when Python's ``repr`` of ``value`` is exactly ECMAScript's ``Number#toString``.

    Between 1e-4 and 1e16 both print the shortest round-trip digits in plain
    notation; they differ on exponents and on integral values ("2.0" against
    "2"), which go the slow way.
    """
    text = repr(value)
    return not ("e" in text or "n" in text or text.endswith(".0"))


def _plain_leaf(item: Any, kind: type) -> bool | None:
    """A scalar's verdict (True: plain, False: not), or None for a container."""
    if kind is str or kind is bool or item is None:
        return True
    if kind is int:
        return bool(-_SAFE_INT <= item <= _SAFE_INT)  # beyond IEEE-754's exact range: rfc8785
    if kind is float:
        return float_is_plain(item)
    if kind is dict or kind is list or kind is tuple:
        return None
    # a StrEnum member (registry.vocabulary) is plain: both encoders write its text;
    # anything else rfc8785 should judge (and reject)
    return isinstance(item, str)


def _plain(value: Any) -> bool:
    """True when the C encoder's output is exactly RFC 8785 for ``value``.

    It walks every value of every call's ledger events, so strings, booleans
    and None -- nearly every leaf -- are judged where they are met, never pushed.
    """
    stack = [value]
    push = stack.append
    pop = stack.pop
    while stack:
        item = pop()
        kind = type(item)
        if kind is dict:
            for key, child in item.items():
                if type(key) is not str or (not key.isascii() and max(key) > "\uffff"):
                    return False  # RFC 8785 sorts by UTF-16 code units, Python by code points
                ck = type(child)
                if ck is str or ck is bool or child is None:
                    continue
                if ck is dict or ck is list or ck is tuple:
                    push(child)
                elif not _plain_leaf(child, ck):
                    return False
        elif kind is list or kind is tuple:
            for child in item:
                ck = type(child)
                if ck is str or ck is bool or child is None:
                    continue
                if ck is dict or ck is list or ck is tuple:
                    push(child)
                elif not _plain_leaf(child, ck):
                    return False
        elif not _plain_leaf(item, kind):
            return False
    return True


def canonical_bytes(value: Any, *, known_plain: bool = False) -> bytes:
    """RFC 8785 serialisation of plain JSON data (dicts, lists, str, int, float, bool, None).

    ``known_plain``: the caller has established what ``_plain`` checks (the
    YAML loader tracks it while it builds a file's data), so the walk is skipped.
    """
    if known_plain or _plain(value):
        text: str = _encode(value)
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            pass  # a lone surrogate: let the reference implementation reject it
    out: bytes = rfc8785.dumps(value)
    return out


def canonical_text(value: Any) -> str:
    """Canonical JSON as text (how the ledger stores payloads and snapshots)."""
    return canonical_bytes(value).decode("utf-8")


def canonical_hash(value: Any, *, known_plain: bool = False) -> str:
    """``sha256:<hex>`` of the canonical form of ``value``."""
    return "sha256:" + hashlib.sha256(canonical_bytes(value, known_plain=known_plain)).hexdigest()


def scalar_text(value: str | int | None) -> str:
    """Canonical JSON of a string, a safe integer or None, without a walk.

    RFC 8785 escapes strings as the standard library's ``encode_basestring``
    does; the caller's final UTF-8 encoding refuses a lone surrogate (and then
    goes the slow way).  Anything else is serialised whole.
    """
    if value is None:
        return "null"
    if isinstance(value, str):
        return _encode_string(value)
    if type(value) is int and -_SAFE_INT <= value <= _SAFE_INT:  # (bool is not int here)
        return str(value)
    return canonical_text(value)


def object_text(members: Mapping[str, str]) -> str:
    """Canonical JSON of an object from its members' canonical texts.

    RFC 8785 orders members by their names' UTF-16 code units; for the ASCII
    names used here that is plain string order.  Building an object from parts
    lets one value (a call's inputs) be serialised once and reused in every
    hash that covers it.
    """
    return "{" + ",".join(f'"{k}":{members[k]}' for k in sorted(members)) + "}"


def hash_of_text(text: str) -> str:
    """``sha256:<hex>`` of canonical text built by :func:`object_text` (see canonical_hash)."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
