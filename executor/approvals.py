"""Authenticated approvals: each approver signs with a key only they can read.

Threat: an agent identity with shell access runs ``capgate approve --by
alice`` (or writes an approval row straight into the ledger store).  A name is
not proof, so an approval carries an Ed25519 signature by the approver's
private key, which lives in a file only that person can read; the grants file
(writable by administrators only) names each approver's *public* key
(``approval_key = "ed25519:..."``).  capgate verifies the signature when the
approval is recorded and again when a call consumes it -- against the grants
as they are then -- so an approval whose key was withdrawn, whose approver lost
the role, or whose row someone edited or inserted by hand is refused.

The signed statement binds everything that makes an approval what it is:
the approval id, the plan hash (which binds the row, inputs, connector,
environment, case and requester), the approver, the role and the expiry.
Verification needs only public keys, so a process that verifies (an agent's
executor) can never sign.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from capgate.registry.canonical import canonical_bytes
from capgate.registry.errors import ConfigError, UsageError

if TYPE_CHECKING:  # cryptography is imported where a key is used: a read call never pays
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

KEY_PREFIX = "ed25519:"
STATEMENT_FIELDS = ("approval_id", "plan_hash", "approver", "role", "expires_at")
KEY_ENV = "CAPGATE_APPROVER_KEY"
"""The approver's private key file when ``capgate approve`` is given no ``--key``."""

__all__ = ["KEY_ENV", "KEY_PREFIX", "SigningKey", "check_public_key", "generate",
           "load_signing_key", "parse_public_key", "statement", "verify"]


def statement(fields: Mapping[str, str]) -> bytes:
    """The canonical bytes an approval signature covers."""
    return canonical_bytes({"capgate": "approval/1",
                            **{name: str(fields[name]) for name in STATEMENT_FIELDS}})


@dataclass(frozen=True)
class SigningKey:
    """An approver's private key, loaded from the file only they can read."""

    key: Ed25519PrivateKey
    source: str

    @property
    def public_text(self) -> str:
        return public_text(self.key.public_key())

    def sign(self, fields: Mapping[str, str]) -> str:
        return base64.b64encode(self.key.sign(statement(fields))).decode()


def public_text(key: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def check_public_key(text: str, *, where: str) -> bytes:
    """``ed25519:BASE64`` of 32 bytes -> the raw key; ConfigError naming ``where`` if not.

    What ``Ed25519PublicKey.from_public_bytes`` accepts, decided without
    loading cryptography (reading the grants file is on every call's path).
    """
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise ConfigError(f"{where}: approval_key must look like \"ed25519:BASE64\" "
                          "(`capgate approver keygen` prints it)")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX):], validate=True)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"{where}: approval_key is not a valid Ed25519 public key")
    return raw


def parse_public_key(text: str, *, where: str) -> Ed25519PublicKey:
    """``ed25519:BASE64`` -> the key; ConfigError naming ``where`` when it is not one."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    raw = check_public_key(text, where=where)
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise ConfigError(f"{where}: approval_key is not a valid Ed25519 public key") from None


def verify(public: str, fields: Mapping[str, str], signature: str) -> bool:
    """Whether ``signature`` is ``public``'s signature of the approval ``fields``."""
    from cryptography.exceptions import InvalidSignature

    try:
        key = parse_public_key(public, where="approval")
        key.verify(base64.b64decode(signature, validate=True), statement(fields))
    except (ConfigError, InvalidSignature, ValueError):
        return False
    return True


def generate(path: str | Path, *, force: bool = False) -> str:
    """A new key pair: the private key to ``path`` (mode 0600); returns the public text."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    target = Path(path)
    if target.exists() and not force:
        raise UsageError(f"{target} exists; keep it, or pass --force to replace it",
                         path=str(target))
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    os.chmod(target, 0o600)
    return public_text(key.public_key())


def load_signing_key(path: str | Path | None) -> SigningKey:
    """The private key at ``path`` (or ``$CAPGATE_APPROVER_KEY``); UsageError when unusable."""
    chosen = path or os.environ.get(KEY_ENV)
    if not chosen:
        raise UsageError(f"an approval is signed: give the approver's key file with --key "
                         f"FILE (or {KEY_ENV}); `capgate approver keygen` makes one")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from capgate.executor.secretfiles import read_private

    file = Path(chosen)
    try:
        data = read_private(file, "approver's private key")
    except OSError as exc:
        raise UsageError(f"cannot read the approver key {file}: {exc.strerror}",
                         path=str(file)) from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise UsageError(f"{file} is not an unencrypted PEM private key", path=str(file)) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"{file} is not an Ed25519 key", path=str(file))
    return SigningKey(key, str(file))
