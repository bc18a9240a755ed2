"""Unmodified agent programs in real rootless sandboxes (network none), through the job's model
gateway: mini-swe-agent on every shipped SWE task and the openai-SDK example agent, each driven
by a scripted model. The SWE runs use a fake vLLM (token ids in and out, a byte-level tokenizer),
so each program's calls come back as exact token chains."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import v1
from prorl_server.agents.swe import SWEInstance
from prorl_server.datasets.swe import load_task, task_dirs
from tests.conftest import job_containers
from tests.fakes.scripted_llm import ScriptedReply, api_tool_call, turn_index
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.helpers import assert_eventually

pytestmark = pytest.mark.podman

# The tasks judged by pytest (Django's and SymPy's runners: tests/integration/test_swe_runners.py).
TASKS = {
    task_dir.name: task
    for task_dir in task_dirs()
    if SWEInstance.model_validate(task := load_task(task_dir)).evaluation() is None
}
EXAMPLE_AGENT = (Path(__file__).resolve().parents[2] / "examples" / "agents" / "openai_agent.py").read_text()
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"


def bash_call(command: str) -> str:
    """A reply calling mini-swe-agent's bash tool, in the hermes format the gateway reads from text."""
    return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command}})}</tool_call>"


def mini_swe_agent(instance: dict[str, Any], *, right: bool) -> Callable[[str], str]:
    """The model's side: write the upstream fix (or a wrong one), apply it, submit. The step is
    read from the prompt: how many replies the model has given so far."""
    fix = instance["patch"] if right else "not a patch\n"
    steps = [
        bash_call(f"cat > /tmp/fix.patch <<'PRORL_EOF'\n{fix}PRORL_EOF"),
        bash_call("git apply /tmp/fix.patch; git status --short"),
        bash_call(SUBMIT),
    ]

    def reply(prompt_text: str) -> str:
        return steps[min(prompt_text.count("<|im_start|>assistant") - 1, len(steps) - 1)]

    return reply


def model(vllm: FakeVLLM, reply: Callable[[str], str]) -> Callable[[list[int]], str]:
    """The fake vLLM's script: `reply` reads the prompt as text, special tokens included."""
    return lambda prompt: reply(vllm.tokenizer.decode(prompt, skip_special_tokens=False))


def command_request(instance: dict[str, Any]) -> v1.RolloutRequest:
    task = {key: value for key, value in instance.items() if key != "patch"}
    request = v1.RolloutRequest(handler="command")
    request.instance.update(
        {
            "program": {
                "argv": ["/opt/agents/bin/python", "/opt/agents/run_mini.py", "--workdir", "/testbed"],
                "cwd": "/testbed",
                "timeout_s": 300,
            },
            "verifier": "swe",
            "task": task,
            "submission": "git_diff",
        }
    )
    # run_mini.py reads the task from --task-file: the job's PRORL_TASK_FILE.
    request.instance["program"]["argv"].extend(["--task-file", "$PRORL_TASK_FILE"])
    request.sampling.max_tokens = 16384  # a byte-level tokenizer: the patch is one token a byte
    return request


@pytest_asyncio.fixture
async def fake_vllm(tmp_path: Path) -> AsyncIterator[tuple[FakeVLLM, Path]]:
    folder = write_tiny_tokenizer(tmp_path / "tok")
    server = FakeVLLM(folder, lambda prompt: "")
    server.max_model_len = 65536  # a byte-level tokenizer: prompts and patches are long in tokens
    await server.start()
    yield server, folder
    await server.stop()


async def run(client: Any, request: v1.RolloutRequest) -> v1.RolloutResult:
    events = [event async for event in client.rollout(request)]
    return events[-1].finished.result


@pytest.mark.parametrize("name", sorted(TASKS))
async def test_mini_swe_agent_resolves_each_shipped_task_through_the_gateway(
    name: str, fake_vllm: tuple[FakeVLLM, Path], start_server
) -> None:
    vllm, folder = fake_vllm
    instance = TASKS[name]
    vllm.script = model(vllm, mini_swe_agent(instance, right=True))
    backend = {"id": "vllm", "kind": "vllm", "base_url": f"{vllm.base_url}", "tokenizer_path": str(folder)}
    _, client = await start_server(None, llm={"backends": [backend], "embedded": {"enabled": "never"}})

    result = await run(client, command_request(instance))
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    assert result.reward == 1.0, result.details
    assert result.details["verdict"] == "resolved" and result.details["patch"] == instance["patch"]
    assert result.details["exit_code"] == 0 and result.details["calls"] == 3

    # The calls are one exact chain: each prompt extends the previous prompt and sample, and the
    # chain is the last prompt followed by the last sample.
    prompts = [request["prompt"] for request in vllm.requests]
    (chain,) = result.trajectory.chains
    samples = [list(chain.token_ids[span.start : span.end]) for span in chain.turn_spans]
    assert len(prompts) == len(samples) == 3
    for before, sample, after in zip(prompts, samples, prompts[1:], strict=False):
        assert after[: len(before) + len(sample)] == before + sample
    assert list(chain.token_ids) == prompts[-1] + samples[-1]
    assert sum(chain.loss_mask) == sum(len(sample) for sample in samples)

    if name == sorted(TASKS)[0]:  # a wrong patch scores 0 (one task is enough)
        vllm.requests.clear()
        vllm.script = model(vllm, mini_swe_agent(instance, right=False))
        wrong = await run(client, command_request(instance))
        assert wrong.status == v1.JOB_STATUS_SUCCEEDED and wrong.reward == 0.0
        assert wrong.details["verdict"] == "unresolved" and wrong.details["patch"] == ""


def example_agent(answer: str) -> Callable[[list[dict[str, Any]]], ScriptedReply]:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_calls=[api_tool_call("bash", {"command": "echo $((6 * 7))"}, "call_1")])
        return ScriptedReply(tool_calls=[api_tool_call("finish", {"answer": answer}, "call_2")])

    return script


def example_request(question: str, gold: str) -> v1.RolloutRequest:
    request = v1.RolloutRequest(handler="command")
    request.instance.update(
        {
            "program": {
                "argv": ["/opt/agents/bin/python", "/tmp/openai_agent.py", "--task-file", "$PRORL_TASK_FILE"],
                "files": {"/tmp/openai_agent.py": EXAMPLE_AGENT},
            },
            "verifier": "math",
            "task": {"question": question, "answer": gold},
        }
    )
    return request


async def test_the_openai_sdk_example_agent_in_a_real_sandbox(scripted_llm, start_server, podman_url: str) -> None:
    right = await scripted_llm(example_agent("42"))
    _, client = await start_server(right.base_url)
    result = await run(client, example_request("What is 6 * 7?", "42"))
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    assert result.reward == 1.0 and result.details["calls"] == 2
    # The bash call ran in the sandbox, and its output went back to the model as a tool message.
    tool_messages = [m for m in right.requests[1]["messages"] if m["role"] == "tool"]
    assert tool_messages and "42" in tool_messages[0]["content"]
    assert not job_containers(podman_url, result.job_id)

    wrong = await scripted_llm(example_agent("41"))
    _, client = await start_server(wrong.base_url)
    result = await run(client, example_request("What is 6 * 7?", "42"))
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 0.0


async def test_a_cancelled_program_leaves_no_container(scripted_llm, start_server, podman_url: str) -> None:
    held = await scripted_llm(lambda messages: ScriptedReply("...", delay_s=600))
    _, client = await start_server(held.base_url)
    job = (await client.submit(example_request("What is 6 * 7?", "42"))).job
    await assert_eventually(lambda: len(held.requests) == 1, message="the program never called the model")
    cancelled = await client.cancel(job.job_id, reason="test")
    assert cancelled.status == v1.JOB_STATUS_CANCELLED
    assert not job_containers(podman_url, job.job_id)
