"""Turn arbitrary user text into a safe FTS5 ``MATCH`` expression (pure).

User text never reaches ``MATCH`` as written: FTS5 gives meaning to ``"``, ``*``, ``^``, ``:``,
``+``, ``-``, parentheses and the bare words ``AND``, ``OR``, ``NOT`` and ``NEAR``, and a stray
one is a syntax error (or a different query). :func:`to_match` keeps only word tokens (runs of
Unicode letters and digits, as the ``unicode61`` tokenizer sees them), drops English stop words
unless told not to, double-quotes each token (so ``OR`` is the word "or") and joins them with
``OR``, which BM25 then ranks. Text with no usable token gives ``None``: skip the FTS path.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Collection

# Letters and digits; "_" and everything else separate tokens, as in FTS5's unicode61.
_TOKEN = re.compile(r"[^\W_]+")

DEFAULT_MAX_TERMS = 32

STOP_WORDS: frozenset[str] = frozenset(
    """
    a about above after again against all am an and any are aren as at be because been before
    being below between both but by can cannot could couldn did didn do does doesn doing don
    down during each few for from further had hadn has hasn have haven having he her here hers
    herself him himself his how i if in into is isn it its itself just let ll me more most
    mustn my myself no nor not now of off on once only or other ought our ours ourselves out
    over own re s same shan she should shouldn so some such t than that the their theirs them
    themselves then there these they this those through to too under until up ve very was
    wasn we were weren what when where which while who whom why will with won would wouldn y
    you your yours yourself yourselves d m o
    """.split()  # noqa: SIM905 - a word list reads better as text
)
"""A small English stop-word list (NLTK's, contractions split as unicode61 splits them)."""


def tokens(text: str) -> list[str]:
    """The word tokens of ``text``, NFC-normalised, in order (duplicates kept)."""
    return _TOKEN.findall(unicodedata.normalize("NFC", text))


def to_match(
    text: str,
    *,
    stop_words: Collection[str] | None = STOP_WORDS,
    max_terms: int = DEFAULT_MAX_TERMS,
) -> str | None:
    """A safe ``MATCH`` expression for ``text``, or ``None`` when nothing searchable is left.

    Tokens are compared case-insensitively for stop words and duplicates; the first
    ``max_terms`` distinct tokens are kept. ``stop_words=None`` keeps every token.
    """
    seen: set[str] = set()
    terms: list[str] = []
    for token in tokens(text):
        folded = token.casefold()
        if folded in seen or (stop_words is not None and folded in stop_words):
            continue
        seen.add(folded)
        terms.append(token)
        if len(terms) >= max_terms:
            break
    if not terms:
        return None
    return " OR ".join(quote(t) for t in terms)


def quote(term: str) -> str:
    """``term`` as an FTS5 string: double-quoted, inner quotes doubled."""
    return '"' + term.replace('"', '""') + '"'
