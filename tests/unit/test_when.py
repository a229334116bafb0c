"""The times a query names (proxy/search/when.py) and the scored fusion's ``when`` feature."""

from __future__ import annotations

import datetime as dt

import pytest

from proxy.search.scoring import FEATURES, Candidate, features, scored_fusion
from proxy.search.when import query_times, said_in

NOW = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC).timestamp()


def at(y: int, m: int, d: int, h: int = 12) -> float:
    return dt.datetime(y, m, d, h, tzinfo=dt.UTC).timestamp()


@pytest.mark.parametrize(
    ("query", "inside", "outside"),
    [
        ("What did Evan share with Sam on 9th December 2023?", at(2023, 12, 9), at(2023, 12, 20)),
        ("What did they share on January 5, 2024?", at(2024, 1, 5, 23), at(2024, 1, 9)),
        ("Dave's new business as of 1 May, 2023?", at(2023, 5, 1), at(2023, 6, 1)),
        ("Which hobby did Dave pick up in October 2023?", at(2023, 10, 31), at(2023, 11, 1)),
        ("Where was Calvin in the last week of Aug. 2023?", at(2023, 8, 1), at(2022, 8, 15)),
        ("Which cities did Dave travel to in 2023?", at(2023, 2, 2), at(2024, 1, 2)),
        ("Who headlined the festival Dave attended in October?", at(2021, 10, 3), at(2023, 9, 30)),
        ("what happened on 2023-05-08", at(2023, 5, 8), at(2023, 5, 11)),
        ("What did I say about the boiler yesterday?", at(2026, 11, 29, 9), at(2026, 11, 20)),
        ("the plan we made last week", at(2026, 11, 24), at(2026, 10, 1)),
        ("the recipe from three days ago", at(2026, 11, 27), at(2026, 11, 10)),
    ],
)
def test_times_a_query_names(query: str, inside: float, outside: float) -> None:
    windows = query_times(query, NOW)
    assert windows, query
    assert said_in(inside, windows) and not said_in(outside, windows)


@pytest.mark.parametrize(
    "query",
    [
        "May I ask what Caroline researched?",  # "may" the verb
        "What did June say about the garden?",  # a name
        "How many of the 2023 tickets are left",  # a number, not "in 2023"
        "What did I say about the boiler last week?",  # relative: needs the request's time
        "Where does Bob's sister live?",
    ],
)
def test_queries_that_name_no_time(query: str) -> None:
    assert query_times(query) == []


def test_an_impossible_day_falls_back_to_its_month() -> None:
    (window,) = query_times("on 31 February 2023")
    assert said_in(at(2023, 2, 14), [window]) and not said_in(at(2023, 3, 3), [window])
    assert not said_in(None, query_times("in 2023"))


def test_the_when_feature_prefers_the_turn_said_then() -> None:
    """Two equally good matches: the one said on the day the query names ranks first, and the
    feature is 0 for every turn when the query names no time."""
    said = {1: at(2023, 5, 20), 2: at(2023, 12, 9)}
    cands = [Candidate(i, "s", i, "Evan", 60, -2.0, 0.5, at=said[i]) for i in (1, 2)]
    weights = {"fts": 1.0, "when": 0.2}
    ranks = {"fts": [1, 2]}
    query = "What did Evan share with Sam on 9th December 2023?"
    assert [f.id for f in scored_fusion(cands, query, ranks, weights, NOW)] == [2, 1]
    column = FEATURES.index("when")
    rows = features(cands, "What did Evan share with Sam?", [], NOW)
    assert [r[column] for r in rows] == [0.0, 0.0]
