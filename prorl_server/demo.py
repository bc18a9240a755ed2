"""The demo: rollouts of every task family on the embedded model, live progress, JSONL out.

Math, STEM and code tasks from data/demo_tasks.jsonl, then the first shipped
SWE task(s) (a real repository in its own image).

Starts a real server (Podman sandboxes, the embedded llama.cpp model) on a
free port and streams the tasks through it with the client's dataset runner
(the same code as `prorl run`), writing one line per rollout in the form
trainers consume. While it runs, everything the server (and the libraries and
processes under it) writes to stderr goes to a log file, so the terminal
shows only the progress bar; at the end come the summary table per task
family and an HTML page of the trajectories (`prorl view`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from prorl_client.display import print_summary
from prorl_client.runner import load_tasks, read_records, run
from prorl_client.viewer import TokenText, token_decoder, write_report

from prorl_client import Client
from prorl_server.app import ProrlServer
from prorl_server.config import ConfigError, Settings
from prorl_server.datasets.swe import load_task, task_dirs, to_task
from prorl_server.errors import ProrlError
from prorl_server.llm.llama_cpp_backend import default_model_path
from prorl_server.logging import configure_logging


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[TextIO]:
    """Point file descriptor 2 at `path` (C libraries and child processes too); yield the old stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    console = os.fdopen(os.dup(saved), "w", buffering=1)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)
    try:
        yield console
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        console.close()


def _token_text() -> TokenText | None:
    """Token text from the embedded model's vocabulary, if it loads."""
    try:
        return token_decoder(default_model_path())
    except (ProrlError, SystemExit, OSError, ValueError):
        return None


async def run_demo(settings: Settings, args: argparse.Namespace, console: TextIO) -> int:
    tasks = load_tasks(args.tasks, "math")
    tasks += [to_task(load_task(task_dir)) for task_dir in task_dirs()[: args.swe_tasks]]
    if args.limit:
        tasks = tasks[: args.limit]
    for task in tasks:
        task.setdefault("limits", {"max_turns": args.max_turns})
        task.setdefault("sampling", {"max_tokens": 256, "temperature": 0.7})
    args.out.write_text("")  # a demo starts afresh; `prorl run` resumes instead
    server = ProrlServer(settings)
    print("starting the server (sandboxes + embedded model)...", file=console, flush=True)
    await server.start()
    try:
        async with Client.connect(server.address) as client:
            display = await run(client, tasks, args.out, samples=args.samples, run_id="demo", progress_stream=console)
    finally:
        await server.stop()
    records = read_records(args.out)
    print_summary(records, console)
    html = args.html or args.out.with_suffix(".html")
    await asyncio.to_thread(write_report, args.out, html, token_text=_token_text())
    print(f"wrote {display.done} trajectories to {args.out}", file=console)
    print(f"trajectory viewer: file://{html.absolute()}", file=console)
    return 0 if display.done == display.total else 1


def main(settings: Settings, args: argparse.Namespace) -> int:
    """The demo with the server's log in a file (its path printed first)."""
    log_path: Path = args.log or args.out.with_name("demo_server.log")
    with stderr_to(log_path) as console:
        print(f"server log: {log_path.absolute()}", file=console, flush=True)
        configure_logging(log_format=settings.server.log_format, level=settings.server.log_level)
        try:
            return asyncio.run(run_demo(settings, args, console))
        except ProrlError as exc:
            print(f"prorl-server demo: {exc.message} (see {log_path})", file=console)
            return 1
        except ConfigError as exc:
            print(f"prorl-server demo: {exc}", file=console)
            return 2
        except KeyboardInterrupt:
            print("prorl-server demo: interrupted", file=console)
            return 130
