"""End to end: the openai-SDK example agent, unmodified, in a real sandbox (network none), on the
real embedded model through the job's model gateway; its calls come back as exact token chains."""

from __future__ import annotations

from pathlib import Path

import pytest

from prorl_client import v1

pytestmark = [pytest.mark.e2e, pytest.mark.podman]

EXAMPLE_AGENT = (Path(__file__).resolve().parents[2] / "examples" / "agents" / "openai_agent.py").read_text()


async def test_the_example_agent_on_the_embedded_model_has_token_chains(start_server) -> None:
    _, client = await start_server(None)
    request = v1.RolloutRequest(handler="command")
    request.instance.update(
        {
            "program": {
                "argv": [
                    "/opt/agents/bin/python",
                    "/tmp/openai_agent.py",
                    "--max-turns",
                    "3",
                    "--task-file",
                    "$PRORL_TASK_FILE",
                ],
                "files": {"/tmp/openai_agent.py": EXAMPLE_AGENT},
                "timeout_s": 240,
            },
            "verifier": "math",
            "task": {"question": "What is 17 + 25?", "answer": "42"},
        }
    )
    request.sampling.max_tokens = 48
    request.sampling.temperature = 0.7

    events = [event async for event in client.rollout(request)]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    assert result.reward in (0.0, 1.0) and result.details["verifier"] == "math"
    turns = [event.model_turn for event in events if event.HasField("model_turn")]
    assert turns and all(turn.backend_id == "embedded" and turn.token_ids for turn in turns)
    assert any(event.HasField("gateway_opened") for event in events)

    chains = result.trajectory.chains
    assert chains and sum(len(chain.calls) for chain in chains) == len(turns)
    for chain in chains:
        assert len(chain.token_ids) == len(chain.loss_mask) == len(chain.logprobs) == len(chain.policy_versions)
        for span in chain.turn_spans:
            assert all(chain.loss_mask[span.start : span.end])  # the sampled ids, exactly
        assert sum(chain.loss_mask) == sum(span.end - span.start for span in chain.turn_spans)
    assert list(result.trajectory.token_ids) == list(chains[-1].token_ids)
