"""Forking jobs (ForkJob): the state kept at a forkable job's turn boundaries, and the start of a branch.

At each turn boundary of a forkable job (RolloutRequest.forkable, or a fork) the
registry keeps a `Boundary`: where the job's recorder and token conversation stood
(their lists only grow, so a position is enough while the job's objects live), and
a snapshot of its sandbox (sandbox/snapshot.py) in a file under
<sandbox.state_dir>/forks/<server.instance_id>/, readable by the server's user
only. A fork copies the parent's trajectory up to the boundary, restores the
snapshot into its own fresh sandbox and goes on from the next turn; it inherits the
parent's earlier boundaries, so a fork can be forked (at any of its turns).

What a branch starts from lives in this server's memory and files: it is gone after
a restart, once the parent is no longer retained, and on other servers of a cluster;
ForkJob then says so (FAILED_PRECONDITION). Snapshots are never served: the only way
to read one is to fork the job it belongs to.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from prorl_client import v1
from prorl_server.agents.recorder import RecorderMark, TrajectoryRecorder
from prorl_server.errors import FailedPrecondition, OutOfRange, ProrlError
from prorl_server.llm.job_chat import JobChat
from prorl_server.llm.token_conversation import ConversationMark
from prorl_server.sandbox.snapshot import NOT_CARRIED, Root, SandboxState, capture, record_base, restore

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Boundary:
    """A job's state after one turn's tool results."""

    turn: int
    recorder: RecorderMark | None = None
    conversation: ConversationMark | None = None
    archive: Path | None = None
    state: SandboxState | None = None
    """Without its archive bytes (those are in `archive`)."""
    lost: str = ""
    """Why no fork can start here; "" when one can."""
    agent_time_s: float = 0.0
    """How much of the task's own time limit for its agent was used by then (RolloutContext.time_used_s):
    a fork's agent has only the rest, as the parent's had."""


@dataclass
class ForkSource:
    """What a job offers its forks."""

    job_id: str
    root_job_id: str
    roots: tuple[Root, ...]
    recorder: TrajectoryRecorder
    chat: JobChat
    boundaries: dict[int, Boundary] = field(default_factory=dict)
    running: bool = True
    base: str | None = None
    """Where the job's sandbox lists its pristine roots as they started (snapshot.record_base):
    its snapshots carry their changes only. None: whole trees."""


@dataclass(frozen=True)
class ForkStart:
    """A fork's start, as its JobRecord holds it."""

    parent_job_id: str
    root_job_id: str
    boundary: Boundary
    source: ForkSource
    train_prefix: bool

    @property
    def prefix_tokens(self) -> int:
        return self.boundary.conversation.tokens if self.boundary.conversation is not None else 0

    def origin(self) -> v1.ForkOrigin:
        return v1.ForkOrigin(
            parent_job_id=self.parent_job_id,
            parent_turn=self.boundary.turn,
            root_job_id=self.root_job_id,
            prefix_tokens=self.prefix_tokens,
            train_prefix=self.train_prefix,
        )

    def forked_event(self) -> v1.JobForked:
        state = self.boundary.state
        carried = sorted(state.paths.values()) if state is not None else []
        skipped = []
        if state is not None and state.skipped:
            skipped = [f"special files (devices, FIFOs, sockets): {', '.join(state.skipped)[:1000]}"]
        return v1.JobForked(origin=self.origin(), not_carried=[*NOT_CARRIED, *skipped], carried_paths=carried)

    def fingerprint(self) -> bytes:
        return self.origin().SerializeToString(deterministic=True)


class ForkRegistry:
    def __init__(self, directory: Path, *, max_snapshot_bytes: int, max_total_bytes: int) -> None:
        self._directory = directory
        self._max_snapshot = max_snapshot_bytes
        self._max_total = max_total_bytes
        self._sources: dict[str, ForkSource] = {}
        self._reserved: dict[str, list[Path]] = {}
        """A fork's inherited snapshot files, held from ForkJob until its job starts (track)."""
        self._refs: dict[Path, int] = {}
        self._sizes: dict[Path, int] = {}
        self._ready: asyncio.Lock | None = None
        self._prepared = False

    @property
    def stored_bytes(self) -> int:
        return sum(self._sizes.values())

    async def _prepare(self) -> None:
        """The snapshot folder, emptied of what an earlier run of this server left (its index died with it)."""
        if self._ready is None:
            self._ready = asyncio.Lock()
        async with self._ready:
            if not self._prepared:
                await asyncio.to_thread(_fresh_folder, self._directory)
                self._prepared = True

    # --- the jobs that offer forks ----------------------------------------------------

    def reserve(self, job_id: str, start: ForkStart) -> None:
        """Hold the parent's snapshot files a new fork inherits from the moment ForkJob accepts it
        (the parent may be forgotten before the fork starts to run)."""
        paths = [b.archive for turn, b in start.source.boundaries.items() if turn <= start.boundary.turn and b.archive]
        for path in paths:
            self._refs[path] = self._refs.get(path, 0) + 1
        self._reserved[job_id] = paths

    def track(
        self,
        job_id: str,
        *,
        roots: tuple[Root, ...],
        recorder: TrajectoryRecorder,
        chat: JobChat,
        start: ForkStart | None,
    ) -> ForkSource:
        """Begin keeping `job_id`'s boundaries; a fork inherits its parent's up to its own start."""
        inherited: dict[int, Boundary] = {}
        root_job_id = job_id
        if start is not None:  # its references to the parent's files were taken by `reserve`
            root_job_id = start.root_job_id
            inherited = {turn: b for turn, b in start.source.boundaries.items() if turn <= start.boundary.turn}
            held = set(self._reserved.pop(job_id, []))
            inherited = {turn: b for turn, b in inherited.items() if b.archive is None or b.archive in held}
        source = ForkSource(job_id, root_job_id, roots, recorder, chat, inherited)
        self._sources[job_id] = source
        return source

    async def begin(self, source: ForkSource, sandbox: Any) -> None:
        """Note what the job's sandbox starts from, before its first turn or a fork's restore.
        Never fails the job: without it the snapshots carry the whole trees."""
        try:
            source.base = await record_base(sandbox, source.roots)
        except ProrlError as exc:
            log.info("fork_base_not_listed", reason=exc.message)

    async def record(self, source: ForkSource, turn: int, sandbox: Any, *, agent_time_s: float = 0.0) -> Boundary:
        """Keep the job's state after `turn`: never fails the job (a state that cannot be kept
        leaves the turn unforkable, with the reason)."""
        boundary = Boundary(turn, source.recorder.mark(turn), source.chat.mark(), agent_time_s=agent_time_s)
        try:
            state = await capture(sandbox, source.roots, max_bytes=self._max_snapshot, base=source.base)
            await self._make_room(len(state.archive))
            if self.stored_bytes + len(state.archive) > self._max_total:
                raise FailedPrecondition(
                    f"this server's snapshot space is full of running jobs' snapshots "
                    f"(setting jobs.fork_snapshots_max_bytes = {self._max_total})"
                )
            await self._prepare()
            path = self._directory / _folder_name(source.job_id) / f"{turn}.tar"
            await asyncio.to_thread(_write_private, path, state.archive)
            self._refs[path] = self._refs.get(path, 0) + 1
            self._sizes[path] = len(state.archive)
            boundary = replace(boundary, archive=path, state=replace(state, archive=b""))
        except ProrlError as exc:
            log.info("fork_state_not_kept", turn=turn, reason=exc.message)
            boundary = replace(boundary, lost=exc.message)
        except OSError as exc:  # the server's own folder: its state cannot be written
            log.error("fork_state_not_written", turn=turn, error=str(exc))
            boundary = replace(boundary, lost=f"the server could not write the snapshot: {exc}")
        if source.job_id in self._sources:
            source.boundaries[turn] = boundary
        return boundary

    def finished(self, job_id: str) -> None:
        source = self._sources.get(job_id)
        if source is not None:
            source.running = False

    async def close(self) -> None:
        """Remove every snapshot (the index that makes them usable lives in memory only)."""
        self._sources.clear()
        self._reserved.clear()
        self._refs.clear()
        self._sizes.clear()
        await asyncio.to_thread(shutil.rmtree, self._directory, True)

    async def _make_room(self, needed: int) -> None:
        """Drop the snapshots of finished jobs, oldest job first, until `needed` more bytes fit."""
        gone: list[Path] = []
        for source in list(self._sources.values()):
            if self.stored_bytes + needed <= self._max_total:
                break
            if source.running:
                continue
            for boundary in source.boundaries.values():
                if boundary.archive is not None and boundary.archive in self._sizes:
                    self._sizes.pop(boundary.archive)
                    self._refs.pop(boundary.archive, None)
                    gone.append(boundary.archive)
        if not gone:
            return
        dropped = set(gone)
        why = f"dropped to make room for newer ones (setting jobs.fork_snapshots_max_bytes = {self._max_total})"
        for source in self._sources.values():
            for turn, boundary in source.boundaries.items():
                if boundary.archive in dropped:
                    source.boundaries[turn] = replace(boundary, archive=None, lost=why)
        await asyncio.to_thread(_remove_files, gone)

    async def release(self, job_id: str) -> None:
        """Forget a job's boundaries (it is no longer retained): its snapshot files go once no
        fork of its tree refers to them."""
        source = self._sources.pop(job_id, None)
        held = self._reserved.pop(job_id, [])  # a fork that ended before it ran
        paths = held + ([b.archive for b in source.boundaries.values() if b.archive] if source else [])
        gone: list[Path] = []
        for path in paths:
            if path not in self._refs:
                continue
            self._refs[path] -= 1
            if self._refs[path] <= 0:
                del self._refs[path]
                self._sizes.pop(path, None)
                gone.append(path)
        if gone:
            await asyncio.to_thread(_remove_files, gone)

    # --- branching --------------------------------------------------------------------

    def start(self, job_id: str, turn: int, *, forkable: bool) -> tuple[ForkSource, Boundary]:
        """The boundary a fork of `job_id` after `turn` starts from; the refusal says what to do."""
        if not forkable:
            raise FailedPrecondition(
                f"job {job_id!r} was not submitted with forkable = true, so it kept no state to branch from; "
                "submit it again with RolloutRequest.forkable set"
            )
        source = self._sources.get(job_id)
        if source is None:
            raise FailedPrecondition(
                f"the state job {job_id!r} kept for forks is gone (this server restarted, or the job ran "
                "elsewhere); fork jobs while the server that ran them retains them"
            )
        boundary = source.boundaries.get(turn)
        finished_turns = source.recorder.num_turns
        if boundary is None:
            if turn < 0:
                raise OutOfRange(f"after_turn must be 0 or more, got {turn}")
            kept = sorted(t for t, b in source.boundaries.items() if not b.lost)
            where = f"it can be branched after turns {_ranges(kept)}" if kept else "it has no turn to branch after yet"
            if source.running and turn >= finished_turns - 1:
                raise OutOfRange(
                    f"job {job_id!r} has not finished turn {turn} yet ({finished_turns} model turns so far); "
                    f"retry once it has, {where}"
                )
            raise OutOfRange(
                f"job {job_id!r} has no turn boundary after turn {turn} ({finished_turns} model turns, the last "
                f"one ends it); {where}"
            )
        if boundary.lost:
            raise FailedPrecondition(f"the state of job {job_id!r} after turn {turn} was not kept: {boundary.lost}")
        if boundary.archive is None or not boundary.archive.exists():
            raise FailedPrecondition(f"the sandbox snapshot of job {job_id!r} after turn {turn} is lost from disk")
        return source, boundary


class JobBranching:
    """A job's part in forking (agents/branching.py): its boundaries recorded, a fork's state restored."""

    def __init__(self, registry: ForkRegistry, source: ForkSource, start: ForkStart | None) -> None:
        self._registry = registry
        self._source = source
        self._start = start

    @property
    def resume_after(self) -> int | None:
        return self._start.boundary.turn if self._start is not None else None

    @property
    def carried_time_s(self) -> float:
        return self._start.boundary.agent_time_s if self._start is not None else 0.0

    async def begin(self, ctx: Any) -> None:
        if any(root.pristine for root in self._source.roots):
            with ctx.time_stopped():
                await self._registry.begin(self._source, ctx.sandbox)

    async def resume(self, ctx: Any) -> None:
        assert self._start is not None
        boundary = self._start.boundary
        assert boundary.archive is not None and boundary.state is not None
        with ctx.time_stopped():
            archive = await asyncio.to_thread(boundary.archive.read_bytes)
            await restore(ctx.sandbox, self._source.roots, replace(boundary.state, archive=archive))

    async def boundary(self, ctx: Any, turn: int) -> None:
        used = ctx.time_used_s  # before the snapshot, which is not the agent's time
        with ctx.time_stopped():
            await self._registry.record(self._source, turn, ctx.sandbox, agent_time_s=used or 0.0)


def _folder_name(job_id: str) -> str:
    """A job's snapshot folder: a digest of its id (ids may be "..")."""
    return hashlib.sha256(job_id.encode()).hexdigest()[:32]


def _ranges(turns: list[int]) -> str:
    return ", ".join(map(str, turns[:20])) + (" ..." if len(turns) > 20 else "")


def _fresh_folder(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, mode=0o700)
    os.chmod(directory, 0o700)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def _remove_files(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
        if path.parent.exists() and not any(path.parent.iterdir()):
            path.parent.rmdir()
