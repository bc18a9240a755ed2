"""The command family: an unmodified program on the official openai SDK, run in a (fake)
sandbox with the job's model gateway on its loopback, judged by a built-in family; on a token
backend its calls come back as exact token chains. No Podman: the fake provider runs the
program on this host with this interpreter (which has the SDK)."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio
from google.protobuf.struct_pb2 import Struct

from prorl_client import Client, RpcError, v1
from prorl_server.app import ProrlServer
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import LLMBackend
from prorl_server.llm.factory import build_backend
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, user_prompt
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.helpers import assert_eventually, server_settings

# Two calls: the second extends the first (its reply echoed back, one more user message).
AGENT = """
import os, openai
client = openai.OpenAI()
messages = [{"role": "user", "content": os.environ["PRORL_TASK"]}]
first = client.chat.completions.create(model="prorl", messages=messages)
messages += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Your final answer, alone on a line?"}]
second = client.chat.completions.create(model="prorl", messages=messages)
print("thinking...")
print(second.choices[0].message.content)
"""


def command_request(question: str, gold: str, *, argv: list[str] | None = None) -> v1.RolloutRequest:
    instance = Struct()
    instance.update(
        {
            "program": {"argv": argv or [sys.executable, "agent.py"], "files": {"agent.py": AGENT}},
            "verifier": "math",
            "task": {"question": question, "answer": gold},
        }
    )
    return v1.RolloutRequest(handler="command", instance=instance)


async def served(backend: LLMBackend, *, gateway_port: int | None = None) -> tuple[ProrlServer, FakeSandboxProvider]:
    provider = FakeSandboxProvider(instance_id=instance_id("cmd"))
    settings = server_settings(server={"gateway_port": gateway_port})
    server = ProrlServer(settings, sandbox_provider=provider, backends=[backend])
    await server.start()
    return server, provider


def leftovers(provider: FakeSandboxProvider) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"prorl-{provider.instance_id}-*"))


def answer_script(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Thinks aloud first, then gives 42 or, for "wrong", 41."""
    if len(messages) == 1:
        return ScriptedReply("Let me compute 6 * 7.")
    return ScriptedReply("41" if "wrong" in user_prompt(messages) else "42")


@pytest_asyncio.fixture
async def chat_client() -> AsyncIterator[tuple[Client, ScriptedChatBackend]]:
    backend = ScriptedChatBackend(answer_script)
    server, provider = await served(backend)
    async with Client.connect(server.address) as client:
        yield client, backend
    await server.stop()
    assert provider.busy == 0
    assert not leftovers(provider)


async def result_of(client: Client, request: v1.RolloutRequest) -> v1.RolloutResult:
    async for event in client.rollout(request):
        if event.HasField("finished"):
            return event.finished.result
    raise AssertionError("no finished event")


async def test_an_sdk_program_is_judged_by_the_math_family(chat_client: tuple[Client, ScriptedChatBackend]) -> None:
    client, backend = chat_client
    right = await result_of(client, command_request("What is 6 * 7?", "42"))
    assert right.status == v1.JOB_STATUS_SUCCEEDED, right.failure
    assert right.reward == 1.0
    assert right.details["answer"] == "42" and right.details["stop_reason"] == "program_exit"
    assert right.details["calls"] == 2 and right.details["exit_code"] == 0
    assert right.trajectory.num_turns == 2
    # The program's calls went through the job's session, with the task as the family prompts it.
    assert [m["content"] for m in backend.requests[0].messages] == ["What is 6 * 7?"]
    assert [m.role for m in right.trajectory.messages] == ["user", "assistant", "user", "assistant"]

    wrong = await result_of(client, command_request("wrong: what is 6 * 7?", "42"))
    assert wrong.status == v1.JOB_STATUS_SUCCEEDED and wrong.reward == 0.0 and wrong.details["answer"] == "41"


async def test_a_program_that_cannot_run_is_an_infrastructure_failure(
    chat_client: tuple[Client, ScriptedChatBackend],
) -> None:
    client, _ = chat_client
    result = await result_of(client, command_request("q", "1", argv=["no-such-agent-program"]))
    assert result.status == v1.JOB_STATUS_FAILED
    assert (result.failure.kind, result.failure.reason) == (v1.FAILURE_KIND_INFRASTRUCTURE, "program_not_runnable")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"verifier": "chess"}, "verifier"),
        ({"task": {"question": "q"}}, "math instance field 'answer'"),
        ({"program": {"argv": []}}, "argv"),
        ({"program": {"argv": ["x"], "cwd": "relative"}}, "absolute"),
        ({"submission": "git_diff"}, "git_diff"),
    ],
)
async def test_bad_instances_are_named(
    chat_client: tuple[Client, ScriptedChatBackend], change: dict[str, Any], named: str
) -> None:
    client, _ = chat_client
    request = command_request("q", "1")
    fields = {**dict(request.instance), **change}
    request.instance.Clear()
    request.instance.update(fields)
    with pytest.raises(RpcError) as error:
        await client.submit(request)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert named in error.value.details


async def test_on_a_token_backend_the_calls_are_one_exact_chain(tmp_path: Path) -> None:
    folder = write_tiny_tokenizer(tmp_path / "tok")
    vllm = FakeVLLM(folder, lambda prompt: "42")
    await vllm.start()
    settings = BackendSettings(id="v", kind="vllm", base_url=vllm.base_url, tokenizer_path=str(folder))
    server, _ = await served(build_backend(settings, timeout_s=10, max_retries=0))
    try:
        async with Client.connect(server.address) as client:
            result = await result_of(client, command_request("What is 6 * 7?", "42"))
    finally:
        await server.stop()
        await vllm.stop()

    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0
    (chain,) = result.trajectory.chains
    prompts = [request["prompt"] for request in vllm.requests]
    assert len(prompts) == 2 and list(chain.calls) == [0, 1]
    first_sample = list(chain.token_ids[chain.turn_spans[0].start : chain.turn_spans[0].end])
    assert prompts[1][: len(prompts[0]) + len(first_sample)] == prompts[0] + first_sample  # extended, not re-rendered
    assert list(chain.token_ids) == prompts[1] + list(chain.token_ids[len(prompts[1]) :])
    assert sum(chain.loss_mask) == sum(span.end - span.start for span in chain.turn_spans)
    assert len(chain.policy_versions) == len(chain.token_ids) == len(chain.logprobs)
    assert list(result.trajectory.token_ids) == list(chain.token_ids)  # the top level holds the last chain


class Held:
    """A policy whose first call waits until the test releases it; any other question is answered."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def __call__(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        if user_prompt(messages) == "ping":
            return ScriptedReply("pong")
        if len(messages) == 1:
            return ScriptedReply("Let me think.", wait_for=self.release)
        return ScriptedReply("42")


async def events_until(client: Client, job_id: str, kind: str) -> v1.RolloutEvent:
    async for event in client.watch(job_id):
        if event.WhichOneof("kind") == kind:
            return event
    raise AssertionError(f"no {kind} event")


async def test_the_gateway_is_reachable_outside_with_the_jobs_key_until_the_program_ends() -> None:
    held = Held()
    backend = ScriptedChatBackend(held)
    server, provider = await served(backend, gateway_port=0)
    try:
        async with Client.connect(server.address) as client:
            job = (await client.submit(command_request("What is 6 * 7?", "42"))).job
            opened = (await events_until(client, job.job_id, "gateway_opened")).gateway_opened
            assert opened.port == server.gateway_port and opened.path == f"/jobs/{job.job_id}"
            assert opened.host == server.settings.server.host == "127.0.0.1"
            base_url = f"http://127.0.0.1:{opened.port}{opened.path}/v1"
            outside = openai.AsyncOpenAI(base_url=base_url, api_key=opened.api_key, max_retries=0)
            reply = await outside.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "ping"}])
            assert reply.choices[0].message.content == "pong"
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(base_url=base_url, api_key="not-the-key", max_retries=0).models.list()

            held.release.set()
            finished = (await events_until(client, job.job_id, "finished")).finished.result
            assert finished.status == v1.JOB_STATUS_SUCCEEDED and finished.reward == 1.0
            # The program ended: its key died with it.
            with pytest.raises(openai.AuthenticationError):
                await outside.models.list()
            await outside.close()
    finally:
        held.release.set()
        await server.stop()
    assert provider.busy == 0 and not leftovers(provider)


async def test_a_cancel_mid_call_stops_the_program_and_frees_its_sandbox() -> None:
    held = Held()
    backend = ScriptedChatBackend(held)
    server, provider = await served(backend)
    try:
        async with Client.connect(server.address) as client:
            job = (await client.submit(command_request("What is 6 * 7?", "42"))).job
            await assert_eventually(lambda: backend.in_flight == 1, message="the program never called the model")
            cancelled = await client.cancel(job.job_id, reason="test")
            assert cancelled.status == v1.JOB_STATUS_CANCELLED
            assert backend.in_flight == 0  # its model call was aborted
            assert provider.busy == 0 and not leftovers(provider)  # the program's process tree is gone with it
    finally:
        held.release.set()
        await server.stop()


async def test_a_program_that_cannot_reach_the_model_fails_as_infrastructure() -> None:
    backend = ScriptedChatBackend(lambda messages: ScriptedReply(status=503, error_message="overloaded"))
    server, provider = await served(backend)
    try:
        async with Client.connect(server.address) as client:
            result = await result_of(client, command_request("What is 6 * 7?", "42"))
    finally:
        await server.stop()
    # The SDK gave up on a 503 and the program crashed: not the policy's doing, so masked out of training.
    assert result.status == v1.JOB_STATUS_FAILED
    assert (result.failure.kind, result.failure.phase) == (v1.FAILURE_KIND_INFRASTRUCTURE, v1.PHASE_RUN)
    assert result.failure.reason == "llm_unavailable"
    assert provider.busy == 0
