"""What a running server does after a correction (:mod:`proxy.api.actions`): the in-memory views
of what was forgotten go at once (recent requests, last prompts, pinned turns), and the Redis
copies of its slots and the scrub that makes the bytes leave the file follow in the background
(drained at shutdown)."""

from __future__ import annotations

from proxy.api.actions import Done
from proxy.services import Services


def after(services: Services, done: Done) -> None:
    parts = services.parts
    if parts is None:
        return
    memory = parts.memory
    for sid in done.sessions:
        memory.last_requests.pop(sid)
    if done.everything:
        memory.recent.drop(done.user)
    elif done.sessions or done.turn is not None:
        memory.recent.drop(done.user, done.sessions, done.turn)
    if done.pins_changed:
        memory.recall.forget_pinned(done.user)
    slots, store = parts.slots, parts.store

    async def afterwards() -> None:
        if slots is not None and done.everything:
            await slots.forget_user(done.user)
        elif slots is not None and done.slot_ids:
            await slots.forget_slots(done.user, done.sessions, done.slot_ids)
        if done.scrub:
            await store.scrubber.scrub()

    if done.scrub or done.slot_ids or done.everything:
        services.tasks.spawn(afterwards(), name="forget-scrub")
