"""A gateway answer's hop-by-hop headers stop at the hop: on the gateway port (aiohttp) and in the
sandbox's relay alike, the one list drops the fields RFC 9110 section 7.6.1 names (Connection,
Proxy-Connection, Keep-Alive, TE, Transfer-Encoding, Upgrade) and Trailer (each end frames the body
itself); end-to-end headers pass. Each response head is read off a raw socket, as the program
receives it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio

from prorl_server.gateway.aiohttp_adapter import GatewayServer
from prorl_server.sandbox.base import Sandbox, SandboxSpec
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse
from tests.fakes.sandbox_provider import FakeSandboxProvider

BODY = b'{"ok": true}'
FROM_HANDLER = {
    "Connection": "from-handler",
    "Proxy-Connection": "from-handler",
    "Keep-Alive": "from-handler",
    "TE": "from-handler",
    "Transfer-Encoding": "from-handler",
    "Upgrade": "from-handler",
    "Trailer": "from-handler",
}
REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


async def handler(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, {**FROM_HANDLER, "Content-Type": "application/json", "X-End-To-End": "kept"}, BODY)


def head_of(response: bytes) -> dict[str, str]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert body == BODY
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 200")
    return {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}


def assert_end_to_end_only(head: dict[str, str]) -> None:
    assert "from-handler" not in head.values(), head
    for name in ("proxy-connection", "keep-alive", "te", "upgrade", "trailer", "transfer-encoding"):
        assert name not in head, name
    assert head.get("connection", "close") == "close"  # the end's own, for this request
    assert head["content-length"] == str(len(BODY))
    assert head["x-end-to-end"] == "kept" and head["content-type"] == "application/json"


async def test_the_gateway_port_drops_the_hop_by_hop_headers() -> None:
    server = GatewayServer(handler)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(REQUEST)
        response = await reader.read()
        writer.close()
        await writer.wait_closed()
    finally:
        await server.close()
    assert_end_to_end_only(head_of(response))


@pytest_asyncio.fixture
async def sandbox(fake_provider: FakeSandboxProvider) -> AsyncIterator[Sandbox]:
    sandbox = await fake_provider.create(SandboxSpec(image="fake-python", cpus=1.0, memory_mib=256, pids_limit=64))
    yield sandbox
    await sandbox.close()


async def test_the_sandbox_relay_drops_the_same_headers(sandbox: Sandbox) -> None:
    gateway = await sandbox.open_relay(handler)
    program = f"""
import socket
s = socket.create_connection(("127.0.0.1", {gateway.port}), timeout=30)
s.sendall({REQUEST!r})
got = b""
while True:
    piece = s.recv(65536)
    if not piece:
        break
    got += piece
print(got.hex())
"""
    try:
        result = await sandbox.python(program, timeout_s=60)
    finally:
        await gateway.close()
    assert not result.is_error, result.output
    assert_end_to_end_only(head_of(bytes.fromhex(result.output.strip())))
