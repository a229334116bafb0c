"""Which tool outputs become references, and how the references read (pure functions)."""

from __future__ import annotations

import json
from typing import Any

from proxy.slots.refs import REFERENCE, apply, call_hint, find, protected_from, references, slot_id


def count(text: str) -> int:
    return len(text.split())


def big(tag: str, words: int = 800) -> str:
    return f"# {tag}\n" + " ".join(f"{tag}{i}" for i in range(words))


def agent_chat(outputs: list[str], *, final_user: bool = True) -> list[dict[str, Any]]:
    """A system prompt, then per output: user asks, assistant calls read_file, tool answers,
    assistant comments."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i, out in enumerate(outputs):
        msgs.append({"role": "user", "content": f"look at file {i}"})
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call{i:05d}",
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "arguments": json.dumps({"path": f"src/mod{i}.py"}),
                        },
                    }
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": f"call{i:05d}", "content": out})
        msgs.append({"role": "assistant", "content": f"File {i} is fine."})
    if final_user:
        msgs.append({"role": "user", "content": "and now?"})
    return msgs


def test_old_large_outputs_are_replaced_and_ids_are_deterministic() -> None:
    outs = [big("a"), "short output", big("c")]
    msgs = agent_chat(outs)
    found = find(msgs, min_tokens=500, keep_recent="exchange", count=count)
    assert [c.index for c in found] == [3, 11]
    assert found[0].slot.id == slot_id("read_file", outs[0]) == found[0].slot.id
    assert (
        found[0].slot.id.startswith("read_file-")
        and len(found[0].slot.id) == len("read_file-") + 12
    )
    # Same content, same id; other content, another id.
    assert slot_id("read_file", outs[0]) == slot_id("read_file", big("a"))
    assert slot_id("read_file", outs[0]) != slot_id("read_file", outs[2])

    view = apply(msgs, found)
    assert len(view) == len(msgs)
    ref = view[3]
    assert ref["role"] == "tool" and ref["tool_call_id"] == "call00000"
    first, second = ref["content"].split("\n")
    assert first == f"[TOOL_RESULT:{found[0].slot.id}]"
    assert "read_file" in second and "802 tokens" in second and "src/mod0.py" in second
    # Untouched messages are the very same objects; the originals are not mutated.
    assert all(view[i] is msgs[i] for i in range(len(msgs)) if i not in (3, 11))
    assert msgs[3]["content"] == outs[0]
    assert references(view) == [found[0].slot.id, found[1].slot.id]
    # Applying again to the same history gives byte-identical JSON (a stable prompt prefix).
    again = apply(msgs, find(msgs, min_tokens=500, keep_recent="exchange", count=count))
    assert json.dumps(again) == json.dumps(view)


def test_the_current_exchange_stays_raw_by_default() -> None:
    msgs = agent_chat([big("a"), big("b")], final_user=False)
    # The last user message asked for file 1: its output is the current exchange.
    found = find(msgs, min_tokens=500, keep_recent="exchange", count=count)
    assert [c.index for c in found] == [3]
    # "round" keeps only outputs after the last assistant message; here none follow it.
    assert [c.index for c in find(msgs, min_tokens=500, keep_recent="round", count=count)] == [
        3,
        7,
    ]
    # Mid agent loop: the outputs answering the latest calls stay raw under "round".
    loop = msgs[:-1]
    assert [c.index for c in find(loop, min_tokens=500, keep_recent="round", count=count)] == [3]
    assert [c.index for c in find(loop, min_tokens=500, keep_recent="none", count=count)] == [3, 7]
    assert protected_from(loop, "none") == len(loop)


def test_threshold_is_in_tokens_and_exclusive() -> None:
    msgs = agent_chat([big("a", 498)])  # 500 words with the "# a" line
    assert find(msgs, min_tokens=500, keep_recent="exchange", count=count) == []
    assert len(find(msgs, min_tokens=499, keep_recent="exchange", count=count)) == 1


def test_legacy_function_messages_and_array_content() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "run it"},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "shell", "arguments": "{}"},
        },
        {"role": "function", "name": "shell", "content": big("f")},
        {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": big("p")}]},
        {"role": "user", "content": "thanks"},
    ]
    found = find(msgs, min_tokens=500, keep_recent="exchange", count=count)
    assert [c.slot.tool for c in found] == ["shell", "tool"]
    view = apply(msgs, found)
    assert view[2]["name"] == "shell" and REFERENCE.match(view[2]["content"])
    assert view[3]["tool_call_id"] == "x" and isinstance(view[3]["content"], str)
    assert "first line: # p" in view[3]["content"]


def test_text_protocol_results_in_user_messages() -> None:
    body = big("x")
    cline = [
        {"role": "user", "content": "<task>fix it</task>"},
        {"role": "assistant", "content": "<read_file><path>a.py</path></read_file>"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"[read_file for 'a.py'] Result:\n{body}\n"},
                {"type": "text", "text": "<environment_details>cwd</environment_details>"},
            ],
        },
        {"role": "assistant", "content": "<execute_command>ls</execute_command>"},
        {"role": "user", "content": f"[execute_command for 'ls'] Result:\n{big('y')}"},
    ]
    assert find(cline, min_tokens=500, keep_recent="exchange", count=count) == []
    found = find(cline, min_tokens=500, keep_recent="exchange", count=count, detect_text=True)
    assert len(found) == 1  # the last user message is the current exchange
    c = found[0]
    assert (c.index, c.part, c.slot.tool, c.slot.content) == (2, 0, "read_file", body)
    view = apply(cline, found)
    text = view[2]["content"][0]["text"]
    assert text.startswith("[read_file for 'a.py'] Result:\n[TOOL_RESULT:read_file-")
    assert "for: a.py" in text and body not in text
    assert view[2]["content"][1] is cline[2]["content"][1]


def test_call_hint_picks_the_path_or_command() -> None:
    assert call_hint('{"path": "src/x.py", "limit": 3}') == "path: src/x.py"
    assert call_hint({"command": ["ls", "-la"]}) == "command: ls -la"
    assert call_hint("not json") is None
    assert call_hint('{"n": 1}') is None


def test_a_reference_is_never_replaced_again() -> None:
    msgs = agent_chat([big("a")])
    view = apply(msgs, find(msgs, min_tokens=500, keep_recent="exchange", count=count))
    assert find(view, min_tokens=5, keep_recent="exchange", count=count) == []
