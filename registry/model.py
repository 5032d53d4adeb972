"""The capability row's Python form: a tree of frozen dataclasses.

The YAML shape is validated by JSON Schema first (``capability.schema.json``);
``Row.from_dict`` then builds this tree, which the executor and the DDL loop
read.  Frozen, so a resolved row cannot be altered between plan and call; the
row's canonical hash (``row_hash``) is computed from the validated mapping and
recorded with every call.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any


class EffectClass(StrEnum):
    READ = "read"
    TRANSACTIONAL = "transactional"
    COMPENSABLE = "compensable"
    IRREVERSIBLE = "irreversible"
    DDL = "ddl"


class Shape(StrEnum):
    COLLAPSED = "collapsed"
    LEASED = "leased"


class AuthKind(StrEnum):
    READ_GRANT = "read_grant"
    WRITE_GRANT = "write_grant"
    GATE = "gate"


class OnTimeout(StrEnum):
    ROLLED_BACK = "rolled_back"
    UNKNOWN = "unknown"


class Recovery(StrEnum):
    RETRYABLE = "retryable"
    RECONCILE_FIRST = "reconcile_first"
    NEVER_RETRY = "never_retry"


_EFFECTS = {m.value: m for m in EffectClass}
_SHAPES = {m.value: m for m in Shape}
_AUTH_KINDS = {m.value: m for m in AuthKind}
_ON_TIMEOUTS = {m.value: m for m in OnTimeout}
_RECOVERIES = {m.value: m for m in Recovery}
_ATOMS = frozenset({str, int, bool, float, type(None)})


def _freeze(value: Any) -> Any:
    """Deep-freeze plain data (dicts become read-only mappings, lists tuples).

    Scalars are tested by exact type before any call (the common case: a row
    is mostly strings), and ABC ``isinstance`` checks come last.
    """
    kind = type(value)
    if kind is dict:
        return MappingProxyType(
            {k: v if type(v) in _ATOMS else _freeze(v) for k, v in value.items()})
    if kind is list or kind is tuple:
        return tuple([v if type(v) in _ATOMS else _freeze(v) for v in value])
    if kind in _ATOMS:
        return value
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _adopt(value: Any) -> Any:
    """``_freeze`` for data nobody else holds: dicts are wrapped in place, not copied.

    A loaded row's dicts are the loader's to give away; copying 130,000 of
    them for 10,000 rows (and freeing the originals) was a third of building
    the rows.
    """
    kind = type(value)
    if kind is dict:
        for k, v in value.items():
            if type(v) not in _ATOMS:
                value[k] = _adopt(v)  # replacing a value keeps the dict's size: safe mid-loop
        return MappingProxyType(value)
    if kind is list:
        return tuple([v if type(v) in _ATOMS else _adopt(v) for v in value])
    return _freeze(value)


def _member(members: Mapping[str, Any], kind: type[Any], value: Any) -> Any:
    """``kind(value)`` for a StrEnum, without ``EnumType.__call__`` in the common case."""
    found = members.get(value)
    return found if found is not None else kind(value)


def thaw(value: Any) -> Any:
    """The inverse of ``_freeze``: plain dicts and lists, e.g. for jsonschema or JSON."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class ExpectRows:
    """An expected row count: exact when ``minimum == maximum``; ``maximum`` None is open."""

    minimum: int
    maximum: int | None

    @classmethod
    def from_value(cls, value: Any) -> ExpectRows:
        if isinstance(value, int | float):  # JSON Schema's integer includes 1.0
            return cls(int(value), int(value))
        return cls(int(value["min"]), None if value.get("max") is None else int(value["max"]))

    def matches(self, count: int) -> bool:
        return count >= self.minimum and (self.maximum is None or count <= self.maximum)

    def to_value(self) -> int | dict[str, int]:
        if self.maximum == self.minimum:
            return self.minimum
        if self.maximum is None:
            return {"min": self.minimum}
        return {"min": self.minimum, "max": self.maximum}

    def __str__(self) -> str:
        if self.maximum == self.minimum:
            return str(self.minimum)
        if self.maximum is None:
            return f">= {self.minimum}"
        return f"{self.minimum}..{self.maximum}"


@dataclass(frozen=True)
class Expect:
    """What a query must return: a row count and/or its first value, or all its rows."""

    rows: ExpectRows | None = None
    value: Any = None
    has_value: bool = False
    values: tuple[tuple[Any, ...], ...] | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Expect:
        return cls(
            rows=ExpectRows.from_value(d["rows"]) if "rows" in d else None,
            value=thaw(d["value"]) if "value" in d else None,  # as written (a list stays a list)
            has_value="value" in d,
            values=tuple(tuple(r) for r in d["values"]) if "values" in d else None,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.rows is not None:
            out["rows"] = self.rows.to_value()
        if self.has_value:
            out["value"] = self.value
        if self.values is not None:
            out["values"] = [list(r) for r in self.values]
        return out


@dataclass(frozen=True)
class Returns:
    """The key a write statement returns (``RETURNING``, a generated key), as a named value.

    ``table`` is the table the statement writes and ``key`` the column whose
    values it returns; both are identifiers reviewed with the row (never
    inputs).  The values are recorded in the outcome under ``key``, bind later
    calls of the case, and drive the simulation's teardown: the keys an INSERT
    returned are exactly the rows it wrote.
    """

    table: str
    key: str


@dataclass(frozen=True)
class Statement:
    """One SQL statement with ``:name`` binds and its expected affected-row count."""

    sql: str
    expect_rows: ExpectRows | None
    name: str | None = None
    returns: Returns | None = None
    """The key this statement returns (simulation first, issue 16); None: it returns none."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Statement:
        returns = d.get("returns")
        return cls(
            sql=d["sql"],
            expect_rows=ExpectRows.from_value(d["expect_rows"]) if "expect_rows" in d else None,
            name=d.get("name"),
            returns=Returns(returns["table"], returns["key"]) if returns else None,
        )

    @property
    def verb(self) -> str:
        """The statement's first keyword, upper-case (``INSERT``, ``UPDATE``...).

        Validation (CG680) holds a statement with ``returns`` to be exactly one
        INSERT, UPDATE or DELETE whose first keyword says so, so this cheap
        reading is the parser's answer too.
        """
        return leading_keyword(self.sql)


_COMMENT = re.compile(r"\A(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.S)


def leading_keyword(sql: str) -> str:
    lead = _COMMENT.match(sql)  # the pattern matches every text (possibly empty)
    word = re.match(r"[A-Za-z]+", sql[lead.end() if lead else 0:])
    return word.group(0).upper() if word else ""


@dataclass(frozen=True)
class Check:
    """A named query and what it must return (verify and post-commit checks)."""

    name: str
    sql: str
    expect: Expect

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Check:
        return cls(name=d["name"], sql=d["sql"], expect=Expect.from_dict(d["expect"]))


@dataclass(frozen=True)
class Step:
    """A leased step: a statement, a branching check, or a registered function.

    A check whose expectation fails either aborts (``abort`` is the reason) or
    skips forward to the step named ``skip_to``.
    """

    name: str
    sql: str | None = None
    expect_rows: ExpectRows | None = None
    check: str | None = None
    expect: Expect | None = None
    abort: str | None = None
    skip_to: str | None = None
    function: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        otherwise = d.get("otherwise") or {}
        return cls(
            name=d["name"],
            sql=d.get("sql"),
            expect_rows=ExpectRows.from_value(d["expect_rows"]) if "expect_rows" in d else None,
            check=d.get("check"),
            expect=Expect.from_dict(d["expect"]) if "expect" in d else None,
            abort=otherwise.get("abort"),
            skip_to=otherwise.get("skip_to"),
            function=d.get("function"),
        )


@dataclass(frozen=True)
class Target:
    """Target identity; impact keys are (environment, system, object, key values)."""

    system: str
    object: str
    keys: tuple[str, ...] = ()
    dimensions: tuple[tuple[str, str], ...] = ()
    """``(dimension, input)`` pairs -- ``product``, ``version``, ``account``, ``route`` --
    the row affects as a whole (issue 17): each adds a coarser impact key
    (``environment/system/product=P/version=V``...), so two cases changing one product,
    account or route collide even when their objects differ."""


@dataclass(frozen=True)
class Symptom:
    """What the screen shows for the target (issue 17): a read-only query over the inputs.

    A case registers the symptom it starts from; capgate re-reads it before a
    write (the fix) and at a checkpoint (the send), and records
    ``changed_outside_case`` when it differs.  ``actor_sql`` says who changed
    the target last, where the target can say (a last-modified-by column).
    """

    sql: str
    max_rows: int | None = None
    actor_sql: str | None = None


@dataclass(frozen=True)
class Authorization:
    kind: AuthKind
    approver_roles: tuple[str, ...] = ()
    four_eyes: bool = False
    approval_ttl_seconds: int = 3600


@dataclass(frozen=True)
class Timeout:
    seconds: float
    on_timeout: OnTimeout
    """What a timeout or a lost connection means for the effect: ``rolled_back`` (all of
    it inside the transaction the server rolls back) or ``unknown`` (it may have
    escaped: a reconciliation task holds the case)."""
    lock_seconds: float | None = None
    attempts: int = 1
    """How many attempts an idempotent, retryable row gets after a timeout whose
    effect is known rolled back (the same intent and key each time)."""


@dataclass(frozen=True)
class Replay:
    sql: str
    expect: Expect | None = None
    max_rows: int | None = None


@dataclass(frozen=True)
class Probe:
    """A query that tells after the fact whether the effect is present."""

    sql: str
    expect: Expect


EFFECT_CLASSES = ("sequence", "trigger_callout", "autonomous_audit", "queue_message", "document",
                  "numbering", "external_registration", "workflow", "cache")
"""The kinds of effect no transaction covers (seed 001 §2), as ``expected_effects`` name them."""
CUSTOMER_FACING_EFFECTS = frozenset({"trigger_callout", "queue_message", "document",
                                     "external_registration", "workflow"})
"""Effect classes that reach beyond the database: customer-visible unless the row says not."""


@dataclass(frozen=True)
class ExpectedEffect:
    """An effect no transaction covers, declared so that it is recorded, not forgotten.

    How it is observed is exactly one of: ``probe`` (a query that finds it after
    the fact: the effect is *verifiable*), ``returned`` (the named value a
    statement returns shows it, e.g. the identity value consumed) or
    ``unobservable`` (why nothing can see it).
    """

    name: str
    effect_class: str
    description: str
    probe: Probe | None = None
    returned: str | None = None
    unobservable: str | None = None
    customer_visible: bool | None = None
    """As declared; None: not declared (then the class decides, see ``visible``)."""

    @property
    def verifiable(self) -> bool:
        """Whether the effect can be verified after the fact: it has a probe."""
        return self.probe is not None

    @property
    def visible(self) -> bool:
        """Customer-visible: as declared, else by class (documents, messages, callouts...)."""
        if self.customer_visible is not None:
            return self.customer_visible
        return self.effect_class in CUSTOMER_FACING_EFFECTS

    @property
    def observed_by(self) -> str:
        if self.probe is not None:
            return "probe"
        return f"returned {self.returned}" if self.returned else "unobservable"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "class": self.effect_class, "description": self.description,
                "observed_by": self.observed_by, "verifiable": self.verifiable,
                "customer_visible": self.visible,
                **({"unobservable": self.unobservable} if self.unobservable else {})}


@dataclass(frozen=True)
class ContextItem:
    """Something the caller must know before using the operation (``required_context``)."""

    name: str
    description: str


@dataclass(frozen=True)
class DeclaredPoint:
    """An exemption point the executor cannot compute: declared on the row, shown to the
    reviewer, recorded in the plan as a claim."""

    holds: bool
    because: str


@dataclass(frozen=True)
class BaselineQuery:
    name: str
    sql: str


@dataclass(frozen=True)
class SimulationSpec:
    """``simulation:``: what the simulation cycle and the exemption test need from the row."""

    baseline: tuple[BaselineQuery, ...] = ()
    """Read before the first write and re-read after the teardown (with the target's rows)."""
    target_baseline: bool = True
    """Whether the rows the target names (``SELECT * FROM object WHERE key = :key``) are
    part of the baseline; false for a target object that is not a table."""
    no_downstream_consumer: DeclaredPoint | None = None
    """Exemption point 4, declared: nothing reads it that is not part of the same change."""
    no_customer_visible_effect: DeclaredPoint | None = None
    """Exemption point 5, declared (the row's expected effects are checked too)."""
    reconciliation: Check | None = None
    """The named reconciliation query a production simulation runs the same business day."""


@dataclass(frozen=True)
class DdlObject:
    type: str
    name: str


@dataclass(frozen=True)
class AcceptedWarning:
    """A checker finding the DBA reviewed and accepts (e.g. a plpgsql_check false positive)."""

    object: str
    """``kind:name`` of the object it is reported on."""
    message: str
    """Text the finding contains."""
    reason: str
    """Why it is accepted, shown in plans and verdicts."""

    def to_dict(self) -> dict[str, str]:
        return {"object": self.object, "message": self.message, "reason": self.reason}


@dataclass(frozen=True)
class FarSideStep:
    """A named check of a remote dependent on the far side, with its assertion."""

    name: str
    dependent: str
    assertion: str
    expect: Any = 1
    recompile: bool = True


@dataclass(frozen=True)
class FarSide:
    """A far-side database (a configured connector) that uses this connector's objects
    through a database link (Oracle) or a foreign server (PostgreSQL) named ``link``."""

    connector: str
    link: str
    dependents: tuple[str, ...] = ()
    steps: tuple[FarSideStep, ...] = ()


@dataclass(frozen=True)
class DdlScope:
    objects: tuple[DdlObject, ...]
    pattern: str | None = None
    accepted_warnings: tuple[AcceptedWarning, ...] = ()
    far_side: tuple[FarSide, ...] = ()


@dataclass(frozen=True)
class Example:
    name: str
    input: Mapping[str, Any]
    expect_rows: tuple[ExpectRows, ...] | None = None
    outcome: str = "applied_verified"


@dataclass(frozen=True)
class Row:
    """One ``(operation_id, version)`` capability, as reviewed by a DBA."""

    operation_id: str
    """The name a caller calls (``policy.add_note``); with ``version``, the row's identity."""
    version: int
    """The row's version: a changed row is a new version, reviewed and locked on its own."""
    connector: str
    """The configured connector (target database) the row's SQL runs on."""
    description: str
    """What the operation does, in the DBA's words: shown to callers and on the review card."""
    input: Mapping[str, Any]
    """The JSON Schema every call's inputs must satisfy before any SQL is sent; its
    properties are the only names the SQL may bind."""
    target: Target
    """The business object the row changes or reads (system, table, key inputs): the
    impact key that claims, symptoms and coordination are keyed by."""
    effect_class: EffectClass
    """What a call can do to the database: read, transactional, compensable, irreversible
    or ddl -- it decides which fields are required and how a failure is undone."""
    authorization: Authorization
    """Which grant a call needs (read, write, or a gate with approver roles and four eyes)."""
    environments: tuple[str, ...]
    """The environments (dev, qa, staging, prod) whose connectors may run the row."""
    timeout: Timeout
    """How long the statements may run (and wait for locks), and what a timeout means:
    rolled back, or unknown until reconciled."""
    recovery: Recovery
    """What may follow a failure: retry at once, reconcile first, or never retry."""
    row_hash: str
    """The SHA-256 of the row's canonical JSON: what the lock pins and an approval binds."""
    source_path: str
    """The capability file the row was read from (for findings and the review card)."""
    source_line: int
    """The line in ``source_path`` where the row starts."""
    shape: Shape | None = None
    """A write's shape: ``collapsed`` (one transaction: apply, verify, replay, commit) or
    ``leased`` (ordered steps under a lease).  None for reads and ddl rows."""
    retired: bool = False
    """Kept in the registry for the ledger's sake, refused at call time."""
    idempotency_key: str | None = None
    """The template (``{case}:{operation_id}:{policy_id}``) of the key written with the
    effect as its landing marker: a repeat with the same key is answered, not applied again."""
    idempotent: bool = False
    """Declared safe to repeat (the MCP ``idempotentHint``): a retry cannot double the effect."""
    accepts_caller_key: bool = False
    """Whether a caller may add its own key (``capgate call --key``); it is combined with
    the row's reviewed template, never substituted for it."""
    max_rows: int | None = None
    """A read's row cap: the executor fetches at most this many rows."""
    statements: tuple[Statement, ...] = ()
    """A collapsed write's SQL, run in order in one transaction, each with the row count it
    must affect (else the transaction rolls back)."""
    steps: tuple[Step, ...] = ()
    """A leased write's ordered steps: statements, checks that branch, step functions."""
    verify: tuple[Check, ...] = ()
    """Queries run in the same session after the statements and before COMMIT; one that
    fails rolls the write back."""
    replay: Replay | None = None
    """The consuming query (what the application would read), re-run in the write's session
    before COMMIT: its rows are the evidence of what the caller will see."""
    landed_probe: Probe | None = None
    """A query that tells after the fact whether the effect is present: how ``resume``
    settles a call whose outcome was lost (required for irreversible rows)."""
    symptom: Symptom | None = None
    """What the screen shows for the target, re-read before the fix and at a checkpoint."""
    compensation: tuple[Statement, ...] = ()
    """For compensable rows: the reviewed statements that undo a committed effect."""
    post_commit: tuple[Check, ...] = ()
    """Checks that can only run after COMMIT; a failure runs the compensation."""
    compensation_verify: tuple[Check, ...] = ()
    """Checks run after the compensation committed: a re-read of the restored state.
    Only when they pass is the outcome ``compensated``."""
    evidence: tuple[str, ...] = ()
    """What the result of a call returns as evidence (counts, verify results, replay rows)."""
    ddl: DdlScope | None = None
    """For ddl rows: the stored-code objects the row may change, and the checker warnings
    and far-side dependents declared for them."""
    examples: tuple[Example, ...] = ()
    """Calls ``capgate rehearse`` runs (rolled back) with the outcome each must have."""
    expected_effects: tuple[ExpectedEffect, ...] = ()
    """Effects no transaction covers (issue 16): listed by ``show`` and the MCP tool."""
    required_context: tuple[ContextItem, ...] = ()
    """What must be known, and is shown to the caller, before the operation is used."""
    simulation: SimulationSpec | None = None
    """How the row is simulated first: baseline queries, the declared exemption points,
    the reconciliation query."""
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The row as written in its file (frozen plain data): what ``row_hash`` is computed
    from and what ``to_dict`` returns."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.operation_id, self.version)

    @functools.cached_property
    def date_inputs(self) -> frozenset[tuple[str, str]]:
        """``(input, "date" | "date-time")`` for each top-level input declared with that
        JSON Schema ``format``: the executor binds them as dates where a dialect needs it
        (Oracle compares a string with a DATE through the session's ``NLS_DATE_FORMAT``)."""
        props = self.input.get("properties")
        if not isinstance(props, Mapping):
            return frozenset()
        return frozenset((str(name), str(spec["format"])) for name, spec in props.items()
                         if isinstance(spec, Mapping)
                         and spec.get("format") in ("date", "date-time"))

    @property
    def safe_to_repeat(self) -> bool:
        """A repeat with the same key cannot double the effect: declared ``idempotent``,
        or a transactional write, which its landing marker deduplicates."""
        return self.idempotent or self.effect_class is EffectClass.TRANSACTIONAL

    @property
    def timeout_action(self) -> str:
        """What the executor does when a call of this row times out or loses its connection.

        The spec's effect-of-timeout contract, decided by the row:

        * ``reconcile`` -- ``on_timeout: unknown``: the effect may have escaped
          the transaction, so the intent stays open, holding the case, until
          ``capgate resume`` has established what landed;
        * ``retry`` -- the rollback is known, the row is ``retryable``, safe to
          repeat and has ``timeout.attempts`` > 1: attempted again at once,
          same intent and key, up to that many attempts;
        * ``record`` -- otherwise: the rollback is the outcome (``never_retry``
          rows are never attempted again).
        """
        if self.timeout.on_timeout is OnTimeout.UNKNOWN:
            return "reconcile"
        if self.recovery is Recovery.RETRYABLE and self.safe_to_repeat \
                and self.timeout.attempts > 1:
            return "retry"
        return "record"

    def timeout_meaning(self) -> str:
        """One line for the review card and the MCP tool description."""
        seconds = f"{self.timeout.seconds:g} s"
        if self.effect_class is EffectClass.READ:
            return f"after {seconds} the read is cancelled; nothing changes"
        action = self.timeout_action
        if action == "reconcile":
            return (f"after {seconds} (or a lost connection) the outcome is unknown: the case "
                    "is held until `capgate resume` has established what landed")
        if action == "retry":
            return (f"after {seconds} the transaction is rolled back and attempted again at "
                    f"once with the same key (up to {self.timeout.attempts} attempts)")
        then = {Recovery.NEVER_RETRY: "never retried",
                Recovery.RECONCILE_FIRST: "a retry is safe once reconciled",
                Recovery.RETRYABLE: "safe to call again with the same key"}[self.recovery]
        return f"after {seconds} (or a lost connection) the transaction is rolled back; {then}"

    @property
    def ref(self) -> str:
        return f"{self.operation_id}@{self.version}"

    @property
    def is_write(self) -> bool:
        return self.effect_class is not EffectClass.READ

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, row_hash: str, source_path: str = "",
                  source_line: int = 0, adopt: bool = False) -> Row:
        """Build the tree from a mapping that already passed the JSON Schema.

        ``adopt``: ``d`` is the caller's to give away (the loader's freshly
        parsed rows); it is frozen in place instead of copied, so it must not
        be used afterwards.
        """
        auth = d["authorization"]
        timeout = d["timeout"]
        replay = d.get("replay")
        probe = d.get("landed_probe")
        symptom = d.get("symptom")
        ddl = d.get("ddl")
        effect = _member(_EFFECTS, EffectClass, d["effect_class"])
        # frozen once; the input contract and example inputs are shared with it
        raw = _adopt(d) if adopt and type(d) is dict else _freeze(d)
        d = raw
        return cls(
            operation_id=d["operation_id"],
            version=int(d["version"]),
            connector=d["connector"],
            description=d["description"].strip(),
            input=raw["input"],
            target=Target(
                system=d["target"]["system"],
                object=d["target"]["object"],
                keys=tuple(d["target"].get("keys", ())),
                dimensions=tuple((str(k), str(v)) for k, v in
                                 (d["target"].get("dimensions") or {}).items()),
            ),
            effect_class=effect,
            authorization=Authorization(
                kind=_member(_AUTH_KINDS, AuthKind, auth["kind"]),
                approver_roles=tuple(auth.get("approver_roles", ())),
                four_eyes=bool(auth.get("four_eyes", False)),
                approval_ttl_seconds=int(auth.get("approval_ttl_seconds", 3600)),
            ),
            environments=tuple(d["environments"]),
            timeout=Timeout(
                seconds=float(timeout["seconds"]),
                on_timeout=_member(_ON_TIMEOUTS, OnTimeout, timeout["on_timeout"]),
                lock_seconds=(
                    float(timeout["lock_seconds"]) if "lock_seconds" in timeout else None
                ),
                attempts=int(timeout.get("attempts", 1)),
            ),
            recovery=_member(_RECOVERIES, Recovery, d["recovery"]),
            row_hash=row_hash,
            source_path=source_path,
            source_line=source_line,
            shape=_member(_SHAPES, Shape, d["shape"]) if "shape" in d else None,
            retired=bool(d.get("retired", False)),
            idempotency_key=d.get("idempotency_key"),
            idempotent=bool(d.get("idempotent", effect is EffectClass.READ)),
            accepts_caller_key=bool(d.get("accepts_caller_key", False)),
            max_rows=d.get("max_rows"),
            statements=tuple(Statement.from_dict(s) for s in d.get("statements", ())),
            steps=tuple(Step.from_dict(s) for s in d.get("steps", ())),
            verify=tuple(Check.from_dict(c) for c in d.get("verify", ())),
            replay=(
                Replay(
                    sql=replay["sql"],
                    expect=Expect.from_dict(replay["expect"]) if "expect" in replay else None,
                    max_rows=replay.get("max_rows"),
                )
                if replay
                else None
            ),
            landed_probe=(
                Probe(sql=probe["sql"], expect=Expect.from_dict(probe["expect"])) if probe else None
            ),
            symptom=(
                Symptom(sql=symptom["sql"], max_rows=symptom.get("max_rows"),
                        actor_sql=(symptom.get("actor") or {}).get("sql"))
                if symptom else None
            ),
            compensation=tuple(Statement.from_dict(s) for s in d.get("compensation", ())),
            post_commit=tuple(Check.from_dict(c) for c in d.get("post_commit", ())),
            compensation_verify=tuple(Check.from_dict(c)
                                      for c in d.get("compensation_verify", ())),
            evidence=tuple(d.get("evidence", ())),
            ddl=(
                DdlScope(
                    objects=tuple(DdlObject(o["type"], o["name"]) for o in ddl["objects"]),
                    pattern=ddl.get("pattern"),
                    accepted_warnings=tuple(
                        AcceptedWarning(a["object"], a["message"], a["reason"])
                        for a in ddl.get("accepted_warnings", ())),
                    far_side=tuple(
                        FarSide(f["connector"], f["link"], tuple(f.get("dependents", ())),
                                tuple(FarSideStep(st["name"], st["dependent"], st["assertion"],
                                                  st.get("expect", 1),
                                                  bool(st.get("recompile", True)))
                                      for st in f.get("steps", ())))
                        for f in ddl.get("far_side", ())),
                )
                if ddl
                else None
            ),
            expected_effects=tuple(_effect(e) for e in d.get("expected_effects", ())),
            required_context=tuple(ContextItem(c["name"], c["description"].strip())
                                   for c in d.get("required_context", ())),
            simulation=_simulation(d["simulation"]) if "simulation" in d else None,
            examples=tuple(
                Example(
                    name=e["name"],
                    input=e["input"],
                    expect_rows=(
                        tuple(ExpectRows.from_value(x) for x in e["expect_rows"])
                        if "expect_rows" in e
                        else None
                    ),
                    outcome=e.get("outcome", "applied_verified"),
                )
                for e in raw.get("examples", ())
            ),
            raw=raw,
        )

    def to_dict(self) -> dict[str, Any]:
        """The validated mapping the row was built from (its reviewed YAML shape)."""
        out: dict[str, Any] = thaw(self.raw)
        return out


def _effect(d: Mapping[str, Any]) -> ExpectedEffect:
    probe = d.get("probe")
    return ExpectedEffect(
        name=d["name"], effect_class=d["class"], description=d["description"].strip(),
        probe=Probe(probe["sql"], Expect.from_dict(probe.get("expect") or {"rows": {"min": 0}}))
        if probe else None,
        returned=d.get("returned"), unobservable=d.get("unobservable"),
        customer_visible=d.get("customer_visible"))


def _declared(d: Mapping[str, Any] | None) -> DeclaredPoint | None:
    return DeclaredPoint(bool(d["holds"]), str(d["because"]).strip()) if d else None


def _simulation(d: Mapping[str, Any]) -> SimulationSpec:
    exemption = d.get("exemption") or {}
    return SimulationSpec(
        baseline=tuple(BaselineQuery(q["name"], q["sql"]) for q in d.get("baseline", ())),
        target_baseline=bool(d.get("target_baseline", True)),
        no_downstream_consumer=_declared(exemption.get("no_downstream_consumer")),
        no_customer_visible_effect=_declared(exemption.get("no_customer_visible_effect")),
        reconciliation=Check.from_dict(d["reconciliation"]) if "reconciliation" in d else None)
