"""The OpenAI-chat adapter against the scripted fake server: retries only what may succeed again."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_server.errors import LLMError
from prorl_server.llm.base import BackendInfo, Sampling
from prorl_server.llm.openai_chat import OpenAIChatBackend
from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply

SAMPLING = Sampling(max_tokens=8, temperature=0.0)


def statuses(*codes: int) -> Any:
    replies = iter(codes)

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply("ok", status=next(replies, 200))

    return script


@pytest.mark.parametrize(("codes", "calls"), [((429, 503), 3), ((500,), 2)])
async def test_429_and_5xx_are_retried(codes: tuple[int, ...], calls: int) -> None:
    server = ScriptedLLMServer(statuses(*codes))
    await server.start()
    backend = OpenAIChatBackend(BackendInfo("b", "openai_chat", server.base_url, "m"), max_retries=3)
    try:
        result = await backend.chat([{"role": "user", "content": "hi"}], [], SAMPLING)
        assert result.text == "ok" and len(server.requests) == calls
    finally:
        await backend.close()
        await server.stop()


async def test_other_4xx_fail_at_once() -> None:
    server = ScriptedLLMServer(statuses(400))
    await server.start()
    backend = OpenAIChatBackend(BackendInfo("b", "openai_chat", server.base_url, "m"), max_retries=3)
    try:
        with pytest.raises(LLMError, match="refused the request: HTTP 400"):
            await backend.chat([{"role": "user", "content": "hi"}], [], SAMPLING)
        assert len(server.requests) == 1
    finally:
        await backend.close()
        await server.stop()


async def test_unreachable_backend_fails_after_retries() -> None:
    backend = OpenAIChatBackend(BackendInfo("b", "openai_chat", "http://127.0.0.1:9/v1", "m"), max_retries=1)
    try:
        with pytest.raises(LLMError, match="unavailable after 2 attempts"):
            await backend.chat([{"role": "user", "content": "hi"}], [], SAMPLING)
        assert not await backend.check_health()
    finally:
        await backend.close()
