"""Work that never runs while a client waits: indexing archived turns, rolling summaries,
sub-agent hand-backs, feedback and consolidation into facts, and the token figures."""
