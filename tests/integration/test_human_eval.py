"""All 164 HumanEval canonical solutions, submitted through the service's evaluation
path (a scripted fake LLM finishes with them), score 1; mutated ones score 0. On reused
sandboxes (sandbox.reuse): a reset sandbox judges the next job as a new one would, and the
suite is spared most of 170 container starts."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_client import v1
from prorl_server.datasets.human_eval import load_problems, to_task
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, user_prompt

pytestmark = [pytest.mark.podman, pytest.mark.slow]


VARIANT = "    # variant: scored with a mutated solution\n"


def mutate(solution: str) -> str:
    """A plausible wrong solution: every return gives None."""
    return solution.replace("return ", "return None and ")


async def test_canonical_solutions_score_1_and_mutants_0(scripted_llm, start_server) -> None:
    problems = load_problems()
    assert len(problems) == 164
    answers: dict[str, str] = {}
    requests = []
    for problem in problems:
        task = to_task(problem)
        request = v1.RolloutRequest(job_id=f"he-{problem['task_id'].replace('/', '-')}", handler="code")
        request.instance.update(task["instance"])
        requests.append(request)
        answers[problem["prompt"]] = problem["canonical_solution"]
    mutants = problems[:6]
    for problem in mutants:
        request = v1.RolloutRequest(job_id=f"mutant-{problem['task_id'].replace('/', '-')}", handler="code")
        instance = to_task(problem)["instance"]
        request.instance.update({**instance, "prompt": instance["prompt"] + VARIANT})
        requests.append(request)

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        prompt = user_prompt(messages)
        for problem_prompt, solution in answers.items():
            if problem_prompt in prompt:
                answer = mutate(solution) if VARIANT in prompt else solution
                return ScriptedReply(tool_call_text("finish", {"answer": answer}))
        raise AssertionError("unknown problem")

    llm = await scripted_llm(script)
    server, client = await start_server(
        llm.base_url, phases={"init": 8, "run": 32, "eval": 8}, sandbox={"reuse": {"enabled": True}}
    )
    rewards: dict[str, float] = {}
    async for item in client.rollout_many(requests):
        assert isinstance(item, v1.RolloutEvent), item
        if item.HasField("finished"):
            result = item.finished.result
            assert result.status == v1.JOB_STATUS_SUCCEEDED, (item.job_id, result.failure)
            rewards[item.job_id] = result.reward
    assert len(rewards) == 170
    failing = sorted(job for job, reward in rewards.items() if job.startswith("he-") and reward != 1.0)
    assert not failing, f"canonical solutions scored 0: {failing}"
    assert all(rewards[f"mutant-{p['task_id'].replace('/', '-')}"] == 0.0 for p in mutants)
    pools = server._sandboxes
    assert pools is not None and sum(pool.reused for pool in pools.stats()) > len(requests) / 2
