"""Fake vLLM and SGLang servers that speak their documented token APIs, and a tiny tokenizer.

No model: each reply's text comes from a script and is tokenised with the
same tokenizer the server side uses, so ids round-trip exactly.

Shapes implemented (what the adapters rely on):
- vLLM, OpenAI-compatible server (vllm/entrypoints/openai/completion/protocol.py,
  CompletionRequest / CompletionResponse as documented for vLLM 0.15-0.26):
  POST /v1/completions {"prompt": [ids], "max_tokens", "temperature", "logprobs": 1,
  "return_tokens_as_token_ids": true} -> {"choices": [{"text", "finish_reason",
  "logprobs": {"tokens": ["token_id:<id>"], "token_logprobs": [..], "top_logprobs", "text_offset"}}],
  "usage": {...}}; GET /v1/models.
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
        self._runner = web.AppRunner(app)
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
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if (failure := self.failure()) is not None:
            return failure
        prompt = body["prompt"]
        assert isinstance(prompt, list) and all(isinstance(i, int) for i in prompt), "prompt must be token ids"
        assert body.get("return_tokens_as_token_ids") is True and body.get("logprobs") == 1
        ids = self.sample(prompt)[: body["max_tokens"]]
        finish = "stop" if ids and ids[-1] == self.eos else "length"
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
                            "token_logprobs": [-0.5] * len(ids),
                            "top_logprobs": [{f"token_id:{i}": -0.5} for i in ids],
                            "text_offset": list(range(len(ids))),
                        },
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
