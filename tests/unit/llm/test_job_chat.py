"""The per-job adapter (any backend -> one chat turn, the job's token trajectory) and the
session on top of it, which only routes: lease, retry after Pause, fail-over, stamps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prorl_server.errors import LLMError
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import ChatResult, Generation, LLMBackend, Sampling, TokenBackend
from prorl_server.llm.chat_template import ChatTokenizer
from prorl_server.llm.factory import build_backend
from prorl_server.llm.job_chat import JobChat
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from tests.fakes.scripted_llm import ScriptedChatBackend
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.helpers import assert_eventually

SAMPLING = Sampling(max_tokens=64, temperature=0.7, seed=3)
FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_tiny_tokenizer(tmp_path / "tok")


@pytest_asyncio.fixture
async def vllm(folder: Path) -> AsyncIterator[FakeVLLM]:
    server = FakeVLLM(folder, lambda prompt: f"reply {len(prompt)}")
    await server.start()
    yield server
    await server.stop()


def token_backend(server: FakeVLLM, folder: Path, backend_id: str = "v") -> TokenBackend:
    settings = BackendSettings(
        id=backend_id, kind="vllm", base_url=server.base_url, tokenizer_path=str(folder), logprobs_mode="raw"
    )
    backend = build_backend(settings, timeout_s=5, max_retries=0)
    assert isinstance(backend, TokenBackend)
    return backend


def then(messages: list[dict[str, Any]], reply: ChatResult, user: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": reply.text}, {"role": "user", "content": user}]


async def test_a_token_backend_becomes_chat_with_one_exact_trajectory(vllm: FakeVLLM, folder: Path) -> None:
    backend = token_backend(vllm, folder)
    job = JobChat()

    first = await job.chat(backend, FIRST, [], SAMPLING)
    second_messages = then(FIRST, first, "More?")
    second = await job.chat(backend, second_messages, [], SAMPLING)

    prompts = [request["prompt"] for request in vllm.requests]
    assert backend.tokenizer.decode(prompts[0]) == backend.tokenizer.render(FIRST, add_generation_prompt=True)
    assert prompts[1][: len(prompts[0]) + len(first.token_ids)] == prompts[0] + list(first.token_ids)
    # The text is the sampled ids without the stop token; the ids keep it.
    assert first.text == f"reply {len(prompts[0])}" and first.token_ids[-1] == vllm.eos
    assert first.completion_tokens == len(first.token_ids) and first.prompt_tokens == len(prompts[0])
    assert (first.token_offset, second.token_offset) == (len(prompts[0]), len(prompts[1]))
    assert (first.backend_id, first.tool_call_parser, first.logprobs_mode) == ("v", "hermes", "raw")

    token_ids, loss_mask, logprobs = job.token_trajectory()
    assert token_ids == prompts[1] + list(second.token_ids)
    assert sum(loss_mask) == len(first.token_ids) + len(second.token_ids)
    assert [lp for lp, bit in zip(logprobs, loss_mask, strict=True) if bit] == [*first.logprobs, *second.logprobs]
    assert job.turn_spans() == [
        (len(prompts[0]), len(prompts[0]) + len(first.token_ids)),
        (len(prompts[1]), len(prompts[1]) + len(second.token_ids)),
    ]
    await backend.close()


class AbortedOnce(TokenBackend):
    """A token backend whose first request is cancelled, as Pause(abort) does."""

    def __init__(self, real: TokenBackend) -> None:
        self.info = real.info
        self._real = real
        self.prompts: list[list[int]] = []

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._real.tokenizer

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
        self.prompts.append(list(prompt_ids))
        if len(self.prompts) == 1:
            raise asyncio.CancelledError
        return await self._real.generate(prompt_ids, sampling)

    async def check_health(self) -> bool:
        return True

    async def close(self) -> None:
        await self._real.close()


async def test_a_turn_sent_again_sends_the_same_prompt(vllm: FakeVLLM, folder: Path) -> None:
    """After a Pause aborted a turn, the session sends it again: the trajectory does not grow twice."""
    backend = AbortedOnce(token_backend(vllm, folder))
    job = JobChat()
    with pytest.raises(asyncio.CancelledError):
        await job.chat(backend, FIRST, [], SAMPLING)
    result = await job.chat(backend, FIRST, [], SAMPLING)
    first, again = backend.prompts
    assert first == again == vllm.requests[0]["prompt"]
    assert job.token_trajectory()[0] == first + list(result.token_ids)
    await backend.close()


async def test_a_chat_backend_passes_through_without_a_trajectory() -> None:
    backend = ScriptedChatBackend(["hi there"], backend_id="c")
    job = JobChat()
    result = await job.chat(backend, FIRST, [], SAMPLING)
    assert (result.text, result.backend_id, result.tool_call_parser) == ("hi there", "c", "hermes")
    assert result.token_offset == -1 and result.token_ids == ()
    assert backend.requests[0].messages == FIRST
    assert job.token_trajectory() == ([], [], []) and job.turn_spans() == []


async def test_a_backend_of_neither_kind_is_refused() -> None:
    class Neither(LLMBackend):
        info = ScriptedChatBackend([]).info

        async def check_health(self) -> bool:
            return True

        async def close(self) -> None:
            pass

    with pytest.raises(TypeError, match="neither"):
        await JobChat().chat(Neither(), FIRST, [], SAMPLING)


async def test_the_trajectory_belongs_to_the_job_across_token_backends(vllm: FakeVLLM, folder: Path) -> None:
    """Removing the job's backend sends its next turn elsewhere; the trajectory continues there."""
    other = FakeVLLM(folder, lambda prompt: "from the other one")
    await other.start()
    pool = BackendRouter(health_interval_s=0)
    pool.add(token_backend(vllm, folder, "a"))
    session = LLMSession("job", pool)
    first = await session.chat(FIRST, [], SAMPLING)
    pool.add(token_backend(other, folder, "b"))
    await pool.remove("a")
    second = await session.chat(then(FIRST, first, "And?"), [], SAMPLING)

    assert (first.backend_id, second.backend_id, second.switched_from_backend) == ("a", "b", "a")
    (continued,) = [r["prompt"] for r in other.requests]
    assert continued[: len(vllm.requests[0]["prompt"]) + len(first.token_ids)] == vllm.requests[0]["prompt"] + list(
        first.token_ids
    )
    assert session.token_trajectory()[0] == continued + list(second.token_ids)
    await pool.close()
    await other.stop()


class RecordingJobChat(JobChat):
    """Answers every turn itself and records which backend the session handed it."""

    def __init__(self) -> None:
        super().__init__()
        self.backends: list[str] = []
        self.fail: set[str] = set()
        self.gate = asyncio.Event()
        self.gate.set()

    async def chat(
        self,
        backend: LLMBackend,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
    ) -> ChatResult:
        self.backends.append(backend.info.id)
        await self.gate.wait()
        if backend.info.id in self.fail:
            raise LLMError(f"backend {backend.info.id} unavailable")
        return ChatResult(text="ok", finish_reason="stop", backend_id="set by the adapter", token_offset=7)

    def token_trajectory(self) -> tuple[list[int], list[int], list[float]]:
        return [1, 2], [0, 1], [0.0, -0.5]

    def turn_spans(self) -> list[tuple[int, int]]:
        return [(1, 2)]


async def test_the_session_routes_and_the_adapter_does_the_turn() -> None:
    pool = BackendRouter(health_interval_s=0)
    a, b = ScriptedChatBackend(["a"], backend_id="a"), ScriptedChatBackend(["b"], backend_id="b")
    pool.add(a)
    job = RecordingJobChat()
    session = LLMSession("job", pool, job_chat=job)

    first = await session.chat(FIRST, [], SAMPLING)
    pool.add(b)
    job.fail.add("a")  # a stops answering: the same turn goes to b
    second = await session.chat(FIRST, [], SAMPLING)

    assert job.backends == ["a", "a", "b"] and not a.requests and not b.requests
    assert (first.text, first.token_offset, first.backend_id, first.switched_from_backend) == ("ok", 7, "a", "")
    assert (second.backend_id, second.switched_from_backend) == ("b", "a")
    assert not pool.entries()[0].healthy
    assert session.token_trajectory() == job.token_trajectory() and session.turn_spans() == [(1, 2)]
    await pool.close()


async def test_a_turn_aborted_by_pause_is_sent_again_after_resume() -> None:
    pool = BackendRouter(health_interval_s=0)
    pool.add(ScriptedChatBackend([], backend_id="a"))
    job = RecordingJobChat()
    job.gate.clear()
    turn = asyncio.create_task(LLMSession("job", pool, job_chat=job).chat(FIRST, [], SAMPLING))
    await assert_eventually(lambda: job.backends == ["a"], timeout_s=5)

    assert pool.pause(abort_in_flight=True) == 1
    job.gate.set()
    pool.resume()
    result = await turn

    assert job.backends == ["a", "a"] and result.policy_version == 1
    await pool.close()
