"""Who may do what: read and write grants per connector and environment, and roles.

Checked before anything opens.  A write grant implies the read grant on the
same connector and environment.  Roles are what approvers hold; a row's gate
names the roles it accepts, and an approver's ``approval_key`` is the public
half of the key they sign approvals with (:mod:`executor.approvals`).  The
grants file is TOML, writable by administrators only::

    [principals.claims-agent]
    grants = [{ connector = "insurance", environments = ["dev", "qa"], access = "write" }]

    [principals.alice]
    roles = ["dba", "team_lead"]
    approval_key = "ed25519:..."     # from `capgate approver keygen`
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.errors import ApproverLacksRole, ConfigError, NotAuthorized
from registry.model import Row


@dataclass(frozen=True)
class Grant:
    connector: str
    environments: tuple[str, ...]
    access: str  # "read" or "write"

    def allows(self, connector: str, environment: str, access: str) -> bool:
        if self.connector not in (connector, "*") or environment not in self.environments:
            return False
        return self.access == "write" or access == "read"


@dataclass(frozen=True)
class Principal:
    name: str
    roles: tuple[str, ...] = ()
    grants: tuple[Grant, ...] = ()
    approval_key: str | None = None
    """``ed25519:BASE64``: the public key this principal's approvals must be signed with."""


@dataclass(frozen=True)
class Grants:
    principals: Mapping[str, Principal] = field(default_factory=dict)
    source: str = "(none)"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "(inline)") -> Grants:
        principals: dict[str, Principal] = {}
        raw = data.get("principals", {})
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: `principals` must be a table")
        for name, spec in raw.items():
            if not isinstance(spec, dict):
                raise ConfigError(f"{source}: principals.{name} must be a table")
            unknown = set(spec) - {"roles", "grants", "approval_key"}
            if unknown:
                raise ConfigError(f"{source}: principals.{name}: unknown key(s) "
                                  f"{', '.join(sorted(unknown))}")
            grants = []
            for i, g in enumerate(spec.get("grants", [])):
                try:
                    access = g["access"]
                    if access not in ("read", "write"):
                        raise ValueError(f"access must be read or write, got {access!r}")
                    grants.append(Grant(str(g["connector"]), tuple(g["environments"]), access))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ConfigError(
                        f"{source}: principals.{name}.grants[{i}]: {exc}") from None
            key = spec.get("approval_key")
            if key is not None:
                from executor.approvals import check_public_key

                check_public_key(key, where=f"{source}: principals.{name}")
            principals[name] = Principal(name, tuple(spec.get("roles", [])), tuple(grants),
                                         str(key) if key is not None else None)
        return cls(principals, source)

    @classmethod
    def load(cls, path: str | Path) -> Grants:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{p}: grants file not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: {exc}") from None
        return cls.from_dict(data, str(p))

    def principal(self, name: str) -> Principal:
        return self.principals.get(name) or Principal(name)

    def check_call(self, who: str, row: Row, connector: str, environment: str) -> None:
        access = "write" if row.is_write else "read"
        if any(g.allows(connector, environment, access) for g in self.principal(who).grants):
            return
        raise NotAuthorized(
            f"{who!r} holds no {access} grant on connector {connector!r} in {environment!r} "
            f"(needed by {row.ref}; grants file {self.source})",
            principal=who, access=access, connector=connector, environment=environment,
        )

    def approval_problem(self, approval: Any, row_roles: tuple[str, ...]) -> str | None:
        """Why ``approval`` (an ``ApprovalRecord``) cannot be trusted now; None when it can.

        Checked against these grants: the approver's current key must have
        signed exactly this approval, and the approver must still hold a role
        the row accepts.
        """
        from executor.approvals import verify

        principal = self.principal(approval.approver)
        if approval.signature is None or approval.public_key is None:
            return "the approval is not signed"
        if principal.approval_key is None:
            return f"{approval.approver!r} has no approval_key in {self.source}"
        if approval.public_key != principal.approval_key:
            return f"signed with a key that is not {approval.approver!r}'s in {self.source}"
        fields = {"approval_id": approval.approval_id, "plan_hash": approval.plan_hash,
                  "approver": approval.approver, "role": approval.role,
                  "expires_at": approval.expires_text}
        if not verify(principal.approval_key, fields, approval.signature):
            return "the signature does not verify (the approval was altered or forged)"
        if approval.role not in row_roles:
            return f"role {approval.role!r} cannot approve this row"
        if approval.role not in principal.roles:
            return f"{approval.approver!r} no longer holds role {approval.role!r}"
        return None

    def check_approver(self, who: str, role: str, row_roles: tuple[str, ...]) -> None:
        if role not in row_roles:
            raise ApproverLacksRole(
                f"role {role!r} cannot approve this row (accepted: {', '.join(row_roles)})",
                approver=who, role=role, accepted=list(row_roles))
        if role not in self.principal(who).roles:
            raise ApproverLacksRole(f"{who!r} does not hold role {role!r} ({self.source})",
                                    approver=who, role=role)
