"""A live server shared by one test module's attacks: a scripted agent per
attack, all rollouts at once over one stream, results by job id.

Each request carries a marker (`attack: NAME`) in the text the agent sees; the
scripted LLM replies with that attack's tool calls, one per turn (the last
one, finish, repeats).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from tests.conftest import make_settings, server_containers
from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply, tool_call_text, turn_index, user_prompt

MARKER = "attack: "

Calls = Sequence[str]
"""The tool-call texts an attacking agent sends, in order."""
RunAll = Callable[[dict[str, v1.RolloutRequest], dict[str, Calls]], Awaitable[dict[str, v1.RolloutResult]]]


def marked(text: str, attack: str) -> str:
    """`text` with the marker that makes the scripted agent play `attack`."""
    return f"{text}\n# {MARKER}{attack}\n"


def bash_call(command: str) -> str:
    return tool_call_text("bash", {"command": command})


def finish_call(answer: str | None = None) -> str:
    return tool_call_text("finish", {} if answer is None else {"answer": answer})


@contextlib.asynccontextmanager
async def live_server(podman_url: str) -> AsyncIterator[RunAll]:
    """Start a scripted LLM and a server; yield `run(requests, attacks)`; stop both, check no container is left."""
    scripts: dict[str, Calls] = {}

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        prompt = user_prompt(messages)
        attack = prompt[prompt.index(MARKER) + len(MARKER) :].split()[0]
        calls = scripts[attack]
        return ScriptedReply(calls[min(turn_index(messages), len(calls) - 1)])

    llm = ScriptedLLMServer(script)
    await llm.start()
    server = ProrlServer(make_settings(podman_url, llm.base_url, phases={"init": 8, "run": 16, "eval": 6}))
    client: Client | None = None
    try:
        await server.start()
        client = Client.connect(server.address)

        async def run(requests: dict[str, v1.RolloutRequest], attacks: dict[str, Calls]) -> dict[str, v1.RolloutResult]:
            assert client is not None
            scripts.update(attacks)
            for job_id, request in requests.items():
                request.job_id = job_id
            results: dict[str, v1.RolloutResult] = {}
            async for item in client.rollout_many(list(requests.values())):
                assert isinstance(item, v1.RolloutEvent), item
                if item.HasField("finished"):
                    results[item.job_id] = item.finished.result
            assert set(results) == set(requests)
            return results

        yield run
    finally:
        if client is not None:
            await client.close()
        await server.stop()
        await llm.stop()
    assert not server_containers(podman_url, server.settings.server.instance_id)
