"""Simulation first (seed 001 §5, issue 16): the cycle, its teardown, the exemption test.

Every change is simulated on a lower venue before it is promoted, unless it
passes the five-point exemption test.  The modules, each importable alone (no
module here imports another package's top, so the call path can import the
exemption test without the cycle):

* :mod:`executor.simulation.teardown` -- the teardown derived from the write log;
* :mod:`executor.simulation.exemption` -- the five-point exemption test, as a claim;
* :mod:`executor.simulation.baseline` -- capturing and re-reading the baseline;
* :mod:`executor.simulation.records` -- the ledger records of a simulation;
* :mod:`executor.simulation.production` -- the five conditions of a production
  simulation and its same-day reconciliation;
* :mod:`executor.simulation.cycle` -- the cycle itself (``simulate``).

The promotion rule that reads the evidence is :mod:`executor.promotion`.
"""
