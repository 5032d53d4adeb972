"""capgate."""
