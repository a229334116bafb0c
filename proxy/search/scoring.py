"""Score-aware fusion of the two search paths (pure functions, no I/O).

Reciprocal Rank Fusion sees only ranks, so a vector hit ranked 3rd at cosine 0.31 counts as much
as one ranked 3rd at 0.62, and it knows nothing about the turn beyond its place in a list.
:func:`scored_fusion` ranks the union of both paths' candidates by a weighted sum of features
that each path, and the turns themselves, already hold:

- ``fts`` — the turn's BM25 over the best BM25 of the query (1 for the best match, 0 when FTS5
  did not find it);
- ``vec`` — the cosine of the turn's vector to the query's, stretched over the vector path's
  list (1 for its best, 0 for its last or anything below; FTS5-only candidates' cosines are
  computed too; 0 when the vector path did not run), so that the path's best match stands out
  as BM25's does;
- ``speaker`` — 1 when the turn's speaker is named in the query ("What did Caroline research?"
  asks about Caroline's turns). Only names, never a role such as ``user``;
- ``session`` — the best ``fts`` of any candidate of the same session: a session that matches
  the question well holds its answer more often than a stray turn of another;
- ``neighbour`` — the best ``vec`` of the turns just before and after it in its session, among
  the vector path's candidates (0 otherwise): an answer often sits next to the turn that names
  the topic ("Did you finish it?" — "Yes, last Sunday.");
- ``length`` — ``log(1 + min(chars, 50)) / log(51)``: "Thanks!" or "Wow, cool!" seldom answers
  a question. Anything of 50 characters or more counts the same: on LoCoMo a cap of 300 found
  more (held-out R@10 0.79 against 0.77), but there it made a model's long reply outrank the
  short user message it answered, which both paths ranked first ("My sister Marta lives in
  Porto and she breeds Siamese cats."); a memory layer over chats with a model must not
  prefer the model's verbosity;
- ``time`` — 1 when the query is about time (asks when or how long, or names a time) and the
  turn says when something happened ("last Friday", "two weeks ago", "in 2022"), both by the
  English patterns of :mod:`proxy.search.timewords`; 0 for any other query. On LoCoMo's
  held-out half it lifted temporal questions' R@10 from 0.74 to 0.86.
- ``when`` — 1 when the query names a time (a date, a month, a year; with the request's time
  also "yesterday", "last week", "three days ago": :mod:`proxy.search.when`) and the turn was
  said in it. On LoCoMo 190 of the 233 turns cited by questions naming a month were said in it.

The weights are settings (``[retrieval] score_*``), fitted by ``python -m bench.tune_fusion``
on half of LoCoMo's conversations and checked on the other half.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from proxy.search.fusion import Fused
from proxy.search.timewords import asks_about_time, says_when
from proxy.search.when import query_times, said_in

FEATURES = ("fts", "vec", "speaker", "session", "neighbour", "length", "time", "when")
"""The features, in the order of :func:`features`' columns and of the weights."""

LENGTH_CAP = 50
"""Characters past which a turn's length no longer counts."""

_LOG_CAP = math.log1p(LENGTH_CAP)
_LENGTH = [math.log1p(chars) / _LOG_CAP for chars in range(LENGTH_CAP + 1)]
"""The ``length`` feature of 0..LENGTH_CAP characters."""
_ROLE_NAMES = frozenset({"user", "assistant", "system", "tool", "function", "developer"})
_WORD = re.compile(r"\w+")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One turn either path found, with what the scoring needs of it.

    ``bm25``: FTS5's score (lower is better, usually negative), None when FTS5 did not find it;
    ``cosine``: to the query, None when unknown (no vector, or no vector path); ``text``: the
    turn's content (read only for a query about time); ``at``: when the turn was said (Unix
    seconds), None when unknown."""

    id: int
    session_id: str
    position: int
    speaker: str | None
    chars: int
    bm25: float | None
    cosine: float | None
    text: str = ""
    at: float | None = None


def named_speakers(query: str, speakers: Sequence[str | None]) -> set[str]:
    """Those of ``speakers`` the query names as a whole word (case-insensitive); roles and
    one-letter names never count."""
    folded = query.casefold()
    words = set(_WORD.findall(folded))
    out: set[str] = set()
    for name in {s for s in speakers if s}:
        key = name.casefold().strip()
        if len(key) < 2 or key in _ROLE_NAMES:
            continue
        if key in words if _WORD.fullmatch(key) else _names(key, folded):
            out.add(name)
    return out


def _names(key: str, folded: str) -> bool:
    """Whether ``folded`` holds ``key`` (a name of several words or signs) as a whole."""
    return re.search(r"(?<!\w)" + re.escape(key) + r"(?!\w)", folded) is not None


@dataclass(slots=True)
class Columns:
    """Candidates as columns, one list per field of :class:`Candidate` (same order): what the
    search builds, one list per field instead of one object per candidate."""

    ids: list[int]
    session_id: list[str]
    position: list[int]
    speaker: list[str | None]
    chars: list[int]
    bm25: list[float | None]
    cosine: list[float | None]
    text: list[str]
    at: list[float | None]

    @classmethod
    def of(cls, candidates: Sequence[Candidate]) -> Columns:
        c = candidates
        return cls(
            [x.id for x in c],
            [x.session_id for x in c],
            [x.position for x in c],
            [x.speaker for x in c],
            [x.chars for x in c],
            [x.bm25 for x in c],
            [x.cosine for x in c],
            [x.text for x in c],
            [x.at for x in c],
        )

    def __len__(self) -> int:
        return len(self.ids)

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(*row)
            for row in zip(
                self.ids, self.session_id, self.position, self.speaker, self.chars, self.bm25,
                self.cosine, self.text, self.at, strict=True,
            )
        ]  # fmt: skip


def _columns(candidates: Sequence[Candidate] | Columns) -> Columns:
    return candidates if isinstance(candidates, Columns) else Columns.of(candidates)


def features(
    candidates: Sequence[Candidate] | Columns,
    query: str,
    vec_ids: Sequence[int],
    now: float | None = None,
) -> list[tuple[float, ...]]:
    """One row of :data:`FEATURES` per candidate, in order. ``vec_ids``: the vector path's
    candidates (whose cosines the ``neighbour`` feature looks at); ``now``: the request's time
    (Unix seconds), for the query's relative times ("last week")."""
    return [tuple(row) for row in feature_matrix(candidates, query, vec_ids, now).tolist()]


def feature_matrix(
    candidates: Sequence[Candidate] | Columns,
    query: str,
    vec_ids: Sequence[int],
    now: float | None = None,
) -> npt.NDArray[np.float64]:
    """:func:`features` as a (candidates, features) array: the columns computed a whole list at
    a time, since this runs on every search."""
    c = _columns(candidates)
    n = len(c)
    out = np.zeros((n, len(FEATURES)), dtype=np.float64)
    if not n:
        return out
    # fts: BM25 over the query's best (both negative), 0 where FTS5 did not find the turn
    bm25 = np.array([np.nan if b is None else b for b in c.bm25])
    found = ~np.isnan(bm25)
    best = float(bm25[found].min()) if found.any() else 0.0
    if best < 0:
        out[found, 0] = bm25[found] / best
    # vec: the cosine stretched over the vector path's list
    in_vec = set(vec_ids)
    listed = np.array([i in in_vec for i in c.ids])
    cosine = np.array([np.nan if x is None else x for x in c.cosine])
    known = ~np.isnan(cosine)
    scale = listed & known
    if scale.any():
        floor = float(cosine[scale].min())
        span = (float(cosine[scale].max()) - floor) or 1.0
        out[known, 1] = np.maximum(0.0, (cosine[known] - floor) / span)
    # speaker, session, neighbour: per candidate, from its session's other candidates
    names = named_speakers(query, c.speaker)
    vec_at = {
        (session, position): v
        for session, position, v, on in zip(
            c.session_id, c.position, out[:, 1].tolist(), listed.tolist(), strict=True
        )
        if on
    }
    session_best: dict[str, float] = {}
    for session, f in zip(c.session_id, out[:, 0].tolist(), strict=True):
        session_best[session] = max(session_best.get(session, 0.0), f)
    timely = asks_about_time(query)
    times = query_times(query, now)
    out[:, 2] = [1.0 if speaker in names else 0.0 for speaker in c.speaker]
    out[:, 3] = [session_best[session] for session in c.session_id]
    out[:, 4] = [
        max(vec_at.get((session, position - 1), 0.0), vec_at.get((session, position + 1), 0.0))
        for session, position in zip(c.session_id, c.position, strict=True)
    ]
    out[:, 5] = [_LENGTH[min(max(chars, 0), LENGTH_CAP)] for chars in c.chars]
    if timely:
        out[:, 6] = [1.0 if says_when(text) else 0.0 for text in c.text]
    if times:
        out[:, 7] = [1.0 if said_in(at, times) else 0.0 for at in c.at]
    return out


def scored_fusion(
    candidates: Sequence[Candidate] | Columns,
    query: str,
    ranks: Mapping[str, Sequence[int]],
    weights: Mapping[str, float],
    now: float | None = None,
) -> list[Fused[int]]:
    """The candidates best first by the sum of weight times feature. ``ranks``: each path's
    candidate ids, best first (``"vec"``'s feed the ``neighbour`` feature; both give each
    result its 1-based rank per path); ``now``: the request's time. Ties go to the better best
    rank in any path, then to the id."""
    return list(scored_order(candidates, query, ranks, weights, now))


def scored_order(
    candidates: Sequence[Candidate] | Columns,
    query: str,
    ranks: Mapping[str, Sequence[int]],
    weights: Mapping[str, float],
    now: float | None = None,
) -> Iterator[Fused[int]]:
    """:func:`scored_fusion`, each result made only when asked for: a search reads the best
    few of about a hundred candidates."""
    c = _columns(candidates)
    if not len(c):
        return iter(())
    matrix = feature_matrix(c, query, ranks.get("vec", ()), now)
    score = np.zeros(len(c), dtype=np.float64)
    for j, name in enumerate(FEATURES):  # summed in this order, as a plain sum would
        score += float(weights.get(name, 0.0)) * matrix[:, j]
    position = {path: {i: r for r, i in enumerate(ids, 1)} for path, ids in ranks.items()}
    paths = list(position.values())
    far = 1 << 30
    best = [min((r for p in paths if (r := p.get(i)) is not None), default=far) for i in c.ids]
    ids = c.ids
    order = np.lexsort((np.array(ids), np.array(best), -score))
    scores = score.tolist()

    def results() -> Iterator[Fused[int]]:
        for i in order.tolist():
            turn_id = ids[i]
            yield Fused(turn_id, scores[i], {p: position[p].get(turn_id) for p in ranks})

    return results()
