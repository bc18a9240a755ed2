"""A real vLLM server for the tests: vLLM's CPU build, in its own environment, serving
SmolLM2-135M-Instruct (both made by scripts/setup_vllm.sh, `make setup-vllm`).

One server per test run (the `vllm` fixture in tests/conftest.py), started on a
free loopback port with the flags docs/llm.md gives ("Running vLLM for prorl")
and stopped after the run with its whole process group (vLLM forks an engine
core process), so nothing is left behind.

While developing, PRORL_TEST_VLLM_PORT=N makes the fixture use a vLLM already
serving on 127.0.0.1:N (started with `flags()` and `environment()`), not stopped.

Where things are: PRORL_VLLM_VENV (default .venv-vllm in the checkout) and
PRORL_VLLM_MODEL (default the folder setup_vllm.sh makes in that venv).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("PRORL_VLLM_VENV", ROOT / ".venv-vllm"))
MODEL = Path(os.environ.get("PRORL_VLLM_MODEL", VENV / "share/prorl/SmolLM2-135M-Instruct"))
SERVED_NAME = "smollm2"
TOOL_CALL_PARSER = "hermes"

# Start-up takes about 2 to 6 minutes on two busy cores (importing torch and vLLM,
# profiling; -O0: no torch.compile, which took 10 more minutes here); far above
# that only a hang waits this long.
START_TIMEOUT_S = 1200.0


def flags(model: Path = MODEL, *, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The server's command line, as docs/llm.md gives it ("Running vLLM for prorl")."""
    return [
        str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", "2048",
        "--dtype", "bfloat16",
        "--logprobs-mode", "processed_logprobs",
        "--enable-prefix-caching",
        "--enable-auto-tool-choice",
        "--tool-call-parser", TOOL_CALL_PARSER,
        "-O0",
        *extra,
    ]  # fmt: skip


def environment() -> dict[str, str]:
    """vLLM's environment: 1 GiB of KV cache, the RL endpoints (/pause, /collective_rpc, ...) on."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_SERVER_DEV_MODE="1",
        OMP_WAIT_POLICY="PASSIVE",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        # One engine step of 30 sequences took over vLLM's default 300 s on a machine loaded far
        # past its two cores, and the engine shut itself down: wait as long as it takes.
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="3600",
        DO_NOT_TRACK="1",
    )
    return env


def missing() -> str:
    """Why no real vLLM can run here, or "" when it can."""
    if not (VENV / "bin/python").exists():
        return f"no vLLM environment at {VENV}: run `make setup-vllm` (scripts/setup_vllm.sh)"
    if not (MODEL / "prorl-model.json").exists():
        return f"no model folder at {MODEL}: run `make setup-vllm` (scripts/setup_vllm.sh)"
    return ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VLLMServer:
    """One vLLM OpenAI-compatible server as a child process (its own process group)."""

    model: Path = MODEL
    extra: Sequence[str] = ()
    port: int = 0
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0
    """Seconds from launch to its first answer."""
    _log: Any = field(default=None, repr=False)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    async def start(self, log_path: Path) -> None:
        self.port = self.port or free_port()
        self.log_path = log_path
        self._log = log_path.open("wb")
        launched = time.monotonic()
        self.process = subprocess.Popen(  # noqa: ASYNC220 - returns at once; its output goes to a file
            flags(self.model, port=self.port, extra=self.extra),
            env={**environment(), "TMPDIR": str(log_path.parent)},  # its vllm_dist_* files go with the log
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",
        )
        async with aiohttp.ClientSession() as session:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.process.returncode} before serving:\n{self.log_tail()}")
                if time.monotonic() - launched > START_TIMEOUT_S:
                    await self.stop()
                    raise RuntimeError(f"vLLM did not answer within {START_TIMEOUT_S:g}s:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.base_url}/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(1.0)
        self.started_s = time.monotonic() - launched

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL if it lingers; the engine core goes with it."""
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        for _ in range(300):
            if process.poll() is not None:
                break
            await asyncio.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # stragglers of the group, if any
        await asyncio.to_thread(process.wait)
        if self._log is not None:
            self._log.close()
        self.process = None

    # --- what tests ask of it directly -------------------------------------------------

    async def post(self, path: str, payload: dict[str, Any] | None = None, **params: str) -> Any:
        url = f"{self.root}{path}"
        async with aiohttp.ClientSession() as session, session.post(url, json=payload, params=params or None) as answer:
            text = await answer.text()
            if answer.status >= 400:
                raise RuntimeError(f"vLLM {path}: HTTP {answer.status}: {text[:500]}")
            return json.loads(text) if text else None

    async def get_json(self, path: str) -> Any:
        async with aiohttp.ClientSession() as session, session.get(f"{self.root}{path}") as response:
            response.raise_for_status()
            return await response.json()

    async def metrics_text(self) -> str:
        async with aiohttp.ClientSession() as session, session.get(f"{self.root}/metrics") as response:
            return await response.text()

    async def metrics(self) -> dict[str, float]:
        """Prometheus counters and gauges of /metrics, summed over their labels."""
        text = await self.metrics_text()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                values[name] = values.get(name, 0.0) + float(value)
        return values

    async def weight_version(self) -> str:
        return str((await self.get_json("/weight_info"))["weight_version"])

    async def checksums(self) -> dict[str, str]:
        """vLLM's own sha256 of each weight tensor it serves (POST /weight_checker, its RL API)."""
        answer: dict[str, str] = (await self.post("/weight_checker", {"action": "checksum"}))["checksums"]
        return answer

    async def mismatches(self, baseline: dict[str, str]) -> list[str]:
        """The weight tensors vLLM serves whose bytes are not those of `baseline` (vLLM compares)."""
        answer = await self.post("/weight_checker", {"action": "compare", "baseline": baseline})
        return [str(name) for name in answer["mismatches"]]


def rescore(model: Path | None, sequences: Sequence[dict[str, Any]]) -> list[list[float]]:
    """Log-probs of the given tokens, by a transformers forward pass in vLLM's environment
    (scripts/rescore_logprobs.py): each sequence is {"token_ids", "positions", "temperature"}
    and, where `model` is None, its own "model" folder (group them by it: one is loaded at a time)."""
    completed = subprocess.run(
        [str(VENV / "bin/python"), str(ROOT / "scripts/rescore_logprobs.py"), *([str(model)] if model else [])],
        input=json.dumps(list(sequences)).encode(),
        capture_output=True,
        env=environment(),
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"rescore_logprobs.py failed: {completed.stderr.decode(errors='replace')[-2000:]}")
    result: list[list[float]] = json.loads(completed.stdout)
    return result


def make_checkpoint(source: Path, out: Path, step: int) -> Path:
    """A distinguishable checkpoint: `source` with its final norm scaled by 1 + step/8."""
    completed = subprocess.run(
        [str(VENV / "bin/python"), str(ROOT / "scripts/vllm_model.py"), str(out),
         "--perturb", str(step), "--from", str(source)],
        capture_output=True,
        env=environment(),
        check=False,
    )  # fmt: skip
    if completed.returncode != 0:
        raise RuntimeError(f"vllm_model.py --perturb failed: {completed.stderr.decode(errors='replace')[-2000:]}")
    return out


def make_half_written_checkpoint(source: Path, out: Path) -> Path:
    """A checkpoint as a trainer that died while saving it leaves one: `source`'s config, about
    half of its tensors (by name) in a sound first shard, and a second shard cut off inside its
    header. vLLM reads the first shard into the model's layers before the second fails; the cut
    falls between a layer's k_proj and its q_proj and v_proj, which vLLM stacks into one qkv
    tensor, so that layer is left with part of its weights loaded.

    Written from safetensors' layout (8-byte little-endian header size, a JSON header of
    name -> dtype, shape, data_offsets, then the data), so no torch is needed here."""
    out.mkdir(parents=True)
    shutil.copy(source / "config.json", out / "config.json")
    with (source / "model.safetensors").open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        data = f.read()
    header.pop("__metadata__", None)
    names = sorted(header)
    cut = 1 + next(i for i in range(len(names) // 2, len(names)) if names[i].endswith("self_attn.k_proj.weight"))
    first: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name in names[:cut]:
        begin, end = header[name]["data_offsets"]
        chunks.append(data[begin:end])
        first[name] = {**header[name], "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    encoded = json.dumps(first).encode()
    encoded += b" " * (-len(encoded) % 8)
    (out / "model-00001-of-00002.safetensors").write_bytes(
        len(encoded).to_bytes(8, "little") + encoded + b"".join(chunks)
    )
    second = json.dumps({name: header[name] for name in names[cut:]}).encode()
    (out / "model-00002-of-00002.safetensors").write_bytes(
        len(second).to_bytes(8, "little") + second[: len(second) // 2]
    )
    return out


@dataclass
class Exchange:
    path: str
    request: Any
    response: Any
    status: int


class RecordingProxy:
    """A pass-through in front of the real vLLM that keeps every request and answer, so a test
    sees exactly which ids the service sent and what vLLM answered. A client that goes away
    cancels the forwarded request too (vLLM then aborts it), as without the proxy."""

    def __init__(self, upstream: VLLMServer) -> None:
        self.upstream = upstream
        self.exchanges: list[Exchange] = []
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def completions(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == "/v1/completions" and e.status == 200]

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        async with self._session.request(
            request.method,
            f"{self.upstream.root}{request.path_qs}",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as upstream:
            text = await upstream.text()
            status = upstream.status
        with contextlib.suppress(ValueError):
            self.exchanges.append(
                Exchange(request.path, json.loads(body) if body else None, json.loads(text) if text else None, status)
            )
        return web.Response(text=text, status=status, content_type="application/json")
