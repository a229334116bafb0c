"""The Anthropic Messages adapter's request side (pure): the neutral shape it parses into, the
precise 400s, and the encoding of rewritten neutral messages back into the client's body."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from proxy.chat.anthropic.adapter import AnthropicMessages, error_body, hints
from proxy.chat.anthropic.neutral import ORIGIN, AnthropicConversation
from proxy.chat.prompt import append_to_system, assemble, with_leading_text
from proxy.errors import BadRequest
from proxy.messages import chain_hashes
from proxy.slots.refs import apply as apply_slots
from proxy.slots.refs import find as find_outputs
from testing.fake_anthropic import chat_messages
from testing.fake_chunks import template_violations

API = AnthropicMessages()
BLOCK = '<memory-abc>\n- [2024-01-01] user: "I live in Lisbon"\n</memory-abc>'
PNG = "iVBORw0KGgo" * 1000

SYSTEM_BLOCKS = [
    {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": " Be careful."},
]


def agent_body(**extra: Any) -> dict[str, Any]:
    """A Claude-Code-like conversation: thinking, tool use, tool results, an image, a role
    system message after the first user turn, unknown fields everywhere."""
    return {
        "model": "claude-sonnet",
        "max_tokens": 512,
        "system": copy.deepcopy(SYSTEM_BLOCKS),
        "metadata": {"user_id": '{"device_id":"d1","account_uuid":"","session_id":"s1"}'},
        "vendor_field": None,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Read src/app.py please"}]},
            {"role": "system", "content": "Available agents: explorer, planner."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read it.", "signature": "sig=="},
                    {"type": "text", "text": "Reading."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "read_file",
                        "input": {"path": "src/app.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": "line\n" * 2000,
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "What does it do?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                    },
                ],
            },
        ],
        **extra,
    }


def parse(body: dict[str, Any]) -> AnthropicConversation:
    return API.parse(json.dumps(body).encode())


def plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neutral messages without the bookkeeping, for comparing shapes."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != ORIGIN}
        if isinstance(m.get("content"), list):
            m["content"] = [{k: v for k, v in p.items() if k != ORIGIN} for p in m["content"]]
        out.append(m)
    return out


def encoded(conv: AnthropicConversation, messages: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(API.encode(conv, messages))
    return out


# --- parse ---------------------------------------------------------------------------------------


def test_the_neutral_shape_of_an_agent_conversation() -> None:
    conv = parse(agent_body())
    assert conv.model == "claude-sonnet" and conv.reply_tokens == 512 and not conv.stream
    assert conv.reshape  # a role system message inside messages
    assert plain(conv.messages) == [
        {"role": "system", "content": "You are Claude Code. Be careful."},
        {"role": "user", "content": [{"type": "text", "text": "Read src/app.py please"}]},
        {"role": "system", "content": "Available agents: explorer, planner."},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Reading."}],
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_01", "content": "line\n" * 2000},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What does it do?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            ],
        },
    ]
    # Claude Code's own metadata.user_id names an installation, not a user or a conversation.
    assert conv.hints == {}
    # max_tokens is a required ceiling: the budget caps what it keeps free for the reply
    # (prompt.reply_share), as on every API; the adapter reports what was asked.
    assert parse({**agent_body(), "max_tokens": 32000}).reply_tokens == 32000


def test_tool_results_come_before_the_users_text_whatever_their_order() -> None:
    conv = parse(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "here:"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "a.py"}],
                        },
                    ],
                },
            ]
        }
    )
    roles = [m["role"] for m in conv.messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assert plain(conv.messages)[2]["content"] == [{"type": "text", "text": "a.py"}]
    assert conv.messages[1]["content"] is None  # only a tool call
    assert not template_violations(plain(conv.messages))


def test_claude_codes_billing_stamp_does_not_break_the_hash_chain() -> None:
    def body(stamp: str) -> dict[str, Any]:
        line = (
            f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={stamp};"
        )
        return {
            "system": [{"type": "text", "text": line}, {"type": "text", "text": "You are Claude."}],
            "messages": [{"role": "user", "content": "hi"}],
        }

    a, b = parse(body("a5145")), parse(body("0c3e9"))
    assert chain_hashes(a.messages) == chain_hashes(b.messages)
    assert "cch=fffff;" in a.messages[0]["content"]
    assert a.body["system"][0]["text"].endswith("cch=a5145;")  # the client's bytes keep it


@pytest.mark.parametrize(
    ("user_id", "expected"),
    [
        ("alice-7f3a", {"user": "alice-7f3a"}),
        ("user_9f86d081884c7d65_account__session_57a121ec-f78c-48c3-a745-e3036a3ecc33", {}),
        ('{"device_id":"abc","account_uuid":"","session_id":"54c1eb09"}', {}),
        ("", {}),
    ],
)
def test_metadata_user_id_names_the_user_unless_claude_code_made_it(
    user_id: str, expected: dict[str, Any]
) -> None:
    assert hints({"metadata": {"user_id": user_id}}) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                    }
                ]
            },
            "messages[0].content[0].input",
        ),
        ({"system": 3, "messages": []}, "system"),
        ({"system": [{"type": "image"}], "messages": []}, "system[0]"),
        ({"model": "m"}, "messages"),
    ],
)
def test_bad_requests_get_a_precise_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse(body)
    assert err.value.param == param


def test_errors_have_anthropics_shape() -> None:
    assert error_body(400, "invalid_request_error", "bad") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }
    assert error_body(502, "upstream_error", "down")["error"]["type"] == "api_error"
    assert (
        error_body(413, "invalid_request_error", "big")["error"]["type"] == "invalid_request_error"
    )
    assert error_body(413, "payload_too_large", "big")["error"]["type"] == "request_too_large"
    assert error_body(503, "busy", "later")["error"]["type"] == "overloaded_error"


# --- encode --------------------------------------------------------------------------------------


def test_unchanged_messages_encode_to_the_clients_body() -> None:
    body = agent_body()
    del body["messages"][1]  # without the role system message there is nothing to move
    del body["messages"][2]["content"][1:]  # nor a tool result beside other blocks
    conv = parse(body)
    assert not conv.reshape
    assert encoded(conv, conv.messages) == body


def test_tool_results_beside_other_blocks_go_first_in_a_message_of_their_own() -> None:
    body = agent_body()
    del body["messages"][1]
    conv = parse(body)
    assert conv.reshape
    out = encoded(conv, conv.messages)
    results, rest = body["messages"][2]["content"][:1], body["messages"][2]["content"][1:]
    assert out["messages"] == [
        *body["messages"][:2],
        {"role": "user", "content": results},
        {"role": "user", "content": rest},
    ]
    assert template_violations(chat_messages(body))  # llama-server: text before the results
    assert not template_violations(chat_messages(out))


def test_memory_goes_after_the_clients_system_string() -> None:
    body = {"system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "x": 1}
    conv = parse(body)
    out = encoded(conv, [append_to_system(conv.messages[0], BLOCK), *conv.messages[1:]])
    assert out == {**body, "system": "Be brief.\n\n" + BLOCK}


def test_memory_goes_after_the_clients_system_blocks_which_stay_as_sent() -> None:
    body = agent_body()
    conv = parse(body)
    out = encoded(conv, [append_to_system(conv.messages[0], BLOCK), *conv.messages[1:]])
    assert out["system"][:2] == SYSTEM_BLOCKS  # cache_control kept, byte-identical prefix
    # then the role system message's text, then the memory block, as text blocks
    assert out["system"][2:] == [
        {"type": "text", "text": "\n\nAvailable agents: explorer, planner."},
        {"type": "text", "text": "\n\n" + BLOCK},
    ]
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user", "user"]
    assert out["messages"][1] == body["messages"][2]  # thinking and signature intact, in place
    assert (
        out["messages"][2]["content"] + out["messages"][3]["content"]
        == (body["messages"][3]["content"])
    )
    assert {k: v for k, v in out.items() if k not in ("system", "messages")} == {
        k: v for k, v in body.items() if k not in ("system", "messages")
    }
    # What llama-server makes of it has one system message, first: strict templates accept it.
    assert not template_violations(chat_messages(out))


def test_memory_becomes_the_system_when_the_client_sent_none() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    conv = parse(body)
    out = encoded(conv, [{"role": "system", "content": BLOCK}, *conv.messages])
    assert out == {"system": BLOCK, "messages": body["messages"]}


def test_role_system_messages_join_the_system_once_each() -> None:
    reminder = {"role": "system", "content": [{"type": "text", "text": "Skills: pdf."}]}
    body = {
        "system": "Top.",
        "messages": [
            {"role": "user", "content": "one"},
            reminder,
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "two"},
            reminder,
        ],
    }
    conv = parse(body)
    out = encoded(conv, conv.messages)
    # blocks stay blocks (a cache_control on them would be kept), after the client's text
    assert out["system"] == [
        {"type": "text", "text": "Top."},
        {"type": "text", "text": "\n\nSkills: pdf."},
    ]
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]
    assert not template_violations(chat_messages(out))
    # A leading role system message is the system (and takes the memory) when there is no other.
    body = {"messages": [{"role": "system", "content": "Lead."}, {"role": "user", "content": "x"}]}
    conv = parse(body)
    out = encoded(conv, [append_to_system(conv.messages[0], BLOCK), *conv.messages[1:]])
    assert out == {"system": "Lead.\n\n" + BLOCK, "messages": [{"role": "user", "content": "x"}]}


def test_a_tool_result_slot_replaces_only_that_blocks_content() -> None:
    body = agent_body()
    conv = parse(body)
    found = find_outputs(conv.messages, min_tokens=100, keep_recent="none", count=len)
    assert [c.index for c in found] == [4]
    view = apply_slots(conv.messages, found)
    out = encoded(conv, view)
    [result] = out["messages"][2]["content"]
    assert result["content"].startswith("[TOOL_RESULT:read_file-")
    assert result["is_error"] is False and result["cache_control"] == {"type": "ephemeral"}
    assert result["tool_use_id"] == "toolu_01"
    assert out["messages"][3]["content"] == body["messages"][3]["content"][1:]
    assert out["messages"][1] == body["messages"][2]


def test_a_tool_result_with_block_content_keeps_its_blocks_where_unchanged() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    body = {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "text", "text": "old"}, image],
                    }
                ],
            },
        ]
    }
    conv = parse(body)
    tool = conv.messages[2]
    changed = {**tool, "content": [{**tool["content"][0], "text": "new"}, tool["content"][1]]}
    out = encoded(conv, [*conv.messages[:2], changed])
    assert out["messages"][2]["content"][0]["content"] == [{"type": "text", "text": "new"}, image]
    out = encoded(conv, [*conv.messages[:2], {**tool, "content": "[TOOL_RESULT:f-1]"}])
    ref = [{"type": "text", "text": "[TOOL_RESULT:f-1]"}]  # blocks stay blocks
    assert out["messages"][2]["content"][0]["content"] == ref


def test_parts_engram_adds_become_text_blocks_where_the_stages_put_them() -> None:
    body = agent_body()
    conv = parse(body)
    last = conv.messages[-1]
    out = encoded(conv, [*conv.messages[:-1], with_leading_text(last, BLOCK)])
    assert out["messages"][-2]["content"] == body["messages"][3]["content"][:1]  # results first
    blocks = out["messages"][-1]["content"]
    assert blocks[0] == {"type": "text", "text": BLOCK + "\n\n"}
    assert blocks[1:] == body["messages"][3]["content"][1:]
    # A string content becomes blocks: Engram's first, then the client's text.
    body = {"messages": [{"role": "user", "content": "hi"}]}
    conv = parse(body)
    out = encoded(conv, [with_leading_text(conv.messages[0], BLOCK)])
    assert out["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": BLOCK + "\n\n"}, {"type": "text", "text": "hi"}],
        }
    ]


def test_a_cut_window_with_its_summary_reads_well_to_a_strict_template() -> None:
    turns: list[dict[str, Any]] = []
    for i in range(12):
        turns += [
            {"role": "user", "content": [{"type": "text", "text": f"question {i} " + "x " * 200}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": f"t{i}", "name": "grep", "input": {"q": str(i)}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"t{i}", "content": "found " * 50},
                    {"type": "text", "text": f"and {i}?"},
                ],
            },
            {"role": "assistant", "content": f"answer {i}"},
        ]
    body = {"system": "Sys.", "messages": [*turns, {"role": "user", "content": "last one"}]}
    conv = parse(body)

    def count(m: dict[str, Any]) -> int:
        return len(json.dumps(m)) // 4

    a = assemble(
        conv.messages,
        budget=3000,
        count=count,
        count_text=lambda t: len(t) // 4,
        memory_block=BLOCK,
        summary="Earlier they grepped a lot.",
    )
    assert a.rewritten
    out = encoded(conv, a.messages)
    assert out["system"] == "Sys.\n\n" + BLOCK
    assert a.aged > 4 and "question 0 " not in json.dumps(out["messages"])
    assert "Earlier they grepped a lot." in json.dumps(out["messages"][0])
    for m in out["messages"]:
        if m["role"] == "assistant" and isinstance(m["content"], list):
            assert m in body["messages"]  # assistant turns go whole, thinking included
    assert not template_violations(chat_messages(out))


def test_lone_surrogates_are_cleaned_only_in_the_neutral_copy() -> None:
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    conv = API.parse(raw)
    assert conv.messages[0]["content"] == "a\ufffdb"
    assert conv.body["messages"][0]["content"] == "a\ud800b"
    out = API.encode(conv, [{"role": "system", "content": BLOCK}, *conv.messages])
    assert b"\\ud800" in out  # the client's text as it sent it, next to the memory
