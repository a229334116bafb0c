"""Time in English text: whether a question is about time, and whether a turn says when.

Scored fusion's ``time`` feature (:mod:`proxy.search.scoring`) pairs the two: a question about
time ("When did Calvin have a car incident?", "How long has Jolene been doing yoga?", "What did
Maria donate in December 2023?") is most often answered by a turn that places something in time
("I had a lil car accident last Friday", "for three years", "yesterday"). On LoCoMo 84 % of the
evidence turns of its temporal questions hold such an expression against 16 % of all turns.

Pure regular expressions, English only; a question in another language never triggers the
feature (it then scores as before). :func:`asks_about_time` is strict: it fires when the
question asks when, how long, how old, what year/month/day..., or names a time itself (a month,
a year, a weekday, "last week", "recently"); never on a question that merely holds "time" or
"when" in another sense ("What time management techniques...", "When Dave was a child, what
did he...").
"""

from __future__ import annotations

import hashlib
import re

from proxy.cache import LRU

SCAN_CHARS = 300
"""Characters of a turn searched for a time expression: where a turn says when, it mostly does
so early (on LoCoMo, where 99 % of turns are shorter, no turn's answer changes), and a model's
long replies cost no more than a short message."""

_UNIT = r"(?:day|week|weekend|month|year|hour|night|decade)s?"
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_WEEKDAY = rf"(?:{'|'.join(_DAYS)})s?"
_WEEKDAY_SHORT = r"(?:mon|tues?|wed|thu|thurs|fri|sat|sun)"
_SEASON = r"(?:spring|summer|fall|autumn|winter)"
_MONTHS = (
    "january", "february", "march", "april", "june", "july", "august", "september", "october",
    "november", "december",
)  # fmt: skip
_MONTH = rf"(?:{'|'.join(_MONTHS)})"
_MAY_BEFORE = ("in", "of", "on", "during", "early", "late", "mid")  # "may" alone is a verb
_MAY = rf"(?:(?:{'|'.join(_MAY_BEFORE)})[\s-]+may|may\s+\d)"
_COUNTS = (
    r"\d+", "a", "an", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", r"a\s+few", "few", r"a\s+couple\s+of", r"couple\s+of",
    "several", "many",
)  # fmt: skip
_RELATIVE = ("last", "next", "this", "past", "coming", "previous", "other")
_AGE = r"(?:kid|child|teen|teenager|little|young|\d+)"
_YEAR = r"(?:19|20)\d\d"

_ASKS = re.compile(
    r"^\s*when\b(?!\s+\w+\s+(?:was|were|is)\s+(?:a\s+)?(?:child|kid|young|little|teen))"
    r"|\bhow\s+long\b|\bhow\s+old\b|\bsince\s+when\b"
    r"|\bhow\s+many\s+(?:years|months|weeks|days|hours|minutes)\b"
    r"|\b(?:what|which)\s+(?:year|month|day|date|week|weekend|season|decade)\b"
    r"|\bwhat\s+time\s+(?:did|does|do|is|was|will)\b",
    re.IGNORECASE,
)
_NAMES = re.compile(
    rf"\b(?:{_MONTH}|{_MAY}|{_YEAR}|{_WEEKDAY}"
    rf"|(?:last|next|this|past|previous)\s+(?:{_UNIT}|{_SEASON}|{_WEEKDAY})"
    r"|yesterday|today|tomorrow|tonight|recently|lately|ago)\b",
    re.IGNORECASE,
)
_SAYING = (
    "yesterday", "today", "tonight", "tomorrow", "recently", "lately", "ago", "forever",
    r"for\s+ages", r"a\s+while", r"the\s+other\s+day",
    *(
        rf"{w}\s+(?:{_UNIT}|{_WEEKDAY}|{_WEEKDAY_SHORT}|{_SEASON}|time|morning|afternoon|evening)"
        for w in _RELATIVE
    ),
    *(rf"{n}\s+{_UNIT}" for n in _COUNTS),
    *(rf"{d}s?" for d in _DAYS),
    r"the\s+\d{1,2}(?:st|nd|rd|th)",
    r"since\s+(?:we|i|last|then|\d)",
    rf"as\s+a\s+{_AGE}",
    rf"when\s+i\s+was(?:\s+a)?\s+{_AGE}",
    r"19\d\d", r"20\d\d",
    *_MONTHS,
    *(rf"{w}[\s-]+may" for w in _MAY_BEFORE),
    r"may\s+\d",
)  # fmt: skip
_SAYS = re.compile(r"\b(?:" + "|".join(_SAYING) + r")\b")
"""Lower-case text only. One flat alternation, each branch starting with a letter or digit of
its own: the regex engine skips a branch at the first character that differs, which makes it
about twice as fast as the same expressions nested."""


def asks_about_time(question: str) -> bool:
    """Whether ``question`` asks when or how long, or names a time (see the module's text)."""
    return _ASKS.search(question) is not None or _NAMES.search(question) is not None


def says_when(text: str) -> bool:
    """Whether ``text`` (its first :data:`SCAN_CHARS` characters) holds a time expression: a
    relative one ("yesterday", "last Friday", "two weeks ago", "next month", "for three
    years", "since I was 17") or an absolute one (a month, a weekday, a year, "the 11th")."""
    return _says(text[:SCAN_CHARS])


_SEEN: LRU[bytes, bool] = LRU(1 << 14)
"""Answers of :func:`_says` by a digest of the text (no stored text is kept in memory here:
a forgotten turn's words do not linger in a cache)."""


def _says(head: str) -> bool:
    """:func:`says_when` of a turn's head, remembered: the same user's turns come back search
    after search, and a look-up costs about a microsecond where the search costs about ten."""
    key = hashlib.blake2b(head.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    known = _SEEN.get(key)
    if known is None:
        known = _SAYS.search(head.lower()) is not None
        _SEEN[key] = known
    return known
