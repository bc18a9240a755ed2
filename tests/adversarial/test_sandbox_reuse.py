"""Reuse without trust: job N tries to leave something behind for job N+1 in one
sandbox, and job N+1 must find it exactly as new.

Each case runs a probe in a new sandbox (what job N+1 must see), then job N's
attack, then the reset, which must prove itself from the host (no problem
reported), then the probe again: both must be equal. The probe looks from
inside at what an agent can observe: every process, every file (mode, owner,
content, extended attributes) under every writable path, its environment,
cwd and umask, Python's sys.path and importable sitecustomize, the SysV IPC
tables, POSIX message queues, kernel keys, held sockets, the mount table.
A reset that cannot prove itself clean retires the container (last tests).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
from typing import Any

import pytest

from prorl_server.errors import ProrlError
from prorl_server.sandbox.allocator import ReusePolicy, SandboxAllocator
from prorl_server.sandbox.base import Sandbox
from prorl_server.sandbox.podman import PodmanProvider, reset_check
from prorl_server.sandbox.podman.container import PodmanContainer
from prorl_server.sandbox.podman.container_spec import NOT_RESET
from tests.conftest import SANDBOX_USER, small_spec
from tests.helpers import assert_eventually

pytestmark = pytest.mark.podman


@pytest.fixture
def provider(reusable_provider: PodmanProvider) -> PodmanProvider:
    """Every sandbox here is started reusable (sandbox.reuse.enabled: read-only root, tmpfs writable paths)."""
    return reusable_provider


WRITABLE = ["/tmp", "/var/tmp", "/workspace", "/home/agent", "/testbed", "/dev/shm", "/dev/mqueue"]

PROBE = r"""
import hashlib, json, os, subprocess, sys
me = os.getpid()
ours = {me}
pid = me
while pid > 1:  # this probe and the shell that runs it
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    ours.add(pid)
processes = []
for entry in sorted(os.listdir("/proc")):
    if entry.isdigit() and int(entry) not in ours:
        try:
            processes.append(open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode())
        except OSError:
            pass
processes.append(open("/proc/1/cmdline", "rb").read().replace(b"\0", b" ").decode())
files = {}
for top in WRITABLE:
    for root, dirs, names in os.walk(top):
        dirs.sort()
        for name in [".", *sorted(dirs), *sorted(names)]:
            path = os.path.normpath(os.path.join(root, name))
            if path == os.path.abspath(__file__):
                continue  # this probe's own file
            info = os.lstat(path)
            try:
                hashed = os.path.isfile(path) and not top.startswith("/dev/mqueue")
                content = hashlib.sha256(open(path, "rb").read()).hexdigest() if hashed else ""
            except OSError as exc:
                content = "unreadable"
            try:
                xattrs = sorted(os.listxattr(path, follow_symlinks=False))
            except OSError:
                xattrs = ["?"]
            files[path] = [oct(info.st_mode), info.st_uid, info.st_gid, info.st_size, content, xattrs]
def table(path):
    try:
        return open(path).read().splitlines()[1:]
    except OSError as exc:
        return [str(exc)]
# held sockets (inode != 0): a TIME_WAIT left by a closed connection carries nothing
tables = [table(f"/proc/net/{name}") for name in ("tcp", "tcp6", "udp", "udp6")]
sockets = [row for rows in tables for row in rows if row.split()[9] != "0"]
SITE = (
    "import sys, importlib.util; find = importlib.util.find_spec; "
    "print(sys.path, find('sitecustomize') is not None, find('usercustomize') is not None)"
)
python = subprocess.run([sys.executable, "-c", SITE], capture_output=True, text=True).stdout
mask = os.umask(0); os.umask(mask)
print(json.dumps({
    "processes": sorted(processes),
    "files": files,
    "environ": sorted(f"{k}={v}" for k, v in os.environ.items() if k not in ("_", "OLDPWD")),
    "cwd": os.getcwd(),
    "umask": mask,
    "python": python,
    "sysvipc": {kind: table(f"/proc/sysvipc/{kind}") for kind in ("msg", "sem", "shm")},
    "keys": open("/proc/keys").read().splitlines() if os.path.exists("/proc/keys") else [],
    "inet": [row for row in sockets if ":" in row.split()[1]],
    "mounts": [" ".join(line.split()[3:]) for line in open("/proc/self/mountinfo")],
    "limits": open("/proc/self/limits").read(),
}, sort_keys=True))
""".replace("WRITABLE", repr(WRITABLE))


def python_file(source: str) -> str:
    """A shell command that runs `source` with python3 (from a file, so no quoting matters)."""
    encoded = base64.b64encode(source.encode()).decode()
    return f"f=$(mktemp -p /dev/shm) && echo {encoded} | base64 -d > $f && python3 $f; s=$?; rm -f $f; (exit $s)"


async def probe(sandbox: Sandbox) -> dict[str, Any]:
    result = await sandbox.bash(python_file(PROBE), timeout_s=120)
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.output.strip().splitlines()[-1])
    return parsed


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = []
    for key in sorted(set(before) | set(after)):
        if key == "files":
            paths = set(before["files"]) | set(after["files"])
            found += [
                f"file {path}: {before['files'].get(path)} -> {after['files'].get(path)}"
                for path in sorted(paths)
                if before["files"].get(path) != after["files"].get(path)
            ]
        elif before.get(key) != after.get(key):
            found.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return found


# --- job N's attempts -------------------------------------------------------------------

DOUBLE_FORK_IGNORING_SIGNALS = r"""
import os, signal, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            open("/tmp/heartbeat", "a").write("x")
            time.sleep(0.05)
    os._exit(0)
"""

RESPAWNER = r"""
import os, time
if os.fork() == 0:
    os.setsid()
    while True:  # a new session's watcher, bringing its worker back whenever it goes
        child = os.fork()
        if child == 0:
            os.execvp("sleep", ["sleep", "1000"])
        os.waitpid(child, 0)
        open("/workspace/respawned", "a").write("x")
"""

FORK_STORM = r"""
import os, time
for _ in range(20):
    if os.fork() == 0:
        os.setsid()
        while True:  # children that fork on and on, each leaving
            if os.fork() != 0:
                os._exit(0)
            time.sleep(0.01)
"""

SOCKET_HOLDER = r"""
import os, socket, time
if os.fork() == 0:
    os.setsid()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 4567))
    listener.listen()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 4568))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind("\0prorl-leftover")
    unix.listen()
    while True:
        conn, _ = listener.accept()
        conn.sendall(b"left over from job N\n")
"""

SYSV_IPC = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT = 0o1000
print("msg", libc.msgget(1234, IPC_CREAT | 0o666))
print("sem", libc.semget(1235, 1, IPC_CREAT | 0o666))
shm = libc.shmget(1236, 4096, IPC_CREAT | 0o666)
libc.shmat.restype = ctypes.c_void_p
print("shm", shm, libc.shmat(shm, None, 0) is not None)
"""

POSIX_IPC = r"""
import ctypes, os, mmap
rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int
print("mq", rt.mq_open(b"/leftover", os.O_CREAT | os.O_RDWR, 0o666, None), ctypes.get_errno())
fd = os.open("/dev/shm/leftover-shm", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
mmap.mmap(fd, 4096).write(b"secret")
open("/dev/shm/sem.leftover", "wb").write(b"\0" * 32)
"""

KEYRING = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_LINK, SYS_KEYCTL, SYS_ADD_KEY = 1, 8, 250, 248
print("join", libc.syscall(SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, b"leftover-keyring"), ctypes.get_errno())
print("add", libc.syscall(SYS_ADD_KEY, b"user", b"leftover", b"secret", 6, -4), ctypes.get_errno())
print("link", libc.syscall(SYS_KEYCTL, KEYCTL_LINK, -3, -4), ctypes.get_errno())
"""

HELD_LOCK = r"""
import fcntl, os, time
if os.fork() == 0:
    os.setsid()
    handle = open("/workspace/.lock", "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    other = open("/tmp/posix.lock", "w")
    fcntl.lockf(other, fcntl.LOCK_EX)
    time.sleep(1000)
"""

ATTEMPTS = {
    "double-forked process ignoring signals": python_file(DOUBLE_FORK_IGNORING_SIGNALS),
    "setsid daemon": "setsid sh -c 'trap \"\" TERM HUP; while :; do sleep 1; done' >/dev/null 2>&1 < /dev/null &",
    "new session re-spawning its worker": python_file(RESPAWNER),
    "fork storm of leaving children": python_file(FORK_STORM),
    "stopped process": "sleep 1000 & kill -STOP $!",
    "nohup'd and disowned job": "nohup sleep 1000 >/dev/null 2>&1 & disown",
    "delayed at-style job": "(sleep 3; echo late > /workspace/late; echo late > /tmp/late) >/dev/null 2>&1 &",
    "files in every writable path": " ; ".join(
        f"echo leftover > {path}/leftover-$RANDOM; mkdir -p {path}/d/e && echo x > {path}/d/e/f"
        for path in WRITABLE
        if path != "/dev/mqueue"
    ),
    "user site-packages, .pth and sitecustomize": (
        "site=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p $site && "
        'echo \'import os; os.environ["PWNED"]="1"\' > $site/sitecustomize.py && '
        "echo 'import sys; sys.path.insert(0, \"/tmp/evil\")' > $site/evil.pth && "
        "echo 'print(1)' > $site/usercustomize.py && echo 'x=1' > /workspace/sitecustomize.py"
    ),
    "system site-packages and PATH": (
        "for d in $(python3 -c 'import site; print(*site.getsitepackages())') /usr/local/bin /usr/bin; do "
        "echo x > $d/evil.pth 2>/dev/null && echo WROTE $d; done; "
        "mkdir -p ~/.local/bin ~/bin && printf '#!/bin/sh\\necho hijacked\\n' > ~/.local/bin/ls; "
        "chmod +x ~/.local/bin/ls; "
        "export PATH=/tmp:$PATH; printf '#!/bin/sh\\necho hijacked\\n' > /tmp/python3; chmod +x /tmp/python3"
    ),
    "shell start-up files and history": (
        "echo 'export PWNED=1' >> ~/.bashrc; echo 'export PWNED=1' >> ~/.profile; "
        "echo 'alias ls=rm' > ~/.bash_aliases; HISTFILE=~/.bash_history; history -s secret; history -w; "
        "echo 'secret' > ~/.python_history; mkdir -p ~/.config/pip && echo '[global]' > ~/.config/pip/pip.conf"
    ),
    "crontab and systemd user units": (
        "mkdir -p ~/.config/systemd/user /tmp/crontabs && echo '* * * * * touch /tmp/cron' > /tmp/crontabs/agent; "
        "echo '[Service]' > ~/.config/systemd/user/x.service; crontab -l 2>/dev/null; at now 2>/dev/null; true"
    ),
    "environment, cwd and umask": "export PWNED=1 LD_PRELOAD=/tmp/evil.so PYTHONPATH=/tmp; cd /tmp; umask 000",
    "Python tool state": None,
    "changed file modes and extended attributes": (
        "mkdir -p /workspace/sub && chmod 000 /workspace/sub; chmod 0777 ~; chmod 000 ~/.bashrc; "
        'python3 -c \'import os; os.setxattr("/workspace", "user.leftover", b"1"); '
        'os.setxattr("/tmp", "user.leftover", b"1") if os.stat("/tmp").st_uid == os.getuid() else None\'; '
        "chmod 0700 /workspace; ln -s /etc/shadow /workspace/link; mkfifo /tmp/fifo; "
        "ln /workspace/.keep /tmp/hard 2>/dev/null; true"
    ),
    "mount attempts": (
        "mkdir -p /tmp/m; mount -t tmpfs none /tmp/m 2>&1; unshare -m true 2>&1; unshare -Ur true 2>&1; "
        "python3 -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        'print(libc.mount(b"none", b"/tmp/m", b"tmpfs", 0, None))\'; true'
    ),
    "process holding sockets open": python_file(SOCKET_HOLDER),
    "SysV message queue, semaphore and shared memory": python_file(SYSV_IPC),
    "POSIX message queue, shared memory and semaphore": python_file(POSIX_IPC),
    "kernel keyring entries": python_file(KEYRING),
    "held locks": python_file(HELD_LOCK),
    "poisoning the image copy the reset restores from": (
        "for f in /opt/prorl-image/tmp/x /opt/prorl-image/home/agent/.bashrc /opt/prorl-image/workspace/x; do "
        "echo poisoned > $f 2>/dev/null && echo WROTE $f; done; true"
    ),
    "files in the runtime's socket folder": "echo x > /run/prorl/leftover; mkdir /run/prorl/d; true",
    "filling the writable paths": "head -c 20M /dev/zero > /tmp/big; head -c 20M /dev/zero > /workspace/big; true",
    "the runtime's scratch files": (
        "for d in /tmp/prorl-*; do echo 'echo hijacked' > $d/cmd.sh; chmod 000 $d; done; true"
    ),
}


@pytest.mark.parametrize("attempt", list(ATTEMPTS), ids=list(ATTEMPTS))
async def test_job_n_leaves_nothing_for_job_n_plus_1(provider: PodmanProvider, attempt: str) -> None:
    sandbox = await provider.create(small_spec())
    try:
        before = await probe(sandbox)
        command = ATTEMPTS[attempt]
        if command is None:  # the Python tool's own state
            await sandbox.python("import os; secret = 42; os.environ['PWNED'] = '1'; os.chdir('/tmp')", timeout_s=30)
        else:
            result = await sandbox.bash(command, timeout_s=60)
            assert not result.timed_out, result.output
            assert "WROTE" not in result.output, result.output  # the root file system is read-only
        await asyncio.sleep(0.3)  # let what it started get going
        problems = await sandbox.container.reset(sandbox.runtime)
        assert problems == [], problems
        if attempt == "delayed at-style job":
            await asyncio.sleep(4)  # past the time it would have fired
        after = await probe(sandbox)
        assert differences(before, after) == []
        names = await sandbox.python("print(sorted(n for n in dir() if not n.startswith('__')))", timeout_s=30)
        assert names.output.strip() == "[]"
        if attempt == "process holding sockets open":
            connect = await sandbox.bash(
                "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 4567))'", timeout_s=30
            )
            assert connect.exit_code != 0 and "Connection refused" in connect.output
        if attempt == "held locks":
            lock = await sandbox.bash(
                "python3 -c 'import fcntl; "
                'fcntl.flock(open("/workspace/.lock", "w"), fcntl.LOCK_EX | fcntl.LOCK_NB)\'; echo $?',
                timeout_s=30,
            )
            assert lock.output.strip().endswith("0")
    finally:
        await sandbox.close()


async def test_every_attempt_at_once_then_many_jobs(provider: PodmanProvider) -> None:
    """All the attempts in one job, then the same container for five more jobs."""
    sandbox = await provider.create(small_spec())
    try:
        before = await probe(sandbox)
        for _ in range(5):
            for command in ATTEMPTS.values():  # the last takes the shell's scratch files away: no call after it works
                if command is not None:
                    with contextlib.suppress(ProrlError):
                        await sandbox.bash(command, timeout_s=60)
            with contextlib.suppress(ProrlError):
                await sandbox.python("secret = 1", timeout_s=30)
            assert await sandbox.container.reset(sandbox.runtime) == []
            assert differences(before, await probe(sandbox)) == []
    finally:
        await sandbox.close()


async def test_the_hosts_checks_see_what_a_job_leaves(provider: PodmanProvider) -> None:
    """The proof's checks are not blind: before any reset, each finds what job N left."""
    sandbox = await provider.create(small_spec())
    try:
        assert isinstance(sandbox.container, PodmanContainer)
        view, pristine = sandbox.container.view, sandbox.container.pristine
        assert view is not None and pristine is not None
        assert await provider.call(lambda: reset_check.stray_processes(view)) == []
        assert await reset_check.sysv_ipc(view.init.pid) == []
        await sandbox.bash(python_file(SYSV_IPC) + "; " + python_file(SOCKET_HOLDER), timeout_s=60)
        await sandbox.bash("echo x > /workspace/left; setsid sleep 1000 & chmod 0700 ~", timeout_s=30)
        await assert_eventually(lambda: provider.call(lambda: bool(reset_check.inet_sockets(view.runtime.pid))))
        strays = await provider.call(lambda: reset_check.stray_processes(view))
        assert any("sleep 1000" in line for line in strays), strays
        ipc = await reset_check.sysv_ipc(view.init.pid)
        assert ipc is not None and {line.split(":")[0] for line in ipc} == {"msg", "sem", "shm"}, ipc
        now = await provider.call(lambda: reset_check.snapshot(view.init.pid, skip=NOT_RESET))
        found = reset_check.differences(pristine, now)
        assert "/workspace/left: added" in found and "/home/agent/.: changed" in found, found
        assert await sandbox.container.reset(sandbox.runtime) == []
    finally:
        await sandbox.close()


def _exec_as_root(name: str, command: str) -> None:
    """What no job can do: a root process in the container, from outside (podman exec)."""
    subprocess.run(
        [
            "runuser",
            "-u",
            SANDBOX_USER,
            "--",
            "podman",
            "exec",
            "--privileged",
            "--user",
            "0",
            name,
            "sh",
            "-c",
            command,
        ],
        check=True,
        capture_output=True,
        cwd="/",
    )


async def test_a_reset_that_cannot_clean_reports_it(provider: PodmanProvider) -> None:
    """A file the runtime cannot remove (root's, in the job's workdir): the reset says so."""
    sandbox = await provider.create(small_spec())
    try:
        assert isinstance(sandbox.container, PodmanContainer)
        await asyncio.to_thread(
            _exec_as_root, sandbox.id, "mkdir /workspace/root-owned && touch /workspace/root-owned/f"
        )
        problems = await sandbox.container.reset(sandbox.runtime)
        assert any("/workspace" in problem for problem in problems), problems
    finally:
        await sandbox.close()


async def _allocator(provider: PodmanProvider) -> SandboxAllocator:
    allocator = SandboxAllocator(provider, [], reuse=ReusePolicy(enabled=True, max_idle=4))
    allocator.start()
    return allocator


async def test_reuse_hands_the_reset_container_to_the_next_job(provider: PodmanProvider) -> None:
    allocator = await _allocator(provider)
    try:
        first = await allocator.acquire(small_spec())
        await first.bash("echo leftover > /workspace/x; sleep 1000 &", timeout_s=30)
        container = first.id
        await first.close()
        second = await allocator.acquire(small_spec())  # waits for the reset under way
        assert second.id == container and second.jobs_served == 1
        listing = await second.bash(
            "ls -1A /workspace; grep -l 'slee[p] 1000' /proc/[0-9]*/cmdline | wc -l", timeout_s=30
        )
        assert listing.output.split() == ["0"]
        await second.close()
        await assert_eventually(lambda: allocator.stats()[0].warm == 1)
        assert allocator.stats()[0].reused == 2 and allocator.stats()[0].retired == 0
    finally:
        await allocator.close()


async def test_a_sandbox_that_cannot_be_proven_clean_is_retired(provider: PodmanProvider) -> None:
    """Two ways: a root-owned file the reset cannot remove, and a job that killed the runtime
    (no reset can run). Both containers are removed; the next jobs get new ones."""
    allocator = await _allocator(provider)
    try:
        first = await allocator.acquire(small_spec())
        await asyncio.to_thread(_exec_as_root, first.id, "mkdir /workspace/root-owned && touch /workspace/root-owned/f")
        second = await allocator.acquire(small_spec())
        with pytest.raises(ProrlError):  # the job kills the runtime: its own call never returns (POLICY)
            await second.bash("kill -9 $(cat /proc/1/task/1/children)", timeout_s=5)
        retired = {first.id, second.id}
        await first.close()
        await second.close()
        await assert_eventually(lambda: allocator.stats()[0].retired == 2)

        async def removed() -> bool:
            return not retired & {container.name for container in await _live(provider)}

        await assert_eventually(removed, message="a retired container was not removed")
        third = await allocator.acquire(small_spec())
        assert third.id not in retired and third.jobs_served == 0
        await third.close()
    finally:
        await allocator.close()


async def _live(provider: PodmanProvider) -> list[Any]:
    return await provider.call(lambda: provider.client.containers.list(all=True))
