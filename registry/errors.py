"""One exception tree for every refusal capgate makes.

Each class registers a stable machine-readable ``code`` (``CG1xx`` registry,
``CG2xx`` authorization and gates, ``CG3xx`` execution, ``CG4xx``
reconciliation and ledger, ``CG5xx`` DDL, ``CG9xx`` configuration) and the CLI
exit code it maps to.  The class docstring is the long explanation that
``capgate explain CODE`` prints, so it says what failed and how to fix it.

Details travel as attributes (``details``), not only in the message, so that
the CLI's ``--json`` output and the MCP server can hand them to a machine.

This module lives in ``registry`` because ``registry`` is the lowest layer:
``executor`` and ``ddl`` import it, and it imports nothing of theirs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from registry.excerpt import bounded, cut

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNKNOWN = 3
EXIT_APPROVAL_REQUIRED = 4
EXIT_INTERNAL = 5

_BY_CODE: dict[str, type[CapgateError]] = {}


class CapgateError(Exception):
    """The root of every error capgate raises on purpose.

    Catch this one class to handle any refusal; read ``code`` to tell them
    apart, ``exit_code`` to map to a process status and ``details`` for the
    structured facts behind the message.
    """

    code: ClassVar[str] = "CG000"
    exit_code: ClassVar[int] = EXIT_REFUSED
    retryable: ClassVar[bool] = False

    def __init_subclass__(
        cls,
        code: str | None = None,
        exit_code: int | None = None,
        retryable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            if code in _BY_CODE:
                raise TypeError(f"error code {code} is already taken by {_BY_CODE[code].__name__}")
            cls.code = code
            _BY_CODE[code] = cls
        if exit_code is not None:
            cls.exit_code = exit_code
        if retryable is not None:
            cls.retryable = retryable

    def __init__(self, message: str, **details: Any) -> None:
        # never the whole of a huge value: an error travels to CLIs, MCP clients and
        # ledger records (registry.excerpt)
        message = cut(message, 4000)
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = bounded(details)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """The shape the CLI prints with ``--json`` and the MCP server returns."""
        return {
            "error": type(self).__name__,
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
            "details": self.details,
        }


def lookup(code: str) -> type[CapgateError]:
    """Return the class registered for ``code`` (e.g. ``"CG140"``)."""
    try:
        return _BY_CODE[code.upper()]
    except KeyError:
        raise UnknownErrorCode(f"no error has code {code!r}; see `capgate explain --all`") from None


def all_codes() -> list[type[CapgateError]]:
    """Every registered error class, ordered by code."""
    return [_BY_CODE[k] for k in sorted(_BY_CODE)]


def explain(code: str) -> str:
    """The long explanation of one code, taken from its class docstring."""
    import inspect  # here, not at the top: every command imports this module at start

    cls = lookup(code)
    doc = inspect.cleandoc(cls.__doc__ or "")
    return f"{cls.code} {cls.__name__} (exit {cls.exit_code})\n\n{doc}\n"


class InternalError(CapgateError, code="CG999", exit_code=EXIT_INTERNAL):
    """capgate failed in a way it did not foresee: a bug in capgate, not a mistake of yours.

    The message names the exception and says whether the case was left with an
    open intent (then ``capgate resume CASE`` settles it from evidence before
    more work runs in the case).  Report it with the output of the same command
    run with ``--traceback``.
    """


class UsageError(CapgateError, code="CG900", exit_code=EXIT_USAGE):
    """The command was called wrongly: a missing argument, a malformed value.

    Read the command's ``--help`` and call it again.
    """


class UnknownErrorCode(UsageError, code="CG901"):
    """``capgate explain`` was given a code that no error carries.

    ``capgate explain --all`` lists every code.
    """


class ConfigError(CapgateError, code="CG902", exit_code=EXIT_USAGE):
    """The configuration (``capgate.toml`` or its environment overrides) is invalid.

    The message names the file and the key.  Fix the value; nothing was
    executed.
    """


# --- getting started and ``capgate doctor`` (CG903-CG919; issue 12) ------------------


class ConfigMissing(ConfigError, code="CG903"):
    """The command needs a configuration and none was found.

    capgate looks for ``capgate.toml`` in the working directory, the file named
    by ``--config`` or ``CAPGATE_CONFIG``, or configuration in the environment
    (``CAPGATE_LEDGER_URL``, ``CAPGATE_CONNECTOR_<NAME>_URL``, ...).  Nothing
    was created.  ``capgate init DIR`` scaffolds a working project; ``cd`` into
    it, or pass ``--config DIR/capgate.toml``.
    """


class ProjectExists(UsageError, code="CG904"):
    """``capgate init`` would overwrite files of an existing project.

    It names the files it found and changed nothing.  Choose an empty or new
    folder, or remove the files first.
    """


class GrantUnknownConnector(ConfigError, code="CG910"):
    """A grant names a connector that the configuration does not define.

    Such a grant lets nobody do anything, and usually hides a typo: fix the
    connector name in the grants file (or define the connector), or use
    ``"*"`` for every connector.
    """


class GrantUnknownRole(ConfigError, code="CG911"):
    """A principal holds a role that no capability row accepts as an approver role.

    The role can approve nothing; usually the role name has a typo.  Rows name
    their approver roles in ``authorization.approver_roles``.
    """


class EnvironmentMismatch(ConfigError, code="CG912"):
    """Rows are hidden because environment labels do not agree.

    A row runs on a connector only when the connector's ``environment`` is one
    of the row's ``environments``, and the caller's grant covers that
    environment.  When they disagree the MCP server lists no tool for the row
    and a call is refused.  Make the connector's label, the rows' environments
    and the grants name the same environment.
    """


class SessionLimitTooLow(ConfigError, code="CG913"):
    """The database allows fewer sessions than the connector's ``session_budget``.

    capgate would open sessions up to its budget and the database would refuse
    the last ones (ORA-02391, a role's ``CONNECTION LIMIT``, MariaDB's
    ``max_user_connections``).  Lower ``session_budget`` (and
    ``db_user_budget``) below the database's limit, or raise the limit.
    """


class PrivilegeMissing(ConfigError, code="CG914"):
    """The connector's account lacks a privilege that the declared rows need.

    The finding names the table or object, the privilege and the rows that
    need it.  Grant it, or remove the rows from the connector.
    """


class ExtensionMissing(ConfigError, code="CG915"):
    """A database extension that declared rows need is not installed.

    On PostgreSQL the DDL loop takes the compile status of stored code from
    ``plpgsql_check``: install its package (``postgresql-NN-plpgsql-check``)
    and run ``CREATE EXTENSION plpgsql_check`` in the target database.
    """


class CommitOutcomeUnavailable(ConfigError, code="CG916"):
    """The database cannot say after a lost connection whether a COMMIT landed.

    On Oracle, Transaction Guard answers it: the service needs
    ``COMMIT_OUTCOME = TRUE`` (``DBMS_SERVICE.MODIFY_SERVICE``) and the
    account ``EXECUTE`` on ``DBMS_APP_CONT``.  Without it resume falls back on
    the landing marker and may have to answer ``unknown``.
    """


class DriverUnsupported(ConfigError, code="CG917"):
    """The installed database driver is too old for what capgate relies on.

    On Oracle capgate needs python-oracledb 3.0 or later: 2.5 added the Thin
    mode's ``session_id`` and ``serial_num`` and 3.0 its logical transaction id
    (``ltxid``, Transaction Guard); an older Thin driver reports an empty LTXID,
    so a commit outcome would silently never be asked for.  Upgrade the driver
    (``pip install -U oracledb``).
    """


class SecretInUrl(ConfigError, code="CG918"):
    """A connector's URL carries a secret in its query string (e.g. ``wallet_password``).

    A URL is printed, recorded in plans and named in DDL plan targets; only its
    password part is ever hidden.  Put the secret in the connector's
    ``connect_args`` with ``{ env = "VARIABLE" }`` so that it is read from the
    environment when the connector opens and never written anywhere.
    """


class DriverModeConflict(ConfigError, code="CG919"):
    """Oracle connectors of one configuration ask for different python-oracledb modes.

    python-oracledb runs in Thin or Thick mode for the whole process, decided
    before the first connection (``oracledb.init_oracle_client()``).  Give every
    Oracle connector the same ``thick_mode`` setting (and the same Oracle
    Client library directory), or run them in separate processes.
    """


# --- registry (CG1xx) --------------------------------------------------------


class RegistryError(CapgateError, code="CG100"):
    """A capability file could not be loaded or is invalid.

    Each problem is reported as ``path:line:col: CODE: field: message``; fix
    them in the file and run ``capgate validate`` again.  An invalid file
    registers nothing.
    """

    def __init__(self, message: str, problems: list[Problem] | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.problems: list[Problem] = problems or []

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["problems"] = [p.to_dict() for p in self.problems]
        return d


class Problem:
    """One located finding in a capability file (not an exception itself)."""

    __slots__ = ("code", "col", "field", "line", "message", "path")

    def __init__(self, path: str, line: int, col: int, code: str, field: str, message: str):
        self.path = path
        self.line = line
        self.col = col
        self.code = code
        self.field = field
        self.message = message

    def render(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code}: {self.field}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "code": self.code,
            "field": self.field,
            "message": self.message,
        }

    def __repr__(self) -> str:
        return f"Problem({self.render()!r})"


# Codes for located findings.  They are registered as classes so that
# ``capgate explain`` knows them; the loader reports them as Problems.


class YamlSyntax(RegistryError, code="CG101"):
    """The file is not valid YAML (or uses a duplicate key, an alias, a tag).

    Fix the syntax at the reported line; capability files use plain block YAML.
    """


class UnknownKey(RegistryError, code="CG102"):
    """A key that the capability schema does not know.

    Unknown keys are errors so that a typo (``expect_row``) never silently
    drops a check.  See the capability file format in the README.
    """


class MissingField(RegistryError, code="CG103"):
    """A required field is missing from a row or one of its parts."""


class InvalidValue(RegistryError, code="CG104"):
    """A field has the wrong type or a value outside what the schema allows.

    The message says what was expected and what was found, e.g. an expected
    row count must be an integer or a range ``{min: 0, max: 1}``.
    """


class UnknownBind(RegistryError, code="CG110"):
    """A ``:bind`` in SQL names no input property.

    Every bind must be declared in the row's ``input.properties``; inputs are
    the only values SQL can take, and they are always bound, never spliced.
    """


class UnusedInput(RegistryError, code="CG111"):
    """A required input is used by no statement, check, target or key.

    An input nobody reads is usually a typo in a bind name; remove it or use it.
    """


class OpenInputContract(RegistryError, code="CG112"):
    """The row's ``input`` schema does not say ``additionalProperties: false``.

    An open contract would accept fields the reviewer never saw.
    """


class MissingStatements(RegistryError, code="CG113"):
    """A write row has no statements, or a statement has no expected count.

    Every writing statement declares ``expect_rows`` (an integer or a range);
    a mismatch at run time rolls the call back.
    """


class MissingCompensation(RegistryError, code="CG114"):
    """A ``compensable`` row declares no ``compensation`` statements.

    Compensation must be written (and reviewed) before the write runs.
    """


class MissingApproverRoles(RegistryError, code="CG115"):
    """A ``gate`` row names no ``approver_roles``; nobody could approve it."""


class UnknownKeyField(RegistryError, code="CG116"):
    """The ``idempotency_key`` template names a field that is not an input.

    Allowed fields are ``{case}``, ``{operation_id}``, ``{version}`` and the
    row's input properties.
    """


class WritingRead(RegistryError, code="CG117"):
    """A ``read`` row (or a verify, replay or probe query) contains a writing statement.

    Reads run in a read-only transaction; move the write to a write row.
    """


class DuplicateRow(RegistryError, code="CG118"):
    """Two rows share the same ``(operation_id, version)``."""


class UndeclaredConnector(RegistryError, code="CG119"):
    """A row names a ``connector`` that its file does not declare under ``connectors:``."""


class SqlParseError(RegistryError, code="CG120"):
    """A SQL text could not be parsed, so its effect cannot be classified."""


class UnknownTargetKey(RegistryError, code="CG121"):
    """``target.keys`` or ``target.dimensions`` names a field that is not an input property.

    A ``version`` dimension also needs its ``product``: the impact key it adds
    is ``product=P/version=V``.
    """


class ShapeMismatch(RegistryError, code="CG122"):
    """The row's ``shape`` and its parts disagree.

    Leased rows declare ``steps``; collapsed rows declare ``statements``;
    ``ddl`` rows declare ``ddl`` objects; reads have no shape.
    """


class UnknownStep(RegistryError, code="CG123"):
    """A leased step's check branches to a step name that does not exist later in the row."""


class PostCommitWithoutCompensation(RegistryError, code="CG124"):
    """A row declares ``post_commit`` checks but no ``compensation``.

    A post-commit check runs after COMMIT, so its failure cannot be a rollback:
    the effect is there, and only an already-written compensation can undo it.
    Without one the executor could only escalate.  Declare the compensation
    statements (with ``compensation_verify``), or drop the post-commit checks.
    """


class CompensationUnverifiable(RegistryError, code="CG125"):
    """A ``compensation`` without ``compensation_verify`` (or the reverse).

    ``compensated`` is reported only when the compensation committed *and* a
    re-read of the restored state says so.  ``compensation_verify`` declares
    those re-read checks (same shape as ``verify``; they run after the
    compensation's COMMIT, each with its expected result).
    """


class TimeoutClaimsRollback(RegistryError, code="CG126"):
    """An ``irreversible`` row declares ``on_timeout: rolled_back``.

    An irreversible effect (a document issued, a number consumed, a call made to
    another system) is not undone by a rollback, so after a timeout it is
    unknown until reconciled.  Declare ``on_timeout: unknown``.
    """


class UnsafeRetry(RegistryError, code="CG127"):
    """A row declared ``retryable`` (or with automatic ``timeout.attempts``) is not safe to repeat.

    A transactional write is deduplicated by its landing marker; an irreversible
    or compensable one is safe to repeat only if it says so (``idempotent:
    true``).  Otherwise declare ``recovery: reconcile_first``.
    """


class Unverifiable(RegistryError, code="CG128"):
    """A ``reconcile_first`` or ``irreversible`` row has no way to tell whether it landed.

    Reconciliation asks the target what landed.  The landing marker proves only
    what commits with it (transactional and compensable effects); anything else
    needs a ``landed_probe`` query that finds the effect after the fact.
    """


class LockMismatch(RegistryError, code="CG130"):
    """A locked row changed without a new version.

    A published row is immutable.  Copy it, give the copy ``version: N+1``,
    keep or retire the old one, then run ``capgate lock``.
    """


class VersionNotIncreasing(RegistryError, code="CG131"):
    """A new version is not greater than every earlier version of the operation."""


class LockFileInvalid(RegistryError, code="CG132"):
    """``capabilities.lock`` cannot be read.

    ``capgate lock`` refuses to overwrite a lock it cannot read, since that
    would drop the pins of published rows.  Restore the file from version
    control; only if it is truly lost, delete it and run ``capgate lock`` to
    pin the rows as they are now.
    """


class LockedRowMissing(RegistryError, code="CG133"):
    """A row pinned in ``capabilities.lock`` is gone from the files.

    Published rows are retired (``retired: true``), never deleted.
    """


class UnknownOperation(CapgateError, code="CG140"):
    """No capability row declares this operation.

    capgate fails closed: an unlisted operation is a capability gap to
    escalate to a DBA, never a reason to improvise SQL.
    """


class UnknownVersion(CapgateError, code="CG141"):
    """The operation exists but not at the requested version.

    ``capgate list`` shows the registered versions.
    """


class RetiredRow(CapgateError, code="CG142"):
    """The requested row is retired: kept for the record, refused at call time.

    Call the current version instead.
    """


class EnvironmentNotAllowed(CapgateError, code="CG143"):
    """The row does not allow the connector's environment (e.g. ``prod``).

    The row's ``environments`` list is reviewed by a DBA; change it there.
    """


class UnboundedInput(RegistryError, code="CG160"):
    """A warning, not an error: a string input of a write row declares no ``maxLength``.

    Every input of a write is recorded in the ledger with its intent; an input
    without a declared bound is limited only by the executor's
    ``max_request_bytes``.  Declare ``maxLength`` (or an ``enum``, ``const`` or
    ``format``) so that the contract itself says how large it may be.
    """


class DialectSqlInvalid(RegistryError, code="CG170"):
    """A row's SQL does not fit a dialect its connector declares (``connectors.NAME.dialects``).

    Each SQL text of the row is parsed with sqlglot's parser for every declared
    dialect (``postgresql`` -> postgres, ``mariadb`` -> mysql, ``oracle``,
    ``sqlite``), and dialect rules are checked: on Oracle a query needs a FROM
    clause before 23ai (``SELECT ... FROM dual``, or better a derived table
    that every declared dialect accepts).  The finding names the file, row
    and statement.  Rewrite the SQL, or stop declaring the dialect.
    """


class TransactionControlInWrite(RegistryError, code="CG171"):
    """A write statement commits, rolls back or runs DDL (or dynamic SQL that could).

    A write's statements run inside the one transaction capgate opens, labels,
    marks and commits.  ``COMMIT``, ``ROLLBACK``, ``SAVEPOINT``, DDL (which
    commits implicitly on Oracle and MariaDB), session control (``ALTER
    SESSION``) and ``EXECUTE IMMEDIATE`` would end or split that transaction
    and make the landing marker and the commit-outcome evidence lie.  Remove
    it; DDL belongs in a ``ddl`` row.
    """


class DateBoundAsText(RegistryError, code="CG172"):
    """A warning: a date input is bound as text where the connector declares Oracle.

    The input's pattern admits ISO dates (``2024-08-15``) but it declares no
    ``format: date``: capgate binds it as a string, and Oracle converts a
    string compared with or stored into a DATE column with the session's
    ``NLS_DATE_FORMAT`` (``DD-MON-RR`` by default: ORA-01861).  Declare
    ``format: date`` (or ``date-time``) on the input: capgate then binds a
    DATE, whatever the session's settings.
    """


class LeasedOnOracle(RegistryError, code="CG173"):
    """A warning: a leased row on a connector that declares Oracle.

    Oracle cannot end a leased transaction at its deadline on its own, so the
    executor refuses leased rows there (``CG326``).  The row still runs on the
    connector's other dialects.
    """


class CapabilityPathError(RegistryError, code="CG150"):
    """A capability path does not exist or holds no capability files."""


class LoadWorkerFailed(RegistryError, code="CG151"):
    """A process checking capability files in parallel died before it finished.

    Large registries are checked in several forked processes; one was killed
    (out of memory, a signal) and the load stopped rather than wait for it.
    Nothing was registered.  Run again, or set ``CAPGATE_LOAD_WORKERS=1`` to
    check every file in the calling process.
    """


# --- authorization and gates (CG2xx) ------------------------------------------


class NotAuthorized(CapgateError, code="CG200"):
    """The caller holds no grant for this operation's connector and environment.

    Grants live in the grants file (``grants.toml``): a read row needs a read
    grant, a write row a write grant, on the row's connector and environment.
    """


class ApprovalRequired(CapgateError, code="CG201", exit_code=EXIT_APPROVAL_REQUIRED):
    """The row is gated and no valid approval exists for this exact plan.

    Nothing was opened.  The details carry the plan hash and the rendered
    plan; a person holding one of the row's approver roles runs
    ``capgate approve PLAN_HASH --by WHO --role ROLE``, then the call is
    repeated unchanged.
    """


class ApprovalExpired(CapgateError, code="CG202", exit_code=EXIT_APPROVAL_REQUIRED):
    """The approval for this plan has expired.  Ask for a new approval."""


class ApprovalUsed(CapgateError, code="CG203", exit_code=EXIT_APPROVAL_REQUIRED):
    """The approval for this plan was already consumed by an earlier call.

    Approvals are single use.  A new call needs a new approval.
    """


class ApprovalMismatch(CapgateError, code="CG204", exit_code=EXIT_APPROVAL_REQUIRED):
    """The approval was given for a different plan than the one being called.

    Any change of row, inputs, connector or environment changes the plan hash
    and needs a new approval.
    """


class SelfApproval(CapgateError, code="CG205"):
    """Under four eyes the requester may not approve their own plan."""


class ApproverLacksRole(CapgateError, code="CG206"):
    """The approver does not hold the named role, or the row does not accept that role."""


class ApprovalNotAuthenticated(CapgateError, code="CG208", exit_code=EXIT_APPROVAL_REQUIRED):
    """The approval is not proven to come from the approver it names.

    Every approval is signed with the approver's private Ed25519 key (a file
    only that person can read; ``capgate approver keygen`` makes one), and the
    grants file names each approver's public key (``approval_key``).  The
    signature is checked when the approval is recorded and again when a call
    uses it, against the grants as they are then.  The details say what failed:
    no key in the grants file, a key that is not the approver's, a signature
    that does not verify (an edited or hand-made approval), or a role the
    approver no longer holds.  Ask the approver to approve again with their key.
    """


class UnknownPlan(CapgateError, code="CG207"):
    """No plan with this hash was recorded.  Run ``capgate plan`` first."""


# --- execution (CG3xx) --------------------------------------------------------


class InputInvalid(CapgateError, code="CG300"):
    """The inputs do not satisfy the row's input contract (JSON Schema).

    The message names the field.  Nothing was opened or written.
    """


class IdempotencyConflict(CapgateError, code="CG301"):
    """The idempotency key was already used with a different request.

    The same key with the same request returns the recorded outcome; a
    different request needs a different key.
    """


class CaseConflict(CapgateError, code="CG302"):
    """The case id was reused for a different request (task-id reuse).

    Use a new case for new work.
    """


class UnknownConnector(CapgateError, code="CG303", exit_code=EXIT_USAGE):
    """The row names a connector that the configuration does not define."""


class RequestTooLarge(CapgateError, code="CG307"):
    """The request's inputs are larger than the configured ``max_request_bytes``.

    Every input is recorded in the ledger with the intent (a retry after a
    crash needs it), so the size of a request is bounded by configuration
    (``[capgate] max_request_bytes``, 1 MiB by default).  Nothing was recorded.
    Declare ``maxLength`` on the row's string inputs so that the contract says
    so too (``capgate validate`` warns where it does not).
    """


class CallerKeyRefused(CapgateError, code="CG308"):
    """A caller-supplied idempotency key (``--key``) for a row that does not accept one.

    The row's ``idempotency_key`` template is part of the reviewed contract: it
    decides which requests are the same request.  A caller key is accepted only
    where the row says ``accepts_caller_key: true``, and then it is combined
    with the row's key (``ROWKEY|caller:KEY``), never substituted for it.
    Nothing was recorded.
    """


class ConnectorUnavailable(CapgateError, code="CG304", retryable=True):
    """The connector's database could not be reached; nothing was sent to it.

    Exit 1, not 3: the connection failed before any statement reached the
    server, so nothing of the call can have landed.  A write already recorded
    as prepared is closed as ``rolled_back`` with the reason
    ``connection_failed``; nothing is left open.  Retry when it answers.
    """


class TargetNotInstalled(CapgateError, code="CG305", exit_code=EXIT_USAGE):
    """capgate's own tables (``capgate_landed``, ``capgate_fence``) are missing in the target.

    A call never creates tables: a least-privilege account need not be able to.
    A privileged account installs them once with ``capgate target install
    CONNECTOR`` (``--sql`` prints the script for a DBA to run instead, with
    ``--grant-to USER`` the grants the calling account needs).  Nothing was
    recorded or written.
    """


class TargetPrivilegeMissing(CapgateError, code="CG306", exit_code=EXIT_USAGE):
    """The connector's account may not read or write one of capgate's tables in the target.

    Grant it what ``capgate target install CONNECTOR --sql --grant-to USER``
    prints (SELECT, INSERT on ``capgate_landed``; SELECT, INSERT, UPDATE on
    ``capgate_fence``).  Nothing was recorded or written.
    """


class ExecutionTimeout(CapgateError, code="CG310", exit_code=EXIT_UNKNOWN):
    """The operation exceeded its declared timeout.

    The row's ``timeout.on_timeout`` says whether the effect is known to be
    rolled back or unknown (then ``capgate resume`` decides).
    """


class ImpactConflict(CapgateError, code="CG320", retryable=True):
    """Another case holds an impact claim on an overlapping target.

    The details name the holder and its case.  Wait for it to finish or
    coordinate; two cases never write one target at once.
    """


class BudgetExhausted(CapgateError, code="CG321", retryable=True):
    """The session budget of the connector or database user is used up.

    capgate refuses before the database would (e.g. ORA-02391).
    """


class DatabaseSessionLimit(BudgetExhausted, ConnectorUnavailable):
    """The database itself refused a new session: its per-user limit is reached.

    Oracle ORA-02391 (the profile's ``SESSIONS_PER_USER``, counted per user per
    database): a budget error (``CG321``, retryable) and, like an unreachable
    database, refused before any statement was sent, so nothing of the call can
    have landed.  capgate's budgets should refuse first: keep ``session_budget``
    and ``db_user_budget`` below the limit (``capgate doctor`` compares them).
    """


class LeaseExpired(CapgateError, code="CG322"):
    """The lease's deadline passed; its transaction was rolled back."""


class UnregisteredStep(CapgateError, code="CG323"):
    """A leased transaction was offered a step function that is not registered.

    Only reviewed, registered, deterministic step functions may run inside a lease.
    """


class StaleFence(CapgateError, code="CG324"):
    """A write carried a fencing token older than the current claim's.

    The holder's claim expired and was taken over; its late write is refused.
    """


class ReadOnlyViolation(CapgateError, code="CG325"):
    """A read row attempted to write; the read-only transaction refused it."""


class LeaseNotEnforceable(CapgateError, code="CG326"):
    """The connector's database cannot end a leased transaction at its deadline on its own.

    A lease promises that a hung executor (stopped, partitioned) cannot hold
    its locks past the deadline: the server must end the transaction by
    itself.  Oracle offers no per-transaction idle timeout a session can set
    (profiles' ``IDLE_TIME`` counts whole minutes, Resource Manager's
    ``MAX_IDLE_BLOCKER_TIME`` and 23ai's transaction priorities are DBA
    configuration capgate cannot check per call), so leased rows are refused
    on Oracle before anything is recorded.  Use a collapsed row there, or run
    the leased row on PostgreSQL or MariaDB.
    """


class TransactionSplit(CapgateError, code="CG327", exit_code=EXIT_UNKNOWN):
    """Something committed in the middle of a write, so its transaction was split in two.

    Before COMMIT capgate checks that the transaction is still the one it
    opened (Oracle: ``DBMS_TRANSACTION.LOCAL_TRANSACTION_ID``).  A procedure
    that commits, or DDL run inside a statement, commits the work so far --
    landing marker included -- and starts a new transaction: the marker and
    the logical transaction id would then vouch for a part of the call only.
    The rest is rolled back and the intent is escalated as ``partly_applied``
    for a person to decide (``capgate resume CASE --resolve``).  Fix the row:
    its statements must not commit (capgate already runs Oracle sessions with
    ``ALTER SESSION DISABLE COMMIT IN PROCEDURE``).
    """


# --- cases that coordinate (CG330-CG339; issue 17) -----------------------------


class CoordinationRequired(ImpactConflict, code="CG330", retryable=False):
    """Another case holds this target: a coordination decision waits for a person.

    A case holds the impact keys of its writes and plans until it is closed,
    releases them, or its claim expires (``case_claim_seconds``).  A second
    case touching a held key is refused, and a coordination decision is
    recorded in both cases' ledgers: who holds, who asks, which keys.  Nothing
    of the call was recorded as an intent, sent or written.  A person decides
    with ``capgate case decide ASKING_CASE DECISION --decision wait|hand_over|
    override --by NAME`` (override needs ``--reason``); the decision is
    recorded in both ledgers too.  Calling again before that returns this
    refusal with the same decision id.
    """


class UnknownDecision(CapgateError, code="CG331"):
    """No coordination decision with this id is recorded in the case.

    ``capgate case show CASE`` lists the case's decisions; the id is the one a
    ``CG330`` refusal named, and the case is the one that asked.
    """


class DecisionMade(CapgateError, code="CG332"):
    """This coordination decision was already made; a decision is made once.

    The recorded decision stands (``capgate case show CASE``).  Should the
    situation change, a new conflict raises a new decision.
    """


class SelfDecision(CapgateError, code="CG333"):
    """The identity that asked for a held target may not decide its own coordination.

    A coordination decision is a person's: the agent whose call was refused
    cannot hand the target over to itself.  Another person decides.
    """


class HolderBusy(CapgateError, code="CG334", retryable=True):
    """The holding case is in the middle of a call, or its hold changed meanwhile.

    A target is handed over only between the holder's calls, so that the
    holder's in-flight write can never commit after the hand-over (its fencing
    token would not yet be stale in the target).  Decide again once the
    holder's intent settled (``capgate resume HOLDER`` after a crash).
    Nothing was changed or recorded.
    """


class SymptomChanged(CapgateError, code="CG335", exit_code=EXIT_UNKNOWN):
    """The case's symptom changed outside the case: the case is held for a person.

    Before a write (the fix) and at a checkpoint (the send) capgate re-reads
    the symptom the case registered.  It differs: someone else changed the
    target meanwhile.  The ledger records ``changed_outside_case`` with the
    before and after digests and the actor where the target can say, and the
    case takes no new work until a person accepts the new state (``capgate
    case accept CASE HOLD --by NAME``) or re-opens the case from it
    (``capgate case reopen CASE HOLD --by NAME``).  Nothing of the refused
    call was sent.
    """


class NoSymptom(CapgateError, code="CG336"):
    """The row declares no ``symptom`` query, so there is nothing to register or re-read.

    A row declares what the screen shows for its target under ``symptom:``
    (``sql``, optionally ``actor.sql``); register the symptom with a row that
    has one.
    """


class DecisionNotAuthenticated(CapgateError, code="CG337"):
    """A person's decision on a case is not proven to come from the person it names.

    Coordination decisions (wait, hand over, override) and the answer to a
    hold (accept, re-open) are a person's, so they are signed like approvals:
    with the private key only that person can read (``capgate approver
    keygen``), whose public half is their ``approval_key`` in the grants file.
    The details say what failed: no key in the grants file, or a key that is
    not the named person's.  Nothing was recorded.
    """


class NotInCase(CapgateError, code="CG338"):
    """Only an identity that worked in the case, or a person with their key, may do this.

    Closing a case or releasing its claims frees targets other cases may be
    waiting for; an agent of one case must not free another case's targets.
    The identities that acted in the case (its calls, its symptom) may; so may
    a person who signs with their approver key (``--key``).  Nothing changed.
    """


# --- reconciliation and ledger (CG4xx) ----------------------------------------


class ReconciliationRequired(CapgateError, code="CG400", exit_code=EXIT_UNKNOWN):
    """The case has an intent whose outcome is not yet known.

    No new call in the case runs until ``capgate resume CASE`` has resolved
    every in-flight intent.
    """


class OutcomeUnknown(CapgateError, code="CG401", exit_code=EXIT_UNKNOWN):
    """The outcome could not be established from evidence.

    The intent is parked as an escalation; a person must decide.
    """


class RequestInFlight(CapgateError, code="CG402", exit_code=EXIT_UNKNOWN, retryable=True):
    """The same request (same idempotency key, same request) is being executed right now.

    Exactly one execution runs per idempotency key; every identical call waits
    for that execution's outcome and returns it.  This refusal means the wait
    ended before the execution did: nothing was recorded or sent for this
    call.  Call again to get the outcome; if the executing process died,
    ``capgate resume CASE`` (the case named in the details) settles it.
    """


class AttemptSuperseded(CapgateError, code="CG403", exit_code=EXIT_UNKNOWN):
    """This attempt of an intent was superseded while its process was stopped or slow.

    ``capgate resume`` (or a person) settled the intent, or retried it as a newer
    attempt, while this process could not act.  Nothing this process does for the
    old attempt reaches the case any more: the ledger refuses its events and the
    target's fence refuses its writes.  Its late observation is kept as
    ``stale_attempt`` evidence; the details name the intent's recorded state.
    """


class LedgerTampered(CapgateError, code="CG410"):
    """The ledger's hash chain or a case snapshot does not verify.

    ``capgate ledger verify`` names each broken event.  Do not continue the
    case until the cause is understood.
    """


class LedgerError(CapgateError, code="CG411", exit_code=EXIT_USAGE):
    """The ledger store could not be opened or written."""


class UnknownCase(CapgateError, code="CG412"):
    """No such case in the ledger."""


class UnknownIntent(CapgateError, code="CG413"):
    """No such intent in the ledger."""


class LedgerNotMigrated(CapgateError, code="CG414", exit_code=EXIT_USAGE):
    """The ledger's tables are of another format than this capgate reads and writes.

    An older store (format 1, or an older revision) is upgraded by ``capgate
    ledger migrate``; nothing is read or written until then.  A store written
    by a newer capgate is refused: use that version.
    """


class AnchorMismatch(CapgateError, code="CG415", exit_code=EXIT_USAGE):
    """An anchor file does not fit this ledger (another store, or it was edited)."""


# --- DDL (CG5xx) ---------------------------------------------------------------


class DdlError(CapgateError, code="CG500"):
    """A DDL loop step failed; the message names the object and step."""
