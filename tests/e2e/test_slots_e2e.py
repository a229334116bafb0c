"""End to end with the real llama-server (-c 2048): an agent conversation whose tool outputs
alone are beyond the context is forwarded whole with [TOOL_RESULT:id] references, the
real chat template takes Engram's expansion tool beside the client's, and the answer comes back."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from proxy.services import SERVICES
from proxy.slots.refs import REFERENCE, slot_id
from testing.fake_chunks import template_violations
from testing.harness import Engram, settle
from tests.e2e.conftest import CTX, LlamaServer
from tests.proxy.test_slot_proxy import agent_chat

pytestmark = pytest.mark.asyncio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def source(tag: str) -> str:
    return "\n".join(f"def {tag}_{n}(x):\n    return x * {n}\n" for n in range(150))


async def test_tool_outputs_larger_than_the_context_go_as_references(
    engram: Engram, llama: LlamaServer
) -> None:
    outs = [source(t) for t in ("alpha", "beta", "gamma")]
    msgs = agent_chat(outs, "In one sentence: what do the modules define?")
    assert len(json.dumps(msgs)) // 4 > CTX  # beyond the context, raw
    body = {"model": "smollm2", "messages": msgs, "tools": [WEATHER], "max_tokens": 32}
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            engram.url + "/v1/chat/completions", json=body, headers={"X-Engram-User": "dev"}
        ) as r,
    ):
        reply = await r.json()
        assert r.status == 200, (reply, llama.log_tail())
    assert reply["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    calls = reply["choices"][0]["message"].get("tool_calls") or []
    assert all(c["function"]["name"] == "get_weather" for c in calls)
    # The real server took the request with the expansion tool beside the client's (SmolLM2's
    # template does not render tool definitions, but llama-server parsed and accepted them).
    expander = engram.app[SERVICES].pipeline.expander
    assert expander is not None and not expander.rejections.rejected("smollm2")
    await settle(engram)
    assert engram.turns[-1].expand
    # What the model saw: every module as a reference, the whole conversation kept.
    prompt = (await asyncio.to_thread(llama.get_json, "/slots"))[0]["prompt"]
    for out in outs:
        sid = slot_id("read_file", out)
        assert f"[TOOL_RESULT:{sid}]" in prompt
        assert await engram.app[SERVICES].slots.get("dev", sid) is not None
    assert "Module 0 looks fine." in prompt
    assert "def alpha_7" not in prompt
    assert REFERENCE.search(prompt) and template_violations(msgs) == []
