"""The fake upstream's KV cache (:mod:`testing.fake_upstream`, ``FakeUpstream(kv_cache=True)``):
what llama-server reports of a chat request's prompt, computed and reused, from the longest
prefix it shares with the last prompt, as its ``timings`` and ``usage``.

One slot, like llama-server with ``--parallel 1``: a prompt is rendered as text (each message's
role and text, then the tool definitions), about four characters a token (as
:func:`testing.fake_chunks.rough_tokens` counts), and the tokens of the shared prefix are
reused, but never the whole prompt: the last token is always computed, as llama-server does.
"""

from __future__ import annotations

import json
from typing import Any

from testing.fake_chunks import text_of


def rendered(messages: list[Any], tools: Any = None) -> str:
    """The prompt as the fake's chat template would render it."""
    out = [
        f"<|{m.get('role')}|>{text_of(m.get('content'))}<|end|>\n"
        for m in messages
        if isinstance(m, dict)
    ]
    if tools:
        out.append(json.dumps(tools, sort_keys=True))
    return "".join(out)


class KVCache:
    """The last prompt seen; :meth:`use` says what a new one reuses of it."""

    def __init__(self) -> None:
        self.prompt = ""
        self.last: tuple[int, int] | None = None  # the last prompt's (computed, reused)

    def use(self, prompt: str, total: int) -> tuple[int, int]:
        """``(computed, reused)`` of ``prompt``, ``total`` tokens long; it becomes the last."""
        shared = next(
            (i for i, (a, b) in enumerate(zip(self.prompt, prompt, strict=False)) if a != b),
            min(len(self.prompt), len(prompt)),
        )
        self.prompt = prompt
        reused = max(0, min(shared // 4, total - 1))
        self.last = (total - reused, reused)
        return self.last


def timings(computed: int, reused: int, predicted: int) -> dict[str, Any]:
    """llama-server's ``timings`` object."""
    return {
        "cache_n": reused,
        "prompt_n": computed,
        "prompt_ms": computed * 0.5,
        "prompt_per_token_ms": 0.5,
        "prompt_per_second": 2000.0,
        "predicted_n": predicted,
        "predicted_ms": predicted * 10.0,
        "predicted_per_token_ms": 10.0,
        "predicted_per_second": 100.0,
    }


def with_report(usage: dict[str, Any], reused: int) -> dict[str, Any]:
    """``usage`` with llama-server's ``prompt_tokens_details``."""
    return {**usage, "prompt_tokens_details": {"cached_tokens": reused}}


def on_last_chunk(events: list[bytes], extra: dict[str, Any]) -> list[bytes]:
    """A streamed reply's events with ``extra`` added to its last JSON chunk (llama-server puts
    its ``timings`` there: the usage chunk when asked for, else the finish chunk)."""
    out = list(events)
    if not extra:
        return out
    for i in range(len(out) - 1, -1, -1):
        line = out[i]
        if line.startswith(b"data: {"):
            obj = json.loads(line[len(b"data: ") :])
            out[i] = b"data: " + json.dumps({**obj, **extra}, separators=(",", ":")).encode()
            out[i] += b"\n\n"
            break
    return out
