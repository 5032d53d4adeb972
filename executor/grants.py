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

A role may be held for some environments only (simulation first, issue 16: the
promoting identity holds the role *for the target environment*)::

    roles = ["dba", { role = "release_manager", environments = ["staging", "prod"] }]
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capgate.registry.errors import ApproverLacksRole, ConfigError, NotAuthorized
from capgate.registry.model import Row


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
class ScopedRole:
    """A role held in some environments only (``{ role = "dba", environments = ["prod"] }``)."""

    role: str
    environments: tuple[str, ...]


@dataclass(frozen=True)
class Principal:
    name: str
    roles: tuple[str, ...] = ()
    """Roles held in every environment."""
    grants: tuple[Grant, ...] = ()
    approval_key: str | None = None
    """``ed25519:BASE64``: the public key this principal's approvals must be signed with."""
    scoped_roles: tuple[ScopedRole, ...] = ()
    """Roles held in the named environments only."""

    def holds(self, role: str, environment: str | None) -> bool:
        """Whether this principal holds ``role`` in ``environment`` (None: unscoped only)."""
        if role in self.roles:
            return True
        return environment is not None and any(
            s.role == role and environment in s.environments for s in self.scoped_roles)

    @property
    def role_names(self) -> tuple[str, ...]:
        """Every role held anywhere, scoped or not."""
        return tuple(dict.fromkeys([*self.roles, *(s.role for s in self.scoped_roles)]))


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
                from capgate.executor.approvals import check_public_key

                check_public_key(key, where=f"{source}: principals.{name}")
            roles, scoped = _roles(spec.get("roles", []), f"{source}: principals.{name}.roles")
            principals[name] = Principal(name, roles, tuple(grants),
                                         str(key) if key is not None else None, scoped)
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

    def approval_problem(self, approval: Any, row_roles: tuple[str, ...],
                         environment: str | None = None) -> str | None:
        """Why ``approval`` (an ``ApprovalRecord``) cannot be trusted now; None when it can.

        Checked against these grants: the approver's current key must have
        signed exactly this approval, and the approver must still hold a role
        the row accepts -- in ``environment``, the plan's, when the role is held
        for some environments only.
        """
        from capgate.executor.approvals import verify

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
        if not principal.holds(approval.role, environment):
            where = f" in {environment!r}" if environment else ""
            return f"{approval.approver!r} no longer holds role {approval.role!r}{where}"
        return None

    def scoped(self, who: str) -> bool:
        """Whether ``who`` holds any role for some environments only."""
        return bool(self.principal(who).scoped_roles)

    def check_approver(self, who: str, role: str, row_roles: tuple[str, ...],
                       environment: str | None = None) -> None:
        if role not in row_roles:
            raise ApproverLacksRole(
                f"role {role!r} cannot approve this row (accepted: {', '.join(row_roles)})",
                approver=who, role=role, accepted=list(row_roles))
        if not self.principal(who).holds(role, environment):
            where = f" in {environment!r}" if environment else ""
            raise ApproverLacksRole(f"{who!r} does not hold role {role!r}{where} "
                                    f"({self.source})", approver=who, role=role,
                                    environment=environment)


def _roles(raw: Any, where: str) -> tuple[tuple[str, ...], tuple[ScopedRole, ...]]:
    """``roles``: names held everywhere, and ``{ role, environments }`` tables held in some."""
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: must be a list of role names or "
                          "{ role = NAME, environments = [...] } tables")
    plain: list[str] = []
    scoped: list[ScopedRole] = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item:
            plain.append(item)
            continue
        if isinstance(item, dict) and set(item) == {"role", "environments"} \
                and isinstance(item["role"], str) and item["role"] \
                and isinstance(item["environments"], list) and item["environments"] \
                and all(isinstance(e, str) and e for e in item["environments"]):
            scoped.append(ScopedRole(item["role"], tuple(item["environments"])))
            continue
        raise ConfigError(f"{where}[{i}]: expected a role name or "
                          f"{{ role = NAME, environments = [...] }}, got {item!r}")
    return tuple(plain), tuple(scoped)
