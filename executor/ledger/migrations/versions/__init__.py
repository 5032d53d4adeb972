"""One module per ledger table revision."""
