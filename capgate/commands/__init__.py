"""The commands as library functions: one module per command group, one function per command.

As in alembic's ``command.py``, each command is a function that does the
command's work and returns data -- never prints, never exits -- and raises a
coded ``CapgateError`` for every refusal.  Three faces share them:

* the command line (:mod:`capgate.handlers`): a handler parses its arguments,
  calls one of these and prints what it returned;
* the MCP server (:mod:`capgate.mcp_server`) calls through :func:`calls.call`;
* the Python API (:mod:`capgate`) re-exports them.

The first argument is what the command runs against: an open
:class:`~executor.call.Executor` (``gate``) for a command that acts through
the executor -- a CLI process opens one per command with
:func:`capgate.api.open`, the MCP server and a Python caller hold theirs --
and :class:`~capgate.config.Settings` for one that needs only the
configuration (the ledger's own commands, capgate's tables in a target, the
MCP server itself).  The capability-file commands take the files.

Modules import what only one command needs inside that function: a
``capgate call`` process imports this package and pays for every module-level
import here on each call (``bench/startup.py``).
"""
