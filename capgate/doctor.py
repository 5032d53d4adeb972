"""``capgate doctor``: check configuration, grants and every connector's live access."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("doctor", parents=[common],
                       help="check configuration, grants and every connector's live access")
    p.set_defaults(handler=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    raise NotImplementedError
