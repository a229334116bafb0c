"""What the model server's own chat template and tokenizer make of a prompt: llama-server's
``/apply-template`` renders the messages and tools as the model sees them, ``/tokenize`` counts
that text. Engram asks once per model how many tokens a client's tool definitions take
(:meth:`proxy.chat.rewrite.Rewriter.rendered_tokens`), instead of guessing from their JSON.
"""

from __future__ import annotations

from typing import Any

from proxy.upstream import Upstream, get_json, join_url


async def rendered_tokens(upstream: Upstream, messages: list[Any], tools: list[Any]) -> int | None:
    """How many tokens the model server's chat template makes of ``messages`` with ``tools``.
    None from any upstream but llama-server, or when it cannot say (an older server, a template
    that refuses)."""
    if upstream.info.kind != "llamacpp":
        return None
    timeout = upstream.settings.probe_timeout
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    got = await get_json(
        upstream.session, "POST", join_url(upstream.base, "/apply-template"), timeout, body
    )
    found = got[1] if got is not None and got[0] == 200 else None
    prompt = found.get("prompt") if isinstance(found, dict) else None
    if not isinstance(prompt, str):
        return None
    got = await get_json(
        upstream.session, "POST", join_url(upstream.base, "/tokenize"), timeout, {"content": prompt}
    )
    found = got[1] if got is not None and got[0] == 200 else None
    tokens = found.get("tokens") if isinstance(found, dict) else None
    return len(tokens) if isinstance(tokens, list) else None
