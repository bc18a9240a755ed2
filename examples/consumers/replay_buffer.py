"""A streaming consumer that is not the trainer: a replay buffer with a reward dashboard.

Follows the finished trajectories of the jobs carrying some labels, from the service's
event feed (Subscribe), keeps the last --size of them in memory (what a trainer or an
evaluator would sample from) and prints the running mean reward per handler.

Restartable: the running counts are saved together with the feed cursor they go up to,
in one file replaced atomically (--state), so a consumer killed at any moment and
started again counts every trajectory exactly once. The buffer itself is not saved (it
is recent trajectories by design, refilled by the ones that come next).

    python examples/consumers/replay_buffer.py --server localhost:50051 --label run=exp1 \\
        --state replay.state.json --size 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import grpc

from prorl_client import Client, RpcError


@dataclass(frozen=True)
class Trajectory:
    job_id: str
    handler: str
    reward: float
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]


class ReplayBuffer:
    """The last `size` trajectories, and per handler how many came and their reward sum."""

    def __init__(self, size: int, counts: dict[str, list[float]] | None = None) -> None:
        self.items: deque[Trajectory] = deque(maxlen=size)
        self.counts: dict[str, list[float]] = counts or {}  # handler -> [trajectories, reward sum]

    def add(self, trajectory: Trajectory) -> None:
        self.items.append(trajectory)
        count = self.counts.setdefault(trajectory.handler, [0, 0.0])
        count[0] += 1
        count[1] += trajectory.reward

    def sample(self, k: int) -> list[Trajectory]:
        return random.sample(list(self.items), min(k, len(self.items)))

    def dashboard(self) -> str:
        means = " | ".join(
            f"{handler} {total / count:.3f} (n={int(count)})" for handler, (count, total) in sorted(self.counts.items())
        )
        return f"buffer {len(self.items)} | mean reward: {means}"


def load_state(path: Path) -> tuple[str, dict[str, list[float]]]:
    """(cursor, counts) saved by an earlier run; ("", {}) the first time."""
    if not path.exists():
        return "", {}
    state = json.loads(path.read_text())
    return str(state["cursor"]), {str(k): [float(n), float(s)] for k, (n, s) in state["counts"].items()}


def save_state(path: Path, cursor: str, counts: dict[str, list[float]]) -> None:
    """Cursor and counts in one atomic replacement: both or neither."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as file:
        json.dump({"cursor": cursor, "counts": counts}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


async def follow(client: Client, args: argparse.Namespace) -> int:
    cursor, counts = load_state(args.state)
    buffer = ReplayBuffer(args.size, counts)
    taken = 0
    feed = client.follow_feed(after_cursor=cursor, labels=dict(args.label), event_kinds=["finished"])
    async for item in feed:
        if item.HasField("event"):
            result = item.event.finished.result
            trajectory = result.trajectory
            buffer.add(
                Trajectory(
                    job_id=result.job_id,
                    handler=item.handler,
                    reward=result.reward,
                    token_ids=tuple(trajectory.token_ids),
                    loss_mask=tuple(trajectory.loss_mask),
                    logprobs=tuple(trajectory.logprobs),
                )
            )
            taken += 1
            print(buffer.dashboard(), flush=True)
        # Progress marks (no event) move the cursor too: a restart does not read them again.
        save_state(args.state, item.cursor, buffer.counts)
        if args.stop_after and taken >= args.stop_after:
            break
    return 0


def label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--server", default="localhost:50051")
    parser.add_argument("--label", action="append", type=label, default=[], metavar="KEY=VALUE")
    parser.add_argument("--size", type=int, default=1000, help="trajectories kept in memory")
    parser.add_argument("--state", type=Path, default=Path("replay.state.json"), help="cursor and counts")
    parser.add_argument("--stop-after", type=int, default=0, help="stop after N trajectories (0: never)")
    parser.add_argument("--token", default=os.environ.get("PRORL_TOKEN"))
    args = parser.parse_args(argv)

    async def go() -> int:
        async with Client.connect(args.server, token=args.token) as client:
            return await follow(client, args)

    try:
        return asyncio.run(go())
    except KeyboardInterrupt:
        return 0  # the state file is as of the last trajectory or progress mark
    except RpcError as exc:
        if exc.code == grpc.StatusCode.OUT_OF_RANGE:
            print(f"the feed no longer has the events after {args.state}'s cursor: {exc.details}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
