"""A math rollout end to end on a fake vLLM, for a Qwen3 and a Llama 3.1 model: the real server,
the real chat templates and the models' own tool-call formats; reward 1 and exact token ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prorl_client import v1
from tests.fakes.token_servers import FakeVLLM
from tests.unit.llm.model_families import FAMILIES

pytestmark = pytest.mark.podman

CALLS = {
    "qwen3-thinking": lambda name, args: (
        f"<think>\nI will use {name}.\n</think>\n\n<tool_call>\n"
        + json.dumps({"name": name, "arguments": args})
        + "\n</tool_call>"
    ),
    "llama3.1": lambda name, args: json.dumps({"name": name, "parameters": args}),
}


@pytest.mark.parametrize("name", list(CALLS))
async def test_math_rollout_on_a_fake_vllm(name: str, tmp_path: Path, start_server: Any) -> None:
    family = next(f for f in FAMILIES if f.name == name)
    folder = family.write_tokenizer(tmp_path / "tokenizer")
    write_call = CALLS[name]

    def script(prompt: list[int]) -> str:
        if len(fake.requests) == 1:  # the first turn computes; the second answers what it read
            return write_call("python", {"code": "print(6 * 7)"})
        assert "42" in fake.tokenizer.decode(prompt[len(fake.requests[0]["prompt"]) :], skip_special_tokens=False)
        return write_call("finish", {"answer": "42"})

    fake = FakeVLLM(folder, script)
    fake.eos = fake.tokenizer.token_to_id(family.stop)
    await fake.start()
    try:
        backend = {
            "id": "fake-vllm",
            "kind": "vllm",
            "base_url": fake.base_url,
            "tokenizer_path": str(folder),
            "tool_call_parser": family.parser,
        }
        _, client = await start_server(None, llm={"backends": [backend], "embedded": {"enabled": "never"}})
        request = v1.RolloutRequest(handler="math")
        request.instance.update({"question": "What is 6 * 7?", "answer": "42"})
        events = [e async for e in client.rollout(request)]
    finally:
        await fake.stop()
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    assert result.reward == 1.0 and result.details["format_errors"] == 0
    trajectory = result.trajectory
    prompts = [r["prompt"] for r in fake.requests]
    turns = [e.model_turn for e in events if e.HasField("model_turn")]
    assert len(prompts) == len(turns) == 2
    assert list(trajectory.token_ids) == prompts[-1] + list(turns[-1].token_ids)
    assert prompts[1][: len(prompts[0]) + len(turns[0].token_ids)] == prompts[0] + list(turns[0].token_ids)
    assert [(s.start, s.end) for s in trajectory.turn_spans] == [
        (len(p), len(p) + len(t.token_ids)) for p, t in zip(prompts, turns, strict=True)
    ]
    assert all(t.logprobs_mode == v1.LOGPROBS_MODE_PROCESSED for t in turns)
    assert [m.role for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert "42" in trajectory.messages[3].content
