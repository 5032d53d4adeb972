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

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capgate.registry.errors import (
    ApproverLacksRole,
    CapgateError,
    ConfigError,
    GrantsFileInvalid,
    NotAuthorized,
)
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
    failure: CapgateError | None = None
    """Set when the grants file failed validation on a reload (``GrantsFileInvalid``):
    every call, plan and approval is refused with it -- nothing is granted meanwhile."""

    @classmethod
    def failed(cls, error: CapgateError, source: str) -> Grants:
        """Grants that grant nothing and refuse every use with ``error``."""
        return cls({}, source, error)

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
        """Read and check the grants file; a ``ConfigError`` names the file and line."""
        p = Path(path)
        try:
            text = p.read_text("utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{p}: grants file not found", path=str(p)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: cannot read the grants file: {exc}", path=str(p)) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            m = re.search(r"line (\d+)", str(exc))
            line = int(m.group(1)) if m else 1
            raise ConfigError(f"{p}:{line}: {exc}", path=str(p), line=line) from None
        try:
            return cls.from_dict(data, str(p))
        except ConfigError as exc:
            line = _line_of(text, exc.message)
            message = exc.message
            if message.startswith(f"{p}: "):
                message = message[len(f"{p}: "):]
            raise ConfigError(f"{p}:{line}: {message}", path=str(p), line=line) from None

    def principal(self, name: str) -> Principal:
        if self.failure is not None:
            return Principal(name)
        return self.principals.get(name) or Principal(name)

    def check_call(self, who: str, row: Row, connector: str, environment: str) -> None:
        if self.failure is not None:
            raise self.failure
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

        if self.failure is not None:
            return self.failure.message
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
        if self.failure is not None:
            raise self.failure
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


def _line_of(text: str, message: str) -> int:
    """The line of the principal a grants finding names (``principals.NAME``), else 1.

    ``tomllib`` keeps no positions; the finding's message names the principal,
    and its table header (``[principals.NAME]``) or key (``NAME = {...}``) is
    where a reader looks.
    """
    m = re.search(r"principals\.([^.:\s\[]+)", message)
    if m is None:
        return 1
    name = re.escape(m.group(1))
    header = re.compile(rf"^\s*\[\s*principals\s*\.\s*[\"']?{name}[\"']?\s*\]")
    key = re.compile(rf"^\s*[\"']?{name}[\"']?\s*=")
    found = None
    for number, line in enumerate(text.splitlines(), start=1):
        if header.match(line):
            return number
        if found is None and key.match(line):
            found = number
    return found or 1


def load_failing_closed(path: str | Path) -> Grants:
    """The grants file for a reload: its grants, or grants that refuse everything with a
    ``GrantsFileInvalid`` naming the file and line (the process keeps running)."""
    try:
        return Grants.load(path)
    except ConfigError as exc:
        error = GrantsFileInvalid(
            f"the grants file no longer validates, so every call, plan and approval is "
            f"refused until it does: {exc.message}; nothing was executed",
            path=str(path), line=exc.details.get("line"))
        return Grants.failed(error, str(path))
