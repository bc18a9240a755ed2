"""Real vLLM under the router: prefix-cache reuse with sticky routing, and prorl's overhead.

Two vLLM servers (CPU build, SmolLM2-135M, tests/vllm.py) as `vllm` token backends.
Measured in one run, side by side:
- prefix-cache hit rate (vLLM's /metrics: prefix_cache_hits / prefix_cache_queries, in
  tokens, summed over both servers) for the same multi-turn conversations routed
  sticky (the router: a job's turns go to its backend) and per-turn least-loaded (the
  job's stickiness dropped before each turn);
- turns/s through prorl's session and router (exact-token prompts, TokenConversation)
  against posting the very same prompts to vLLM directly, at the same concurrency:
  prorl's overhead as a ratio.

Usage: python bench/vllm_prefix.py   (make bench-vllm; needs make setup-vllm)
PRORL_BENCH_VLLM_PORTS=P1,P2 uses two vLLM servers already serving on 127.0.0.1 (started
with tests/vllm.py's flags and environment) instead of starting two, and leaves them running.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from prorl_server.logging import configure_logging
from tests.vllm import MODEL, SERVED_NAME, VLLMServer, missing

JOBS = 8
TURNS = 4
MAX_TOKENS = 16
OVERHEAD_PAIRS = 2
# Long enough that a job's prefix fills whole KV blocks (vLLM's CPU block is 128 tokens).
CONTEXT = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(60))


Replay = dict[int, list[tuple[str, list[int]]]]
"""Per job, each turn's (backend id, prompt ids) in order."""


async def conversations(router: BackendRouter, *, sticky: bool, replay: Replay | None = None) -> float:
    """JOBS conversations of TURNS turns at once; returns wall seconds. Records each turn's prompt."""
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, model=SERVED_NAME)

    async def job(index: int) -> None:
        session = LLMSession(f"job-{index}-{sticky}", router)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"Conversation {index}. {CONTEXT}"},
            {"role": "user", "content": f"Is {index} even?"},
        ]
        backends = []
        for turn in range(TURNS):
            if not sticky:
                router.forget(session.job_id)  # every turn chooses the least-loaded backend afresh
            result = await session.chat(messages, [], sampling)
            backends.append(result.backend_id)
            messages += [{"role": "assistant", "content": result.text}, {"role": "user", "content": f"And {turn}?"}]
        if replay is not None:
            ids, _, _ = session.token_trajectory()
            replay[index] = [
                (backend, ids[:start]) for backend, (start, _) in zip(backends, session.turn_spans(), strict=True)
            ]

    started = time.perf_counter()
    await asyncio.gather(*(job(i) for i in range(JOBS)))
    return time.perf_counter() - started


async def cache_counters(servers: list[VLLMServer]) -> tuple[float, float]:
    hits = queries = 0.0
    for server in servers:
        metrics = await server.metrics()
        hits += metrics.get("vllm:prefix_cache_hits_total", 0.0)
        queries += metrics.get("vllm:prefix_cache_queries_total", 0.0)
    return hits, queries


async def reset_caches(servers: list[VLLMServer]) -> None:
    for server in servers:
        await server.post("/reset_prefix_cache")


async def direct(servers: list[VLLMServer], replay: Replay) -> float:
    """The same prompts posted straight to vLLM: each job's turns in order, on the server
    that served them, JOBS jobs at once."""
    urls = {f"vllm-{i}": server.base_url for i, server in enumerate(servers)}

    async def job(turns: list[tuple[str, list[int]]], session: aiohttp.ClientSession) -> None:
        for backend, prompt in turns:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}  # fmt: skip
            async with session.post(f"{urls[backend]}/completions", json=body) as response:
                response.raise_for_status()
                await response.read()

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(job(turns, session) for turns in replay.values()))
    return time.perf_counter() - started


def router_for(servers: list[VLLMServer]) -> BackendRouter:
    router = BackendRouter(health_interval_s=0)
    for index, server in enumerate(servers):
        settings = BackendSettings(
            id=f"vllm-{index}", kind="vllm", base_url=server.base_url, model=SERVED_NAME, tokenizer_path=str(MODEL)
        )
        router.add(build_backend(settings, timeout_s=600, max_retries=0))
    return router


async def main() -> None:
    if why := missing():
        raise SystemExit(why)
    attached = [int(port) for port in os.environ.get("PRORL_BENCH_VLLM_PORTS", "").split(",") if port]
    servers = [VLLMServer(port=port) for port in attached] if attached else [VLLMServer(), VLLMServer()]
    if len(servers) != 2:
        raise SystemExit("PRORL_BENCH_VLLM_PORTS names two ports")
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-"))  # the servers' logs, kept only if the run fails
    failed = True
    try:
        if not attached:
            await asyncio.gather(*(s.start(logs / f"vllm-{i}.log") for i, s in enumerate(servers)))
        started = "already running" if attached else f"started in {', '.join(f'{s.started_s:.0f}' for s in servers)} s"
        print(f"# real vLLM under the router: 2 servers ({started})")
        print(f"{JOBS} conversations x {TURNS} turns at once, {MAX_TOKENS} new tokens per turn, greedy\n")
        warm_up = router_for(servers)
        await conversations(warm_up, sticky=True)  # compiled paths, allocator
        await warm_up.close()
        print("routing              prefix-cache hits / queries (tokens)   hit rate   wall s")
        for sticky in (True, False):
            await reset_caches(servers)
            router = router_for(servers)
            before = await cache_counters(servers)
            wall = await conversations(router, sticky=sticky)
            after = await cache_counters(servers)
            hits, queries = after[0] - before[0], after[1] - before[1]
            name = "sticky (prorl)" if sticky else "per-turn least-loaded"
            print(f"{name:22s} {hits:14.0f} / {queries:<14.0f}           {hits / max(queries, 1):7.1%}  {wall:7.2f}")
            await router.close()
        # Overhead: the pair (through prorl, then the same prompts straight to vLLM) twice, so an order
        # effect or a burst of load on the shared machine shows as two ratios that disagree.
        ratios = []
        for _ in range(OVERHEAD_PAIRS):
            replay: Replay = {}
            router = router_for(servers)
            await reset_caches(servers)
            through = await conversations(router, sticky=True, replay=replay)
            await router.close()
            await reset_caches(servers)
            straight = await direct(servers, replay)
            turns = sum(len(t) for t in replay.values())
            ratios.append(through / straight)
            print(f"\nturns/s through prorl (session, router, exact-token ids): {turns / through:6.2f} ({turns} turns)")
            print(f"turns/s posting the same prompts to vLLM directly:        {turns / straight:6.2f}")
            print(f"prorl's overhead: {through / straight:.3f}x the direct time")
        print(f"\nprorl's overhead over {OVERHEAD_PAIRS} pairs: {', '.join(f'{r:.3f}x' for r in ratios)}")
        failed = False
    finally:
        if not attached:
            await asyncio.gather(*(s.stop() for s in servers))
        if failed:
            print(f"vLLM logs: {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    configure_logging(level="warning")
    asyncio.run(main())
