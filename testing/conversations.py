"""Synthetic conversations for tests and benchmarks: long ones with distinct texts (so none is
answered from the embedder's cache), built from a small word list, the same for the same seed."""

from __future__ import annotations

import random
from typing import Any

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "garden",
    "river",
    "mountain",
    "engine",
    "coffee",
    "table",
    "window",
]


def long_conversation(
    messages: int, chars: int = 350, seed: int = 1, system: str = "You are helpful."
) -> list[dict[str, Any]]:
    """A system prompt and ``messages - 1`` turns of about ``chars`` characters, alternating
    user and assistant, ending with a user message."""
    rnd = random.Random(seed)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i in range(messages - 1):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rnd.choice(WORDS))
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": f"{i} " + " ".join(words)})
    if out[-1]["role"] != "user":
        out.append({"role": "user", "content": "and now?"})
    return out
