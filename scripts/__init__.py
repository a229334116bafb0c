"""Tools for people, run from the repository root as modules: ``python -m scripts.<name>``.

- ``scripts.demo``: a short scripted chat that shows Engram recalling a fact in a new
  conversation (imports only the standard library and the ``openai`` SDK; Engram itself, when it
  has to start one, runs as ``python -m proxy serve``).
- ``scripts.llama_server``: build, locate or run the bundled llama-server (``proxy.bundled``).

Run as modules, they import this checkout's top-level packages (``proxy``) with no ``sys.path``
edits. The benchmarks are in ``bench/`` (``python -m bench.<name>``).
"""
