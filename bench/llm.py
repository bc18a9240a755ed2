"""LLM layer benchmark: backend utilisation under the router, and the router's own cost.

Measured in one run:
- two fake backends of fixed latency (the scripted OpenAI-chat server, each in
  its own process, over real HTTP, 4 slots each via max_in_flight) driven by 1,
  4, 16 and 64 concurrent trajectories of sequential turns. Utilisation =
  busy slot-time / (wall time x slots), where busy is the time the backend
  spent serving (requests x latency); occupancy counts the HTTP round trip too
  (the time the router had the slot leased);
- the embedded model (llama.cpp in process, one slot) at the same concurrencies;
- the router's overhead per request: a lease (choose, count, release) around an
  instant backend, against calling that backend directly.

Usage: python bench/llm.py   (make bench-llm)
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prorl_server.llm.base import BackendInfo, ChatBackend, ChatResult, Sampling
from prorl_server.llm.llama_cpp_backend import LlamaCppBackend
from prorl_server.llm.openai_chat import OpenAIChatBackend
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from prorl_server.logging import configure_logging

CONCURRENCY = (1, 4, 16, 64)
LATENCY_S = 0.05
SLOTS_PER_BACKEND = 4
TURNS = 4


async def drive(pool: BackendRouter, concurrency: int, turns: int, sampling: Sampling) -> float:
    """`concurrency` trajectories of `turns` sequential turns each; returns wall time."""

    async def trajectory(index: int) -> None:
        session = LLMSession(f"t{index}", pool)
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Count to {index}."}]
        for _ in range(turns):
            result = await session.chat(messages, [], sampling)
            messages += [{"role": "assistant", "content": result.text}, {"role": "user", "content": "Go on."}]

    started = time.perf_counter()
    await asyncio.gather(*(trajectory(i) for i in range(concurrency)))
    return time.perf_counter() - started


class OccupancyMeter:
    """Sums the time slots are leased, by wrapping each backend's chat."""

    def __init__(self) -> None:
        self.leased_s = 0.0
        self.requests = 0

    def wrap(self, backend: OpenAIChatBackend) -> None:
        original = backend.chat

        async def chat(*args: Any) -> ChatResult:
            started = time.perf_counter()
            try:
                return await original(*args)
            finally:
                self.leased_s += time.perf_counter() - started
                self.requests += 1

        backend.chat = chat  # type: ignore[method-assign]


async def fake_backends() -> None:
    processes, urls = [], []
    for _ in range(2):
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).with_name("fake_backend_server.py")), str(LATENCY_S),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None
        urls.append((await process.stdout.readline()).decode().strip())
        processes.append(process)
    slots = SLOTS_PER_BACKEND * len(urls)
    print(
        f"## fake backends: 2 x {SLOTS_PER_BACKEND} slots, {LATENCY_S * 1e3:.0f} ms per request,"
        " HTTP to other processes"
    )
    print("concurrency  requests   wall s  utilisation  occupancy")
    for concurrency in CONCURRENCY:
        pool = BackendRouter(health_interval_s=0)
        meter = OccupancyMeter()
        for index, url in enumerate(urls):
            backend = OpenAIChatBackend(
                BackendInfo(f"fake-{index}", "openai_chat", url, "m", SLOTS_PER_BACKEND), max_retries=0
            )
            meter.wrap(backend)
            pool.add(backend)
        turns = TURNS * max(1, 64 // concurrency)  # 256 requests per level
        wall = await drive(pool, concurrency, turns, Sampling(max_tokens=4, temperature=0))
        utilisation = meter.requests * LATENCY_S / (wall * slots)
        occupancy = meter.leased_s / (wall * slots)
        print(f"{concurrency:11d}  {meter.requests:8d}  {wall:7.2f}  {utilisation:10.1%}  {occupancy:9.1%}")
        await pool.close()
    for process in processes:
        assert process.stdin is not None
        process.stdin.close()
        await process.wait()


async def embedded_backend() -> None:
    backend = LlamaCppBackend(
        BackendInfo("embedded", "embedded", "in-process", "smollm2", 1),
        model_path=None,
        context_length=4096,
        threads=2,
    )
    await backend.start()
    busy = 0.0
    original = backend.generate

    async def timed(prompt_ids: Sequence[int], sampling: Sampling) -> Any:
        nonlocal busy
        generation = await original(prompt_ids, sampling)
        busy += generation.latency_s
        return generation

    backend.generate = timed  # type: ignore[method-assign]
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend, managed=True)
    print("\n## embedded model (SmolLM2-135M, llama.cpp in process, 1 slot), 8 new tokens per turn")
    print("concurrency  requests   wall s  utilisation")
    for concurrency in CONCURRENCY:
        busy = 0.0
        turns = 2 if concurrency < 64 else 1
        wall = await drive(pool, concurrency, turns, Sampling(max_tokens=8, temperature=0.7, seed=1))
        print(f"{concurrency:11d}  {concurrency * turns:8d}  {wall:7.2f}  {busy / wall:10.1%}")
    await pool.close()


class InstantBackend(ChatBackend):
    def __init__(self) -> None:
        self.info = BackendInfo("instant", "fake", "none", "m")
        self.result = ChatResult(text="", finish_reason="stop")

    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        return self.result

    async def check_health(self) -> bool:
        return True

    async def close(self) -> None:
        return None


async def router_overhead(requests: int = 20_000) -> None:
    backend = InstantBackend()
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend)
    for index in range(7):  # a realistic pool
        other = InstantBackend()
        other.info = BackendInfo(f"other-{index}", "fake", "none", "m")
        pool.add(other)
    sampling = Sampling(max_tokens=1, temperature=0)
    messages = [{"role": "user", "content": "x"}]
    started = time.perf_counter()
    for _ in range(requests):
        await backend.chat(messages, [], sampling)
    direct = (time.perf_counter() - started) / requests
    session = LLMSession("job", pool)
    started = time.perf_counter()
    for _ in range(requests):
        await session.chat(messages, [], sampling)
    routed = (time.perf_counter() - started) / requests
    started = time.perf_counter()
    for index in range(requests):
        async with pool.lease(f"job-{index % 256}"):
            pass
    lease = (time.perf_counter() - started) / requests
    print("\n## router overhead per request (8 backends)")
    print(f"lease alone (choose, count, release): {lease * 1e6:7.1f} us")
    print(f"session.chat via the router: {routed * 1e6:7.1f} us   direct backend call: {direct * 1e6:7.1f} us")
    print(f"overhead (routed - direct): {(routed - direct) * 1e6:7.1f} us = {(routed - direct) * 1e3:.3f} ms")
    await pool.close()


async def main() -> None:
    print(f"# LLM layer benchmark, {os.cpu_count()} cores\n")
    await fake_backends()
    await embedded_backend()
    await router_overhead()


if __name__ == "__main__":
    configure_logging(level="warning")
    asyncio.run(main())
