"""What the tests, the benchmarks and the scripts share to drive Engram without a real model.

- :mod:`testing.fake_upstream`: a scriptable fake model server (llama.cpp or Ollama flavour) on
  a real port that records every request; ``python -m testing.fake_upstream --port 8081`` serves
  it standalone.
- :mod:`testing.fake_chunks`: the pure builders behind it (chunks, completion objects, error
  bodies) and the strict chat-template check.
- :mod:`testing.redis_server`: a real ``redis-server`` on a free port that can be killed and
  started again.
- :mod:`testing.harness`: an in-process Engram on a free port with its own temporary database
  (:func:`~testing.harness.start_engram`), and :func:`~testing.harness.settle` to wait for its
  background work.

Nothing here is part of the installed ``engram-proxy`` package; run from the repository root
(or with it on ``PYTHONPATH``).
"""
