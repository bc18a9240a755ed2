"""How a tool loop takes part in forking (ForkJob): the seam between agents/ and jobs/forks.py.

A forkable job's loop first calls `begin`, before anything runs in its sandbox (for a
fork: before the restore), so that snapshots can carry what changed since then; it
tells `boundary(turn)` after each turn whose tool results it
has recorded (the jobs layer snapshots the sandbox and marks the trajectory there);
a fork's loop starts with `resume`, which restores the parent's sandbox state into
the fork's fresh sandbox, and then goes on at turn `resume_after + 1` with the
recorder and token conversation the jobs layer built from the parent's, and with what
was left of the agent's time limit there (`carried_time_s`). The work done for forking
(the snapshots, the restore) does not count as the agent's time.
"""

from __future__ import annotations

from typing import Any, Protocol


class Branching(Protocol):
    @property
    def resume_after(self) -> int | None:
        """For a fork: the parent's turn it branched after; None for a job that starts afresh."""
        ...

    @property
    def carried_time_s(self) -> float:
        """For a fork: how much of the task's own time limit for its agent (RolloutContext.time_limit)
        the parent had used by `resume_after`; 0 for a job that starts afresh or has no such limit."""
        ...

    async def begin(self, ctx: Any) -> None:
        """Before the first turn (and a fork's `resume`): note the sandbox's starting state."""
        ...

    async def resume(self, ctx: Any) -> None:
        """Put the parent's sandbox state at `resume_after` into this job's sandbox."""
        ...

    async def boundary(self, ctx: Any, turn: int) -> None:
        """`turn` and its tool results are recorded and the loop goes on: keep this point."""
        ...
