"""The commands as library functions: one module per command group, one function per command.

As in alembic's ``command.py``, each command is a function that does the
command's work and returns data -- never prints (the demo, a story told as it
goes, writes to the stream it is given), never exits -- and raises a coded
``CapgateError`` for every refusal.  A command that is one library function
already (``executor.cases.show``, ``executor.simulation.cycle.simulate``) is
that function, re-exported by its group's module; the DDL commands are the
methods of the service :func:`ddl.service` makes.  Three faces share them:

* the command line (:mod:`capgate.handlers`): a handler parses its arguments,
  calls one of these and prints what it returned;
* the MCP server (:mod:`capgate.mcp_server`): a tool call is :func:`calls.call`;
* the Python API (:mod:`capgate`): ``capgate.validate``, ``init_project``,
  ``rehearse``, ``resume``, ``simulate``, ... are these functions.

The first argument is what the command runs against: an open
:class:`~executor.call.Executor` (``gate``) for a command that acts through
the executor -- a CLI process opens one per command with
:func:`capgate.api.open`, the MCP server and a Python caller hold theirs --
:class:`~capgate.config.Settings` for one that needs only the configuration
(the ledger's own commands, the MCP server and a rehearsal, which build their
own executor), the files for the capability-file commands, and the
configuration file for ``target`` (whose ``admin_url`` works without one).

Modules import what only one command needs inside that function: a
``capgate call`` process imports this package and pays for every module-level
import here on each call (``bench/startup.py``).
"""
