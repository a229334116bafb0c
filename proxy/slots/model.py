"""The :class:`Slot`: one stored tool output, as every slot module sees it (pure, no imports).

:mod:`proxy.slots.refs` makes slot ids, :mod:`proxy.slots.expand` reads slots back into
prompts, and both backends (:mod:`proxy.slots.redis`, :mod:`proxy.slots.embedded`) store them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One stored tool output. ``id`` is deterministic (see :mod:`proxy.slots.refs`)."""

    id: str
    tool: str
    content: str
    tokens: int
    description: str
