"""A client's side requests told from its user's turns by what they are (issue 38, item 1): a
single-shot request quoting the latest exchange of a live conversation of the same user is
forwarded as sent, given no memory, archived nowhere, and splits or joins no session, whatever
its wording; what a person sends is still archived (a first message, a document pasted twice, a
reply quoted without the exchange, another user's chat quoted)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.chat.machinery import fold, quotes, single_shot
from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle
from tests.proxy.test_memory import all_turns, chat

FACT = "My sister's tortoise is called Zanzibar and she eats dandelions."

# Open WebUI 0.12.4's follow-up prompt begins so; no known-prompt pattern matches it.
FOLLOW_UPS = (
    "### Task:\nPredict 3-5 useful messages this user might naturally send next, in their own "
    "voice, based on the chat history.\n### Guidelines:\n- Write each as the user would.\n"
    '### Output:\nJSON format: { "follow_ups": ["Message 1", "Message 2"] }\n'
    "### Chat History:\n<chat_history>\n{history}\n</chat_history>"
)
# A made-up client's wording: nothing in proxy/clients.py knows it.
NEW_CLIENT = "Summarise in five words, reply with JSON only.\n\n{history}"


def history(messages: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{m['role'].upper()}: {m['content']}" for m in messages if m["role"] != "system"
    )


async def told(
    http: aiohttp.ClientSession, engram: Engram, user: str, **headers: str
) -> list[dict[str, Any]]:
    """A chat in which the user tells the fact and says one more thing: its messages."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": FACT}]
    for then in (None, "Also, remind me to water the ferns on Sunday."):
        if then is not None:
            messages.append({"role": "user", "content": then})
        body, _ = await chat(http, engram, messages, user, headers=headers)
        messages.append(body["choices"][0]["message"])
    await settle(engram)
    return messages


@pytest.mark.asyncio
@pytest.mark.parametrize("template", [FOLLOW_UPS, NEW_CLIENT], ids=["open-webui-0.12.4", "unknown"])
async def test_a_side_request_quoting_the_chat_is_forwarded_as_sent_and_stored_nowhere(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession, template: str
) -> None:
    messages = await told(http, engram, "webui")
    before = await all_turns(engram, "webui")
    side = [{"role": "user", "content": template.replace("{history}", history(messages))}]
    for stream in (False, True):
        _, r = await chat(http, engram, side, "webui", stream=stream)
        assert r.headers["X-Engram-Memories"] == "0"
        assert "X-Engram-Session" not in r.headers
        assert fake.chat_requests()[-1].json()["messages"] == side  # forwarded as sent
    await settle(engram)
    after = await all_turns(engram, "webui")
    assert [t.id for t in after] == [t.id for t in before]  # archived nowhere
    assert sum(t.content == FACT for t in after) == 1  # the fact stored once
    status = await http.get(engram.url + "/engram/metrics")
    assert "engram_client_tasks_total 2" in await status.text()


@pytest.mark.asyncio
async def test_with_open_webui_user_headers_the_side_request_stays_out_of_the_chat(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """ENABLE_FORWARD_USER_INFO_HEADERS: the side request names the real chat; still nothing of
    it is archived there, and the chat goes on in one session."""
    headers = {"X-OpenWebUI-User-Id": "u-1", "X-OpenWebUI-Chat-Id": "chat-1"}
    messages = await told(http, engram, "", **headers)
    side = [{"role": "user", "content": FOLLOW_UPS.replace("{history}", history(messages))}]
    _, r = await chat(http, engram, side, headers=headers)
    assert r.headers["X-Engram-Memories"] == "0"
    messages.append({"role": "user", "content": "And what does she eat?"})
    body, r = await chat(http, engram, messages, headers=headers)
    assert r.headers["X-Engram-Session"] == "chat-1"
    messages.append(body["choices"][0]["message"])
    await settle(engram)
    store = engram.app[SERVICES].store
    sessions = await store.list_sessions("u-1")
    assert [s.name for s in sessions] == ["chat-1"]
    stored = [t.content for t in await store.session_turns(sessions[0].id)]
    assert stored == [m["content"] for m in messages]  # no side prompt between its turns


@pytest.mark.asyncio
async def test_what_a_person_sends_is_still_archived(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    messages = await told(http, engram, "person")
    reply = messages[1]["content"]
    document = "Minutes of the allotment society, 3 May. " * 20
    firsts = [
        "What should I cook tonight?",  # a new chat's first message
        document,  # a long text pasted in one chat ...
        document,  # ... and again in another
        f'You told me "{reply}" earlier. Why?',  # a reply quoted without its exchange
    ]
    for text in firsts:
        _, r = await chat(http, engram, [{"role": "user", "content": text}], "person")
        assert "X-Engram-Session" in r.headers, text
    # Another user's chat quoted in full is no conversation of this user's.
    other = [{"role": "user", "content": NEW_CLIENT.replace("{history}", history(messages))}]
    _, r = await chat(http, engram, other, "someone-else")
    assert "X-Engram-Session" in r.headers
    await settle(engram)
    stored = [t.content for t in await all_turns(engram, "person")]
    for text in firsts:
        assert text in stored, text
    status = await http.get(engram.url + "/engram/metrics")
    assert "engram_client_tasks_total 0" in await status.text()


def test_the_rule_itself() -> None:
    turns = [("assistant", "Zanzibar is a fine name for a tortoise."), ("user", FACT)]
    quoted = fold(f"### Task\nUSER: {FACT}\nASSISTANT: Zanzibar is a fine\n name for a tortoise.")
    assert quotes(quoted, turns)  # re-wrapped lines are the same words
    assert not quotes(fold(f"USER: {FACT}"), turns)  # the person's words alone
    assert not quotes(fold("ASSISTANT: Zanzibar is a fine name for a tortoise."), turns)
    assert not quotes(fold("ok Sure! ok"), [("assistant", "Sure!"), ("user", "ok")])  # too short
    # A reasoning model's reply: Open WebUI quotes it without its reasoning (a <details> block
    # it made of <think>, left out of the history), and a long one cut in the middle.
    thought = "<think>The user names a tortoise; I should be warm about it.</think>\n\n"
    answer = "What a lovely name! Zanzibar suits a tortoise who takes her time."
    reasoned = [("assistant", thought + answer), ("user", FACT)]
    assert quotes(fold(f"USER: {FACT}\nASSISTANT: {answer}"), reasoned)
    long = "Tortoises live long lives. " * 60 + answer
    cut = long[:497] + "..." + long[-497:]
    assert quotes(fold(f"USER: {FACT}\nASSISTANT: {cut}"), [("assistant", long), ("user", FACT)])
    assert not quotes(fold(f"USER: {FACT}\nASSISTANT: Something else entirely."), reasoned)
    assert single_shot([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert not single_shot(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    )
    assert not single_shot([{"role": "user", "content": "u"}, {"role": "user", "content": "v"}])
