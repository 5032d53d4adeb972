"""Three-way merge proposals for a preflight mismatch.

Base = the snapshot, ours = the new source, theirs = the live object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import merge3

from capgate.ddl.signature import diff, sign

OURS = "ours (new source)"
THEIRS = "theirs (live object)"
BASE = "base (snapshot)"


@dataclass(frozen=True)
class MergeRegion:
    """One region of the merge: unchanged, taken from one side, or a conflict."""

    kind: str
    """``unchanged`` | ``ours`` | ``theirs`` | ``same`` (both changed alike) | ``conflict``."""
    base: tuple[str, ...]
    ours: tuple[str, ...]
    theirs: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "base": list(self.base),
            "ours": list(self.ours),
            "theirs": list(self.theirs),
        }


@dataclass(frozen=True)
class MergeProposal:
    """What a person needs to resolve a changed-underneath object."""

    object: str
    base_snapshot_id: str
    base_signature: str
    ours_signature: str
    theirs_signature: str
    merged: str
    """The merged source; conflicts carry ``<<<<<<<``, ``|||||||``, ``=======``, ``>>>>>>>``."""
    conflicts: int
    regions: tuple[MergeRegion, ...]
    theirs_changed_blocks: tuple[dict[str, Any], ...]
    """Blocks of the live object that differ from the snapshot (the other session's edit)."""

    @property
    def clean(self) -> bool:
        return self.conflicts == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": self.object,
            "base_snapshot_id": self.base_snapshot_id,
            "signatures": {
                "base": self.base_signature,
                "ours": self.ours_signature,
                "theirs": self.theirs_signature,
            },
            "clean": self.clean,
            "conflicts": self.conflicts,
            "merged": self.merged,
            "regions": [r.to_dict() for r in self.regions if r.kind != "unchanged"],
            "theirs_changed_blocks": list(self.theirs_changed_blocks),
        }


def propose(
    object_key: str, base_snapshot_id: str, base: str, ours: str, theirs: str,
    *, signatures: tuple[str, str, str] | None = None,
    appliable: Callable[[str], str] | None = None,
) -> MergeProposal:
    """Merge three normalised texts with ``merge3``; conflicts are marked, never resolved.

    ``signatures`` are the objects' own (base, ours, theirs) signatures when the
    caller has them (they cover attributes the texts do not show);
    ``appliable`` turns the merged normalised text back into a source that
    applies over the live object (MariaDB's normalisation drops ``OR REPLACE``).
    """
    b, o, t = (s.splitlines(keepends=True) for s in (base, ours, theirs))
    m = merge3.Merge3(b, o, t)
    merged_lines = list(
        m.merge_lines(
            name_a=OURS,
            name_b=THEIRS,
            name_base=BASE,
            base_marker="|||||||",
        )
    )
    regions: list[MergeRegion] = []
    conflicts = 0
    for raw_group in m.merge_groups():
        group: Any = raw_group
        kind = group[0]
        if kind == "unchanged":
            regions.append(MergeRegion("unchanged", tuple(group[1]), tuple(group[1]),
                                       tuple(group[1])))
        elif kind == "a":
            regions.append(MergeRegion("ours", (), tuple(group[1]), ()))
        elif kind == "b":
            regions.append(MergeRegion("theirs", (), (), tuple(group[1])))
        elif kind == "same":
            regions.append(MergeRegion("same", (), tuple(group[1]), tuple(group[1])))
        else:
            conflicts += 1
            regions.append(
                MergeRegion("conflict", tuple(group[1]), tuple(group[2]), tuple(group[3]))
            )
    merged = "".join(merged_lines)
    if appliable is not None:
        merged = appliable(merged)
    base_sig, ours_sig, theirs_sig = sign(base), sign(ours), sign(theirs)
    names = signatures or (str(base_sig), str(ours_sig), str(theirs_sig))
    return MergeProposal(
        object=object_key,
        base_snapshot_id=base_snapshot_id,
        base_signature=names[0],
        ours_signature=names[1],
        theirs_signature=names[2],
        merged=merged,
        conflicts=conflicts,
        regions=tuple(regions),
        theirs_changed_blocks=tuple(c.to_dict() for c in diff(base_sig, theirs_sig).changed),
    )

