"""The relevance gate (proxy/search/relevance.py): what it lets through, on made-up hits."""

from __future__ import annotations

from proxy.search.relevance import (
    GateSettings,
    HitFeatures,
    admit,
    content_words,
    is_question,
    query_content,
)

G = GateSettings()


def hit(
    cosine: float | None,
    *,
    score: float = 1.0,
    fts: int | None = 1,
    role: str = "user",
    content: str = "My sister Marta lives in Porto",
) -> HitFeatures:
    return HitFeatures(score, cosine, fts, 1, role, content)


def test_content_words_leave_out_greetings_thanks_and_stop_words() -> None:
    assert content_words("Thanks, that's all! ok bye") == []
    assert content_words("Hi there, good morning :)") == []
    assert content_words("My sister Marta lives in Porto") == ["sister", "marta", "lives", "porto"]
    assert content_words("code 4711") == ["code", "4711"]


def test_questions_are_told_from_statements() -> None:
    assert is_question("when did I go to Kyoto")
    assert is_question("Remind me of my garage code")
    assert is_question("and the code was…?")
    assert not is_question("I'm planning my week.")
    assert not is_question("Make it shorter")
    assert query_content("thanks!").words == 0


def test_a_message_without_content_words_gets_nothing_but_a_very_close_hit() -> None:
    q = query_content("thanks, that's all")
    assert admit(q, [hit(0.45), hit(0.3)], G) == []
    assert admit(q, [hit(0.9)], G) == [0]  # cosine_alone


def test_bare_acknowledgements_are_never_memories() -> None:
    q = query_content("What did you say about that?")
    hits = [hit(0.9, content="ok"), hit(0.9, content="Thanks!"), hit(0.9, content="haha nice")]
    assert admit(q, hits, G) == []


def test_a_statement_takes_only_close_hits_near_the_best() -> None:
    q = query_content("I'm planning a trip to Porto next week.")
    hits = [
        hit(0.6, score=1.0),
        hit(0.5, score=0.85),
        hit(0.6, score=0.5),  # far below the best score
        hit(0.3, score=0.9),  # not close enough to a statement
    ]
    assert admit(q, hits, G) == [0, 1]


def test_a_question_takes_every_hit_over_its_cosine_whatever_its_rank() -> None:
    q = query_content("Where does my sister live?")
    hits = [hit(0.6, score=1.0), hit(0.3, score=0.2), hit(0.15, score=0.9)]
    assert admit(q, hits, G) == [0, 1]


def test_a_models_reply_needs_more_than_a_users_words() -> None:
    q = query_content("Where did I travel last spring?")
    bar = G.question_cosine + G.assistant_extra / 2
    hits = [hit(bar, role="user"), hit(bar, role="assistant")]
    assert admit(q, hits, G) == [0]


def test_a_vector_only_hit_needs_the_higher_bar_and_no_cosine_passes_on_full_text() -> None:
    q = query_content("Where does my sister live?")
    assert admit(q, [hit(0.4, fts=None)], G) == []
    assert admit(q, [hit(0.55, fts=None)], G) == [0]
    assert admit(q, [hit(None)], G) == [0]  # fts-only (no vector path): rank alone
    assert admit(q, [hit(None, fts=None)], G) == []


def test_the_gate_off_passes_everything_in_order() -> None:
    off = GateSettings(enabled=False)
    hits = [hit(-1.0, content="ok"), hit(0.0)]
    assert admit(query_content("thanks"), hits, off) == [0, 1]
    assert admit(query_content("thanks"), [], G) == []
