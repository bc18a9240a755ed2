"""Gateway relay benchmark: what relaying an HTTP call through the in-sandbox runtime costs.

A small JSON POST (about 200 bytes each way) is timed by the same client code
(http.client, stdlib) in three setups, p50/p95 over --calls calls after a warm-up:
- direct: a client on the host to an aiohttp server on the host's loopback (no relay);
- gateway: a client inside the sandbox to the gateway at 127.0.0.1, answered by a
  handler in this process (runtime -> Unix socket -> SocketRelay -> handler);
- gateway+upstream: the same, the handler forwarding the call to the aiohttp server;
- model gateway: an OpenAI chat completion through the job's model gateway (relay and
  protocol layer), the model answering at once: the gateway's whole cost per call.
Each is run with one kept-alive connection and with a new connection per call. The
relay's overhead is the gateway figure minus the direct one.

Then the same for a large request, as coding-agent CLIs send (Claude Code: about 76 KB a
call, its system prompt and 24 tools): direct and through the relay with that body, and
an Anthropic Messages call of that body through the job's model gateway (the recorded
Claude Code request under tests/data/harness_requests/ when there is one, else a
request of the same shape and size made here; the output says which).

Usage: python bench/gateway_relay.py [--provider fake|podman] [--calls N]
(fake: the real runtime as a host process, tests/fakes/sandbox_provider.py; podman: a
rootless container with network none, needs `make images`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiohttp import ClientSession, web

from bench.common import default_spec, percentile, podman_provider
from prorl_server.gateway.app import ModelGateway
from prorl_server.llm.base import ChatResult, Sampling
from prorl_server.sandbox.base import Sandbox, SandboxProvider
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse, RelayHandler

BODY_IN_SANDBOX = "/tmp/prorl-bench-body.json"
REPLY = json.dumps({"id": "r-1", "object": "echo", "choices": [{"index": 0, "text": "x" * 120}]}).encode()

CLIENT = """
import http.client, json, time
def run(port, calls, warmup, keep_alive):
    if BODY_FILE:
        with open(BODY_FILE, "rb") as file:
            body = file.read()
    else:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 120}]})
    headers = {"Content-Type": "application/json", "Authorization": "Bearer k",
               "x-api-key": "k", "anthropic-version": "2023-06-01"}
    samples = []
    connection = None
    for index in range(warmup + calls):
        started = time.perf_counter()
        if connection is None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", PATH, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        if not keep_alive:
            connection.close()
            connection = None
        elapsed = time.perf_counter() - started
        assert response.status == 200 and len(data) > 100, (response.status, data)
        if index >= warmup:
            samples.append(elapsed)
    return samples
print(json.dumps({"keep": run(PORT, CALLS, WARMUP, True), "fresh": run(PORT, CALLS, WARMUP, False)}))
"""


def client_code(port: int, calls: int, warmup: int, path: str = "/v1/echo", body_file: str | None = None) -> str:
    return f"PORT = {port}\nCALLS = {calls}\nWARMUP = {warmup}\nPATH = {path!r}\nBODY_FILE = {body_file!r}\n{CLIENT}"


async def on_host(port: int, calls: int, warmup: int, body_file: str | None = None) -> dict[str, list[float]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", client_code(port, calls, warmup, body_file=body_file), stdout=asyncio.subprocess.PIPE
    )
    output, _ = await process.communicate()
    assert process.returncode == 0, output
    samples: dict[str, list[float]] = json.loads(output)
    return samples


async def in_sandbox(
    sandbox: Sandbox, port: int, calls: int, warmup: int, path: str = "/v1/echo", body_file: str | None = None
) -> dict[str, list[float]]:
    result = await sandbox.python(client_code(port, calls, warmup, path, body_file), timeout_s=600)
    assert not result.is_error, result.output
    samples: dict[str, list[float]] = json.loads(result.output)
    return samples


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[int]:
    """An aiohttp server on the host's loopback answering REPLY; yields its port."""

    async def echo(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def provider_of(kind: str) -> AsyncIterator[SandboxProvider]:
    if kind == "podman":
        async with podman_provider(threads=4) as provider:
            yield provider
        return
    from tests.fakes.sandbox_provider import FakeSandboxProvider

    fake = FakeSandboxProvider(instance_id="bench-gateway")
    await fake.start()
    try:
        yield fake
    finally:
        await fake.close()


def model_gateway() -> ModelGateway:
    """The job's model gateway (OpenAI chat completions), over a model that answers at once: what the
    gateway itself costs per call, relay and protocol, beside a direct call to the model (~0)."""

    async def chat(messages: Any, tools: Any, sampling: Sampling) -> ChatResult:
        return ChatResult(text="x" * 120, finish_reason="stop", prompt_tokens=40, completion_tokens=30)

    return ModelGateway(chat, default_sampling=Sampling(max_tokens=64, temperature=1.0), api_key="k")


RECORDED = Path(__file__).resolve().parent.parent / "tests" / "data" / "harness_requests"


def large_request() -> tuple[bytes, str]:
    """A Claude Code Messages request: the first recorded one over 50 KB, else one of its shape made here
    (a system prompt in text blocks with cache_control, 24 tools with long descriptions and schemas,
    one user message, thinking and a max_tokens as it sends them), about 76 KB."""
    for path in sorted(RECORDED.glob("claude-code-*/*.json")):
        recorded = json.loads(path.read_text())
        body = json.dumps(recorded.get("body")).encode()
        if str(recorded.get("path", "")).endswith("/messages") and len(body) > 50_000:
            return body, f"recorded {path.relative_to(RECORDED.parent.parent.parent)}"
    words = "Use this tool to run a command in the user's repository and read what it printed. " * 30
    tools = [
        {
            "name": f"Tool{index}",
            "description": words,
            "input_schema": {
                "type": "object",
                "properties": {
                    name: {"type": "string", "description": f"The {name} of the call, as the tool expects it."}
                    for name in ("command", "description", "file_path", "old_string", "new_string", "pattern")
                },
                "required": ["command"],
            },
        }
        for index in range(24)
    ]
    request = {
        "model": "prorl",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "You are a coding agent."},
            {"type": "text", "text": words, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": tools,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 6 * 7?"}]}],
        "thinking": {"type": "adaptive"},
        "stream": False,
    }
    return json.dumps(request).encode(), "made here, in Claude Code's shape"


def line(label: str, samples: list[float]) -> str:
    return (
        f"  {label:<34} p50 {percentile(samples, 50) * 1e3:7.3f} ms   p95 {percentile(samples, 95) * 1e3:7.3f} ms"
        f"   (n={len(samples)})"
    )


async def main(args: argparse.Namespace) -> None:
    async with upstream() as upstream_port, provider_of(args.provider) as provider, ClientSession() as session:

        async def local(request: HttpRequest) -> HttpResponse:
            return HttpResponse(200, {"content-type": "application/json"}, REPLY)

        async def forward(request: HttpRequest) -> HttpResponse:
            headers = {"content-type": request.headers.get("content-type", "application/json")}
            async with session.post(
                f"http://127.0.0.1:{upstream_port}{request.path}", data=request.body, headers=headers
            ) as reply:
                body = await reply.read()
                return HttpResponse(reply.status, {"content-type": reply.content_type}, body)

        sandbox = await provider.create(default_spec() if args.provider == "podman" else default_spec(image="fake"))
        try:
            results = {"direct (host -> aiohttp)": await on_host(upstream_port, args.calls, args.warmup)}
            cases: list[tuple[str, RelayHandler, str]] = [
                ("gateway (handler in-process)", local, "/v1/echo"),
                ("gateway -> aiohttp upstream", forward, "/v1/echo"),
                ("model gateway, chat completion", model_gateway(), "/v1/chat/completions"),
            ]
            for label, handler, path in cases:
                relay = await sandbox.open_relay(handler)
                hosts = getattr(relay, "hosts", ["127.0.0.1"])
                try:
                    results[label] = await in_sandbox(sandbox, relay.port, args.calls, args.warmup, path)
                finally:
                    await relay.close()
            # The large request: the same body on the host and in the sandbox.
            body, origin = large_request()
            with tempfile.NamedTemporaryFile(suffix=".json") as host_file:
                host_file.write(body)
                host_file.flush()
                large = {
                    "direct (host -> aiohttp)": await on_host(upstream_port, args.calls, args.warmup, host_file.name)
                }
            await sandbox.write_file(BODY_IN_SANDBOX, body)
            large_cases: list[tuple[str, RelayHandler, str]] = [
                ("gateway (handler in-process)", local, "/v1/echo"),
                ("model gateway, Anthropic messages", model_gateway(), "/v1/messages"),
            ]
            for label, handler, path in large_cases:
                relay = await sandbox.open_relay(handler)
                try:
                    large[label] = await in_sandbox(sandbox, relay.port, args.calls, args.warmup, path, BODY_IN_SANDBOX)
                finally:
                    await relay.close()
        finally:
            await sandbox.close()
    print(
        f"gateway relay, provider={args.provider}, {args.calls} calls each (+{args.warmup} warm-up); "
        f"the gateway listened on {', '.join(hosts)}"
    )
    report(results, "a small request (about 200 bytes)")
    report(large, f"a large request ({len(body) / 1000:.1f} KB, {origin})")


def report(results: dict[str, dict[str, list[float]]], what: str) -> None:
    for mode, title in (("keep", "one kept-alive connection"), ("fresh", "a new connection per call")):
        print(f"{what}, {title}:")
        for label, samples in results.items():
            print(line(label, samples[mode]))
        direct, relayed = results["direct (host -> aiohttp)"][mode], results["gateway (handler in-process)"][mode]
        print(
            f"  relay overhead (p50): {(percentile(relayed, 50) - percentile(direct, 50)) * 1e3:.3f} ms"
            f"   (p95): {(percentile(relayed, 95) - percentile(direct, 95)) * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=("fake", "podman"), default="fake")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    asyncio.run(main(parser.parse_args()))
