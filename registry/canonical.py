"""Canonical JSON (RFC 8785) and the hashes built on it.

Row hashes, plan hashes, request fingerprints and ledger digests all use this
one function, so that the same data hashes the same on every machine and in
every process.
"""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785


def canonical_bytes(value: Any) -> bytes:
    """RFC 8785 serialisation of plain JSON data (dicts, lists, str, int, float, bool, None)."""
    out: bytes = rfc8785.dumps(value)
    return out


def canonical_hash(value: Any) -> str:
    """``sha256:<hex>`` of the canonical form of ``value``."""
    return "sha256:" + hashlib.sha256(canonical_bytes(value)).hexdigest()
