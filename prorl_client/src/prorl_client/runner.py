"""`prorl run TASKS.jsonl --out RESULTS.jsonl`: stream a dataset through a server.

The task-line format is in prorl_client.task_lines (and the README): one JSON
object per line, {"id": ..., "handler": "math", "instance": {...}} plus
optional request fields ("sampling", "limits", "sandbox", "labels", ...). A bad
line is named (file, line, field) and skipped; with --strict nothing is
submitted.

Every task runs --samples times (a GRPO group, group_id = the task id). One
JSON line per rollout is appended to the output as soon as it finishes, with
the trajectory in the form trainers consume (token_ids, loss_mask, logprobs),
the task's handler (its family) and a timeline of the rollout built from the
streamed events, which `prorl view` draws. Requests the server refuses are
listed in RESULTS.rejected.jsonl (rewritten by each run).

Resuming: rerunning with the same output file runs only what is not done.
A rollout is done when its line says SUCCEEDED, or FAILED/TIMED_OUT as the
policy's failure; a CANCELLED one (the server stopped, or `prorl cancel`) or
one that failed as infrastructure is written with its status, not done, and
runs again on the next run under a new job id (`<id>.r1`, `.r2`, ...): the
server keeps a job's result under its id, so the old id would only give the
cancelled result back. Job ids follow from the output file (or --run-id), so a
rollout the server still holds (running when the previous run was
interrupted, or finished) is reattached rather than run twice; `prorl run`
says how many results came from such earlier jobs. --run-id NEW gives fresh
samples under new ids. Each job carries the label prorl-run=<run id>, which
`prorl jobs` and `prorl cancel` filter on.

The exit status says what happened (prorl_client.cli_common lists the codes).
Two runs on one output file are refused (a lock on the file).

The other commands: `prorl view` (prorl_client.viewer), `prorl import-swe`
(prorl_client.swe_import), `prorl import-harbor` (prorl_client.harbor_import),
`prorl tail` (prorl_client.tail), `prorl jobs`, `prorl job`, `prorl cancel`,
`prorl stats` (prorl_client.jobs_cli).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

import grpc
from google.protobuf.json_format import ParseDict

from prorl_client import cli_common, harbor_import, jobs_cli, swe_import, tail, v1
from prorl_client._client import Client
from prorl_client._errors import RpcError
from prorl_client.display import RunDisplay, print_summary
from prorl_client.records import result_record
from prorl_client.task_lines import LineError, read_task_lines

JOB_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]")
MAX_JOB_ID = 128
RUN_LABEL = "prorl-run"
"""Every job of a `prorl run` carries this label, its value the run id."""


def rollout_key(task_id: str, sample: int) -> str:
    return f"{task_id}#{sample}"


def load_tasks(path: Path, default_handler: str) -> list[dict[str, Any]]:
    """The file's tasks; ValueError listing every bad line (for callers that cannot skip any)."""
    tasks, errors = read_task_lines(path, default_handler)
    if errors:
        raise ValueError("\n".join(str(error) for error in errors))
    return tasks


def is_done(record: dict[str, Any]) -> bool:
    """A usable sample: not cancelled, and not an infrastructure failure (which a trainer masks)."""
    if record.get("status") in ("JOB_STATUS_CANCELLED", "JOB_STATUS_UNSPECIFIED", None):
        return False
    failure = record.get("failure") or {}
    return failure.get("kind") != "FAILURE_KIND_INFRASTRUCTURE"


@dataclass
class OutputState:
    """What the output file already holds: the rollouts done, and how often each was not."""

    done: set[str] = field(default_factory=set)
    attempts: Counter[str] = field(default_factory=Counter)


def output_state(path: Path) -> OutputState:
    state = OutputState()
    for record in read_records(path):
        try:
            key = rollout_key(str(record["task_id"]), int(record["sample"]))
        except (KeyError, TypeError, ValueError):
            continue
        if is_done(record):
            state.done.add(key)
        else:
            state.attempts[key] += 1
    return state


def done_keys(path: Path) -> set[str]:
    return output_state(path).done


def job_id_for(run_id: str, task_id: str, sample: int, attempt: int = 0) -> str:
    """A valid job id (1-128 of A-Z a-z 0-9 . _ : -) for any task id: other characters
    ("HumanEval/0") become "-", with a hash of the task id so that two ids never meet."""
    body = JOB_ID_CHARS.sub("-", task_id)
    suffix = f"-{sample}" + (f".r{attempt}" if attempt else "")
    job_id = f"{run_id}-{body}{suffix}"
    if body != task_id or len(job_id) > MAX_JOB_ID:
        digest = hashlib.sha1(task_id.encode()).hexdigest()[:8]
        room = MAX_JOB_ID - len(run_id) - len(suffix) - len(digest) - 2
        job_id = f"{run_id}-{body[: max(room, 0)]}-{digest}{suffix}"
    return job_id[:MAX_JOB_ID]


def default_run_id(out: Path) -> str:
    return "run-" + hashlib.sha1(str(out.absolute()).encode()).hexdigest()[:10]


def build_request(
    task: dict[str, Any],
    sample: int,
    run_id: str,
    *,
    attempt: int = 0,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> v1.RolloutRequest:
    """The request of one (task, sample); `overrides` ({"limits": {...}, "sampling": {...}})
    replace those fields of every task (the command line's --max-turns and the like)."""
    body: dict[str, Any] = {
        "job_id": job_id_for(run_id, str(task["id"]), sample, attempt),
        "handler": task["handler"],
        "instance": task["instance"],
        "group_id": str(task["id"])[:256],
    }
    for name in ("sampling", "limits", "sandbox", "labels", "priority", "retry", "min_policy_version"):
        if name in task:
            body[name] = task[name]
    for name, values in (overrides or {}).items():
        if values:
            body[name] = {**body.get(name, {}), **values}
    body["labels"] = {**body.get("labels", {}), RUN_LABEL: run_id}
    request = v1.RolloutRequest()
    ParseDict(body, request)
    return request


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
    tasks: list[dict[str, Any]],
    out: Path,
    *,
    samples: int = 1,
    run_id: str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[v1.RolloutRequest], dict[str, tuple[str, int]]]:
    """The requests of every (task, sample) not yet done in `out`, and each job's (task id, sample)."""
    state = output_state(out)
    # Job ids follow from the output file: a rerun resubmits the same ids, so a
    # job the server already ran (or is still running) is reattached, not redone;
    # a rollout that was not done gets the next attempt's id, so it runs afresh.
    run_id = run_id or default_run_id(out)
    by_job: dict[str, tuple[str, int]] = {}
    requests = []
    for task, sample in pending(tasks, samples, state.done):
        attempt = state.attempts[rollout_key(str(task["id"]), sample)]
        request = build_request(task, sample, run_id, attempt=attempt, overrides=overrides)
        by_job[request.job_id] = (str(task["id"]), sample)
        requests.append(request)
    return requests, by_job


def rejected_path(out: Path) -> Path:
    """Where a run lists the requests the server refused: RESULTS.rejected.jsonl beside RESULTS.jsonl."""
    return out.with_name(out.stem + ".rejected.jsonl") if out.suffix else out.with_name(out.name + ".rejected.jsonl")


@dataclass
class RunReport:
    """What one `prorl run` did, for its last lines and its exit status."""

    total: int = 0
    written: int = 0
    succeeded: int = 0
    policy_failed: int = 0
    not_done: int = 0
    """Written CANCELLED or as infrastructure failures: run again by the next run."""
    rejected: int = 0
    rerun: int = 0
    """Rollouts whose job an earlier run left cancelled (or failed as infrastructure) on the
    server under the id this run reused: run again under the next attempt's id."""
    from_earlier: int = 0
    """Results of jobs an earlier run had submitted under the same ids (reattached)."""
    display: RunDisplay | None = None

    def count(self, result: v1.RolloutResult) -> None:
        self.written += 1
        if result.status == v1.JOB_STATUS_SUCCEEDED:
            self.succeeded += 1
        elif result.status == v1.JOB_STATUS_CANCELLED or result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE:
            self.not_done += 1
        else:
            self.policy_failed += 1


class OutputLocked(Exception):
    """Another process is writing the output file."""


@contextlib.contextmanager
def locked_output(out: Path) -> Iterator[IO[str]]:
    """The output file opened for appending, with an exclusive lock held until the end:
    two runs appending to one file would each write every line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        try:
            fcntl.flock(sink.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLocked(str(out)) from None
        try:
            yield sink
        finally:
            fcntl.flock(sink.fileno(), fcntl.LOCK_UN)


async def run(
    client: Client,
    tasks: list[dict[str, Any]],
    out: Path,
    *,
    samples: int = 1,
    run_id: str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    progress_stream: TextIO = sys.stderr,
    live: bool | None = None,
    report: RunReport | None = None,
) -> RunDisplay:
    """Run every (task, sample) not yet done in `out`; append one line per finished rollout.

    Progress goes to `progress_stream`: a live bar on a terminal (`live`
    forces it on or off), a plain line per rollout otherwise. `report` (if
    given) is filled in as the run goes, so it tells how far an interrupted
    run got. Raises OutputLocked if another run holds `out`.
    """
    report = report if report is not None else RunReport()
    started_at = time.time()
    with locked_output(out) as sink:
        requests, by_job = await asyncio.to_thread(
            plan, tasks, out, samples=samples, run_id=run_id, overrides=overrides
        )
        handlers = {str(task["id"]): str(task["handler"]) for task in tasks}
        requests_by_id = {request.job_id: request for request in requests}
        display = RunDisplay(len(requests), progress_stream, live=live)
        report.total, report.display = len(requests), display
        rejections = rejected_path(out)
        rejections.unlink(missing_ok=True)
        if not requests:
            display.close()
            return display
        stream = _Stream(requests)
        timelines: dict[str, Timeline] = {}
        earlier: set[str] = set()
        try:
            async for item in client.rollout_many(stream.outgoing()):
                if isinstance(item, v1.RolloutRejected):
                    task_id, sample = by_job.get(item.job_id, ("", -1))
                    code = _code_name(item.code)
                    with rejections.open("a") as listed:
                        line = {"task_id": task_id, "sample": sample, "job_id": item.job_id}
                        listed.write(json.dumps({**line, "code": code, "message": item.message}) + "\n")
                    report.rejected += 1
                    display.note(f"rejected {task_id or item.job_id} (sample {sample}): {code}: {item.message}")
                    display.finished(item.job_id, ok=False, reward=0.0)
                    stream.ended()
                    continue
                timeline = timelines.setdefault(item.job_id, Timeline())
                if item.HasField("queued") and item.time.ToNanoseconds() / 1e9 < started_at - 1.0:
                    earlier.add(item.job_id)
                if not item.HasField("finished"):
                    timeline.add(item)
                    if item.HasField("phase_started"):
                        display.started(item.job_id)
                    continue
                result = item.finished.result
                task_id, sample = by_job[item.job_id]
                del timelines[item.job_id]
                if item.job_id in earlier and not _usable(result):
                    # A result kept from an earlier run's job (its server stopped, say), under an
                    # id this run reused: run that rollout afresh under the next attempt's id.
                    retry = next_attempt(item.job_id)
                    request = v1.RolloutRequest()
                    request.CopyFrom(requests_by_id[item.job_id])
                    request.job_id = retry
                    requests_by_id[retry] = request
                    by_job[retry] = (task_id, sample)
                    report.rerun += 1
                    stream.add(request)
                    stream.ended()
                    continue
                if item.job_id in earlier:
                    report.from_earlier += 1
                record = result_record(
                    task_id, sample, result, handler=handlers[task_id], timeline=timeline.finish(item)
                )
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                report.count(result)
                display.finished(item.job_id, ok=result.status == v1.JOB_STATUS_SUCCEEDED, reward=result.reward)
                stream.ended()
        finally:
            display.close()
    return display


class _Stream:
    """The requests of one RolloutStream: the planned ones, then any re-run; it ends (so the
    server ends the call) once every job sent has ended."""

    def __init__(self, requests: list[v1.RolloutRequest]) -> None:
        self._queue: asyncio.Queue[v1.RolloutRequest | None] = asyncio.Queue()
        self._open = 0
        for request in requests:
            self.add(request)

    def add(self, request: v1.RolloutRequest) -> None:
        self._open += 1
        self._queue.put_nowait(request)

    def ended(self) -> None:
        self._open -= 1
        if self._open <= 0:
            self._queue.put_nowait(None)

    async def outgoing(self) -> AsyncIterator[v1.RolloutRequest]:
        while (request := await self._queue.get()) is not None:
            yield request


def _usable(result: v1.RolloutResult) -> bool:
    return result.status != v1.JOB_STATUS_CANCELLED and result.failure.kind != v1.FAILURE_KIND_INFRASTRUCTURE


def next_attempt(job_id: str) -> str:
    """`x-0` -> `x-0.r1`, `x-0.r1` -> `x-0.r2`."""
    match = re.fullmatch(r"(.*)\.r(\d+)", job_id)
    return f"{match[1]}.r{int(match[2]) + 1}" if match else f"{job_id}.r1"


def _code_name(code: int) -> str:
    """A status code's name (3: INVALID_ARGUMENT)."""
    for status in grpc.StatusCode:
        number, _ = status.value
        if number == code:
            return str(status.name)
    return str(code)


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


def add_run_parser(commands: Any) -> None:
    run_parser = commands.add_parser(
        "run",
        help="run TASKS.jsonl, append results to --out (resumable)",
        description="Run every task of TASKS.jsonl --samples times; append one line per rollout to --out. "
        "Rerun the same command to resume. Exit status: 0 all done, 1 some rollouts cancelled or failed as "
        "infrastructure (rerun to run them again), 2 bad task lines or usage, 3 requests rejected (see "
        "RESULTS.rejected.jsonl), 4 server unreachable, 5 output file in use, 130 interrupted.",
    )
    run_parser.add_argument("tasks", type=Path, help="task lines (JSONL); '-' for standard input")
    run_parser.add_argument("--out", type=Path, required=True)
    cli_common.add_connection_flags(run_parser)
    run_parser.add_argument("--samples", type=int, default=1, help="rollouts per task (a GRPO group)")
    run_parser.add_argument("--handler", default="math", help="handler of lines that name none")
    run_parser.add_argument("--limit", type=int, help="only the first N tasks")
    run_parser.add_argument("--max-turns", type=int, help="limits.max_turns of every task")
    run_parser.add_argument("--max-tokens", type=int, help="sampling.max_tokens of every task (per model turn)")
    run_parser.add_argument("--temperature", type=float, help="sampling.temperature of every task")
    run_parser.add_argument(
        "--run-id",
        help="prefix of the job ids (default: from the output file's path); a new one gives fresh samples "
        "rather than the server's stored results of an earlier run",
    )
    run_parser.add_argument(
        "--strict", action="store_true", help="submit nothing if any task line is bad (default: skip bad lines)"
    )


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    limits = {"max_turns": args.max_turns} if args.max_turns is not None else {}
    sampling: dict[str, Any] = {}
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    return {"limits": limits, "sampling": sampling}


def _read_tasks(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[LineError]]:
    if str(args.tasks) == "-":
        return read_task_lines(Path("<stdin>"), args.handler, text=sys.stdin.read())
    return read_task_lines(args.tasks, args.handler)


def run_command(args: argparse.Namespace) -> int:
    if args.samples < 1:
        return cli_common.fail("prorl run: --samples must be at least 1", cli_common.EXIT_USAGE)
    for flag in ("limit", "max_turns", "max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return cli_common.fail(f"prorl run: --{flag.replace('_', '-')} must be at least 1", cli_common.EXIT_USAGE)
    if args.run_id is not None and not re.fullmatch(r"[A-Za-z0-9._:-]{1,40}", args.run_id):
        return cli_common.fail("prorl run: --run-id takes 1-40 of A-Z a-z 0-9 . _ : -", cli_common.EXIT_USAGE)
    if str(args.tasks) != "-" and not args.tasks.is_file():
        return cli_common.fail(f"prorl run: no task file {args.tasks}", cli_common.EXIT_USAGE)
    tasks, errors = _read_tasks(args)
    for error in errors:
        print(f"prorl run: {error}", file=sys.stderr)
    if errors and args.strict:
        return cli_common.fail(
            f"prorl run: {len(errors)} bad task line(s); nothing submitted (--strict)", cli_common.EXIT_USAGE
        )
    if args.limit is not None:
        tasks = tasks[: args.limit]
    run_id = args.run_id or default_run_id(args.out)
    report = RunReport()

    async def go() -> None:
        async with cli_common.connect(args) as client:
            await run(
                client, tasks, args.out, samples=args.samples, run_id=run_id, overrides=_overrides(args), report=report
            )

    cancel_hint = f"prorl cancel --server {args.server} --label {RUN_LABEL}={run_id}"
    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        print(
            f"\nprorl run: interrupted at {report.written}/{report.total}; the jobs keep running on the server; "
            f"rerun the same command to resume, or cancel them: {cancel_hint}",
            file=sys.stderr,
        )
        return cli_common.EXIT_INTERRUPTED
    except OutputLocked:
        return cli_common.fail(
            f"prorl run: another prorl run is writing {args.out}; wait for it to end or pass another --out",
            cli_common.EXIT_LOCKED,
        )
    except RpcError as exc:
        where = f" after {report.written}/{report.total} rollouts" if report.written else ""
        line = cli_common.rpc_error_line(exc, args.server)
        return cli_common.fail(f"{line}{where}; rerun the same command to resume", cli_common.EXIT_UNREACHABLE)
    print_summary(read_records(args.out), sys.stderr)
    return _report(args, report, errors)


def _report(args: argparse.Namespace, report: RunReport, errors: list[LineError]) -> int:
    """The run's last lines (what it wrote, what was not done and why) and its exit status."""

    def say(text: str) -> None:
        print(f"prorl run: {text}", file=sys.stderr)

    if not report.total:
        say(f"nothing to run: every rollout is already done in {args.out}")
    else:
        say(
            f"wrote {report.written} of {report.total} rollouts to {args.out}: {report.succeeded} succeeded, "
            f"{report.policy_failed} failed as the policy's (reward 0, a training sample), "
            f"{report.not_done} cancelled or failed as infrastructure"
        )
    if report.from_earlier:
        say(
            f"{report.from_earlier} of them are the stored results of jobs an earlier run submitted under the "
            "same ids; pass --run-id NEW for fresh samples"
        )
    if report.rerun:
        say(f"{report.rerun} rollouts ran again: the server held them cancelled or failed as infrastructure")
    if report.not_done:
        say(f"{report.not_done} not done (status in {args.out}): rerun the same command to run them again")
    if report.rejected:
        say(f"{report.rejected} requests rejected by the server: listed in {rejected_path(args.out)}")
    if errors:
        say(f"{len(errors)} bad task line(s) skipped (above)")
    if report.rejected:
        return cli_common.EXIT_REJECTED
    if errors:
        return cli_common.EXIT_USAGE
    if report.not_done or report.written < report.total:
        return cli_common.EXIT_ROLLOUTS_FAILED
    return cli_common.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prorl", description="Stream a dataset of tasks through a prorl server.")
    parser.add_argument("--version", action="version", version=f"prorl {cli_common.client_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_parser(commands)
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
    tail.add_parser(commands)
    harbor_import.add_parser(commands)
    jobs_cli.add_parsers(commands)
    args = parser.parse_args(argv)
    if args.command == "import-swe":
        return swe_import.command(args)
    if args.command == "tail":
        return tail.command(args)
    if args.command == "import-harbor":
        return harbor_import.command(args)
    if args.command == "view":
        from prorl_client.viewer import view_command

        return view_command(args.results, out=args.out, jobs=args.job, tokenizer=args.tokenizer)
    if args.command == "run":
        return run_command(args)
    return jobs_cli.command(args)


if __name__ == "__main__":
    sys.exit(main())
