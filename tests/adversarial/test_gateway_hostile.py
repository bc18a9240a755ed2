"""The model gateway under a hostile agent program (issue 30): what a program run by the command
family may do to the server through its gateway, and what it may not.

Before (a live server, scripted programs): 10 concurrent 50 MB calls held by a slow model took the
server from 246 to 2,345 MiB; 100 sequential distinct 5 MB conversations from 374 to 834 MiB for
the job's life; an 8 MB last call made an 8,000,766-byte result that no 4 MiB client could read;
max_tokens 2**62, temperature 2.0, 10,000 stop strings and chat_template_kwargs reached the
backend; a seed the backend refused failed the job as INFRASTRUCTURE; the gateway port read
60 MiB bodies before its 401.

The server is real and in this process (its RSS is this process's), on the fake sandbox provider:
the program is a real process on this host behind the real in-sandbox runtime and relay. The
backend is a scripted fake in process (`LeanBackend`) that keeps nothing of a request but its
sampling and size, so the memory measured is the server's own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from google.protobuf.struct_pb2 import Struct

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.errors import LLMError
from prorl_server.llm.base import BackendInfo, ChatBackend, ChatResult, Sampling
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.helpers import assert_eventually

MiB = 1 << 20
GRPC_DEFAULT_MAX_MESSAGE = 4 * MiB
JOB_SAMPLING = {"max_tokens": 64, "temperature": 0.6, "stop": ["</answer>"]}


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS), or its peak since `reset_peak` (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class LeanBackend(ChatBackend):
    """A scripted fake chat backend: answers "42"; keeps only each request's sampling and size (no
    copy of its messages) and the server's RSS when it came; holds replies while `hold` is clear;
    refuses every request as the program's (a 400) when `refuse`."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.info = BackendInfo(id="lean", kind="scripted", base_url="in-process", model="lean")
        self.hold = asyncio.Event()
        self.hold.set()
        self.refuse = refuse
        self.samplings: list[Sampling] = []
        self.sizes: list[int] = []
        self.rss: list[float] = []
        self.in_flight = 0

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
        *,
        native_tools: bool = False,
    ) -> ChatResult:
        self.samplings.append(sampling)
        self.sizes.append(sum(len(str(m.get("content") or "")) for m in messages))
        self.rss.append(rss_mib())
        if self.refuse:
            raise LLMError("backend lean refused the request: HTTP 400: seed out of range", reason="llm_bad_request")
        self.in_flight += 1
        try:
            await self.hold.wait()
        finally:
            self.in_flight -= 1
        return ChatResult(text="42", finish_reason="stop", prompt_tokens=1, completion_tokens=1)

    async def check_health(self) -> bool:
        return True

    async def close(self) -> None:
        return None


async def serve(backend: ChatBackend, **sections: dict[str, Any]) -> tuple[ProrlServer, FakeSandboxProvider]:
    provider = FakeSandboxProvider(instance_id=instance_id("hostile"))
    server_section = {"port": 0, "instance_id": instance_id("server"), "shutdown_grace_s": 0}
    server_section.update(sections.pop("server", {}))
    settings = load_settings(
        None,
        environ={},
        overrides={
            "server": server_section,
            "jobs": {"store": False},
            "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
            **sections,
        },
    )
    server = ProrlServer(settings, sandbox_provider=provider, backends=[backend])
    await server.start()
    return server, provider


def program_request(code: str, *, sampling: str = "job", env: dict[str, str] | None = None) -> v1.RolloutRequest:
    instance = Struct()
    instance.update(
        {
            "program": {
                "argv": [sys.executable, "agent.py"],
                "files": {"agent.py": code},
                "env": env or {},
                "sampling": sampling,
            },
            "verifier": "math",
            "task": {"question": "What is 6 * 7?", "answer": "42"},
        }
    )
    request = v1.RolloutRequest(handler="command", instance=instance)
    request.sampling.max_tokens = JOB_SAMPLING["max_tokens"]
    request.sampling.temperature = JOB_SAMPLING["temperature"]
    request.sampling.stop.extend(JOB_SAMPLING["stop"])
    return request


async def result_of(client: Client, request: v1.RolloutRequest) -> v1.RolloutResult:
    async for event in client.rollout(request):
        if event.HasField("finished"):
            return event.finished.result
    raise AssertionError("no finished event")


def leftovers(provider: FakeSandboxProvider) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"prorl-{provider.instance_id}-*"))


@pytest_asyncio.fixture
async def stopping() -> AsyncIterator[list[tuple[ProrlServer, FakeSandboxProvider, LeanBackend]]]:
    """Servers to stop at the end, each checked for leftover sandboxes."""
    started: list[tuple[ProrlServer, FakeSandboxProvider, LeanBackend]] = []
    yield started
    for server, provider, backend in started:
        backend.hold.set()
        await server.stop()
        assert provider.busy == 0 and not leftovers(provider)


# A program's raw HTTP: concurrent calls of SIZE-byte conversations, each answered or refused.
RAW_CALLS = r"""
import http.client, json, os, sys, threading, time, urllib.parse
url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
key = os.environ["OPENAI_API_KEY"]

def call(size, out, index):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": ("%d " % index) + "x" * size}]})
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", body=body,
                           headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        response = connection.getresponse()
        out.append((response.status, json.loads(response.read() or b"null")))
    except (BrokenPipeError, ConnectionResetError) as exc:  # refused before the body was all sent
        out.append((type(exc).__name__, None))

def declare(size, out, index):
    # The head of a `size`-byte call and 1 MB of its body, then wait for the answer.
    import socket
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (key, size))
    with socket.create_connection((url.hostname, url.port), timeout=600) as sock:
        sock.sendall(head.encode() + b"x" * 1_000_000)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
    status = int(answer.split(b" ", 2)[1])
    out.append((status, json.loads(answer.split(b"\r\n\r\n", 1)[1])))

def wave(count, size, answered_first=0, signal=None, target=call):
    # `count` calls at once; once `answered_first` of them are answered, `signal` is written.
    out = []
    threads = [threading.Thread(target=target, args=(size, out, i)) for i in range(count)]
    for t in threads: t.start()
    while signal and len(out) < answered_first:
        time.sleep(0.05)
    if signal:
        open(signal, "w").write(json.dumps([s for s, _ in out]))
    for t in threads: t.join()
    return out
"""


async def test_one_job_cannot_take_the_servers_memory(stopping: list[Any], tmp_path: Path) -> None:
    """10 concurrent calls of 12 MB held by a slow model: 4 reach it (gateway.max_concurrent_calls), 6
    are 429 at once; then 10 of 50 MB: 413 before they are read (gateway.max_request_bytes).
    Before: ~210 MB of server memory per call held, 2,100 MiB for 10 of 50 MB."""
    backend = LeanBackend()
    backend.hold.clear()
    server, provider = await serve(backend, gateway={"max_concurrent_calls": 4, "max_request_bytes": 16 * MiB})
    stopping.append((server, provider, backend))
    code = (
        RAW_CALLS
        + r"""
held = wave(10, 12_000_000, 6, os.environ["REFUSED_FILE"])
big = wave(10, 50_000_000, target=declare)
print(json.dumps({"held": [s for s, _ in held], "big": [s for s, _ in big],
                  "429": [b for s, b in held if s == 429][:1], "413": [b for s, b in big if s == 413][:1]}),
      file=sys.stderr)
print("42")
"""
    )
    async with Client.connect(server.address) as client:
        baseline = rss_mib()
        reset_peak()
        # The fake provider's sandbox is a process on this host: the program tells the test, in a
        # file, when the calls beyond the limit have been answered (while 4 are still held).
        refused = tmp_path / "refused"
        job = (await client.submit(program_request(code, env={"REFUSED_FILE": str(refused)}))).job
        await assert_eventually(refused.exists, timeout_s=300, message="the calls beyond the limit were not answered")
        await assert_eventually(lambda: backend.in_flight == 4, timeout_s=60, message="the held calls never arrived")
        held_rss = rss_mib()
        backend.hold.set()
        result = None
        async for event in client.watch(job.job_id):
            if event.HasField("finished"):
                result = event.finished.result
        assert result is not None and result.status == v1.JOB_STATUS_SUCCEEDED, result
        peak = rss_mib("VmHWM")
    seen = json.loads(result.details["program_log_tail"].strip().splitlines()[-1])
    assert sorted(seen["held"], key=str) == [200] * 4 + [429] * 6
    assert seen["429"][0]["error"]["code"] == "rate_limit_exceeded"
    assert seen["big"] == [413] * 10 and seen["413"][0]["error"]["code"] == "request_too_large"
    assert len(backend.sizes) == 4  # nothing refused reached the model
    # 4 calls of 12 MB held: each keeps its parsed conversation (~12 MB) and little else, but the
    # allocator keeps transient copies: +132 MiB alone, +212 MiB in a process that ran the whole
    # suite first. Before: ~210 MB per call held, ~840 MiB for these 4.
    print(f"RSS baseline {baseline:.0f} MiB, 4 calls held {held_rss:.0f} MiB, peak {peak:.0f} MiB")
    assert held_rss - baseline < 4 * 12 * 6, (baseline, held_rss)
    assert peak - baseline < 400, (baseline, peak)


async def test_a_jobs_memory_does_not_grow_with_the_conversations_its_program_sends(stopping: list[Any]) -> None:
    """40 sequential calls, each a distinct 5 MB conversation: before, each kept ~4.6 MiB for the
    job's life (100 calls: 374 -> 834 MiB)."""
    backend = LeanBackend()
    server, provider = await serve(backend)
    stopping.append((server, provider, backend))
    code = (
        RAW_CALLS
        + r"""
for i in range(40):
    [(status, _)] = wave(1, 5_000_000)
    assert status == 200, status
print("42")
"""
    )
    async with Client.connect(server.address) as client:
        result = await result_of(client, program_request(code))
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result
    assert len(backend.rss) == 40 and min(backend.sizes) >= 5_000_000
    growth = backend.rss[-1] - backend.rss[4]
    print(f"RSS at call 5: {backend.rss[4]:.0f} MiB, at call 40: {backend.rss[-1]:.0f} MiB")
    assert growth < 60, backend.rss  # before: ~160 MiB over these 35 calls


async def test_a_result_with_a_huge_last_call_is_readable_by_a_plain_4_mib_client(stopping: list[Any]) -> None:
    """The last call carries 8 MB: before, an 8,000,766-byte result (RESOURCE_EXHAUSTED on GetJob
    and Watch for a client on gRPC's default limit)."""
    backend = LeanBackend()
    server, provider = await serve(backend)
    stopping.append((server, provider, backend))
    code = (
        RAW_CALLS
        + r"""
[(status, _)] = wave(1, 8_000_000)
assert status == 200, status
print("42")
"""
    )
    async with Client.connect(server.address) as client:
        job = (await client.submit(program_request(code))).job
        await assert_eventually(
            lambda: len(backend.sizes) == 1, timeout_s=120, message="the program never called the model"
        )
    # A plain client: gRPC's defaults (4 MiB to receive), the generated stub, nothing else.
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = v1.RolloutServiceStub(channel)
        finished = None
        async for response in stub.Watch(v1.WatchRequest(job_id=job.job_id)):
            if response.event.HasField("finished"):
                finished = response.event.finished.result
        got = (await stub.GetJob(v1.GetJobRequest(job_id=job.job_id))).job
    assert finished is not None and finished.status == v1.JOB_STATUS_SUCCEEDED
    assert got.result.ByteSize() < GRPC_DEFAULT_MAX_MESSAGE
    messages = got.result.trajectory.messages
    assert [m.role for m in messages] == ["user", "assistant"]
    assert "characters cut by the gateway" in messages[0].content and messages[1].content == "42"
    cut = got.result.details["gateway"]["messages_cut"]
    assert cut["characters_cut"] > 7_000_000


SAMPLING_PROGRAM = r"""
import json, openai, sys
client = openai.OpenAI(max_retries=0)
kwargs = {"chat_template": "{{ 'mine' }}", "bos_token": "<evil>", "add_generation_prompt": False}
extra = {"chat_template_kwargs": kwargs, "top_p": 0.01, "seed": 7}
for max_tokens in (10**9, 2**62):
    reply = client.chat.completions.create(
        model="prorl", messages=[{"role": "user", "content": "go"}], max_tokens=max_tokens, temperature=2.0,
        stop=["s%d" % i for i in range(10_000)], extra_body=extra)
print(reply.choices[0].message.content)
"""


async def test_the_trainers_sampling_wins_over_the_programs(stopping: list[Any]) -> None:
    backend = LeanBackend()
    server, provider = await serve(backend)
    stopping.append((server, provider, backend))
    async with Client.connect(server.address) as client:
        turns = []
        async for event in client.rollout(program_request(SAMPLING_PROGRAM)):
            if event.HasField("model_turn"):
                turns.append(event.model_turn)
            if event.HasField("finished"):
                result = event.finished.result
        chosen = await result_of(client, program_request(SAMPLING_PROGRAM, sampling="program"))
    assert result.status == chosen.status == v1.JOB_STATUS_SUCCEEDED, (result, chosen)
    # Each call's event says what was overridden, as it was sent.
    assert [len(turn.sampling_changes) for turn in turns] == [6, 6]
    rows = {change.field: (change.asked, change.used) for change in turns[1].sampling_changes}
    assert rows["max_tokens"] == (str(2**62), "64") and rows["seed"] == ("7", "") and rows["top_p"] == ("0.01", "")
    assert rows["stop"] == ("10000 strings", "16 strings") and rows["temperature"][0] == "2.0"
    assert rows["chat_template_kwargs"] == ("add_generation_prompt, bos_token, chat_template", "the job's")
    job_calls, chosen_calls = backend.samplings[:2], backend.samplings[2:]
    for sampling in job_calls:
        assert sampling.max_tokens == 64 and sampling.temperature == pytest.approx(0.6)
        assert sampling.top_p is None and sampling.seed is None
        assert sampling.stop[0] == "</answer>" and len(sampling.stop) == 16
        assert sampling.chat_template_kwargs == {}
    for sampling in chosen_calls:  # the job lets its program choose: temperature, top_p, seed only
        assert sampling.max_tokens == 64 and sampling.temperature == 2.0
        assert sampling.top_p == 0.01 and sampling.seed == 7 and len(sampling.stop) == 16
        assert sampling.chat_template_kwargs == {}
    report = result.details["gateway"]
    assert report["calls"] == 2 and report["clamped_calls"] == 2
    first = report["clamped"][0]
    assert first["max_tokens"] == [1e9, 64] and first["temperature"] == [2.0, pytest.approx(0.6)]
    assert first["seed"] == [7, None] and first["stop"]["dropped"] == 10_000 - 15
    assert first["chat_template_kwargs"]["dropped"] == ["add_generation_prompt", "bos_token", "chat_template"]
    assert set(chosen.details["gateway"]["clamped"][1]) == {"call", "max_tokens", "stop", "chat_template_kwargs"}


async def test_a_request_the_backend_refuses_is_the_programs_not_infrastructure(stopping: list[Any]) -> None:
    """Before: FAILED / INFRASTRUCTURE / llm_bad_request, unjudged (masked out of training)."""
    backend = LeanBackend(refuse=True)
    server, provider = await serve(backend)
    stopping.append((server, provider, backend))
    code = r"""
import openai, sys
try:
    messages = [{"role": "user", "content": "go"}]
    openai.OpenAI(max_retries=0).chat.completions.create(model="prorl", messages=messages, seed=2**63 - 1)
except openai.BadRequestError as exc:
    print("refused", exc.status_code, exc.body["type"], file=sys.stderr)
    raise
"""
    async with Client.connect(server.address) as client:
        result = await result_of(client, program_request(code))
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure  # judged
    assert result.failure.kind != v1.FAILURE_KIND_INFRASTRUCTURE
    assert result.reward == 0.0 and result.details["exit_code"] == 1
    assert "refused 400 invalid_request_error" in result.details["program_log_tail"]


def head_only(port: int, path: str, headers: dict[str, str], declared: int) -> int:
    """Send a POST's head declaring `declared` body bytes, none of them; the status answered."""
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {declared}", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = sock.recv(65536)
    return int(answer.split(b" ", 2)[1])


async def test_the_gateway_port_authenticates_before_it_reads_a_body(stopping: list[Any]) -> None:
    """Before: 20 keyless connections to an unknown job, 60 MiB declared each, held 1,344 MiB and got
    their 401 only once the body was read. Now the head is enough for the 401 (or, with the key, the
    413): no byte of the body is sent here, so an answer that waited for it would never come."""
    backend = LeanBackend()
    backend.hold.clear()
    server, provider = await serve(backend, server={"gateway_port": 0})
    stopping.append((server, provider, backend))
    code = (
        "import openai\n"
        "reply = openai.OpenAI(max_retries=0).chat.completions.create(\n"
        "    model='m', messages=[{'role': 'user', 'content': 'go'}])\n"
        "print(reply.choices[0].message.content)\n"
    )
    async with Client.connect(server.address) as client:
        job = (await client.submit(program_request(code))).job
        opened = None
        async for event in client.watch(job.job_id):
            if event.HasField("gateway_opened"):
                opened = event.gateway_opened
                break
        assert opened is not None and server.gateway_port is not None
        port, path = server.gateway_port, f"{opened.path}/v1/chat/completions"
        baseline = rss_mib()
        statuses = await asyncio.gather(
            *[asyncio.to_thread(head_only, port, "/jobs/unknown/v1/chat/completions", {}, 60 * MiB) for _ in range(20)]
        )
        assert statuses == [401] * 20
        assert await asyncio.to_thread(head_only, port, path, {"Authorization": "Bearer wrong"}, 60 * MiB) == 401
        assert await asyncio.to_thread(head_only, port, path, {"x-api-key": "wrong"}, 60 * MiB) == 401
        good = {"Authorization": f"Bearer {opened.api_key}"}
        assert await asyncio.to_thread(head_only, port, path, good, 60 * MiB) == 413
        assert rss_mib() - baseline < 50
        backend.hold.set()
        async for event in client.watch(job.job_id):
            if event.HasField("finished"):
                assert event.finished.result.status == v1.JOB_STATUS_SUCCEEDED


async def test_the_metrics_port_asks_for_a_token_when_told_to(stopping: list[Any]) -> None:
    for require, expected in ((False, 200), (True, 401)):
        backend = LeanBackend()
        server, provider = await serve(
            backend, server={"metrics_port": 0, "auth_tokens": ["t0ken"], "metrics_require_token": require}
        )
        stopping.append((server, provider, backend))
        url = f"http://127.0.0.1:{server.metrics.port}/metrics"
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as response:
                assert response.status == expected
            async with session.get(url, headers={"Authorization": "Bearer t0ken"}) as response:
                assert response.status == 200 and "prorl_jobs" in await response.text()
            async with session.get(url, headers={"Authorization": "Bearer nope"}) as response:
                assert response.status == expected
