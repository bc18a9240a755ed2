"""The server's load at one moment, as one typed value.

GetStats and the Prometheus gauges both read it, so the two always agree.
The wiring (app.py) builds it from the components that own each figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prorl_client import v1
from prorl_server.llm.router import BackendEntry
from prorl_server.sandbox.allocator import PoolStats


@dataclass(frozen=True)
class PhaseLoad:
    phase: v1.Phase
    queued: int
    active: int
    limit: int


@dataclass(frozen=True)
class ServerStats:
    phases: Sequence[PhaseLoad]
    jobs_by_status: Mapping[v1.JobStatus, int]
    """Jobs the server knows (queued, running and retained), by status."""
    sandboxes_busy: int
    pools: Sequence[PoolStats]
    """Warm pools, and the specs jobs hold sandboxes of."""
    backends: Sequence[BackendEntry]
    policy_version: int
    paused: bool
