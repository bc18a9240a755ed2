"""Fake vLLM and SGLang servers that speak their documented token APIs, and a tiny tokenizer.

No model: each reply's text comes from a script and is tokenised with the
same tokenizer the server side uses, so ids round-trip exactly.

Shapes implemented (what the adapters rely on):
- vLLM, OpenAI-compatible server (vllm/entrypoints/openai/completion/protocol.py,
  CompletionRequest / CompletionResponse as documented for vLLM 0.15-0.26):
  POST /v1/completions {"prompt": [ids], "max_tokens", "temperature", "logprobs": 1,
  "return_tokens_as_token_ids": true} -> {"choices": [{"text", "finish_reason",
  "logprobs": {"tokens": ["token_id:<id>"], "token_logprobs": [..], "top_logprobs", "text_offset"}}],
  "usage": {...}}; GET /v1/models. Checked against a real vLLM 0.32 by
  tests/integration/test_vllm_fake_contract.py (every field the backend reads).
  vLLM's RL endpoints (served with VLLM_SERVER_DEV_MODE=1,
  vllm/entrypoints/rl/online/api_router.py): POST /pause?mode=abort|wait|keep,
  /resume, /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}},
  /reset_prefix_cache, /update_weight_version {"new_version"}; GET /weight_info.
  `routed_experts` (a base64 .npy of shape (tokens - 1, layers, top_k)) when
  `routed` is set, as a vLLM started with --enable-return-routed-experts sends it.
- SGLang native API (docs.sglang.io, "Sampling Parameters", /generate endpoint,
  GenerateReqInput): POST /generate {"input_ids": [ids], "sampling_params":
  {"max_new_tokens", "temperature", ...}, "return_logprob": true} ->
  {"text", "meta_info": {"prompt_tokens", "completion_tokens", "finish_reason":
  {"type": "stop"|"length"}, "output_token_logprobs": [[logprob, id, null], ...]}};
  GET /health. POST /update_weights_from_disk {"model_path"} -> {"success", "message"}
  (HTTP 400 with success false when the checkpoint cannot be loaded; SGLang's
  UpdateWeightFromDiskReqInput, python/sglang/srt/managers/io_struct.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tiny_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer (one token per byte) with ChatML special tokens, as a HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


Script = Callable[[list[int]], str]


class FakeTokenServer:
    """Base: an aiohttp app on a free loopback port that records every request."""

    def __init__(self, tokenizer_folder: Path, script: Script) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
        self.eos = self.tokenizer.token_to_id("<|im_end|>")
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.loads: list[str] = []
        """Checkpoints loaded through /update_weights_from_disk (SGLang only)."""
        self.fail_next: list[int] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    def sample(self, prompt: list[int]) -> list[int]:
        text = self.script(prompt)
        return [*list(self.tokenizer.encode(text, add_special_tokens=False).ids), self.eos]

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def failure(self) -> web.Response | None:
        if self.fail_next:
            return web.json_response({"error": "injected"}, status=self.fail_next.pop(0))
        return None


class FakeVLLM(FakeTokenServer):
    weights = "initial"
    """The checkpoint it serves: log-probs -0.5 under the initial weights, -0.125 under any loaded later."""
    weight_version = "default"
    paused = False
    routed: tuple[int, int] | None = None
    """(layers, top_k): send routed_experts, expert (t + l + k) % 8 for token t, layer l, choice k."""

    def __init__(self, tokenizer_folder: Path, script: Script) -> None:
        super().__init__(tokenizer_folder, script)
        self.control: list[str] = []
        """RL endpoints called, in order (with the pause mode: "/pause?mode=wait")."""
        self.hold: asyncio.Event | None = None
        """When set to an Event, completions wait for it (a turn kept in flight)."""
        self.cancelled = 0
        """Completions whose client went away before the answer (vLLM aborts those)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_post("/collective_rpc", self._collective_rpc)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_get("/weight_info", self._weight_info)

    async def _pause(self, request: web.Request) -> web.Response:
        self.control.append(f"/pause?mode={request.query.get('mode', 'abort')}")
        self.paused = True
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.control.append("/resume")
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.control.append(f"/collective_rpc {body['method']}")
        path = str(body["kwargs"]["weights_path"])
        if "missing" in path:  # vLLM: the worker's error comes back as a 500
            message = f"Call to collective_rpc method failed: Worker failed with error 'no weights under {path}'"
            error = {"message": message, "type": "InternalServerError", "param": None, "code": 500}
            return web.json_response({"error": error}, status=500)
        self.loads.append(path)
        self.weights = path
        return web.json_response({"results": [None]})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.control.append("/reset_prefix_cache")
        return web.json_response({"success": True})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        self.weight_version = str((await request.json())["new_version"])
        self.control.append(f"/update_weight_version {self.weight_version}")
        return web.json_response({"success": True, "new_version": self.weight_version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    def routed_experts(self, tokens: int) -> str | None:
        if self.routed is None:
            return None
        layers, top_k = self.routed
        values = bytes((t + l + k) % 8 for t in range(tokens) for l in range(layers) for k in range(top_k))  # noqa: E741
        header = repr({"descr": "|u1", "fortran_order": False, "shape": (tokens, layers, top_k)}).encode()
        header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
        return base64.b64encode(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + values).decode()

    max_model_len = 2048
    root = "/models/fake"
    """The folder it "serves" (the model list's root): the checkpoint loaded last, as vLLM says it."""

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": "fake", "object": "model", "root": self.root, "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [model]})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if (failure := self.failure()) is not None:
            return failure
        prompt = body["prompt"]
        assert isinstance(prompt, list) and all(isinstance(i, int) for i in prompt), "prompt must be token ids"
        assert body.get("return_tokens_as_token_ids") is True and body.get("logprobs") == 1
        if self.hold is not None:
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if len(prompt) + int(body["max_tokens"]) > self.max_model_len:  # vLLM 0.32's wording and shape
            message = (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{body['max_tokens']} output tokens and your prompt contains at least {len(prompt)} input tokens, "
                f"for a total of at least {len(prompt) + int(body['max_tokens'])} tokens. Please reduce the length "
                "of the input prompt or the number of requested output tokens."
            )
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        ids = self.sample(prompt)[: body["max_tokens"]]
        finish = "stop" if ids and ids[-1] == self.eos else "length"
        logprob = -0.5 if self.weights == "initial" else -0.125
        return web.json_response(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": self.tokenizer.decode(ids, skip_special_tokens=True),
                        "finish_reason": finish,
                        "logprobs": {
                            "tokens": [f"token_id:{i}" for i in ids],
                            "token_logprobs": [logprob] * len(ids),
                            "top_logprobs": [{f"token_id:{i}": logprob} for i in ids],
                            "text_offset": list(range(len(ids))),
                        },
                        "stop_reason": None,
                        "prompt_logprobs": None,
                        "token_ids": ids if body.get("return_token_ids") else None,
                        "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                        "routed_experts": self.routed_experts(len(prompt) + len(ids) - 1),
                    }
                ],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
            }
        )


class FakeSGLang(FakeTokenServer):
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_post("/update_weights_from_disk", self._update_weights)

    weights = "initial"
    """The checkpoint it serves: replies' log-probs tell the initial weights (-0.25) from any loaded later (-0.125)."""

    async def _update_weights(self, request: web.Request) -> web.Response:
        path = str((await request.json())["model_path"])
        if "missing" in path:
            return web.json_response({"success": False, "message": f"{path} not found"}, status=400)
        self.loads.append(path)
        self.weights = path
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if (failure := self.failure()) is not None:
            return failure
        prompt = body["input_ids"]
        assert isinstance(prompt, list) and all(isinstance(i, int) for i in prompt), "input_ids must be token ids"
        assert body.get("return_logprob") is True
        ids = self.sample(prompt)[: body["sampling_params"]["max_new_tokens"]]
        finish = {"type": "stop", "matched": self.eos} if ids and ids[-1] == self.eos else {"type": "length"}
        return web.json_response(
            {
                "text": self.tokenizer.decode(ids, skip_special_tokens=True),
                "meta_info": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids),
                    "finish_reason": finish,
                    "output_token_logprobs": [[-0.25 if self.weights == "initial" else -0.125, i, None] for i in ids],
                },
            }
        )
