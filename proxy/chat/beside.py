"""A question's neighbours (pure): where the turns beside its best memories are, and which
of them say something the kept memories do not (:meth:`proxy.chat.recall.Recall.neighbours`
reads them)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from proxy.chat.fence import Recalled
from proxy.search.phrasing import content_words
from proxy.search.relevance import repeats
from proxy.search.retrieval import Hit
from proxy.store.models import Turn


def places_near(turns: Sequence[Turn], offsets: Sequence[int]) -> list[tuple[str, int]]:
    """(session, position) of each turn's neighbours ``offsets`` away in its session, sorted;
    memory items (negative positions) have none."""
    return sorted(
        {
            (t.session_id, t.position + d)
            for t in turns
            if t.position >= 0
            for d in offsets
            if t.position + d >= 0
        }
    )


class Words:
    """The content words (:func:`~proxy.search.phrasing.content_words`) of the texts one
    recall reads, each text read once: the gate, the question's neighbours and their rules
    read the same hits. Kept for one request only (a forgotten turn's words do not linger)."""

    def __init__(self) -> None:
        self._read: dict[str, tuple[str, ...]] = {}
        self._sets: dict[str, frozenset[str]] = {}

    def __call__(self, text: str) -> tuple[str, ...]:
        found = self._read.get(text)
        if found is None:
            found = self._read[text] = tuple(content_words(text))
        return found

    def set(self, text: str) -> frozenset[str]:
        """The words as a set (made once a text)."""
        found = self._sets.get(text)
        if found is None:
            found = self._sets[text] = frozenset(self(text))
        return found


def new_words(
    hits: Sequence[Hit],
    near: Mapping[int, list[Recalled]],
    asked: Collection[str] = (),
    words: Words | None = None,
) -> dict[int, list[Recalled]]:
    """``near`` (neighbours by hit id) less those that share no content word with their hit or
    the question (``asked``: a model's reply to some earlier message sits before a user's turn
    in a chat with a model) and a model's replies that say nothing the kept turns do not
    (:func:`~proxy.search.relevance.repeats`): "The new garage door code is 8042." beside the
    user's "Note for later: the new garage door code is 8042."."""
    words_of = (words or Words()).set
    question = frozenset(asked)
    content = {h.turn.id: h.turn.content for h in hits}
    near = {
        hit: [m for m in ms if (words_of(content.get(hit, "")) | question) & words_of(m.content)]
        for hit, ms in near.items()
    }
    turns = [(h.turn.id, h.turn.role, words_of(h.turn.content)) for h in hits]
    turns += [(m.id, m.role, words_of(m.content)) for ms in near.values() for m in ms]
    said: set[str] = set()
    for _, role, these in turns:
        if role != "assistant":
            said |= these
    return {
        hit: [
            m
            for m in ms
            if m.role != "assistant"
            or not repeats(words_of(m.content), said, [w for i, _, w in turns if i != m.id])
        ]
        for hit, ms in near.items()
    }
