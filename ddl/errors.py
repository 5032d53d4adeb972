"""The DDL loop's refusals and failures (codes CG501-CG599).

Every class is a ``registry.errors.DdlError``, so the CLI catches them with
the rest of capgate's tree; ``capgate explain CODE`` prints the docstring.
The six standing prohibitions (CG501-CG506) carry their anti-pattern and best
practice in the docstring; ``ddl.prohibitions`` lists them as data.

Details travel as attributes in ``details`` (object keys, snapshot ids,
signatures, the merge proposal), never only in the message text.
"""

from __future__ import annotations

from typing import Any

from registry.errors import EXIT_UNKNOWN, DdlError

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
    merge (the refusal carries a three-way merge proposal) or capture again.
    """


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
    source, theirs = live) with conflicts marked.  Review the merged source,
    capture the live object again and plan the merged source against it.
    """


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


def error_details(exc: BaseException) -> dict[str, Any]:
    """A JSON-ready description of any exception (ours or the driver's)."""
    to_dict = getattr(exc, "to_dict", None)
    if callable(to_dict):
        out = to_dict()
        if isinstance(out, dict):
            return out
    return {"error": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else ""}
