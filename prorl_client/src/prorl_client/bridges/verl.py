"""verl: an agent loop (`AgentLoopBase.run`) whose output is a prorl rollout.

Written against verl commit b178a3cd (2026-01-29),
verl/experimental/agent_loop/agent_loop.py: verl makes one agent loop instance
per sample and calls `await run(sampling_params, **kwargs)`, kwargs being the
sample's dataset fields (`raw_prompt`, `extra_info`, `uid`, ...; `uid` is the
same for the n samples of one prompt: their GRPO group). It returns an
`AgentLoopOutput` (pydantic): `prompt_ids`, `response_ids`, `response_mask` (1
on generated tokens, 0 on tool responses; response part only),
`response_logprobs`, `reward_score`, `num_turns`, `metrics`, `extra_fields`.
With a `reward_score` on every sample verl takes it as the score (`rm_scores`)
and runs no reward function of its own.

verl sees one sample at a time, so an infrastructure failure cannot be taken
out of its group's baseline here: it gets a zero `response_mask` (no gradient)
and reward 0, and `extra_fields["prorl_masked"]` says so (filter such groups,
e.g. with DAPO's group filtering, where the bias matters).

The agent loop class must live in a module of yours (verl instantiates it by its
import path), so this module gives its body, not the class:

    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
    from prorl_client.bridges.verl import VerlRollouts

    rollouts = VerlRollouts("prorl.example:50051")

    @register("prorl")
    class ProrlAgentLoop(AgentLoopBase):
        async def run(self, sampling_params, **kwargs):
            return AgentLoopOutput(**await rollouts.run(sampling_params, **kwargs))
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prorl_client import v1
from prorl_client._client import Client
from prorl_client.bridges._core import Rollout, Sample, Task, neutral_rewards, run_batch, sampling_params

TaskOf = Callable[[Mapping[str, Any]], Task]
"""The prorl task of one sample, from its dataset fields (verl's run kwargs)."""


def task_from_extra_info(fields: Mapping[str, Any]) -> Task:
    """The default: `extra_info["prorl"]` holds `{"handler": ..., "instance": {...}}`."""
    spec = fields["extra_info"]["prorl"]
    return Task(handler=str(spec["handler"]), instance=dict(spec["instance"]))


class VerlRollouts:
    """Runs verl's samples as prorl jobs; one client per event loop (a channel cannot
    move between loops, and each verl agent-loop worker has its own)."""

    def __init__(
        self,
        target: str | Sequence[str],
        task_of: TaskOf = task_from_extra_info,
        *,
        template: v1.RolloutRequest | None = None,
        pad_token_id: int = 0,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.target = target
        self.task_of = task_of
        self.template = template
        self.pad_token_id = pad_token_id
        self.labels = {"bridge": "verl", **(labels or {})}
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Client] = weakref.WeakKeyDictionary()

    def client(self) -> Client:
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients[loop] = Client.connect(self.target)
        return self._clients[loop]

    async def close(self) -> None:
        """Close the client of the running loop (the others close with their loops)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    async def run(self, sampling: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
        """The fields of an `AgentLoopOutput` for one sample."""
        group = str(fields.get("uid") or fields.get("index") or "")
        (rollout,) = await run_batch(
            self.client(),
            [Sample(self.task_of(fields), group_id=f"verl-{group}")],
            template=self.template,
            sampling=sampling_params(sampling),
            labels=self.labels,
            pad_token_id=self.pad_token_id,
        )
        return agent_loop_output(rollout)


def agent_loop_outputs(rollouts: Sequence[Rollout]) -> list[dict[str, Any]]:
    """AgentLoopOutput fields of a whole batch (`run_batch`'s rollouts), for an own
    `agent_loop_manager_class` that runs a batch at once: there a masked sample gets
    its group's mean reward (`neutral_rewards`) instead of 0."""
    return [agent_loop_output(r, reward=reward) for r, reward in zip(rollouts, neutral_rewards(rollouts), strict=True)]


def agent_loop_output(rollout: Rollout, *, reward: float | None = None) -> dict[str, Any]:
    """An AgentLoopOutput's fields, `metrics` as a dict (pydantic builds AgentLoopMetrics
    from it). reward: the score to give (default: its reward, 0 when masked)."""
    result = rollout.result
    if reward is None:
        reward = 0.0 if rollout.masked else rollout.reward
    timing = result.timing if result is not None else v1.Timing()
    return {
        "prompt_ids": rollout.prompt_ids,
        "response_ids": rollout.response_ids,
        "response_mask": rollout.response_mask,
        "response_logprobs": rollout.response_logprobs,
        "reward_score": reward,
        # MoE routing replay (R3): [tokens][layers][top_k] from the prompt's first token; None without.
        "routed_experts": rollout.routed_experts,
        # verl counts chat messages (user, assistant and tool), not model turns.
        "num_turns": len(result.trajectory.messages) if result is not None else 0,
        "metrics": {
            "generate_sequences": timing.llm.ToTimedelta().total_seconds(),
            "tool_calls": timing.tools.ToTimedelta().total_seconds(),
        },
        "extra_fields": {
            "prorl_job_id": rollout.job_id,
            "prorl_status": rollout.status,
            "prorl_masked": rollout.masked,
            "prorl_reason": rollout.reason,
            "prorl_policy_versions": rollout.turn_policy_versions,
        },
    }
