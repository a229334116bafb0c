"""Scaffolding cut out of messages (proxy.scaffold) and housekeeping requests recognised by what
they ask (proxy.chat.identity), on the shapes the real clients send (issue 22)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import scaffold
from proxy.chat.identity import is_housekeeping

REMINDER = (
    "<system-reminder>\nAttribution for git commits and pull requests you create from here on:"
    "\n- End git commit messages with:\nCo-Authored-By: Claude Code\n</system-reminder>\n"
)
ENVIRONMENT = (
    "<environment_context>\n  <cwd>/home/me/project</cwd>\n  <shell>bash</shell>\n"
    "  <current_date>2026-12-01</current_date>\n</environment_context>"
)
AGENTS_MD = (
    "# AGENTS.md instructions for /home/me/project\n\n<INSTRUCTIONS>\nRun make test before you "
    "commit.\n</INSTRUCTIONS>"
)


def test_a_claude_code_message_keeps_only_the_users_words() -> None:
    text = REMINDER + "\nMy cat is called Zorblax. Remember that."
    cut = scaffold.split("user", text)
    assert cut.words == "My cat is called Zorblax. Remember that."
    assert [p.kind for p in cut.pieces] == ["system-reminder"]
    assert scaffold.join(cut.words, cut.pieces) == text


def test_codex_environment_and_instructions_are_scaffolding() -> None:
    for text in (ENVIRONMENT, AGENTS_MD, f"{AGENTS_MD}\n\n{ENVIRONMENT}\n"):
        cut = scaffold.split("user", text)
        assert cut.words == "" and cut.pieces
        assert scaffold.join(cut.words, cut.pieces) == text
    mixed = f"before\n{ENVIRONMENT}\nafter"
    cut = scaffold.split("user", mixed)
    assert cut.words == "before\nafter" and [p.kind for p in cut.pieces] == ["environment"]


def test_system_prompts_are_scaffolding_a_paragraph_a_piece() -> None:
    text = "You are an agent.\n\nRules:\n- be brief\n\n\n# Environment\ncwd: /x\n"
    cut = scaffold.split("system", text)
    assert cut.words == ""
    assert [p.core for p in cut.pieces] == [
        "You are an agent.",
        "Rules:\n- be brief",
        "# Environment\ncwd: /x",
    ]
    assert scaffold.join(cut.words, cut.pieces) == text
    # A paragraph that changes (the date) changes only its own piece.
    other = scaffold.split("developer", text.replace("/x", "/y"))
    assert [p.hash for p in other.pieces][:2] == [p.hash for p in cut.pieces][:2]
    assert other.pieces[2].hash != cut.pieces[2].hash


def test_messages_the_client_makes_up_are_not_the_users_words() -> None:
    for text in (
        "Output token limit hit. Resume directly — no apology, no recap of what you were doing.",
        "Continue from where you left off.",
        "continue",
        "Please continue.",
        "Resume",
        "This session is being continued from a previous conversation that ran out of context.",
        "Another language model started to solve this problem and produced a summary of it.",
        REMINDER + "Continue",
    ):
        cut = scaffold.split("user", text)
        assert cut.words == "", text
        assert scaffold.join(cut.words, cut.pieces) == text
    for text in ("Continue the story where the dragon wakes up", "Resume writing my CV", "go"):
        assert scaffold.split("user", text).words == text


def test_a_paragraph_known_from_another_session_is_scaffolding() -> None:
    repo_map = "Here are summaries of some files present in my git repository: " + "x.py " * 60
    text = f"{repo_map}\n\nWhy does x.py fail?"
    assert scaffold.split("user", text).words == text  # unknown: the user's words
    known = set(scaffold.long_paragraphs(repo_map))
    cut = scaffold.split("user", text, known.__contains__)
    assert cut.words == "Why does x.py fail?"
    assert [p.kind for p in cut.pieces] == ["repeated"]
    assert scaffold.join(cut.words, cut.pieces) == text
    # Short paragraphs never count, and only user messages are split.
    assert scaffold.long_paragraphs("Why does x.py fail?") == []
    assert scaffold.split("assistant", text, known.__contains__).words == text
    assert scaffold.split("tool", REMINDER).words == REMINDER


texts = st.lists(
    st.one_of(
        st.text(alphabet="ab \n<>/", max_size=40),
        st.sampled_from([REMINDER, ENVIRONMENT, AGENTS_MD, "\n\n", "Continue", " " * 3]),
    ),
    max_size=8,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(texts, st.sampled_from(["user", "system", "developer", "assistant", "tool"]))
def test_the_text_as_sent_is_always_recoverable(text: str, role: str) -> None:
    cut = scaffold.split(role, text, lambda h: True)
    assert scaffold.join(cut.words, cut.pieces) == text
    assert [p.at for p in cut.pieces] == sorted(p.at for p in cut.pieces)
    for p in cut.pieces:
        assert p.lead + p.core + p.trail == p.text
    assert scaffold.words_of(role, text) == scaffold.split(role, text).words


# --- housekeeping, by what it asks ----------------------------------------------------------


def msgs(*pairs: tuple[str, Any]) -> list[dict[str, Any]]:
    return [{"role": r, "content": c} for r, c in pairs]


def test_the_known_clients_housekeeping_is_recognised() -> None:
    cases = [
        # opencode's title request: two user messages, the instruction first.
        msgs(
            ("system", "You are a title generator. You output ONLY a thread title. Nothing else."),
            ("user", "Generate a title for this conversation:\n"),
            ("user", '"My cat is called Zorblax."'),
        ),
        msgs(
            ("system", "You are a helpful AI assistant tasked with summarizing conversations."),
            ("user", "Create a new anchored summary from the conversation history above."),
        ),
        # Claude Code: titles, topic detection, compaction, the quota probe.
        msgs(
            (
                "system",
                "x-anthropic-billing-header: cc_version=2.1.332.770;You are Claude Code.You are"
                " naming a coding session so the user can pick it out of a long list.",
            ),
            ("user", "<session>\nMy cat is called Zorblax.\n</session>\n\nWrite the title."),
        ),
        msgs(("user", "quota")),
        msgs(
            ("user", "fix the bug"),
            ("assistant", "done"),
            ("user", "Your task is to create a detailed summary of the conversation so far, ..."),
        ),
        msgs(("user", "Analyze if this message indicates a new conversation topic. ...")),
        # Codex's compaction.
        msgs(
            ("user", "hi"),
            ("assistant", "hello"),
            (
                "user",
                "You are performing a CONTEXT "
                "CHECKPOINT COMPACTION. Create a handoff summary for another LLM.",
            ),
        ),
        # Continue, LibreChat, Open WebUI.
        msgs(("user", "Given the following... please reply with a title for the chat that is 3")),
        msgs(("user", "Please generate a concise, 5-word-or-less title for the conversation")),
        msgs(("user", "### Task:\nGenerate a concise, 3-5 word title with an emoji")),
    ]
    for case in cases:
        assert is_housekeeping(case), case


def test_conversations_about_titles_and_summaries_are_not_housekeeping() -> None:
    cases = [
        msgs(("user", "What is a good title for my essay?")),
        msgs(("user", "Summarize this conversation for me, please")),
        msgs(("user", "quota exceeded errors keep showing up, why?")),
        # The instruction is old history, not this turn's.
        msgs(
            ("user", "Generate a title for this conversation:"),
            ("assistant", "Cats"),
            ("user", "thanks, now tell me about dogs"),
        ),
        # Claude Code's main agent prompt mentions titles but asks for none.
        msgs(
            ("system", "You are Claude Code. Use the TodoWrite tool. PR titles are short."),
            ("user", REMINDER + "fix the title bar"),
        ),
    ]
    for case in cases:
        assert not is_housekeeping(case), case


def test_unclosed_openings_cost_one_pass() -> None:
    """A hostile (or merely odd) text of unclosed block openings: read as words, in one pass
    (a lazy regex per opening took 1.5 s for 50 kB and grows with the square of the length)."""
    import time

    text = "<system-reminder>" * 12_000 + "<environment_context>" * 5_000
    start = time.monotonic()
    cut = scaffold.split("user", text)
    assert cut.words == text and cut.pieces == ()
    assert time.monotonic() - start < 2.0
    # An opening closed only at the very end is one block.
    closed = "<system-reminder>" * 1_000 + "</system-reminder>\nhi"
    assert scaffold.split("user", closed).words == "hi"


AIDER_INSTRUCTIONS = (
    "To suggest changes to a file you MUST return the entire content of the updated file.\n"
    "You MUST use this *file listing* format:\n\npath/to/filename.js\n```\n// entire file\n```\n\n"
    "Reply in English.\n\n"
)


def test_aiders_own_words_are_scaffolding_and_its_query_is_the_users_words() -> None:
    """aider 0.86 appends its editing instructions (no "<" in them) to every message typed, and
    writes whole user messages of its own: the archive and the recall query both see only the
    words typed (the query once kept the instructions: the fact's cosine fell to 0.2)."""
    text = "What is my cat called?\n\n" + AIDER_INSTRUCTIONS
    cut = scaffold.split("user", text)
    assert cut.words == "What is my cat called?\n\n"
    assert [p.kind for p in cut.pieces] == ["instructions"]
    assert scaffold.join(cut.words, cut.pieces) == text
    assert scaffold.words_of("user", text) == "What is my cat called?\n\n"
    for own in (
        "I am not sharing any files that you can edit yet.",
        "Change the greeting to be more casual",
        "I spoke to you previously about a number of things.\nwe talked",
    ):
        assert scaffold.words_of("user", own) == ""
    messages = [
        {
            "role": "system",
            "content": "*Briefly* summarize this partial conversation "
            "about programming.\nInclude less detail",
        },
        {"role": "user", "content": "x"},
    ]
    assert is_housekeeping(messages)
