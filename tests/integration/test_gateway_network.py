"""The HTTP gateway in a real rootless container with `network none`: a program inside
reaches the server's handler at 127.0.0.1 (the sandbox's own loopback), and nothing else
at all: no outside address, no DNS, no interface but lo."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prorl_server.gateway.app import ModelGateway
from prorl_server.llm.base import ChatResult, Sampling
from prorl_server.sandbox.podman import PodmanProvider
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse
from tests.conftest import small_spec

pytestmark = pytest.mark.podman

CLIENT = """
import http.client, json
def call(host, path, body):
    c = http.client.HTTPConnection(host, PORT, timeout=30)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    pieces = []
    while True:
        piece = r.read1(65536) if hasattr(r, "read1") else r.read()
        if not piece:
            break
        pieces.append(piece.decode())
    return {"status": r.status, "type": r.getheader("content-type"), "pieces": pieces}
results = [call("127.0.0.1", "/v1/echo?via=v4", {"n": 1}), call("127.0.0.1", "/v1/stream", {})]
if HAS_V6:
    results.append(call("::1", "/v1/echo?via=v6", {"n": 2}))
print(json.dumps(results))
"""

ISOLATION = """
import json, socket
outcome = {}
for host in ("1.1.1.1", "10.0.2.2", "8.8.8.8"):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, 80))
        outcome[host] = "connected"
    except OSError as exc:
        outcome[host] = exc.errno if exc.errno is not None else type(exc).__name__
    finally:
        s.close()
try:
    socket.getaddrinfo("example.com", 80)
    outcome["dns"] = "resolved"
except OSError as exc:
    outcome["dns"] = type(exc).__name__
outcome["interfaces"] = [name for _, name in socket.if_nameindex()]
print(json.dumps(outcome))
"""


async def test_the_gateway_is_reached_over_loopback_and_nothing_else_is(provider: PodmanProvider) -> None:
    seen: list[HttpRequest] = []

    async def events() -> AsyncIterator[bytes]:
        for word in ("alpha", "beta", "gamma"):
            yield f"data: {word}\n\n".encode()
            await asyncio.sleep(0.05)

    async def handler(request: HttpRequest) -> HttpResponse:
        seen.append(request)
        if request.path == "/v1/stream":
            return HttpResponse(200, {"content-type": "text/event-stream"}, events())
        reply = {"path": request.path, "body": json.loads(request.body)}
        return HttpResponse(200, {"content-type": "application/json"}, json.dumps(reply).encode())

    sandbox = await provider.create(small_spec())
    try:
        gateway = await sandbox.open_relay(handler)
        has_v6 = "::1" in getattr(gateway, "hosts", [])
        # A bash call in progress (and killed at its timeout) does not disturb the relay.
        busy = asyncio.ensure_future(sandbox.bash("sleep 30", timeout_s=3))
        result = await sandbox.python(f"PORT = {gateway.port}\nHAS_V6 = {has_v6}\n{CLIENT}", timeout_s=60)
        assert not result.is_error, result.output
        results = json.loads(result.output)
        assert results[0] == {
            "status": 200,
            "type": "application/json",
            "pieces": [json.dumps({"path": "/v1/echo?via=v4", "body": {"n": 1}})],
        }
        assert results[1]["status"] == 200 and results[1]["type"] == "text/event-stream"
        assert "".join(results[1]["pieces"]) == "data: alpha\n\ndata: beta\n\ndata: gamma\n\n"
        if has_v6:
            assert json.loads(results[2]["pieces"][0]) == {"path": "/v1/echo?via=v6", "body": {"n": 2}}
        assert [request.path for request in seen][:2] == ["/v1/echo?via=v4", "/v1/stream"]
        assert (await busy).timed_out
        again = await sandbox.python(f"PORT = {gateway.port}\nHAS_V6 = False\n{CLIENT}", timeout_s=60)
        assert [item["status"] for item in json.loads(again.output)] == [200, 200], again.output

        # The listener is in the sandbox's own network namespace: this host's loopback
        # does not lead to it.
        marker = f"/from-the-host-{uuid.uuid4().hex}"
        try:
            with socket.create_connection(("127.0.0.1", gateway.port), timeout=3) as outside:
                outside.sendall(f"GET {marker} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                await asyncio.sleep(0.5)
        except OSError:
            pass
        assert marker not in [request.path for request in seen]

        # And nothing but the gateway is reachable from inside.
        isolation = await sandbox.python(ISOLATION, timeout_s=60)
        assert not isolation.is_error, isolation.output
        outcome = json.loads(isolation.output)
        unreachable = (errno.ENETUNREACH, errno.EHOSTUNREACH)
        for host in ("1.1.1.1", "10.0.2.2", "8.8.8.8"):
            assert outcome[host] in unreachable, outcome
        assert outcome["dns"] == "gaierror", outcome
        assert outcome["interfaces"] == ["lo"], outcome

        await gateway.close()
        after = await sandbox.python(
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {gateway.port}), timeout=5)\n"
            "    print('connected')\nexcept ConnectionRefusedError:\n    print('refused')",
            timeout_s=30,
        )
        assert after.output.strip() == "refused"
    finally:
        await sandbox.close()


SDK_PROGRAM = """
import json, openai, anthropic
out = {}
client = openai.OpenAI()
tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
          "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
plain = client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "hi"}])
out["openai"] = plain.choices[0].message.content
called = client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "list"}], tools=tools)
call = called.choices[0].message.tool_calls[0]
out["openai_tool"] = [call.function.name, json.loads(call.function.arguments), called.choices[0].finish_reason]
stream = client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "hi"}], stream=True)
out["openai_stream"] = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
claude = anthropic.Anthropic()
message = claude.messages.create(model="prorl", max_tokens=32, messages=[{"role": "user", "content": "hi"}])
out["anthropic"] = message.content[0].text
with claude.messages.stream(model="prorl", max_tokens=32, messages=[{"role": "user", "content": "hi"}]) as events:
    out["anthropic_stream"] = "".join(events.text_stream)
used = claude.messages.create(model="prorl", max_tokens=32, messages=[{"role": "user", "content": "list"}],
                              tools=[{"name": "bash", "input_schema": tools[0]["function"]["parameters"]}])
block = [b for b in used.content if b.type == "tool_use"][0]
out["anthropic_tool"] = [block.name, block.input, used.stop_reason]
print(json.dumps(out))
"""


async def test_the_official_sdks_work_inside_a_network_less_sandbox(provider: PodmanProvider) -> None:
    """The openai and anthropic SDKs of the image (/opt/agents), streaming and not, with tools and
    without, against the job's model gateway over the sandbox's loopback."""

    async def chat(messages: Any, tools: Any, sampling: Sampling) -> ChatResult:
        if tools:
            return ChatResult(
                text='<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>',
                finish_reason="stop",
                tool_call_parser="hermes",
            )
        return ChatResult(text="hello from the gateway", finish_reason="stop")

    gateway_handler = ModelGateway(chat, default_sampling=Sampling(max_tokens=32, temperature=1.0), api_key="k")
    sandbox = await provider.create(small_spec())
    try:
        gateway = await sandbox.open_relay(gateway_handler)
        environment = (
            f"OPENAI_BASE_URL=http://127.0.0.1:{gateway.port}/v1 OPENAI_API_KEY=k "
            f"ANTHROPIC_BASE_URL=http://127.0.0.1:{gateway.port} ANTHROPIC_API_KEY=k"
        )
        await sandbox.write_file("/tmp/sdks.py", SDK_PROGRAM.encode())
        result = await sandbox.bash(f"env {environment} /opt/agents/bin/python /tmp/sdks.py", timeout_s=120)
        await gateway.close()
    finally:
        await sandbox.close()
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["openai"] == out["openai_stream"] == "hello from the gateway"
    assert out["anthropic"] == out["anthropic_stream"] == "hello from the gateway"
    assert out["openai_tool"] == ["bash", {"command": "ls"}, "tool_calls"]
    assert out["anthropic_tool"] == ["bash", {"command": "ls"}, "tool_use"]
