"""`prorl-server serve` as a child process of the trainer, as it would run beside a real one.

The server's log goes to a file; its address is read from that log. On exit the
server is stopped as an operator would (SIGTERM: it removes its sandboxes) and
killed if it does not end within 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

LISTENING = "prorl-server listening on "


@contextlib.asynccontextmanager
async def serve(log_path: Path, settings: Sequence[str] = (), *, start_timeout_s: float = 120) -> AsyncIterator[str]:
    """Start a server with `--set` overrides `settings`; yield its address."""
    flags = [arg for setting in settings for arg in ("--set", setting)]
    with log_path.open("w") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prorl_server", "serve", "--port", "0", "--log-level", "info", *flags,
            stdout=log, stderr=log, cwd="/",
        )  # fmt: skip
    try:
        yield await _address(process, log_path, start_timeout_s)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


async def _address(process: asyncio.subprocess.Process, log_path: Path, timeout_s: float) -> str:
    async with asyncio.timeout(timeout_s):
        while True:
            text = await asyncio.to_thread(log_path.read_text, errors="replace")
            for line in text.splitlines():
                if line.startswith(LISTENING):
                    return line.split()[-1]
            if process.returncode is not None:
                raise RuntimeError(f"prorl-server exited before listening; see {log_path}")
            await asyncio.sleep(0.2)
