"""Run a coroutine to its end even when the task awaiting it is cancelled.

A job's cleanup (removing sandboxes, building the result, the `finished`
event, the store write) must happen exactly once whatever else is going on:
a second Cancel, or one that lands while the job is already cleaning up,
must not cut it short, or the job would stay RUNNING and its watchers would
hang. `asyncio.shield` alone is not enough: it protects the inner work, but
the awaiting coroutine still stops at the first cancellation and never runs
the lines after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def uninterruptible(work: Coroutine[Any, Any, T]) -> T:
    """Await `work` to completion through any number of cancellations of the
    current task, then re-raise one CancelledError if there were any."""
    task = asyncio.ensure_future(work)
    cancelled = 0
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the work itself was cancelled, not us
                raise
            cancelled += 1
    if cancelled:
        current = asyncio.current_task()
        if current is not None:
            for _ in range(cancelled - 1):
                current.uncancel()
        raise asyncio.CancelledError
    return result
