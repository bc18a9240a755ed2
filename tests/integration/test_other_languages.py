"""Go and C++ trainers: clients built from proto/ with Debian's toolchains, run against a live server."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, user_prompt

pytestmark = [pytest.mark.podman, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def add_numbers(messages: list[dict[str, Any]]) -> ScriptedReply:
    a, b = map(int, re.findall(r"\d+", user_prompt(messages))[:2])
    return ScriptedReply(tool_call_text("finish", {"answer": str(a + b)}))


async def run(*command: str, timeout_s: float = 300) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(timeout_s):
        output, _ = await process.communicate()
    return process.returncode or 0, output.decode()


@pytest.mark.parametrize("language", ["go", "cpp"])
async def test_client_streams_events_and_rewards(language: str, scripted_llm, start_server) -> None:
    code, output = await run("bash", str(EXAMPLES / language / "build.sh"))
    assert code == 0, output
    llm = await scripted_llm(add_numbers)
    server, _ = await start_server(llm.base_url)
    binary = str(EXAMPLES / language / "bin" / "rollout-client")
    command = [binary, "-server", server.address, "-tasks", "3"] if language == "go" else [binary, server.address, "3"]

    code, output = await run(*command)

    assert code == 0, output
    rewards = re.findall(r"^reward (\S+) (\S+)$", output, re.MULTILINE)
    assert len(rewards) == 3 and all(float(reward) == 1.0 for _, reward in rewards), output
    for job, _ in rewards:
        events = re.findall(rf"^{re.escape(job)} #\d+ ", output, re.MULTILINE)
        assert len(events) >= 4, output  # queued, phase started x3, model turn, ..., finished


async def test_go_cluster_client_submits_watches_and_gets_rewards(scripted_llm, start_server) -> None:
    code, output = await run("bash", str(EXAMPLES / "go" / "build.sh"))
    assert code == 0, output
    llm = await scripted_llm(add_numbers)
    server, _ = await start_server(llm.base_url)

    code, output = await run(str(EXAMPLES / "go" / "bin" / "cluster-client"), "-targets", server.address, "-tasks", "3")

    assert code == 0, output
    rewards = re.findall(r"^reward (\S+) (\S+)$", output, re.MULTILINE)
    assert len(rewards) == 3 and all(float(reward) == 1.0 for _, reward in rewards), output
    for job, _ in rewards:
        seqs = [int(seq) for seq in re.findall(rf"^{re.escape(job)} #(\d+) \w+$", output, re.MULTILINE)]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 4, output  # each event once, in order
        assert re.search(rf"^{re.escape(job)} #{seqs[-1]} finished$", output, re.MULTILINE), output
    assert re.search(r"^resumed 0$", output, re.MULTILINE), output  # one server, never lost
