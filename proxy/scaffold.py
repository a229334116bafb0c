"""Scaffolding: what a client sends again and again that is nobody's words (pure).

Agents wrap every request in context they make themselves: system prompts and agent lists,
``<system-reminder>`` and ``<environment_context>`` blocks, retries ("Output token limit hit…"),
hand-overs after a compaction. Archived as the user's words, that would be stored again in every
session and recalled as memories (an old working directory answering for the current one). So a
message's text is split into its **words** (what is archived, indexed and recalled) and its
**pieces** of scaffolding, each of which is stored once per user by its hash
(:mod:`proxy.store.scaffolds`), never recalled:

- the text of a system or developer message: all of it, a paragraph a piece (the paragraphs that
  stay the same across runs are stored once, only a changed one — a date, a directory — again);
- in a user message, the blocks whose shape says so (:data:`proxy.clients.BLOCKS`), and the whole
  message when it is one a client writes in the user's place (:data:`proxy.clients.MADE_UP`);
- in a user message, a paragraph of at least :data:`REPEAT_MIN` characters that the caller knows
  as scaffolding (``known``: it was sent verbatim in another of the user's sessions).

:func:`join` puts the pieces back where they were: ``join(split(...))`` is the text as sent.
Assistant and tool messages are never split (a tool output is data, whatever it holds).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from proxy import clients
from proxy.store.models import Scaffold

REPEAT_MIN = 200  # characters a user paragraph needs before repetition can make it scaffolding
SYSTEM_ROLES = ("system", "developer")

# One opening pattern each, starting with a literal (a fast substring search; an alternation of
# them scanned every position: 21 ms for 100 kB), and its closing tag found by str.find, so a
# text of unclosed openings costs one pass, not one per opening (1.5 s for 50 kB by regex).
_BLOCKS = [(kind, re.compile(opening), close) for kind, opening, close in clients.BLOCKS]


def _lead(opening: str) -> str:
    """What a block's opening pattern starts with, as plain text: "<" for the tagged ones."""
    if opening.startswith("<"):
        return "<"
    literal = re.match(r"(?:[^\\.^$*+?{}\[\]|()]|\\[^A-Za-z0-9])+", opening)
    return re.sub(r"\\(.)", r"\1", literal.group(0)) if literal else opening[:1]


# A text holding none of the openings' leads ("<", "To suggest changes…") has no block.
_LEADS = frozenset(_lead(opening) for _, opening, _ in clients.BLOCKS)


def may_hold_blocks(text: str) -> bool:
    """Whether ``text`` holds the start of any block's opening (else it has no block)."""
    return any(lead in text for lead in _LEADS)


_TRAILING = re.compile(r"[ \t]*(?:\r?\n)*")
_MADE_UP = [(kind, re.compile(pattern, re.DOTALL)) for kind, pattern in clients.MADE_UP]
_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")
_SPACE = " \t\r\n"


def digest(core: str) -> str:
    """The hash a piece is stored under (of its text without surrounding white space)."""
    return hashlib.sha256(core.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def core_of(text: str) -> str:
    """``text`` without the white space around it, as pieces are stored and hashed."""
    return text.strip(_SPACE)


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of scaffolding cut out of a message's text."""

    # system | system-reminder | environment | instructions | retry | handoff | context | repeated
    kind: str
    text: str  # exactly as it stood, white space included
    at: int  # where it stood in the words (offsets into :attr:`Split.words`)

    @property
    def core(self) -> str:
        """The text without its surrounding white space: what is stored once."""
        return core_of(self.text)

    @property
    def lead(self) -> str:
        return self.text[: len(self.text) - len(self.text.lstrip(_SPACE))]

    @property
    def trail(self) -> str:
        return self.text[len(self.text.rstrip(_SPACE)) :] if self.core else ""

    @property
    def hash(self) -> str:
        return digest(self.core)


@dataclass(frozen=True, slots=True)
class Split:
    """A message's text as words and pieces of scaffolding."""

    words: str
    pieces: tuple[Piece, ...] = ()


def paragraphs(text: str) -> list[str]:
    """``text`` cut after each blank line (the blank lines stay with the paragraph before):
    ``"".join(paragraphs(t)) == t``."""
    out: list[str] = []
    start = 0
    for m in _PARAGRAPH_END.finditer(text):
        out.append(text[start : m.end()])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


def made_up(text: str) -> str | None:
    """The kind of client-written message ``text`` is (``retry``, ``handoff``), or None."""
    core = text.strip(_SPACE)
    for kind, pattern in _MADE_UP:
        if pattern.search(core):
            return kind
    return None


def split(role: str, text: str, known: Callable[[str], bool] | None = None) -> Split:
    """``text`` of a message of ``role`` as words and scaffolding. ``known(hash)``: whether a
    long paragraph of a user message is known scaffolding (seen in another session)."""
    if role in SYSTEM_ROLES:
        return Split("", tuple(Piece("system", p, 0) for p in paragraphs(text) if p))
    if role != "user" or not text:
        return Split(text)
    if made_up(text):
        return Split("", (Piece(made_up(text) or "retry", text, 0),))
    segments: list[tuple[str | None, str]] = []  # (kind, text); None: words
    pos = 0
    for start, stop, block in blocks(text):
        segments += _word_segments(text[pos:start], known)
        segments.append((block, text[start:stop]))
        pos = stop
    segments += _word_segments(text[pos:], known)
    if len(segments) == 1 and segments[0][0] is None:
        return Split(text)
    words = "".join(t for kind, t in segments if kind is None)
    if made_up(words):  # the blocks wrapped a retry: the whole message is the client's
        return Split("", (Piece(made_up(words) or "retry", text, 0),))
    pieces: list[Piece] = []
    at = 0
    for kind, t in segments:
        if kind is None:
            at += len(t)
        else:
            pieces.append(Piece(kind, t, at))
    return Split(words, tuple(pieces))


def blocks(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, kind)`` of the scaffolding blocks in ``text`` (with the blank space after
    each), in order, none overlapping."""
    if not may_hold_blocks(text):
        return []
    spans: list[tuple[int, int, str]] = []
    for kind, opening, close in _BLOCKS:
        pos = 0
        while (m := opening.search(text, pos)) is not None:
            end = text.find(close, m.end())
            if end < 0:
                break  # no later opening is closed either
            pos = end + len(close)
            spans.append((m.start(), -pos, kind))
    found = sorted(spans)
    out: list[tuple[int, int, str]] = []
    for start, neg_end, kind in found:
        if out and start < out[-1][1]:
            continue  # inside a block already taken
        trailing = _TRAILING.match(text, -neg_end)
        out.append((start, trailing.end() if trailing is not None else -neg_end, kind))
    return out


def _word_segments(text: str, known: Callable[[str], bool] | None) -> list[tuple[str | None, str]]:
    if not text:
        return []
    if known is None or len(text) < REPEAT_MIN:
        return [(None, text)]
    out: list[tuple[str | None, str]] = []
    for p in paragraphs(text):
        core = core_of(p)
        kind = "repeated" if len(core) >= REPEAT_MIN and known(digest(core)) else None
        if kind is None and out and out[-1][0] is None:
            out[-1] = (None, out[-1][1] + p)
        else:
            out.append((kind, p))
    return out


def long_paragraphs(words: str) -> list[str]:
    """Hashes of the paragraphs of ``words`` long enough for repetition to count."""
    if len(words) < REPEAT_MIN:
        return []
    out = []
    for p in paragraphs(words):
        core = core_of(p)
        if len(core) >= REPEAT_MIN:
            out.append(digest(core))
    return out


def join(words: str, pieces: tuple[Piece, ...] | list[Piece]) -> str:
    """The text as sent: ``words`` with each piece put back where it stood."""
    if not pieces:
        return words
    out: list[str] = []
    pos = 0
    for p in pieces:
        out += (words[pos : p.at], p.text)
        pos = p.at
    out.append(words[pos:])
    return "".join(out)


def words_of(role: str, text: str) -> str:
    """The words of a message by shape alone (no repetition): what a query or a recalled turn
    stored before scaffolding was split off reads as."""
    if role in SYSTEM_ROLES:
        return ""
    if role != "user" or not text or (not may_hold_blocks(text) and made_up(text) is None):
        return text
    return split(role, text).words


def archived(
    role: str,
    text: str,
    known: Callable[[str], bool] | None = None,
    client_reply: bool = False,
) -> tuple[str, tuple[Scaffold, ...], tuple[str, ...]]:
    """What a message's (redacted) ``text`` is archived as: its words, its pieces of
    scaffolding as the store keeps them, and the hashes of a user's long paragraphs (their
    sightings, :func:`proxy.store.scaffolds.known_paragraphs`). ``client_reply``: an assistant
    message answering a client's own context (:func:`proxy.said.client_reply`), all of it
    scaffolding."""
    if client_reply and role == "assistant" and text:
        cut = Split("", (Piece("context", text, 0),))
    else:
        cut = split(role, text, known)
    pieces = tuple(Scaffold(p.hash, p.kind, p.core, p.at, p.lead, p.trail) for p in cut.pieces)
    sightings = tuple(long_paragraphs(cut.words)) if role == "user" else ()
    return cut.words, pieces, sightings
