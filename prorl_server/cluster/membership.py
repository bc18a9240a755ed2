"""The servers of a cluster (`servers` table): each publishes itself at every heartbeat.

A row per server id: its address, whether it runs jobs, its last heartbeat
(the database's clock) and its load as a ServerSummary message. A server whose
heartbeat is older than cluster.lease_ttl_s is not live (its leases lapse at
the same time). GetStats(include_cluster) reads them all.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from prorl_client import v1
from prorl_server.cluster.store import NOW, ClusterStore
from prorl_server.stats import ServerStats


def summary(server_id: str, address: str, runs_jobs: bool, stats: ServerStats, leases: int) -> v1.ServerSummary:
    return v1.ServerSummary(
        server_id=server_id,
        address=address,
        runs_jobs=runs_jobs,
        leases=leases,
        phases=[
            v1.PhaseStats(phase=load.phase, queued=load.queued, active=load.active, limit=load.limit)
            for load in stats.phases
        ],
        sandboxes_busy=stats.sandboxes_busy,
        policy_version=stats.policy_version,
        paused=stats.paused,
    )


async def publish(store: ClusterStore, item: v1.ServerSummary, *, admin_applied: int) -> None:
    await store.pool.execute(
        "INSERT INTO servers (server_id, address, runs_jobs, started, heartbeat, admin_applied, summary) "
        f"VALUES ($1, $2, $3, {NOW}, {NOW}, $4, $5) ON CONFLICT (server_id) DO UPDATE SET "
        f"address = $2, runs_jobs = $3, heartbeat = {NOW}, admin_applied = $4, summary = $5",
        item.server_id,
        item.address,
        item.runs_jobs,
        admin_applied,
        item.SerializeToString(),
    )


async def leave(store: ClusterStore) -> None:
    """This server stops: it is no longer live (its row stays, for the record)."""
    await store.pool.execute("UPDATE servers SET heartbeat = 0 WHERE server_id = $1", store.server_id)


async def servers(store: ClusterStore, live_within_s: float) -> list[v1.ServerSummary]:
    rows = await store.pool.fetch(
        f"SELECT server_id, heartbeat, heartbeat > {NOW} - $1 AS live, summary FROM servers ORDER BY server_id",
        live_within_s,
    )
    found = []
    for row in rows:
        item = v1.ServerSummary.FromString(row["summary"]) if row["summary"] else v1.ServerSummary()
        item.server_id = row["server_id"]
        item.live = row["live"]
        stamp = Timestamp()
        stamp.FromNanoseconds(int(row["heartbeat"] * 1e9))
        item.heartbeat_time.CopyFrom(stamp)
        found.append(item)
    return found
