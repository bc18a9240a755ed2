"""ForkJob on real rootless Podman: a fork's sandbox holds the parent's files at turn k byte for
byte (contents, modes, types, link targets), in its shell's directory and environment,
and a policy that hides a python3 of its own on its PATH does not get to make the snapshot."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_client import v1
from tests.conftest import job_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index
from tests.helpers import math_request

pytestmark = pytest.mark.podman

# Turn 0 lays out files of every kind the snapshot carries, moves the shell and exports a variable,
# and puts a "python3" of its own first on its PATH, which would leave a marker if it ever ran.
SETUP = (
    "mkdir -p /workspace/d/e /workspace/bin && head -c 300000 /dev/urandom > /workspace/d/data.bin "
    "&& printf 'exec 0640\\n' > /workspace/d/e/mode.txt && chmod 0640 /workspace/d/e/mode.txt "
    "&& printf '#!/bin/sh\\necho x\\n' > /workspace/run.sh && chmod 0755 /workspace/run.sh "
    "&& ln -s /etc/hostname /workspace/hn && ln -s d/e /workspace/rel && : > /workspace/empty "
    "&& printf 'tmp file' > /tmp/t.txt && mkdir -p /tmp/cache && printf x > /tmp/cache/c "
    "&& printf '#!/bin/sh\\ntouch /tmp/hijacked\\nexec /usr/bin/python3 \"$@\"\\n' > /workspace/bin/python3 "
    "&& chmod +x /workspace/bin/python3 && export PATH=/workspace/bin:$PATH && export FORK_VAR='a b'\"'\"'c' "
    "&& cd /workspace/d/e"
)
MANIFEST = (
    'echo "cwd=$PWD var=$FORK_VAR"; '
    "find /workspace /tmp -mindepth 1 \\( -name 'prorl-*' -o -name '.prorl-fork-*' \\) -prune -o -printf "
    "'%p %y %m %l\\n' | sort; find /workspace /tmp -name 'prorl-*' -prune -o -type f -print0 | sort -z "
    "| xargs -0 sha256sum"
)
CHANGE = "rm -rf /workspace/d/data.bin /tmp/cache && printf changed > /workspace/new.txt"


def policy(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Parent and forks alike: 0 set up, 1 the manifest, 2 change things, 3 the manifest, 4 finish."""
    turn = turn_index(messages)
    commands = [SETUP, MANIFEST, CHANGE, MANIFEST]
    if turn < len(commands):
        return ScriptedReply(tool_call_text("bash", {"command": commands[turn]}))
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


def outputs(events: list[v1.RolloutEvent]) -> list[str]:
    return [event.tool_result.output for event in events if event.HasField("tool_result")]


async def test_a_fork_starts_from_the_parents_files_byte_for_byte(scripted_llm, start_server, podman_url) -> None:
    llm = await scripted_llm(policy)
    _, client = await start_server(llm.base_url)
    request = math_request("Lay out files.", "42", job_id="pod-parent", max_turns=8, forkable=True)
    parent_events = [event async for event in client.rollout(request)]
    parent = parent_events[-1].finished.result
    assert parent.status == v1.JOB_STATUS_SUCCEEDED, parent.failure
    at_turn_0 = outputs(parent_events)[1]  # the manifest turn 1 printed: the files as turn 0 left them
    assert "cwd=/workspace/d/e var=a b'c" in at_turn_0 and "/workspace/d/data.bin f 644 \n" in at_turn_0

    response = await client.fork_job("pod-parent", 0, [v1.ForkBranch(job_id="pod-f0")])
    assert response.jobs[0].job_id == "pod-f0"
    fork_events = [event async for event in client.watch("pod-f0")]
    fork = fork_events[-1].finished.result
    assert fork.status == v1.JOB_STATUS_SUCCEEDED, fork.failure
    assert (fork.fork_origin.parent_job_id, fork.fork_origin.parent_turn) == ("pod-parent", 0)
    # The fork's first own turn is its turn 1, the manifest: the same listing and hashes as the parent's.
    assert outputs(fork_events)[0] == at_turn_0
    assert "/tmp/hijacked" not in at_turn_0  # the policy's python3 never made a snapshot

    # After turn 2 (files deleted and added): a fork sees that state, not turn 0's.
    await client.fork_job("pod-parent", 2, [v1.ForkBranch(job_id="pod-f2")])
    f2_events = [event async for event in client.watch("pod-f2")]
    assert f2_events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED
    assert outputs(f2_events)[0] == outputs(parent_events)[3]
    assert "data.bin" not in outputs(f2_events)[0] and "/workspace/new.txt" in outputs(f2_events)[0]
    for job_id in ("pod-parent", "pod-f0", "pod-f2"):
        assert not job_containers(podman_url, job_id)
