"""The host's processes started since a given one (sandbox/procfs.py), on this host's /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from prorl_server.sandbox import procfs
from prorl_server.sandbox.blame import HostView
from prorl_server.sandbox.cgroups import _descendants

MARKER = "prorl-procfs-test-marker"


@pytest.fixture
def tree() -> Iterator[tuple[int, int]]:
    """(a parent, its child): a python that forks a child running the same command line,
    as the container's init forks the runtime. The child's pid is above its parent's: on
    a busy host (pid_max is 32768 here) the counter may wrap between the two forks, and
    then the pair is made again."""
    for _ in range(3):
        with _forked_pair() as (parent, child):
            if child > parent:
                yield parent, child
                return
    pytest.fail("the pid counter wrapped between parent and child three times")


@contextlib.contextmanager
def _forked_pair() -> Iterator[tuple[int, int]]:
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\nelse:\n    print(flush=True); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", code, MARKER], stdout=subprocess.PIPE)
    children: list[int] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"\n"  # forked by now
        children = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent(int(pid)) == parent.pid]
        assert len(children) == 1
        yield parent.pid, children[0]
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def test_the_processes_started_after_one_are_found_without_the_older_ones(
    tree: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, child = tree
    # The counter has not wrapped since the parent (other tests on a busy host may make it wrap).
    monkeypatch.setattr(procfs, "last_pid", lambda: child)
    since = procfs.pids_since(parent)
    assert child in since and parent not in since and all(pid > parent for pid in since)
    older = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and int(pid) < parent]
    assert older and not set(older) & set(since)
    assert since == sorted(since)
    assert _descendants(parent) == [parent, child]


def test_once_the_pid_counter_wrapped_every_process_is_looked_at(
    tree: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, child = tree
    monkeypatch.setattr(procfs, "last_pid", lambda: parent - 1)  # handed out pid_max, then started again low
    since = procfs.pids_since(parent)
    assert {parent, child, os.getpid(), 1} <= set(since)


def test_the_runtime_forked_by_init_is_found(tree: tuple[int, int]) -> None:
    parent, child = tree
    view = HostView.find(parent, MARKER)
    assert view is not None and (view.init.pid, view.runtime.pid) == (parent, child)


def test_the_last_pid_handed_out_is_read_from_proc() -> None:
    with open("/proc/sys/kernel/pid_max") as pid_max:
        highest = int(pid_max.read())
    newest = procfs.last_pid()
    assert newest is not None and 0 < newest <= highest
