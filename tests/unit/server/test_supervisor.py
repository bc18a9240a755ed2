"""SupervisedProcess.stop: a child that ignores SIGTERM is killed with everything it started."""

from __future__ import annotations

from pathlib import Path

from prorl_server.supervisor import SupervisedProcess
from tests.helpers import assert_eventually


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_child_that_ignores_sigterm_is_killed_with_its_whole_process_group() -> None:
    # The shell and its background sleep both ignore SIGTERM (an ignored signal stays ignored
    # across exec), like a runuser whose podman service does not stop in time.
    child = SupervisedProcess("stubborn", ["sh", "-c", 'trap "" TERM; sleep 1000 & echo "$!" >&2; wait'])

    async def started() -> bool:
        return bool(child.stderr_tail)

    await child.start(started, timeout_s=10)
    grandchild = int(child.stderr_tail.splitlines()[0])
    assert alive(grandchild)
    await child.stop(timeout_s=0.5)
    assert not child.running
    await assert_eventually(lambda: not alive(grandchild), timeout_s=10)
