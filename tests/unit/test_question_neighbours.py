"""recall.new_words: a question's neighbours that only repeat the kept turns stay out."""

from __future__ import annotations

from proxy.chat.fence import Recalled
from proxy.chat.recall import new_words
from proxy.search.retrieval import Hit
from proxy.store.models import Turn


def turn(i: int, role: str, content: str) -> Turn:
    return Turn(i, "s", "u", i, role, None, content, None, None, 0.0, None, "", False)


def near(i: int, role: str, content: str) -> Recalled:
    return Recalled(i, role, None, content, 0.0, "s", 1.0)


def test_a_models_echo_of_the_kept_turns_is_no_neighbour() -> None:
    hits = [Hit(turn(1, "user", "Note for later: the new garage door code is 8042."), 1.0, {})]
    beside = {
        1: [
            near(2, "assistant", "The new garage door code is 8042."),  # the user's words
            near(0, "user", "The old one stopped working after the power cut on Sunday."),
        ]
    }
    assert [m.id for m in new_words(hits, beside)[1]] == [0]


def test_a_reply_that_says_something_new_stays_and_so_does_a_users_turn() -> None:
    hits = [Hit(turn(1, "user", "Wow! What got you into running?"), 1.0, {})]
    beside = {
        1: [
            near(2, "assistant", "My doctor suggested it after my knee surgery last spring."),
            near(0, "user", "I ran my first marathon, got you a running medal too."),
        ]
    }
    assert [m.id for m in new_words(hits, beside)[1]] == [2, 0]


def test_a_reply_repeating_another_kept_reply_goes() -> None:
    hits = [
        Hit(turn(1, "user", "We adopted a cat last week! We called it Ziggy."), 1.0, {}),
        Hit(turn(5, "assistant", "Lovely, a cat named Ziggy sounds playful and sweet."), 0.9, {}),
    ]
    beside = {1: [near(2, "assistant", "A cat named Ziggy sounds sweet and playful!")]}
    assert new_words(hits, beside)[1] == []
