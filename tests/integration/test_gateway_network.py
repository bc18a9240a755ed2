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

import pytest

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
        gateway = await sandbox.open_gateway(handler)
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
