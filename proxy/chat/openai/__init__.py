"""OpenAI chat completions (``/v1/chat/completions``): the adapter and its dialect
of the expansion loop."""
