"""Shutdown removes every sandbox group, even where processes take seconds to leave it
(sandbox/cgroups.py). Directories in a temporary folder stand in for the v1 hierarchies:
rmdir fails on one while it is not empty, as on a group that still has processes."""

from __future__ import annotations

import threading
from pathlib import Path

from prorl_server.sandbox.cgroups import CONTROLLERS, CgroupV1Limiter


def limiter_in(root: Path) -> CgroupV1Limiter:
    limiter = CgroupV1Limiter("prorl-unit")
    limiter._parents = {controller: root / controller / "prorl-unit" for controller in CONTROLLERS}
    return limiter


def test_groups_whose_processes_leave_late_are_still_removed_at_shutdown(tmp_path: Path) -> None:
    limiter = limiter_in(tmp_path)
    busy = []
    for controller in CONTROLLERS:
        for name in ("sandbox-a", "sandbox-b"):
            (tmp_path / controller / "prorl-unit" / name).mkdir(parents=True)
        busy.append(tmp_path / controller / "prorl-unit" / "sandbox-a" / "still-exiting")
        busy[-1].touch()

    # Longer than one sandbox's own patience (2 s): the processes of hundreds of containers
    # removed at once took that long to exit on a loaded host, and their groups were left.
    def processes_leave() -> None:
        for path in busy:
            path.unlink()

    leave = threading.Timer(3.0, processes_leave)
    leave.start()
    try:
        limiter.remove_all(patience_s=20.0)
    finally:
        leave.join()
    assert not any((tmp_path / controller / "prorl-unit").exists() for controller in CONTROLLERS)


def test_a_group_that_never_empties_is_given_up_once_the_patience_is_spent(tmp_path: Path) -> None:
    limiter = limiter_in(tmp_path)
    for controller in CONTROLLERS:
        group = tmp_path / controller / "prorl-unit" / "stuck"
        group.mkdir(parents=True)
        (group / "process").touch()
    limiter.remove_all(patience_s=0.2)  # returns: shutdown is never held up for ever
    assert all((tmp_path / controller / "prorl-unit" / "stuck").is_dir() for controller in CONTROLLERS)
