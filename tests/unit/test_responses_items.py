"""The Responses adapter's request side: input items ↔ neutral messages, encode, hints and the
precise 400s (pure; no sockets)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.chat.prompt import append_to_system, with_leading_text
from proxy.chat.responses.adapter import OpenAIResponses
from proxy.chat.responses.items import MARK
from proxy.errors import BadRequest
from proxy.messages import canonical
from proxy.sse import AssembledReply
from testing.fake_chunks import template_violations
from testing.fake_responses import chat_messages

AGENT_INPUT: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": "Sandbox: read-only."},
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What is the weather?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
        ],
    },
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque=="},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "w", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}],
    },
    {"type": "item_reference", "id": "msg_0"},
    {"role": "user", "content": "Thanks!"},
]
BODY: dict[str, Any] = {
    "model": "m",
    "instructions": "Be brief.",
    "input": AGENT_INPUT,
    "store": False,
    "vendor": {"x": None},
    "max_output_tokens": 99,
    "stream": True,
}


def parse(body: dict[str, Any], api: OpenAIResponses | None = None) -> Any:
    return (api or OpenAIResponses()).parse(json.dumps(body).encode())


def plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != MARK} for m in messages]


def test_items_become_the_neutral_conversation() -> None:
    conv = parse(BODY)
    assert (conv.model, conv.stream, conv.reply_tokens) == ("m", True, 99)
    assert plain(conv.messages) == [
        # the instructions and the leading developer item: one system message
        {"role": "system", "content": "Be brief.\n\nSandbox: read-only."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the weather?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
            ],
        },
        # the reasoning item goes with the call it precedes
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks!"},  # the item reference travels with it
    ]
    assert template_violations(plain(conv.messages)) == []


def test_unchanged_messages_encode_to_the_same_body() -> None:
    api = OpenAIResponses()
    conv = parse(BODY, api)
    assert json.loads(api.encode(conv, conv.messages)) == BODY
    conv = parse({"input": "hi"}, api)
    assert json.loads(api.encode(conv, conv.messages)) == {"input": "hi"}


def test_memory_goes_after_the_instructions_and_folds_the_leading_items() -> None:
    api = OpenAIResponses()
    conv = parse(BODY, api)
    forwarded = [append_to_system(conv.messages[0], "<memory>"), *conv.messages[1:]]
    out = json.loads(api.encode(conv, forwarded))
    assert out["instructions"].startswith(BODY["instructions"])  # the client's text: a prefix
    assert out["instructions"] == "Be brief.\n\nSandbox: read-only.\n\n<memory>"
    # Every other item as sent, in place: reasoning, the reference, the image, the ids.
    assert out["input"] == AGENT_INPUT[1:]
    assert {k: v for k, v in out.items() if k not in ("instructions", "input")} == {
        k: v for k, v in BODY.items() if k not in ("instructions", "input")
    }
    # A strict template (llama-server makes each system item a system message) sees one.
    assert template_violations(chat_messages(out)) == []
    assert template_violations(chat_messages(BODY)) != []  # as the client sent it: two


def test_memory_is_the_whole_instructions_when_there_were_none() -> None:
    api = OpenAIResponses()
    conv = parse({"model": "m", "input": "hello"}, api)
    forwarded = [{"role": "system", "content": "<memory>"}, *conv.messages]
    assert json.loads(api.encode(conv, forwarded)) == {
        "model": "m",
        "input": "hello",
        "instructions": "<memory>",
    }
    body = {"input": [{"role": "developer", "content": "dev"}, {"role": "user", "content": "q"}]}
    conv = parse(body, api)
    out = json.loads(
        api.encode(conv, [append_to_system(conv.messages[0], "<m>"), *conv.messages[1:]])
    )
    assert out == {"input": [{"role": "user", "content": "q"}], "instructions": "dev\n\n<m>"}


def test_changed_messages_are_rebuilt_with_only_their_content_replaced() -> None:
    api = OpenAIResponses()
    conv = parse(BODY, api)
    msgs = list(conv.messages)
    msgs[3] = {**msgs[3], "content": "[TOOL_RESULT:abc] w output"}  # a slot reference
    msgs[1] = with_leading_text(msgs[1], "<summary>")
    out = json.loads(api.encode(conv, msgs))
    # A rewritten request folds the leading developer item into the instructions (one system
    # message for a strict template), whether or not the system message changed.
    assert out["instructions"] == "Be brief.\n\nSandbox: read-only."
    assert out["input"][3] == {**AGENT_INPUT[4], "output": "[TOOL_RESULT:abc] w output"}
    assert out["input"][0]["content"] == [
        {"type": "input_text", "text": "<summary>\n\n"},
        *AGENT_INPUT[1]["content"],
    ]
    assert template_violations(chat_messages(out)) == []
    # A string input stays a string.
    conv = parse({"input": "hello"}, api)
    out = json.loads(api.encode(conv, [with_leading_text(conv.messages[0], "<m>")]))
    assert out == {"input": "<m>\n\nhello"}


def test_a_cut_window_drops_the_items_of_the_messages_left_out() -> None:
    api = OpenAIResponses()
    conv = parse(BODY, api)
    summary = {"role": "user", "content": "<summary>"}
    out = json.loads(api.encode(conv, [conv.messages[0], summary, *conv.messages[4:]]))
    assert out["instructions"] == "Be brief.\n\nSandbox: read-only."
    assert out["input"] == [
        {"type": "message", "role": "user", "content": "<summary>"},
        *AGENT_INPUT[5:],
    ]


def test_a_resent_reply_hashes_like_the_archived_one() -> None:
    reply = AssembledReply(
        content="Let me look.",
        tool_calls=[
            {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    )
    resent = [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs", "summary": []},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"},
    ]
    conv = parse({"input": resent})
    assert canonical(conv.messages[1]) == canonical(reply.message())


def test_hints_name_user_and_session() -> None:
    api = OpenAIResponses()
    conv = parse({"input": "x", "user": "u1", "safety_identifier": "s1"}, api)
    assert conv.hints == {"user": "u1", "safety_identifier": "s1"}
    conv = parse({"input": "x", "prompt_cache_key": "conv-7"}, api)
    assert conv.hints == {"metadata": {"session_id": "conv-7"}}
    body = {"input": "x", "prompt_cache_key": "k", "metadata": {"session_id": "mine"}}
    assert parse(body, api).hints == {"metadata": {"session_id": "mine"}}
    # previous_response_id: the session its reply was archived in, once Engram knows it
    body = {"input": "x", "previous_response_id": "resp_1", "prompt_cache_key": "k"}
    assert parse(body, api).hints == {"metadata": {"session_id": "k"}}
    api.replied(parse(body, api), AssembledReply(id="resp_1"), "s-abc")
    assert parse(body, api).hints == {"metadata": {"session_id": "s-abc"}}


def test_lone_surrogates_are_cleaned_for_memory_not_for_the_upstream() -> None:
    api = OpenAIResponses()
    raw = b'{"input": [{"role": "user", "content": "a \\ud800 b"}]}'
    conv = api.parse(raw)
    assert conv.messages[0]["content"] == "a \ufffd b"
    assert api.encode(conv, conv.messages) == json.dumps(json.loads(raw)).encode()


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"", "invalid_json", None),
        (b"{", "invalid_json", None),
        (b"[]", "invalid_body", None),
        (b"{}", "missing_input", "input"),
        (b'{"input": 3}', "invalid_input", "input"),
        (b'{"input": "x", "instructions": ["a"]}', "invalid_instructions", "instructions"),
        (b'{"input": "x", "previous_response_id": 1}', "invalid_previous_response_id", None),
        (b'{"input": [1]}', "invalid_input", "input[0]"),
        (b'{"input": [{"content": "x"}]}', "invalid_input", "input[0]"),
        (b'{"input": [{"role": "bot", "content": "x"}]}', "invalid_input", "input[0].role"),
        (b'{"input": [{"role": "user", "content": 5}]}', "invalid_input", "input[0].content"),
        (b'{"input": [{"role": "user", "content": [7]}]}', "invalid_input", None),
        (b'{"input": [{"type": "function_call", "call_id": "c"}]}', "invalid_input", None),
        (b'{"input": [{"type": "function_call_output", "output": "o"}]}', "invalid_input", None),
    ],
)
def test_bad_input_is_a_precise_400(raw: bytes, code: str, param: str | None) -> None:
    with pytest.raises(BadRequest) as err:
        OpenAIResponses().parse(raw)
    assert err.value.code == code
    if param is not None:
        assert err.value.param == param


def test_unknown_items_and_fields_pass() -> None:
    body = {"input": [{"type": "web_search_call", "id": "ws"}, {"role": "user", "content": "q"}]}
    api = OpenAIResponses()
    conv = parse(body, api)
    assert plain(conv.messages) == [{"role": "user", "content": "q"}]
    forwarded = [{"role": "system", "content": "<m>"}, *conv.messages]
    assert json.loads(api.encode(conv, forwarded))["input"] == body["input"]
