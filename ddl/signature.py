"""Normalised source and its block-hash content signature (recipe ``v2``).

Recipe ``v2`` is ``v1`` plus one rule: before signing, an adapter may put in
front of the normalised text the attributes that change what the code does
on its engine (``CatalogAdapter.signed_text``: MariaDB ``sql_mode`` and
``DEFINER``; Oracle editionability, PL/SQL compiler settings and a trigger's
enabled state) -- so a routine re-created under another ``sql_mode`` is drift,
not "the same".  A ``v1`` snapshot is re-signed by recipe ``v2`` from its stored
source and attributes when it is compared, so the new recipe never looks like
drift.

Recipe ``v1``, applied in this order:

1. a leading byte-order mark is dropped; ``\\r\\n`` and lone ``\\r`` become ``\\n``;
2. the dialect's cosmetic noise is removed by its catalog adapter (a callable
   passed as ``cosmetic``: e.g. the ``DEFINER=`` clause MariaDB puts in
   ``SHOW CREATE``, the statement terminator a file carries);
3. trailing spaces, tabs, form feeds and vertical tabs are stripped from
   every line;
4. blank lines at the start and at the end are dropped, and the text ends
   with exactly one ``\\n`` (an empty text stays empty).

The normalised text is cut into blocks of ``BLOCK_LINES`` (64) lines; each
block's bytes (UTF-8, every line ending in ``\\n``) are hashed with SHA-256;
the signature is SHA-256 over the concatenated 32-byte block digests,
written ``v2:sha256:<hex>``.  The recipe version is part of the text, so a
future change of normalisation or block size is a new recipe, never drift.
A diff of two signatures names the blocks (and so the line ranges) that
changed.  An object that does not exist has the signature ``v2:absent``.

Timestamps (``LAST_DDL_TIME``, ``LAST_ALTERED``) are never part of it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

RECIPE = "v2"
ALGORITHM = "sha256"
BLOCK_LINES = 64
ABSENT = f"{RECIPE}:absent"

_SIGNATURE_RE = re.compile(r"^(v[0-9]+):(sha256):([0-9a-f]{64})$")
_TRAILING = " \t\f\v"

Cosmetic = Callable[[str], str]


def normalise(text: str, cosmetic: Cosmetic | None = None) -> str:
    """Normalise ``text`` by recipe v1 (see the module docstring)."""
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cosmetic is not None:
        text = cosmetic(text)
    lines = [line.rstrip(_TRAILING) for line in text.split("\n")]
    start = 0
    end = len(lines)
    while start < end and not lines[start]:
        start += 1
    while end > start and not lines[end - 1]:
        end -= 1
    if start == end:
        return ""
    return "\n".join(lines[start:end]) + "\n"


@dataclass(frozen=True)
class Signature:
    """The content signature of one normalised source.

    ``str(sig)`` is the compact form ``v1:sha256:<hex>`` that plans, snapshots
    and events carry; ``blocks`` are the per-block digests a diff compares.
    """

    digest: str
    """Hex SHA-256 over the block digests; empty for an absent object."""
    blocks: tuple[str, ...]
    """Hex SHA-256 of each block of ``block_lines`` lines, in order."""
    lines: int
    """Number of lines of the normalised text."""
    exists: bool = True
    """False for the signature of an object that does not exist."""
    recipe: str = RECIPE
    block_lines: int = BLOCK_LINES

    def __str__(self) -> str:
        if not self.exists:
            return f"{self.recipe}:absent"
        return f"{self.recipe}:{ALGORITHM}:{self.digest}"

    @classmethod
    def absent(cls) -> Signature:
        """The signature of an object that does not exist."""
        return cls(digest="", blocks=(), lines=0, exists=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "signature": str(self),
            "recipe": self.recipe,
            "block_lines": self.block_lines,
            "lines": self.lines,
            "blocks": list(self.blocks),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Signature:
        sig = str(data["signature"])
        if sig.endswith(":absent"):
            return cls(digest="", blocks=(), lines=0, exists=False, recipe=data["recipe"])
        recipe, _, digest = parse(sig)
        out = cls(
            digest=digest,
            blocks=tuple(str(b) for b in data["blocks"]),
            lines=int(data["lines"]),
            recipe=recipe,
            block_lines=int(data["block_lines"]),
        )
        if _combine(out.blocks) != digest:
            raise ValueError(f"signature {sig} does not match its blocks")
        return out


def _combine(blocks: Sequence[str]) -> str:
    h = hashlib.sha256()
    for block in blocks:
        h.update(bytes.fromhex(block))
    return h.hexdigest()


def sign(normalised: str) -> Signature:
    """The v1 signature of text that is already normalised."""
    if not normalised:
        return Signature(digest=_combine(()), blocks=(), lines=0)
    body = normalised[:-1] if normalised.endswith("\n") else normalised
    lines = body.split("\n")
    blocks: list[str] = []
    sha = hashlib.sha256
    for i in range(0, len(lines), BLOCK_LINES):
        chunk = "\n".join(lines[i : i + BLOCK_LINES]) + "\n"
        blocks.append(sha(chunk.encode("utf-8")).hexdigest())
    return Signature(digest=_combine(blocks), blocks=tuple(blocks), lines=len(lines))


def signature_of(text: str, cosmetic: Cosmetic | None = None) -> Signature:
    """Normalise ``text`` and sign it in one call."""
    return sign(normalise(text, cosmetic))


def parse(signature: str) -> tuple[str, str, str]:
    """Split ``v1:sha256:<hex>`` into ``(recipe, algorithm, hex)``; ValueError if malformed."""
    m = _SIGNATURE_RE.match(signature)
    if not m:
        raise ValueError(f"not a content signature: {signature!r} (expected v1:sha256:<64 hex>)")
    return m.group(1), m.group(2), m.group(3)


@dataclass(frozen=True)
class BlockChange:
    """One block that differs between two signatures."""

    index: int
    first_line: int
    last_line: int
    old: str | None
    """The block's digest in the old signature; None if the block is new."""
    new: str | None
    """The block's digest in the new signature; None if the block was removed."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "block": self.index,
            "lines": [self.first_line, self.last_line],
            "old": self.old,
            "new": self.new,
        }


@dataclass(frozen=True)
class SignatureDiff:
    """Which blocks changed between an old and a new signature."""

    old: str
    new: str
    changed: tuple[BlockChange, ...]

    @property
    def same(self) -> bool:
        return self.old == self.new

    def to_dict(self) -> dict[str, Any]:
        return {
            "old": self.old,
            "new": self.new,
            "same": self.same,
            "changed_blocks": [c.to_dict() for c in self.changed],
        }


def diff(old: Signature, new: Signature) -> SignatureDiff:
    """Name the blocks of ``new`` that differ from ``old`` (compared by position).

    Fixed-size blocks mean an inserted or removed line changes its own block
    and every later one; the first changed block is where to look.
    """
    if old.recipe != new.recipe or old.block_lines != new.block_lines:
        raise ValueError(f"cannot compare signatures of recipes {old.recipe} and {new.recipe}")
    n = old.block_lines
    changed: list[BlockChange] = []
    for i in range(max(len(old.blocks), len(new.blocks))):
        a = old.blocks[i] if i < len(old.blocks) else None
        b = new.blocks[i] if i < len(new.blocks) else None
        if a != b:
            lines = new.lines if b is not None else old.lines
            changed.append(BlockChange(i, i * n + 1, min((i + 1) * n, lines), a, b))
    return SignatureDiff(str(old), str(new), tuple(changed))
