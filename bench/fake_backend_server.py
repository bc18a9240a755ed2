"""A fixed-latency OpenAI-chat backend in its own process, for bench/llm.py.

Prints its base URL on stdout, then serves until stdin closes.
Usage: python bench/fake_backend_server.py LATENCY_S
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply


async def main(latency_s: float) -> None:
    server = ScriptedLLMServer(lambda messages: ScriptedReply("ok", delay_s=latency_s))
    await server.start()
    print(server.base_url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
