"""prorl-server with a real vLLM as its backend, instead of the embedded model (`make serve-vllm`).

Starts vLLM's CPU build serving SmolLM2-135M-Instruct (made by `make setup-vllm`)
with the flags of docs/llm.md ("Running vLLM for prorl"), then `prorl-server
serve` with that vLLM as its only backend (kind `vllm`: exact token ids, weight
updates through vLLM's RL API). Both run until Ctrl-C, which stops both.

    python scripts/serve_vllm.py [--vllm-port 8000] [--port 50051]

Then, from another shell:  prorl run TASKS.jsonl --out results.jsonl --server 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.vllm import MODEL, SERVED_NAME, TOOL_CALL_PARSER, VLLMServer, missing  # noqa: E402


def backend(vllm: VLLMServer) -> dict[str, str]:
    return {
        "id": "vllm",
        "kind": "vllm",
        "base_url": vllm.base_url,
        "model": SERVED_NAME,
        "tokenizer_path": str(MODEL),
        "tool_call_parser": TOOL_CALL_PARSER,
        "logprobs_mode": "processed",
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-port", type=int, default=8000)
    parser.add_argument("--port", type=int, default=50051, help="prorl-server's gRPC port")
    parser.add_argument("--log", type=Path, default=Path("vllm_server.log"), help="vLLM's log")
    args = parser.parse_args()
    if why := missing():
        print(why, file=sys.stderr)
        return 1
    vllm = VLLMServer(port=args.vllm_port)
    print(f"starting vLLM on {vllm.root} (about 2 minutes; log: {args.log})")
    await vllm.start(args.log.resolve())
    print(f"vLLM serves {SERVED_NAME} at {vllm.base_url} (started in {vllm.started_s:.0f} s)")
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prorl_server", "serve", "--host", "127.0.0.1", "--port", str(args.port),
        "--set", f"llm.backends={json.dumps([backend(vllm)])}",
        "--set", "llm.embedded.enabled=never",
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiting = asyncio.create_task(server.wait())
    try:
        await asyncio.wait([waiting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if server.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                server.terminate()
            await server.wait()
        await vllm.stop()
    return server.returncode or 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
