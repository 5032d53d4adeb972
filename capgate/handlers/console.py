"""What every handler parses and prints: ``--json`` output and the common arguments.

A handler turns arguments into one call of :mod:`capgate.commands` and the
answer into text (or, with ``--json``, the answer's JSON form).  The pieces
they all need are here, so that no handler imports another handler or the
entry point (:mod:`capgate.cli` imports the handlers, never the reverse).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from capgate.registry.errors import UsageError
from capgate.registry.excerpt import cut, excerpt


def emit(args: argparse.Namespace, payload: Any, text: str | None = None) -> None:
    """Print JSON with ``--json``, else the human text."""
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, ensure_ascii=False, default=str))
    elif text is not None:
        print(text)


def parse_operation(spec: str) -> tuple[str, int | None]:
    """``OPERATION[@VERSION]`` -> (operation, version or None)."""
    op, _, ver = spec.partition("@")
    if ver and not ver.isdigit():
        raise UsageError(f"version must be an integer, got {ver!r}")
    return op, int(ver) if ver else None


def caller(args: argparse.Namespace, doing: str = "is calling") -> str:
    """The acting identity: ``--as``, else ``CAPGATE_AGENT`` or the config's ``agent``."""
    from capgate.config import load_settings

    who = args.who or load_settings(args.config).agent
    if not who:
        raise UsageError(f"say who {doing}: --as WHO (or CAPGATE_AGENT)")
    return str(who)


class _DuplicateKey(ValueError):
    """One object of ``--input`` names a key twice."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: an object, refused when it names a key twice.

    JSON leaves duplicate keys to the reader, and Python keeps the last: the
    request a reviewer reads on the command line (the first) would not be the
    one that runs.
    """
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_inputs(raw: str) -> dict[str, Any]:
    """``--input``: a JSON object, or ``@FILE`` holding one; every mistake is a usage error."""
    if raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as fh:
                raw = fh.read()
        except OSError as exc:
            raise UsageError(f"--input {raw}: cannot read the file: {exc.strerror}",
                             path=raw[1:]) from None
        except UnicodeDecodeError:
            raise UsageError(f"--input {raw}: the file is not UTF-8 text", path=raw[1:]) from None
    try:
        value = json.loads(raw, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--input is not valid JSON: {exc}") from None
    except _DuplicateKey as exc:
        raise UsageError(f"--input names the key {excerpt(str(exc), 60)} twice in one "
                         "object; say it once", key=cut(str(exc), 60)) from None
    except RecursionError:
        raise UsageError("--input is nested too deeply to read") from None
    except ValueError as exc:  # e.g. a number of more than 4,300 digits (int's own limit)
        from capgate.registry.errors import InputInvalid

        raise InputInvalid(f"--input cannot be read as JSON data: {cut(str(exc), 200)}; "
                           "nothing was recorded", field="(input)") from None
    if not isinstance(value, dict):
        raise UsageError("--input must be a JSON object")
    return value


_TTL = re.compile(r"^(\d+)\s*([smhd]?)$")


def parse_ttl(raw: str | None) -> int | None:
    """``--ttl``: ``900s``, ``30m``, ``2h``, ``1d`` or plain seconds -> seconds (None: unset)."""
    if raw is None:
        return None
    m = _TTL.match(raw.strip())
    if not m:
        raise UsageError(f"--ttl must look like 900s, 30m, 2h or 1d, got {raw!r}")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
