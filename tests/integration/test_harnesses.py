"""The coding-agent CLIs of localhost/prorl-harnesses, unmodified, in real rootless sandboxes with
network none, through the job's model gateway, each driven by a scripted model on the fake vLLM
(token ids in and out; a byte-level tokenizer with Qwen2.5's chat template, so the prompt shows the
tools the harness offers: tests/harness_model.py). Per harness: a shell episode (a call, then two at
once, then the answer: math reward 1) and a shipped SWE task fixed through the harness's own edit
tool (reward 1; a wrong edit 0), each with its calls checked as exact token chains.

Needs `make images-harnesses`; run by `make test-harnesses` (marker `harnesses`)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import v1
from prorl_server.datasets.swe import load_task, task_dirs
from tests import harness_model
from tests.conftest import job_containers
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.harness_model import Harness

pytestmark = [pytest.mark.podman, pytest.mark.harnesses]

IMAGE = "localhost/prorl-harnesses:latest"
TASK = "more-itertools__more-itertools-10.8.0"
SWE_IMAGE = f"localhost/prorl-harnesses-swe-{TASK.lower()}:latest"

# How each runs headless (docs/handlers.md, "Coding-agent CLIs"), and its tools' names.
HARNESSES = {
    harness.name: harness
    for harness in [
        Harness(
            "claude-code",
            ["claude", "-p", "$PRORL_TASK", "--dangerously-skip-permissions"],
            shell="Bash",
            read="Read",
            edit="Edit",
        ),
        Harness(
            "codex",
            [
                "codex",
                "exec",
                "--skip-git-repo-check",
                "-c",
                'model_providers.prorl.base_url="$OPENAI_BASE_URL"',
                "$PRORL_TASK",
            ],
            shell="exec_command",
            read=None,
            edit=None,
        ),
        Harness(
            "gemini-cli",
            ["gemini", "-p", "$PRORL_TASK", "--yolo"],
            shell="run_shell_command",
            read="read_file",
            edit="replace",
        ),
        Harness("opencode", ["opencode", "run", "$PRORL_TASK"], shell="bash", read="read", edit="edit"),
        Harness(
            "qwen-code",
            ["qwen", "-p", "$PRORL_TASK", "--yolo"],
            shell="run_shell_command",
            read="read_file",
            edit="edit",
        ),
    ]
}


# What starts a new chain in the SWE episode: Claude Code sends its Edit call back with the
# tool's default `replace_all: false` added to the arguments the model gave, a changed reply, so
# the call after an edit starts a new chain (read, edit | final answer).
SWE_CHAINS = {"claude-code": [2, 1]}


@pytest_asyncio.fixture
async def fake_vllm(tmp_path: Path) -> AsyncIterator[tuple[FakeVLLM, Path]]:
    folder = write_tiny_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = harness_model.QWEN25_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    server = FakeVLLM(folder, lambda prompt: "")
    # One token a byte: the harnesses' system prompts and tools alone are 30-80 KB.
    server.max_model_len = 4_000_000
    await server.start()
    yield server, folder
    await server.stop()


async def serve(start_server: Any, vllm: FakeVLLM, folder: Path) -> Any:
    backend = {"id": "vllm", "kind": "vllm", "base_url": vllm.base_url, "tokenizer_path": str(folder)}
    _, client = await start_server(
        None,
        llm={"backends": [backend], "embedded": {"enabled": "never"}},
        sandbox={
            "default_image": IMAGE,
            "allowed_images": [IMAGE, "localhost/prorl-harnesses-swe-*:latest"],
            "tmp_mib": 256,
        },
    )
    return client


def request(harness: Harness, image: str, verifier: str, task: dict[str, Any], **program: Any) -> v1.RolloutRequest:
    rollout = v1.RolloutRequest(handler="command")
    rollout.sandbox.image = image
    instance: dict[str, Any] = {
        "program": {"argv": harness.argv, "timeout_s": 600, **program},
        "verifier": verifier,
        "task": task,
    }
    if verifier == "swe":
        instance["submission"] = "git_diff"
    rollout.instance.update(instance)
    rollout.sampling.max_tokens = 4096
    return rollout


async def run(client: Any, rollout: v1.RolloutRequest) -> v1.RolloutResult:
    events = [event async for event in client.rollout(rollout)]
    result: v1.RolloutResult = events[-1].finished.result
    return result


def decode(vllm: FakeVLLM, ids: list[int]) -> str:
    return str(vllm.tokenizer.decode(ids, skip_special_tokens=False))


def check_chains(result: v1.RolloutResult, vllm: FakeVLLM, layout: list[int]) -> None:
    """The calls as exact token chains: each call's prompt, as the backend got it, is its chain's ids
    up to that call's sample (so each prompt extends the previous prompt and sample of its chain),
    the loss mask covers exactly the samples, and the chains of the calls that offered tools hold
    `layout` calls each, in order (side calls without tools, such as a title, are chains of their own)."""
    prompts = [list(body["prompt"]) for body in vllm.requests]
    with_tools = []
    for chain in result.trajectory.chains:
        ids = list(chain.token_ids)
        assert len(chain.calls) == len(chain.turn_spans)
        for call, span in zip(chain.calls, chain.turn_spans, strict=True):
            assert ids[: span.start] == prompts[call], f"call {call} is not its chain's prefix"
        assert sum(chain.loss_mask) == sum(span.end - span.start for span in chain.turn_spans)
        if "<tools>" in decode(vllm, ids):
            with_tools.append(len(chain.calls))
    assert with_tools == layout, [(list(chain.calls), len(chain.token_ids)) for chain in result.trajectory.chains]


@pytest.mark.parametrize("name", sorted(HARNESSES))
async def test_each_harness_runs_a_shell_episode_in_a_networkless_sandbox(
    name: str, fake_vllm: tuple[FakeVLLM, Path], start_server: Any, podman_url: str
) -> None:
    vllm, folder = fake_vllm
    harness = HARNESSES[name]
    vllm.script = harness_model.script(harness, harness_model.shell_plan(), lambda ids: decode(vllm, ids))
    client = await serve(start_server, vllm, folder)

    result = await run(client, request(harness, IMAGE, "math", {"question": "What is 6 * 7?", "answer": "42"}))
    assert result.status == v1.JOB_STATUS_SUCCEEDED, (result.failure, result.details)
    assert result.reward == 1.0, result.details
    assert result.details["stop_reason"] == "program_exit" and result.details["exit_code"] == 0
    # The commands ran in the sandbox (the model never wrote 42, 333 or 999) and both parallel
    # calls' results came back, each as its own tool result, in the harness's third call.
    episode = [decode(vllm, body["prompt"]) for body in vllm.requests if "<tools>" in decode(vllm, body["prompt"])]
    last = episode[-1]
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last, re.DOTALL)
    assert len(results) == 3, last[-2000:]
    assert re.search(r"(?<![\w-])42\b", results[0]), results  # each harness frames the output its own way
    assert "333" in "".join(results[1:]) and "999" in "".join(results[1:]), results
    check_chains(result, vllm, [3])
    assert not job_containers(podman_url, result.job_id)


@pytest.mark.parametrize("name", sorted(HARNESSES))
async def test_each_harness_fixes_a_shipped_swe_task_with_its_own_edit_tool(
    name: str, fake_vllm: tuple[FakeVLLM, Path], start_server: Any
) -> None:
    vllm, folder = fake_vllm
    harness = HARNESSES[name]
    (task_dir,) = [path for path in task_dirs() if path.name == TASK]
    instance = load_task(task_dir)
    task = {key: value for key, value in instance.items() if key != "patch"}
    task["image"] = SWE_IMAGE
    client = await serve(start_server, vllm, folder)

    plan = harness_model.swe_plan(harness, instance["patch"], "/testbed", right=True)
    vllm.script = harness_model.script(harness, plan, lambda ids: decode(vllm, ids))
    result = await run(client, request(harness, SWE_IMAGE, "swe", task, cwd="/testbed"))
    assert result.status == v1.JOB_STATUS_SUCCEEDED, (result.failure, result.details)
    assert result.reward == 1.0, result.details
    # The edit tool wrote exactly the upstream fix.
    assert result.details["verdict"] == "resolved" and result.details["patch"] == instance["patch"]
    check_chains(result, vllm, SWE_CHAINS.get(name, [len(plan)]))

    vllm.requests.clear()
    wrong = harness_model.swe_plan(harness, instance["patch"], "/testbed", right=False)
    vllm.script = harness_model.script(harness, wrong, lambda ids: decode(vllm, ids))
    result = await run(client, request(harness, SWE_IMAGE, "swe", task, cwd="/testbed"))
    assert result.status == v1.JOB_STATUS_SUCCEEDED, (result.failure, result.details)
    assert result.reward == 0.0 and result.details["verdict"] == "unresolved", result.details
    assert "# not the fix" in str(result.details["patch"])
