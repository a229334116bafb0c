"""Ollama's ``/api/chat``: the adapter, its NDJSON wire format, translation to and
from chat completions, and its dialect of the expansion loop."""
