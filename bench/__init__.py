"""The benchmarks behind BENCHMARKS.md, each behind a table there, run from the repository root:

    .venv/bin/python -m bench.<name> --help

Memory off, memory on, every API:

- ``bench.proxy``: Engram's memory-off overhead against the fake upstream (``make bench``).
- ``bench.memory_load``: memory's cost on chat requests at 10k and 100k stored turns, c=1
  latency and closed-loop throughput, beside the query embedding's own time.
- ``bench.processes``: one or more ``engram serve`` processes (``--workers``) or replicas on one
  database, closed-loop throughput.
- ``bench.retrieval``: one search through the database's own path (FTS5, vec0 exact and
  quantised) at 10k and 100k turns, ingest, and memory's cost on a chat request.
- ``bench.backpressure``: a small request's latency alone and beside a 4,001-message one.
- ``bench.embedder``: the embedder's load, query and batch times, a query beside passages.
- ``bench.apis``: added latency on every chat API Engram serves, memory off and on.

Recall, and what the model server computes:

- ``bench.locomo``: retrieval quality on LoCoMo through Engram's import, store and Retriever
  (SQLite or PostgreSQL).
- ``bench.tune_fusion``: the scored fusion's weights fitted on half of LoCoMo, checked on the
  other half.
- ``bench.replay``: LoCoMo conversations replayed through a running Engram: what it forwards.
- ``bench.gate``: the relevance gate's calibration (messages that need no memory in
  ``bench.gate_data``).
- ``bench.prefix``: prompt tokens the real llama-server computes, straight and through Engram.
- ``bench.own_calls``: Engram's own calls against the user's KV cache on a one-slot server.

Storing, and the rest:

- ``bench.archive``: the cost of archiving a turn before the client's last byte, and sessions per
  conversation under back-to-back clients (can measure another checkout, see its docstring).
- ``bench.reindex``: ``engram reindex`` speed.
- ``bench.tools``: tool-result slots in a coding-agent session: forwarded tokens, expansion
  latency, the slot store.
- ``bench.agents``: what each real coding agent stores per session.
- ``bench.inspector``: every inspector page's server time at 100,000 turns, and what the
  inspector costs a chat request when nobody looks.
- ``bench.pgvector``: per-user KNN in PostgreSQL + pgvector, exact against HNSW.
- ``bench.redact``: secret redaction's cost and false positives.
- ``bench.forget``: what forgetting that forgets costs (``secure_delete``, the scrub).

Shared, not benchmarks: ``bench.common`` (machine figures, an embedding cache, LoCoMo loading),
``bench.backends`` (a SQLite file or a PostgreSQL server for a run), ``bench.gate_data``.

They drive Engram with the top-level ``testing`` package (fake upstream, in-process harness).
Nothing here is part of the installed ``engram-proxy`` package.
"""
