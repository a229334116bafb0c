"""Background work: tracked tasks (each kept, its failure logged, all drained on shutdown), and
the one helper every periodic loop runs through (:func:`every`, stopped with :func:`stop`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger("engram.tasks")


class BackgroundTasks:
    """A set of running tasks that outlive the request that started them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed = 0
        self.completed = 0

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failed += 1
            log.error("background task %s failed", task.get_name(), exc_info=exc)
        else:
            self.completed += 1

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float) -> None:
        """Wait for running tasks (and any they start) up to ``timeout``; cancel the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._tasks:
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.wait(set(self._tasks), timeout=left)
        if self._tasks:
            log.warning(
                "cancelling %d background tasks still running at shutdown", len(self._tasks)
            )
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


def every(interval: float, job: Callable[[], Awaitable[object]], what: str) -> asyncio.Task[None]:
    """Start ``job()`` every ``interval`` seconds, forever, as a task; a failure is logged
    (with ``what``) and the loop goes on. Stop it with :func:`stop`."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except Exception:
                log.exception("%s failed; trying again in %g s", what, interval)

    return asyncio.get_running_loop().create_task(loop(), name=what)


async def stop(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task and wait for it to end; whatever it raised on the way is logged, never
    raised (shutdown goes on)."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s had failed", task.get_name(), exc_info=task.exception())
