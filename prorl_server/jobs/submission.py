"""What every Submit checks of a job's identity, on one server or in a cluster.

A job is known by its id and by the request that made it. The id is the
client's (checked) or a new one; the fingerprint (the request's deterministic
bytes, then a branch's point of departure) tells a resubmission, which returns
the job already known, from a different request under an id in use, which is
refused. JobManager.submit (the jobs of one server) and ClusterJobs.submit (the
cluster's store) both start here, so the two modes refuse alike.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from prorl_client import v1
from prorl_server.errors import AlreadyExists
from prorl_server.jobs.validation import check_job_id

RESEND = "choose a new job id or resend the identical request"


@dataclass(frozen=True)
class Submission:
    request: v1.RolloutRequest
    """The request with its job id (a copy given a new one if it had none)."""
    fingerprint: bytes

    @classmethod
    def of(cls, request: v1.RolloutRequest, *, extra: bytes = b"") -> Submission:
        """Check the request's job id, or give it a new one; `extra` is appended to the
        fingerprint (a branch's point of departure: the same request forked elsewhere is
        another job)."""
        if request.job_id:
            check_job_id(request.job_id)
        else:
            copy = v1.RolloutRequest()
            copy.CopyFrom(request)
            copy.job_id = uuid.uuid4().hex
            request = copy
        return cls(request, request.SerializeToString(deterministic=True) + extra)

    @property
    def job_id(self) -> str:
        return self.request.job_id

    def check_same(self, known: bytes, *, hint: str = RESEND) -> None:
        """AlreadyExists unless `known`, the fingerprint of the job under this id, is this one's."""
        if known != self.fingerprint:
            raise AlreadyExists(f"job id {self.job_id!r} is already used by a different request; {hint}")
