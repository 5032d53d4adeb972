"""Simulation first (seed 001 §5): the refusals of the cycle, promotion and production
simulation, and the row findings of their fields (codes CG600-CG699).

``CG60x`` are refusals at run time (a promotion without evidence, a teardown
that cannot be derived, a production simulation missing one of its five
conditions...); ``CG68x`` are located findings in a capability file (reported
as ``path:line:col: CODE: field: message`` like every other registry check).
Every class is a :class:`~registry.errors.CapgateError`; the docstring is what
``capgate explain CODE`` prints.  The module lives in ``registry`` because the
registry's checks report the ``CG68x`` findings and ``registry`` imports
nothing of ``executor``.
"""

from __future__ import annotations

from registry.errors import EXIT_UNKNOWN, EXIT_USAGE, CapgateError, RegistryError

__all__ = [
    "BaselineUnreadable", "CustomerNotInformed", "EffectNamesNoReturn",
    "ProductionSimulationRefused", "PromoterLacksRole", "PromotionRefused",
    "ReconciliationUndeclared", "RestorationMismatch", "ReturnedValueUnavailable",
    "ReturnsMismatch", "SimulationError", "SimulationNotFound", "SimulationStateConflict",
    "SimulationVenueRefused", "TeardownUnderivable",
]


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
