"""The demo: rollouts of every task family on the embedded model, live progress, JSONL out.

Math, STEM and code tasks from data/demo_tasks.jsonl, then the first shipped
SWE task(s) (a real repository in its own image).

Beside them, reference runs whose reward is known before they run (`reference_tasks`):
no model, a program in the sandbox (the command family) submits an answer known to be
right or wrong, or applies the task's gold patch or nothing, and the same verifiers
score it. They must score 1 and 0: a 135M model rarely solves anything, so without
them a newcomer could not tell a working reward path from a broken one. The demo
prints them in a table of their own and fails if one scores otherwise.

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
from typing import Any, TextIO

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


REFERENCE_LABEL = "reference"
"""The label (value: the reward it must get) that marks a reference run."""


def _reference(
    task_id: str, expected: float, what: str, verifier: str, task: dict[str, Any], **program: Any
) -> dict[str, Any]:
    instance = {"program": program, "verifier": verifier, "task": task, "submission": program.pop("submission")}
    return {
        "id": task_id,
        "handler": "command",
        "instance": instance,
        "labels": {REFERENCE_LABEL: f"{expected:g}", "shows": what},
    }


def reference_tasks(swe_instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs whose reward is known: a right and a wrong math answer, and for each SWE task its
    gold patch and no change at all, each submitted by a program instead of the model."""
    question = {"question": "What is 17 + 25?", "answer": "42"}
    tasks = [
        _reference("ref-math-right", 1.0, "prints 42 to 'What is 17 + 25?'", "math", question,
                   argv=["echo", "42"], submission="last_line"),
        _reference("ref-math-wrong", 0.0, "prints 41 to 'What is 17 + 25?'", "math", question,
                   argv=["echo", "41"], submission="last_line"),
    ]  # fmt: skip
    for instance in swe_instances:
        shown = {key: value for key, value in instance.items() if key != "patch"}
        repo = str(instance.get("repo_dir") or "/testbed")
        name = instance["instance_id"]
        tasks += [
            _reference(f"ref-{name}-gold-patch", 1.0, "applies the upstream fix", "swe", shown,
                       argv=["git", "apply", "/tmp/gold.patch"], cwd=repo, files={"/tmp/gold.patch": instance["patch"]},
                       submission="git_diff"),
            _reference(f"ref-{name}-no-change", 0.0, "changes nothing", "swe", shown,
                       argv=["true"], cwd=repo, submission="git_diff"),
        ]  # fmt: skip
    return tasks


def reference_table(records: list[dict[str, Any]], tasks: list[dict[str, Any]]) -> tuple[str, bool]:
    """The reference runs as a table, and whether each got the reward it must."""
    by_id = {task["id"]: task for task in tasks if REFERENCE_LABEL in task.get("labels", {})}
    lines = ["reference runs (no model: a program submits a known answer; the same verifiers score it)"]
    all_ok = True
    for record in records:
        task = by_id.get(str(record.get("task_id")))
        if task is None:
            continue
        expected = float(task["labels"][REFERENCE_LABEL])
        got = float(record.get("reward") or 0.0)
        ok = record.get("status") == "JOB_STATUS_SUCCEEDED" and got == expected
        all_ok &= ok
        status = "ok" if ok else f"WRONG ({record.get('status')}, {(record.get('failure') or {}).get('message', '')})"
        lines.append(f"  {task['id']:<48} {task['labels']['shows']:<36} must {expected:g}  got {got:g}  {status}")
    seen = {str(record.get("task_id")) for record in records}
    for missing in sorted(set(by_id) - seen):
        all_ok = False
        lines.append(f"  {missing:<48} did not finish")
    return "\n".join(lines), all_ok


async def run_demo(settings: Settings, args: argparse.Namespace, console: TextIO) -> int:
    tasks = load_tasks(args.tasks, "math")
    swe = [load_task(task_dir) for task_dir in task_dirs()[: args.swe_tasks]]
    tasks += [to_task(instance) for instance in swe]
    if args.limit:
        tasks = tasks[: args.limit]
    for task in tasks:
        task.setdefault("limits", {"max_turns": args.max_turns})
        task.setdefault("sampling", {"max_tokens": 256, "temperature": 0.7})
    references = [] if args.no_reference else reference_tasks(swe)
    tasks += references
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
    reference_ids = {task["id"] for task in references}
    print_summary([r for r in records if r.get("task_id") not in reference_ids], console)
    references_ok = True
    if references:
        table, references_ok = reference_table(records, references)
        print(table, file=console)
    html = args.html or args.out.with_suffix(".html")
    await asyncio.to_thread(write_report, args.out, html, token_text=_token_text())
    print(f"wrote {display.done} trajectories to {args.out}", file=console)
    print(f"trajectory viewer: file://{html.absolute()}", file=console)
    if not references_ok:
        print("a reference run did not get the reward it must: the reward path is broken", file=console)
        return 1
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
