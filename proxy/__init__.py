"""Engram: a transparent OpenAI-compatible proxy that gives local LLM chats long-term memory."""

__version__ = "0.1.0"
