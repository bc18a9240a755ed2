"""The agent harnesses in the default sandbox image (sandbox_images/python): the
venv /opt/agents has mini-swe-agent and the openai and anthropic SDKs, the
system python3 (the one the SWE verifier runs tests with) does not see them,
and /opt/agents/run_mini.py drives mini-swe-agent to edit a repository and
submit, against a scripted OpenAI endpoint."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import uuid

import pytest

from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply, api_tool_call

pytestmark = pytest.mark.podman

IMAGE = "localhost/prorl-python:latest"
SANDBOX_USER = os.environ.get("PRORL_TEST_SANDBOX_USER", "prorl")
HARNESS_MODULES = ("openai", "anthropic", "litellm", "minisweagent", "pydantic", "httpx")


def podman(*args: str) -> list[str]:
    """A podman command line, as the sandbox user (whose rootless storage holds the images) when run as root."""
    if os.geteuid() != 0:
        return ["podman", *args]
    account = pwd.getpwnam(SANDBOX_USER)
    return [
        "runuser", "-u", SANDBOX_USER, "--",
        "env", f"XDG_RUNTIME_DIR=/run/user/{account.pw_uid}", f"HOME={account.pw_dir}",
        "podman", *args,
    ]  # fmt: skip


async def run_in_image(script: str, *, network: str = "none", env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs a bash script in a fresh container of IMAGE; returns its exit status and output."""
    name = f"prorl-test-agents-{uuid.uuid4().hex[:8]}"
    options = [f"--env={key}={value}" for key, value in (env or {}).items()]
    process = await asyncio.create_subprocess_exec(
        *podman("run", "--rm", f"--name={name}", f"--network={network}", *options, IMAGE, "bash", "-c", script),
        cwd="/", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout=180)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        remove = await asyncio.create_subprocess_exec(
            *podman("rm", "--force", "--ignore", name), cwd="/",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await remove.wait()
    assert process.returncode is not None
    return process.returncode, output.decode()


async def test_the_harnesses_are_in_their_own_venv_and_the_system_python_does_not_see_them() -> None:
    modules = json.dumps(HARNESS_MODULES)
    status, output = await run_in_image(
        f"""
        set -e
        test -x /opt/agents/bin/mini && test -x /opt/agents/bin/python
        test "$(command -v mini)" = /usr/local/bin/mini
        test "$(command -v python3)" = /usr/bin/python3
        /opt/agents/bin/python -c 'import anthropic, litellm, minisweagent, openai; print("venv", openai.__version__)'
        python3 -c 'import importlib.util as u, sys; print("system sees", [m for m in {modules} if u.find_spec(m)])'
        python3 -c 'import sys; print("system prefix", sys.prefix)'
        python3 -m pytest --version
        mini --help | grep -q -- --yolo
        /opt/agents/run_mini.py --help | grep -q -- --task-file
        echo ALL-OK
        """,
        env={"MSWEA_SILENT_STARTUP": "1"},
    )
    assert status == 0, output
    assert "venv 3." in output
    assert "system sees []" in output and "system prefix /usr" in output
    assert "ALL-OK" in output


async def test_run_mini_edits_the_repository_and_submits_against_a_scripted_endpoint() -> None:
    def bash(text: str, command: str, call_id: str) -> ScriptedReply:
        return ScriptedReply(text, [api_tool_call("bash", {"command": command}, call_id)], finish_reason="tool_calls")

    server = ScriptedLLMServer(
        [
            bash("Replace hello with goodbye.", "sed -i 's/hello/goodbye/' greeting.txt", "call_1"),
            bash("Done: submitting the diff.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff", "call_2"),
        ]
    )
    await server.start()
    try:
        # The host's network, only for this test: the container reaches the scripted
        # endpoint on the host's loopback (sandboxes get theirs through the gateway).
        status, output = await run_in_image(
            """
            cd /tmp && git init -q repo && cd repo && echo 'hello world' > greeting.txt
            git add . && git -c user.name=t -c user.email=t@t commit -qm base
            /opt/agents/run_mini.py --workdir /tmp/repo 'Say goodbye instead of hello in greeting.txt'
            echo "EXIT=$?"
            echo "FILE=$(cat greeting.txt)"
            """,
            network="host",
            env={"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "sk-job-key"},
        )
    finally:
        await server.stop()

    assert status == 0, output
    assert "EXIT=0" in output and "FILE=goodbye world" in output, output
    assert "+goodbye world" in output  # the submission: the diff the agent printed
    assert "exit_status=Submitted model_calls=2" in output
    assert len(server.requests) == 2
    assert all(r["model"] == "prorl" and "stream" not in r for r in server.requests)
    assert [tool["function"]["name"] for tool in server.requests[0]["tools"]] == ["bash"]
    assert server.requests[1]["messages"][-1]["tool_call_id"] == "call_1"
    assert server.authorizations == ["Bearer sk-job-key"] * 2
