"""The ledger's table versions, as alembic migrations (see :mod:`executor.ledger.migrate`)."""
