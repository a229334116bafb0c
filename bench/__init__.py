"""The benchmarks behind BENCHMARKS.md, one module each, run from the repository root:

    .venv/bin/python -m bench.<name> --help

- ``bench.proxy``: Engram's overhead against the fake upstream (``make bench``).
- ``bench.archive``: the cost of archiving a turn before the client's last byte, and sessions per
  conversation under back-to-back clients (can measure another checkout, see its docstring).
- ``bench.tools``: tool-result slots in a coding-agent session: forwarded tokens, expansion
  latency, the slot store.
- ``bench.replay``: LoCoMo conversations replayed through a running Engram: what it forwards.
- ``bench.locomo``: retrieval quality on LoCoMo through Engram's import, store and Retriever.
- ``bench.retrieval``: retrieval latency, ingest speed and memory's cost on a chat request.
- ``bench.store``: the store's search paths at scale (vec0 KNN, FTS5, hybrid).
- ``bench.embedder``: the embedder's load, query and batch times (and, given a
  ``bench.memory_load`` result, the added latency over the query embedding's time).
- ``bench.memory_load``: memory's cost on chat requests at scale, beside the query embedding's.
- ``bench.memory_profile``: a memory-on request's time and CPU per stage.
- ``bench.embed_variants``: the embedding model's builds (float, QUInt8, QInt8) on this CPU.
- ``bench.inspector``: every inspector page's server time at 100,000 turns, and what the
  inspector costs a chat request when nobody looks.
- ``bench.common``: what they share (machine figures, an embedding cache, LoCoMo loading).

They drive Engram with the top-level ``testing`` package (fake upstream, in-process harness).
Nothing here is part of the installed ``engram-proxy`` package.
"""
