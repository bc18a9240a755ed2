"""The backend pool: live-load choice, stickiness, health, removal, pause/resume, caps, and slots
granted first come, first served (with each wait told to the job's wait clock)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from prorl_server.errors import LLMError
from prorl_server.llm.base import BackendInfo, ChatBackend, ChatResult, Sampling
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from tests.helpers import assert_eventually

SAMPLING = Sampling(max_tokens=8, temperature=0.0)
MESSAGES = [{"role": "user", "content": "hi"}]


class FakeBackend(ChatBackend):
    """A chat backend whose replies wait for the test to release them."""

    def __init__(self, backend_id: str, *, max_in_flight: int = 0) -> None:
        self.info = BackendInfo(id=backend_id, kind="fake", base_url="fake://", model="m", max_in_flight=max_in_flight)
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls = 0
        self.healthy = True
        self.closed = False

    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        self.calls += 1
        await self.gate.wait()
        return ChatResult(text=f"from {self.info.id}", finish_reason="stop")

    async def check_health(self) -> bool:
        return self.healthy

    async def close(self) -> None:
        self.closed = True


async def wait_for(condition: Any) -> None:
    await assert_eventually(condition, timeout_s=5)


async def test_new_trajectories_go_to_the_least_loaded_backend() -> None:
    pool = BackendRouter(health_interval_s=0)
    a, b = FakeBackend("a"), FakeBackend("b")
    pool.add(a)
    pool.add(b)
    a.gate.clear()
    held = asyncio.create_task(LLMSession("job-1", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: a.calls == 1)
    result = await LLMSession("job-2", pool).chat(MESSAGES, [], SAMPLING)
    assert result.backend_id == "b"
    a.gate.set()
    assert (await held).backend_id == "a"


async def test_later_turns_stick_to_the_same_backend() -> None:
    pool = BackendRouter(health_interval_s=0)
    a, b = FakeBackend("a"), FakeBackend("b")
    pool.add(a)
    pool.add(b)
    session = LLMSession("job", pool)
    first = await session.chat(MESSAGES, [], SAMPLING)
    other = (first.backend_id == "a" and b) or a
    other.gate.clear()  # load the other backend: stickiness must win over load anyway
    other_task = asyncio.create_task(LLMSession("busy", pool).chat(MESSAGES, [], SAMPLING))
    for _ in range(3):
        again = await session.chat(MESSAGES, [], SAMPLING)
        assert again.backend_id == first.backend_id and again.switched_from_backend == ""
    other.gate.set()
    await other_task


async def test_health_check_evicts_and_readmits() -> None:
    pool = BackendRouter(health_interval_s=0)
    a, b = FakeBackend("a"), FakeBackend("b")
    pool.add(a)
    pool.add(b)
    session = LLMSession("job", pool)
    first = await session.chat(MESSAGES, [], SAMPLING)
    sick, other = (a, b) if first.backend_id == "a" else (b, a)
    sick.healthy = False
    await pool.check_health()
    moved = await session.chat(MESSAGES, [], SAMPLING)
    assert moved.backend_id == other.info.id
    assert moved.switched_from_backend == sick.info.id  # noted in the job's events
    for i in range(3):
        assert (await LLMSession(f"new-{i}", pool).chat(MESSAGES, [], SAMPLING)).backend_id == other.info.id
    other.healthy = False
    await pool.check_health()
    with pytest.raises(LLMError, match="health check"):
        await LLMSession("none", pool).chat(MESSAGES, [], SAMPLING)
    sick.healthy = other.healthy = True
    await pool.check_health()
    assert {e.id for e in pool.entries() if e.healthy} == {"a", "b"}


async def test_removing_a_backend_mid_run_lets_its_request_finish_and_moves_the_job() -> None:
    pool = BackendRouter(health_interval_s=0)
    a, b = FakeBackend("a"), FakeBackend("b")
    pool.add(a)
    session = LLMSession("job", pool)
    a.gate.clear()
    in_flight = asyncio.create_task(session.chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: a.calls == 1)
    pool.add(b)
    await pool.remove("a")
    assert not a.closed  # closed only once its in-flight request is done
    a.gate.set()
    assert (await in_flight).backend_id == "a"
    assert a.closed
    after = await session.chat(MESSAGES, [], SAMPLING)
    assert after.backend_id == "b" and after.switched_from_backend == "a"


async def test_pause_holds_new_requests_and_resume_bumps_the_policy_version() -> None:
    pool = BackendRouter(health_interval_s=0)
    a = FakeBackend("a")
    pool.add(a)
    assert (await LLMSession("j0", pool).chat(MESSAGES, [], SAMPLING)).policy_version == 0
    pool.pause(abort_in_flight=False)
    waiting = asyncio.create_task(LLMSession("j1", pool).chat(MESSAGES, [], SAMPLING))
    await asyncio.sleep(0.05)
    assert not waiting.done() and a.calls == 1
    assert pool.resume() == 1
    assert (await waiting).policy_version == 1
    assert pool.resume(7) == 7
    with pytest.raises(Exception, match="older than the current 7"):
        pool.resume(3)


async def test_pause_with_abort_retries_in_flight_requests_after_resume() -> None:
    pool = BackendRouter(health_interval_s=0)
    a = FakeBackend("a")
    pool.add(a)
    a.gate.clear()
    request = asyncio.create_task(LLMSession("job", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: a.calls == 1)
    assert pool.pause(abort_in_flight=True) == 1
    await asyncio.sleep(0.05)
    assert not request.done() and a.calls == 1  # aborted, waiting for Resume
    a.gate.set()
    pool.resume()
    result = await request
    assert a.calls == 2 and result.policy_version == 1


async def test_cancelling_the_job_cancels_its_request() -> None:
    pool = BackendRouter(health_interval_s=0)
    a = FakeBackend("a")
    pool.add(a)
    a.gate.clear()
    request = asyncio.create_task(LLMSession("job", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: a.calls == 1)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert pool.entries()[0].in_flight == 0


async def test_per_backend_cap_queues_requests() -> None:
    pool = BackendRouter(health_interval_s=0)
    a = FakeBackend("a", max_in_flight=1)
    pool.add(a)
    a.gate.clear()
    first = asyncio.create_task(LLMSession("j1", pool).chat(MESSAGES, [], SAMPLING))
    second = asyncio.create_task(LLMSession("j2", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: a.calls == 1)
    await asyncio.sleep(0.05)
    assert a.calls == 1 and pool.entries()[0].in_flight == 1
    a.gate.set()
    await asyncio.gather(first, second)
    assert a.calls == 2


async def test_no_backend_is_a_clear_error() -> None:
    with pytest.raises(LLMError, match="AddBackend"):
        await LLMSession("job", BackendRouter(health_interval_s=0)).chat(MESSAGES, [], SAMPLING)


class DeadBackend(FakeBackend):
    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        self.calls += 1
        raise LLMError(f"backend {self.info.id} unavailable after 4 attempts: connection refused")


async def test_a_dead_backend_is_evicted_and_the_request_moves() -> None:
    pool = BackendRouter(health_interval_s=0)
    dead, alive = DeadBackend("dead"), FakeBackend("alive")
    pool.add(dead)
    session = LLMSession("job", pool)
    pool.add(alive)
    pool._sticky["job"] = "dead"  # the job's turns have been going to the backend that died
    result = await session.chat(MESSAGES, [], SAMPLING)
    assert result.backend_id == "alive" and dead.calls == 1
    assert {e.id: e.healthy for e in pool.entries()} == {"dead": False, "alive": True}
    alive_only = BackendRouter(health_interval_s=0)
    alive_only.add(DeadBackend("only"))
    with pytest.raises(LLMError, match="unavailable"):
        await LLMSession("job", alive_only).chat(MESSAGES, [], SAMPLING)


async def test_weights_share_new_trajectories_by_capacity() -> None:
    pool = BackendRouter(health_interval_s=0)
    big, small = FakeBackend("big"), FakeBackend("small")
    big.info.weight = 3.0
    pool.add(big)
    pool.add(small)
    big.gate.clear()
    small.gate.clear()
    held = [asyncio.create_task(LLMSession(f"j{i}", pool).chat(MESSAGES, [], SAMPLING)) for i in range(8)]
    await wait_for(lambda: big.calls + small.calls == 8)
    assert (big.calls, small.calls) == (6, 2)
    big.gate.set()
    small.gate.set()
    await asyncio.gather(*held)


async def test_eviction_can_wait_for_failed_checks_in_a_row() -> None:
    pool = BackendRouter(health_interval_s=0, failed_checks_to_evict=2)
    flaky = FakeBackend("flaky")
    pool.add(flaky)
    flaky.healthy = False
    await pool.check_health()
    assert (await LLMSession("one-miss", pool).chat(MESSAGES, [], SAMPLING)).backend_id == "flaky"
    flaky.healthy = True
    await pool.check_health()  # the count starts again
    flaky.healthy = False
    await pool.check_health()
    assert (await LLMSession("one-miss-again", pool).chat(MESSAGES, [], SAMPLING)).backend_id == "flaky"
    await pool.check_health()
    with pytest.raises(LLMError, match="health check"):
        await LLMSession("two-misses", pool).chat(MESSAGES, [], SAMPLING)
    flaky.healthy = True
    await pool.check_health()  # one good answer readmits
    assert (await LLMSession("back", pool).chat(MESSAGES, [], SAMPLING)).backend_id == "flaky"


class OrderedBackend(FakeBackend):
    """One slot; each reply waits for the test's step, and the order requests were served in is kept."""

    def __init__(self) -> None:
        super().__init__("one", max_in_flight=1)
        self.served: list[str] = []

    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        self.served.append(str(messages[-1]["content"]))
        await asyncio.sleep(0.01)  # the backend works a little; no test outcome depends on how long
        return ChatResult(text="ok", finish_reason="stop")


async def test_turns_of_jobs_sharing_one_slot_interleave_first_come_first_served() -> None:
    """Each job asks for its next turn the moment its last one ends (no await between them,
    the worst case): it still queues behind the jobs already waiting, so the turns go round."""
    pool = BackendRouter(health_interval_s=0)
    backend = OrderedBackend()
    pool.add(backend)

    async def job(name: str) -> None:
        session = LLMSession(name, pool)
        for turn in range(3):
            await session.chat([{"role": "user", "content": f"{name}:{turn}"}], [], SAMPLING)

    await asyncio.gather(*(job(f"j{n}") for n in range(4)))
    assert backend.served == [f"j{n}:{turn}" for turn in range(3) for n in range(4)]
    assert pool.waiting == 0 and pool.entries()[0].in_flight == 0


class Clock:
    """A wait clock that records each wait's start and end."""

    def __init__(self) -> None:
        self.waits: list[str] = []

    @contextlib.contextmanager
    def waiting_for_model(self) -> Iterator[None]:
        self.waits.append("start")
        try:
            yield
        finally:
            self.waits.append("end")


async def test_a_request_that_waits_for_a_slot_tells_its_jobs_clock_and_the_turn_says_how_long() -> None:
    pool = BackendRouter(health_interval_s=0)
    backend = FakeBackend("one", max_in_flight=1)
    pool.add(backend)
    clocks = {"first": Clock(), "second": Clock()}
    pool.wait_clocks.update(clocks)
    backend.gate.clear()
    first = asyncio.create_task(LLMSession("first", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: backend.calls == 1)
    second = asyncio.create_task(LLMSession("second", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: pool.waiting == 1)
    assert clocks["second"].waits == ["start"]  # waiting now: its job's budget is stopped
    await asyncio.sleep(0.1)  # a wait of at least this long, whatever the machine
    backend.gate.set()
    results = await asyncio.gather(first, second)
    assert clocks["first"].waits == [] and clocks["second"].waits == ["start", "end"]
    assert results[0].model_wait_s < results[1].model_wait_s and results[1].model_wait_s >= 0.1
    pool.forget("second")
    assert "second" not in pool.wait_clocks


async def test_a_request_cancelled_while_it_waits_leaves_the_queue_and_the_slot_goes_on() -> None:
    pool = BackendRouter(health_interval_s=0)
    backend = FakeBackend("one", max_in_flight=1)
    pool.add(backend)
    backend.gate.clear()
    first = asyncio.create_task(LLMSession("first", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: backend.calls == 1)
    gone = asyncio.create_task(LLMSession("gone", pool).chat(MESSAGES, [], SAMPLING))
    third = asyncio.create_task(LLMSession("third", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: pool.waiting == 2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert pool.waiting == 1
    backend.gate.set()
    await asyncio.gather(first, third)
    assert backend.calls == 2 and pool.entries()[0].in_flight == 0


async def test_a_queued_request_learns_when_its_last_backend_fails() -> None:
    pool = BackendRouter(health_interval_s=0)
    backend = FakeBackend("one", max_in_flight=1)
    pool.add(backend)
    backend.gate.clear()
    first = asyncio.create_task(LLMSession("first", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: backend.calls == 1)
    queued = asyncio.create_task(LLMSession("queued", pool).chat(MESSAGES, [], SAMPLING))
    await wait_for(lambda: pool.waiting == 1)
    backend.healthy = False
    await pool.check_health()
    with pytest.raises(LLMError, match="health check"):
        await queued
    backend.gate.set()
    await first
