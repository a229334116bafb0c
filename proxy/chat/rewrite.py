"""The rewrite stage: what the forwarded prompt holds, under the upstream's token budget.

The budget is the upstream's context size (:meth:`Rewriter.budget`) minus the reply's room and a
safety share. Old bulky tool outputs become slot references first (:mod:`proxy.slots.refs`, the
assembler works on that view); a draft assembly tells recall which turns the window keeps; the
final assembly (:func:`proxy.chat.prompt.assemble`, pure) puts the memory block
(:mod:`proxy.chat.fence`) at the start and the rolling summary plus recent turns at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from proxy.background.summarizer import Summarizer
from proxy.cache import LRU, SizedLRU
from proxy.chat.fence import Recalled, block_tag, memory_block
from proxy.chat.laying import UNLIMITED, Layer, user_chains
from proxy.chat.prompt import (
    MEMORY_DROPPED,
    NO_ROOM,
    OVER_BUDGET,
    Assembly,
    Message,
    assemble,
    current_start,
    fixed_tokens,
    is_system,
    last_user_index,
    memory_room,
    whole_within,
)
from proxy.chat.recall import Recall
from proxy.chat.turn import Laid, MemoryTurn
from proxy.config import Settings
from proxy.messages import anchor_length, content_text
from proxy.redact import Redactor
from proxy.slots.refs import TOOL_ROLES, Candidate, references
from proxy.slots.refs import apply as apply_slots
from proxy.slots.refs import find as find_outputs
from proxy.slots.store import SlotStore
from proxy.store.store import Store
from proxy.store.summaries import get_summary
from proxy.tokens import TokenCounter

log = logging.getLogger("engram.rewrite")

# Tokens kept spare beyond the reply's room: chat templates add their own.
PROMPT_MARGIN = 32
PROMPT_SAFETY = 0.05  # share of the budget left unused: token estimates err by a few percent
# Messages whose token counts are remembered (by chain hash) across requests.
SIZE_CACHE = 50_000
WINDOWS = 100_000  # sessions whose last window start is remembered
MESSAGE_OVERHEAD = 300  # bytes a message dict holds besides its text
BLOCK_SLACK = 16  # tokens left beside a memory block made to fit what the history leaves
THREAD_TEXT = 20_000  # characters past which a first token count goes to a thread
OPENAI_CHAT = "openai-chat"  # the chat API whose tools llama-server's template takes as sent
RENDER_WAIT_S = 1.0  # how long a request waits, once per model, for the upstream's tool count


def prompt_size(entry: tuple[float, Assembly]) -> int:
    """About how many bytes a kept prompt holds (4 per token, plus each message's dict)."""
    assembly = entry[1]
    return 4 * assembly.tokens + MESSAGE_OVERHEAD * len(assembly.messages)


class Rewriter:
    """Budgets and assembles the forwarded prompt; one per server (it keeps token counts)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        tokens: TokenCounter,
        recall: Recall,
        context_size: Callable[[str | None], Awaitable[int | None]] | None = None,
        summarizer: Summarizer | None = None,
        slots: SlotStore | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.tokens = tokens
        self.recall = recall
        self.context_size = context_size
        self.summarizer = summarizer
        self.slots = slots
        self._sizes: LRU[str, int] = LRU(SIZE_CACHE)  # chain hash -> message tokens
        self._raw_counts: LRU[str, int] = LRU(SIZE_CACHE)  # text hash -> tokens
        # Tool outputs become slots redacted, as turns are archived.
        self._redact = Redactor() if settings.memory.redact_secrets else None
        # session id -> (when, assembly) of its last forwarded prompt, for the inspector's
        # last-request view; bounded by bytes (limits.last_prompts_bytes)
        self.last_requests: SizedLRU[str, tuple[float, Assembly]] = SizedLRU(
            settings.limits.last_prompts_bytes, prompt_size
        )
        # session id -> where its last rewritten window began (-1: it went whole), so the next
        # request's window starts there too (the upstream's prompt cache keeps working)
        self.windows: LRU[str, tuple[int, str | None]] = LRU(WINDOWS)
        self.layer = Layer(store, recall)  # the blocks earlier requests laid (mode stable)
        self.fence_secret = secrets.token_bytes(32)  # the memory block's tags (fence.block_tag)
        # Read what other processes learned of a model's token counts, before budgeting a
        # request of a model not learned here (set by proxy.services; None: nothing to ask).
        self.unlearned: Callable[[], Awaitable[None]] | None = None
        # How many tokens the upstream's template makes of messages and tools (llama-server's
        # /apply-template and /tokenize; set by proxy.services), and the one ask per model.
        self.render_probe: Callable[[list[Any], list[Any]], Awaitable[int | None]] | None = None
        self._render_probes: dict[str, asyncio.Future[None]] = {}

    async def compose(
        self,
        mt: MemoryTurn,
        reply_tokens: int | None,
        recall: bool,
        context_size: int | None = None,
        rendered: Sequence[Any] = (),
    ) -> None:
        """Recall memories for what the window does not hold, then assemble the prompt.
        ``context_size``: the context the request itself sets (Ollama's ``num_ctx``), if any;
        ``rendered``: what else of the body the upstream renders into the prompt (tools)."""
        s = self.settings
        budget = await self.budget(reply_tokens, mt.model, context_size)
        if budget is not None and rendered:
            tools = await self.rendered_tokens(rendered, mt.model, mt.api == OPENAI_CHAT)
            budget = max(0, budget - tools)
        mt.budget = budget
        sizes = await self.message_sizes(mt)
        model = mt.model
        share = whole_within(s.prompt.mode, s.prompt.whole_share)
        full = budget is None or sum(sizes.values()) > share * budget
        swap = full or s.slots.replace == "always"  # (slots.replace: the prefix holds till full)
        view = mt.view = await self.slot_view(mt) if swap else mt.messages
        if view is not mt.messages:  # the references, counted once (the assembler asks often)
            factor = self.tokens.factor(model)
            for m in view:
                if id(m) not in sizes:
                    sizes[id(m)] = round(self.tokens.messages([m]) * factor)

        def count_text(text: str) -> int:
            return self.tokens.count(text, model)

        def count(msg: Message) -> int:
            n = sizes.get(id(msg))
            return (
                n
                if n is not None
                else round(self.tokens.messages([msg]) * self.tokens.factor(model))
            )

        fixed = fixed_tokens(view, count)
        if budget is not None and fixed > budget:
            # The system prompt, tools and current turn alone overflow: the request goes as
            # the client sent it, without memories (nothing Engram adds or cuts would help).
            mt.view, mt.slot_refs = mt.messages, []  # what goes: the client's own messages
            mt.assembly = assemble(mt.messages, budget=budget, count=count, count_text=count_text)
            mt.memory_note = OVER_BUDGET
            self._remember(mt, mt.assembly)
            return
        latest: str | None = None
        if budget is not None and mt.placement is not None and self.summarizer is not None:
            sid = mt.placement.session.id
            found = await self.store.read(lambda c: get_summary(c, sid))
            latest = mt.summary = found.content if found else None
        stable = s.prompt.mode == "stable"
        if mt.placement is not None:
            window = self.windows.get(mt.placement.session.id)
            start = window[0] if window is not None else None
            mt.previous_start = start if start is not None and start >= 0 else None
            if stable and mt.previous_start is not None and window is not None:
                mt.summary = window[1]  # the summary the window opened with, until a cut
        if recall and stable:
            mt.laid = await self.laid(mt, view)
        laid = mt.laid.blocks if mt.laid is not None else None
        room = memory_room(s.retrieval, budget) if recall else 0
        mt.memory_room = room if budget is None else max(0, min(room, budget - fixed))
        mem_room = mt.memory_room

        def plan(room: int) -> Assembly:  # the window, with ``room`` kept for the memory
            return assemble(
                view,
                budget=None if budget is None else budget - room,
                count=count,
                count_text=count_text,
                mode=s.prompt.mode,
                whole_share=share,
                summary=mt.summary,
                previous_start=mt.previous_start,
                laid=laid,
            )

        # Zones keeps the memory's room free in the window. Stable goes whole while it fits,
        # the memory taking what is left (a cut moves the prefix); a conversation that no
        # longer fits (or was cut before) is cut leaving the memory its room, as in zones.
        windowed = mt.previous_start is not None
        draft = plan(0 if stable and not windowed else mem_room)
        if stable and budget is not None and draft.rewritten and not windowed:
            draft = plan(mem_room)
        elif stable and budget is not None and not draft.rewritten:
            mt.memory_room = max(0, min(mem_room, budget - draft.tokens - BLOCK_SLACK))
        memories: list[Recalled] = []
        if mt.laid is not None and mt.laid.current_memories is not None:
            # The same message as before (a tool loop's next request, a regenerated reply):
            # exactly the block it had, searched for no more.
            memories = mt.laid.current_memories
        elif recall:
            shown = mt.laid.shown_from(draft.window_start) if mt.laid is not None else set()
            memories = await self.recall.recall(mt, draft.window_start, shown)
            if mt.laid is not None and mt.memory_note != "recall-timeout":
                mt.block_key = mt.laid.current_key  # what is laid now is recorded (archive)
        final = self.assemble(mt, memories, budget, count, count_text)
        if stable and final.window_start != mt.previous_start and mt.summary != latest:
            mt.summary = latest  # a cut: the window opens with the newest summary
            final = self.assemble(mt, memories, budget, count, count_text)
        if MEMORY_DROPPED in final.notes and budget is not None:
            # The history fits only without the block: a smaller block in what is left.
            mt.memory_room = max(0, budget - final.original_tokens - BLOCK_SLACK)
            final = self.assemble(mt, memories, budget, count, count_text)
        kept = self.recall.not_in(memories, mt.messages[final.window_start :])
        if len(kept) != len(memories):  # the final window holds some: drop them, assemble again
            final = self.assemble(mt, kept, budget, count, count_text)
        if OVER_BUDGET in final.notes:  # as sent after all: nothing of it fits cut
            mt.injected, mt.memory_note = [], OVER_BUDGET
        elif kept and not mt.injected and mt.memory_note is None:
            mt.memory_note = NO_ROOM  # found, and none fits: said, not left to guess
        if view is not mt.messages:  # the client's own count, before its outputs became slots
            final.original_tokens = sum(count(m) for m in mt.messages)
        mt.assembly = final
        if self.summarizer is not None:
            self.summarizer.account_prompt(final.tokens)
        if final.messages != mt.messages:
            mt.forward_messages = final.messages
            mt.raw_tokens = round(final.tokens / self.tokens.factor(model))
            mt.slot_refs = references(final.messages) if mt.slot_refs else []
        self._remember(mt, final)

    def _remember(self, mt: MemoryTurn, final: Assembly) -> None:
        """Keep where the window began (and the summary it opened with) and what was sent,
        for the session's next request and the inspector's last-request view."""
        if mt.placement is not None:
            sid = mt.placement.session.id
            start = final.window_start if final.rewritten else -1
            self.windows[sid] = (start, mt.summary if start >= 0 else None)
            self.last_requests[sid] = (time.time(), final)

    async def laid(self, mt: MemoryTurn, view: Sequence[Message]) -> Laid:
        """What earlier requests of the conversation laid before its user messages
        (:mod:`proxy.chat.laying`), rendered again."""
        first = 1 if view and is_system(view[0]) else 0
        current = last_user_index(view, current_start(view, first))
        keys = user_chains(mt.messages, mt.chains)
        placed = mt.placement
        session = placed.session.id if placed is not None and not placed.created else None
        return await self.layer.read(
            mt.identity.user,
            keys,
            current,
            self.fence_secret,
            session,
            anchor_length(mt.messages),
            len(mt.messages) - 1,
        )

    def tag(self, mt: MemoryTurn) -> str:
        """The memory block's tag for this request's conversation (:func:`block_tag`); a block
        laid again keeps the tag it was laid with."""
        if mt.laid is not None and mt.laid.current_tag is not None:
            return mt.laid.current_tag
        scope = mt.placement.session.id if mt.placement is not None else mt.identity.user
        return block_tag(self.fence_secret, scope)

    async def rendered_tokens(
        self, rendered: Sequence[Any], model: str | None, ask: bool = False
    ) -> int:
        """Tokens the upstream spends on ``rendered`` (tool definitions): their JSON's tokens,
        corrected for the model, times the share of them its chat template renders (learned
        from the ``usage`` it reports: :meth:`proxy.tokens.TokenCounter.learn`; ``ask``: tools
        in chat completions' shape, which the upstream can be asked to count)."""
        t = self.tokens
        if not t.knows_rendered(model) and self.unlearned is not None:
            await self.unlearned()  # another process may have learned it (background.stats)
        raw = await self.rendered_raw(rendered)
        if ask and not t.knows_rendered(model) and self.render_probe is not None and raw:
            await self._measure_rendered(list(rendered), model, raw)
        return round(raw * t.factor(model) * t.rendered_share(model))

    async def _measure_rendered(self, tools: list[Any], model: str | None, raw: int) -> None:
        """Ask the upstream, once per model, how many tokens its template makes of these tools
        (llama-server renders a one-word chat with and without them); waited for at most
        ``RENDER_WAIT_S``, after which this request counts them all and the answer serves the
        next. Usage reports correct it later (:meth:`proxy.tokens.TokenCounter.learn`)."""
        key = model or ""
        job = self._render_probes.get(key)
        if job is None:
            probe = self.render_probe
            assert probe is not None

            async def measure() -> None:
                chat = [{"role": "user", "content": "hi"}]
                with_tools = await probe(chat, tools)
                without = await probe(chat, []) if with_tools is not None else None
                if with_tools is not None and without is not None:
                    share = max(0, with_tools - without) / (raw * self.tokens.factor(model))
                    self.tokens.measured_rendered(model, share)
                    log.info(
                        "the upstream's template renders %.0f %% of %s's tools", share * 100, key
                    )

            job = self._render_probes[key] = asyncio.ensure_future(measure())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(job), RENDER_WAIT_S)

    async def rendered_raw(self, rendered: Sequence[Any]) -> int:
        """Uncorrected tokens of ``rendered`` as JSON, remembered by its hash: clients send the
        same tools on every request (the first count of a long set is made on a thread)."""
        text = json.dumps(rendered, ensure_ascii=False, separators=(", ", ": "))
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
        n = self._raw_counts.get(key)
        if n is None:
            big = len(text) > THREAD_TEXT
            n = await asyncio.to_thread(self.tokens.raw, text) if big else self.tokens.raw(text)
            self._raw_counts[key] = n
        return n

    async def budget(
        self, reply_tokens: int | None, model: str | None, context_size: int | None = None
    ) -> int | None:
        """Prompt tokens available: the context size (the request's own, else the upstream's)
        minus the room kept for the reply: what the client asked for (``max_tokens``…), else
        ``prompt.reply_reserve``, and never more than ``prompt.reply_share`` of the context."""
        ctx = context_size
        if ctx is None:
            if self.context_size is None:
                return None
            try:
                ctx = await self.context_size(model)
            except Exception:
                log.exception("could not learn the upstream's context size")
                return None
        if not ctx:
            return None
        p = self.settings.prompt
        reserve = min(reply_tokens or p.reply_reserve, int(ctx * p.reply_share))
        # Counts are estimates (another tokenizer, corrected on average): keep a safety share.
        return max(0, int((ctx - reserve) * (1 - PROMPT_SAFETY)) - PROMPT_MARGIN)

    async def message_sizes(self, mt: MemoryTurn) -> dict[int, int]:
        """Token counts of the client's messages by ``id()``, cached by chain hash across
        requests (clients resend the history); large uncached batches go to a thread."""
        missing = [
            (m, h) for m, h in zip(mt.messages, mt.chains, strict=True) if h not in self._sizes
        ]
        if missing:

            def count_all() -> list[int]:
                return [self.tokens.messages([m]) for m, _ in missing]

            chars = sum(len(content_text(m.get("content"))) for m, _ in missing)
            counts = await asyncio.to_thread(count_all) if chars > 20_000 else count_all()
            for (_, h), n in zip(missing, counts, strict=True):
                self._sizes[h] = n
        ratio = self.tokens.factor(mt.model)
        out: dict[int, int] = {}
        for m, h in zip(mt.messages, mt.chains, strict=True):
            cached = self._sizes.get(h)
            # evicted meanwhile (a prompt longer than the cache): count again
            tokens = cached if cached is not None else self.tokens.messages([m])
            out[id(m)] = round(tokens * ratio)
        return out

    async def slot_view(self, mt: MemoryTurn) -> list[dict[str, Any]]:
        """The messages with old bulky tool outputs swapped for references to stored slots.
        An output that could be stored nowhere stays raw: nothing is ever dropped."""
        s = self.settings.slots
        if self.slots is None or not s.enabled:
            return mt.messages
        tool_chars = sum(
            len(content_text(m.get("content")))
            for m in mt.messages
            if m.get("role") in TOOL_ROLES or (s.detect_text_results and m.get("role") == "user")
        )
        if tool_chars <= s.min_tokens:
            return mt.messages

        def plan() -> list[Candidate]:
            return find_outputs(
                mt.messages,
                min_tokens=s.min_tokens,
                keep_recent=s.keep_recent,
                count=self.raw_tokens,
                detect_text=s.detect_text_results,
                clean=self._redact,
            )

        found = await asyncio.to_thread(plan) if tool_chars > 20_000 else plan()
        if not found:
            return mt.messages
        unique = list({c.slot.id: c.slot for c in found}.values())
        try:
            session = mt.placement.session.id if mt.placement is not None else None
            stored = await self.slots.put_many(mt.identity.user, unique, session)
        except Exception:  # put_many never raises; if it did, the outputs go raw
            log.exception("storing tool-result slots failed; forwarding them raw")
            return mt.messages
        keep = [c for c in found if c.slot.id in stored]
        mt.slot_refs = list(dict.fromkeys(c.slot.id for c in keep))
        return apply_slots(mt.messages, keep) if keep else mt.messages

    def raw_tokens(self, text: str) -> int:
        """Tokens of a tool output by the fixed tokenizer (deterministic: the reference's
        description holds it), cached by content hash."""
        key = hashlib.sha1(text.encode()).hexdigest()
        n = self._raw_counts.get(key)
        if n is None:
            n = self.tokens.raw(text)
            self._raw_counts[key] = n
        return n

    def assemble(
        self,
        mt: MemoryTurn,
        memories: list[Recalled],
        budget: int | None,
        count: Callable[[Message], int],
        count_text: Callable[[str], int],
    ) -> Assembly:
        s = self.settings
        again = mt.laid is not None and mt.laid.current_memories is not None
        room = UNLIMITED if again else mt.memory_room  # a block laid again is not cut
        block, used = memory_block(memories, room, count_text, self.tag(mt), mt.block_year)
        mt.injected = [m.id for m in used]
        # The block's tokens as its lines' plus one per line end, as memory_block filled it
        # (each line counted and remembered then): at most a token a line above the exact
        # count (a line end may merge with its neighbour), so the budget errs on the safe
        # side; tiktoken on the whole block again was a tenth of a memory-on request's
        # event-loop time.
        lines = block.split("\n")
        block_tokens = sum(count_text(line) for line in lines) + len(lines) - 1

        def count_block(text: str) -> int:
            return block_tokens if text is block else count_text(text)

        return assemble(
            mt.view if mt.view is not None else mt.messages,
            budget=budget,
            count=count,
            count_text=count_block,
            memory_block=block,
            memory_ids=mt.injected,
            mode=s.prompt.mode,
            whole_share=whole_within(s.prompt.mode, s.prompt.whole_share),
            summary=mt.summary,
            previous_start=mt.previous_start,
            laid=mt.laid.blocks if mt.laid is not None else None,
        )
