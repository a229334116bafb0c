"""Pure functions: no server, no database."""
