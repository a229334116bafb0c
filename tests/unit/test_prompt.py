"""The prompt assembler over generated conversations (pure): budgets, units, template rules."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.chat.fence import (
    DERIVED_NOTE,
    PREAMBLE,
    Recalled,
    memory_block,
    parse_block,
    says_derived,
    without_preamble,
)
from proxy.chat.prompt import MEMORY_DROPPED, SUMMARY_OPEN, assemble
from proxy.messages import content_text
from testing.fake_chunks import template_violations

Message = dict[str, Any]


def tok(text: str) -> int:
    return max(1, len(text) // 4)


def count(msg: Message) -> int:
    calls = msg.get("tool_calls")
    return tok(content_text(msg.get("content"))) + 4 + (tok(json.dumps(calls)) if calls else 0)


words = st.text(alphabet="abcdefghij klmnop", min_size=1, max_size=400).map(
    lambda s: s.strip() or "x"
)


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    msgs: list[Message] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(words)})
    call_no = 0
    for _ in range(draw(st.integers(0, 12))):
        text = draw(words)
        user_content: Any = text if draw(st.booleans()) else [{"type": "text", "text": text}]
        msgs.append({"role": "user", "content": user_content})
        # the assistant may loop through tools before answering
        for _ in range(draw(st.integers(0, 2))):
            n_calls = draw(st.integers(1, 3))
            ids = [f"call{call_no + k}" for k in range(n_calls)]
            call_no += n_calls
            msgs.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        for i in ids
                    ],
                }
            )
            msgs += [{"role": "tool", "tool_call_id": i, "content": draw(words)} for i in ids]
        msgs.append({"role": "assistant", "content": draw(words)})
    msgs.append({"role": "user", "content": draw(words)})
    if draw(st.booleans()):  # an agent loop in the current exchange
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "cur1", "type": "function", "function": {"name": "g", "arguments": "{}"}}
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": "cur1", "content": draw(words)})
    return msgs


def current_exchange(msgs: list[Message]) -> list[Message]:
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    return msgs[last_user:]


@settings(max_examples=300, deadline=None)
@given(
    conversations(),
    st.integers(50, 3000),
    st.sampled_from(["zones", "stable"]),
    st.booleans(),
    st.booleans(),
)
def test_assembly_properties(
    msgs: list[Message], budget: int, mode: str, with_memory: bool, with_summary: bool
) -> None:
    assert not template_violations(msgs)
    memory = "<memory>\n- [2026-01-01] user: likes tea\n</memory>" if with_memory else ""
    out = assemble(
        msgs,
        budget=budget,
        count=count,
        count_text=tok,
        memory_block=memory,
        memory_ids=[7] if with_memory else [],
        mode=mode,
        summary="They planned a trip." if with_summary else None,
    )
    fwd = out.messages
    if out.notes == ["over-budget"]:  # nothing of it fits cut: as sent, without memory
        assert fwd == msgs and not out.rewritten
        return
    # Strict chat-template rules hold.
    assert not template_violations(fwd), (template_violations(fwd), fwd)
    # The original system text is a byte-identical prefix.
    if msgs[0]["role"] == "system":
        assert fwd[0]["role"] == "system"
        assert fwd[0]["content"].startswith(msgs[0]["content"])
    assert sum(1 for m in fwd if m["role"] == "system") <= 1
    # The current exchange comes last and whole (in stable mode the memory leads the user turn).
    cur = current_exchange(msgs)
    tail = fwd[-len(cur) :]
    assert tail[1:] == cur[1:]
    if tail[0] != cur[0]:
        assert content_text(tail[0]["content"]).endswith(content_text(cur[0]["content"]))
    # Every kept client message is unchanged and in order; nothing is invented but the blocks.
    kept = [p.index for p in out.parts if p.index is not None]
    assert kept == sorted(kept)
    # The budget holds whenever the parts that are never cut fit in it.
    fixed = sum(count(m) for m in cur) + (count(msgs[0]) if msgs[0]["role"] == "system" else 0)
    fixed += tok(memory) + 4 if memory else 0
    fixed += tok("They planned a trip.") + 40 if with_summary else 0
    if fixed <= budget:
        assert out.tokens <= budget + 30 or not out.rewritten
    # Memory sits where the mode says, unless it was left out for the whole history to go (a
    # cut would leave nothing of it and no summary stands for it: the caller may offer less).
    if with_memory and MEMORY_DROPPED in out.notes:
        assert fwd == msgs and "likes tea" not in json.dumps(fwd)
    elif with_memory:
        text = json.dumps(fwd)
        assert text.count("likes tea") == 1
        if mode == "zones":
            assert "likes tea" in content_text(fwd[0]["content"])


def test_small_conversation_goes_whole() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    out = assemble(msgs, budget=1000, count=count, count_text=tok)
    assert out.messages == msgs and not out.rewritten


def test_long_conversation_is_cut_and_summarised() -> None:
    msgs: list[Message] = [{"role": "system", "content": "S"}]
    for i in range(40):
        msgs += [
            {"role": "user", "content": f"question {i} " * 20},
            {"role": "assistant", "content": f"answer {i} " * 20},
        ]
    msgs.append({"role": "user", "content": "and now?"})
    out = assemble(
        msgs, budget=600, count=count, count_text=tok, summary="Forty questions were asked."
    )
    assert out.rewritten and out.tokens <= 600
    assert out.messages[0] == msgs[0]
    assert out.messages[1]["role"] == "user" and SUMMARY_OPEN in json.dumps(out.messages[1])
    assert out.messages[-1] == msgs[-1]
    assert [p.source for p in out.parts][:2] == ["system", "summary"] or out.parts[
        1
    ].source.startswith("summary")
    assert not template_violations(out.messages)


def test_stable_mode_keeps_prefix_identical_across_turns() -> None:
    msgs: list[Message] = [{"role": "system", "content": "S"}]
    for i in range(3):
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    turn1 = [*msgs, {"role": "user", "content": "new one"}]
    turn2 = [*turn1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    a = assemble(
        turn1, budget=5000, count=count, count_text=tok, memory_block="MEM A", mode="stable"
    ).messages
    b = assemble(
        turn2, budget=5000, count=count, count_text=tok, memory_block="MEM B", mode="stable"
    ).messages
    # Everything before the new user message of turn 1 is byte-identical in turn 2.
    assert json.dumps(a[:-1]) == json.dumps(b[: len(a) - 1])
    z1 = assemble(turn1, budget=5000, count=count, count_text=tok, memory_block="MEM A").messages
    z2 = assemble(turn2, budget=5000, count=count, count_text=tok, memory_block="MEM B").messages
    assert z1[0] != z2[0]  # zones mode: the system message changes with the memories


def test_stable_mode_lays_earlier_blocks_again_so_every_turn_extends_the_last() -> None:
    """Each turn's block stays before the user message it was made for (``laid``): turn n+1's
    forwarded prompt extends turn n's byte for byte, blocks included."""
    msgs: list[Message] = [{"role": "system", "content": "S"}]
    laid: dict[int, str] = {}
    previous: list[Message] | None = None
    for i in range(8):
        msgs.append({"role": "user", "content": f"question {i}"})
        block = f"MEMORY FOR {i}" if i % 3 == 0 else ""
        out = assemble(
            msgs,
            budget=5000,
            count=count,
            count_text=tok,
            memory_block=block,
            mode="stable",
            laid=laid,
        )
        if previous is not None:
            assert out.messages[: len(previous)] == previous
            assert json.dumps(out.messages).startswith(json.dumps(previous)[:-1])
        if block:
            laid[len(msgs) - 1] = block
        assert out.messages[0] == {"role": "system", "content": "S"}
        previous = out.messages
        msgs.append({"role": "assistant", "content": f"answer {i}"})
    blocks = [m for m in previous or [] if isinstance(m["content"], list)]
    assert [b["content"][0]["text"] for b in blocks] == [f"MEMORY FOR {i}\n\n" for i in (0, 3, 6)]
    # the laid blocks' tokens are counted with their messages
    out = assemble(msgs, budget=5000, count=count, count_text=tok, mode="stable", laid=laid)
    plain = assemble(msgs, budget=5000, count=count, count_text=tok, mode="stable")
    assert out.tokens == plain.tokens + sum(tok(b) + 4 for b in laid.values())
    # zones lays nothing again
    zones = assemble(msgs, budget=5000, count=count, count_text=tok, laid=laid)
    assert zones.messages == plain.messages


def _block(i: int) -> str:
    mem = Recalled(i, "user", None, f"fact number {i}", 1_700_000_000.0, "s", 1.0)
    return memory_block([mem], 10_000, tok, "t")[0]


def test_the_preamble_is_said_once_by_the_first_block_of_the_prompt() -> None:
    """Later blocks go without the preamble, every turn still extends the last byte for byte,
    and a cut that leaves the first block out gives the window's new first block the preamble
    (the prefix moves at a cut anyway)."""
    msgs: list[Message] = [{"role": "system", "content": "S"}]
    laid: dict[int, str] = {}
    previous: list[Message] | None = None
    for i in range(6):
        msgs.append({"role": "user", "content": f"question {i}"})
        block = _block(i) if i % 2 == 0 else ""
        out = assemble(
            msgs, budget=5000, count=count, count_text=tok, memory_block=block,
            memory_ids=[i] if block else [], mode="stable", laid=laid,
        )  # fmt: skip
        if previous is not None:
            assert json.dumps(out.messages).startswith(json.dumps(previous)[:-1])
        if block:
            laid[len(msgs) - 1] = block
            if i > 0:
                assert out.memory_tokens == tok(without_preamble(block)) + 4
        previous = out.messages
        msgs.append({"role": "assistant", "content": f"answer {i}"})
    texts = [m["content"][0]["text"] for m in previous or [] if isinstance(m["content"], list)]
    assert [PREAMBLE in t for t in texts] == [True, False, False]
    assert [[p.text for p in parse_block(t.strip())] for t in texts] == [
        [f"fact number {i}"] for i in (0, 2, 4)
    ]
    # a window that starts after the first block: the next one says it
    msgs.append({"role": "user", "content": "last " * 40})
    out = assemble(msgs, budget=260, count=count, count_text=tok, mode="stable", laid=laid)
    assert out.rewritten and out.window_start > 1
    texts = [m["content"][0]["text"] for m in out.messages if isinstance(m["content"], list)]
    assert texts and PREAMBLE in texts[0] and all(PREAMBLE not in t for t in texts[1:])


def test_what_derived_means_is_said_once_a_prompt_by_the_first_block_that_shows_it() -> None:
    """The first block shows the user's words alone: its preamble leaves the note out; the next
    block shows a fact and says the note; the one after it shows a fact again and does not."""
    fact = Recalled(9, "fact", "Tom", "Tom is a nurse", 1_700_000_000.0, "f", 1.0)
    both = [fact, Recalled(8, "user", None, "x y", 1_700_000_000.0, "s", 1.0)]
    blocks = [_block(0), *(memory_block(m, 10_000, tok, "t")[0] for m in ([fact], both))]
    msgs: list[Message] = [{"role": "system", "content": "S"}]
    laid: dict[int, str] = {}
    previous: list[Message] | None = None
    for i, block in enumerate(blocks):
        msgs.append({"role": "user", "content": f"question {i}"})
        out = assemble(
            msgs, budget=5000, count=count, count_text=tok, memory_block=block,
            memory_ids=[i], mode="stable", laid=laid,
        )  # fmt: skip
        if previous is not None:
            assert json.dumps(out.messages).startswith(json.dumps(previous)[:-1])
        laid[len(msgs) - 1] = block
        previous = out.messages
        msgs.append({"role": "assistant", "content": f"answer {i}"})
    texts = [m["content"][0]["text"] for m in previous or [] if isinstance(m["content"], list)]
    assert [t.split("\n")[1] for t in texts] == [PREAMBLE, DERIVED_NOTE, "14 Nov 2023:"]
    assert DERIVED_NOTE not in texts[0] and DERIVED_NOTE not in texts[2]
    assert [says_derived(t.strip()) for t in texts] == [False, True, False]
    assert [[p.text for p in parse_block(t.strip())] for t in texts] == [
        ["fact number 0"],
        ["Tom is a nurse"],
        ["x y", "Tom is a nurse"],
    ]


def test_a_window_too_small_for_the_laid_blocks_cuts_them_with_their_messages() -> None:
    msgs: list[Message] = [{"role": "system", "content": "S"}]
    laid: dict[int, str] = {}
    for i in range(30):
        msgs.append({"role": "user", "content": f"question {i} " * 10})
        laid[len(msgs) - 1] = f"memory {i} " * 20
        msgs.append({"role": "assistant", "content": f"answer {i} " * 10})
    msgs.append({"role": "user", "content": "last"})
    out = assemble(msgs, budget=900, count=count, count_text=tok, mode="stable", laid=laid)
    assert out.rewritten and out.tokens <= 900
    assert not template_violations(out.messages)
    kept = [p.index for p in out.parts if p.index is not None and p.index in laid]
    assert kept and all(i >= out.window_start for i in kept)
    for part, msg in zip(out.parts, out.messages, strict=True):
        if part.index in laid:
            assert msg["content"][0]["text"].startswith(laid[part.index])


def test_tool_unit_is_never_split() -> None:
    msgs: list[Message] = [{"role": "user", "content": "read files"}]
    msgs.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
                for i in range(3)
            ],
        }
    )
    msgs += [{"role": "tool", "tool_call_id": f"c{i}", "content": "data " * 200} for i in range(3)]
    msgs += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    for budget in range(20, 1200, 37):
        out = assemble(msgs, budget=budget, count=count, count_text=tok)
        assert not template_violations(out.messages)


def test_stable_mode_keeps_the_window_start_between_cuts() -> None:
    msgs: list[Message] = [{"role": "system", "content": "S"}]
    prefixes = []
    start = None
    for i in range(60):
        msgs += [{"role": "user", "content": f"question {i} " * 15}]
        out = assemble(
            msgs, budget=800, count=count, count_text=tok, mode="stable", previous_start=start
        )
        assert not template_violations(out.messages) and out.tokens <= 800
        if out.rewritten:
            start = out.window_start
        prefixes.append(json.dumps(out.messages[:-1]))
        msgs.append({"role": "assistant", "content": f"answer {i} " * 15})
    # Most turns extend the previous prompt byte for byte: the window moves only at cuts.
    extended = sum(b.startswith(a[:-1]) for a, b in itertools.pairwise(prefixes))
    assert extended >= 0.7 * (len(prefixes) - 1)


# --- memory never makes a request worse than none (issue 22) -----------------------------------


def chat(*pairs: tuple[str, str]) -> list[Message]:
    return [{"role": role, "content": text} for role, text in pairs]


def test_the_current_turn_is_everything_after_the_last_reply() -> None:
    # Codex sends its environment block and the question as two user items; opencode's title
    # request sends its instruction and the quoted message as two user messages.
    msgs = chat(
        ("system", "S"),
        ("user", "old question " * 50),
        ("assistant", "old answer " * 50),
        ("user", "<environment_context><cwd>/new</cwd></environment_context>"),
        ("user", "where am I?"),
    )
    out = assemble(msgs, budget=60, count=count, count_text=tok, summary="asked before")
    assert out.messages[0] == msgs[0] and out.messages[2:] == [msgs[4]]
    assert content_text(out.messages[1]["content"]).endswith(msgs[3]["content"])
    assert [p.source for p in out.parts] == ["system", "summary+current", "current"]


def test_system_messages_inside_the_history_are_never_aged_out() -> None:
    # Claude Code sends its environment as a role "system" message after the first user turn.
    msgs = chat(
        ("system", "S"),
        ("user", "q1 " * 100),
        ("system", "# Environment: cwd /work"),
        ("assistant", "a1 " * 100),
        ("user", "q2"),
    )
    out = assemble(msgs, budget=60, count=count, count_text=tok, summary="q1 was asked")
    assert out.rewritten
    assert msgs[2] in out.messages and msgs[1] not in out.messages
    assert content_text(out.messages[-1]["content"]).endswith("q2")  # the summary leads it


def test_a_request_whose_fixed_part_overflows_goes_as_sent() -> None:
    msgs = chat(("system", "S " * 400), ("user", "q1"), ("assistant", "a1"), ("user", "q2"))
    out = assemble(msgs, budget=100, count=count, count_text=tok, memory_block="MEM " * 10)
    assert out.messages == msgs and out.notes == ["over-budget"] and not out.rewritten


def test_the_history_is_never_cut_to_nothing_when_it_fits_without_memory() -> None:
    history = chat(("user", "q1 " * 40), ("assistant", "a1 " * 40))
    msgs = [{"role": "system", "content": "S"}, *history, {"role": "user", "content": "q2"}]
    original = sum(count(m) for m in msgs)
    memory = "MEM " * 200  # the block alone would push the history out
    out = assemble(msgs, budget=original + 5, count=count, count_text=tok, memory_block=memory)
    assert out.messages == msgs  # whole, without the block
    assert out.notes == ["memory-dropped"]
    # A block that fits beside the whole conversation goes with it.
    small = "MEM"
    out = assemble(msgs, budget=original + 20, count=count, count_text=tok, memory_block=small)
    assert out.messages[1:] == msgs[1:] and small in out.messages[0]["content"]
    assert out.notes == []
    # With a summary standing for the history the cut is as before.
    out = assemble(
        msgs, budget=original + 5, count=count, count_text=tok, memory_block=small, summary="s"
    )
    assert out.rewritten and out.notes == []


def test_a_history_that_fits_only_cut_to_nothing_goes_as_sent() -> None:
    msgs = chat(("system", "S"), ("user", "q1 " * 400), ("assistant", "a1"), ("user", "q2"))
    out = assemble(msgs, budget=60, count=count, count_text=tok, memory_block="MEM")
    assert out.messages == msgs and out.notes == ["over-budget"]
    # With a summary standing for it, the history may be folded away.
    out = assemble(msgs, budget=60, count=count, count_text=tok, summary="q1 was long")
    assert out.rewritten and msgs[1] not in out.messages and out.notes == []
    assert out.messages[-1] == msgs[-1]
