"""The in-sandbox runtime's operations through the typed protocol, without Podman: the
real runtime (sandbox/runtime/prorl_runtime.py) in a local process, on a temporary
socket, driven by the same Sandbox and SocketRuntime the server uses (through the
fake provider, tests/fakes/sandbox_provider.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from prorl_server.errors import SandboxError
from prorl_server.sandbox.base import Sandbox, SandboxSpec
from prorl_server.sandbox.blame import process_ref, process_status
from prorl_server.sandbox.runtime.protocol import (
    BashRequest,
    BashResponse,
    EditRequest,
    HealthResponse,
    PythonRequest,
    PythonResponse,
)
from prorl_server.sandbox.runtime.socket_runtime import SocketRuntime
from tests.fakes.sandbox_provider import FakeContainer, FakeSandboxProvider

SPEC = SandboxSpec(image="fake-python", cpus=1.0, memory_mib=256, pids_limit=64)


@pytest_asyncio.fixture
async def sandbox(fake_provider: FakeSandboxProvider) -> AsyncIterator[Sandbox]:
    sandbox = await fake_provider.create(SPEC)
    yield sandbox
    await sandbox.close()


def workdir(sandbox: Sandbox) -> Path:
    container = sandbox.container
    assert isinstance(container, FakeContainer)
    return container.workdir


def processes_running(command_line: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line is exactly `command_line`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        ref = process_ref(int(entry))
        if cmdline == command_line and ref is not None and process_status(ref) != "gone":
            found.append(int(entry))
    return found


async def test_bash_output_exit_code_and_state(sandbox: Sandbox) -> None:
    assert sandbox.mode == "runtime" and isinstance(sandbox.runtime, SocketRuntime)
    result = await sandbox.bash("echo hello; echo oops >&2; (exit 3)", timeout_s=10)
    assert result.exit_code == 3 and result.output == "hello\noops\n" and not result.timed_out
    ended = await sandbox.bash("exit 7", timeout_s=10)
    assert ended.exit_code == 7 and "the shell exited" in ended.output
    await sandbox.bash("mkdir -p sub && cd sub && export GREETING=hi", timeout_s=10)
    state = await sandbox.bash('pwd; echo "$GREETING"', timeout_s=10)
    assert state.output.split() == [str(workdir(sandbox) / "sub"), "hi"] and state.exit_code == 0


async def test_the_typed_runtime_answers_typed_responses(sandbox: Sandbox) -> None:
    runtime = sandbox.runtime
    bash = await runtime.bash(BashRequest("printf %s abc", timeout_s=10))
    assert isinstance(bash, BashResponse) and bash.output == "abc" and bash.exit_code == 0
    python = await runtime.python(PythonRequest("print(6 * 7)", timeout_s=10))
    assert isinstance(python, PythonResponse) and python.output == "42\n" and not python.state_lost
    edit = await runtime.edit(EditRequest("create", "typed.txt", file_text="x\n"))
    assert not edit.is_error and (workdir(sandbox) / "typed.txt").read_text() == "x\n"
    health = await sandbox.health()
    assert isinstance(health, HealthResponse) and health.ok and health.pid and health.python


async def test_a_timeout_kills_the_commands_process_group_and_the_shell_lives_on(sandbox: Sandbox) -> None:
    result = await sandbox.bash("echo started; sleep 61.25 | cat; echo never", timeout_s=1)
    assert result.timed_out and result.exit_code == 124
    assert "started" in result.output and "never" not in result.output and "timed out after 1s" in result.output
    assert processes_running("sleep 61.25") == []  # the whole pipeline's group is gone
    assert (await sandbox.bash("echo next", timeout_s=10)).output == "next\n"


async def test_python_names_persist_and_errors_show_only_the_agents_frames(sandbox: Sandbox) -> None:
    await sandbox.python("total = 40", timeout_s=10)
    result = await sandbox.python("total += 2\nprint(total)", timeout_s=10)
    assert result.output == "42\n" and not result.is_error
    error = await sandbox.python("undefined_name", timeout_s=10)
    assert error.is_error and "NameError: name 'undefined_name' is not defined" in error.output
    assert "prorl_runtime" not in error.output
    slow = await sandbox.python("import time\nstate = 1\ntime.sleep(60)", timeout_s=1)
    assert slow.timed_out and slow.is_error and "KeyboardInterrupt" in slow.output
    assert (await sandbox.python("print(state)", timeout_s=10)).output == "1\n"


async def test_an_interpreter_the_machine_does_not_run_for_seconds_keeps_its_names_through_an_interrupt(
    sandbox: Sandbox,
) -> None:
    """A busy machine, made certain: the worker is stopped (SIGSTOP) when its call times out and
    continued 3 s later. It takes the interrupt then, so its names are kept; a fixed grace of
    1 s used to kill it first ("variables defined so far are lost")."""
    started = await sandbox.python("import os, time\nstate = 7\nprint(os.getpid())", timeout_s=30)
    worker = int(started.output)
    call = asyncio.create_task(sandbox.python("time.sleep(60)", timeout_s=1))
    os.kill(worker, signal.SIGSTOP)
    try:
        await asyncio.sleep(3)  # not a timeout: how long the machine "does not run" the worker
    finally:
        os.kill(worker, signal.SIGCONT)
    slow = await call
    assert slow.timed_out and not slow.state_lost and "KeyboardInterrupt" in slow.output, slow.output
    again = await sandbox.python("print(state, os.getpid())", timeout_s=30)
    assert again.output == f"7 {worker}\n"


async def test_code_that_swallows_the_interrupt_is_killed_and_says_its_names_are_lost(sandbox: Sandbox) -> None:
    await sandbox.python("state = 1", timeout_s=30)
    code = "import time\nwhile True:\n    try:\n        time.sleep(60)\n    except KeyboardInterrupt:\n        pass"
    stubborn = await sandbox.python(code, timeout_s=1)
    assert stubborn.timed_out and stubborn.state_lost and "variables defined so far are lost" in stubborn.output
    fresh = await sandbox.python("print('state' in globals())", timeout_s=30)
    assert fresh.output == "False\n" and not fresh.is_error


async def test_editor_view_create_replace_insert_and_undo(sandbox: Sandbox) -> None:
    created = await sandbox.edit("create", "app.py", file_text="def f():\n    return 1\n")
    assert not created.is_error and "Created" in created.output
    view = await sandbox.edit("view", "app.py")
    assert "     1\tdef f():" in view.output and "     2\t    return 1" in view.output
    partial = await sandbox.edit("view", "app.py", view_range=[2, 2])
    assert "return 1" in partial.output and "def f" not in partial.output
    again = await sandbox.edit("create", "app.py", file_text="x")
    assert again.is_error and "already exists" in again.output
    replaced = await sandbox.edit("str_replace", "app.py", old_str="return 1", new_str="return 2")
    assert not replaced.is_error and "return 2" in replaced.output
    missing = await sandbox.edit("str_replace", "app.py", old_str="return 9", new_str="x")
    assert missing.is_error and "was not found" in missing.output
    without_line = await sandbox.edit("insert", "app.py", new_str="import os")  # absent, not null, on the wire
    assert without_line.is_error and "insert needs insert_line" in without_line.output
    await sandbox.edit("insert", "app.py", insert_line=0, new_str="import os")
    assert (await sandbox.read_file("app.py")).decode() == "import os\ndef f():\n    return 2\n"
    await sandbox.edit("undo", "app.py")
    await sandbox.edit("undo", "app.py")
    assert (await sandbox.read_file("app.py")).decode() == "def f():\n    return 1\n"
    await sandbox.edit("undo", "app.py")
    assert not (workdir(sandbox) / "app.py").exists()  # the creation undone
    nothing = await sandbox.edit("undo", "app.py")
    assert nothing.is_error and "no edit of" in nothing.output


async def test_files_are_written_read_and_listed(sandbox: Sandbox) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    await sandbox.write_file("data/blob.bin", payload)
    await sandbox.write_file("run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert await sandbox.read_file("data/blob.bin") == payload
    assert await sandbox.read_file("data/blob.bin", max_bytes=10) == payload[:10]
    assert (await sandbox.bash("./run.sh", timeout_s=10)).output == "ran\n"
    assert os.stat(workdir(sandbox) / "run.sh").st_mode & 0o777 == 0o755
    listing = await sandbox.list_dir(".")
    assert listing == [
        {"name": "data", "type": "dir", "size": listing[0]["size"]},
        {"name": "run.sh", "type": "file", "size": 19},
    ]
    with pytest.raises(SandboxError) as error:
        await sandbox.read_file("no/such/file")
    assert "FileNotFoundError" in error.value.message and error.value.reason == "sandbox_runtime"


async def test_concurrent_calls_on_one_connection(sandbox: Sandbox) -> None:
    calls = [sandbox.bash(f"echo {i}", timeout_s=10) for i in range(10)]
    calls += [sandbox.python(f"print({i} * 2)", timeout_s=10) for i in range(3)]
    results = await asyncio.gather(*calls)
    assert [r.output.strip() for r in results] == [str(i) for i in range(10)] + ["0", "2", "4"]


FUNCTION_TASK = {
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "timeout_s": 10,
}


async def test_judge_in_function_mode_passes_and_fails(sandbox: Sandbox) -> None:
    passing = await sandbox.judge("function", {**FUNCTION_TASK, "answer": "    return a + b\n"}, timeout_s=30)
    assert passing.verdict is not None and passing.verdict["passed"] is True, (passing.problem, passing.output)
    assert passing.exit_code == 0 and not passing.timed_out
    failing = await sandbox.judge("function", {**FUNCTION_TASK, "answer": "    return a - b\n"}, timeout_s=30)
    assert failing.verdict is not None and failing.verdict["passed"] is False
    assert "AssertionError" in failing.verdict["reason"]
    with pytest.raises(SandboxError) as error:
        await sandbox.judge("no-such-mode", {}, timeout_s=5)
    assert "unknown judge mode" in error.value.message


async def test_close_runs_callbacks_once_and_leaves_no_process_or_folder(fake_provider: FakeSandboxProvider) -> None:
    sandbox = await fake_provider.create(SPEC)
    container = sandbox.container
    assert isinstance(container, FakeContainer) and container.process is not None
    await sandbox.bash("sleep 62.5 &", timeout_s=10)  # a background job the shell keeps
    await sandbox.bash("(setsid sleep 63.5 &)", timeout_s=10)  # an orphan in a session of its own
    await sandbox.python("import subprocess\nsubprocess.Popen(['sleep', '64.5'])", timeout_s=10)
    runtime_pid = container.process.pid
    assert fake_provider.busy == 1
    closed: list[str] = []
    sandbox.on_close(lambda: closed.append("first"))
    sandbox.on_close(lambda: closed.append("second"))

    await sandbox.close()
    await sandbox.close()  # idempotent
    assert closed == ["first", "second"]
    sandbox.on_close(lambda: closed.append("late"))  # already closed: called at once
    assert closed == ["first", "second", "late"]
    assert fake_provider.busy == 0 and not container.folder.exists()
    assert container.process.returncode is not None
    runtime_ref = process_ref(runtime_pid)
    assert runtime_ref is None or process_status(runtime_ref) == "gone"
    for seconds in ("62.5", "63.5", "64.5"):
        assert processes_running(f"sleep {seconds}") == [], seconds
    with pytest.raises(SandboxError, match="closed"):
        await sandbox.bash("echo", timeout_s=5)
