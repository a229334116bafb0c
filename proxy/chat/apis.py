"""The chat APIs Engram serves through the memory pipeline, each by its adapter
(:class:`proxy.chat.api.ChatAPI`). The app routes every path of each to a pipeline of its own."""

from __future__ import annotations

from proxy.chat.anthropic.adapter import AnthropicMessages
from proxy.chat.api import ChatAPI
from proxy.chat.ollama.adapter import OllamaChat
from proxy.chat.openai.adapter import OpenAIChat
from proxy.chat.responses.adapter import OpenAIResponses


def chat_apis() -> list[ChatAPI]:
    """One adapter per API, OpenAI chat completions first."""
    return [OpenAIChat(), AnthropicMessages(), OpenAIResponses(), OllamaChat()]


def api_for_path(apis: list[ChatAPI], path: str) -> ChatAPI | None:
    """The adapter serving ``path``, if any."""
    for api in apis:
        if path in api.paths:
            return api
    return None
