"""How the registry loads 10,000 rows fast -- machinery, not what a capability means.

``registry/`` itself holds the domain a reader comes for: what a row is
(``model``), how files become a registry (``loader``, ``registry``), what makes
a row wrong (``checks``, ``dialect_checks``, ``simulation_checks``, ``schema``),
the lock and the review card.  What is here only makes that fast and locates
its findings, and changes for reasons of speed rather than meaning:

* ``yamlpos`` -- YAML parsed straight from libyaml's events, with the line and
  column of every value (or only of each row, on a clean file);
* ``fastschema`` -- JSON Schema questions answered "yes" quickly, jsonschema
  asked otherwise;
* ``filecheck`` -- one file checked on its own, the unit of a parallel load;
* ``parallel`` -- those files checked in forked worker processes;
* ``cache`` -- files that passed before are not checked again (keyed by
  content, code, schema and library versions), their rows built lazily.

Nothing here decides whether a capability is valid: the rules live in the
domain modules, and each shortcut here (``fastschema``, ``parallel``,
``cache``) has a plain path beside it that finds the same problems at the
same lines -- the tests compare the two.
This ``__init__`` imports nothing, so that a call reaching one of these
modules pays for that module alone (``tests/test_startup.py``).
"""
