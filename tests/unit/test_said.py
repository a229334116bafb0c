"""The chain over what was said (proxy.said): the same through what clients change when they
resend a conversation, different where someone said something else."""

from __future__ import annotations

from typing import Any

from proxy.said import said_anchor, said_chain, unmatched_history

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


def test_a_message_the_client_wrote_and_the_reply_to_it_say_nothing() -> None:
    """aider's example exchange and the "Ok." to its file context, Claude Code's retries."""
    said = chain(
        user("Change the greeting to be more casual"),
        assistant("Ok, I will:\n\n1. Switch the greeting."),
        user("I am not sharing any files that you can edit yet."),
        assistant("Ok."),
        user("What is my cat called?"),
        assistant("Ziggy."),
        user(REMINDER),
        assistant("Noted."),
    )
    assert said[:4] == [None] * 4
    assert said[4] is not None and said[5] is not None
    assert said[6:] == [None, None]
    # Moved elsewhere, they change nothing said.
    moved = chain(
        user("What is my cat called?"),
        assistant("Ziggy."),
        user("I am not sharing any files that you can edit yet."),
        assistant("Ok."),
    )
    assert moved[:2] == said[4:6]


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
    assert said[0] is None and said[1] is None  # a number says nothing, nor its reply
    assert len(said) == len(odd)
