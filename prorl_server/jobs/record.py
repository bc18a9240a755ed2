"""A job as the server tracks it, and its resolved plan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from prorl_client import v1
from prorl_server.agents.base import AnyHandler, Limits, TaskInstance
from prorl_server.jobs.event_log import EventLog
from prorl_server.jobs.forks import ForkStart
from prorl_server.llm.base import Sampling

FINISHED_STATUSES = frozenset(
    {v1.JOB_STATUS_SUCCEEDED, v1.JOB_STATUS_FAILED, v1.JOB_STATUS_CANCELLED, v1.JOB_STATUS_TIMED_OUT}
)


class JobView(Protocol):
    """What is reported of a job (jobs.wire.job): a JobRecord of this server, or a
    cluster's stored row (cluster/store.py JobRow) of a job held elsewhere."""

    @property
    def job_id(self) -> str: ...
    @property
    def status(self) -> v1.JobStatus: ...
    @property
    def phase(self) -> v1.Phase: ...
    @property
    def request(self) -> v1.RolloutRequest: ...
    @property
    def create_time(self) -> float: ...
    @property
    def start_time(self) -> float | None: ...
    @property
    def end_time(self) -> float | None: ...
    @property
    def result(self) -> v1.RolloutResult | None: ...
    @property
    def last_seq(self) -> int: ...
    @property
    def finished(self) -> bool: ...


@dataclass(frozen=True)
class JobPlan:
    """The request with every default filled in and every limit checked."""

    handler: AnyHandler
    instance: TaskInstance
    """The request's instance as the handler's model (checked at submission)."""
    limits: Limits
    sampling: Sampling
    budget_s: float
    image: str | None
    cpus: float
    memory_mib: int
    pids_limit: int
    priority: int
    min_policy_version: int = 0
    """No model turn of the job is sampled from an older policy version."""


@dataclass(eq=False)
class JobRecord:
    job_id: str
    number: int
    """Creation order; ListJobs pages by it."""
    request: v1.RolloutRequest
    fingerprint: bytes
    plan: JobPlan | None
    """None for a job restored from the store (it will not run again)."""
    create_time: float
    events: EventLog
    status: v1.JobStatus = v1.JOB_STATUS_QUEUED
    phase: v1.Phase = v1.PHASE_UNSPECIFIED
    start_time: float | None = None
    end_time: float | None = None
    result: v1.RolloutResult | None = None
    attempt: int = 1
    """Runs so far, counting this one; above 1 after restarts (RolloutRequest.retry)."""
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    cancel_reason: str | None = None
    """Set by the first cancel request; later ones only wait for the job to end."""
    started: bool = False
    """The job's task has begun to run (before that, cancelling the task would skip its cleanup)."""
    stored_events: int = 0
    """Its first events already in the store when it started here (a cluster's job)."""
    fork: ForkStart | None = field(default=None, repr=False)
    """Set for a branch made by ForkJob: where it starts."""

    @property
    def last_seq(self) -> int:
        return self.events.last_seq

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES
