"""`prorl run` tells the truth: run as a user runs it (a child process), against a real server on
port 0 with fake sandboxes and a scripted in-process model.

The scripted policy reads the question: "answer N" finishes with N, "hold" waits until the test
releases it (or its job is cancelled)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio
from prorl_client.cli_common import server_target
from prorl_client.runner import job_id_for

from prorl_client import Client
from prorl_server.app import ProrlServer
from prorl_server.testing import FakeSandboxProvider, ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt
from tests.conftest import instance_id
from tests.helpers import assert_eventually, server_settings


class Served:
    """A server on fake sandboxes and a scripted model; `store` keeps its jobs in a SQLite file."""

    def __init__(self, store: Path | None = None) -> None:
        self.release = asyncio.Event()
        self.provider = FakeSandboxProvider(instance_id=instance_id("fake"))
        self.backend = ScriptedChatBackend(self.script)
        jobs: dict[str, Any] = {"store": False} if store is None else {"store": True, "store_path": str(store)}
        settings = server_settings(jobs=jobs)
        self.server = ProrlServer(settings, sandbox_provider=self.provider, backends=[self.backend])

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        question = user_prompt(messages)
        if question == "hold":
            return ScriptedReply(tool_call_text("finish", {"answer": "42"}), wait_for=self.release)
        return ScriptedReply(tool_call_text("finish", {"answer": question.split()[-1]}))

    async def __aenter__(self) -> Served:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self.server.stop()


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    async with Served() as served:
        yield served


def cli_env() -> dict[str, str]:
    return {**os.environ, "PRORL_TOKEN": "", "PRORL_SERVER": ""}


async def prorl(*args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    """`prorl ARGS` as a child process: (exit status, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prorl_client.runner", *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    out, err = await process.communicate(stdin)
    return process.returncode or 0, out.decode(), err.decode()


def write_lines(path: Path, *lines: dict[str, Any] | str) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_server_without_a_port_means_the_default_port() -> None:
    assert server_target("localhost") == "localhost:50051"
    assert server_target("10.0.0.5") == "10.0.0.5:50051"
    assert server_target("prorl.example:7000") == "prorl.example:7000"
    assert server_target("[::1]") == "[::1]:50051" and server_target("::1") == "[::1]:50051"
    assert server_target("[::1]:7000") == "[::1]:7000"
    assert server_target("dns:///prorl.example:50051") == "dns:///prorl.example:50051"


def test_any_task_id_gives_a_valid_job_id_and_two_ids_never_meet() -> None:
    ids = {job_id_for("run-abc", task, 0) for task in ("HumanEval/0", "HumanEval-0", "HumanEval 0", "x" * 300)}
    assert len(ids) == 4
    for job_id in ids:
        assert len(job_id) <= 128 and all(c.isalnum() or c in "._:-" for c in job_id), job_id
    assert job_id_for("run-abc", "q1", 2) == "run-abc-q1-2" and job_id_for("run-abc", "q1", 2, 1) == "run-abc-q1-2.r1"


async def test_bad_lines_are_named_and_skipped_and_strict_submits_nothing(served: Served, tmp_path: Path) -> None:
    tasks = write_lines(
        tmp_path / "tasks.jsonl",
        {"id": "good", "question": "answer 7", "answer": "7"},
        '{"id": "broken", "question": ',
        {"id": "typo", "question": "answer 1", "answer": "1", "limits": {"max_turn": 3}},
        {"id": "top", "handler": "math", "instance": {"question": "answer 2", "answer": "2"}, "sampling ": {}},
        {"id": "camel", "question": "answer 3", "answer": "3", "limits": {"maxTurns": "three"}},
    )
    out = tmp_path / "out.jsonl"

    code, _, err = await prorl("run", str(tasks), "--out", str(out), "--server", served.server.address, "--strict")

    assert code == 2, err
    assert "nothing submitted (--strict)" in err and not served.backend.requests and not out.exists()

    code, _, err = await prorl("run", str(tasks), "--out", str(out), "--server", served.server.address)

    assert code == 2, err
    assert f"{tasks}:2: not JSON" in err
    assert f"{tasks}:3: limits.max_turn: unknown field; did you mean 'max_turns'?" in err
    assert f"{tasks}:4: sampling : unknown field; did you mean 'sampling'?" in err
    assert f"{tasks}:5: limits" in err
    assert "Traceback" not in err
    assert [(r["task_id"], r["reward"]) for r in records(out)] == [("good", 1.0)]  # the good line still ran
    assert "3 bad task line(s) skipped" in err or "4 bad task line(s) skipped" in err


async def test_rejections_are_recorded_and_the_exit_status_says_so(served: Served, tmp_path: Path) -> None:
    tasks = write_lines(
        tmp_path / "tasks.jsonl",
        {"id": "ok", "question": "answer 4", "answer": "4"},
        # `choice` for `choices`: without the check this became a short-answer task
        {"id": "stem", "handler": "stem", "question": "Which?", "choice": ["a", "b"], "answer": "A"},
        {"id": "nohandler", "handler": "chess", "question": "answer 1", "answer": "1"},
    )
    out = tmp_path / "out.jsonl"

    code, _, err = await prorl("run", str(tasks), "--out", str(out), "--server", served.server.address)

    assert code == 3, err
    rejected = records(tmp_path / "out.rejected.jsonl")
    by_task = {r["task_id"]: r for r in rejected}
    assert set(by_task) == {"stem", "nohandler"}
    assert by_task["stem"]["code"] == "INVALID_ARGUMENT"
    assert "'choice'" in by_task["stem"]["message"] and "did you mean 'choices'?" in by_task["stem"]["message"]
    assert "unknown handler 'chess'" in by_task["nohandler"]["message"]
    assert [r["task_id"] for r in records(out)] == ["ok"]
    assert f"2 requests rejected by the server: listed in {tmp_path / 'out.rejected.jsonl'}" in err
    assert "wrote 1 of 3 rollouts" in err


async def test_unreachable_server_is_one_line_with_the_fix(tmp_path: Path) -> None:
    tasks = write_lines(tmp_path / "tasks.jsonl", {"id": "q", "question": "answer 1", "answer": "1"})
    code, _, err = await prorl("run", str(tasks), "--out", str(tmp_path / "o.jsonl"), "--server", "127.0.0.1:1")
    assert code == 4
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot reach a prorl server at 127.0.0.1:1" in lines[0]
    assert "prorl-server serve" in lines[0] and "--server HOST:PORT" in lines[0]
    code, _, err = await prorl("jobs", "--server", "127.0.0.1:1")
    assert code == 4 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


async def test_a_second_run_on_one_output_is_refused(served: Served, tmp_path: Path) -> None:
    tasks = write_lines(tmp_path / "tasks.jsonl", {"id": "q", "question": "answer 1", "answer": "1"})
    out = tmp_path / "out.jsonl"
    with out.open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as a running `prorl run` holds it
        code, _, err = await prorl("run", str(tasks), "--out", str(out), "--server", served.server.address)
    assert code == 5 and "another prorl run is writing" in err
    assert out.read_text() == "" and not served.backend.requests


async def test_flags_set_every_tasks_limits_and_sampling(served: Served, tmp_path: Path) -> None:
    tasks = write_lines(
        tmp_path / "tasks.jsonl",
        {"id": "a", "question": "answer 1", "answer": "1", "sampling": {"max_tokens": 99}},
        {"id": "b", "question": "answer 2", "answer": "2"},
    )
    out = tmp_path / "out.jsonl"
    args = ("--out", str(out), "--server", served.server.address, "--limit", "1")
    code, _, err = await prorl("run", str(tasks), *args, "--max-tokens", "17", "--temperature", "0.25")
    assert code == 0, err
    assert [r["task_id"] for r in records(out)] == ["a"]
    (request,) = served.backend.requests
    assert request.sampling.max_tokens == 17 and request.sampling.temperature == 0.25

    async with Client.connect(served.server.address) as client:
        job = await client.get_job(records(out)[0]["job_id"])
    assert job.labels["prorl-run"].startswith("run-")


async def test_stored_results_are_reported_and_a_new_run_id_gives_fresh_samples(served: Served, tmp_path: Path) -> None:
    tasks = write_lines(tmp_path / "tasks.jsonl", {"id": "q", "question": "answer 5", "answer": "5"})
    out = tmp_path / "out.jsonl"
    args = ("run", str(tasks), "--out", str(out), "--server", served.server.address)
    assert (await prorl(*args))[0] == 0
    asked = len(served.backend.requests)
    out.unlink()  # a user deletes the output to sample again
    # prorl run tells an earlier run's job by its queue time: over 1 s (its clock-skew slack)
    # before this run started. A user's rerun is never quicker than that; this one could be.
    await asyncio.sleep(1.2)

    code, _, err = await prorl(*args)

    assert code == 0, err
    assert len(served.backend.requests) == asked  # the server's stored result came back...
    assert (
        "stored results of jobs an earlier run submitted under the same ids; pass --run-id NEW" in err
    )  # ...and said so
    out.unlink()
    code, _, err = await prorl(*args, "--run-id", "again")
    assert code == 0, err
    assert len(served.backend.requests) > asked  # fresh samples
    assert records(out)[0]["job_id"] == "again-q-0"


async def test_ctrl_c_is_one_line_and_the_jobs_can_be_cancelled(served: Served, tmp_path: Path) -> None:
    tasks = write_lines(
        tmp_path / "tasks.jsonl", {"id": "h1", "question": "hold", "answer": "42"}, {"id": "h2", "question": "hold"}
    )
    tasks.write_text(tasks.read_text().replace('"question": "hold"}', '"question": "hold", "answer": "42"}'))
    out = tmp_path / "out.jsonl"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prorl_client.runner", "run", str(tasks), "--out", str(out),
        "--server", served.server.address, "--run-id", "ctrlc",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    await assert_eventually(lambda: served.backend.in_flight == 2, message="the jobs never reached the model")
    process.send_signal(signal.SIGINT)
    _, err_bytes = await process.communicate()
    err = err_bytes.decode()

    assert process.returncode == 130, err
    assert "Traceback" not in err
    (line,) = [text for text in err.splitlines() if "interrupted" in text]
    assert "interrupted at 0/2; the jobs keep running on the server; rerun the same command to resume" in line
    assert f"prorl cancel --server {served.server.address} --label prorl-run=ctrlc" in line

    code, listed, _ = await prorl("jobs", "--server", served.server.address, "--label", "prorl-run=ctrlc")
    assert code == 0 and len(listed.splitlines()) == 2 and all(" running " in x for x in listed.splitlines())
    code, _, err = await prorl("cancel", "--server", served.server.address, "--label", "prorl-run=ctrlc")
    assert code == 0 and "2 job(s) cancelled" in err
    code, listed, _ = await prorl("jobs", "--server", served.server.address, "--status", "cancelled")
    assert code == 0 and sorted(x.split()[0] for x in listed.splitlines()) == ["ctrlc-h1-0", "ctrlc-h2-0"]
    code, shown, _ = await prorl("job", "ctrlc-h1-0", "--server", served.server.address)
    assert code == 0 and "status    cancelled" in shown and "cancelled with prorl cancel" in shown
    code, _, err = await prorl("job", "no-such-job", "--server", served.server.address)
    assert code == 2 and "no job with id 'no-such-job'" in err
    code, shown, _ = await prorl("stats", "--server", served.server.address, "--json")
    assert code == 0 and isinstance(json.loads(shown), dict)


async def test_jobs_a_stopping_server_cancelled_run_again_on_the_next_run(tmp_path: Path) -> None:
    store = tmp_path / "jobs.sqlite"
    tasks = write_lines(
        tmp_path / "tasks.jsonl",
        {"id": "quick", "question": "answer 3", "answer": "3"},
        {"id": "slow", "question": "hold", "answer": "42"},
    )
    out = tmp_path / "out.jsonl"
    async with Served(store) as first:
        run = asyncio.create_task(prorl("run", str(tasks), "--out", str(out), "--server", first.server.address))
        await assert_eventually(lambda: first.backend.in_flight == 1 and out.exists() and out.read_text() != "")
        await first.server.stop()  # shutdown_grace_s = 0: the held job is cancelled
        code, _, err = await run

    assert code in (1, 4), err  # its CANCELLED line written (1), or the stream cut first (4)
    assert "Traceback" not in err
    written = {r["task_id"]: r["status"] for r in records(out)}
    assert written["quick"] == "JOB_STATUS_SUCCEEDED" and written.get("slow", "JOB_STATUS_CANCELLED") == (
        "JOB_STATUS_CANCELLED"
    )

    async with Served(store) as second:  # the same job store: the cancelled job's result is kept there
        second.release.set()
        code, _, err = await prorl("run", str(tasks), "--out", str(out), "--server", second.server.address)

    assert code == 0, err
    final = [r for r in records(out) if r["task_id"] == "slow" and r["status"] == "JOB_STATUS_SUCCEEDED"]
    assert len(final) == 1 and final[0]["reward"] == 1.0  # ran again, not the stored CANCELLED result
    # Under a new id either way: the old one holds the cancelled result on the server, whether
    # the first run wrote its CANCELLED line or was cut off before it.
    assert final[0]["job_id"].endswith("-slow-0.r1")
    assert "wrote 1 of 1 rollouts" in err
