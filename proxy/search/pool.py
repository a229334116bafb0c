"""Several model sessions of one embedder used as one, for bulk work (``engram import``).

On a 2-core machine two sessions of one ONNX thread each, embedding different texts at once,
outrun one session of two threads by about a third (small matrices keep a session's two threads
waiting on each other; measured by ``python -m bench.reindex``). :class:`EmbedderPool` splits a
call's texts between its members, shortest first dealt round the members so each gets a like
share of the work and its batches pad little, and puts the vectors back in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from proxy.search.embedder import Embedder
from proxy.vectors import Vector


class EmbedderPool:
    """An :class:`~proxy.search.embedder.Embedder` over ``members`` (the same model each)."""

    def __init__(self, members: Sequence[Embedder]) -> None:
        if not members:
            raise ValueError("a pool needs at least one embedder")
        first = members[0]
        if any((m.name, m.dim) != (first.name, first.dim) for m in members):
            raise ValueError("every member of a pool must be of the same model")
        self.members = list(members)

    @property
    def name(self) -> str:
        return self.members[0].name

    @property
    def dim(self) -> int:
        return self.members[0].dim

    async def load(self) -> None:
        for member in self.members:
            await member.load()

    async def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        return await self.members[0].embed_queries(texts)

    async def embed_passages(self, texts: Sequence[str]) -> list[Vector]:
        n = len(self.members)
        if n == 1 or len(texts) < 2:
            return await self.members[0].embed_passages(texts)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        shares = [order[k::n] for k in range(n)]
        parts = await asyncio.gather(
            *(
                member.embed_passages([texts[i] for i in share])
                for member, share in zip(self.members, shares, strict=True)
                if share
            )
        )
        out: list[Vector | None] = [None] * len(texts)
        for share, vectors in zip((s for s in shares if s), parts, strict=True):
            for i, vec in zip(share, vectors, strict=True):
                out[i] = vec
        done = [v for v in out if v is not None]
        if len(done) != len(texts):
            raise RuntimeError("an embedder of the pool returned fewer vectors than texts")
        return done

    async def aclose(self) -> None:
        for member in self.members:
            await member.aclose()
