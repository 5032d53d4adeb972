"""The command line's handlers: parse, call one command function, print.

One module per command group, named as the group's module in
:mod:`capgate.commands` is -- ``handlers.ddl`` is the command line of
``commands.ddl``.  Each has ``register(sub, common)``, which adds its commands
to the parser, and a ``cmd_*`` handler per command, which turns the arguments
into one call of the library, prints the answer (``--json``: its JSON form)
and returns the exit code.  :data:`capgate.cli.COMMANDS` lists them; a
handler imports neither the entry point nor another handler, only
:mod:`capgate.handlers.console`.
"""
