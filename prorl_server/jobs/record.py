"""A job as the server tracks it, and its resolved plan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from prorl_client import v1
from prorl_server.agents.base import AgentHandler, Limits
from prorl_server.jobs.event_log import EventLog
from prorl_server.llm.base import Sampling

FINISHED_STATUSES = frozenset(
    {v1.JOB_STATUS_SUCCEEDED, v1.JOB_STATUS_FAILED, v1.JOB_STATUS_CANCELLED, v1.JOB_STATUS_TIMED_OUT}
)


@dataclass(frozen=True)
class JobPlan:
    """The request with every default filled in and every limit checked."""

    handler: AgentHandler
    instance: dict[str, Any]
    limits: Limits
    sampling: Sampling
    budget_s: float
    image: str | None
    cpus: float
    memory_mib: int
    pids_limit: int
    priority: int


def timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    value = Timestamp()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


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

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def to_proto(self) -> v1.Job:
        return v1.Job(
            job_id=self.job_id,
            status=self.status,
            phase=self.phase,
            handler=self.request.handler,
            group_id=self.request.group_id,
            labels=dict(self.request.labels),
            create_time=timestamp(self.create_time),
            start_time=timestamp(self.start_time),
            end_time=timestamp(self.end_time),
            last_seq=self.events.last_seq,
            result=self.result,
        )
