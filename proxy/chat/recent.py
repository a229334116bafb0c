"""The recent chat requests as Engram forwarded them, kept in memory for the inspector: what it
sent (the assembly, labelled by zone), why each memory was there, the budget, and how long the
memory stages took. Bounded by bytes (``limits.last_prompts_bytes``), lost at restart; nothing of
it is written anywhere (the ``requests`` table keeps the durable record for feedback).

Kept on the request path at the cost of one dictionary insert: nothing is computed until a page
asks (:func:`zones`).
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from proxy.chat.prompt import Assembly
from proxy.chat.turn import MemoryTurn, Why
from proxy.costs import PromptCost

MESSAGE_BYTES = 300  # what a message dict holds besides its text
LATENCIES = 1000
"""Memory-stage times kept for the overview's p50 / p95 and sparkline."""
ZONES = ("system", "memory", "summary", "recent", "current", "sent")
"""The prompt's zones, in the order they are drawn: the ``source`` of each assembled part
(``sent``: a request forwarded as the client sent it, over budget)."""


@dataclass
class RequestView:
    """One chat request as the memory stages left it."""

    id: str
    at: float
    user: str
    session: str | None  # the session's id
    api: str | None
    model: str | None
    assembly: Assembly | None
    budget: int | None
    memory_room: int
    why: dict[int, Why]
    slot_refs: list[str]
    note: str | None
    skipped: str | None
    memory_ms: float | None
    injected: list[int]
    summary: str | None  # the rolling summary the prompt carried
    status: int | None = None
    expansions: int = 0
    cost: PromptCost | None = None  # what the model server said it computed and reused


def view_size(view: RequestView) -> int:
    """About what a view holds in memory (its messages' text, mostly)."""
    a = view.assembly
    if a is None:
        return 512
    return 4 * a.tokens + MESSAGE_BYTES * len(a.messages) + 512


class RecentRequests:
    """Request id -> :class:`RequestView`, newest last; and the recent memory-stage times."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._views: OrderedDict[str, tuple[RequestView, int]] = OrderedDict()
        self.latencies: deque[tuple[float, float]] = deque(maxlen=LATENCIES)  # (at, ms)
        self.saved: deque[tuple[float, int, int]] = deque(maxlen=LATENCIES)  # (at, sent, fwd)
        # (at, computed, reused) of the recent requests whose model server reported both
        self.costs: deque[tuple[float, int, int]] = deque(maxlen=LATENCIES)

    def add(self, request_id: str, mt: MemoryTurn) -> None:
        now = time.time()
        a = mt.assembly
        view = RequestView(
            request_id,
            now,
            mt.identity.user,
            mt.placement.session.id if mt.placement is not None else None,
            mt.api,
            mt.model,
            a,
            mt.budget,
            mt.memory_room,
            mt.why,
            list(mt.slot_refs),
            mt.memory_note,
            mt.skipped,
            mt.memory_ms,
            list(mt.injected),
            mt.summary,
        )
        self._put(request_id, view)
        if mt.memory_ms is not None:
            self.latencies.append((now, mt.memory_ms))
        if a is not None:
            self.saved.append((now, a.original_tokens, a.tokens))

    def _put(self, request_id: str, view: RequestView) -> None:
        self._pop(request_id)
        size = view_size(view)
        if size > self.max_bytes:
            return
        self._views[request_id] = (view, size)
        self.size += size
        while self.size > self.max_bytes:
            _, (_, dropped) = self._views.popitem(last=False)
            self.size -= dropped

    def _pop(self, request_id: str) -> None:
        found = self._views.pop(request_id, None)
        if found is not None:
            self.size -= found[1]

    def get(self, request_id: str) -> RequestView | None:
        found = self._views.get(request_id)
        return found[0] if found is not None else None

    def settle(self, request_id: str, status: int | None, expansions: int) -> None:
        view = self.get(request_id)
        if view is not None:
            view.status, view.expansions = status, expansions

    def reported(self, request_id: str, cost: PromptCost | None) -> None:
        """What the model server said it computed and reused of the request's prompt."""
        view = self.get(request_id)
        if view is not None:
            view.cost = cost
        if cost is not None and cost.computed is not None and cost.reused is not None:
            self.costs.append((time.time(), cost.computed, cost.reused))

    def reuse(self) -> tuple[int, int, int]:
        """Over the recent requests whose model server reported both: how many there are, and
        the prompt tokens it computed and reused for them."""
        costs = list(self.costs)
        return len(costs), sum(c for _, c, _ in costs), sum(r for _, _, r in costs)

    def of_user(self, user: str, limit: int, offset: int = 0) -> tuple[list[RequestView], int]:
        """A page of the user's recent requests, the newest first, and how many there are."""
        mine = [v for v, _ in reversed(self._views.values()) if v.user == user]
        return mine[offset : offset + limit], len(mine)

    def drop(
        self,
        user: str,
        sessions: Sequence[str] = (),
        turn: int | None = None,
        *,
        turns: Collection[int] = (),
    ) -> int:
        """Forget the views of ``sessions``, or those that showed ``turn`` (or any of
        ``turns``), or (none given) all of the user's; how many went."""
        shown = {turn, *turns} - {None}
        gone = [
            k
            for k, (v, _) in self._views.items()
            if v.user == user
            and (
                (not sessions and not shown)
                or v.session in sessions
                or (shown and not shown.isdisjoint(v.injected))
            )
        ]
        for k in gone:
            self._pop(k)
        return len(gone)

    def clear(self) -> None:
        """Forget every view (another process deleted what they showed, not saying which)."""
        self._views.clear()
        self.size = 0

    def percentiles(self) -> tuple[float | None, float | None]:
        """p50 and p95 of the recent memory-stage times (ms)."""
        ms = [m for _, m in self.latencies]
        if not ms:
            return None, None
        if len(ms) == 1:
            return ms[0], ms[0]
        cuts = statistics.quantiles(ms, n=20, method="inclusive")
        return statistics.median(ms), cuts[18]


def zones(a: Assembly, summary_tokens: int = 0) -> dict[str, int]:
    """Tokens per zone of the forwarded prompt: each message's cost as the assembler counted
    it, a message that carries the memory block (or the summary) split between that and its
    own zone. They add up to ``a.tokens``. ``summary_tokens``: the summary text's count."""
    out = dict.fromkeys(ZONES, 0)
    costs = a.costs or [0] * len(a.parts)
    for part, cost in zip(a.parts, costs, strict=False):
        labels = part.source.split("+")
        own = next((x for x in labels if x not in ("memory", "summary")), labels[-1])
        if len(labels) > 1 and "memory" in labels:
            share = min(cost, a.memory_tokens)
            out["memory"] += share
            cost -= share
        if len(labels) > 1 and "summary" in labels:
            share = min(cost, summary_tokens)
            out["summary"] += share
            cost -= share
        out[own] = out.get(own, 0) + cost
    return out
