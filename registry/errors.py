"""One exception tree for every refusal capgate makes.

Each class registers a stable machine-readable ``code`` (``CG1xx`` registry,
``CG2xx`` authorization and gates, ``CG3xx`` execution, ``CG4xx``
reconciliation and ledger, ``CG5xx`` DDL, ``CG6xx`` simulation, ``CG9xx``
configuration) and the CLI exit code it maps to.  The class docstring is the long explanation that
``capgate explain CODE`` prints, so it says what failed and how to fix it.

Details travel as attributes (``details``), not only in the message, so that
the CLI's ``--json`` output and the MCP server can hand them to a machine.

This module lives in ``registry`` because ``registry`` is the lowest layer:
``executor`` and ``ddl`` import it, and it imports nothing of theirs.  It is the
only module that defines error classes (``tests/test_error_codes.py`` holds it
to that), so ``capgate.lookup`` knows every code as soon as it is imported.
"""

from __future__ import annotations

from typing import Any, ClassVar

from capgate.registry.excerpt import bounded, cut

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
    documents: ClassVar[frozenset[str]] = frozenset()
    """Detail keys that hold a document capgate wrote (a merge proposal): kept whole, never
    cut to an excerpt -- a person applies it as it is."""

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
        whole = {k: details[k] for k in self.documents if k in details}
        self.details: dict[str, Any] = bounded(
            {k: v for k, v in details.items() if k not in whole})
        self.details.update(whole)

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


class SecretFileExposed(ConfigError, code="CG920"):
    """A key or token file can be read by other users: it is refused, as ssh refuses one.

    An approver's private key signs approvals and a tokens file maps bearer
    tokens to identities; either, readable by the file's group or by others,
    lets another account on the machine approve or call as someone else.  The
    message names the file and its mode; ``chmod 600 FILE`` (and keep the file
    out of agents' reach) fixes it.  Nothing was read from the file.
    """


class ExcessPrivilege(ConfigError, code="CG921"):
    """A connector's database account holds more than capgate's rows could ever need.

    capgate's gates hold only as long as the account behind them cannot act
    outside the declared operations.  A superuser, or an account holding
    ``pg_signal_backend``, ``pg_read_server_files``, ``pg_write_server_files``
    or ``pg_execute_server_program`` (PostgreSQL), ``FILE``, ``SUPER`` or
    ``GRANT OPTION`` (MariaDB), ``DBA`` or any ``ANY`` privilege (Oracle) can
    terminate sessions, read and write server files or grant itself more.
    ``capgate doctor`` reports it as a warning in development environments and
    as an error in the environments ``[capgate] production_environments``
    names (default ``prod``).  Give the connector an account with only the
    table privileges the rows need (the doctor lists them).
    """


class InvalidIdentifier(UsageError, code="CG922"):
    """A name given on the command line is not a plain SQL identifier.

    Role, user and schema names given to ``capgate target install
    --grant-to`` (and the like) become part of SQL text, so each is checked
    against the dialect's identifier rules and quoted by the dialect; one that
    carries quotes, semicolons, spaces or comments is refused before anything
    is sent.  Nothing was executed.
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
    drops a check.  See the capability file format in docs/capability-file.md.
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
    """The ``idempotency_key`` template names a field that is not an input, or formats one.

    Allowed fields are ``{case}``, ``{operation_id}``, ``{version}`` and the
    row's input properties, each written bare: no format spec (``{id:05d}``) and
    no conversion (``{id!r}``).
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


class RowsNotPinned(RegistryError, code="CG134"):
    """Capability rows that no ``capabilities.lock`` pins (a warning of ``capgate doctor``).

    Only a pinned row is immutable: with no lock file beside the files, a row
    edited in place -- its gate removed, its SQL changed -- takes effect at once,
    with no new version and nothing to review; a row missing from an existing
    lock is a draft that nobody has pinned yet.  Review the rows (``capgate
    diff``), then ``capgate lock``; ``capgate init`` pins the rows it writes.
    """


class LockMissing(RegistryError, code="CG135"):
    """No ``capabilities.lock`` pins the rows, in an environment that needs one.

    Outside the environments the configuration declares unlocked
    (``[capgate] unlocked_environments``, default ``rig`` and ``dev``) a row
    runs only as its lock pins it: without a lock, a row edited in place -- its
    gate turned into a write grant, its SQL changed -- would take effect at once
    with nothing reviewed.  Nothing was executed.  Review the rows (``capgate
    diff``), run ``capgate lock`` and commit ``capabilities.lock`` beside the
    files; a running server picks the lock up on its next call.
    """


class RowUnpinned(RegistryError, code="CG136"):
    """The row is not pinned by ``capabilities.lock``, in an environment that needs a pin.

    A row the lock does not pin is a draft: runnable in the unlocked
    environments (``rig``, ``dev`` by default) to try it out, refused
    elsewhere.  ``capgate list`` and ``capgate show`` mark it ``UNPINNED``, and
    the MCP tool carries ``capgate/pinned: false``.  Review it, run ``capgate
    lock`` and commit the lock.  Nothing was executed.
    """


class Unretired(RegistryError, code="CG137"):
    """A row the lock records as retired is no longer retired in its file.

    Retiring is one step (``retired: true``, or ``capgate bump --retire``) and
    ``capgate lock`` records it, so the retirement is pinned: deleting the
    ``retired`` line would otherwise bring a withdrawn row back with its hash
    unchanged and nothing to review.  To use the operation again, publish a new
    version; to revive this exact row, remove it from the lock's ``retired``
    list in a reviewed change.
    """


class CapabilityFilesInvalid(RegistryError, code="CG138"):
    """The operation depends on a capability file (or the lock) that no longer validates.

    A running server or a long-lived executor re-reads the capability files
    and ``capabilities.lock`` when they change.  A changed file that fails
    validation fails closed: every operation with a row in that file (before or
    after the change) is refused with the file, line and column of the first
    problem, while every other operation keeps running from the files as they
    are now.  The previous, perhaps more permissive, rows are never kept.  Fix
    the file (``capgate validate`` lists every problem); the next call picks
    the fix up.
    """


class UnsafeFunction(RegistryError, code="CG139"):
    """Read or verify SQL calls a function that is not known to be free of side effects.

    Reads run in a read-only transaction, but that does not stop every action:
    ``pg_terminate_backend`` ends another session, ``LOAD_FILE`` reads a server
    file, ``dblink`` opens its own connection, advisory locks and ``nextval``
    outlive a rollback.  So a read row's statements, and the verify, replay,
    probe and check SQL of every row, may call only the functions on the
    engine's list of side-effect-free functions (``registry/sql_functions.py``),
    or a function the row names in its reviewed ``allow_functions`` list.
    Functions that act -- file access, session control, locks, sequences,
    notifications, sleeps, Oracle ``DBMS_*`` / ``UTL_*`` packages -- cannot be
    allowed at all.  The finding names the file, line and column of the call.
    """


class ReadSqlActs(RegistryError, code="CG144"):
    """Read or verify SQL that is not a plain query: it writes a file, a variable or a lock.

    ``SELECT ... INTO OUTFILE`` / ``INTO DUMPFILE`` write a file on the
    database server, ``SELECT ... INTO @var`` / ``INTO table`` write state, and
    ``FOR UPDATE`` / ``LOCK IN SHARE MODE`` take row locks from a check that
    should only look.  Write the query without the clause.
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


class FreeTextKey(RegistryError, code="CG161"):
    """A warning, not an error: a write row's target key (or dimension) is free text.

    capgate's impact claims and idempotency keys compare key values exactly, as
    text.  The database may not: MariaDB's default collations ignore case and
    trailing spaces (and ``utf8mb4_unicode_ci`` accents), a PostgreSQL column
    may use a nondeterministic collation.  Then ``'ABC'`` and ``'abc '`` are one
    row to the database and two keys to capgate -- two cases could write that
    row at once, each holding "its own" claim.  Declare an ``enum``, a ``const``
    or a ``pattern`` that admits one spelling per value (``^[A-Z0-9-]{1,40}$``).
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


class LockedRowEdited(RegistryError, code="CG152"):
    """``capgate bump`` found a published row edited in place and cannot put it back.

    A published row is immutable: ``capabilities.lock`` pins its hash, and an
    edited one is refused (CG130).  ``bump`` writes the edit as the next version
    and restores the published row from its locked text -- found in the file's git
    history, or among the packaged examples ``capgate init`` copied.  When neither
    holds it (or an older version than the newest was edited), nothing is written
    and the message says what to run: undo the edit, bump, change the new version.
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


class GrantsFileInvalid(ConfigError, code="CG209"):
    """The grants file no longer validates: every call is refused until it does.

    A running server or a long-lived executor re-reads the grants file when it
    changes.  A changed file that cannot be read or fails validation fails
    closed -- every grant, role and approval key comes from it, so every call,
    plan and approval is refused with the file and line of the problem -- while
    the process keeps running; the grants it had before are not kept.  Fix the
    file; the next call picks the fix up.
    """


class ApprovalTtlTooLong(UsageError, code="CG210"):
    """The approval would live longer than the configured maximum.

    An approval is a standing permission until it is used or expires; the
    longer it lives, the longer a stolen or forgotten one can be spent.  Its
    lifetime (``--ttl``, or the row's ``approval_ttl_seconds``) may not exceed
    ``[capgate] approval_ttl_max_seconds`` (default 86400, a day).  Approve
    with a shorter ``--ttl``; nothing was recorded.
    """


class ApprovalDeclined(CapgateError, code="CG220"):
    """The person at the terminal did not confirm the approval; nothing was recorded.

    ``capgate approve`` prints the plan it is asked to sign -- every statement with its
    bound values, the verify checks, the case and the requester -- and on a terminal
    asks before it signs.  Anything but ``y`` declines.  Read the plan again with
    ``capgate plan show PLAN_HASH``; a script that has shown the plan to its person
    passes ``--yes``.
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
    """The connector's database could not be reached; nothing of the call can commit.

    Exit 1, not 3: the connection failed before any statement reached the
    server -- or (``connection_cut`` in the details) the opening of the
    transaction got no answer by the row's deadline + 1 s, a network partition,
    and the client cut the connection: COMMIT is never sent on it, so nothing of
    the call can land, whatever the server still holds until it ends that
    session.  A write already recorded as prepared is closed as ``rolled_back``
    with the reason; nothing is left open.  Retry when it answers.
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

    The details name the impact key and how long the claim still runs -- never
    the holding case or its intents, which may be another identity's work (the
    person who coordinates finds them in the ledger).  Wait for it to finish or
    coordinate; two cases never write one target at once.
    """

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None,
                 **details: Any) -> None:
        super().__init__(message, **details)
        self.holder: dict[str, Any] = dict(holder or {})
        """Who holds the key (case, intent, operation, process, token): for the ledger's
        coordination record, never shown with the refusal."""


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


class NotSupported(CapgateError, code="CG390"):
    """The database does not offer a mechanism this operation asked for.

    The message names the dialect and the feature; use a row whose recovery
    does not depend on it, or a database that has it.
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


class LedgerUnreachable(CapgateError, code="CG430", exit_code=EXIT_UNKNOWN):
    """The ledger stopped answering in the middle of a call that may have recorded its intent.

    Exit 3, an unknown outcome, not a usage error: the call was cut off from its
    ledger -- a network partition, a reset, a store that went away -- after its
    intent was recorded (``recorded: true``; the case now holds an open intent)
    or while it was being recorded (``recorded: null``: whether it was is
    unknown).  The target's transaction was rolled back unless its COMMIT had
    been sent; what landed is established from evidence by ``capgate resume
    CASE`` (the details name the case and the intent) once the ledger answers
    -- resume retries an intent that did not land, or records the one that did.
    If resume finds no such intent, nothing of the call was recorded or
    committed and it can be sent again.
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


class LedgerBehindTarget(CapgateError, code="CG416"):
    """A target's fence row holds a token this ledger never issued for the impact key.

    Every token is committed in the ledger before its holder writes the target, so
    the ledger's token for a key is never below the target's -- unless the ledger
    lost history: it was restored from an older backup, edited, or cloned.  The
    write is rolled back (nothing committed), and every write to the key would be
    until the cause is understood: writes the target holds may be missing from the
    ledger.  ``capgate target fences CONNECTOR`` lists the keys and the landing
    markers of their last writers; ``--realign`` moves the ledger's tokens up to
    the target's once a person has looked.
    """


# --- DDL (CG5xx) ---------------------------------------------------------------


class DdlError(CapgateError, code="CG500"):
    """A DDL loop step failed; the message names the object and step."""


# --- the six standing prohibitions --------------------------------------------


class DdlProhibition(DdlError):
    """A standing prohibition of the DDL loop refused the plan (base class).

    Each prohibition has its own code; nothing was applied.
    """


class StaleExtract(DdlProhibition, code="CG501"):
    """Stale extract: the live object no longer matches the snapshot the new source is based on.

    Anti-pattern: editing a copy of a package taken last week and replacing the
    live package with it -- silently reverting whatever was saved since.

    Best practice: capture the object (``capgate ddl capture``), edit that
    snapshot, and plan against its snapshot id.  If the live object moved on,
    merge (the refusal carries a three-way merge proposal, whole: its
    ``merged`` text applies as it is when the merge is clean) or capture again.
    """

    documents = frozenset({"merge"})


class SpecWithoutBody(DdlProhibition, code="CG502"):
    """Spec without body: a package (or type) spec changes and its existing body is not in the plan.

    Anti-pattern: ``CREATE OR REPLACE PACKAGE`` alone.  Oracle invalidates the
    body; MariaDB (``sql_mode=ORACLE``) drops it outright, so every routine of
    the package is gone until somebody re-creates the body.

    Best practice: put the body in the same plan, right after the spec (its
    current source if it does not change), so that the loop applies, verifies
    and, if needed, compensates both together.
    """


class SchemaWideRecompile(DdlProhibition, code="CG503"):
    """Schema-wide recompile: the plan asks to recompile a whole schema.

    Anti-pattern: ``DBMS_UTILITY.COMPILE_SCHEMA``, ``UTL_RECOMP``, "recompile
    everything invalid" -- it touches objects nobody reviewed, takes library
    cache locks across the schema, and hides which change broke what.

    Best practice: let the dependent sweep recompile the dependents of the
    changed objects one by one (it records each status before and after), and
    name any other object explicitly.
    """


class RemoteDependentsWithoutFarSideStep(DdlProhibition, code="CG504"):
    """Spec with remote dependents: an object used over a db link changes with no far-side step.

    Anti-pattern: changing a spec that objects in another database call
    through a link, trusting "dependents revalidate on first use".  Remote
    dependents are not revalidated by the local database; they fail at their
    next call, in the other system (the ABC_PREM incident).

    Best practice: add a named far-side step for every remote dependent: the
    link, the dependent, the recompile on the far side and an assertion whose
    expected result proves the dependent works.
    """


class UngreppedCallers(DdlProhibition, code="CG505"):
    """Ungrepped callers: the plan records no caller search for a changed object.

    Anti-pattern: relying on the dependency catalog alone.  Dynamic SQL,
    ``EXECUTE IMMEDIATE`` strings, MariaDB routines (which have no dependency
    catalog) and code in other repositories never appear there.

    Best practice: let ``plan`` search the stored source for every changed
    object (it does so by default) and review the hits it records as evidence.
    """


class SnapshotOverwrite(DdlProhibition, code="CG506"):
    """Snapshot overwrite: a snapshot id already holds different content.

    Anti-pattern: "refreshing" a snapshot in place.  Snapshots are the
    evidence that compensation restores; a snapshot that can change is no
    evidence at all.

    Best practice: capture again -- a new content gives a new snapshot id.
    Storing the identical snapshot again is harmless and changes nothing.
    """


# --- failures of the loop's steps -----------------------------------------------


class ApplyFailed(DdlError, code="CG510"):
    """The DDL did not apply cleanly: the database refused it, or created the object with errors.

    On Oracle a ``CREATE OR REPLACE`` that compiles with errors *succeeds*
    (python-oracledb warning DPY-7000, errors in ``ALL_ERRORS``); that is a
    failed apply too.  On PostgreSQL the transaction was rolled back; on
    engines whose DDL commits the loop compensates.  ``details`` name the
    object and the database's errors.
    """


class VerifyFailed(DdlError, code="CG511"):
    """Verification after apply failed: a changed object or dependent is invalid, or a check failed.

    ``details["checks"]`` lists every check with its result; objects that
    were already invalid before the apply are reported but do not fail.
    PostgreSQL rolls back; other engines compensate from the snapshot.
    """


class CompensationFailed(DdlError, code="CG512", exit_code=EXIT_UNKNOWN):
    """Compensation did not restore the snapshot: escalate to a person.

    The loop re-applied the captured snapshot and verified again, and the
    live object still differs from the snapshot (or is invalid).  ``details``
    carry the snapshot ids and the live signatures.  Do not re-run the
    change: inspect the object, restore it from the snapshot by hand (``ddl
    export`` has its source) and record what was done.
    """


class MergeRequired(DdlError, code="CG513"):
    """The live object changed since its snapshot: the apply was refused at preflight.

    Somebody saved the object between capture and apply.  ``details["merge"]``
    carries a three-way merge proposal (base = snapshot, ours = the new
    source, theirs = live), whole, with conflicts marked.  A merged source is a
    new source: it is never applied under the approval of the plan it replaces.
    When every merge is clean, capgate records it as a plan of its own in the
    same case, planned against the live object (``details["merge_plan"]``: its
    plan hash), which needs its own approval; with conflicts, resolve them and
    plan the result (``capgate ddl plan FILE --fresh``).  The old plan's
    approval stays unused and can never apply the merge.
    """

    documents = frozenset({"merge"})


class PlanTampered(DdlError, code="CG514"):
    """The plan's content does not match its plan hash.

    A plan is approved by its hash; an edited plan needs a new plan and a new
    approval.
    """


class PlpgsqlCheckMissing(DdlError, code="CG520"):
    """The PostgreSQL extension ``plpgsql_check`` is not installed in the target database.

    PostgreSQL does not check PL/pgSQL bodies against the catalog when a
    function is created; the DDL loop uses ``plpgsql_check`` for compile
    status and dependencies.  Install the server package
    (``postgresql-NN-plpgsql-check``) and run ``CREATE EXTENSION
    plpgsql_check`` in the target database.
    """


class LockNotAcquired(DdlError, code="CG521", retryable=True):
    """The session-scoped DDL lock on an object could not be taken in time.

    Another DDL loop is working on the same object.  Wait for it to finish;
    two changes to one object are never interleaved.
    """


class UnsupportedObjectType(DdlError, code="CG522"):
    """The object type is not handled by this dialect's catalog adapter.

    ``details`` name the type and the types the adapter supports.
    """


class ObjectNotFound(DdlError, code="CG523"):
    """The named object does not exist in the target's catalog."""


class FeatureNotSupported(DdlError, code="CG524"):
    """The target database lacks a feature this step needs.

    ``details`` name the feature, what was found and what is needed.
    """


class InvalidObjectName(DdlError, code="CG525"):
    """An object name or identifier is not a plain identifier capgate will interpolate.

    Names that reach DDL text are validated and quoted; use letters, digits,
    ``_`` (and ``$``/``#`` on Oracle), starting with a letter or ``_``.
    """


class ObjectOutOfScope(DdlError, code="CG526"):
    """The object is not one the capability row may change.

    A ``ddl`` row names the stored-code objects it may change (``ddl.objects``:
    type and name, in the connector's own schema) or a name pattern
    (``ddl.pattern``).  A source that creates or replaces anything else --
    another object, another schema, an object over a database link -- is
    refused before the plan reads the catalog.  Use the row that covers the
    object, or have a DBA add the object to a new version of the row.
    """


class SnapshotTampered(DdlError, code="CG515"):
    """A stored snapshot no longer matches its content address.

    A snapshot's id is the hash of its dialect, object, source, attributes and
    signature, and its signature is recomputed from the stored blocks; a row
    edited in the store fails both.  It is refused wherever it is read -- as
    the base of a plan, in an apply, in ``ddl export`` -- because compensation
    would restore whatever the edited row now says.  ``details`` name the
    snapshot and what did not match.  Restore the store from a backup or
    capture the object again; never plan against a tampered snapshot.
    """


class ExtraStatements(DdlError, code="CG527"):
    """The source holds more than the definition of the object it names.

    A ``ddl`` row applies exactly one object's ``CREATE`` per source: the
    source is parsed (PostgreSQL's own grammar through ``pglast``; MariaDB's
    server parses it with ``PREPARE``, which runs nothing; PL/SQL through
    sqlglot's tokenizer and its block structure) and anything after the
    definition -- a ``CREATE TABLE``, a ``GRANT``, a second function -- is
    refused at plan time, before anything is rendered or applied.
    ``details`` give the line and the start of the extra text.  Put each
    object in its own source file under the row that covers it.
    """


class SourceDoesNotParse(DdlError, code="CG528"):
    """The new source is not a valid definition, or would fail when applied.

    Found at plan time, so nothing is approved that cannot apply: the parser
    (or the database, in a savepoint that is rolled back, or ``PREPARE``)
    refused it, or it ``CREATE``s without ``OR REPLACE`` an object that
    exists.  ``details`` carry the database's message and line.
    """


class DefinerCannotBeKept(DdlError, code="CG529"):
    """Applying the source would change a MariaDB routine's DEFINER, which compensation cannot undo.

    MariaDB runs a ``SQL SECURITY DEFINER`` routine with its definer's
    privileges and gives every ``CREATE`` without a ``DEFINER`` clause the
    applying account as definer.  capgate keeps the live definer by writing
    it into the applied text -- which needs the ``SET USER`` (or ``SUPER``)
    privilege -- and refuses at plan time when the applying account lacks it.
    Grant ``SET USER`` to the connector's account, or apply as the definer.
    """


class SourceNotVisible(DdlError, code="CG530"):
    """The connector's account cannot read the object's source.

    MariaDB shows a routine's body only to its definer or to an account with
    ``SELECT`` on ``mysql.proc`` (``SHOW CREATE ROUTINE`` from 11.3); any
    other account reads ``NULL``.  Nothing was stored: a snapshot without the
    source could never be restored.  Grant the privilege (docs/ddl.md lists
    what each engine needs) or capture as an account that may read it.
    """


class SmokeNotContained(DdlError, code="CG531"):
    """A smoke call's SQL could act outside the read-only check it is meant to be.

    Smoke calls run during verification, where nothing may commit or write:
    on PostgreSQL as one statement over the extended protocol, in the
    verification transaction, in a read-only savepoint; on MariaDB in a session
    of its own, in a read-only XA transaction that is always rolled back.  What
    that cannot contain is refused when the plan is made, before anything is
    approved or run: more than one statement, transaction or session control
    (``COMMIT``, ``ROLLBACK``, ``SAVEPOINT``, ``SET``, ``XA``...), DDL, a
    statement that writes (``INSERT``/``UPDATE``/``DELETE``, a data-modifying
    ``WITH``, ``SELECT ... INTO`` a table or a file).  A smoke call is one
    ``SELECT`` (or ``VALUES``/``WITH ... SELECT``) or one ``CALL``.
    ``details`` name the smoke call and what was found.  Write the call as one
    read-only statement; code it calls may still try to write -- the engine
    refuses that at run time and the check fails.
    """


class NothingToApply(DdlError, code="CG532"):
    """Every object of the plan already is its new source: there is nothing to do.

    The live object's signature equals the signature the new source would
    give (the catalog's rendering, where the engine renders it), so an apply
    would change nothing and prove nothing.  Nothing was planned or recorded
    for approval; the refusal is recorded in the case.
    """


def error_details(exc: BaseException) -> dict[str, Any]:
    """A JSON-ready description of any exception (ours or the driver's)."""
    to_dict = getattr(exc, "to_dict", None)
    if callable(to_dict):
        out = to_dict()
        if isinstance(out, dict):
            return out
    return {"error": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else ""}


# --- simulation first (CG600-CG699; issue 16) -------------------------------------
# CG60x are refusals at run time (a promotion without evidence, a teardown that cannot
# be derived, a production simulation missing one of its five conditions...); CG68x are
# located findings in a capability file, reported like every other registry check.


class SimulationError(CapgateError, code="CG600"):
    """A step of the simulation cycle could not run (base class of the CG60x refusals).

    The simulation cycle is: capture the baseline, declare the planned effects
    and cleanup, execute (committed, through the normal call path and its
    gates), observe, tear down from the write log, verify the restoration.
    Each step is a ledger event of the case; ``capgate ledger show CASE`` shows
    how far a simulation got.
    """


class PromotionRefused(SimulationError, code="CG601"):
    """A write on a higher venue has no simulation evidence (and no exemption) in its case.

    Simulation is the default: a change reaches a promotion environment
    (staging and prod unless the connector says otherwise with
    ``requires_simulation``) only when its case holds a completed simulation
    -- baseline restored -- of the *same row version* (row hash) with inputs of
    the *same shape*, on a *lower* venue, younger than the connector's
    ``simulation_max_age_seconds``; or when the change passes the five-point
    exemption test, recorded in the plan.  The details say which was missing
    (``no_evidence``, ``stale``, ``other_row_version``, ``other_input_shape``,
    ``not_lower``) and each exemption point that failed.  Run ``capgate
    simulate OP --case CASE`` on a lower venue first.  Nothing was recorded.
    """


class PromoterLacksRole(SimulationError, code="CG602"):
    """The promoting identity does not hold a promotion role for the target environment.

    A connector may name ``promotion_roles``: then a write there needs the
    caller to hold one of them *for that environment* in the grants file
    (``roles = [{ role = "release_manager", environments = ["prod"] }]``), on
    top of its write grant.  Nothing was recorded.
    """


class TeardownUnderivable(SimulationError, code="CG603"):
    """The row's effect cannot be torn down from its write log, so it cannot be simulated.

    A teardown removes exactly what the simulation wrote: the keys an INSERT
    returned (the statement declares ``returns: {table, key}``), and -- for
    every other write statement -- the row's already-written ``compensation``.
    A write statement that is neither would need a teardown authored after the
    fact; declare ``returns`` on the INSERT or write the compensation.
    Nothing ran.
    """


class SimulationVenueRefused(SimulationError, code="CG604"):
    """The simulation was asked to run where it may not.

    A simulation runs on a venue (rig < dev < qa < staging < prod) that the row
    allows; a production simulation is its own gate (``CG606``).  The message
    says which venue and why.  Nothing ran.
    """


class CustomerNotInformed(SimulationError, code="CG605"):
    """A simulation on staging needs the record that the customer was informed.

    Staging is customer-facing: a rehearsal there is visible.  Say who
    informed the customer and when (``--customer-informed "WHO at
    2026-12-01T09:00Z"``); it is recorded with the simulation.  Nothing ran.
    """


class ProductionSimulationRefused(SimulationError, code="CG606"):
    """A production simulation is refused: one of its five conditions does not hold.

    A simulation on prod runs only when all five hold and are recorded in its
    plan: (1) the evidence cannot be obtained off production -- a recorded
    attempt on a lower venue in the case, or a written data-dependency argument
    (``--data-dependency TEXT``); (2) every step is transactional, or
    compensable with its compensation already written; (3) the blast radius is
    one key value (one policy, account or product version); (4) the pre-state
    is captured as evidence before the first write; (5) a reconciliation query
    is named on the row (``simulation.reconciliation``), to be run and recorded
    the same business day (``capgate reconcile``).  The details name every
    condition that failed.  Its gate is a distinct kind, approved by a holder
    of the connector's ``production_simulation_approver_roles`` (two roles)
    who is not the requester.  Nothing ran.
    """


class RestorationMismatch(SimulationError, code="CG607", exit_code=EXIT_UNKNOWN):
    """After the teardown the re-read baseline is not the captured one: the simulation escalated.

    The restoration is verified by re-reading every baseline query and
    comparing digests.  A mismatch (a concurrent writer, a trigger, a teardown
    that missed something) is escalated with both digests and the rows that
    differ, for a person to decide; the simulation is not evidence for a
    promotion until then.
    """


class ReturnedValueUnavailable(SimulationError, code="CG608"):
    """An input bound to an earlier intent's returned value cannot be resolved from the ledger.

    ``--bind INPUT=INTENT.NAME`` takes the value that intent's statement
    returned (``RETURNING``, a generated key), as recorded in the ledger --
    never a predicted one.  The intent must be in the same case, applied (its
    outcome recorded, or reconciled as applied by ``capgate resume``), and must
    have returned exactly one value under that name.  The message says which of
    these failed.  Nothing was recorded.
    """


class SimulationNotFound(SimulationError, code="CG609", exit_code=EXIT_USAGE):
    """No simulation with this id in the case.  ``capgate ledger show CASE`` lists them."""


class SimulationStateConflict(SimulationError, code="CG610"):
    """The simulation is not at a step where this can run (e.g. torn down twice).

    Each step of the cycle runs once, in order; a continued simulation
    (``capgate simulate --continue``) picks up at the first step not recorded.
    """


class BaselineUnreadable(SimulationError, code="CG611"):
    """A baseline query could not be read, so the pre-state cannot be captured.

    The baseline is the rows the row's ``target`` names (``SELECT * FROM
    object WHERE key = :key``) plus the row's ``simulation.baseline`` queries,
    read before the first write.  Fix the query (or the target's object name),
    or declare the baseline queries explicitly.  Nothing was written.
    """


class ReconciliationUndeclared(SimulationError, code="CG612", exit_code=EXIT_USAGE):
    """The simulation's row names no reconciliation query (``simulation.reconciliation``)."""


# --- row findings (located in the capability file) ----------------------------------


class ReturnsMismatch(RegistryError, code="CG680"):
    """A statement's ``returns`` does not fit its SQL.

    ``returns: {table, key}`` names the table the statement writes and the key
    column whose values it returns (``RETURNING``, a generated key): the
    statement must be a single ``INSERT``, ``UPDATE`` or ``DELETE`` of that
    table, without a ``RETURNING`` clause of its own (the dialect adds it), and
    no two statements of a row may return the same name.
    """


class EffectNamesNoReturn(RegistryError, code="CG681"):
    """An ``expected_effects`` entry is observed by a returned value no statement returns.

    ``returned: NAME`` must be the ``returns.key`` of one of the row's
    statements (e.g. the identity value an INSERT consumed).
    """
