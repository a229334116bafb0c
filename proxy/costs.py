"""What the model server computed and what it reused of one request's prompt, read from what it
reported with its reply (pure).

A local model server keeps the last prompt's KV cache and computes only what follows the longest
prefix it shares with the new one (invariant 4 is measured by this). Each server says so in its
own words, in the reply's last chunk or its whole body:

- llama.cpp's llama-server: ``timings`` (``prompt_n`` computed, ``cache_n`` reused), on chat
  completions (the JSON body, the last streamed chunk) and the Responses stream's terminal
  event; and in ``usage`` (below) too.
- OpenAI chat completions: ``usage.prompt_tokens`` (the whole prompt) and
  ``usage.prompt_tokens_details.cached_tokens`` (reused).
- OpenAI Responses: ``usage.input_tokens`` and ``usage.input_tokens_details.cached_tokens``.
- Anthropic Messages: ``usage.input_tokens`` and ``cache_creation_input_tokens`` (computed),
  ``cache_read_input_tokens`` (reused).
- Ollama's ``/api/chat``: ``prompt_eval_count`` (the whole prompt in current Ollama, the cached
  part included) and ``prompt_eval_cached_count`` (reused; Ollama leaves it out when 0).

A count is a whole number from 0 to :data:`MAX_TOKENS`; anything else (a string, a negative or
fractional number, a boolean) is as if absent, and a split that does not add up (more reused than
the whole) keeps only the whole. Nothing here raises. When a reply reports both ``usage`` and
``timings`` (llama-server), the usage wins where it tells the split: summed over Engram's
expansion round trips it covers every round, where the timings are the last round's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 10**12


@dataclass(frozen=True, slots=True)
class PromptCost:
    """One request's prompt as the model server reported it: tokens ``computed``, ``reused``
    from its KV cache, and ``total`` (both together); None where it said nothing. ``source``
    names the field it came from ("timings", "usage", "prompt_eval_count")."""

    computed: int | None
    reused: int | None
    total: int | None
    source: str

    @property
    def split(self) -> bool:
        """Whether both the computed and the reused part are known."""
        return self.computed is not None and self.reused is not None

    @property
    def reused_share(self) -> float | None:
        """Reused / (computed + reused), when both are known and not both 0."""
        if self.computed is None or self.reused is None or not self.computed + self.reused:
            return None
        return self.reused / (self.computed + self.reused)


def count(value: Any) -> int | None:
    """A token count as reported, or None for anything that is not a plausible one."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= MAX_TOKENS else None


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else None


def _split(total: int | None, reused: int | None, source: str) -> PromptCost | None:
    """A cost from the whole prompt and its reused part."""
    if total is None and reused is None:
        return None
    if total is None:
        return PromptCost(None, reused, None, source)
    if reused is None or reused > total:
        return PromptCost(None, None, total, source)
    return PromptCost(total - reused, reused, total, source)


def from_timings(timings: Any) -> PromptCost | None:
    """llama-server's ``timings``: ``prompt_n`` computed, ``cache_n`` reused."""
    computed = count(_field(timings, "prompt_n"))
    reused = count(_field(timings, "cache_n"))
    if computed is None and reused is None:
        return None
    total = computed + reused if computed is not None and reused is not None else None
    return PromptCost(computed, reused, total, "timings")


def from_chat_usage(usage: Any) -> PromptCost | None:
    """Chat completions' ``usage``."""
    details = _field(usage, "prompt_tokens_details")
    return _split(
        count(_field(usage, "prompt_tokens")), count(_field(details, "cached_tokens")), "usage"
    )


def from_responses_usage(usage: Any) -> PromptCost | None:
    """The Responses API's ``usage``."""
    details = _field(usage, "input_tokens_details")
    return _split(
        count(_field(usage, "input_tokens")), count(_field(details, "cached_tokens")), "usage"
    )


def from_anthropic_usage(usage: Any) -> PromptCost | None:
    """Anthropic's ``usage``: what was read from the cache was reused, the rest (the plain input
    and what was written to the cache) computed. Without ``cache_read_input_tokens`` the reuse
    is unknown: only the whole is kept."""
    plain = count(_field(usage, "input_tokens"))
    written = count(_field(usage, "cache_creation_input_tokens"))
    reused = count(_field(usage, "cache_read_input_tokens"))
    computed = None if plain is None and written is None else (plain or 0) + (written or 0)
    if reused is None:
        return None if computed is None else PromptCost(None, None, computed, "usage")
    if computed is None:
        return PromptCost(None, reused, None, "usage")
    return PromptCost(computed, reused, computed + reused, "usage")


def from_ollama(final: Any) -> PromptCost | None:
    """Ollama's ``/api/chat`` final object (the ``done`` line, or the whole reply)."""
    return _split(
        count(_field(final, "prompt_eval_count")),
        count(_field(final, "prompt_eval_cached_count")),
        "prompt_eval_count",
    )


def pick(*costs: PromptCost | None) -> PromptCost | None:
    """The first that tells the split, else the first reported."""
    found = [c for c in costs if c is not None]
    return next((c for c in found if c.split), found[0] if found else None)


def chat_cost(usage: Any, timings: Any) -> PromptCost | None:
    """A chat completion's (or a Responses reply's, with ``usage`` already read) cost from its
    ``usage`` and llama-server's ``timings``."""
    return pick(from_chat_usage(usage), from_timings(timings))


def describe(cost: PromptCost | None) -> str:
    """One line for the inspector: what the model server said it did with the prompt."""
    if cost is None:
        return "not reported by the upstream"
    c, r = cost.computed, cost.reused
    if c is not None and r is not None:
        share = cost.reused_share
        pct = f" ({share * 100:.1f} %)" if share is not None else ""
        text = f"computed {c} prompt tokens, reused {r} from its cache{pct}"
    elif c is not None:
        text = f"computed {c} prompt tokens; what it reused from its cache was not reported"
    elif r is not None:
        text = f"reused {r} prompt tokens from its cache; what it computed was not reported"
    else:
        text = f"{cost.total} prompt tokens; what it reused from its cache was not reported"
    return f"{text} (from its {cost.source})"
