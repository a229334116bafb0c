"""Anthropic Messages (``/v1/messages``): the adapter, its encoding and
reading of requests, the neutral conversation, replies and streams, translation to and from chat
completions, and its dialect of the expansion loop."""
