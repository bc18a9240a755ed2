from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from prorl_client import v1
from prorl_server.jobs.event_log import EventLog
from prorl_server.jobs.phases import PhaseGate
from prorl_server.sandbox.output import cap_output


async def test_phase_gate_limits_and_grants_by_priority_then_arrival() -> None:
    gate = PhaseGate(1)
    order: list[str] = []
    release = asyncio.Event()

    async def worker(name: str, priority: int) -> None:
        async with gate.slot(priority):
            order.append(name)
            if name == "first":
                await release.wait()

    first = asyncio.create_task(worker("first", 0))
    await asyncio.sleep(0)
    others = [asyncio.create_task(worker(n, p)) for n, p in (("low", 0), ("high", 5), ("low2", 0))]
    for _ in range(5):
        await asyncio.sleep(0)
    assert gate.active == 1 and gate.queued == 3
    release.set()
    await asyncio.gather(first, *others)
    assert order == ["first", "high", "low", "low2"]
    assert gate.active == 0 and gate.queued == 0


async def test_phase_gate_cancelled_waiter_frees_nothing_it_did_not_hold() -> None:
    gate = PhaseGate(1)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot():
            await hold.wait()

    task = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(gate.slot().__aenter__())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    hold.set()
    await task
    assert gate.active == 0 and gate.queued == 0


async def test_event_log_replays_then_follows_until_closed() -> None:
    log = EventLog("j")
    log.append(queued=v1.JobQueued())
    log.append(phase_started=v1.PhaseStarted(phase=v1.PHASE_INIT))
    seen: list[int] = []

    async def follow() -> None:
        async for event in log.follow(after_seq=1):
            seen.append(event.seq)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0)
    log.append(phase_started=v1.PhaseStarted(phase=v1.PHASE_RUN))
    log.close()
    await asyncio.wait_for(task, 30)
    assert seen == [2, 3]
    assert [e.job_id for e in log.events()] == ["j"] * 3


async def test_a_follower_sees_what_came_while_it_was_suspended_in_a_yield() -> None:
    """The last events and the close landing while the reader holds the one before (a gRPC
    write pending; a job whose sandbox goes back to a reuse pool ends that fast): the
    follower must still read them and end, not wait for a change that already happened."""
    log = EventLog("j")
    log.append(queued=v1.JobQueued())
    events = log.follow()
    first = await anext(events)  # the generator is now suspended in its yield
    log.append(phase_started=v1.PhaseStarted(phase=v1.PHASE_RUN))
    log.append(finished=v1.JobFinished())
    log.close()
    rest = await asyncio.wait_for(_drain(events), 30)
    assert [first.seq, *(event.seq for event in rest)] == [1, 2, 3]


async def _drain(events: AsyncIterator[v1.RolloutEvent]) -> list[v1.RolloutEvent]:
    return [event async for event in events]


def test_cap_output_keeps_head_and_tail_and_says_so() -> None:
    text, truncated = cap_output(b"a" * 100 + b"b" * 100, 50)
    assert truncated and text.startswith("a" * 25) and text.endswith("b" * 25)
    assert "150 bytes of output truncated" in text
    assert cap_output(b"short", 50) == ("short", False)


async def test_a_durable_follower_sees_only_what_is_stored_and_ends_if_the_rest_never_will_be() -> None:
    log = EventLog("j")
    log.append(queued=v1.JobQueued())
    log.append(phase_started=v1.PhaseStarted(phase=v1.PHASE_INIT))
    seen: list[int] = []

    async def follow() -> None:
        async for event in log.follow(durable_only=True):
            seen.append(event.seq)

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0)
    assert seen == []  # nothing stored yet
    log.mark_durable(1)
    await asyncio.sleep(0)
    assert seen == [1]
    log.append(finished=v1.JobFinished())
    log.close()
    await asyncio.sleep(0)
    assert seen == [1] and not follower.done()  # closed, but seq 2 and 3 are not stored
    log.lose_durability()  # the final write failed: the follower goes on from the store
    await asyncio.wait_for(follower, 30)
    assert seen == [1]
    assert [event.seq async for event in log.follow()] == [1, 2, 3]  # a plain follower sees all
