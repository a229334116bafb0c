"""The relevance gate: which of a search's hits bear on the message at all (pure).

What a message's phrasing says (a question, a request, a greeting, a name, a model's
boilerplate) is read by :mod:`proxy.search.phrasing`. Search always answers: its fused scores
are relative (the best full-text match scores 1 on its feature whatever it matched), so a top
20 is full whenever the archive holds 20 turns. The gate
reads what is absolute beside the ranks and keeps a hit only when:

- the message has words to go on: a message of greetings, thanks and acknowledgements alone
  ("thanks, that's all", "ok!") has no :func:`content_words` and gets nothing (a question such
  as "and what was it again?" only a hit whose meaning is very close to it, ``cosine_alone``);
- something stored is about the message at all: unless its closest hit reaches
  ``best_cosine``, no hit goes (a question about the task at hand, "What can I prepare the day
  before?", still finds a top 20 of loosely related turns);
- the hit itself says something: a bare acknowledgement ("ok", "Thanks!", "haha nice") is never
  a memory (fewer than ``min_words`` content words), and neither is a turn that only asks
  (:func:`only_asks`: every sentence a question or a request to the assistant), nor a model's
  reply that opens with its boilerplate (:func:`boilerplate`: "I'm sorry for any confusion,
  but as a personal assistant…");
- it says something the others kept do not (:func:`distinct`: a model repeating the user's
  fact, the same words sent twice, are shown once, the user's own words first; a model's reply
  whose words the user's kept turns hold between them is not shown, nor one that mostly repeats
  a hit kept before it);
- its vector agrees: a hit full-text search found needs a cosine to the query of at least
  ``min_cosine`` (``question_cosine`` for a question; a shared common word alone is no
  relevance), one only the vector path found needs ``cosine_alone``, and so does one that
  shares only a vague word with the message (:func:`only_vague`: "new", "one", "thing").
  Without a cosine (the vector path did not run, or the turn has no vector yet) a full-text
  hit passes on its rank;
- a question (:func:`is_question`: "when did I…?", "remind me…", but not a request to the
  assistant, :func:`is_request`: "Can you help me plan…?") asks for what was said: every
  hit over ``question_cosine`` goes whose fused score is at least ``question_share`` of the
  best one's, whatever its rank (on LoCoMo, where every message is a question, the evidence a
  top 20 holds sits anywhere in it; the fused score tells it from the rest far better than the
  cosine alone does; a hit as close as ``cosine_alone`` goes whatever its score); any other
  message (a statement, an instruction, small talk) takes only what both paths agree on: a
  hit that shares a content word with it, not a light one (:func:`shares_word`; full-text
  search's rank is not enough, it also matches a turn by its neighbours' words) and is close
  in meaning, ``min_cosine``, near the best hit
  (a fused score at least ``min_share`` of the best one's), at most ``statement_top`` (one) (in
  mode ``stable`` each block stays in the prompt: a chat of statements must not fill its window
  with memories). The vector alone is not enough here: a chat's short turns are embedded as
  ``"user: …"``, and that shared start lifts their cosine ("For Wednesday, suggest a dinner I
  can make in twenty minutes." and "I usually cook it on Thursday evenings." 0.56);
- a task (a message with a request to the assistant: "Can you summarise the plan for Monday to
  Wednesday?") is about the conversation at hand: its memory must share what the task names
  (:func:`anchors`: "a present for Hugo", "my sister"), not only a common word ("plan",
  "cooking", a weekday);
- its words bring it close, not its speaker: a turn is embedded as ``"<speaker>: <words>"``
  and the query as ``"user: <words>"``, and on short texts that start alone makes much of the
  cosine (in a chat app's archive every turn of the user starts ``"user: "``: "Okay, let's keep
  going." has cosine 0.62 to "…so let's keep it simple." and 0.62 to an empty ``"user: "``, 0.38
  between the bare texts). A chat user's short turn (fewer than ``lift_words`` content words:
  on a longer one its words make the cosine) must be closer to the message than an empty
  ``"user: "`` turn by ``min_lift`` (a named speaker's start is not the query's: ``baseline``
  None);
- a model's own reply is evidence of what was said, not of what is true: an assistant turn needs
  ``assistant_extra`` more cosine on each of those bars, and ``cosine_alone`` when the message
  speaks in the first person ("Which dish did I say was my favourite?": the user asks about
  their own words, which a model's reply at best repeats; LoCoMo's questions, about two other
  people, never do).

``retrieval.top_k`` and the budgets are ceilings: a message that needs nothing gets nothing.
The thresholds are settings (``[retrieval] gate_*``), calibrated by ``python -m bench.gate`` on
LoCoMo's questions and on messages that need no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from proxy.search.fts_query import tokens
from proxy.search.phrasing import (
    ASKS_CHARS,
    anchors,
    boilerplate,
    content_words,
    only_asks,
    what_it_asks,
)


@dataclass(frozen=True, slots=True)
class Query:
    """What the gate reads of the message: its content words, whether it asks, whether it is
    about the user's own life or words (first person: "What did I say…", "our new pet"), and,
    for a message that asks the assistant to do something, what it names (:func:`anchors`)."""

    terms: frozenset[str]  # its content words
    question: bool
    own: bool = False
    anchors: frozenset[str] | None = None  # a task's names; None: the message is no task

    @property
    def words(self) -> int:
        """How many content words it has."""
        return len(self.terms)


FIRST_PERSON = frozenset(["i", "me", "my", "mine", "myself", "we", "us", "our", "ours"])


def query_content(query: str) -> Query:
    """What the gate needs of the message."""
    own = any(t.lower() in FIRST_PERSON for t in tokens(query[:ASKS_CHARS]))
    question, task = what_it_asks(query)
    names = anchors(query) if task else None
    return Query(frozenset(content_words(query)), question, own, names)


STEM_CHARS = 4
"""A word and a longer one it starts count as one from this many letters ("cook", "cooking")."""


LIGHT_WORDS = frozenset(
    " ".join(
        (
            "like likes liked want wants wanted need needs needed get gets got getting go goes",
            "going went make makes made making think know would could might must also really",
            "new one thing things something anything everything someone",
        )
    ).split()
)
"""Content words too light to tie a statement to a memory ("Saturday we'd like a hike…" and
"Monday I need to do groceries and I'd like a gym session…" share only "like"; English)."""


def shares_word(terms: frozenset[str], said: Sequence[str]) -> bool:
    """Whether a hit's content words (``said``) hold one of the message's (``terms``), or one
    word of a pair starts the other and has at least :data:`STEM_CHARS` letters ("cook",
    "cooking"; "Thursday", "Thursdays"); a light word (:data:`LIGHT_WORDS`) counts for
    neither."""
    terms = terms - LIGHT_WORDS
    for w in said:
        if w in LIGHT_WORDS:
            continue
        if w in terms:
            return True
        if len(w) >= STEM_CHARS and any(
            t.startswith(w) or (len(t) >= STEM_CHARS and w.startswith(t)) for t in terms
        ):
            return True
    return False


VAGUE_WORDS = frozenset(
    ["new", "one", "thing", "things", "something", "anything", "everything", "someone"]
)
"""Light words that say nothing of what a turn is about (English)."""


def only_vague(terms: frozenset[str], said: Sequence[str]) -> bool:
    """Whether a hit shares with the message only vague words (:data:`VAGUE_WORDS`): full-text
    search matched "What's the name of our new pet again?" to "Hi, I'm moving to a new flat…"
    by "new" alone, so such a hit needs the cosine of one the vector alone found (on LoCoMo
    this costs no evidence; counting the light verbs too, "make", "want", cost 0.003)."""
    vague = VAGUE_WORDS & terms
    return bool(vague) and any(w in vague for w in said) and not shares_word(terms, said)


@dataclass(frozen=True)
class GateSettings:
    """The gate's thresholds (see the module's docstring); ``enabled`` False passes all."""

    enabled: bool = True
    min_share: float = 0.8
    min_cosine: float = 0.5
    question_cosine: float = 0.12
    cosine_alone: float = 0.5
    assistant_extra: float = 0.03
    min_words: int = 2
    statement_top: int = 1
    best_cosine: float = 0.4
    question_share: float = 0.75
    min_lift: float = 0.02
    lift_words: int = 20

    @classmethod
    def of(cls, retrieval: Any) -> GateSettings:
        """The gate of ``[retrieval]`` settings (``gate``, ``gate_*``)."""
        return cls(
            retrieval.gate,
            retrieval.gate_min_share,
            retrieval.gate_min_cosine,
            retrieval.gate_question_cosine,
            retrieval.gate_cosine_alone,
            retrieval.gate_assistant_extra,
            retrieval.gate_min_words,
            retrieval.gate_statement_top,
            retrieval.gate_best_cosine,
            retrieval.gate_question_share,
            retrieval.gate_min_lift,
            retrieval.gate_lift_words,
        )


@dataclass(frozen=True, slots=True)
class HitFeatures:
    """What the gate reads of one hit: fused score, cosine to the query (None: unknown), rank
    on each path (None: not found there), role and text; ``baseline``: the query's cosine to
    an empty turn of the hit's speaker (:func:`~proxy.search.retrieval.baseline_text`; None:
    unknown)."""

    score: float
    cosine: float | None
    fts: int | None
    vec: int | None
    role: str
    content: str
    baseline: float | None = None


def says_something(
    role: str, content: str, g: GateSettings, said: Sequence[str] | None = None
) -> bool:
    """Whether a turn can be a memory at all: it holds ``g.min_words`` content words (``said``,
    when already read), does not only ask, and is no model's boilerplate."""
    words = content_words(content) if said is None else said
    if len(words) < g.min_words or only_asks(content):
        return False
    return not (role == "assistant" and boilerplate(content))


def admit(
    query: Query,
    hits: Sequence[HitFeatures],
    g: GateSettings,
    words_of: Callable[[str], Sequence[str]] = content_words,
) -> list[int]:
    """Indexes of the ``hits`` (best first) that bear on the message (:func:`query_content`),
    in their order. ``words_of``: :func:`content_words`, or one that remembers what it read
    (recall reads a hit's words again after the gate)."""
    if not g.enabled:
        return list(range(len(hits)))
    if not hits:
        return []
    cosines = [h.cosine for h in hits if h.cosine is not None]
    if cosines and max(cosines) < g.best_cosine:
        return []  # nothing stored is close to the message
    best = max(h.score for h in hits)
    share = g.question_share if query.question else g.min_share
    floor = share * best if best > 0 and share > 0 else float("-inf")
    bar = g.question_cosine if query.question else g.min_cosine
    out: list[int] = []
    words: dict[int, frozenset[str]] = {}
    for i, h in enumerate(hits):
        close = query.question and h.cosine is not None and h.cosine >= g.cosine_alone
        if h.score < floor and not close:
            continue
        lift = None if h.cosine is None or h.baseline is None else h.cosine - h.baseline
        said = words_of(h.content)
        if lift is not None and lift < g.min_lift and len(said) < g.lift_words:
            continue  # a short turn no closer to the message than an empty turn of its speaker
        if not says_something(h.role, h.content, g, said):
            continue
        words[i] = frozenset(said)
        extra = g.assistant_extra if h.role == "assistant" else 0.0
        # A question about the user's own words: a model's reply must be very close.
        bar_here = g.cosine_alone if h.role == "assistant" and query.own else bar
        if not query.question and not shares_word(query.terms, said):
            # A statement's memory shares a word with it (its own: full-text search also
            # matches a turn by its neighbours' words) and is close in meaning.
            ok = False
        elif query.anchors is not None and not shares_word(query.anchors, said):
            ok = False  # a task's memory is about something it names
        elif h.cosine is None:
            ok = h.fts is not None and query.words > 0
        elif query.words == 0 or h.fts is None or only_vague(query.terms, said):
            ok = h.cosine >= g.cosine_alone + extra
        else:
            ok = h.cosine >= bar_here + extra
        if ok:
            out.append(i)
    out = distinct(out, hits, words)
    return out if query.question else out[: g.statement_top]


REPEATS_SHARE = 0.7
"""A model's reply that has this share of its content words in one hit kept before it repeats
that hit (:func:`distinct`)."""


def distinct(
    kept: Sequence[int], hits: Sequence[HitFeatures], words: Mapping[int, frozenset[str]]
) -> list[int]:
    """``kept`` less the hits that say nothing another kept one does not (``words``: each
    one's content words): a hit whose words all appear in another's goes (a model repeating the
    user's fact, the same message sent twice). Of two, the one with more words stays, at the
    better rank of the two; a user's words stay before a reply with the same words. A model's
    reply whose words the user's kept turns hold between them goes too ("The appointment was on
    Tuesday at 9:45." beside "I booked a dentist appointment…" and "It's on Tuesday at 9:45…":
    on LoCoMo, whose second speaker is stored as the assistant, it costs 0.001 of the evidence
    the gate keeps), and so does one that mostly repeats a hit kept before it
    (:data:`REPEATS_SHARE` of its words in that one: a model answering alike every time, "I'm
    sorry for any confusion, but as a personal assistant…"; on LoCoMo it costs nothing)."""
    out = _distinct_pairs(kept, hits, words)
    said: set[str] = set()
    for i in out:
        if hits[i].role != "assistant":
            said |= words[i]
    shown: list[int] = []
    for i in out:
        if hits[i].role == "assistant" and repeats(words[i], said, [words[j] for j in shown]):
            continue
        shown.append(i)
    return shown


def repeats(mine: frozenset[str], said: AbstractSet[str], kept: Sequence[frozenset[str]]) -> bool:
    """Whether a model's reply with the content words ``mine`` says nothing new: the user's
    kept turns hold all its words between them (``said``), or one kept memory (``kept``) holds
    :data:`REPEATS_SHARE` of them."""
    return mine <= said or any(len(mine & other) >= REPEATS_SHARE * len(mine) for other in kept)


def _distinct_pairs(
    kept: Sequence[int], hits: Sequence[HitFeatures], words: Mapping[int, frozenset[str]]
) -> list[int]:
    """:func:`distinct`'s rule for two hits."""
    out: list[int] = []
    for i in kept:
        mine = words[i]
        if any(mine < words[j] or (mine == words[j] and _before(hits[j], hits[i])) for j in out):
            continue
        covered = [j for j in out if words[j] <= mine]
        if covered:
            at = out.index(covered[0])
            out = [j for j in out if j not in covered]
            out.insert(at, i)
        else:
            out.append(i)
    return out


def _before(a: HitFeatures, b: HitFeatures) -> bool:
    """Of two hits with the same words, whether ``a`` (kept earlier) stays: unless it is a reply
    and ``b`` the user's."""
    return not (a.role == "assistant" and b.role != "assistant")
