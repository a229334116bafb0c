"""Token counting for budgets: tiktoken's cl100k_base, loaded offline, corrected per model.

tiktoken downloads its BPE files on first use; here they come from the ``bpe-openai`` package
(byte-identical once gunzipped), written once into a cache folder that ``TIKTOKEN_CACHE_DIR``
points at, so tiktoken checks them against its own known hashes. An OpenAI tokenizer only
estimates what a llama.cpp or Ollama model counts, so :class:`TokenCounter` keeps a per-model
correction factor learned from what the upstream reports (``usage.prompt_tokens``).
If tiktoken cannot load at all, a characters-per-token estimate stands in.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.messages import content_text

log = logging.getLogger("engram.tokens")

_ENCODING = "cl100k_base"
_URL = f"https://openaipublic.blob.core.windows.net/encodings/{_ENCODING}.tiktoken"
# Per message: role and the template's delimiters (OpenAI documents 3-4 for its chat format).
MESSAGE_OVERHEAD = 4
# Assumed ratio of a model's tokens to cl100k_base's until its usage reports teach the real one.
UNCALIBRATED = 1.2
# Texts up to this long have their counts remembered: a recalled turn's memory line comes back
# in many requests, and counting lines was a fifth of the event loop's time at 16 clients.
MEMO_CHARS = 2048
MEMO_ENTRIES = 10_000  # forgotten all at once past this


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "engram" / "tiktoken"


def _install_bpe_file(cache: Path) -> None:
    """Put cl100k_base where tiktoken looks for it (file named by the sha1 of its URL)."""
    target = cache / hashlib.sha1(_URL.encode()).hexdigest()
    if target.exists():
        return
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the bpe-openai package (tiktoken's files, offline) is not installed")
    source = Path(next(iter(spec.submodule_search_locations))) / "data" / f"{_ENCODING}.tiktoken.gz"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(gzip.decompress(source.read_bytes()))
    tmp.replace(target)


def load_encoder() -> Callable[[str], int] | None:
    """A function counting cl100k_base tokens, or None if tiktoken is unavailable."""
    try:
        cache = Path(os.environ.get("TIKTOKEN_CACHE_DIR") or _cache_dir())
        _install_bpe_file(cache)
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
        import tiktoken

        enc = tiktoken.get_encoding(_ENCODING)
    except Exception as exc:  # budgets fall back to an estimate; nothing else depends on it
        log.warning("tiktoken unavailable (%s); estimating 4 characters per token", exc)
        return None

    def count(text: str) -> int:
        return len(enc.encode(text, disallowed_special=()))

    return count


def estimate(text: str) -> int:
    return (len(text) + 3) // 4


class TokenCounter:
    """Counts tokens as the upstream model would, as nearly as can be known without it."""

    def __init__(self, encoder: Callable[[str], int] | None = None) -> None:
        self._encode = encoder or estimate
        # digest of a short text -> tokens (dict operations are atomic). Keyed by a digest, not
        # the text: a forgotten turn's words do not linger in memory.
        self._memo: dict[bytes, int] = {}
        self._ratio: dict[str, float] = {}
        self._rendered: dict[str, float] = {}  # model -> share of tool definitions it renders
        self._lock = threading.Lock()

    def _count(self, text: str) -> int:
        if len(text) > MEMO_CHARS:
            return self._encode(text)
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        n = self._memo.get(key)
        if n is None:
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            n = self._memo[key] = self._encode(text)
        return n

    def count(self, text: str, model: str | None = None) -> int:
        """Tokens of ``text`` for ``model`` (corrected by what that model reported before)."""
        return round(self._count(text) * self.factor(model))

    def factor(self, model: str | None) -> float:
        """The correction for ``model``: learned, else a cautious guess. Local models'
        tokenizers usually split text finer than cl100k_base (SmolLM2: about 1.1x), and a
        prompt that overflows fails outright, so an unknown model is assumed to need more."""
        return self._ratio.get(model or "") or UNCALIBRATED

    def raw(self, text: str) -> int:
        """Uncorrected tiktoken count (what corrections are learned against)."""
        return self._count(text)

    def learn(self, model: str | None, estimated: int, reported: int, rendered: int = 0) -> None:
        """Fold in an upstream report: ``reported`` prompt tokens where we counted
        ``estimated`` for the messages and ``rendered`` for tool definitions (uncorrected). A
        request without tools corrects the model's factor; one with tools tells how much of them
        its chat template renders (what it spent beyond the messages; many small models' templates
        leave tools out). Moving averages, so one odd request does not swing budgets."""
        if estimated <= 0 or reported <= 0:
            return
        key = model or ""
        if rendered > 0:
            f = self.factor(model)
            share = min(1.5, max(0.0, (reported - f * estimated) / (f * rendered)))
            with self._lock:
                old = self._rendered.get(key)
                self._rendered[key] = share if old is None else 0.7 * old + 0.3 * share
            return
        sample = min(4.0, max(0.25, reported / estimated))
        with self._lock:
            old = self._ratio.get(key)
            self._ratio[key] = sample if old is None else 0.8 * old + 0.2 * sample

    def measured_rendered(self, model: str | None, share: float) -> None:
        """The share of tool definitions ``model``'s template renders, as the upstream measured
        it (its own template and tokenizer, :meth:`proxy.upstream.Upstream.rendered_tokens`):
        taken as it is where nothing was learned yet."""
        with self._lock:
            self._rendered.setdefault(model or "", min(1.5, max(0.0, share)))

    def learned(self) -> dict[str, dict[str, float]]:
        """What :meth:`learn` has learned, to share with other processes on the database:
        ``{"ratio": {model: factor}, "rendered": {model: share}}``."""
        with self._lock:  # rounded: a moving average's last digits are not worth a write
            return {
                "ratio": {m: round(v, 3) for m, v in self._ratio.items()},
                "rendered": {m: round(v, 3) for m, v in self._rendered.items()},
            }

    def adopt(self, learned: Mapping[str, Any]) -> None:
        """Take what another process (or this one before a restart) learned, for the models
        this one has not learned itself; values outside what :meth:`learn` makes are ignored."""
        bounds = {"ratio": (0.25, 4.0), "rendered": (0.0, 1.5)}
        with self._lock:
            for kind, mine in (("ratio", self._ratio), ("rendered", self._rendered)):
                theirs = learned.get(kind)
                if not isinstance(theirs, dict):
                    continue
                low, high = bounds[kind]
                for model, value in theirs.items():
                    ok = isinstance(value, int | float) and low <= value <= high
                    if isinstance(model, str) and ok and model not in mine:
                        mine[model] = float(value)

    def knows_rendered(self, model: str | None) -> bool:
        """Whether :meth:`rendered_share` for ``model`` is learned (here or adopted)."""
        return (model or "") in self._rendered

    def rendered_share(self, model: str | None) -> float:
        """How much of the tool definitions ``model``'s chat template renders, as learned
        (:meth:`learn`); all of them until the upstream has said."""
        return self._rendered.get(model or "", 1.0)

    def ratio(self, model: str | None) -> float | None:
        return self._ratio.get(model or "")

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """Uncorrected tokens of a chat prompt: every message's text plus its overhead."""
        total = 0
        for msg in messages:
            total += self._count(content_text(msg.get("content"))) + MESSAGE_OVERHEAD
            calls = msg.get("tool_calls")
            if isinstance(calls, list):
                total += self._count(json.dumps(calls, ensure_ascii=False))
        return total
