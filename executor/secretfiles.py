"""Key and token files: read only when no other account on the machine can read them.

An approver's private key signs approvals; a tokens file maps bearer tokens to
agent identities; a TLS key is the server's identity.  Any of them readable by
the file's group or by others hands that power to every account that can read
it.  So, as ``ssh`` refuses a private key with open permissions, capgate refuses
such a file -- naming it, its mode and the ``chmod`` that fixes it -- before
reading a byte of it (``SecretFileExposed``, ``CG920``).  The mode is checked on
the open descriptor, so a file swapped between the check and the read is the
file that was checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from capgate.registry.errors import SecretFileExposed

__all__ = ["check_private", "read_private"]

OPEN_BITS = 0o077
"""Any permission for the group or others (ssh's rule)."""


def _refusal(path: Path, mode: int, what: str) -> SecretFileExposed:
    who = []
    if mode & 0o070:
        who.append("its group")
    if mode & 0o007:
        who.append("other users")
    return SecretFileExposed(
        f"{path}: the {what} is open to {' and '.join(who)} (mode {stat.S_IMODE(mode):04o}): "
        f"anyone who can read it can act as its owner; run `chmod 600 {path}` (and keep it "
        "out of agents' reach); nothing was read from it",
        path=str(path), mode=f"{stat.S_IMODE(mode):04o}", fix=f"chmod 600 {path}")


def read_private(path: str | Path, what: str) -> bytes:
    """The bytes of ``path`` if only its owner may use it; ``SecretFileExposed`` otherwise.

    ``OSError`` (no such file, no permission) passes through for the caller to word.
    """
    file = Path(path)
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if os.name == "posix" and mode & OPEN_BITS:
            raise _refusal(file, mode, what)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_private(path: str | Path, what: str) -> None:
    """Refuse ``path`` (``SecretFileExposed``) when its group or others may use it."""
    read_private(path, what)
