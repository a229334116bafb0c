"""Hybrid search over one user's memory: FTS5 BM25 and vector KNN, fused by RRF, MMR optional.

Both paths run concurrently (the query embedding runs on the embedder's query lane, the SQL on
the store's readers). With a ``deadline`` (the chat pipeline's ``limits.recall_deadline``) a
vector path not done by then is dropped (the search goes on with FTS5 alone and says
``"fts-only"``), and an FTS5 path not done by then ends the search with :class:`RecallTimeout`.
The same code serves the chat pipeline, the admin API, the CLI and the benchmarks, so what is
measured is what runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.config import RetrievalSettings
from proxy.search.embedder import Embedder
from proxy.search.fts_query import STOP_WORDS, match_of, query_words
from proxy.search.fusion import Fused, mmr, rrf
from proxy.search.scoring import Candidate, Columns, scored_order
from proxy.store.models import Turn, index_text
from proxy.store.rows import CONTENT_COLUMN, turn_of
from proxy.store.store import Store
from proxy.vectors import Vector, as_vector

MODES = ("hybrid", "fts", "vec")
FTS_ONLY = "fts-only"


class RecallTimeout(TimeoutError):
    """The full-text path was not done by the search's deadline."""


COMMON_WORDS_ABOVE = 500
"""``[retrieval] fts_common_share`` applies once the user holds more turns than this (their own:
another user's archive never takes a word out of this user's queries); in fewer, a share says
little (two turns of five are 40 %). It was 20,000 until FTS5's scoring of the rows that common
words match showed up as the largest cost of a search after the query's embedding (~4,000 of
10,000 rows matched by a speaker's name: 6.8 ms of CPU a search). On LoCoMo (speaker names in
every row, users of 369-689 turns) leaving them out changed hybrid R@5 / R@10 from 0.723 / 0.804
to 0.727 / 0.805, and the prompt replay (names seldom in the text) not at all (0.745)."""


@dataclass(frozen=True)
class Scoring:
    """What one scored fusion ranked: the candidates and each path's ids, best first."""

    candidates: list[Candidate]
    rankings: dict[str, list[int]]


@dataclass(frozen=True)
class Hit:
    """One search result: the turn, its fused score and its 1-based rank in each path;
    ``cosine``: its vector's cosine to the query's (None when unknown), what the relevance
    gate (:mod:`proxy.search.relevance`) reads beside the ranks, since fused scores are relative."""

    turn: Turn
    score: float
    ranks: dict[str, int | None]
    cosine: float | None = None


class Retriever:
    """Hybrid retrieval with the settings of ``[retrieval]``."""

    def __init__(
        self, store: Store, embedder: Embedder | None, settings: RetrievalSettings
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.settings = settings
        self._empty: Vector | None = None  # an empty user's turn's vector (baselines)

    async def search(
        self,
        user_id: str,
        query: str,
        k: int,
        *,
        mode: str = "hybrid",
        session_ids: Sequence[str] | None = None,
        exclude_sessions: Sequence[str] = (),
        exclude_roles: Sequence[str] = (),
        keep: Callable[[Turn], bool] | None = None,
        use_mmr: bool | None = None,
        query_vector: Awaitable[Vector] | None = None,
        deadline: float | None = None,
        degraded: list[str] | None = None,
        scoring: list[Scoring] | None = None,
        distinct: bool = False,
    ) -> list[Hit]:
        """The ``k`` best turns of ``user_id`` for ``query``. ``exclude_sessions`` and turns of
        ``exclude_roles`` are left out inside the searches (they take no candidate places);
        ``keep`` filters candidates (e.g. turns already in the request) before the cut to
        ``k``. ``query_vector``: the query's embedding, already on its way (see
        :meth:`embed_query`). ``deadline`` (event loop time): a vector path not done by then is
        dropped, and :data:`FTS_ONLY` appended to ``degraded``; an FTS5 path not done by then
        raises :class:`RecallTimeout`. ``scoring``: where scored fusion runs, what it scored is
        appended there (the fusion tuner, bench/tune_fusion.py, fits the weights on it).
        ``distinct``: a turn whose text (case and spacing aside) a better one has takes no
        place (a model that answers alike every time would fill a top 20 with one reply)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if k <= 0 or not query.strip():
            return []
        s = self.settings
        n = max(s.candidates, k)
        skip, roles = list(exclude_sessions), list(exclude_roles)
        want_fts = mode in ("hybrid", "fts")
        want_vec = mode in ("hybrid", "vec") and self.embedder is not None
        words = (
            query_words(query, stop_words=STOP_WORDS if s.stop_words else None) if want_fts else []
        )

        # Each path reads its candidates' rows in its own reader job; the vector path skips
        # those the full-text path has read by then.
        rows: dict[int, tuple[Any, ...]] = {}
        share = s.fts_common_share
        counted = words if len(words) >= 2 and share < 1.0 else []

        async def fts() -> list[tuple[int, float]]:
            ranked, found = await self.store.fts_candidates(
                user_id,
                counted,
                lambda shares: match_of(uncommon(words, shares, share)),
                n,
                min_turns=COMMON_WORDS_ABOVE + 1,
                above=share,
                session_ids=session_ids,
                exclude_sessions=skip,
                exclude_roles=roles,
            )
            rows.update(found)
            return ranked

        qvec: Vector | None = None

        async def vec() -> list[tuple[int, float]]:
            nonlocal qvec
            if not want_vec or self.embedder is None:
                return []
            if query_vector is not None:
                qvec = await query_vector
            else:
                qvec = (await self.embedder.embed_queries([vector_text(query)]))[0]
            ranked, found = await self.store.vec_candidates(
                user_id,
                qvec,
                n,
                known=rows,
                session_ids=session_ids,
                exclude_sessions=skip,
                exclude_roles=roles,
            )
            rows.update(found)
            return ranked

        if deadline is None:
            fts_rows, vec_rows = await asyncio.gather(fts(), vec())
        else:
            fts_rows, vec_rows = await _by_deadline(fts(), vec(), deadline, degraded)
        rankings: dict[str, list[int]] = {}
        if want_fts:
            rankings["fts"] = [turn_id for turn_id, _ in fts_rows]
        if want_vec:
            rankings["vec"] = [turn_id for turn_id, _ in vec_rows]
        ids = list(dict.fromkeys(i for ranked in rankings.values() for i in ranked))
        if not ids:
            return []
        # Raw rows, no Turn each: the fusion reads five fields of every candidate, and only
        # the few results kept (and those ``keep`` is asked about) become Turns.
        made: dict[int, Turn] = {}

        def turn(turn_id: int) -> Turn:
            t = made.get(turn_id)
            if t is None:
                t = made[turn_id] = turn_of(rows[turn_id])
            return t

        fused: Iterable[Fused[int]]
        cosines: dict[int, float | None] = {i: 1.0 - d for i, d in vec_rows}
        if mode == "hybrid" and s.fusion == "scored":
            found = [i for i in ids if i in rows]  # in the order of the paths, as get_turns
            columns = await self._candidates(user_id, found, rows, fts_rows, vec_rows, qvec)
            cosines = dict(zip(columns.ids, columns.cosine, strict=True))
            if scoring is not None:
                scoring.append(Scoring(columns.candidates(), rankings))
            fused = scored_order(columns, query, rankings, s.score_weights(), time.time())
        else:
            fused = rrf(rankings, k=s.rrf_k, weights={"fts": s.fts_weight, "vec": s.vec_weight})
        use = (s.mmr if use_mmr is None else use_mmr) and qvec is not None
        # ``keep`` hashes each turn's text: asked only until as many are kept as are used
        # (``k``, or MMR's pool)
        want, kept = (max(k * 4, 20) if use else k), []
        texts: set[str] = set()
        for f in fused:
            if f.id in rows and (keep is None or keep(turn(f.id))):
                if distinct:
                    text = " ".join(str(rows[f.id][CONTENT_COLUMN]).lower().split())
                    if text in texts:
                        continue
                    texts.add(text)
                kept.append(f)
                if len(kept) >= want:
                    break
        if use and qvec is not None and len(kept) > 1:
            kept = await self._mmr(user_id, kept, qvec, k)
        return [Hit(turn(f.id), f.score, f.ranks, cosines.get(f.id)) for f in kept[:k]]

    async def _candidates(
        self,
        user_id: str,
        ids: list[int],
        rows: dict[int, tuple[Any, ...]],
        fts_rows: list[tuple[int, float]],
        vec_rows: list[tuple[int, float]],
        qvec: Vector | None,
    ) -> Columns:
        """Both paths' candidates (``ids``, their ``rows`` of ``TURN_COLS``) for
        :func:`~proxy.search.scoring.scored_fusion`; the cosines of FTS5-only candidates are
        computed from their stored vectors."""
        cosine = {turn_id: 1.0 - distance for turn_id, distance in vec_rows}
        missing = [i for i in ids if i not in cosine]
        if qvec is not None and missing:
            q = as_vector(qvec)
            for turn_id, v in (await self.store.turn_vectors(user_id, missing)).items():
                cosine[turn_id] = float(np.dot(v, q))  # both L2-normalised
        bm25 = dict(fts_rows)
        picked = [rows[i] for i in ids]
        texts = [r[CONTENT_COLUMN] for r in picked]
        return Columns(
            ids,
            [r[1] for r in picked],
            [r[3] for r in picked],
            [r[5] for r in picked],
            [len(t) for t in texts],
            [bm25.get(i) for i in ids],
            [cosine.get(i) for i in ids],
            texts,
            [r[9] for r in picked],
        )

    def embed_query(self, query: str) -> asyncio.Task[Vector] | None:
        """Start embedding ``query`` now (the embedder works on its own thread while the
        caller does other things); pass the task to :meth:`search` as ``query_vector``."""
        embedder = self.embedder
        if embedder is None or not query.strip():
            return None

        async def embed() -> Vector:
            return (await embedder.embed_queries([vector_text(query)]))[0]

        return asyncio.create_task(embed(), name="embed-query")

    async def baselines(self, hits: Sequence[Hit], query_vector: Vector) -> list[float | None]:
        """Each hit's baseline for the relevance gate's ``min_lift``: the query's cosine to an
        empty turn (:func:`baseline_text`) where the hit's text starts as the query's does
        (``"user: "``: a chat's user), None for any other (a named speaker's start is not the
        query's, and the query may name the speaker: on LoCoMo "What did Caroline…" is close to
        an empty "Caroline: " turn, and a lift over it cost half the evidence). One short text,
        embedded once."""
        start = vector_text("")
        if self.embedder is None or not any(self._starts(h, start) for h in hits):
            return [None] * len(hits)
        if self._empty is None:
            self._empty = as_vector((await self.embedder.embed_passages([start]))[0])
        base = float(np.dot(self._empty, as_vector(query_vector)))
        return [base if self._starts(h, start) else None for h in hits]

    @staticmethod
    def _starts(hit: Hit, start: str) -> bool:
        return baseline_text(hit.turn.role, hit.turn.speaker) == start

    async def _uncommon(self, user_id: str, words: list[str]) -> list[str]:
        """``words`` without those the user's turns hold too often to be worth searching for
        (``fts_common_share`` of the user's turns, counted in the user's rows); when every word
        is that common, the rarest one. Only once the user holds more than
        ``COMMON_WORDS_ABOVE`` turns: below, FTS5 is fast anyway, and in a small archive the
        words every turn holds (the speakers' names) still order the matches."""
        share = self.settings.fts_common_share
        if len(words) < 2 or share >= 1.0:
            return words
        shares = await self.store.fts_word_shares(
            user_id, words, min_turns=COMMON_WORDS_ABOVE + 1, above=share
        )
        return uncommon(words, shares, share)

    async def _mmr(
        self, user_id: str, fused: list[Fused[int]], qvec: Vector, k: int
    ) -> list[Fused[int]]:
        pool = fused[: max(k * 4, 20)]
        vectors = await self.store.turn_vectors(user_id, [f.id for f in pool])
        # Fused scores have no fixed scale (RRF's are tiny, 1/(k + rank); scored fusion's
        # bunch up near the top): stretch the pool's to [0, 1] so relevance and similarity
        # weigh on the same scale.
        top = max(f.score for f in pool)
        low = min(f.score for f in pool)
        span = (top - low) or 1.0
        relevance = {f.id: (f.score - low) / span for f in pool}
        order = mmr(
            [f.id for f in pool if f.id in vectors],
            qvec,
            vectors,
            lam=self.settings.mmr_lambda,
            top_k=k,
            relevance=relevance,
        )
        by_id = {f.id: f for f in pool}
        return [by_id[i] for i in order]


def vector_text(query: str) -> str:
    """What a query's vector is computed from: the query as a user's turn is embedded
    (``"user: <words>"``, :func:`~proxy.store.models.index_text`). A new chat message's query
    is then the very text its turn is archived with, so the archive reuses the query's vector
    (a symmetric embedder's cache); and on LoCoMo the vector path finds more with it (R@10 0.430
    bare, 0.462 so; hybrid 0.811 and 0.812)."""
    return index_text("user", None, query)


def baseline_text(role: str, speaker: str | None) -> str:
    """An empty turn of a speaker as a turn's vector is made from (:func:`index_text`): what a
    turn's cosine to a query owes to its ``"<speaker>: "`` start alone."""
    return index_text(role, speaker, "")


def uncommon(words: list[str], shares: dict[str, float], share: float) -> list[str]:
    """``words`` less those of more than ``share`` of the user's turns (``shares``, as
    :meth:`~proxy.store.store.Store.fts_word_shares` gives them); when every word is that
    common, the rarest one. Fewer than two words, or ``share`` 1: ``words``."""
    if len(words) < 2 or share >= 1.0:
        return words
    kept = [w for w in words if shares.get(w, 0.0) <= share]
    return kept or [min(words, key=lambda w: shares.get(w, 0.0))]


async def _by_deadline(
    fts: Coroutine[Any, Any, list[tuple[int, float]]],
    vec: Coroutine[Any, Any, list[tuple[int, float]]],
    deadline: float,
    degraded: list[str] | None,
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Both paths' candidates, as far as they got by ``deadline`` (see :meth:`Retriever.search`)."""
    fts_task = asyncio.ensure_future(fts)
    vec_task = asyncio.ensure_future(vec)
    try:
        left = deadline - asyncio.get_running_loop().time()
        await asyncio.wait((fts_task, vec_task), timeout=max(0.0, left))
    finally:
        late = [t for t in (fts_task, vec_task) if not t.done()]
        for task in late:
            task.cancel()
        if late:  # let them unwind (a cancelled read still ends on its thread)
            await asyncio.wait(late)
        # an outage fails both paths: each failure is retrieved (full text's is raised first),
        # none left to asyncio's "Task exception was never retrieved" (gather does the same)
        for task in (fts_task, vec_task):
            if task.done() and not task.cancelled():
                task.exception()
    if fts_task.cancelled():
        raise RecallTimeout("full-text search was not done by the recall deadline")
    fts_ids = fts_task.result()
    if vec_task.cancelled():
        if degraded is not None:
            degraded.append(FTS_ONLY)
        return fts_ids, []
    return fts_ids, vec_task.result()
