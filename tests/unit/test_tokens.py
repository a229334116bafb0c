"""Token counting: tiktoken loaded offline, per-model correction from upstream reports."""

from __future__ import annotations

from proxy.tokens import UNCALIBRATED, TokenCounter, estimate, load_encoder


def test_tiktoken_loads_offline_and_counts() -> None:
    enc = load_encoder()
    assert enc is not None
    assert enc("hello world") == 2
    assert enc("<|endoftext|>") > 1  # special tokens are counted as text, never refused


def test_correction_learned_from_reports() -> None:
    c = TokenCounter(load_encoder())
    text = "The quick brown fox jumps over the lazy dog. " * 10
    raw = c.raw(text)
    c.learn("llama", 100, 150)
    assert c.count(text, "llama") == round(raw * 1.5)
    assert c.count(text, "other") == round(raw * UNCALIBRATED)  # per model; unknown: cautious
    c.learn("llama", 100, 100)
    assert c.ratio("llama") == 0.8 * 1.5 + 0.2 * 1.0  # a moving average
    c.learn("llama", 0, 100)  # nonsense reports are ignored
    assert c.ratio("llama") == 0.8 * 1.5 + 0.2 * 1.0


def test_messages_count_includes_overhead_and_tool_calls() -> None:
    c = TokenCounter(load_encoder())
    plain = c.messages([{"role": "user", "content": "hi"}])
    with_call = c.messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            }
        ]
    )
    assert plain >= 5 and with_call > plain


def test_estimate_without_tiktoken() -> None:
    assert TokenCounter().raw("abcdefgh") == estimate("abcdefgh") == 2


def test_short_texts_are_encoded_once_and_counted_the_same() -> None:
    encoder = load_encoder()
    assert encoder is not None
    calls: list[str] = []

    def counting(text: str) -> int:
        calls.append(text)
        return encoder(text)

    tokens = TokenCounter(counting)
    line = "- [2023-05-08] Caroline: I went to the LGBTQ support group yesterday."
    first = [tokens.count(line), tokens.raw(line), tokens.messages([{"content": line}])]
    again = [tokens.count(line), tokens.raw(line), tokens.messages([{"content": line}])]
    assert first == again == [round(encoder(line) * UNCALIBRATED), encoder(line), encoder(line) + 4]
    assert calls == [line]  # remembered after the first
    long_text = "word " * 1000  # past MEMO_CHARS: counted each time, never kept
    assert tokens.raw(long_text) == tokens.raw(long_text) == encoder(long_text)
    assert calls.count(long_text) == 2


def test_the_count_memo_keeps_digests_not_texts() -> None:
    """Stored text comes back as memory lines; the memo of their counts must not keep the words
    of a turn that was forgotten since."""
    from proxy.search import timewords
    from proxy.tokens import TokenCounter

    secret = "my locker code is 4417, said last Friday"
    counter = TokenCounter()
    assert counter.count(secret) == counter.count(secret) > 0
    assert timewords.says_when(secret)
    memos = [counter._memo, dict(timewords._SEEN._data)]
    for memo in memos:
        assert memo and all(isinstance(k, bytes) and len(k) == 16 for k in memo)
        assert not any(secret in repr(k) for k in memo)


def test_how_much_of_the_tools_a_model_renders_is_learned_from_its_reports() -> None:
    c = TokenCounter()
    assert c.rendered_share("smol") == 1.0  # until the upstream says: all of them
    c.learn("smol", 100, 100)  # without tools: the factor (1.0)
    c.learn("smol", 100, 100, rendered=400)  # tools sent, nothing spent on them
    assert c.rendered_share("smol") == 0.0
    assert c.factor("smol") == 1.0  # the factor is not disturbed by requests with tools
    c.learn("qwen", 100, 100)
    for _ in range(10):
        c.learn("qwen", 100, 500, rendered=400)  # a template that renders them all
    assert abs(c.rendered_share("qwen") - 1.0) < 0.05
