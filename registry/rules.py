"""The capability lint rules as data: each names its error code, its title and its check.

Like ``ddl.prohibitions`` for DDL plans, every finding the registry's row
checks report (``registry.checks``, ``registry.dialect_checks``,
``registry.simulation_checks``) comes from one :class:`Rule` here, and the
checks take the code from the rule (``ctx.at(path, UNKNOWN_BIND.code, ...)``)
rather than writing it out: a code is named once, the table lists every rule
a capability file can break, and ``capgate explain CODE`` prints the rule's
documentation -- the docstring of the error class registered for its code.

A rule names the functions that report it as ``module:function`` strings,
resolved on demand: the table imports nothing, so the checks can import it
without a cycle and a call that loads its rows from the validation cache pays
for none of the checking modules.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """One lint rule: the code its findings carry, what it says, and where it is checked."""

    code: str
    """The registered error code of its findings (``registry.errors.lookup(code)``)."""
    title: str
    """What a capability file that breaks the rule got wrong, in one line."""
    checks: tuple[str, ...]
    """The functions that report it, as ``module:function``."""
    warning: bool = False
    """A warning: the row still loads (``CheckedFile.warnings``)."""

    def functions(self) -> list[Callable[..., Any]]:
        """The check functions themselves (their modules imported now)."""
        out = []
        for spec in self.checks:
            module, _, name = spec.partition(":")
            out.append(getattr(importlib.import_module(module), name))
        return out

    @property
    def doc(self) -> str:
        """The rule's documentation: what ``capgate explain CODE`` prints."""
        from capgate.registry.errors import explain

        return explain(self.code)


_ROW = "capgate.registry.checks:check_row"
_SHAPE = "capgate.registry.checks:_shape_checks"
_TIMEOUT = "capgate.registry.checks:_timeout_checks"
_EXAMPLES = "capgate.registry.checks:_example_checks"
_SIMULATION = "capgate.registry.simulation_checks:simulation_problems"

INVALID_VALUE = Rule("CG104", "a value the checks cannot accept: an invalid input JSON Schema, "
                     "an example outside its contract, a write authorised by a read grant, "
                     "an effect observed more than one way", (_ROW, _EXAMPLES, _SIMULATION))
UNKNOWN_BIND = Rule("CG110", "a :bind in the SQL names no input property", (_ROW,))
UNUSED_INPUT = Rule("CG111", "a required input is used by no SQL, target key or idempotency key",
                    (_ROW,))
OPEN_INPUT_CONTRACT = Rule("CG112", "the input contract is not `type: object` with "
                           "`additionalProperties: false`", (_ROW,))
MISSING_STATEMENTS = Rule("CG113", "a row lacks its statements or steps, or a statement its "
                          "expect_rows", (_ROW, _SHAPE))
MISSING_COMPENSATION = Rule("CG114", "a compensable row has no compensation statements", (_ROW,))
MISSING_APPROVER_ROLES = Rule("CG115", "a gated row names no approver roles, or a ddl row is "
                              "not gated", (_ROW, _SHAPE))
UNKNOWN_KEY_FIELD = Rule("CG116", "the idempotency key template is missing, malformed, or names "
                         "a field that is no input", (_ROW,))
WRITING_READ = Rule("CG117", "a read row or a read-only query writes", (_ROW,))
UNDECLARED_CONNECTOR = Rule("CG119", "the row's connector is not declared in its file", (_ROW,))
SQL_PARSE_ERROR = Rule("CG120", "a read-only query does not parse", (_ROW,))
UNKNOWN_TARGET_KEY = Rule("CG121", "a target key or dimension names no input property", (_ROW,))
SHAPE_MISMATCH = Rule("CG122", "the row's fields do not fit its effect class and shape",
                      (_SHAPE,))
UNKNOWN_STEP = Rule("CG123", "a check step's skip_to names no later step", (_SHAPE,))
POST_COMMIT_WITHOUT_COMPENSATION = Rule("CG124", "post_commit checks with no compensation to run",
                                        (_ROW,))
COMPENSATION_UNVERIFIABLE = Rule("CG125", "a compensation without compensation_verify, or the "
                                 "other way round", (_ROW,))
TIMEOUT_CLAIMS_ROLLBACK = Rule("CG126", "an irreversible row claims a timeout rolls it back",
                               (_TIMEOUT,))
UNSAFE_RETRY = Rule("CG127", "a row retried (or attempted again) that is not safe to repeat",
                    (_TIMEOUT,))
UNVERIFIABLE = Rule("CG128", "nothing can tell after the fact whether the effect landed: no "
                    "landed_probe", (_TIMEOUT,))
DIALECT_SQL_INVALID = Rule("CG170", "a SQL text does not parse for a dialect its connector "
                           "declares", ("capgate.registry.dialect_checks:dialect_problems",))
TRANSACTION_CONTROL_IN_WRITE = Rule("CG171", "a write statement commits, rolls back or runs DDL",
                                    ("capgate.registry.dialect_checks:transaction_control_problems",))
DATE_BOUND_AS_TEXT = Rule("CG172", "Oracle: a date input without `format: date` is bound as "
                          "text", ("capgate.registry.dialect_checks:dialect_warnings",),
                          warning=True)
LEASED_ON_ORACLE = Rule("CG173", "Oracle: a leased row is refused at call time",
                        ("capgate.registry.dialect_checks:dialect_warnings",), warning=True)
UNSAFE_FUNCTION = Rule("CG139", "read or verify SQL calls a function not known to be free of "
                       "side effects (and not in the row's allow_functions)",
                       ("capgate.registry.sql_functions:function_rule",))
READ_SQL_ACTS = Rule("CG144", "read or verify SQL writes a file, a variable or a table (INTO "
                     "OUTFILE, INTO @var), or is a PL/SQL block",
                     ("capgate.registry.sql_functions:into_rule",
                      "capgate.registry.sql_functions:_into_file",
                      "capgate.registry.sql_functions:read_findings"))
RETURNS_MISMATCH = Rule("CG680", "a statement's `returns` does not fit the statement",
                        (_SIMULATION,))
EFFECT_NAMES_NO_RETURN = Rule("CG681", "an expected effect's `returned` names no statement's "
                              "`returns`", (_SIMULATION,))

#: Every rule, by code.
RULES: tuple[Rule, ...] = (
    INVALID_VALUE, UNKNOWN_BIND, UNUSED_INPUT, OPEN_INPUT_CONTRACT, MISSING_STATEMENTS,
    MISSING_COMPENSATION, MISSING_APPROVER_ROLES, UNKNOWN_KEY_FIELD, WRITING_READ,
    UNDECLARED_CONNECTOR, SQL_PARSE_ERROR, UNKNOWN_TARGET_KEY, SHAPE_MISMATCH, UNKNOWN_STEP,
    POST_COMMIT_WITHOUT_COMPENSATION, COMPENSATION_UNVERIFIABLE, TIMEOUT_CLAIMS_ROLLBACK,
    UNSAFE_RETRY, UNVERIFIABLE, DIALECT_SQL_INVALID, TRANSACTION_CONTROL_IN_WRITE,
    DATE_BOUND_AS_TEXT, LEASED_ON_ORACLE, UNSAFE_FUNCTION, READ_SQL_ACTS, RETURNS_MISMATCH,
    EFFECT_NAMES_NO_RETURN,
)
BY_CODE: dict[str, Rule] = {r.code: r for r in RULES}
