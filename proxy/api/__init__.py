"""Engram's own HTTP routes under ``/engram/api/``: the admin API (search, sessions, export,
feedback, consolidation, stats, slots)."""
