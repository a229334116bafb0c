r"""What known clients send that is not a person's words: data only, one entry per shape.

Three kinds, each a table of regular expressions (the client that sends each shape in its
comment, so a new client or version is one line here, never a code path):

- :data:`HOUSEKEEPING` (and :data:`HOUSEKEEPING_ANY_CASE`, lower case, matched against the text
  lower-cased) — requests a client makes for itself (a title, tags, follow-ups, a topic, a summary
  of the conversation so far, a quota probe). Searched in the request's system text and in the
  user messages of its current turn; a match makes the request housekeeping
  (:func:`proxy.chat.identity.is_housekeeping`): forwarded as sent, no memories, not archived.
- :data:`BLOCKS` — blocks a client wraps around context it regenerates on every request
  (reminders, environment, instructions). Found inside user messages by
  :mod:`proxy.scaffold`, stored once per user, never recalled.
- :data:`MADE_UP` — whole messages a client writes in the user's place (retries after a cut
  reply, "continue" nudges, the hand-over after a context compaction).

Patterns are matched case-sensitively (each on its own: a pattern that starts with a literal is
found by a fast substring search), ``.`` matching line ends
too; a ``BLOCKS`` entry is (kind, the block's opening as a pattern that starts with a literal,
its closing tag as plain text): a block runs from its opening to the first closing after it
(where two overlap, the one that starts first, else the longer, wins); ``\A`` and ``\Z``
anchor at the text's start and end.
"""

from __future__ import annotations

import re

HOUSEKEEPING: tuple[str, ...] = (
    # Open WebUI: "### Task:" prompts for titles, tags, follow-ups, autocompletion.
    r"### Task:\s*\n\s*(?:Generate|Suggest|Analyze|Create|Based on|You are an autocompletion)",
    # opencode: its title agent and its compaction (summary) agent.
    r"You are a title generator\. You output ONLY a thread title",
    r"\AGenerate a title for this conversation:",
    r"Create a new anchored summary from the conversation history",
    r"Summarize what was done in this conversation\. Write like a pull request description",
    r"Do not continue the conversation\. Do not respond to any questions in the conversation\.",
    # Claude Code: session titles (2.1: "naming a coding session"), topic detection, compaction
    # summaries and the quota probe sent at start.
    r"You are naming a coding session so the user can pick it out",
    r"Analyze if this message indicates a new conversation topic",
    r"Your task is to create a detailed summary of (?:the conversation so far|this conversation"
    r"|the RECENT portion of the conversation)",
    r"\Aquota\Z",
    # Codex: its context compaction.
    r"You are performing a CONTEXT CHECKPOINT COMPACTION",
    # Continue: chat titles.
    r"Given the following\.\.\. please reply with a title for the chat",
    # GitHub Copilot Chat (VS Code): chat titles.
    r"You are an expert in crafting pithy titles for chatbot conversations",
    # aider 0.86: its commit messages and its summary of the chat history so far.
    r"You are an expert software engineer that generates concise, one-line Git commit messages",
    r"\*Briefly\* summarize this partial conversation about programming\.",
    # Qwen Code 0.24: its managed-memory extraction, after each turn.
    r"You are now acting as the managed memory extraction subagent",
)
HOUSEKEEPING_ANY_CASE: tuple[str, ...] = (
    # Open WebUI (lower case: matched against the text lower-cased, in any case).
    r"generate a concise, 3-5 word title",
    r"generate 1-3 broad tags",
    r"suggest 3-5 relevant follow-up",
    r"you are an autocompletion system",
    r"<chat_history>[\s\S]*</chat_history>[\s\S]*(?:title|tags|follow-up)",
    # LibreChat: titles.
    r"generate a concise,? 5-word-or-less title",
    r"please generate a (?:concise )?title for (?:this|the) conversation",
    r"write a concise title for this conversation",
    # Claude Code before 2.1: session titles.
    r"please write a 5-10 word title for the following conversation",
)

BLOCKS: tuple[tuple[str, str, str], ...] = (
    # Claude Code (reminders, CLAUDE.md, IDE context, hook output) and opencode: <system-reminder>.
    ("system-reminder", r"<system-reminder>", "</system-reminder>"),
    # Codex: the working directory, shell, date and sandbox of this run.
    ("environment", r"<environment_context>", "</environment_context>"),
    # Cline and Roo Code: the open files, the working directory, the time.
    ("environment", r"<environment_details>", "</environment_details>"),
    # Codex: AGENTS.md, user instructions, skills and permission rules.
    ("instructions", r"# AGENTS\.md instructions for [^\n]*\n+<INSTRUCTIONS>", "</INSTRUCTIONS>"),
    ("instructions", r"<INSTRUCTIONS>", "</INSTRUCTIONS>"),
    ("instructions", r"<user_instructions>", "</user_instructions>"),
    ("instructions", r"<skills_instructions>", "</skills_instructions>"),
    ("instructions", r"<permissions instructions>", "</permissions instructions>"),
    ("instructions", r"<collaboration_mode>", "</collaboration_mode>"),
    # Claude Code: the caveat it puts before the output of local slash commands.
    ("instructions", r"<local-command-caveat>", "</local-command-caveat>"),
    # aider 0.86: the edit format's instructions, appended to every message typed.
    (
        "instructions",
        r"To suggest changes to a file you MUST return the entire content of the updated file\.",
        "Reply in English.",
    ),
)

MADE_UP: tuple[tuple[str, str], ...] = (
    # Claude Code: retries after a reply hit its output limit, resumes after a restart.
    ("retry", r"\AOutput token limit hit\b"),
    ("retry", r"\AContinue from where you left off\b"),
    ("retry", r"\A(?i:(?:your|the) (?:previous |last )?response was (?:cut off|truncated))\b"),
    # Any client, or a person, nudging the model on: no words worth remembering.
    ("retry", r"\A(?i:(?:please )?(?:continue|resume|go on|keep going|proceed))[.!]?\Z"),
    # Claude Code and Codex: the hand-over after compacting a conversation (a summary the model
    # wrote, not the user's words).
    ("handoff", r"\AThis session is being continued from a previous conversation"),
    ("handoff", r"\AAnother language model started to solve this problem"),
    # aider 0.86: what stands for the turns it summarised.
    ("handoff", r"\AI spoke to you previously about a number of things\."),
    # aider 0.86: the example exchange and the file context it sends as the user, every request.
    ("context", r"\AChange the greeting to be more casual\Z"),
    ("context", r"\AI switched to a new code base\. Please don't consider the above files"),
    ("context", r"\AI am not sharing any files that you can edit yet\."),
    ("context", r"\AHere are summaries of some files present in my git repository\."),
    ("context", r"\AI have \*added these files to the chat\* so you can go ahead and edit them\."),
    ("context", r"\ADon't try and edit any existing code without asking me to add the files"),
)


def compile_all(patterns: tuple[str, ...] | list[str]) -> tuple[re.Pattern[str], ...]:
    """``patterns`` compiled one by one (an alternation of them would lose each one's fast
    literal search)."""
    return tuple(re.compile(p, re.DOTALL) for p in patterns)
