"""Escaping a sandbox from inside, as an agent's commands would try: privilege
gain through setuid binaries, nested user namespaces, images outside the
server's allow-list, and images without python3 whose `podman exec` commands
would run outside the per-sandbox limits."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from prorl_client import RpcError, v1
from prorl_server.api.errors import REASON_METADATA_KEY
from prorl_server.datasets.swe import TASKS_DIR, load_task
from prorl_server.errors import SandboxError
from prorl_server.sandbox.base import Sandbox
from prorl_server.sandbox.cgroups import CgroupV1Limiter
from prorl_server.sandbox.podman import LABEL_JOB, SECCOMP_PROFILE, Confinement, ExecRuntime, PodmanProvider
from tests.conftest import instance_id, job_containers, podman_options, server_containers, small_spec
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index
from tests.helpers import math_request

pytestmark = pytest.mark.podman

NO_PYTHON = "localhost/prorl-no-python:latest"
OWN_IMAGES = ["localhost/prorl-python:latest", "localhost/prorl-swe-*:latest"]
# dd's buffer is one allocation of its block size, touched by the read: 300 MiB.
MEMORY_HOG = "dd if=/dev/zero of=/dev/null bs=300M count=1; echo exit=$?"

# A setuid-root binary started with a pipe on stdin waits for a password; its
# ids are read from /proc once it runs (real, effective, saved, filesystem).
SETUID_PROBE = """
import subprocess, time
for argv in (["su", "root", "-c", "true"], ["passwd"], ["newgrp", "agent"]):
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while open(f"/proc/{child.pid}/comm").read().strip() != argv[0]:  # until the binary itself runs
        time.sleep(0.01)
    time.sleep(0.1)
    uids = [line.split()[1:] for line in open(f"/proc/{child.pid}/status") if line.startswith("Uid:")][0]
    child.kill()
    child.wait()
    print(argv[0], *uids)
"""

# Every way to ask the kernel for a new user namespace, through libc.
USERNS_PROBE = """
import ctypes, os, signal
CLONE_NEWUSER, SYS_CLONE, SYS_CLONE3 = 0x10000000, 56, 435
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def outcome(result):
    if result == 0:
        os._exit(0)  # a child was created: leave at once
    if result > 0:
        os.waitpid(result, 0)
        return "created"
    return os.strerror(ctypes.get_errno())

print("unshare", outcome(libc.unshare(CLONE_NEWUSER)))
print("clone", outcome(libc.syscall(SYS_CLONE, CLONE_NEWUSER | signal.SIGCHLD, 0, 0, 0, 0)))
args = (ctypes.c_uint64 * 11)(CLONE_NEWUSER, 0, 0, 0, signal.SIGCHLD, 0, 0, 0, 0, 0, 0)
print("clone3", outcome(libc.syscall(SYS_CLONE3, ctypes.byref(args), ctypes.sizeof(args))))
print("plain clone", outcome(libc.syscall(SYS_CLONE, signal.SIGCHLD, 0, 0, 0, 0)))
# Other namespaces need CAP_SYS_ADMIN (mount, network).
print("unshare mount", outcome(libc.unshare(0x00020000)))
print("unshare net", outcome(libc.unshare(0x40000000)))
"""


def script_file(source: str) -> str:
    """A shell command that writes `source` to a file and runs it with python3."""
    encoded = base64.b64encode(source.encode()).decode()
    return f"f=$(mktemp) && echo {encoded} | base64 -d > $f && python3 $f"


async def status_field(sandbox: Sandbox, field: str) -> str:
    result = await sandbox.bash(f"grep '^{field}:' /proc/self/status", timeout_s=10)
    assert result.exit_code == 0, result.output
    return result.output.split(":", 1)[1].strip()


@pytest.mark.parametrize("image", ["localhost/prorl-python:latest", NO_PYTHON])
async def test_no_new_privileges_is_set_inside(image: str, exec_provider: PodmanProvider) -> None:
    sandbox = await exec_provider.create(small_spec(image))
    try:
        assert sandbox.mode == ("exec" if image == NO_PYTHON else "runtime")
        assert await status_field(sandbox, "NoNewPrivs") == "1"
        assert await status_field(sandbox, "CapEff") == "0000000000000000"
        assert await status_field(sandbox, "Seccomp") == "2"  # a filter is in force
    finally:
        await sandbox.close()


async def test_a_setuid_binary_gains_nothing(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    try:
        owners = await sandbox.bash("stat -c '%u %A' /usr/bin/su /usr/bin/passwd /usr/bin/newgrp", timeout_s=10)
        assert owners.output.split() == ["0", "-rwsr-xr-x"] * 3  # the image's setuid-root binaries
        probe = await sandbox.bash(script_file(SETUID_PROBE), timeout_s=20)
        assert probe.exit_code == 0, probe.output
        # Without no_new_privileges the effective and saved uids were 0 ("1000 0 0 0").
        assert probe.output.splitlines() == [f"{name} 1000 1000 1000 1000" for name in ("su", "passwd", "newgrp")]
    finally:
        await sandbox.close()


async def test_nested_user_namespaces_are_refused(provider: PodmanProvider) -> None:
    sandbox = await provider.create(small_spec())
    try:
        unshare = await sandbox.bash("unshare -r true", timeout_s=10)
        assert unshare.exit_code != 0 and "Operation not permitted" in unshare.output
        probe = await sandbox.bash(script_file(USERNS_PROBE), timeout_s=20)
        assert probe.output.splitlines() == [
            "unshare Operation not permitted",
            "clone Operation not permitted",
            "clone3 Function not implemented",  # libc then falls back to clone
            "plain clone created",
            "unshare mount Operation not permitted",
            "unshare net Operation not permitted",
        ]
    finally:
        await sandbox.close()


async def test_the_tools_agents_use_still_work(provider: PodmanProvider) -> None:
    """The seccomp profile takes nothing else away: threads, subprocesses, git, pytest."""
    sandbox = await provider.create(small_spec())
    try:
        script = (
            "set -e; cd /tmp && git init -q repo && cd repo && "
            "printf 'def test_ok():\\n    assert 1\\n' > test_a.py && "
            "git -c user.email=a@b -c user.name=a add -A && git -c user.email=a@b -c user.name=a commit -qm one && "
            "python3 -m pytest -q -p no:cacheprovider test_a.py | tail -n 1 && "
            "python3 -c 'import concurrent.futures as f, subprocess; "
            'print(sum(f.ThreadPoolExecutor(4).map(lambda i: subprocess.run(["true"]).returncode + i, range(8))))\''
        )
        result = await sandbox.bash(script, timeout_s=60)
        assert result.exit_code == 0, result.output
        assert "1 passed" in result.output and result.output.splitlines()[-1] == "28"
        python = await sandbox.python(
            "import threading; t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()", timeout_s=10
        )
        assert python.output.strip() == "thread"
    finally:
        await sandbox.close()


def swe_instance() -> dict[str, Any]:
    task = load_task(TASKS_DIR / "kjd__idna-3.8")  # a pytest-judged task
    return {key: value for key, value in task.items() if key != "patch"}


def finish_at_once(messages: list[dict[str, Any]]) -> ScriptedReply:
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


async def test_an_image_outside_the_allow_list_is_refused_at_submit(
    scripted_llm, start_server, podman_url: str
) -> None:
    llm = await scripted_llm(finish_at_once)
    server, client = await start_server(llm.base_url)
    # An image that exists and has python3, but is not one the server serves.
    by_request = math_request("q", "42", job_id="img-request")
    by_request.sandbox.image = "localhost/prorl-base:bookworm"
    by_instance = v1.RolloutRequest(job_id="img-instance", handler="swe")
    by_instance.instance.update({**swe_instance(), "image": NO_PYTHON})
    for request in (by_request, by_instance):
        with pytest.raises(RpcError) as error:
            await client.submit(request)
        assert error.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "is not allowed on this server" in error.value.details
        assert "sandbox.allowed_images" in error.value.details
        with pytest.raises(RpcError) as error:
            _ = [event async for event in client.rollout(request)]
        assert error.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(RpcError) as error:
            await client.get_job(request.job_id)
        assert error.value.code == grpc.StatusCode.NOT_FOUND  # nothing was queued
        assert not job_containers(podman_url, request.job_id)
    # Over one RolloutStream: each refused with its code, the stream itself goes on and ends.
    replies = [reply async for reply in client.rollout_many([by_request, by_instance])]
    assert [(r.job_id, r.code) for r in replies if isinstance(r, v1.RolloutRejected)] == [
        ("img-request", grpc.StatusCode.PERMISSION_DENIED.value[0]),
        ("img-instance", grpc.StatusCode.PERMISSION_DENIED.value[0]),
    ]
    assert all(isinstance(r, v1.RolloutRejected) for r in replies)
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await v1.RolloutServiceStub(channel).Submit(v1.SubmitRequest(rollout=by_request))
        assert dict(raw.value.trailing_metadata() or ())[REASON_METADATA_KEY] == "image_not_allowed"
    # The project's own images are allowed: a SWE task's image (here its job runs to its verdict).
    allowed = v1.RolloutRequest(job_id="img-own", handler="swe")
    allowed.instance.update(swe_instance())
    result = [event async for event in client.rollout(allowed)][-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure


async def test_an_image_without_python_is_refused_by_default(
    scripted_llm, start_server, provider: PodmanProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SandboxError) as error:
        await provider.create(small_spec(NO_PYTHON))
    assert error.value.reason == "sandbox_image_without_python"
    assert provider.busy == 0

    async def no_container(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a container was started")

    monkeypatch.setattr(provider, "_create", no_container)
    with pytest.raises(SandboxError) as error:  # remembered: refused again without starting a container
        await provider.create(small_spec(NO_PYTHON))
    assert error.value.reason == "sandbox_image_without_python"
    monkeypatch.undo()

    llm = await scripted_llm(finish_at_once)
    _, client = await start_server(llm.base_url, sandbox={"allowed_images": [*OWN_IMAGES, NO_PYTHON]})
    request = math_request("q", "42")
    request.sandbox.image = NO_PYTHON
    result = [event async for event in client.rollout(request)][-1].finished.result
    assert result.status == v1.JOB_STATUS_FAILED
    assert result.failure.phase == v1.PHASE_INIT
    assert result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE  # the request's choice, not the policy's
    assert result.failure.reason == "sandbox_image_without_python"
    assert "sandbox.allow_exec_fallback" in result.failure.message


async def test_with_the_fallback_every_exec_command_is_inside_the_limits(
    exec_provider: PodmanProvider, podman_url: str
) -> None:
    spec = small_spec(NO_PYTHON, memory_mib=64, pids_limit=32, labels={LABEL_JOB: "exec-limits"})
    sandbox = await exec_provider.create(spec)
    try:
        assert sandbox.mode == "exec"
        (container,) = job_containers(podman_url, "exec-limits")
        # Many short commands at once, as many as the provider's Podman threads (8):
        # each one starts inside the sandbox's own groups.
        results = await asyncio.gather(*(sandbox.bash("cat /proc/self/cgroup", timeout_s=10) for _ in range(8)))
        for result in results:
            paths = dict(line.split(":", 2)[1:] for line in result.output.splitlines() if line.count(":") >= 2)
            for controller in ("memory", "cpu", "pids"):
                assert paths[controller].endswith(f"/{container.name}"), result.output
        hog = await sandbox.bash(MEMORY_HOG, timeout_s=30)
        assert "exit=137" in hog.output and "314572800 bytes" not in hog.output, hog.output  # OOM-killed
        spawn = await sandbox.bash(
            "i=0; while [ $i -lt 100 ]; do sleep 20 & i=$((i + 1)); done; echo started $i", timeout_s=10
        )
        assert "started 100" not in spawn.output, spawn.output  # pids.max stops the fork loop
    finally:
        await sandbox.close()


async def test_a_command_that_is_not_moved_into_the_limits_does_not_run(exec_provider: PodmanProvider) -> None:
    sandbox = await exec_provider.create(small_spec(NO_PYTHON))
    try:
        runtime = sandbox.runtime
        assert isinstance(runtime, ExecRuntime)

        async def never(marker: bytes) -> bool:
            return False

        # Waits for groups that never come: the command gives up (after 50 checks here).
        runtime._confinement = Confinement(group="prorl-no-such-group", adopt=never, patience=50)
        with pytest.raises(SandboxError) as error:
            await sandbox.bash("echo ran > /tmp/ran", timeout_s=10)
        assert error.value.reason == "sandbox_confine"
        runtime._confinement = None
        assert (await sandbox.bash("cat /tmp/ran", timeout_s=10)).exit_code != 0  # it never ran
    finally:
        await sandbox.close()


def test_the_profile_is_podmans_default_but_for_user_namespaces_and_keyctl() -> None:
    default = Path("/usr/share/containers/seccomp.json")
    if not default.exists():
        pytest.skip("Podman's default seccomp profile is not installed here")
    ours, theirs = json.loads(SECCOMP_PROFILE.read_text()), json.loads(default.read_text())
    namespaced = {"clone", "clone3", "unshare"}
    # keyctl is denied (as Docker's default profile does): a sandbox takes no kernel keyring.
    differ = namespaced | {"keyctl"}

    def rules(profile: dict[str, Any], keep: Any) -> list[Any]:
        found = []
        for rule in profile["syscalls"]:
            names = [name for name in rule["names"] if keep(name)]
            if names:
                found.append({**rule, "names": names})
        return found

    assert {k: v for k, v in ours.items() if k != "syscalls"} == {k: v for k, v in theirs.items() if k != "syscalls"}
    assert rules(ours, lambda name: name not in differ) == rules(theirs, lambda name: name not in differ)
    assert not [rule for rule in rules(ours, lambda name: name == "keyctl") if rule["action"] == "SCMP_ACT_ALLOW"]
    for rule in rules(ours, lambda name: name in namespaced):
        if rule["action"] == "SCMP_ACT_ALLOW":  # only with the CLONE_NEWUSER bit clear
            assert rule["args"] and all(a["value"] == 0x10000000 and a["valueTwo"] == 0 for a in rule["args"])
        else:
            assert rule["action"] == "SCMP_ACT_ERRNO"


@pytest.mark.skipif(not CgroupV1Limiter.usable(), reason="the server makes the cgroups only on a cgroup v1 host")
async def test_without_the_servers_groups_the_same_hog_gets_its_memory(podman_url: str) -> None:
    """The control for the test above: rootless Podman on cgroup v1 applies no
    memory limit, so outside the server's groups the hog gets all 300 MiB."""
    instance = instance_id("nolimits")
    provider = PodmanProvider(
        url_factory=lambda: podman_url,
        options=podman_options(instance, allow_exec_fallback=True, cgroup_limits=False),
    )
    await provider.start()
    try:
        sandbox = await provider.create(small_spec(NO_PYTHON, memory_mib=64))
        hog = await sandbox.bash(MEMORY_HOG, timeout_s=30)
        assert "314572800 bytes" in hog.output and "exit=0" in hog.output, hog.output
        await sandbox.close()
    finally:
        await provider.close()
    assert not server_containers(podman_url, instance)


async def test_the_fallback_through_the_server_keeps_the_limits(scripted_llm, start_server) -> None:
    def hog_then_finish(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("bash", {"command": MEMORY_HOG}))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    llm = await scripted_llm(hog_then_finish)
    _, client = await start_server(
        llm.base_url, sandbox={"allowed_images": [*OWN_IMAGES, NO_PYTHON], "allow_exec_fallback": True}
    )
    request = math_request("q", "42")
    request.sandbox.image = NO_PYTHON
    request.sandbox.memory_mib = 64
    events = [event async for event in client.rollout(request)]
    hog = next(event.tool_result for event in events if event.WhichOneof("kind") == "tool_result")
    assert "exit=137" in hog.output and "314572800 bytes" not in hog.output, hog.output  # OOM-killed
    assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED
