"""The fake vLLM (tests/fakes/token_servers.py) cannot drift from the real one: the same
requests go to both, and every response field the backend reads (and the tests read
about vLLM) must have the same name, type and shape; status codes must agree, and
errors must be recognised the same way (a prompt over the context is a policy
outcome, http_client.about_context_length).

The real vLLM is the session's (tests/vllm.py); the fake serves with the same model's
tokenizer, so the ids it samples are of the same vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.http_client import about_context_length
from prorl_server.llm.token_http import VLLMBackend
from tests.fakes.token_servers import FakeVLLM
from tests.vllm import MODEL, SERVED_NAME, VLLMServer

# The first test to use the session's vLLM waits for it to start (minutes on a busy CPU): tests/vllm.py.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 1780, 314, 216, 38, 2, 198, 1, 520, 9531, 198]

COMPLETION_FIELDS = (
    # read by VLLMBackend (prorl_server/llm/token_http.py)
    ("choices", 0, "logprobs", "tokens"),
    ("choices", 0, "logprobs", "token_logprobs"),
    ("choices", 0, "finish_reason"),
    ("choices", 0, "token_ids"),
    ("choices", 0, "routed_experts"),
    # read by the tests about what vLLM saw
    ("choices", 0, "prompt_token_ids"),
    ("choices", 0, "text"),
    ("usage", "prompt_tokens"),
    ("usage", "completion_tokens"),
)


def field(body: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        body = body[key]
    return body


def shape(value: Any) -> Any:
    """Type and shape: a list is its length and its elements' shapes; a str keeps its prefix
    up to ':' when it is a "token_id:<n>" token."""
    if isinstance(value, list):
        return ("list", len(value), sorted({repr(shape(v)) for v in value}))
    if isinstance(value, str) and value.startswith("token_id:") and value.removeprefix("token_id:").isdigit():
        return "token_id:<int>"
    return type(value).__name__


@pytest_asyncio.fixture(loop_scope="session")
async def fake() -> AsyncIterator[FakeVLLM]:
    server = FakeVLLM(MODEL, lambda prompt: "The answer is 42.")
    await server.start()
    yield server
    await server.stop()


async def post(root: str, path: str, payload: dict[str, Any] | None = None, **params: str) -> tuple[int, Any]:
    url = f"{root}{path}"
    async with aiohttp.ClientSession() as session, session.post(url, json=payload, params=params or None) as response:
        body = await response.json(content_type=None) if (await response.read()) else None
        return response.status, body


async def get(root: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{root}{path}") as response:
        return response.status, await response.json(content_type=None)


def completion(backend: VLLMBackend, max_tokens: int, prompt: list[int] = PROMPT) -> dict[str, Any]:
    return backend.payload(prompt, Sampling(max_tokens=max_tokens, temperature=1.0, seed=3, model=SERVED_NAME))


def backend_for(base_url: str) -> VLLMBackend:
    settings = BackendSettings(
        id="contract", kind="vllm", base_url=base_url, model=SERVED_NAME, tokenizer_path=str(MODEL)
    )
    built = build_backend(settings, timeout_s=600, max_retries=0)
    assert isinstance(built, VLLMBackend)
    return built


async def test_completions_have_the_same_fields_types_and_shapes(vllm: VLLMServer, fake: FakeVLLM) -> None:
    backend = backend_for(vllm.base_url)
    try:
        for max_tokens in (1, 6):  # a reply cut by max_tokens: lengths must agree as well
            request = completion(backend, max_tokens)
            real_status, real = await post(vllm.root, "/v1/completions", request)
            fake_status, faked = await post(f"http://127.0.0.1:{fake.port}", "/v1/completions", request)
            assert real_status == fake_status == 200
            for path in COMPLETION_FIELDS:
                assert shape(field(faked, path)) == shape(field(real, path)), path
            assert field(real, ("choices", 0, "prompt_token_ids")) == field(faked, ("choices", 0, "prompt_token_ids"))
            # and the backend reads both the same way
            assert len(backend.parse(real)[0]) == len(backend.parse(faked)[0]) == max_tokens
            assert backend.routed_experts(real) is backend.routed_experts(faked) is None  # a dense model: none
    finally:
        await backend.close()


async def test_a_prompt_over_the_context_is_the_same_error(vllm: VLLMServer, fake: FakeVLLM) -> None:
    backend = backend_for(vllm.base_url)
    try:
        request = completion(backend, 64, prompt=PROMPT * 90)  # 2,070 ids + 64 > 2,048
    finally:
        await backend.close()
    async with aiohttp.ClientSession() as session:
        answers = []
        for root in (vllm.root, f"http://127.0.0.1:{fake.port}"):
            async with session.post(f"{root}/v1/completions", json=request) as response:
                answers.append((response.status, await response.text()))
    (real_status, real_text), (fake_status, fake_text) = answers
    assert real_status == fake_status == 400
    assert about_context_length(real_text) and about_context_length(fake_text)
    real_error, fake_error = json.loads(real_text)["error"], json.loads(fake_text)["error"]
    assert sorted(real_error) == sorted(fake_error) and shape(real_error["message"]) == shape(fake_error["message"])


async def test_the_rl_endpoints_answer_alike(vllm: VLLMServer, fake: FakeVLLM, tmp_path: Path) -> None:
    """Pause, reload (the served folder, then one that does not exist), reset the prefix cache,
    resume, set and read the weight version; the model list's root."""
    fake_root = f"http://127.0.0.1:{fake.port}"
    steps: list[tuple[str, str, dict[str, Any] | None, dict[str, str]]] = [
        ("post", "/pause", None, {"mode": "wait"}),
        ("post", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(MODEL)}}, {}),
        ("post", "/reset_prefix_cache", None, {}),
        ("post", "/resume", None, {}),
        ("post", "/update_weight_version", {"new_version": "contract-1"}, {}),
        ("get", "/weight_info", None, {}),
    ]
    try:
        for method, path, payload, params in steps:
            if method == "post":
                real, faked = (
                    await post(vllm.root, path, payload, **params),
                    await post(fake_root, path, payload, **params),
                )
            else:
                real, faked = await get(vllm.root, path), await get(fake_root, path)
            assert real[0] == faked[0] == 200, (path, real, faked)
            assert shape_of_dict(real[1]) == shape_of_dict(faked[1]), path
        assert (await get(vllm.root, "/weight_info"))[1] == (await get(fake_root, "/weight_info"))[1]
        real_models, fake_models = (await get(vllm.base_url, "/models"))[1], (await get(fake.base_url, "/models"))[1]
        for key in ("id", "root", "max_model_len"):
            assert shape(real_models["data"][0][key]) == shape(fake_models["data"][0][key]), key
    finally:
        await post(vllm.root, "/update_weight_version", {"new_version": "default"})
    # A checkpoint that cannot be read: both answer 500 with {"error": {"message", ...}}. (vLLM is left
    # half-loaded by it, so the test loads the served folder again; VLLMBackend.load_weights does the same.)
    missing = str(tmp_path / "missing-checkpoint")
    await post(vllm.root, "/pause", mode="wait")
    try:
        real = await post(
            vllm.root, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": missing}}
        )
        faked = await post(
            fake_root, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": missing}}
        )
    finally:
        await post(vllm.root, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(MODEL)}})
        await post(vllm.root, "/reset_prefix_cache")
        await post(vllm.root, "/resume")
    assert real[0] == faked[0] == 500
    assert sorted(real[1]["error"]) == sorted(faked[1]["error"]) and isinstance(real[1]["error"]["message"], str)


def shape_of_dict(body: Any) -> Any:
    if isinstance(body, dict):
        return {key: shape_of_dict(value) for key, value in body.items()}
    return shape(body)
