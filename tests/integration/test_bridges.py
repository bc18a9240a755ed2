"""The trainer bridges (prorl_client.bridges) against a live server: real gRPC on a real
port, the fake sandbox provider, a fake vLLM whose replies are tokenised by a byte-level
tokenizer, so trajectories have exact ids and log-probs (-0.5 per sampled token).

verl, SkyRL and slime need GPUs, Ray or Megatron and are not installed: their types are
copied below field by field from their sources (commit and file named on each), and
the bridges' output is checked against them with the framework's own consistency
rules. TRL is real when installed (trl==1.16.0, CPU): one GRPOTrainer step on a tiny
random Llama over the test tokenizer's vocabulary, its completions from this server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypedDict

import pydantic
import pytest
import pytest_asyncio
from prorl_client.bridges import RequestRejected, Rollout, Sample, Task, neutral_rewards, run_batch, split
from prorl_client.bridges import skyrl as skyrl_bridge
from prorl_client.bridges import slime as slime_bridge
from prorl_client.bridges import trl as trl_bridge
from prorl_client.bridges import verl as verl_bridge

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.factory import build_backend
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import tool_call_text
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer

SAMPLED_LOGPROB = -0.5  # what the fake vLLM reports for every sampled token


class Policy:
    """The scripted policy, by the question in its prompt: first a python call, then its
    answer (41 for a question saying "wrong"; for a "coin" question 42 and 41 by turns)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.asked: dict[str, int] = {}

    def __call__(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        if "<tool_response>" not in text and "<|im_start|>tool" not in text:
            return tool_call_text("python", {"code": "print(6 * 7)"})
        if "coin" in text:  # right the first time this prompt comes, wrong the next: groups of two differ
            self.asked[text] = self.asked.get(text, 0) + 1
            return tool_call_text("finish", {"answer": "42" if self.asked[text] % 2 else "41"})
        return tool_call_text("finish", {"answer": "41" if "wrong" in text else "42"})


@dataclass
class Served:
    target: str
    client: Client
    vllm: FakeVLLM
    folder: Path


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    folder = write_tiny_tokenizer(tmp_path / "tok")
    vllm = FakeVLLM(folder, Policy(folder))
    await vllm.start()
    backend = build_backend(
        BackendSettings(id="v", kind="vllm", base_url=vllm.base_url, tokenizer_path=str(folder)),
        timeout_s=10,
        max_retries=0,
    )
    provider = FakeSandboxProvider(instance_id=instance_id("bridge"), images={"localhost/prorl-python:latest": None})
    settings = load_settings(
        None,
        environ={},
        overrides={
            "server": {"port": 0, "instance_id": instance_id("server"), "shutdown_grace_s": 0},
            "jobs": {"store": False},
            "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0, "max_retries": 0},
        },
    )
    server = ProrlServer(settings, sandbox_provider=provider, backends=[backend])
    await server.start()
    client = Client.connect(server.address)
    try:
        yield Served(server.address, client, vllm, folder)
    finally:
        await client.close()
        await server.stop()
        await vllm.stop()
    assert provider.busy == 0
    assert not leftovers(provider)


def leftovers(provider: FakeSandboxProvider) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"prorl-{provider.instance_id}-*"))


def math(question: str) -> Task:
    """A math task; one whose question mentions an outage asks for a sandbox image that
    does not exist: its sandbox cannot start, an infrastructure failure."""
    request = None
    if "outage" in question:
        request = v1.RolloutRequest()
        request.sandbox.image = "localhost/prorl-swe-missing:latest"
    return Task("math", {"question": question, "answer": "42"}, request=request)


def max_turns(turns: int) -> v1.RolloutRequest:
    template = v1.RolloutRequest()
    template.limits.max_turns = turns
    return template


def check_aligned(rollout: Rollout, vllm_prompts: list[list[int]]) -> None:
    """The cut every trainer relies on: the prompt is the first request's prompt, the
    response holds the sampled ids (mask 1, their log-probs) and the tool output in between
    (mask 0, log-prob 0), all lists aligned."""
    assert rollout.result is not None
    trajectory = rollout.result.trajectory
    assert rollout.prompt_ids + rollout.response_ids == list(trajectory.token_ids)
    assert rollout.prompt_ids in vllm_prompts
    n = len(rollout.response_ids)
    assert len(rollout.response_mask) == len(rollout.response_logprobs) == len(rollout.response_policy_versions) == n
    assert rollout.response_mask[0] == 1 and 0 in rollout.response_mask  # model, tool, model
    for bit, logprob in zip(rollout.response_mask, rollout.response_logprobs, strict=True):
        assert logprob == (SAMPLED_LOGPROB if bit else 0.0)
    start = len(rollout.prompt_ids)
    for span in trajectory.turn_spans:
        assert rollout.response_mask[span.start - start : span.end - start] == [1] * (span.end - span.start)
    assert sum(rollout.response_mask) == sum(span.end - span.start for span in trajectory.turn_spans)


async def test_a_batch_comes_back_in_order_cut_into_prompt_and_response(served: Served) -> None:
    samples = [
        Sample(math("What is 6 * 7?"), "g0"),
        Sample(math("What is 6 * 7, wrong?"), "g0"),
        Sample(math("What is 6 * 7 during an outage?"), "g0"),
        Sample(math("Again, what is 6 * 7?"), "g1"),
    ]
    rollouts = await run_batch(served.client, samples, template=max_turns(4), labels={"step": "3"})
    prompts = [request["prompt"] for request in served.vllm.requests]

    assert [r.group_id for r in rollouts] == ["g0", "g0", "g0", "g1"]
    assert [(r.reward, r.masked, r.status) for r in rollouts] == [
        (1.0, False, "succeeded"),
        (0.0, False, "succeeded"),
        (0.0, True, "failed"),
        (1.0, False, "succeeded"),
    ]
    for rollout in (rollouts[0], rollouts[1], rollouts[3]):
        check_aligned(rollout, prompts)
        assert rollout.turn_policy_versions == [0, 0] and rollout.stop_reason == "finish"
    outage = rollouts[2]
    assert outage.reason == "sandbox_image" and set(outage.response_mask) == {0}
    # The failure is left out of its group: the group's mean stands in for it.
    assert neutral_rewards(rollouts) == [1.0, 0.0, 0.5, 1.0]
    job = await served.client.get_job(rollouts[0].job_id)
    assert job.group_id == "g0" and job.labels["step"] == "3"


async def test_a_policy_failure_keeps_its_reward_and_tokens(served: Served) -> None:
    template = max_turns(1)  # the python call uses the only turn: no answer, reward 0
    (rollout,) = await run_batch(served.client, [Sample(math("What is 6 * 7?"), "g")], template=template)
    assert not rollout.masked and rollout.reward == 0.0 and rollout.stop_reason == "max_turns"
    assert sum(rollout.response_mask) > 0


async def test_an_invalid_request_is_raised_not_trained_on(served: Served) -> None:
    with pytest.raises(RequestRejected, match="INVALID_ARGUMENT"):
        await run_batch(served.client, [Sample(Task("no-such-family", {}), "g")])


def test_a_result_without_tokens_gets_a_masked_placeholder() -> None:
    result = v1.RolloutResult(status=v1.JOB_STATUS_FAILED)
    result.failure.kind = v1.FAILURE_KIND_INFRASTRUCTURE
    result.failure.reason = "sandbox_start"
    rollout = split("j", "g", result, pad_token_id=7)
    assert (rollout.prompt_ids, rollout.response_ids, rollout.response_mask) == ([7], [7], [0])
    assert rollout.masked and rollout.reason == "sandbox_start"


def test_tool_tokens_carry_the_version_of_the_turn_before_them() -> None:
    result = v1.RolloutResult(status=v1.JOB_STATUS_SUCCEEDED, reward=1.0)
    t = result.trajectory
    t.token_ids.extend(range(10))
    t.loss_mask.extend([0, 0, 1, 1, 0, 0, 1, 1, 1, 0])
    t.logprobs.extend([0, 0, -1, -1, 0, 0, -1, -1, -1, 0])
    t.turn_spans.add(turn=0, start=2, end=4, policy_version=3)
    t.turn_spans.add(turn=1, start=6, end=9, policy_version=4)
    rollout = split("j", "g", result)
    assert rollout.prompt_ids == [0, 1]
    assert rollout.response_policy_versions == [3, 3, 3, 3, 4, 4, 4, 4]


def test_the_bridges_import_without_any_trainer_installed() -> None:
    # A fresh interpreter where the trainers and their heavy dependencies cannot be imported.
    blocked = ["trl", "verl", "skyrl", "slime", "torch", "transformers", "datasets", "ray", "megatron"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "import prorl_client.bridges.trl, prorl_client.bridges.verl, prorl_client.bridges.skyrl\n"
        "import prorl_client.bridges.slime\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- SkyRL ------------------------------------------------------------------------------
# Copied from NovaSky-AI/SkyRL a9564572 (2026-08-21), skyrl/train/generators/base.py
# (torch tensors and RoutedExpertIndices as Any).


@dataclass
class TrajectoryID:
    instance_id: str
    repetition_id: int


class GeneratorInput(TypedDict):
    prompts: list[list[dict[str, str]]]
    env_classes: list[str]
    env_extras: list[dict[str, Any]] | None
    sampling_params: dict[str, Any] | None
    trajectory_ids: list[TrajectoryID] | None
    batch_metadata: Any


class GeneratorOutput(TypedDict):
    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float] | list[list[float]]
    loss_masks: list[list[int]]
    stop_reasons: list[str] | None
    rollout_metrics: dict[str, Any] | None
    rollout_logprobs: list[list[float]] | None
    trajectory_ids: list[TrajectoryID] | None
    trajectory_generation_times: list[float] | None
    trajectory_time_splits: dict[str, list[float]] | None
    rollout_expert_indices: list[Any] | None
    is_last_step: list[bool] | None
    env_metrics: list[dict[str, Any]] | None
    pixel_values: list[Any] | None
    image_grid_thw: list[Any] | None


def skyrl_input(questions: list[str], n: int) -> GeneratorInput:
    """As skyrl/train/generators/utils.py `prepare_generator_input` builds it: each prompt n times."""
    return {
        "prompts": [[{"role": "user", "content": q}] for q in questions for _ in range(n)],
        "env_classes": ["math" for _ in questions for _ in range(n)],
        "env_extras": [{"instance": {"question": q, "answer": "42"}} for q in questions for _ in range(n)],
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_generate_length": 256},
        "trajectory_ids": [TrajectoryID(f"uid{i}", r) for i in range(len(questions)) for r in range(n)],
        "batch_metadata": None,
    }


async def test_skyrl_generator_output(served: Served) -> None:
    generator = skyrl_bridge.ProrlGenerator(
        served.client, lambda prompt, env_class, extras: math(extras["instance"]["question"]), template=max_turns(4)
    )
    batch = skyrl_input(["What is 6 * 7?", "6 * 7 in an outage?"], 2)
    output = await generator.generate(batch)

    assert set(output) == set(GeneratorOutput.__annotations__)
    n = len(batch["prompts"])
    for key in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "rollout_logprobs", "stop_reasons"):
        assert len(output[key]) == n, key
    for ids, mask, logprobs in zip(
        output["response_ids"], output["loss_masks"], output["rollout_logprobs"], strict=True
    ):
        assert len(ids) == len(mask) == len(logprobs)  # SkyRL: the masks and log-probs cover the response only
    assert output["rewards"] == [1.0, 1.0, 0.0, 0.0]
    assert [sum(m) > 0 for m in output["loss_masks"]] == [True, True, False, False]
    assert output["stop_reasons"][:2] == ["finish", "finish"]
    assert output["rollout_metrics"] is not None and output["rollout_metrics"]["prorl/infrastructure_failures"] == 2
    assert output["trajectory_ids"] == batch["trajectory_ids"]
    assert served.vllm.requests[0]["temperature"] == 0.7 and served.vllm.requests[0]["top_p"] == 0.9
    assert (await served.client.get_job(output["env_metrics"][0]["prorl_job_id"])).group_id == "skyrl-uid0"


# --- verl -------------------------------------------------------------------------------
# Copied from volcengine/verl b178a3cd (2026-01-29), verl/experimental/agent_loop/agent_loop.py.
# Unknown fields are forbidden here (verl ignores them) so a misspelt one is caught.


class AgentLoopMetrics(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}


async def test_verl_agent_loop_output(served: Served) -> None:
    rollouts = verl_bridge.VerlRollouts(
        served.target, lambda fields: math(fields["raw_prompt"][0]["content"]), template=max_turns(4)
    )
    sampling = {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def run(question: str) -> AgentLoopOutput:
        # The dataset fields verl passes to run(): the prompt and the reward columns, uid among them.
        fields = {
            "raw_prompt": [{"role": "user", "content": question}],
            "extra_info": {"prorl": {"handler": "math", "instance": {"question": question, "answer": "42"}}},
            "uid": "u1",
            "index": 0,
        }
        return AgentLoopOutput(**await rollouts.run(sampling, **fields))

    ok, wrong, down = await asyncio.gather(run("What is 6 * 7?"), run("6 * 7, wrong?"), run("6 * 7, outage?"))
    await rollouts.close()

    assert [o.reward_score for o in (ok, wrong, down)] == [1.0, 0.0, 0.0]
    for output in (ok, wrong):
        assert output.response_logprobs is not None
        assert len(output.response_ids) == len(output.response_mask) == len(output.response_logprobs)
        assert output.response_mask[0] == 1 and 0 in output.response_mask  # generated, tool response, generated
        assert output.num_turns == 6, output  # system, user, assistant, tool, assistant, tool (finish)
        assert output.extra_fields["prorl_policy_versions"] == [0, 0]
    assert set(down.response_mask) == {0} and down.extra_fields["prorl_masked"] is True
    assert served.vllm.requests[0]["temperature"] == 0.6
    assert {(await served.client.get_job(o.extra_fields["prorl_job_id"])).group_id for o in (ok, down)} == {"verl-u1"}


# --- slime ------------------------------------------------------------------------------
# Copied from THUDM/slime 624b824a (2026-08-21), slime/utils/types.py `Sample` (the fields
# a rollout function fills, with slots so that setting any other attribute fails) and
# slime/rollout/data_source.py `get_samples` (each prompt n_samples_per_prompt times).


@dataclass(slots=True)
class SlimeSample:
    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


class SlimeDataSource:
    def __init__(self, prompts: list[SlimeSample], n_samples_per_prompt: int) -> None:
        self.prompts = prompts
        self.n = n_samples_per_prompt

    def get_samples(self, num_samples: int) -> list[list[SlimeSample]]:
        return [
            [dataclasses.replace(prompt, group_index=g, index=g * self.n + k) for k in range(self.n)]
            for g, prompt in enumerate(self.prompts[:num_samples])
        ]


def slime_prompt(question: str) -> SlimeSample:
    return SlimeSample(
        prompt=question, label="42", metadata={"handler": "math", "instance": {"question": question, "answer": "42"}}
    )


async def test_slime_rollout_function_fills_samples(served: Served) -> None:
    generate_rollout = slime_bridge.RolloutFunction(served.target, lambda s: math(s.prompt), template=max_turns(4))
    args = SimpleArgs(rollout_batch_size=2, rollout_temperature=0.8, rollout_max_response_len=200)
    source = SlimeDataSource([slime_prompt("6 * 7?"), slime_prompt("6 * 7, wrong?")], 2)
    # slime calls it from its own thread; the bridge runs an event loop of its own there.
    groups = await asyncio.to_thread(generate_rollout, args, 5, source, False)
    # and one group with an outage among its samples
    mixed = [[slime_prompt("6 * 7?"), slime_prompt("6 * 7, outage?")]]
    await asyncio.to_thread(generate_rollout.fill, args, 6, mixed)

    samples = [s for group in [*groups, *mixed] for s in group]
    for s in samples:
        # slime's RolloutManager asserts this before training on a sample
        assert s.loss_mask is not None and s.rollout_log_probs is not None
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length < len(s.tokens)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert [s.status for s in samples] == [SlimeSample.Status.COMPLETED] * 5 + [SlimeSample.Status.ABORTED]
    assert [s.remove_sample for s in samples] == [False] * 5 + [True]
    assert samples[0].weight_versions == ["0", "0"] and "42" in samples[0].response
    assert served.vllm.requests[0]["temperature"] == 0.8 and served.vllm.requests[0]["max_tokens"] == 200
    with pytest.raises(NotImplementedError, match="eval_samples"):
        generate_rollout(args, 5, source, evaluation=True)


@dataclass
class SimpleArgs:
    rollout_batch_size: int
    rollout_temperature: float
    rollout_max_response_len: int
    rollout_top_p: float = 1.0


# --- TRL --------------------------------------------------------------------------------


def test_trl_output_without_trl() -> None:
    ok = split("a", "g", _tiny_result(reward=1.0))
    failed = _tiny_result(reward=0.0)
    failed.status, failed.failure.kind = v1.JOB_STATUS_FAILED, v1.FAILURE_KIND_INFRASTRUCTURE
    output = trl_bridge.batch_output([ok, split("b", "g", failed)])
    assert output["prompt_ids"] == [[1, 2], [1, 2]] and output["completion_ids"] == [[3, 4], [3, 4]]
    assert output["env_mask"] == [[1, 1], [0, 0]] and output["logprobs"] == [[-0.5, -0.5], [-0.5, -0.5]]
    assert trl_bridge.prorl_reward(["x", "y"], prorl_reward=output["prorl_reward"]) == [1.0, None]


def _tiny_result(reward: float) -> v1.RolloutResult:
    result = v1.RolloutResult(status=v1.JOB_STATUS_SUCCEEDED, reward=reward)
    result.trajectory.token_ids.extend([1, 2, 3, 4])
    result.trajectory.loss_mask.extend([0, 0, 1, 1])
    result.trajectory.logprobs.extend([0, 0, -0.5, -0.5])
    return result


async def test_trl_grpo_trainer_trains_one_step_on_the_servers_rollouts(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    torch = pytest.importorskip("torch")
    trained = await asyncio.to_thread(_train_one_step, served, tmp_path)
    rollout_func, before, after, history = trained

    assert len(rollout_func.last) == 4
    prompts = [request["prompt"] for request in served.vllm.requests]
    for rollout in rollout_func.last:
        check_aligned(rollout, prompts)
    # Each prompt twice in a row (TRL's RepeatSampler): one group each, one right, one wrong.
    rewards = [r.reward for r in rollout_func.last]
    assert sorted(rewards[:2]) == sorted(rewards[2:]) == [0.0, 1.0]
    groups = [r.group_id for r in rollout_func.last]
    assert groups[0] == groups[1] != groups[2] == groups[3]
    logged = next(entry for entry in history if "reward" in entry)
    assert logged["reward"] == pytest.approx(0.5)
    assert logged["rewards/prorl_reward/mean"] == pytest.approx(0.5)
    # The trainer counted exactly the server's prompts and sampled (env_mask 1) tokens.
    last = rollout_func.last
    assert logged["num_tokens"] == sum(len(r.prompt_ids) + sum(r.response_mask) for r in last)
    assert logged["completions/mean_length"] == pytest.approx(sum(sum(r.response_mask) for r in last) / 4)
    assert any(not torch.equal(before[name], after[name]) for name in before)


def _train_one_step(served: Served, tmp_path: Path) -> tuple[trl_bridge.RolloutFunc, Any, Any, list[dict[str, Any]]]:
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(served.folder / "tokenizer.json"))
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rollout_func = trl_bridge.RolloutFunc(
        served.target,
        lambda prompt: Task("math", {"question": prompt, "answer": "42"}),
        template=max_turns(4),
        pad_token_id=tokenizer.pad_token_id,
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        dataloader_num_workers=0,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": ["Toss a coin: what is 6 * 7?", "Toss a coin again: 6 * 7?"]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_bridge.prorl_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.train()
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    return rollout_func, before, after, list(trainer.state.log_history)
