"""Through a running Engram (in-process or `engram serve`) in front of the fake upstream: the proxy,
memory, prompt rewriting, slots, sub-agents, summaries, feedback, consolidation, the admin API,
crashes and fast clients; and the fake upstream itself."""
