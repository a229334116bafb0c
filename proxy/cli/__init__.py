"""The ``engram`` command: ``main`` parses arguments and serves; ``commands`` are the
subcommands that work on the database without a server (search, sessions, forget, export,
import, stats, doctor)."""
