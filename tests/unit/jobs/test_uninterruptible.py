"""A job's cleanup runs to its end through any number of cancellations."""

from __future__ import annotations

import asyncio

import pytest

from prorl_server.jobs.uninterruptible import uninterruptible


async def test_work_completes_through_repeated_cancels_then_the_cancel_is_raised() -> None:
    steps: list[str] = []
    release = asyncio.Event()

    async def cleanup() -> str:
        steps.append("started")
        await release.wait()
        steps.append("done")
        return "result"

    async def job() -> str:
        return await uninterruptible(cleanup())

    task = asyncio.ensure_future(job())
    await asyncio.sleep(0)
    for _ in range(3):  # a second and third Cancel while cleaning up
        task.cancel()
        await asyncio.sleep(0)
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["started", "done"]
    assert task.cancelled()


async def test_without_cancel_the_result_comes_back() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await uninterruptible(work()) == 7


async def test_the_work_cancelling_itself_propagates() -> None:
    async def work() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await uninterruptible(work())
