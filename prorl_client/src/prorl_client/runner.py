"""`prorl run TASKS.jsonl --out RESULTS.jsonl`: stream a dataset through a server.

Each task line is a JSON object: {"id": ..., "handler": "math", "instance":
{...}} plus optional "sampling", "limits", "sandbox" objects (the fields of
RolloutRequest). A line without "instance" is taken as the instance itself
(its "id" and "handler" aside), so {"id": "q1", "question": ..., "answer": ...}
works with --handler math.

Every task runs --samples times (a GRPO group, group_id = the task id). One
JSON line per rollout is appended to the output as soon as it finishes, with
the trajectory in the form trainers consume (token_ids, loss_mask, logprobs).
Rerunning with the same output file skips the rollouts already in it; job
ids are derived from the output file, so a rollout the server still holds
(finished, or running when the previous run was interrupted) is reattached
rather than run twice. Each line also carries the task's handler (its
family) and a timeline of the rollout (queue, phases, model turns, tool
calls, cleanup) built from the streamed events, which `prorl view` draws.

`prorl view RESULTS.jsonl --out report.html` turns such a file into one
self-contained HTML page (see prorl_client.viewer).

`prorl import-swe FILE --format swe-bench|swe-gym|swe-smith|r2e-gym --out
TASKS.jsonl` turns a SWE dataset's instance file into task lines for `prorl
run` (see prorl_client.swe_import).

`prorl tail --server ADDR --out PATH` appends every finished trajectory that
matches a filter to PATH, from the service's event feed, resumably and exactly
once (see prorl_client.tail).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict

from prorl_client import swe_import, v1
from prorl_client._client import Client
from prorl_client.display import RunDisplay, print_summary


def rollout_key(task_id: str, sample: int) -> str:
    return f"{task_id}#{sample}"


def load_tasks(path: Path, default_handler: str) -> list[dict[str, Any]]:
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        task = json.loads(line)
        if not isinstance(task, dict):
            raise SystemExit(f"{path}:{number}: a task must be a JSON object")
        task.setdefault("id", f"line-{number}")
        task.setdefault("handler", default_handler)
        if "instance" not in task:
            task = {
                "id": task.pop("id"),
                "handler": task.pop("handler"),
                "instance": {k: v for k, v in task.items() if k not in ("sampling", "limits", "sandbox")},
                **{k: task[k] for k in ("sampling", "limits", "sandbox") if k in task},
            }
        tasks.append(task)
    return tasks


def done_keys(path: Path) -> set[str]:
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            keys.add(rollout_key(str(record["task_id"]), int(record["sample"])))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by an interrupted run: that rollout runs again
    return keys


def build_request(task: dict[str, Any], sample: int, run_id: str) -> v1.RolloutRequest:
    body: dict[str, Any] = {
        "job_id": f"{run_id}-{task['id']}-{sample}"[:128],
        "handler": task["handler"],
        "instance": task["instance"],
        "group_id": str(task["id"]),
    }
    for field in ("sampling", "limits", "sandbox", "labels", "priority"):
        if field in task:
            body[field] = task[field]
    request = v1.RolloutRequest()
    ParseDict(body, request)
    return request


def result_record(
    task_id: str,
    sample: int,
    result: v1.RolloutResult,
    *,
    handler: str = "",
    timeline: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    trajectory = result.trajectory
    return {
        "task_id": task_id,
        "sample": sample,
        "job_id": result.job_id,
        "handler": handler,
        "status": v1.JobStatus.Name(result.status),
        "reward": result.reward,
        "failure": MessageToDict(result.failure) if result.HasField("failure") else None,
        "messages": [MessageToDict(m) for m in trajectory.messages],
        "token_ids": list(trajectory.token_ids),
        "loss_mask": list(trajectory.loss_mask),
        "logprobs": [float(x) for x in trajectory.logprobs],
        "turn_policy_versions": list(trajectory.turn_policy_versions),
        # Where each turn's sampled ids are in token_ids (token backends), with its policy version.
        "turn_spans": [
            MessageToDict(span, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
            for span in trajectory.turn_spans
        ],
        "num_turns": trajectory.num_turns,
        "timing": MessageToDict(result.timing),
        "details": MessageToDict(result.details),
        "timeline": timeline or [],
    }


def _seconds(duration: Any) -> float:
    return float(duration.ToNanoseconds()) / 1e9


class Timeline:
    """A job's spans in seconds from its first event, from the events the runner saw.

    Events carry the time they happened; a model turn's and a tool result's
    is when they ended, so each starts its latency or duration earlier. The
    phases' lengths and the cleanup come from the result's timing.
    """

    def __init__(self) -> None:
        self._origin: float | None = None
        self._phase_starts: dict[str, float] = {}
        self._call_names: dict[str, str] = {}
        self.spans: list[dict[str, Any]] = []

    def _at(self, event: v1.RolloutEvent) -> float:
        at = event.time.ToNanoseconds() / 1e9
        if self._origin is None:
            self._origin = at
        return at - self._origin

    def add(self, event: v1.RolloutEvent) -> None:
        at = self._at(event)
        kind = event.WhichOneof("kind")
        if kind == "phase_started":
            name = v1.Phase.Name(event.phase_started.phase).removeprefix("PHASE_").lower()
            self._phase_starts[name] = at
        elif kind == "model_turn":
            turn = event.model_turn
            latency = _seconds(turn.latency)
            waited = _seconds(turn.model_wait)
            if waited:  # before the turn was sent: other jobs' turns held the backend
                start = at - latency
                self.spans.append(
                    {"kind": "wait", "name": f"wait {turn.turn}", "start": round(start - waited, 4),
                     "end": round(start, 4), "turn": turn.turn}
                )  # fmt: skip
            self.spans.append(
                {
                    "kind": "model",
                    "name": f"turn {turn.turn}",
                    "start": round(at - latency, 4),
                    "end": round(at, 4),
                    "turn": turn.turn,
                    "policy_version": turn.policy_version,
                    "backend": turn.backend_id,
                    "finish_reason": turn.finish_reason,
                    "prompt_tokens": turn.prompt_token_count,
                    "completion_tokens": turn.completion_token_count,
                }
            )
        elif kind == "tool_call":
            self._call_names[event.tool_call.call.id] = event.tool_call.call.name
        elif kind == "tool_result":
            tool = event.tool_result
            duration = _seconds(tool.duration)
            self.spans.append(
                {
                    "kind": "tool",
                    "name": tool.name or self._call_names.get(tool.call_id) or "invalid call",
                    "start": round(at - duration, 4),
                    "end": round(at, 4),
                    "turn": tool.turn,
                    "error": tool.error,
                    "exit_code": tool.exit_code if tool.HasField("exit_code") else None,
                }
            )

    def finish(self, event: v1.RolloutEvent) -> list[dict[str, Any]]:
        end = self._at(event)
        timing = event.finished.result.timing
        phases = [{"kind": "phase", "name": "queue", "start": 0.0, "end": round(_seconds(timing.queue), 4)}]
        for name, length in (("init", timing.init), ("run", timing.run), ("eval", timing.eval)):
            if name in self._phase_starts:
                start = self._phase_starts[name]
                phases.append(
                    {"kind": "phase", "name": name, "start": round(start, 4), "end": round(start + _seconds(length), 4)}
                )
        cleanup = _seconds(timing.cleanup)
        if cleanup:
            phases.append({"kind": "phase", "name": "cleanup", "start": round(end - cleanup, 4), "end": round(end, 4)})
        return phases + sorted(self.spans, key=lambda span: span["start"])


def pending(tasks: list[dict[str, Any]], samples: int, skip: set[str]) -> Iterator[tuple[dict[str, Any], int]]:
    for task in tasks:
        for sample in range(samples):
            if rollout_key(str(task["id"]), sample) not in skip:
                yield task, sample


def plan(
    tasks: list[dict[str, Any]], out: Path, *, samples: int = 1, run_id: str | None = None
) -> tuple[list[v1.RolloutRequest], dict[str, tuple[str, int]]]:
    """The requests of every (task, sample) not yet in `out`, and each job's (task id, sample)."""
    todo = list(pending(tasks, samples, done_keys(out)))
    # Job ids follow from the output file: a rerun resubmits the same ids, so a
    # job the server already ran (or is still running) is reattached, not redone.
    run_id = run_id or "run-" + hashlib.sha1(str(out.absolute()).encode()).hexdigest()[:10]
    by_job: dict[str, tuple[str, int]] = {}
    requests = []
    for task, sample in todo:
        request = build_request(task, sample, run_id)
        by_job[request.job_id] = (str(task["id"]), sample)
        requests.append(request)
    return requests, by_job


async def run(
    client: Client,
    tasks: list[dict[str, Any]],
    out: Path,
    *,
    samples: int = 1,
    run_id: str | None = None,
    progress_stream: TextIO = sys.stderr,
    live: bool | None = None,
) -> RunDisplay:
    """Run every (task, sample) not yet in `out`; append one line per finished rollout.

    Progress goes to `progress_stream`: a live bar on a terminal (`live`
    forces it on or off), a plain line per rollout otherwise.
    """
    requests, by_job = await asyncio.to_thread(plan, tasks, out, samples=samples, run_id=run_id)
    handlers = {str(task["id"]): str(task["handler"]) for task in tasks}
    display = RunDisplay(len(requests), progress_stream, live=live)
    if not requests:
        return display
    timelines: dict[str, Timeline] = {}
    try:
        with out.open("a") as sink:
            async for item in client.rollout_many(requests):
                if isinstance(item, v1.RolloutRejected):
                    display.note(f"rejected {item.job_id}: {item.message}")
                    display.finished(item.job_id, ok=False, reward=0.0)
                    continue
                timeline = timelines.setdefault(item.job_id, Timeline())
                if item.HasField("finished"):
                    result = item.finished.result
                    task_id, sample = by_job[item.job_id]
                    record = result_record(
                        task_id, sample, result, handler=handlers[task_id], timeline=timeline.finish(item)
                    )
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    del timelines[item.job_id]
                    display.finished(item.job_id, ok=result.status == v1.JOB_STATUS_SUCCEEDED, reward=result.reward)
                else:
                    timeline.add(item)
                    if item.HasField("phase_started"):
                        display.started(item.job_id)
    finally:
        display.close()
    return display


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a results file (a line cut short by an interrupted run is skipped)."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prorl", description="Stream a dataset of tasks through a prorl server.")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run TASKS.jsonl, append results to --out (resumable)")
    run_parser.add_argument("tasks", type=Path)
    run_parser.add_argument("--out", type=Path, required=True)
    run_parser.add_argument("--server", default="localhost:50051", help="host:port of the prorl server")
    run_parser.add_argument("--samples", type=int, default=1, help="rollouts per task (a GRPO group)")
    run_parser.add_argument("--handler", default="math", help="handler of lines that name none")
    run_parser.add_argument("--token", default=os.environ.get("PRORL_TOKEN"), help="bearer token (or PRORL_TOKEN)")
    run_parser.add_argument("--tls-ca", type=Path, help="PEM CA certificate: connect with TLS, trusting it")
    view_parser = commands.add_parser("view", help="write RESULTS.jsonl as one self-contained HTML page")
    view_parser.add_argument("results", type=Path)
    view_parser.add_argument(
        "--job", action="append", default=[], metavar="ID", help="only this job id or task id (repeatable)"
    )
    view_parser.add_argument("--out", type=Path, help="HTML file to write (default: RESULTS with .html)")
    view_parser.add_argument(
        "--tokenizer",
        type=Path,
        help="show token text: a GGUF model file (needs llama-cpp-python) or a Hugging Face tokenizer.json "
        "or its folder (needs tokenizers); token ids only without it",
    )
    swe_import.add_parser(commands)
    from prorl_client import tail  # here: tail writes its records with this module's result_record

    tail.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "import-swe":
        return swe_import.command(args)
    if args.command == "tail":
        return tail.command(args)
    if args.command == "view":
        from prorl_client.viewer import view_command

        return view_command(args.results, out=args.out, jobs=args.job, tokenizer=args.tokenizer)
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    tasks = load_tasks(args.tasks, args.handler)

    async def go() -> RunDisplay:
        credentials = grpc.ssl_channel_credentials(args.tls_ca.read_bytes()) if args.tls_ca else None
        async with Client.connect(args.server, credentials=credentials, token=args.token) as client:
            return await run(client, tasks, args.out, samples=args.samples)

    display = asyncio.run(go())
    print_summary(read_records(args.out), sys.stderr)
    print(f"{display.done} rollouts written to {args.out} ({display.failed} failed)", file=sys.stderr)
    return 0 if display.done == display.total else 1


if __name__ == "__main__":
    sys.exit(main())
