"""The example agent programs (examples/agents/) run as they are, as subprocesses,
against a scripted OpenAI endpoint over real HTTP, configured only by the
environment a job gets (OPENAI_BASE_URL, OPENAI_API_KEY)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply, api_tool_call

OPENAI_AGENT = Path(__file__).resolve().parents[3] / "examples" / "agents" / "openai_agent.py"


async def run_agent(server: ScriptedLLMServer, *args: str, cwd: Path) -> tuple[int, str, str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(cwd),
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "sk-job-key",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(OPENAI_AGENT), *args, cwd=cwd, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    # A hang guard only: on a loaded machine the SDK's import alone can take a minute.
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=300)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def call(name: str, call_id: str, **arguments: str) -> ScriptedReply:
    return ScriptedReply(tool_calls=[api_tool_call(name, arguments, call_id)], finish_reason="tool_calls")


async def test_openai_agent_runs_a_bash_call_then_finishes_with_the_answer(tmp_path: Path) -> None:
    server = ScriptedLLMServer(
        [
            call("bash", "call_1", command="printf 'hello\\n' > note.txt && wc -c note.txt"),
            call("finish", "call_2", answer="note.txt has 6 bytes"),
        ]
    )
    await server.start()
    try:
        status, stdout, stderr = await run_agent(server, "How many bytes does note.txt have?", cwd=tmp_path)
    finally:
        await server.stop()

    assert status == 0, stderr
    assert stdout.splitlines()[-1] == "note.txt has 6 bytes"
    assert (tmp_path / "note.txt").read_text() == "hello\n"  # the command really ran, in the cwd
    first, second = server.requests
    assert first["model"] == "prorl" and "stream" not in first
    assert [tool["function"]["name"] for tool in first["tools"]] == ["bash", "finish"]
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert first["messages"][1]["content"] == "How many bytes does note.txt have?"
    assistant, result = second["messages"][2:]
    assert assistant["role"] == "assistant" and assistant["tool_calls"][0]["id"] == "call_1"
    assert result == {"role": "tool", "tool_call_id": "call_1", "content": "exit status 0\n6 note.txt\n"}
    assert server.authorizations == ["Bearer sk-job-key"] * 2


async def test_openai_agent_reads_the_task_file_and_is_told_to_use_a_tool_when_it_does_not(tmp_path: Path) -> None:
    (tmp_path / "task.md").write_text("Say hi.\n")
    server = ScriptedLLMServer(["Let me think.", call("finish", "call_1", answer="hi")])
    await server.start()
    try:
        status, stdout, stderr = await run_agent(server, "--task-file", "task.md", cwd=tmp_path)
    finally:
        await server.stop()

    assert status == 0, stderr
    assert stdout.splitlines()[-1] == "hi"
    messages = server.requests[1]["messages"]
    assert messages[1] == {"role": "user", "content": "Say hi.\n"}
    assert messages[2] == {"role": "assistant", "content": "Let me think."}
    assert messages[3]["role"] == "user" and "Call a tool" in messages[3]["content"]


async def test_openai_agent_fails_when_the_endpoint_refuses(tmp_path: Path) -> None:
    server = ScriptedLLMServer([ScriptedReply(status=401, error_message="bad key")])
    await server.start()
    try:
        status, stdout, stderr = await run_agent(server, "anything", cwd=tmp_path)
    finally:
        await server.stop()

    assert status != 0 and stdout == ""
    assert "bad key" in stderr
    assert len(server.requests) == 1  # the SDK does not retry a refusal
