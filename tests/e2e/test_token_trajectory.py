"""Token in, token out with the real embedded model: the trajectory is exactly what was sampled."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence

import pytest
import pytest_asyncio

from prorl_server.llm.base import BackendInfo, Generation, Sampling
from prorl_server.llm.llama_cpp_backend import LlamaCppBackend
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession

pytestmark = pytest.mark.e2e


class RecordingBackend(LlamaCppBackend):
    """The real embedded backend, keeping what crossed its boundary."""

    def __init__(self) -> None:
        super().__init__(
            BackendInfo(id="embedded", kind="embedded", base_url="in-process", model="smollm2", max_in_flight=1),
            model_path=None,
            context_length=4096,
            threads=2,
        )
        self.prompts: list[list[int]] = []
        self.samples: list[tuple[int, ...]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
        self.prompts.append(list(prompt_ids))
        generation = await super().generate(prompt_ids, sampling)
        self.samples.append(generation.token_ids)
        return generation


@pytest_asyncio.fixture
async def backend() -> AsyncIterator[RecordingBackend]:
    backend = RecordingBackend()
    await backend.start()
    yield backend
    await backend.close()


async def test_three_turns_have_zero_drift(backend: RecordingBackend) -> None:
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend, managed=True)
    session = LLMSession("drift", pool)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ]
    sampling = Sampling(max_tokens=24, temperature=0.8, seed=7)
    for turn in range(3):
        result = await session.chat(messages, [], sampling)
        assert result.token_ids and len(result.logprobs) == len(result.token_ids)
        messages.append({"role": "assistant", "content": result.text})
        messages.append({"role": "user", "content": f"<tool_response>\nobservation {turn}\n</tool_response>"})

    token_ids, loss_mask, logprobs = session.token_trajectory()
    # Exactly the last prompt sent followed by the last sampled ids.
    assert token_ids == backend.prompts[-1] + list(backend.samples[-1])
    # Each prompt extends the previous prompt and its sample, untouched.
    for previous, sample, following in zip(backend.prompts, backend.samples, backend.prompts[1:], strict=False):
        assert following[: len(previous) + len(sample)] == previous + list(sample)
    # The mask is 1 on exactly the sampled ids.
    sampled_positions = {
        position
        for prompt, sample in zip(backend.prompts, backend.samples, strict=True)
        for position in range(len(prompt), len(prompt) + len(sample))
    }
    assert {i for i, bit in enumerate(loss_mask) if bit} == sampled_positions
    assert len(token_ids) == len(loss_mask) == len(logprobs)
    for position, logprob in enumerate(logprobs):
        if position in sampled_positions:
            assert math.isfinite(logprob) and logprob <= 0.0
        else:
            assert logprob == 0.0
    # The last prompt decodes to what the chat template renders for the conversation it was built
    # from (everything but the last reply and the observation after it).
    tokenizer = backend.tokenizer
    assert tokenizer.decode(backend.prompts[-1]) == tokenizer.render(messages[:-2], add_generation_prompt=True)


async def test_same_seed_same_sample(backend: RecordingBackend) -> None:
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend, managed=True)
    messages = [{"role": "user", "content": "Say something."}]
    sampling = Sampling(max_tokens=16, temperature=1.0, seed=123)
    first = await LLMSession("a", pool).chat(messages, [], sampling)
    second = await LLMSession("b", pool).chat(messages, [], sampling)
    assert first.token_ids == second.token_ids and first.logprobs == pytest.approx(second.logprobs)
