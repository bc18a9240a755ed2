"""Contract tests: the vLLM and SGLang adapters against fakes of their documented token APIs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from pydantic import ValidationError

from prorl_server.errors import InvalidArgument, LLMError
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from tests.fakes.token_servers import FakeSGLang, FakeTokenServer, FakeVLLM, write_tiny_tokenizer

SAMPLING = Sampling(max_tokens=64, temperature=0.7, seed=3)


@pytest.fixture
def tokenizer_folder(tmp_path: Path) -> Path:
    return write_tiny_tokenizer(tmp_path / "tokenizer")


@pytest_asyncio.fixture(params=["vllm", "sglang"])
async def fake(request: pytest.FixtureRequest, tokenizer_folder: Path) -> AsyncIterator[FakeTokenServer]:
    server_class = FakeVLLM if request.param == "vllm" else FakeSGLang
    server = server_class(tokenizer_folder, lambda prompt: f"reply {len(prompt)}")
    await server.start()
    server.kind = request.param  # type: ignore[attr-defined]
    yield server
    await server.stop()


def backend_for(fake: FakeTokenServer, tokenizer_folder: Path):  # type: ignore[no-untyped-def]
    settings = BackendSettings(
        id="fake",
        kind=fake.kind,
        base_url=fake.base_url,
        model="m",
        tokenizer_path=str(tokenizer_folder),  # type: ignore[attr-defined]
    )
    return build_backend(settings, timeout_s=10, max_retries=2)


async def test_two_turns_send_growing_token_prompts_with_zero_drift(
    fake: FakeTokenServer, tokenizer_folder: Path
) -> None:
    backend = backend_for(fake, tokenizer_folder)
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend)
    session = LLMSession("job", pool)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    first = await session.chat(messages, [], SAMPLING)
    assert first.text.startswith("reply ") and first.finish_reason == "stop"
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "<tool_response>ok</tool_response>"},
    ]
    second = await session.chat(messages, [], SAMPLING)

    prompts = [r["prompt"] if "prompt" in r else r["input_ids"] for r in fake.requests]
    token_ids, loss_mask, logprobs = session.token_trajectory()
    assert token_ids == prompts[1] + list(second.token_ids)
    assert prompts[1][: len(prompts[0]) + len(first.token_ids)] == prompts[0] + list(first.token_ids)
    assert sum(loss_mask) == len(first.token_ids) + len(second.token_ids)
    assert all(lp < 0 for lp, bit in zip(logprobs, loss_mask, strict=True) if bit)
    rendered = backend.tokenizer.render(messages, add_generation_prompt=True)
    assert backend.tokenizer.decode(prompts[1]) == rendered
    await pool.close()


async def test_sampling_parameters_reach_the_backend(fake: FakeTokenServer, tokenizer_folder: Path) -> None:
    backend = backend_for(fake, tokenizer_folder)
    await backend.generate([1, 2, 3], Sampling(max_tokens=5, temperature=0.3, top_p=0.9, seed=11, stop=("x",)))
    body = fake.requests[-1]
    if fake.kind == "vllm":  # type: ignore[attr-defined]
        assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"], body["stop"]) == (
            5,
            0.3,
            0.9,
            11,
            ["x"],
        )
    else:
        params = body["sampling_params"]
        assert (params["max_new_tokens"], params["temperature"], params["top_p"], params["sampling_seed"]) == (
            5,
            0.3,
            0.9,
            11,
        )
    assert await backend.check_health()
    await backend.close()


async def test_transient_errors_are_retried_and_4xx_are_not(fake: FakeTokenServer, tokenizer_folder: Path) -> None:
    backend = backend_for(fake, tokenizer_folder)
    fake.fail_next = [503, 429]
    generation = await backend.generate([1, 2], SAMPLING)
    assert generation.token_ids and len(fake.requests) == 3
    fake.fail_next = [400]
    with pytest.raises(LLMError, match="HTTP 400"):
        await backend.generate([1, 2], SAMPLING)
    assert len(fake.requests) == 4
    await backend.close()


def test_token_backends_need_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs tokenizer_path"):
        BackendSettings(id="v", kind="vllm", base_url="http://x/v1")
    with pytest.raises(InvalidArgument, match="cannot read a Hugging Face tokenizer"):
        build_backend(
            BackendSettings(id="v", kind="sglang", base_url="http://x", tokenizer_path=str(tmp_path)),
            timeout_s=1,
            max_retries=0,
        )


async def test_tools_reach_a_chat_template_that_renders_them(tmp_path: Path) -> None:
    import json

    folder = write_tiny_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
        "<|im_end|>\n{% endif %}" + config["chat_template"]
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    fake = FakeVLLM(folder, lambda prompt: "done")
    await fake.start()
    backend = build_backend(
        BackendSettings(id="v", kind="vllm", base_url=fake.base_url, tokenizer_path=str(folder)),
        timeout_s=5,
        max_retries=0,
    )
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    await LLMSession("job", pool).chat([{"role": "user", "content": "hi"}], tools, SAMPLING)
    assert backend.tokenizer.decode(fake.requests[0]["prompt"]).startswith("<|im_start|>system\nTOOLS: bash")
    await pool.close()
    await fake.stop()
