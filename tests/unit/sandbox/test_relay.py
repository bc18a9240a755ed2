"""The HTTP relay into a sandbox, without Podman: the real runtime in a local process (the fake provider)
listens on loopback and relays to a handler in this test; the clients are programs run
inside the sandbox with `sandbox.python` (http.client, urllib, raw sockets)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from prorl_server.errors import SandboxError
from prorl_server.sandbox.base import Sandbox, SandboxSpec
from prorl_server.sandbox.podman.exec_runtime import ExecRuntime
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse, RelayHandle
from prorl_server.sandbox.runtime.socket_relay import SocketRelay
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.helpers import assert_eventually

SPEC = SandboxSpec(image="fake-python", cpus=1.0, memory_mib=256, pids_limit=64)
WAIT_S = 20.0


@pytest_asyncio.fixture
async def sandbox(fake_provider: FakeSandboxProvider) -> AsyncIterator[Sandbox]:
    sandbox = await fake_provider.create(SPEC)
    yield sandbox
    await sandbox.close()


async def inside(sandbox: Sandbox, relay: RelayHandle, code: str) -> str:
    """Run `code` in the sandbox's Python with PORT bound to the relay's port; its output."""
    result = await sandbox.python(f"PORT = {relay.port}\n{code}", timeout_s=60)
    assert not result.is_error, result.output
    return result.output


def fetch(path: str) -> str:
    """Code that prints the body of a GET of `path` from the relay, from inside."""
    return f"import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:%d{path}' % PORT).read())"


def json_response(value: Any, status: int = 200, **headers: str) -> HttpResponse:
    return HttpResponse(status, {"content-type": "application/json", **headers}, json.dumps(value).encode())


def refused(port: int) -> bool:
    """Whether 127.0.0.1:port refuses connections (the fake sandbox shares this host's loopback)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_a_json_request_and_its_response_round_trip(sandbox: Sandbox) -> None:
    seen: list[HttpRequest] = []

    async def handler(request: HttpRequest) -> HttpResponse:
        seen.append(request)
        return json_response({"echo": json.loads(request.body or b"null"), "n": len(seen)}, 201, **{"x-trace": "t-1"})

    relay = await sandbox.open_relay(handler)
    assert isinstance(relay, SocketRelay) and 0 < relay.port < 65536 and not relay.closed
    assert relay.url == f"http://127.0.0.1:{relay.port}"
    output = await inside(
        sandbox,
        relay,
        """
import http.client, json, urllib.request
c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
c.request("POST", "/v1/chat/completions?stream=false&x=%C3%A9", body=json.dumps({"model": "m", "q": "hé"}),
          headers={"Content-Type": "application/json", "Authorization": "Bearer k", "X-Custom": "v1"})
r = c.getresponse()
first = {"status": r.status, "headers": {k.lower(): v for k, v in r.getheaders()}, "body": json.loads(r.read())}
c.request("GET", "/v1/models")  # the same connection: kept alive
again = c.getresponse()
second = {"status": again.status, "body": json.loads(again.read())}
with urllib.request.urlopen("http://127.0.0.1:%d/v1/other" % PORT, timeout=30) as u:
    third = {"status": u.status, "body": json.loads(u.read())}
print(json.dumps([first, second, third]))
""",
    )
    first, second, third = json.loads(output)
    assert first["status"] == 201 and first["body"] == {"echo": {"model": "m", "q": "hé"}, "n": 1}
    assert first["headers"]["x-trace"] == "t-1" and first["headers"]["content-type"] == "application/json"
    assert int(first["headers"]["content-length"]) == len(json.dumps(first["body"]))
    assert "transfer-encoding" not in first["headers"]
    assert second == {"status": 201, "body": {"echo": None, "n": 2}}
    assert third == {"status": 201, "body": {"echo": None, "n": 3}}
    post, get, other = seen
    assert post.method == "POST" and post.path == "/v1/chat/completions?stream=false&x=%C3%A9"
    assert json.loads(post.body) == {"model": "m", "q": "hé"}
    assert post.headers["authorization"] == "Bearer k" and post.headers["x-custom"] == "v1"
    assert post.headers["content-type"] == "application/json"
    assert post.headers["content-length"] == str(len(post.body))
    assert all(name == name.lower() for name in post.headers)
    assert get.method == "GET" and get.path == "/v1/models" and get.body == b""
    assert other.path == "/v1/other"
    await relay.close()


async def test_a_streamed_body_arrives_piece_by_piece_as_it_is_produced(sandbox: Sandbox) -> None:
    """The handler yields the next event only after the program inside acknowledged the
    previous one (with a request of its own): a relay that held pieces back would stall."""
    acks = [asyncio.Event() for _ in range(4)]
    log: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        for index, word in enumerate(["one", "two", "three"]):
            if index:
                try:
                    await asyncio.wait_for(acks[index].wait(), WAIT_S)
                except TimeoutError:
                    word = "never-acknowledged"
            log.append(f"sent {word}")
            yield f"data: {word}\n\n".encode()
        await asyncio.wait_for(acks[3].wait(), WAIT_S)
        yield b"data: [DONE]\n\n"

    async def handler(request: HttpRequest) -> HttpResponse:
        if request.path.startswith("/ack/"):
            number = int(request.path.rsplit("/", 1)[1])
            log.append(f"ack {number}")
            acks[number].set()
            return HttpResponse(204)
        return HttpResponse(200, {"content-type": "text/event-stream", "cache-control": "no-cache"}, events())

    relay = await sandbox.open_relay(handler)
    output = await inside(
        sandbox,
        relay,
        """
import http.client, json, urllib.request
c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
c.request("POST", "/v1/chat/completions", body=b"{}", headers={"Content-Type": "application/json"})
r = c.getresponse()
events = []
while True:
    line = r.readline().decode()
    if line == "\\n":
        continue
    assert line.startswith("data: "), line
    events.append(line[6:].strip())
    if events[-1] == "[DONE]":
        break
    urllib.request.urlopen("http://127.0.0.1:%d/ack/%d" % (PORT, len(events)), timeout=30).read()
assert r.read() == b"\\n"  # the body ended right after the last event
print(json.dumps({"events": events, "encoding": r.getheader("transfer-encoding"),
                  "type": r.getheader("content-type")}))
""",
    )
    assert json.loads(output) == {
        "events": ["one", "two", "three", "[DONE]"],
        "encoding": "chunked",
        "type": "text/event-stream",
    }
    assert log == ["sent one", "ack 1", "sent two", "ack 2", "sent three", "ack 3"]
    await relay.close()


async def test_twenty_requests_are_served_at_once(sandbox: Sandbox) -> None:
    """Every handler call waits until all twenty are in flight: only concurrent relaying ends."""
    in_flight = 0
    peak = 0
    all_in = asyncio.Event()

    async def handler(request: HttpRequest) -> HttpResponse:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == 20:
            all_in.set()
        try:
            await asyncio.wait_for(all_in.wait(), WAIT_S)
        finally:
            in_flight -= 1
        return json_response({"path": request.path, "body": request.body.decode()})

    relay = await sandbox.open_relay(handler)
    output = await inside(
        sandbox,
        relay,
        """
import json, urllib.request
from concurrent.futures import ThreadPoolExecutor
def call(i):
    body = ("payload %d " % i * 50).encode()
    request = urllib.request.Request("http://127.0.0.1:%d/c/%d" % (PORT, i), data=body, method="POST")
    with urllib.request.urlopen(request, timeout=40) as response:
        return response.status, json.loads(response.read())
with ThreadPoolExecutor(20) as pool:
    print(json.dumps(list(pool.map(call, range(20)))))
""",
    )
    results = json.loads(output)
    assert [status for status, _ in results] == [200] * 20
    assert [body for _, body in results] == [{"path": f"/c/{i}", "body": f"payload {i} " * 50} for i in range(20)]
    assert peak == 20
    await relay.close()


async def test_a_program_that_goes_away_cancels_its_handler(sandbox: Sandbox) -> None:
    started = {"stream": asyncio.Event(), "slow": asyncio.Event()}
    cancelled = {"stream": asyncio.Event(), "slow": asyncio.Event()}

    async def endless() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        started["stream"].set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled["stream"].set()
            raise
        yield b"data: never\n\n"

    async def handler(request: HttpRequest) -> HttpResponse:
        if request.path == "/stream":
            return HttpResponse(200, {"content-type": "text/event-stream"}, endless())
        started["slow"].set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled["slow"].set()
            raise
        raise AssertionError("unreachable")

    relay = await sandbox.open_relay(handler)
    assert isinstance(relay, SocketRelay)
    output = await inside(
        sandbox,
        relay,
        """
import http.client, socket
c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
c.request("GET", "/stream")
r = c.getresponse()
print(r.status, r.readline().decode().strip())
c.sock.shutdown(socket.SHUT_RDWR)  # mid-stream
r.close(); c.close()
s = socket.create_connection(("127.0.0.1", PORT), timeout=30)
s.sendall(b"GET /slow HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
""",
    )
    assert output.split() == ["200", "data:", "first"]
    await asyncio.wait_for(started["stream"].wait(), WAIT_S)
    await asyncio.wait_for(cancelled["stream"].wait(), WAIT_S)
    await asyncio.wait_for(started["slow"].wait(), WAIT_S)
    assert not cancelled["slow"].is_set()
    await inside(sandbox, relay, "s.close()")  # gone before any answer
    await asyncio.wait_for(cancelled["slow"].wait(), WAIT_S)
    await assert_eventually(
        lambda: relay.in_flight == 0, timeout_s=WAIT_S, message="a relayed request stayed in flight"
    )
    await relay.close()


async def test_a_failing_handler_answers_500_and_the_relay_goes_on(sandbox: Sandbox) -> None:
    async def broken_body() -> AsyncIterator[bytes]:
        yield b"partial"
        raise RuntimeError("the stream broke")

    async def handler(request: HttpRequest) -> HttpResponse:
        if request.path == "/boom":
            raise ValueError("secret detail that stays on the server")
        if request.path == "/broken-stream":
            return HttpResponse(200, {"content-type": "text/plain"}, broken_body())
        if request.path == "/not-a-response":
            wrong: Any = {"status": 200}
            return wrong  # type: ignore[no-any-return]
        if request.path == "/bad-status":
            return HttpResponse(42)
        return json_response({"fine": True})

    relay = await sandbox.open_relay(handler)
    output = await inside(
        sandbox,
        relay,
        """
import http.client, json
def get(path):
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    try:
        return [r.status, r.getheader("content-type"), r.read().decode()]
    except http.client.IncompleteRead as exc:
        return [r.status, "incomplete", exc.partial.decode()]
print(json.dumps([get("/boom"), get("/broken-stream"), get("/not-a-response"), get("/bad-status"), get("/fine")]))
""",
    )
    boom, broken, not_a_response, bad_status, fine = json.loads(output)
    assert not_a_response[0] == 500 and "TypeError" in not_a_response[2]
    assert bad_status[0] == 500 and "TypeError" in bad_status[2]
    assert boom[:2] == [500, "application/json"]
    error = json.loads(boom[2])["error"]
    assert "ValueError" in error["message"] and "secret" not in error["message"]
    assert broken == [200, "incomplete", "partial"]  # cut, not ended as if complete
    assert fine == [200, "application/json", '{"fine": true}']
    await relay.close()


async def test_a_chunked_request_body_reaches_the_handler_whole(sandbox: Sandbox) -> None:
    seen: list[HttpRequest] = []

    async def handler(request: HttpRequest) -> HttpResponse:
        seen.append(request)
        return json_response({"size": len(request.body)})

    relay = await sandbox.open_relay(handler)
    output = await inside(
        sandbox,
        relay,
        """
import http.client, json, socket
c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
pieces = (("piece %d;" % i).encode() * 1000 for i in range(5))
c.request("POST", "/upload", body=pieces, encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
r = c.getresponse()
chunked = [r.status, json.loads(r.read())]
c.request("PUT", "/continue", body=b"x" * 10, headers={"Expect": "100-continue"})
r = c.getresponse()
expect = [r.status, json.loads(r.read())]
s = socket.create_connection(("127.0.0.1", PORT), timeout=30)
s.sendall(b"POST /big HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 70000000\\r\\n\\r\\n")
too_big = s.recv(4096).split(b"\\r\\n", 1)[0].decode()
print(json.dumps([chunked, expect, too_big]))
""",
    )
    chunked, expect, too_big = json.loads(output)
    expected = b"".join(f"piece {i};".encode() * 1000 for i in range(5))
    assert chunked == [200, {"size": len(expected)}] and expect == [200, {"size": 10}]
    assert too_big == "HTTP/1.1 413 Request Entity Too Large"
    upload, cont = seen
    assert upload.body == expected and upload.method == "POST"
    assert upload.headers["content-length"] == str(len(expected)) and "transfer-encoding" not in upload.headers
    assert cont.method == "PUT" and cont.body == b"x" * 10
    assert [request.path for request in seen] == ["/upload", "/continue"]  # the 413 never reached it
    await relay.close()


async def test_the_runtimes_refusals_speak_the_format_of_the_api_called(sandbox: Sandbox) -> None:
    """A 413 (or a malformed head) answered by the runtime itself is in the error format of the
    API the path names, as the server's gateway answers: the SDKs of Anthropic and Google read it
    (a Gemini path used to get OpenAI's shape)."""
    relay = await sandbox.open_relay(lambda request: asyncio.sleep(0, json_response({})))
    output = await inside(
        sandbox,
        relay,
        r"""
import json, socket
def refusal(path, extra=""):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=30)
    s.sendall(("POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: 70000000\r\n\r\n" % (path, extra)).encode())
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < 10:
        piece = s.recv(65536)
        if not piece:
            break
        answer += piece
    head, body = answer.split(b"\r\n\r\n", 1)
    return [int(head.split(b" ")[1]), json.loads(body)]
paths = ["/v1/chat/completions", "/v1/messages", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
         "/v1/models/m:countTokens"]
print(json.dumps([refusal(p) for p in paths] + [refusal(paths[2], "Bad Header\r\n")]))
""",
    )
    openai_, anthropic_, google, google_count, google_bad = json.loads(output)
    assert openai_[0] == 413 and openai_[1]["error"]["code"] == "request_too_large"
    assert anthropic_ == [413, {"type": "error", "error": {"type": "request_too_large", "message": ANY_TEXT}}]
    for status, body in (google, google_count):
        assert status == 413 and body["error"]["code"] == 413 and body["error"]["status"] == "INVALID_ARGUMENT"
        assert "gateway.max_request_bytes" in body["error"]["message"]
    assert google_bad[0] == 400 and google_bad[1]["error"] == {
        "code": 400,
        "message": ANY_TEXT,
        "status": "INVALID_ARGUMENT",
    }
    await relay.close()


class _AnyText(str):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)

    __hash__ = str.__hash__


ANY_TEXT = _AnyText()


async def test_large_bodies_cross_whole_both_ways(sandbox: Sandbox) -> None:
    """Megabytes each way: a request body sent in slices, a response split into chunk frames,
    and a streamed piece larger than one frame."""

    async def handler(request: HttpRequest) -> HttpResponse:
        digest = hashlib.sha256(request.body).hexdigest()
        payload = bytes(range(256)) * (12 * 4096)  # 12 MiB
        if request.path == "/whole":
            return HttpResponse(200, {"x-digest": digest}, payload)

        async def pieces() -> AsyncIterator[bytes]:
            yield payload[:7]
            yield payload[7:]

        return HttpResponse(200, {"x-digest": digest}, pieces())

    relay = await sandbox.open_relay(handler)
    output = await inside(
        sandbox,
        relay,
        """
import hashlib, http.client, json, os
body = os.urandom(5 << 20)
results = [hashlib.sha256(body).hexdigest()]
c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=60)
for path in ("/whole", "/streamed"):
    c.request("POST", path, body=body)
    r = c.getresponse()
    data = r.read()
    results.append([r.status, r.getheader("x-digest"), r.getheader("content-length"), len(data),
                    hashlib.sha256(data).hexdigest()])
print(json.dumps(results))
""",
    )
    sent, whole, streamed = json.loads(output)
    expected = hashlib.sha256(bytes(range(256)) * (12 * 4096)).hexdigest()
    assert whole == [200, sent, str(12 << 20), 12 << 20, expected]
    assert streamed == [200, sent, None, 12 << 20, expected]
    await relay.close()


async def test_garbage_gets_400_and_the_runtime_serves_on(sandbox: Sandbox) -> None:
    calls: list[str] = []

    async def handler(request: HttpRequest) -> HttpResponse:
        calls.append(request.path)
        return json_response({"ok": True})

    relay = await sandbox.open_relay(handler)
    output = await inside(
        sandbox,
        relay,
        r"""
import json, os, socket
def exchange(data, half_close=False):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=30)
    s.sendall(data)
    if half_close:
        s.shutdown(socket.SHUT_WR)
    answer = b""
    while True:
        more = s.recv(65536)
        if not more:
            break
        answer += more
    s.close()
    return answer.split(b"\r\n", 1)[0].decode("latin-1")
print(json.dumps([
    exchange(b"\x00\xff\xfe garbage \x01\x02\r\n\r\n"),
    exchange(os.urandom(3000) + b"\n\n"),
    exchange(b"no newline at all", half_close=True),
    exchange(b"GET / HTTP/9.9\r\n\r\n"),
    exchange(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n"),
    exchange(b"GET / HTTP/1.1\r\nContent-Length: abc\r\n\r\n"),
    exchange(b"GET / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"),
    exchange(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n"),
    exchange(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    exchange(b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"),
    exchange(b"GET / HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 200 + b"\r\n"),
    exchange(b"GET /fine HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
]))
""",
    )
    statuses = [line.split(" ", 2)[1] if line.startswith("HTTP/1.1 ") else line for line in json.loads(output)]
    assert statuses == ["400", "400", "400", "505", "400", "400", "400", "501", "400", "414", "431", "200"]
    assert calls == ["/fine"]
    assert (await sandbox.bash("echo alive", timeout_s=10)).output == "alive\n"
    assert (await sandbox.health()).ok
    await relay.close()


async def test_the_runtimes_descriptors_stay_out_of_the_agents_processes(sandbox: Sandbox) -> None:
    """A shell started while the relay listens and serves a connection inherits none of
    its sockets (nor the server's): they are close-on-exec."""
    release = asyncio.Event()
    holding = asyncio.Event()

    async def handler(request: HttpRequest) -> HttpResponse:
        holding.set()
        await asyncio.wait_for(release.wait(), WAIT_S)
        return json_response({"held": True})

    relay = await sandbox.open_relay(handler)
    client = asyncio.ensure_future(inside(sandbox, relay, fetch("/")))
    await asyncio.wait_for(holding.wait(), WAIT_S)
    fds = await sandbox.bash("ls -l /proc/$$/fd /proc/self/fd", timeout_s=10)  # the first bash: started now
    release.set()
    assert "held" in await client
    assert "socket:" not in fds.output and "pipe:" not in fds.output, fds.output
    await relay.close()


async def test_closing_the_relay_stops_the_listener(sandbox: Sandbox) -> None:
    async def handler(request: HttpRequest) -> HttpResponse:
        return json_response({"path": request.path})

    relay = await sandbox.open_relay(handler)
    port = relay.port
    await inside(
        sandbox,
        relay,
        """
import http.client
kept = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
kept.request("GET", "/first")
assert kept.getresponse().read() == b'{"path": "/first"}'
""",
    )
    await relay.close()
    await relay.close()  # idempotent
    assert relay.closed
    output = await inside(
        sandbox,
        relay,
        """
import socket
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=10)
    print("connected")
except ConnectionRefusedError:
    print("refused")
try:
    kept.request("GET", "/again")  # the connection kept alive before the close is cut too
    print(kept.getresponse().status)
except (ConnectionError, OSError, http.client.HTTPException) as exc:
    print("cut")
""",
    )
    assert output.split() == ["refused", "cut"]
    # The port is free again: a new relay can take it.
    again = await sandbox.open_relay(handler, port=port)
    assert again.port == port
    assert "/second" in await inside(sandbox, again, fetch("/second"))
    with pytest.raises(SandboxError) as taken:
        await sandbox.open_relay(handler, port=port)
    assert "EADDRINUSE" in taken.value.message or "in use" in taken.value.message
    await again.close()


async def test_closing_the_sandbox_closes_its_relays_first(fake_provider: FakeSandboxProvider) -> None:
    sandbox = await fake_provider.create(SPEC)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def handler(request: HttpRequest) -> HttpResponse:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    relay = await sandbox.open_relay(handler)
    idle = await sandbox.open_relay(handler)
    client = asyncio.ensure_future(
        sandbox.python(f"import urllib.request\nurllib.request.urlopen('{relay.url}/wait').read()", timeout_s=60)
    )
    await asyncio.wait_for(started.wait(), WAIT_S)
    await sandbox.close()
    assert cancelled.is_set() and relay.closed and idle.closed
    assert refused(relay.port) and refused(idle.port)
    await asyncio.gather(client, return_exceptions=True)
    with pytest.raises(SandboxError, match="closed"):
        await sandbox.open_relay(handler)


async def test_the_official_openai_sdk_streams_through_the_relay(sandbox: Sandbox) -> None:
    """What agent programs use: the openai SDK (when the sandbox's Python has it), streaming."""
    probe = await sandbox.python("import openai", timeout_s=60)
    if probe.is_error:
        pytest.skip("the openai package is not installed in this Python")

    async def chunks() -> AsyncIterator[bytes]:
        for index, text in enumerate(["Hel", "lo"]):
            delta = {"role": "assistant", "content": text} if index == 0 else {"content": text}
            chunk = {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
            }
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def handler(request: HttpRequest) -> HttpResponse:
        assert request.path == "/v1/chat/completions" and request.headers["authorization"] == "Bearer sk-test"
        assert json.loads(request.body)["stream"] is True
        return HttpResponse(200, {"content-type": "text/event-stream"}, chunks())

    relay = await sandbox.open_relay(handler)
    output = await inside(
        sandbox,
        relay,
        """
import openai
client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % PORT, api_key="sk-test", max_retries=0)
stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
print("".join(chunk.choices[0].delta.content or "" for chunk in stream))
""",
    )
    assert output.strip() == "Hello"
    await relay.close()


async def test_without_the_runtime_there_is_no_relay() -> None:
    async def run_in_thread(fn: Any) -> Any:
        return fn()

    runtime = ExecRuntime(object(), run_in_thread=run_in_thread, max_output_bytes=1024)

    async def handler(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200)

    with pytest.raises(SandboxError) as error:
        await runtime.open_relay(handler)
    assert error.value.reason == "gateway_needs_runtime" and "python3" in error.value.message
