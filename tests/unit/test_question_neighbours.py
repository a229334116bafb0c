"""recall.new_words: a question's neighbours that only repeat the kept turns, or share no word
with their hit or the question, stay out."""

from __future__ import annotations

from proxy.chat.beside import new_words
from proxy.chat.fence import Recalled
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
            near(0, "user", "The old garage code stopped working after the power cut."),
        ]
    }
    assert [m.id for m in new_words(hits, beside)[1]] == [0]


def test_a_reply_that_says_something_new_stays_and_so_does_a_users_turn() -> None:
    hits = [Hit(turn(1, "user", "Wow! What got you into running?"), 1.0, {})]
    beside = {
        1: [
            near(2, "assistant", "My doctor suggested running after my knee surgery."),
            near(0, "user", "I love running marathons, got you a medal too."),
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


def test_a_neighbour_sharing_no_word_with_its_hit_or_the_question_goes() -> None:
    """In a chat with a model, before a user's turn sits the model's reply to some other
    message ("A starter, a main course and a dessert?" before the deadline)."""
    hits = [Hit(turn(1, "user", "The deadline is the 16th of April, which is tight."), 1.0, {})]
    beside = {
        1: [
            near(2, "user", "Project Orchard must ship its warehouse app first."),  # the question's
            near(0, "assistant", "A starter, a main course and a dessert? That's a classic."),
        ]
    }
    asked = {"deadline", "project", "orchard"}
    assert [m.id for m in new_words(hits, beside, asked)[1]] == [2]
    assert new_words(hits, beside)[1] == []
