"""OpenAI Responses (``/v1/responses``): the adapter, its input items, replies
and streams, translation to and from chat completions, and its dialect of the expansion loop."""
