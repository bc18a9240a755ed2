"""Token chains of an agent program's gateway calls: calls that extend the previous one
(with its reply, as the program echoes it) continue one exact chain; a rewritten history
starts another."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prorl_server.errors import LLMError
from prorl_server.gateway.chains import CallChains
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import ChatResult, Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.tool_calls import parse_text
from prorl_server.testing.scripted_llm import ScriptedChatBackend
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer

SAMPLING = Sampling(max_tokens=256, temperature=1.0)
SYSTEM = {"role": "system", "content": "Use the tools."}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


@pytest_asyncio.fixture
async def router(tmp_path: Path) -> AsyncIterator[tuple[BackendRouter, FakeVLLM]]:
    folder = write_tiny_tokenizer(tmp_path / "tok")
    server = FakeVLLM(folder, lambda prompt: "ok")
    await server.start()
    router = BackendRouter(health_interval_s=0)
    settings = BackendSettings(id="v", kind="vllm", base_url=server.base_url, tokenizer_path=str(folder))
    router.add(build_backend(settings, timeout_s=5, max_retries=0))
    yield router, server
    await router.close()
    await server.stop()


def echoed(result: ChatResult, call_id: str | None = None) -> dict[str, Any]:
    """The reply as an OpenAI-SDK program sends it back: tool calls parsed out, text removed."""
    calls = parse_text(result.text, "hermes")
    if calls:
        function = {"name": calls[0].name, "arguments": json.dumps(calls[0].arguments)}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    return {"role": "assistant", "content": result.text}


async def test_calls_that_extend_each_other_are_one_exact_chain(router: tuple[BackendRouter, FakeVLLM]) -> None:
    backend_router, server = router
    server.script = lambda prompt: '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    chains = CallChains("job", backend_router)
    first_messages = [SYSTEM, {"role": "user", "content": "List the files."}]
    first = await chains.chat(first_messages, TOOLS, SAMPLING)
    server.script = lambda prompt: "There is one file."
    second_messages = [
        *first_messages,
        echoed(first, "call_1"),
        {"role": "tool", "tool_call_id": "call_1", "name": "bash", "content": "a.txt"},
    ]
    second = await chains.chat(second_messages, TOOLS, SAMPLING)

    (chain,) = chains.token_chains()
    prompts = [request["prompt"] for request in server.requests]
    assert prompts[1][: len(prompts[0]) + len(first.token_ids)] == prompts[0] + list(first.token_ids)
    assert chain.token_ids == prompts[1] + list(second.token_ids)
    assert chain.calls == [0, 1]
    assert sum(chain.loss_mask) == len(first.token_ids) + len(second.token_ids)
    assert len(chain.policy_versions) == len(chain.token_ids) == len(chain.logprobs)
    # The sampled text (with its tool-call markup) is what the template rendered, not the program's echo.
    assert "<tool_call>" in server.tokenizer.decode(prompts[1])


async def test_a_rewritten_history_starts_a_new_chain(router: tuple[BackendRouter, FakeVLLM]) -> None:
    backend_router, _ = router
    chains = CallChains("job", backend_router)
    messages = [SYSTEM, {"role": "user", "content": "Step one."}]
    first = await chains.chat(messages, TOOLS, SAMPLING)
    await chains.chat([*messages, echoed(first), {"role": "user", "content": "Step two."}], TOOLS, SAMPLING)
    # Context compaction: the program replaces its history by a summary.
    compacted = [SYSTEM, {"role": "user", "content": "Summary of steps one and two. Step three."}]
    await chains.chat(compacted, TOOLS, SAMPLING)
    # An edited reply is a rewrite too.
    edited = {"role": "assistant", "content": "something the model never said"}
    await chains.chat([*messages, edited, {"role": "user", "content": "Step two."}], TOOLS, SAMPLING)

    assert [chain.calls for chain in chains.token_chains()] == [[0, 1], [2], [3]]


async def test_other_tools_or_calls_side_by_side_do_not_share_a_chain(router: tuple[BackendRouter, FakeVLLM]) -> None:
    backend_router, _ = router
    chains = CallChains("job", backend_router)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    await chains.chat(messages, TOOLS, SAMPLING)
    await chains.chat(messages, [], SAMPLING)  # a sub-agent without tools
    assert [chain.calls for chain in chains.token_chains()] == [[0], [1]]


async def test_policy_versions_are_per_token(router: tuple[BackendRouter, FakeVLLM]) -> None:
    backend_router, _ = router
    chains = CallChains("job", backend_router)
    messages = [SYSTEM, {"role": "user", "content": "One."}]
    first = await chains.chat(messages, TOOLS, SAMPLING)
    backend_router.pause(abort_in_flight=False)
    backend_router.resume(7)
    second = await chains.chat([*messages, echoed(first), {"role": "user", "content": "Two."}], TOOLS, SAMPLING)

    (chain,) = chains.token_chains()
    assert (first.policy_version, second.policy_version) == (0, 7)
    start, end = chain.turn_spans[1]
    assert set(chain.policy_versions[:start]) <= {0, 7}
    assert chain.policy_versions[start:end] == [7] * (end - start)
    assert chain.policy_versions[: chain.turn_spans[0][1]] == [0] * chain.turn_spans[0][1]


@pytest.mark.parametrize("content", ["", None])
async def test_an_echo_without_text_matches_a_reply_that_was_only_a_tool_call(
    router: tuple[BackendRouter, FakeVLLM], content: str | None
) -> None:
    backend_router, server = router
    server.script = lambda prompt: '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    chains = CallChains("job", backend_router)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    first = await chains.chat(messages, TOOLS, SAMPLING)
    echo = {**echoed(first, "c"), "content": content}
    await chains.chat([*messages, echo, {"role": "tool", "tool_call_id": "c", "content": "x"}], TOOLS, SAMPLING)
    assert [chain.calls for chain in chains.token_chains()] == [[0, 1]]


async def test_identical_calls_side_by_side_are_separate_samples(router: tuple[BackendRouter, FakeVLLM]) -> None:
    backend_router, _ = router
    chains = CallChains("job", backend_router)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    await asyncio.gather(chains.chat(messages, TOOLS, SAMPLING), chains.chat(messages, TOOLS, SAMPLING))
    assert sorted(chain.calls for chain in chains.token_chains()) == [[0], [1]]
    for chain in chains.token_chains():
        assert len(chain.policy_versions) == len(chain.token_ids)


async def test_a_failed_call_sent_again_continues_its_chain_with_every_token_versioned(
    router: tuple[BackendRouter, FakeVLLM],
) -> None:
    backend_router, server = router
    chains = CallChains("job", backend_router)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    first = await chains.chat(messages, TOOLS, SAMPLING)
    following = [*messages, echoed(first), {"role": "user", "content": "Again."}]
    server.fail_next = [500]  # the backend answers 500 once (no retries configured)
    with pytest.raises(LLMError):
        await chains.chat(following, TOOLS, SAMPLING)
    assert chains.outage is not None
    await backend_router.check_health()  # the backend is back
    await chains.chat(following, TOOLS, SAMPLING)  # the program's SDK retries the same call
    assert chains.outage is None
    (chain,) = chains.token_chains()
    assert chain.calls == [0, 2] and len(chain.policy_versions) == len(chain.token_ids)


# --- a conversation rendered whole shows each earlier reply's calls once ----------------------------

QWEN_TEMPLATE = Path(__file__).resolve().parents[2] / "data" / "chat_templates" / "Qwen--Qwen2.5-7B-Instruct.jinja"
LS_CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'


def put_back(result: ChatResult, call_id: str) -> dict[str, Any]:
    """The reply as the gateway hands it to the chains (gateway/common.py's ChatTurns): the sampled
    text put back, markup and all, with the program's structured call."""
    return {**echoed(result, call_id), "content": result.text}


async def test_a_new_chain_renders_an_earlier_replys_call_once(tmp_path: Path) -> None:
    """A program that edits its history (Claude Code's compaction) starts a new chain whose first
    prompt renders the whole conversation: the earlier reply's call must appear once, as the
    template writes structured calls, not also as the markup of the sampled text."""
    folder = write_tiny_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_TEMPLATE.read_text()}))
    server = FakeVLLM(folder, lambda prompt: LS_CALL)
    await server.start()
    backend_router = BackendRouter(health_interval_s=0)
    settings = BackendSettings(id="v", kind="vllm", base_url=server.base_url, tokenizer_path=str(folder))
    backend_router.add(build_backend(settings, timeout_s=5, max_retries=0))
    try:
        chains = CallChains("job", backend_router)
        first = await chains.chat([SYSTEM, {"role": "user", "content": "List the files."}], TOOLS, SAMPLING)
        server.script = lambda prompt: "One file."
        tool = {"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "a.txt"}
        edited = [SYSTEM, {"role": "user", "content": "List every file."}, put_back(first, "c1"), tool]
        second = await chains.chat(edited, TOOLS, SAMPLING)
        third = [*edited, {"role": "assistant", "content": second.text}, {"role": "user", "content": "Thanks."}]
        await chains.chat(third, TOOLS, SAMPLING)
    finally:
        await backend_router.close()
        await server.stop()
    rendered = server.tokenizer.decode(server.requests[1]["prompt"])
    assert rendered.count("command") == 1, rendered  # the call's one argument
    # The new chain goes on as one exact chain: its history is sent the same way every time.
    assert sorted(chain.calls for chain in chains.token_chains()) == [[0], [1, 2]]


async def test_a_chat_backend_sees_each_earlier_call_once() -> None:
    """A chat backend renders the whole conversation on every call: it gets the reply's text
    without the markup and the structured call, on a continued chain and a new one alike."""
    backend = ScriptedChatBackend([LS_CALL, "One file.", "Done."])
    backend_router = BackendRouter(health_interval_s=0)
    backend_router.add(backend)
    try:
        chains = CallChains("job", backend_router)
        task = [SYSTEM, {"role": "user", "content": "List the files."}]
        first = await chains.chat(task, TOOLS, SAMPLING)
        tool = {"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "a.txt"}
        await chains.chat([*task, put_back(first, "c1"), tool], TOOLS, SAMPLING)
        edited = [SYSTEM, {"role": "user", "content": "List every file."}, put_back(first, "c1"), tool]
        await chains.chat(edited, TOOLS, SAMPLING)
    finally:
        await backend_router.close()
    for request in backend.requests[1:]:
        reply = request.messages[2]
        assert reply["tool_calls"][0]["function"]["name"] == "bash"
        assert "<tool_call>" not in (reply["content"] or ""), reply
