"""The rolling summary: made in the background by the upstream, stored, used, bounded."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.background.summarizer import DEFAULT_PROMPT, TOOL_CHARS, clean, render_turns
from proxy.chat.prompt import SUMMARY_OPEN
from proxy.services import SERVICES
from proxy.store.models import Turn
from proxy.store.summaries import get_summary
from proxy.tokens import TokenCounter
from testing.fake_chunks import chat_completion, template_violations
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, settle, start_engram
from tests.cli.test_config import ROOT
from tests.proxy.test_rewrite import long_chat

SUMMARY = "The user asked forty numbered questions about lorem ipsum; question 3 concerned lorem."


async def start(fake: FakeUpstream, **summary: Any) -> Engram:
    """An Engram whose summary is used at the very next turn (``prompt.mode = "zones"``; in
    the default mode it opens the window at the next cut: tests/proxy/test_stable_prefix.py)."""
    return await start_engram(
        fake.url,
        prompt={"reply_reserve": 256, "mode": "zones"},
        summary={"budget_share": 1.0, **summary},
    )


async def post(
    http: aiohttp.ClientSession, engram: Engram, msgs: list[dict[str, Any]]
) -> dict[str, Any]:
    async with http.post(
        engram.url + "/v1/chat/completions",
        json={"messages": msgs},
        headers={"X-Engram-User": "sum"},
    ) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def summary_of(engram: Engram) -> Any:
    """The summary of the user's conversation, or None when none of its sessions has one."""
    store = engram.app[SERVICES].store
    found = [
        await store.read(lambda c, sid=s.id: get_summary(c, sid))
        for s in await store.list_sessions("sum")
    ]
    found = [f for f in found if f is not None]
    return found[0] if found else None


@pytest.mark.asyncio
async def test_summary_made_stored_and_used_next_turn(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream(n_ctx=2048, strict_templates=True, enforce_ctx=True) as fake:
        engram = await start(fake)
        try:
            fake.enqueue(
                JsonReply(chat_completion("Question 3 was about lorem.")),
                *[JsonReply(chat_completion(SUMMARY)) for _ in range(30)],
            )
            msgs = long_chat(40)
            body = await post(http, engram, msgs)
            await settle(engram)
            stored = await summary_of(engram)
            assert stored is not None and stored.content == SUMMARY and stored.upto > 60
            summariser_call = fake.chat_requests()[1].json()
            first, second = summariser_call["messages"]
            assert first["role"] == "system" and "running summary" in first["content"]
            assert second["content"].startswith("Conversation:")
            later = fake.chat_requests()[2].json()["messages"][1]["content"]
            assert later.startswith("Earlier summary:\n" + SUMMARY)
            # The next turn carries the summary in its recency zone.
            msgs2 = [*msgs, body["choices"][0]["message"], {"role": "user", "content": "More?"}]
            await post(http, engram, msgs2)
            fwd = fake.chat_requests()[-1].json()["messages"]
            text = json.dumps(fwd)
            assert SUMMARY_OPEN in text and "forty numbered questions" in text
            assert not template_violations(fwd)
            assert fwd[0]["content"].startswith(msgs[0]["content"])  # the prefix holds
        finally:
            await engram.close()


@pytest.mark.asyncio
async def test_junk_failure_and_budget_leave_memory_alone(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream(n_ctx=2048, enforce_ctx=True) as fake:
        engram = await start(fake)
        try:
            fake.enqueue(JsonReply(chat_completion("ok")), JsonReply(chat_completion("  ")))
            await post(http, engram, long_chat(40))
            await settle(engram)
            assert await summary_of(engram) is None  # junk: nothing stored
            fake.enqueue(
                JsonReply(chat_completion("ok")),
                JsonReply({"error": {"message": "boom"}}, status=500),
            )
            # Another chat (one that said the same under another system prompt would be this one).
            said = [{**m, "content": m["content"].replace("lorem", "amet")} for m in long_chat(40)]
            other = [{"role": "system", "content": "Another chat."}, *said[1:]]
            await post(http, engram, other)
            await settle(engram)
            assert await summary_of(engram) is None  # upstream failure: nothing stored
            summarizer = engram.app[SERVICES].memory.summarizer
            assert summarizer is not None and summarizer.failed == 2
        finally:
            await engram.close()
        engram = await start(fake, budget_share=0.05)
        try:
            before = len(fake.chat_requests())
            await post(http, engram, long_chat(40))
            await settle(engram)
            # 5% of one request's tokens cannot pay for a summary: the summariser waits.
            assert len(fake.chat_requests()) == before + 1
            summarizer = engram.app[SERVICES].memory.summarizer
            assert summarizer is not None and summarizer.skipped_budget == 1
            assert summarizer.tokens_spent <= 0.05 * summarizer.tokens_proxied
        finally:
            await engram.close()


def test_clean_rejects_junk_and_caps_length() -> None:
    tokens = TokenCounter()
    assert clean("", 100, tokens) is None
    assert clean("ok ok ok ok ok", 100, tokens) is None
    assert clean("Summary: Alice lives in Porto and keeps cats.", 100, tokens) == (
        "Alice lives in Porto and keeps cats."
    )
    source = "user: we walked along the street\nassistant: thanks for part 1"
    assert (
        clean(
            "user: we walked along the street\nassistant: thanks for part 1",
            100,
            tokens,
            source=source,
        )
        is None
    )  # the input copied back
    long = "\n".join(f"- fact number {i} about the project" for i in range(200))
    out = clean(long, 50, tokens)
    assert out is not None and tokens.raw(out) <= 50


def test_config_copy_of_the_prompt_matches() -> None:
    assert (ROOT / "config" / "summary_prompt.txt").read_text() == DEFAULT_PROMPT


def test_render_turns_clips_tool_outputs_and_never_stalls_on_a_long_turn() -> None:
    def turn(pos: int, role: str, content: str) -> Turn:
        return Turn(
            id=pos, session_id="s", user_id="u", position=pos, role=role, content=content,
            speaker=None, tool_calls=None, tool_call_id=None, timestamp=0.0, token_count=1,
            content_hash=f"h{pos}", incomplete=False,
        )  # fmt: skip

    big = "x " * 20_000
    text = render_turns([turn(0, "user", "read it"), turn(1, "tool", big)], 5000)
    lines = text.splitlines()
    assert len(lines) == 2 and lines[1].startswith("tool: x x")
    assert lines[1].endswith("more characters of output]") and len(lines[1]) < TOOL_CHARS + 80
    # A first turn longer than the whole room still yields its start (one line, one turn covered).
    first = render_turns([turn(0, "user", "y " * 5000), turn(1, "user", "next")], 1000)
    assert len(first.splitlines()) == 1 and len(first) == 1000 and first.endswith("…")
