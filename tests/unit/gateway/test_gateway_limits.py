"""A job's gateway under load it did not ask for: at most `max_concurrent_calls` calls at once (the
next one 429 at once), no body over `max_request_bytes` (413 before it is read), each refusal in
its provider's format; the gateway port refuses an unknown job or a bad key from the request's
head, before any body is read."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from prorl_server.config import GatewaySettings
from prorl_server.gateway.aiohttp_adapter import GatewayServer
from prorl_server.gateway.app import ModelGateway
from prorl_server.gateway.directory import GatewayDirectory
from prorl_server.llm.base import ChatResult, Sampling
from prorl_server.sandbox.runtime.relay import HttpRequest
from tests.helpers import assert_eventually

KEY = "sk-limits"
LIMITS = GatewaySettings(max_concurrent_calls=2, max_request_bytes=64 << 10)
DEFAULT = Sampling(max_tokens=16, temperature=1.0)


class HeldChat:
    """A `ChatFn` that holds every call until `release` is set; counts the calls it got."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        self.started += 1
        await self.release.wait()
        return ChatResult(text="ok", finish_reason="stop")


@pytest_asyncio.fixture
async def held() -> AsyncIterator[tuple[HeldChat, str]]:
    chat = HeldChat()
    server = GatewayServer(ModelGateway(chat, default_sampling=DEFAULT, api_key=KEY, limits=LIMITS))
    await server.start()
    try:
        yield chat, server.url
    finally:
        chat.release.set()
        await server.close()


async def test_a_call_beyond_the_jobs_concurrency_is_429_at_once_in_each_format(held: tuple[HeldChat, str]) -> None:
    chat, url = held
    oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    ant = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    user = [{"role": "user", "content": "hi"}]
    first = asyncio.create_task(oai.chat.completions.create(model="m", messages=user))  # type: ignore[arg-type]
    second = asyncio.create_task(ant.messages.create(model="m", max_tokens=8, messages=user))  # type: ignore[arg-type]
    await assert_eventually(lambda: chat.started == 2, message="the first two calls never reached the model")
    with pytest.raises(openai.RateLimitError) as too_many:
        await oai.chat.completions.create(model="m", messages=user)  # type: ignore[arg-type]
    body = too_many.value.body
    assert isinstance(body, dict) and body["code"] == "rate_limit_exceeded" and body["type"] == "rate_limit_error"
    assert "gateway.max_concurrent_calls" in body["message"]
    with pytest.raises(anthropic.RateLimitError) as too_many_anthropic:
        await ant.messages.create(model="m", max_tokens=8, messages=user)  # type: ignore[arg-type]
    assert too_many_anthropic.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": body["message"]},
    }
    assert chat.started == 2  # the refused calls never reached the model
    chat.release.set()
    assert (await first).choices[0].message.content == "ok"
    assert (await second).content[0].text == "ok"  # type: ignore[union-attr]
    # Slots are given back: the next call goes through.
    assert (await oai.chat.completions.create(model="m", messages=user)).choices[0].message.content == "ok"  # type: ignore[arg-type]
    await oai.close()
    await ant.close()


def raw_exchange(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send a request head (and `body`), read the whole answer: its status and JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode("latin-1") + body)
        data = b""
        while True:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    status_line, _, rest = data.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload)


def post_head(path: str, length: int, **headers: str) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", f"Content-Length: {length}", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return "\r\n".join(lines) + "\r\n\r\n"


async def test_a_body_over_the_limit_is_413_before_it_is_read(held: tuple[HeldChat, str]) -> None:
    chat, url = held
    port = int(url.rsplit(":", 1)[1])
    # Only the head is sent: a 413 that waited for the declared 60 MiB would never come.
    head = post_head("/v1/chat/completions", 60 << 20, Authorization=f"Bearer {KEY}")
    status, body = await asyncio.to_thread(raw_exchange, port, head)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "gateway.max_request_bytes" in body["error"]["message"]
    head = post_head("/v1/messages", 60 << 20, **{"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    status, body = await asyncio.to_thread(raw_exchange, port, head)
    assert status == 413 and body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert chat.started == 0


async def test_the_gateway_port_refuses_unknown_jobs_and_bad_keys_before_reading_a_body() -> None:
    chat = HeldChat()
    directory = GatewayDirectory()
    directory.add("job-1", ModelGateway(chat, default_sampling=DEFAULT, api_key=KEY, limits=LIMITS))
    server = GatewayServer(directory)
    await server.start()
    try:
        for path, headers in [
            ("/jobs/nope/v1/chat/completions", {}),
            ("/jobs/job-1/v1/chat/completions", {}),
            ("/jobs/job-1/v1/chat/completions", {"Authorization": "Bearer wrong"}),
            ("/jobs/job-1/v1/messages", {"x-api-key": "wrong"}),
        ]:
            # 60 MiB declared, none sent: the 401 comes from the head alone.
            status, body = await asyncio.to_thread(raw_exchange, server.port, post_head(path, 60 << 20, **headers))
            assert status == 401, (path, headers, body)
        # The right key: the body is read and the call made.
        payload = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        chat.release.set()
        head = post_head(
            "/jobs/job-1/v1/chat/completions", len(payload), Authorization=f"Bearer {KEY}", Connection="close"
        )
        status, body = await asyncio.to_thread(raw_exchange, server.port, head, payload)
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok"
    finally:
        await server.close()


async def test_the_parsed_body_is_the_only_copy_the_call_keeps() -> None:
    chat = HeldChat()
    chat.release.set()
    gateway = ModelGateway(chat, default_sampling=DEFAULT, limits=LIMITS)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = HttpRequest("POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
    response = await gateway(request)
    assert response.status == 200
    assert request.body == b""  # taken by the gateway, freed once parsed


def trickle_head(port: int, pause_s: float) -> tuple[int, float]:
    """Open a connection and send a request's head one byte per `pause_s`, never finishing it; the
    bytes sent before the server closed it, and how long it stayed open."""
    head = post_head("/jobs/job-1/v1/chat/completions", 10, Authorization=f"Bearer {KEY}").encode()
    opened = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        for sent, byte in enumerate(head[:-4]):  # the blank line that ends a head never comes
            try:
                sock.sendall(bytes([byte]))
                time.sleep(pause_s)
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        return sent, time.monotonic() - opened
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
            except (BrokenPipeError, ConnectionResetError):
                return sent, time.monotonic() - opened
    return len(head), time.monotonic() - opened


async def test_a_head_trickled_in_does_not_hold_a_connection_past_the_header_time() -> None:
    """Before: aiohttp's default (3,630 s) let a client that sends its head a byte at a time hold a
    connection of the gateway port for an hour. Now the connection is closed at
    gateway.header_timeout_s, however slowly the bytes keep coming."""
    directory = GatewayDirectory()
    directory.add("job-1", ModelGateway(HeldChat(), default_sampling=DEFAULT, api_key=KEY, limits=LIMITS))
    server = GatewayServer(directory, header_timeout_s=1.0)
    await server.start()
    try:
        sent, held_s = await asyncio.to_thread(trickle_head, server.port, 0.05)
    finally:
        await server.close()
    head_bytes = len(post_head("/jobs/job-1/v1/chat/completions", 10, Authorization=f"Bearer {KEY}"))
    # Closed while the head was still trickling in (each byte keeps it busy, none resets the clock).
    assert sent < head_bytes - 4, (sent, held_s)
    assert held_s >= 1.0
