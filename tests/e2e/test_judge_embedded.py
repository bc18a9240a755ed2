"""The model judge with a real model: the embedded SmolLM2-135M (llama.cpp, greedy at
temperature 0) grades the adversarial suite's answers, and judges a rubric job end to end
through a real server (`judge.embedded`), the policy being scripted.

A 135M model is a weak judge: in the runs here its replies were not in the format (it wrote
its own `<<<END RESPONSE ...>>>` marker: reward 0, a verdict of its own). What must hold
whatever it writes is the suite's claim: no attack scores more than the same answer without
it. Every attack is put on the half-right answer (the one an attack could move either way);
one judgement took about 300 s on this 2-core machine at a load average of 37, so the test
has an hour's limit. It prints how the replies were read, for the record.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.llm.base import BackendInfo
from prorl_server.llm.llama_cpp_backend import EMBEDDED_MODEL_NAME, LlamaCppBackend
from prorl_server.llm.router import BackendRouter
from prorl_server.verifiers.judge import JudgeOptions, ModelJudge
from tests.adversarial.test_judge_injection import ATTACKS, BASES, CAP, QUESTION, RUBRIC
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, tool_call_text

pytestmark = [pytest.mark.e2e]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def judge() -> AsyncIterator[ModelJudge]:
    info = BackendInfo(
        id="judge-embedded", kind="embedded", base_url="in-process", model=EMBEDDED_MODEL_NAME, max_in_flight=1
    )
    backend = LlamaCppBackend(info, model_path=None, context_length=4096, threads=2)
    await backend.start()
    router = BackendRouter(health_interval_s=0)
    router.add(backend, managed=True)
    try:
        yield ModelJudge(router, JudgeOptions(max_tokens=32, max_answer_chars=CAP, timeout_s=3600))
    finally:
        await router.close()


@pytest.mark.timeout(3600)
async def test_no_attack_scores_more_than_the_answer_without_it_on_a_real_judge(judge: ModelJudge) -> None:
    bases = {"half": BASES["half"]}
    base_reward: dict[str, float] = {}
    verdicts: collections.Counter[str] = collections.Counter()
    replies: list[str] = []
    for name, answer in bases.items():
        judgement = await judge.judge("e2e", rubric=RUBRIC, question=QUESTION, answer=answer)
        base_reward[name] = judgement.reward
        verdicts[judgement.verdict] += 1
        replies.append(f"base {name}: {judgement.verdict} {judgement.reward} {judgement.reply!r}")
    higher: list[str] = []
    for attack, make in ATTACKS.items():
        for name, answer in bases.items():
            judgement = await judge.judge("e2e", rubric=RUBRIC, question=QUESTION, answer=make(answer))
            verdicts[judgement.verdict] += 1
            replies.append(f"{attack} on {name}: {judgement.verdict} {judgement.reward} {judgement.reply[:80]!r}")
            if judgement.reward > base_reward[name]:
                higher.append(f"{attack} on {name}: {judgement.reward} > {base_reward[name]} ({judgement.reply!r})")
    print("verdicts of the real judge:", dict(verdicts))
    print("\n".join(replies))
    assert sum(verdicts.values()) == len(bases) * (len(ATTACKS) + 1)
    assert not higher, "attacks that scored more than the answer alone:\n" + "\n".join(higher)


def _settings() -> Any:
    return load_settings(
        None,
        environ={},
        overrides={
            "server": {"port": 0, "instance_id": instance_id("judge-e2e"), "shutdown_grace_s": 0},
            "jobs": {"store": False},
            "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
            "judge": {"embedded": True, "max_tokens": 32, "health_interval_s": 0, "timeout_s": 1800},
        },
    )


@pytest.mark.timeout(3600)
async def test_a_rubric_job_is_judged_by_the_embedded_judge_through_the_server() -> None:
    answer = BASES["right"]
    policy = ScriptedChatBackend([tool_call_text("finish", {"answer": answer})], backend_id="policy")
    provider = FakeSandboxProvider(instance_id=instance_id("judge-e2e"))
    server = ProrlServer(_settings(), sandbox_provider=provider, backends=[policy])
    await server.start()
    try:
        async with Client.connect(server.address) as client:
            request = v1.RolloutRequest(handler="rubric")
            criteria = [{"name": c.name, "description": c.description} for c in RUBRIC.criteria]
            request.instance.update({"question": QUESTION, "criteria": criteria, "reference": RUBRIC.reference})
            result = None
            async for event in client.rollout(request):
                if event.HasField("finished"):
                    result = event.finished.result
    finally:
        await server.stop()
    assert result is not None and result.status == v1.JOB_STATUS_SUCCEEDED, result
    details = result.details
    print("the embedded judge:", details["verdict"], result.reward, repr(details["judge"]["reply"]))
    assert details["verdict"] in ("judged", "judge_unparseable", "judge_refused", "judge_echoed_answer")
    judge = details["judge"]
    assert judge["backend"] == "judge-embedded" and judge["completion_tokens"] > 0 and judge["latency_s"] > 0
    assert judge["prompt_tokens"] > 100 and judge["reply"]
    # The policy's backend played its one turn and judged nothing.
    assert len(policy.requests) == 1
    assert 0.0 <= result.reward <= 1.0
