"""How a message is phrased (pure; English heuristics): its content words, whether it asks
something or asks the assistant to do something, its greetings, what it names, and a model's
boilerplate. The relevance gate (:mod:`proxy.search.relevance`) reads messages and hits with
these."""

from __future__ import annotations

import re

from proxy.search.fts_query import STOP_WORDS, tokens

ACKNOWLEDGEMENTS = frozenset(
    " ".join(
        (
            "ok okay k kk yes yeah yep yup ya no nope nah sure thanks thank thx ty cheers hi",
            "hello hey hiya yo bye goodbye cya later morning evening night good great cool",
            "nice fine perfect awesome wow lol haha hahaha hehe lmao right alright gotcha",
            "got sounds please pls welcome np indeed exactly agreed true totally absolutely",
            "definitely amazing wonderful love oh ah hmm um uh well much lot lots glad happy",
            "see soon care take",
        )
    ).split()
)
"""Words that carry no topic of their own in a chat (greetings, thanks, agreement)."""
_NUMBER = re.compile(r"\d+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
ASKS_CHARS = 2000  # what is read of a text for its questions and requests


def content_words(text: str) -> list[str]:
    """The words of ``text`` that can bear a topic: neither stop words nor acknowledgements,
    at least two characters (a number counts whatever its length)."""
    out: list[str] = []
    for t in tokens(text):
        w = t.lower()
        if w in STOP_WORDS or w in ACKNOWLEDGEMENTS:
            continue
        if len(w) >= 2 or _NUMBER.fullmatch(w):
            out.append(w)
    return out


QUESTION_WORDS = frozenset(
    " ".join(
        (
            "what when where who whom whose which why how did do does is are was were can could",
            "would will should have has remind tell",
        )
    ).split()
)
"""Words that open a question (or a request to be told something) in English."""


def is_question(text: str) -> bool:
    """Whether ``text`` asks for something: it holds a question mark or opens with a question
    word (English)."""
    if "?" in text:
        return True
    first = next(iter(tokens(text[:200])), "").lower()
    return first in QUESTION_WORDS


GREETING_CHARS = 40
"""A sentence longer than this is not a greeting (and is not read for one)."""


def sentences(text: str) -> list[str]:
    """``text``'s sentences, less greetings and thanks ("Hi!", "Thanks so much!": no
    :func:`content_words` and no question mark), which neither ask nor tell anything."""
    parts = _SENTENCE_END.split(text.strip())
    return [p for p in parts if len(p) > GREETING_CHARS or "?" in p or content_words(p)]


SAYING_WORDS = frozenset(
    [
        "say",
        "said",
        "says",
        "tell",
        "told",
        "mention",
        "mentioned",
        "remind",
        "remember",
        "recall",
        "again",
    ]
)
"""Words of a question about what was said that the turn which said it does not hold."""


def asked_words(text: str) -> frozenset[str]:
    """The content words of ``text``'s questions (its first :data:`ASKS_CHARS` characters),
    less :data:`SAYING_WORDS`: what a turn that answers it is about ("Which dish did I say
    was my favourite?": dish, favourite)."""
    out: set[str] = set()
    for sentence in sentences(text[:ASKS_CHARS]):
        if is_question(sentence):
            out.update(w for w in content_words(sentence) if w not in SAYING_WORDS)
    return frozenset(out)


def what_it_asks(text: str) -> tuple[bool, bool]:
    """Whether ``text`` asks what was said (one of its sentences is a question,
    :func:`is_question`, that is not a request to the assistant, :func:`is_request`) and, when
    it does not, whether it asks the assistant to do something (a task): "I'm moving at the end
    of the month. Can you help me organise it?" is a statement and a task. Its sentences are
    read once for both."""
    parts = sentences(text[:ASKS_CHARS])
    requests = [is_request(p) for p in parts]
    question = any(is_question(p) and not r for p, r in zip(parts, requests, strict=True))
    return question, not question and any(requests)


CALENDAR_WORDS = frozenset(
    " ".join(
        (
            "monday tuesday wednesday thursday friday saturday sunday january february march",
            "april may june july august september october november december today tomorrow",
            "tonight yesterday week weekend day days morning afternoon evening night month year",
        )
    ).split()
)
"""Words a task names that are about when, not about what (English)."""
_OWNERS = frozenset(["my", "our"])


def anchors(text: str) -> frozenset[str]:
    """What a message names that a memory could be about: a word written with a capital
    inside a sentence ("a present for Hugo", "project Orchard") or after "my" / "our" ("my
    sister"), neither a day nor a time word; lowercased. A task ("Can you summarise the plan
    for Monday to Wednesday?", "How long before the guests arrive should I start cooking?") is
    about the conversation at hand: it draws on memory only through what it names."""
    out: set[str] = set()
    for sentence in _SENTENCE_END.split(text[:ASKS_CHARS].strip()):
        words = list(tokens(sentence))
        for i, t in enumerate(words[1:], 1):
            w = t.lower()
            if w in CALENDAR_WORDS or w in STOP_WORDS or w in ACKNOWLEDGEMENTS:
                continue
            if t[:1].isupper() or words[i - 1].lower() in _OWNERS:
                out.add(w)
    return frozenset(out)


_OPENERS = r"(?:(?:hi|hello|hey|ok|okay|so|and|also|now|well|great|thanks|thank you)\b[\s,!.]*)*"
# A lead of up to three words and no pronoun before it: "For Wednesday, suggest…", "Tonight,
# can you…" (not "I went to Graz, can you believe it?").
_LEAD = r"(?:(?:(?!(?:i|we|you|he|she|they|it)\b)[^\s,.!?]+\s+){0,2}[^\s,.!?]+,\s*)?"
_REQUEST = re.compile(
    _OPENERS
    + _LEAD
    + r"(?:(?:can|could|would|will) you\b(?! (?:please )?(?:remind|recall|remember)\b)"
    r"|(?:please|help me|let'?s|let me)\b"
    r"|(?:what|how|where|which|when) (?:should|can|could|do|would) (?:i|we)\b"
    r"|any (?:ideas|tips|suggestions|advice)\b"
    r"|(?:make|keep|give|suggest|tell me|show me|write|put|list|summari[sz]e|explain|translate"
    r"|rewrite|use|fix)\b"
    r"|(?:what|how|where|which|when|who)\b[^.!?]{0,60}?\b(?:should|shall) (?:i|we)\b)",
    re.IGNORECASE,
)
_REQUEST_TAIL = re.compile(
    r"[,;:\u2013\u2014-]\s*(?:(?:can|could|would|will) you (?:please )?(?:help|suggest|recommend"
    r"|give|make|tell|show|list|write|plan|check|explain|summari[sz]e)\b"
    r"|any (?:ideas|tips|suggestions|advice)\b|what do you (?:think|suggest|recommend)\b)"
    r"[^.!?]{0,40}\?+\s*$",
    re.IGNORECASE,
)


def is_request(text: str) -> bool:
    """Whether ``text`` asks the assistant to do something: by its opening ("Can you help me
    plan my week?", "What should I pack?", "How long before they arrive should I start
    cooking?", "Make it shorter", "Any tips?") or by its closing words ("I'm planning a weekend
    away, can you help?", "We land at nine, any ideas for the evening?"): a task, not a
    question about what was said (no LoCoMo question is phrased so; English). "Can you remind
    me…?" asks what was said."""
    if _REQUEST.match(text.lstrip()[:200]) is not None:  # its opening words
        return True
    return _REQUEST_TAIL.search(text.rstrip()[-80:]) is not None  # or its closing ones


_BOILERPLATE = re.compile(
    r"\bas an? (?:ai|artificial intelligence|(?:large )?language model|llm|chatbot"
    r"|(?:virtual |personal |digital |ai )?assistant)\b"
    r"|\b(?:i(?:'m| am) sorry|i apologi[sz]e|(?:my )?apologies) (?:for|about) (?:any|the)"
    r" (?:confusion|misunderstanding|inconvenience)\b"
    r"|\bi(?:'m| am) (?:just )?(?:an ai|a language model|an? (?:ai|virtual|digital) assistant)\b",
    re.IGNORECASE,
)


BOILERPLATE_CHARS = 300  # what is read of a reply's start for its boilerplate


def boilerplate(text: str) -> bool:
    """Whether a model's reply opens with its boilerplate: its first sentence apologises for
    a confusion or says what the model is ("I'm sorry for any confusion, but as a personal
    assistant, I specialize in…", "As an AI language model, I…"). Such a reply tells nothing of
    the user's (a small local model answers so to half a chat); none of LoCoMo's 5,882 turns
    opens so (English)."""
    first = _SENTENCE_END.split(text.lstrip()[:BOILERPLATE_CHARS], maxsplit=1)[0]
    return _BOILERPLATE.search(first) is not None


def only_asks(text: str) -> bool:
    """Whether every sentence of ``text`` is a question or a request to the assistant: such a
    turn tells nothing to recall ("Any tips for the first month?", "Make that shorter please.",
    "Which dish did I say was my favourite?"; on LoCoMo 0.3 % of the evidence, in a chat the
    user's earlier requests to the assistant)."""
    if len(text) > ASKS_CHARS:  # a long turn says something (and is not split on every read)
        return False
    parts = sentences(text)
    return bool(parts) and all(p.rstrip().endswith("?") or is_request(p) for p in parts)
