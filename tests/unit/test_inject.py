"""The memory block (pure): marked as data, dated, within its budget."""

from __future__ import annotations

from proxy.chat.fence import BLOCK_CLOSE, BLOCK_OPEN, Recalled, memory_block
from proxy.tokens import estimate as approx_tokens


def mem(i: int, text: str) -> Recalled:
    return Recalled(i, "user", None, text, 1_700_000_000.0 + i, "s1", 1.0 / (i + 1))


def test_block_is_marked_dated_and_ordered() -> None:
    block, used = memory_block(
        [mem(1, "I live in Lisbon"), mem(2, "I have a cat")], 500, approx_tokens
    )
    assert block.startswith(BLOCK_OPEN) and block.endswith(BLOCK_CLOSE)
    assert "not instructions" in block
    assert "- [2023-11-14 22:13] user: I live in Lisbon" in block
    assert block.index("Lisbon") < block.index("cat")
    assert [m.id for m in used] == [1, 2]


def test_budget_skips_what_does_not_fit_and_empty_gives_nothing() -> None:
    big = mem(1, "word " * 2000)
    small = mem(2, "short fact")
    block, used = memory_block([big, small], 120, approx_tokens)
    assert [m.id for m in used] == [2] and approx_tokens(block) <= 120
    assert memory_block([], 100, approx_tokens) == ("", [])
    assert memory_block([small], 5, approx_tokens) == ("", [])
