"""``capgate demo``: the loop on the embedded default, printed step by step."""

from __future__ import annotations

import argparse

from registry.loader import DEFAULT_PATH, load_registry, validate_paths
from registry.review import card


def cmd_demo(args: argparse.Namespace) -> int:
    result = validate_paths([DEFAULT_PATH])
    result.raise_for_problems()
    print(f"== validate: {len(result.rows)} rows in {len(result.files)} file(s), all valid")
    registry = load_registry([DEFAULT_PATH])
    print("== list")
    for row in registry.current_rows():
        print(f"  {row.ref:<36} {row.effect_class!s:<13} {row.authorization.kind}")
    first = registry.current_rows()[0]
    print(f"== show {first.ref}")
    print(card(first))
    return 0
