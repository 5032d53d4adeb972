"""Executor commands: demo (more land with the executor)."""

from __future__ import annotations

import argparse
from typing import Any

from capgate import demo


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="run the demo on the embedded default")
    p.set_defaults(handler=demo.cmd_demo)
