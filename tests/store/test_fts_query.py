"""User text to FTS5 MATCH: safe for any input, and still finds what it should."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.search.fts_query import NLTK_STOP_WORDS, STOP_WORDS, quote, to_match, tokens
from proxy.store.sqlite import db
from proxy.store.sqlite.db import Connection
from proxy.store.sqlite.migrations import FTS_TOKENIZE

DOCS = [
    "Caroline went to the LGBTQ support group on 7 May",
    "Melanie painted a sunrise over the lake",
    "NEAR the café AND the bakery, or NOT",
    "北京 is a city; Zürich too",
    'She said "hello" (loudly) - then left: col*umn ^caret +plus',
]


@pytest.fixture(scope="module")
def fts() -> Iterator[Connection]:
    conn = db.connect(":memory:")
    conn.execute(f"CREATE VIRTUAL TABLE t USING fts5(content, tokenize = '{FTS_TOKENIZE}')")
    conn.executemany("INSERT INTO t(content) VALUES (?)", [(d,) for d in DOCS])
    yield conn
    conn.close()


def search(conn: Connection, text: str, **kwargs: object) -> list[int]:
    match = to_match(text, **kwargs)  # type: ignore[arg-type]
    if match is None:
        return []
    rows = conn.execute("SELECT rowid FROM t WHERE t MATCH ? ORDER BY rank", (match,))
    return [r[0] for r in rows]


def test_quotes_each_token_and_joins_with_or() -> None:
    assert to_match("When did Caroline go to the support group?") == (
        '"caroline" OR "go" OR "support" OR "group"'
    )
    assert to_match("pottery pottery POTTERY class") == '"pottery" OR "class"'


def test_operators_become_literal_words_or_vanish() -> None:
    assert to_match('NEAR(a b) AND "x" OR -y ^z col:val * +w', stop_words=None) == (
        '"near" OR "a" OR "b" OR "and" OR "x" OR "or" OR "y" OR "z" OR "col" OR "val" OR "w"'
    )


def test_nothing_searchable_gives_none() -> None:
    for text in ["", "   ", "?!.,;:*^()-+\"'", "_ __ ___", "\x00\x01"]:
        assert to_match(text) is None, text
        assert to_match(text, stop_words=None) is None, text


def test_only_stop_words_keeps_them_all() -> None:
    assert to_match("the and of it") == '"the" OR "and" OR "of" OR "it"'
    assert to_match("Who was it? Who!") == '"who" OR "was" OR "it"'
    assert to_match("the and of it", stop_words=None) == '"the" OR "and" OR "of" OR "it"'


def test_unicode_tokens() -> None:
    assert tokens("Zürich, 北京; naïve café") == ["Zürich", "北京", "naïve", "café"]
    # decomposed input is composed first, so the accent does not split the word
    assert tokens("cafe\u0301s") == ["cafés"]
    assert to_match("über straße") == '"über" OR "straße"'


def test_limits_terms() -> None:
    text = " ".join(f"w{i}" for i in range(100))
    match = to_match(text, max_terms=5)
    assert match == '"w0" OR "w1" OR "w2" OR "w3" OR "w4"'


def test_quote_escapes_quotes() -> None:
    assert quote('say "hi"') == '"say ""hi"""'


def test_stop_words_are_nltks_english_list() -> None:
    assert len(NLTK_STOP_WORDS) == len(set(NLTK_STOP_WORDS)) == 179
    assert all(w == w.lower() and w.isalpha() for w in STOP_WORDS)
    assert len(STOP_WORDS) == 179 - sum("'" in w for w in NLTK_STOP_WORDS)
    assert {"don", "t", "ll", "ve", "ain", "ma", "needn"} <= STOP_WORDS
    # every dropped contraction's halves are still stop words
    for word in NLTK_STOP_WORDS:
        assert all(part in STOP_WORDS for part in tokens(word)), word
    assert to_match("What didn't Melanie paint?") == '"melanie" OR "paint"'


def test_finds_documents(fts: Connection) -> None:
    assert search(fts, "When did Caroline go to the support group?") == [1]
    assert search(fts, "who painted sunrises?") == [2]  # porter: sunrises -> sunris
    assert search(fts, "near AND not") == [3]  # "near" is a word here; and/not are stop words
    assert search(fts, "AND", stop_words=None) == [3]  # the word "and", not the operator
    assert search(fts, "cafe") == [3]  # remove_diacritics
    assert search(fts, "zurich 北京") == [4]
    assert search(fts, "col:umn ^caret") == [5]


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=200), keep_stop_words=st.booleans())
def test_any_text_is_a_valid_match_expression(
    fts: Connection, text: str, keep_stop_words: bool
) -> None:
    match = to_match(text, stop_words=None if keep_stop_words else STOP_WORDS)
    if match is None:
        return
    fts.execute("SELECT rowid FROM t WHERE t MATCH ?", (match,)).fetchall()


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(
        st.sampled_from(
            ['"', "*", "NEAR", "AND", "OR", "NOT", "-", "^", ":", "(", ")", "+", "{", "}"]
        )
        | st.text(min_size=1, max_size=5),
        max_size=12,
    )
)
def test_fts5_syntax_soup(fts: Connection, words: list[str]) -> None:
    match = to_match(" ".join(words), stop_words=None)
    if match is not None:
        fts.execute("SELECT rowid FROM t WHERE t MATCH ?", (match,)).fetchall()
