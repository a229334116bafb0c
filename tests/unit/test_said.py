"""The chain over what was said (proxy.said): the same through what clients change when they
resend a conversation, different where someone said something else."""

from __future__ import annotations

from typing import Any

from proxy import scaffold
from proxy.said import client_reply, said_anchor, said_chain, unmatched_history

REMINDER = "<system-reminder>\nThe current date is: Saturday, December 5, 2026.\n</system-reminder>"
AIDER_INSTRUCTIONS = (
    "\n\nTo suggest changes to a file you MUST return the entire content of the updated file.\n"
    "You MUST use this *file listing* format:\n\nReply in English.\n\n"
)


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def chain(*messages: dict[str, Any]) -> list[str | None]:
    return said_chain(messages)[0]


def test_what_clients_change_on_a_resend_changes_nothing_said() -> None:
    sent = chain(
        {"role": "system", "content": "You are helpful. Today is Friday."},
        user([{"type": "text", "text": REMINDER}, {"type": "text", "text": "Where is Porto?"}]),
        assistant("In  Portugal,\nnorth."),
    )
    resent = chain(
        {"role": "system", "content": "You are helpful. Today is Saturday."},
        user("Where is Porto?  \n"),
        assistant("\nIn Portugal, north.\n\n"),
    )
    assert sent == resent
    assert sent[0] is None and None not in sent[1:]
    assert chain(user("Where is Porto?" + AIDER_INSTRUCTIONS)) == chain(user("Where is Porto?"))


def test_a_word_changed_changes_that_hash_and_every_one_after() -> None:
    one = chain(user("My cat is Ziggy."), assistant("Nice."), user("She is 3."))
    other = chain(user("My cat is Zoe."), assistant("Nice."), user("She is 3."))
    assert all(a != b for a, b in zip(one, other, strict=True))
    edited = chain(user("My cat is Ziggy."), assistant("Nice."), user("She is 4."))
    assert one[:2] == edited[:2] and one[2] != edited[2]
    assert chain(user("hi"), assistant("Hello!")) != chain(user("hi"), assistant("Hi there!"))


def test_a_clients_own_context_and_the_reply_to_it_say_nothing_a_retrys_reply_does() -> None:
    """aider's example exchange and its "Ok." to its file context are aider's (archived as
    scaffolding); the model's continuation after "Continue from where you left off" or after a
    reminder-only message is the model's work."""
    messages = [
        {"role": "system", "content": "Act as an expert software developer."},
        user("Change the greeting to be more casual"),
        assistant("Ok, I will:\n\n1. Switch the greeting."),
        user("I am not sharing any files that you can edit yet."),
        assistant("Ok."),
        user("What is my cat called?"),
        assistant("Ziggy."),
        user("Continue from where you left off."),
        assistant("As I was saying, Ziggy suits a cat."),
        user(REMINDER),
        assistant("Noted."),
    ]
    said = chain(*messages)
    assert [h is None for h in said] == [
        True, True, True, True, True, False, False, True, False, True, False,
    ]  # fmt: skip
    assert [client_reply(m, h) for m, h in zip(messages, said, strict=True)] == [
        False, False, True, False, True, False, False, False, False, False, False,
    ]  # fmt: skip
    # Moved elsewhere, the client's exchanges change nothing said.
    moved = chain(
        user("What is my cat called?"),
        assistant("Ziggy."),
        user("I am not sharing any files that you can edit yet."),
        assistant("Ok."),
    )
    assert moved[:2] == said[5:7] and moved[2:] == [None, None]
    # Archived as the client's: no words, the text as sent put back from its piece.
    words, pieces, _ = scaffold.archived("assistant", messages[2]["content"], None, True)
    assert words == "" and [p.kind for p in pieces] == ["context"]
    back = [scaffold.Piece(p.kind, p.content, p.at) for p in pieces]
    assert scaffold.join(words, back) == messages[2]["content"]


def test_tool_calls_and_their_outputs_are_said() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    other = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a":1}'}}
    base = [user("list it")]
    one = chain(
        *base,
        assistant(None, tool_calls=[call]),
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    )
    two = chain(
        *base,
        assistant(None, tool_calls=[other]),
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    )
    assert None not in one and one[1] != two[1] and one[2] != two[2]
    assert chain(*base, assistant(""))[1] is None  # an empty reply says nothing


def test_the_anchor_is_the_first_reply_that_says_something() -> None:
    messages = [
        user("Change the greeting to be more casual"),
        assistant("Ok, I will: ..."),
        user("What is my cat called?"),
        assistant("Ziggy."),
    ]
    assert said_anchor(messages, chain(*messages)) == 3
    assert said_anchor(messages[:3], chain(*messages[:3])) is None
    assert unmatched_history(messages, 2) and not unmatched_history(messages, 4)
    assert not unmatched_history([user("hi")], 0)


def test_odd_shapes_hash_without_raising() -> None:
    odd = [
        {"role": "user", "content": 42},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}], "tool_calls": "x"},
        {"role": "tool", "content": None, "tool_call_id": 7},
        {"role": "assistant", "content": "\ud800 lone", "tool_calls": [1, {"function": "f"}]},
        {"content": "no role"},
    ]
    said = chain(*odd)
    assert said[0] is None  # a number says nothing (its reply says its text)
    assert said[1] is not None and said[3] is not None  # odd calls ignored, a lone surrogate
    assert said[2] is None  # no output, no string id
    assert said[4] is not None and len(said) == len(odd)
