"""`prorl jobs`, `prorl job ID`, `prorl cancel`, `prorl stats`: the server's jobs from a terminal.

- `prorl jobs [--status S] [--group G] [--label K=V] [--limit N]`: one line per
  job (id, status, phase, handler, group, reward), oldest first.
- `prorl job ID`: a job's status, phase, times and, once it ended, its result
  (reward, failure, turns, timing).
- `prorl cancel ID...` or `prorl cancel --group G` / `--label K=V` (every
  running or queued job that matches; `prorl run` labels its jobs
  prorl-run=<run id>, which its Ctrl-C message names).
- `prorl stats`: the server's load (queue depth per phase, sandboxes, backends).

`--json` prints the messages as JSON instead. Errors are one line (exit 4 when
the server cannot be reached, 2 for an unknown job or bad flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
from google.protobuf.json_format import MessageToDict

from prorl_client import cli_common, v1
from prorl_client._client import Client
from prorl_client._errors import RpcError

ACTIVE = (v1.JOB_STATUS_QUEUED, v1.JOB_STATUS_RUNNING)


def _status(text: str) -> v1.JobStatus:
    name = "JOB_STATUS_" + text.upper().removeprefix("JOB_STATUS_")
    if name not in v1.JobStatus.keys() or name == "JOB_STATUS_UNSPECIFIED":  # noqa: SIM118 (an enum wrapper)
        known = ", ".join(n.removeprefix("JOB_STATUS_").lower() for n in v1.JobStatus.keys()[1:])
        raise argparse.ArgumentTypeError(f"unknown status {text!r}; one of: {known}")
    return cast("v1.JobStatus", v1.JobStatus.Value(name))


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _short(status: int) -> str:
    return v1.JobStatus.Name(status).removeprefix("JOB_STATUS_").lower()


def _phase(phase: int) -> str:
    return v1.Phase.Name(phase).removeprefix("PHASE_").lower()


def add_parsers(commands: Any) -> None:
    jobs = commands.add_parser("jobs", help="list the server's jobs (filters: status, group, label)")
    cli_common.add_connection_flags(jobs)
    jobs.add_argument("--status", type=_status, action="append", default=[], help="queued, running, succeeded, ...")
    jobs.add_argument("--group", default="", help="only this group id")
    jobs.add_argument("--label", type=_label, action="append", default=[], metavar="KEY=VALUE")
    jobs.add_argument("--limit", type=int, default=100, help="at most N jobs (0: all)")
    jobs.add_argument("--json", action="store_true", help="one JSON object per job")

    job = commands.add_parser("job", help="one job's status and result summary")
    cli_common.add_connection_flags(job)
    job.add_argument("job_id")
    job.add_argument("--json", action="store_true", help="the whole Job message as JSON")

    cancel = commands.add_parser("cancel", help="cancel jobs by id, group or label")
    cli_common.add_connection_flags(cancel)
    cancel.add_argument("job_ids", nargs="*", metavar="ID")
    cancel.add_argument("--group", default="", help="every queued or running job of this group")
    cancel.add_argument("--label", type=_label, action="append", default=[], metavar="KEY=VALUE")
    cancel.add_argument("--reason", default="cancelled with prorl cancel")

    stats = commands.add_parser("stats", help="the server's load: queues, sandboxes, backends")
    cli_common.add_connection_flags(stats)
    stats.add_argument("--cluster", action="store_true", help="every server of the cluster too")
    stats.add_argument("--json", action="store_true")


async def iter_jobs(
    client: Client,
    *,
    statuses: list[v1.JobStatus] | tuple[v1.JobStatus, ...] = (),
    group_id: str = "",
    labels: dict[str, str] | None = None,
    limit: int = 0,
) -> AsyncIterator[v1.Job]:
    """The matching jobs, oldest first, following pages; at most `limit` (0: all)."""
    token, seen = "", 0
    while True:
        page = await client.list_jobs(
            statuses=statuses, group_id=group_id, labels=labels, page_size=200, page_token=token
        )
        for job in page.jobs:
            yield job
            seen += 1
            if limit and seen >= limit:
                return
        token = page.next_page_token
        if not token:
            return


def job_line(job: v1.Job) -> str:
    reward = f"{job.result.reward:.3f}" if job.HasField("result") else "-"
    failure = ""
    if job.HasField("result") and job.result.HasField("failure"):
        kind = v1.FailureKind.Name(job.result.failure.kind).removeprefix("FAILURE_KIND_").lower()
        failure = f"  {kind}:{job.result.failure.reason}"
    group = job.group_id or "-"
    return f"{job.job_id}  {_short(job.status)}  {_phase(job.phase)}  {job.handler}  {group}  {reward}{failure}"


def job_summary(job: v1.Job) -> str:
    lines = [
        f"job       {job.job_id}",
        f"status    {_short(job.status)} (phase {_phase(job.phase)})",
        f"handler   {job.handler}",
        f"group     {job.group_id or '-'}",
    ]
    if job.labels:
        lines.append("labels    " + ", ".join(f"{k}={v}" for k, v in sorted(job.labels.items())))
    for name in ("create_time", "start_time", "end_time"):
        if job.HasField(name):
            lines.append(f"{name.removesuffix('_time'):<10}{getattr(job, name).ToJsonString()}")
    if job.HasField("result"):
        result = job.result
        lines.append(f"reward    {result.reward:g}")
        if result.HasField("failure"):
            failure = result.failure
            kind = v1.FailureKind.Name(failure.kind).removeprefix("FAILURE_KIND_").lower()
            lines.append(f"failure   {kind} in {_phase(failure.phase)}: {failure.reason}: {failure.message}")
        lines.append(f"turns     {result.trajectory.num_turns}")
        timing = MessageToDict(result.timing)
        if timing:
            lines.append("timing    " + ", ".join(f"{k} {v}" for k, v in timing.items()))
        stop = result.details.fields.get("stop_reason")
        if stop is not None:
            lines.append(f"stopped   {stop.string_value}")
    return "\n".join(lines)


async def _jobs(client: Client, args: argparse.Namespace) -> int:
    count = 0
    async for job in iter_jobs(
        client, statuses=args.status, group_id=args.group, labels=dict(args.label), limit=args.limit
    ):
        count += 1
        if args.json:
            print(json.dumps(MessageToDict(job, preserving_proto_field_name=True)))
        else:
            print(job_line(job))
    if not args.json:
        print(f"{count} job(s)", file=sys.stderr)
    return cli_common.EXIT_OK


async def _job(client: Client, args: argparse.Namespace) -> int:
    job = await client.get_job(args.job_id)
    if args.json:
        print(json.dumps(MessageToDict(job, preserving_proto_field_name=True)))
    else:
        print(job_summary(job))
    return cli_common.EXIT_OK


async def _cancel(client: Client, args: argparse.Namespace) -> int:
    if not (args.job_ids or args.group or args.label):
        return cli_common.fail("prorl cancel: name job ids, --group or --label", cli_common.EXIT_USAGE)
    ids = list(args.job_ids)
    if args.group or args.label:
        ids += [
            job.job_id async for job in iter_jobs(client, statuses=ACTIVE, group_id=args.group, labels=dict(args.label))
        ]
    # At once: each Cancel waits until its job's sandboxes are gone.
    jobs = await asyncio.gather(*(client.cancel(job_id, reason=args.reason) for job_id in dict.fromkeys(ids)))
    for job in jobs:
        print(f"{job.job_id}  {_short(job.status)}")
    print(f"prorl cancel: {len(jobs)} job(s) cancelled (those already ended keep their result)", file=sys.stderr)
    return cli_common.EXIT_OK


async def _stats(client: Client, args: argparse.Namespace) -> int:
    stats = await client.get_stats(include_cluster=args.cluster)
    text = MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        print(json.dumps(text))
        return cli_common.EXIT_OK
    for key, value in text.items():
        print(f"{key}: {json.dumps(value)}" if isinstance(value, (dict, list)) else f"{key}: {value}")
    return cli_common.EXIT_OK


COMMANDS = {"jobs": _jobs, "job": _job, "cancel": _cancel, "stats": _stats}


def command(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with cli_common.connect(args) as client:
            return await COMMANDS[args.command](client, args)

    try:
        return asyncio.run(go())
    except KeyboardInterrupt:
        return cli_common.EXIT_INTERRUPTED
    except RpcError as exc:
        if exc.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            return cli_common.fail(f"prorl {args.command}: {exc.details}", cli_common.EXIT_USAGE)
        return cli_common.fail(cli_common.rpc_error_line(exc, args.server), cli_common.EXIT_UNREACHABLE)
