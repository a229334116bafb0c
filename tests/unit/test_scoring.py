"""Scored fusion's features and order (proxy/search/scoring.py)."""

from __future__ import annotations

import math

from proxy.config import RetrievalSettings
from proxy.search.scoring import FEATURES, LENGTH_CAP, Candidate, features, named_speakers
from proxy.search.scoring import scored_fusion as fuse
from proxy.search.timewords import asks_about_time, says_when


def cand(
    i: int,
    *,
    session: str = "s",
    pos: int = 0,
    speaker: str | None = None,
    chars: int = 100,
    bm25: float | None = None,
    cosine: float | None = None,
    text: str = "",
) -> Candidate:
    return Candidate(i, session, pos, speaker, chars, bm25, cosine, text)


def row(rows: list[tuple[float, ...]], i: int) -> dict[str, float]:
    return dict(zip(FEATURES, rows[i], strict=True))


def test_named_speakers_are_whole_words_and_never_roles() -> None:
    speakers = ["Caroline", "Mel", "user", "assistant", "A", None]
    assert named_speakers("What did caroline research?", speakers) == {"Caroline"}
    assert named_speakers("Did Melanie paint?", speakers) == set()  # "Mel" inside a word
    assert named_speakers("what did the user and assistant say? A or B", speakers) == set()
    assert named_speakers("Mel's dog", speakers) == {"Mel"}


def test_features_of_each_candidate() -> None:
    cs = [
        cand(1, pos=0, speaker="Caroline", bm25=-4.0, cosine=0.2),
        cand(2, pos=1, speaker="Mel", bm25=-2.0, cosine=0.6, chars=5_000),
        cand(3, session="t", pos=0, speaker="Mel", bm25=None, cosine=0.4, chars=0),
    ]
    rows = features(cs, "Caroline's research", vec_ids=[2, 3])
    first, second, third = (row(rows, i) for i in range(3))
    assert first["fts"] == 1.0 and second["fts"] == 0.5 and third["fts"] == 0.0
    # cosines stretched over the vector list (0.6 .. 0.4): its best 1, its last (or less) 0
    assert [r["vec"] for r in (first, second, third)] == [0.0, 1.0, 0.0]
    assert (first["speaker"], second["speaker"]) == (1.0, 0.0)
    # the session's best match counts for each of its turns
    assert first["session"] == second["session"] == 1.0 and third["session"] == 0.0
    # turn 1's neighbour (position 1) is the vector list's best; turn 2's neighbour (0) is not
    # in the list, nor is anything next to turn 3
    assert first["neighbour"] == 1.0 and second["neighbour"] == 0.0 and third["neighbour"] == 0.0
    assert first["length"] == second["length"] == 1.0  # 100 and 5,000 characters: capped
    assert third["length"] == 0.0
    short = features([cand(4, chars=7, bm25=-1.0)], "q", vec_ids=[])
    assert math.isclose(row(short, 0)["length"], math.log1p(7) / math.log1p(LENGTH_CAP))


def test_a_short_message_both_paths_rank_first_beats_the_long_reply_after_it() -> None:
    """What the end-to-end test with the real model saw: the user's fact (first in both paths)
    and the model's long reply to it (second in both), side by side in one session."""
    fact = cand(1, pos=0, chars=59, bm25=-6.0, cosine=0.62)
    reply = cand(2, pos=1, chars=900, bm25=-4.5, cosine=0.55)
    other = cand(3, session="t", pos=4, chars=200, bm25=-1.0, cosine=0.30)
    ranks = {"fts": [1, 2, 3], "vec": [1, 2, 3]}
    fused = fuse([reply, fact, other], "Which cat breed does my sister raise?", ranks,
                 RetrievalSettings().score_weights())  # fmt: skip
    assert [f.id for f in fused] == [1, 2, 3]


def test_without_a_vector_path_the_vector_features_are_zero() -> None:
    rows = features([cand(1, bm25=-1.0), cand(2, pos=1, bm25=-0.5)], "q", vec_ids=[])
    assert all(row(rows, i)["vec"] == 0.0 and row(rows, i)["neighbour"] == 0.0 for i in (0, 1))


def test_scored_fusion_orders_by_the_weighted_sum_and_keeps_ranks() -> None:
    cs = [cand(1, bm25=-4.0, cosine=0.1), cand(2, pos=5, bm25=-1.0, cosine=0.9)]
    ranks = {"fts": [1, 2], "vec": [2, 1]}
    by_fts = fuse(cs, "q", ranks, {"fts": 1.0})
    assert [f.id for f in by_fts] == [1, 2]
    by_vec = fuse(cs, "q", ranks, {"vec": 1.0})
    assert [f.id for f in by_vec] == [2, 1]
    assert by_vec[0].ranks == {"fts": 2, "vec": 1}
    # ties go to the better best rank
    tied = fuse(cs, "q", ranks, {})
    assert [f.id for f in tied] == [1, 2] and tied[0].score == 0.0


def test_questions_about_time_and_only_those() -> None:
    about_time = [
        "When did Calvin have a car incident?",
        "How long has Jolene been doing yoga?",
        "Which year did Audrey adopt the first three of her dogs?",
        "How many weeks did the workshop last?",
        "What did Maria donate to a homeless shelter in December 2023?",
        "Where was James at on July 12, 2022?",
        "Which outdoor spot did Joanna visit in May?",
        "What did I cook last weekend?",
    ]
    other = [
        "What did Caroline research?",
        "What time management techniques do Deborah and Jolene use?",
        "When Dave was a child, what did he and his father do in the garage?",
        "What may help my sister sleep?",
        "Would Tim enjoy reading books by C. S. Lewis or John Greene?",
        "What was the last book Tim read?",
        "How many pets does Nate have?",
        "Quand est-ce que Marie a adopté son chat ?",
    ]
    assert [q for q in about_time if not asks_about_time(q)] == []
    assert [q for q in other if asks_about_time(q)] == []


def test_turns_that_say_when() -> None:
    saying = [
        "I had a lil car accident last Friday, kinda upsetting but no one was hurt.",
        "We've been together for three years.",
        "I adopted her two years ago when I was feeling lonely.",
        "I went there in 2022 with my mom.",
        "My album finally dropped on the 11th!",
        "I've painted since I was 17.",
        "I just joined a new LGBTQ activist group last Tues.",
        "See you in August!",
        "Yesterday I met some incredible artists in Boston.",
    ]
    silent = [
        "Thanks! That sounds great.",
        "I may go there with my sister.",
        "Turtles really bring me joy and peace.",
        "Wow, what a beautiful painting of a sunset!",
    ]
    assert [t for t in saying if not says_when(t)] == []
    assert [t for t in silent if says_when(t)] == []


def test_the_time_feature_needs_a_question_about_time_and_a_turn_that_says_when() -> None:
    cs = [
        cand(1, text="I had a lil car accident last Friday, but no one was hurt.", bm25=-2.0),
        cand(2, pos=1, text="Cars are such a hassle, aren't they?", bm25=-2.0),
    ]
    timely = features(cs, "When did Calvin have a car incident?", vec_ids=[])
    assert (row(timely, 0)["time"], row(timely, 1)["time"]) == (1.0, 0.0)
    other = features(cs, "What car does Calvin drive?", vec_ids=[])
    assert row(other, 0)["time"] == row(other, 1)["time"] == 0.0


def test_for_a_question_about_time_the_turn_that_says_when_ranks_first() -> None:
    """LoCoMo's "When did Calvin have a car incident?": the evidence ("last Friday") matched
    the question's words a little worse than turns about cars that say nothing of when; with
    the default weights it comes first, and for any other question the order stays BM25's."""
    text = "Since last chat I had a lil car accident last Friday, no one was hurt."
    when = cand(1, chars=len(text), bm25=-3.0, text=text)
    cars = [
        cand(i, session=f"s{i}", chars=60, bm25=score, text="Working on cars is so rewarding!")
        for i, score in ((2, -3.2), (3, -3.1))
    ]
    ranks = {"fts": [2, 3, 1]}
    weights = RetrievalSettings().score_weights()
    timely = fuse([when, *cars], "When did Calvin have a car incident?", ranks, weights)
    assert [f.id for f in timely] == [1, 2, 3]
    other = fuse([when, *cars], "What happened to Calvin's car?", ranks, weights)
    assert [f.id for f in other] == [2, 3, 1]
