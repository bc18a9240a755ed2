"""The in-sandbox runtime in real rootless containers: state, timeouts, output caps, limits, the editor."""

from __future__ import annotations

import asyncio
import socket

import pytest

from prorl_server.errors import SandboxError, SandboxLimitExceeded
from prorl_server.sandbox.podman import PodmanProvider
from tests.conftest import small_spec

pytestmark = pytest.mark.podman


async def test_shell_state_and_python_names_persist(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    assert sandbox.mode == "runtime"
    await sandbox.bash("mkdir -p /tmp/work && cd /tmp/work && export GREETING=hello", timeout_s=10)
    result = await sandbox.bash('pwd; echo "$GREETING"; id -u', timeout_s=10)
    assert result.output.split() == ["/tmp/work", "hello", "1000"] and result.exit_code == 0
    await sandbox.bash("sleep 300 &", timeout_s=10)
    jobs = await sandbox.bash("jobs", timeout_s=10)
    assert "sleep 300" in jobs.output
    assert (await sandbox.bash("exit 7", timeout_s=10)).exit_code == 7
    assert (await sandbox.bash("echo fresh", timeout_s=10)).output == "fresh\n"

    await sandbox.python("total = 40", timeout_s=10)
    result = await sandbox.python("total += 2\nprint(total)", timeout_s=10)
    assert result.output == "42\n" and not result.is_error
    error = await sandbox.python("undefined_name", timeout_s=10)
    assert error.is_error and "NameError: name 'undefined_name' is not defined" in error.output
    assert "prorl_runtime" not in error.output  # only the agent's frames
    await sandbox.close()


async def test_timeout_kills_the_command_says_so_and_the_next_call_works(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    result = await sandbox.bash("echo started; sleep 60; echo never", timeout_s=1)
    assert result.timed_out and "started" in result.output and "never" not in result.output
    assert "timed out after 1s" in result.output
    count_sleeps = "cat /proc/[0-9]*/comm 2>/dev/null | grep -cx sleep"
    assert (await sandbox.bash(count_sleeps, timeout_s=10)).output.strip() == "0"
    assert (await sandbox.bash("echo next", timeout_s=10)).output == "next\n"

    busy = await sandbox.bash("while true; do :; done", timeout_s=1)
    assert busy.timed_out
    assert (await sandbox.bash("echo again", timeout_s=10)).output == "again\n"

    slow = await sandbox.python("import time\nstate = 1\ntime.sleep(60)", timeout_s=1)
    assert slow.timed_out and "KeyboardInterrupt" in slow.output
    assert (await sandbox.python("print(state)", timeout_s=10)).output == "1\n"
    await sandbox.close()


async def test_huge_output_is_capped_and_the_sandbox_still_answers(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    result = await sandbox.bash("yes | head -c 200000000; echo; echo done", timeout_s=120)
    assert result.truncated and result.exit_code == 0
    assert len(result.output.encode()) < 17 * 1024
    assert "bytes of output truncated" in result.output and result.output.rstrip().endswith("done")
    assert (await sandbox.bash("echo alive", timeout_s=10)).output == "alive\n"

    big = await sandbox.python("print('x' * 5_000_000)", timeout_s=30)
    assert big.truncated and len(big.output) < 17 * 1024
    payload = bytes(range(256)) * 40_000  # 10 MB through one frame each way
    await sandbox.write_file("/tmp/blob.bin", payload)
    assert await sandbox.read_file("/tmp/blob.bin") == payload
    await sandbox.close()


async def test_concurrent_calls_on_one_sandbox(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    calls = [sandbox.bash(f"echo {i}", timeout_s=10) for i in range(20)]
    calls += [sandbox.python(f"print({i} * 2)", timeout_s=10) for i in range(5)]
    calls += [sandbox.read_file("/etc/hostname")]
    results = await asyncio.gather(*calls)
    assert [r.output.strip() for r in results[:20]] == [str(i) for i in range(20)]
    assert [r.output.strip() for r in results[20:25]] == [str(i * 2) for i in range(5)]
    await sandbox.close()


async def test_memory_hog_is_killed_and_the_sandbox_survives(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec(memory_mib=128))
    neighbour = await provider.create(small_spec())
    hog = await sandbox.python("block = bytearray(1024 * 1024 * 1024)\nprint('allocated')", timeout_s=30)
    assert hog.is_error and "allocated" not in hog.output
    assert "killed" in hog.output or "MemoryError" in hog.output
    assert (await sandbox.bash("echo survived", timeout_s=10)).output == "survived\n"
    assert (await neighbour.bash("echo fine", timeout_s=10)).output == "fine\n"
    await sandbox.close()
    await neighbour.close()


async def test_fork_bomb_is_contained_to_its_sandbox(provider: PodmanProvider) -> None:
    bomb = await provider.create(small_spec(pids_limit=32))
    neighbour = await provider.create(small_spec())
    await bomb.bash("bomb() { bomb | bomb & }; bomb", timeout_s=5)
    try:
        # The bomb's sandbox may stop answering; if so that is blamed on its limit.
        outcome = await bomb.bash("echo maybe", timeout_s=3)
        assert outcome.timed_out or "maybe" in outcome.output or "fork" in outcome.output
    except SandboxLimitExceeded as exc:
        assert "pids limit" in exc.message
    for i in range(3):
        assert (await neighbour.bash(f"echo neighbour {i}", timeout_s=10)).output == f"neighbour {i}\n"
    fresh = await provider.create(small_spec())
    assert (await fresh.bash("echo new sandbox", timeout_s=10)).output == "new sandbox\n"
    for sandbox in (bomb, neighbour, fresh):
        await sandbox.close()


async def test_no_network_reaches_out(provider: PodmanProvider) -> None:
    # A service on the host's loopback: reachable from the host, never from a sandbox.
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sandbox = await provider.create(small_spec())
    try:
        interfaces = await sandbox.bash("ls /sys/class/net", timeout_s=10)
        assert interfaces.output.split() == ["lo"]
        routes = await sandbox.bash("tail -n +2 /proc/net/route | wc -l", timeout_s=10)
        assert routes.output.strip() == "0"  # no route: no outside address can be reached
        probe = await sandbox.python(
            f"import socket\ns = socket.socket()\ns.settimeout(3)\ntry:\n    s.connect(('127.0.0.1', {port}))\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)",
            timeout_s=10,
        )
        assert probe.output.startswith("refused")
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            pass  # the host itself can
    finally:
        await sandbox.close()
        server.close()
        await server.wait_closed()


async def test_sandbox_runs_unprivileged_with_a_read_only_runtime(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    result = await sandbox.bash(
        "id -u; touch /opt/prorl/x 2>&1 | tail -1; grep CapEff /proc/self/status; df -m --output=size /tmp | tail -1",
        timeout_s=10,
    )
    lines = result.output.splitlines()
    assert lines[0] == "1000"
    assert "Read-only file system" in lines[1]
    assert lines[2].split()[1] == "0000000000000000"  # no capabilities
    assert lines[3].strip() == "64", result.output  # /tmp is a 64 MiB tmpfs
    await sandbox.close()


async def test_editor_errors_tell_the_agent_what_to_do(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    path = "/workspace/app.py"
    created = await sandbox.edit("create", path, file_text="def f():\n    return 1\n\ndef g():\n    return 1\n")
    assert not created.is_error
    view = await sandbox.edit("view", path)
    assert "     1\tdef f():" in view.output and "     5\t    return 1" in view.output

    cases = [
        (("view", "/workspace/missing.py"), {}, "does not exist"),
        (("create", path), {"file_text": "x"}, "already exists; use str_replace"),
        (("create", "/workspace/new.py"), {}, "create needs file_text"),
        (("str_replace", path), {"old_str": "return 2", "new_str": "x"}, "was not found"),
        (("str_replace", path), {"old_str": "return 1", "new_str": "x"}, "occurs 2 times"),
        (("str_replace", path), {"new_str": "x"}, "str_replace needs old_str"),
        (("insert", path), {"new_str": "x", "insert_line": 99}, "outside 0-6"),
        (("insert", path), {"new_str": "x"}, "insert needs insert_line"),
        (("view", path), {"view_range": [4, 2]}, "outside the file's lines"),
        (("undo", "/workspace/other.py"), {}, "no edit of /workspace/other.py to undo"),
        (("frobnicate", path), {}, "unknown editor command"),
        (("view", "/workspace"), {}, "Contents of /workspace"),
    ]
    for (command, target), params, expected in cases:
        result = await sandbox.edit(command, target, **params)
        assert expected in result.output, (command, params, result.output)
        assert result.is_error == (command != "view" or "missing" in target or "view_range" in params)

    edited = await sandbox.edit("str_replace", path, old_str="def g():\n    return 1", new_str="def g():\n    return 2")
    assert not edited.is_error and "return 2" in edited.output
    await sandbox.edit("insert", path, insert_line=0, new_str="import os")
    assert (await sandbox.read_file(path)).decode().startswith("import os\ndef f")
    await sandbox.edit("undo", path)
    await sandbox.edit("undo", path)
    assert (await sandbox.read_file(path)).decode().endswith("def g():\n    return 1\n")
    listing = await sandbox.list_dir("/workspace")
    assert [entry["name"] for entry in listing] == ["app.py"]
    await sandbox.close()


async def test_image_without_python_falls_back_to_podman_exec(exec_provider: PodmanProvider) -> None:
    provider = exec_provider  # the operator allows the fallback (sandbox.allow_exec_fallback)
    sandbox = await provider.create(small_spec("localhost/prorl-no-python:latest"))
    assert sandbox.mode == "exec"
    result = await sandbox.bash("echo via exec; id -u", timeout_s=10)
    assert result.output.split() == ["via", "exec", "1000"]
    slow = await sandbox.bash("sleep 30", timeout_s=1)
    assert slow.timed_out and "timed out" in slow.output
    missing = await sandbox.python("print(1)", timeout_s=10)
    assert missing.is_error and missing.exit_code == 127
    editor = await sandbox.edit("view", "/workspace")
    assert editor.is_error and "needs python3" in editor.output
    await sandbox.write_file("/tmp/f.txt", b"hello")
    assert await sandbox.read_file("/tmp/f.txt") == b"hello"
    assert [e["name"] for e in await sandbox.list_dir("/tmp")] == ["f.txt"]
    await sandbox.close()
    # The second sandbox of that image goes straight to exec mode.
    again = await provider.create(small_spec("localhost/prorl-no-python:latest"))
    assert again.mode == "exec"
    await again.close()


async def test_closed_sandbox_refuses_calls_and_its_container_is_gone(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    assert provider.busy == 1
    await sandbox.close()
    await sandbox.close()  # idempotent
    assert provider.busy == 0
    with pytest.raises(SandboxError):
        await sandbox.bash("echo", timeout_s=5)
