"""alembic's environment for the ledger: always run on a connection capgate hands in.

``capgate ledger migrate`` (:func:`executor.ledger.migrate.upgrade`) opens the
store, takes its DDL lock and passes the connection as
``config.attributes["connection"]``; there is no ``alembic.ini`` and no URL here,
so the migrations can never run against a database other than the ledger's.
"""

from __future__ import annotations

from alembic import context

from capgate.executor.ledger.backends import backend_named
from capgate.executor.ledger.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("the ledger migrations run only through `capgate ledger migrate`")
backend = backend_named(connection.dialect.name)
context.configure(connection=connection, target_metadata=metadata,
                  render_as_batch=backend is not None and backend.batch_migrations,
                  transaction_per_migration=False)
with context.begin_transaction():
    context.run_migrations()
