"""deploy/slurm/prorl.sbatch run for real on a single-node Slurm of the tests' own (tests/deploy/slurm.py).

The job starts PostgreSQL and one server per node (one node here), writes the round_robin
target once the servers listen, and on the end of the job stops the servers, then
PostgreSQL, and removes its node-local folder. Both ways of ending it are run: the graceful
one (`scancel --batch --signal=TERM`, only the batch script is signalled and stops the rest
in order) and a plain `scancel` (Slurm signals every process of the job at once); and a job
given an existing database (PRORL_JOBS__STORE, the tests' throwaway PostgreSQL) uses it,
starts none of its own and leaves it running.

The servers run as fronts (`cluster.run_jobs=false`) without a model
(`llm.embedded.enabled=never`): what is checked is placement, not rollouts.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorl_client import Client
from tests.deploy.slurm import SlurmCluster, free_port, job_processes, missing_programs, single_node_slurm
from tests.helpers import math_request
from tests.postgres import (  # noqa: F401
    CLUSTER_USER,
    postgres_cluster_fixture,
    postgres_url_fixture,
    server_binaries,
)

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.postgres]

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "prorl.sbatch"
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module", name="slurm")
def slurm_fixture() -> Iterator[SlurmCluster]:
    missing = missing_programs()
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm")
    if os.geteuid() != 0:
        pytest.fail("a Slurm cluster of the tests' own needs root (slurmd starts jobs as their users)")
    if server_binaries() is None:
        pytest.fail("PostgreSQL's server binaries are not installed (/usr/lib/postgresql/*/bin): run `make setup-host`")
    with single_node_slurm() as cluster:
        yield cluster


@dataclass(frozen=True)
class Deployment:
    """One submitted prorl.sbatch job and where it writes."""

    slurm: SlurmCluster
    job_id: int
    instance_id: str
    server_port: int
    postgres_port: int

    @property
    def run_dir(self) -> Path:
        return self.slurm.root / "run" / f"prorl-{self.job_id}"

    @property
    def private_dir(self) -> Path:
        return self.slurm.root / "scratch" / f"prorl-{self.job_id}"

    def output(self) -> str:
        """The batch script's own log and every log it wrote, for failure messages."""
        paths = [self.slurm.root / "run" / f"prorl-{self.job_id}.out", *sorted(self.run_dir.glob("*.log"))]
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in paths if p.exists())


def submit(slurm: SlurmCluster, **extra: str) -> Deployment:
    """prorl.sbatch on the one node, PostgreSQL and servers on free ports; `extra`
    variables on top."""
    prefix = f"t{uuid.uuid4().hex[:6]}"
    server_port, postgres_port = free_port(), free_port()
    env = {
        "PRORL_PYTHON": sys.executable,
        "PRORL_SCRATCH": str(slurm.root / "scratch"),
        "PRORL_INSTANCE_PREFIX": prefix,
        "PRORL_POSTGRES_PORT": str(postgres_port),
        "PRORL_POSTGRES_OS_USER": CLUSTER_USER,
        "PRORL_START_TIMEOUT_S": str(int(START_TIMEOUT_S)),
        "PRORL_SERVER__PORT": str(server_port),
        "PRORL_SERVER__SHUTDOWN_GRACE_S": "5",
        "PRORL_LLM__EMBEDDED__ENABLED": "never",
        "PRORL_CLUSTER__RUN_JOBS": "false",
        **extra,
    }
    run = slurm.root / "run"
    job_id = slurm.sbatch(SCRIPT, "--nodes=1", "--time=10", f"--output={run}/prorl-%j.out", cwd=run, env=env)
    return Deployment(slurm, job_id, f"{prefix}-{slurm.node}", server_port, postgres_port)


def wait_for_target(deployment: Deployment) -> str:
    """The target file appears once every server listens; fails early if the job ends first."""
    target = deployment.run_dir / "target"
    deadline = time.monotonic() + START_TIMEOUT_S + 30
    while not target.exists():
        state = deployment.slurm.job_state(deployment.job_id)
        assert state in {"PENDING", "CONFIGURING", "RUNNING"}, f"job {state}:\n{deployment.output()}"
        assert time.monotonic() < deadline, f"no {target} after {START_TIMEOUT_S + 30} s:\n{deployment.output()}"
        time.sleep(0.2)
    return target.read_text().strip()


async def health(address: str, timeout_s: float = 5) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        status: int = reply.status
        return status


async def stored_job_ids(deployment: Deployment, url: str = "") -> set[str]:
    """The job ids in the job's own PostgreSQL, read with the password the script generated
    (or in the database at `url`)."""
    if url:
        connection = await asyncpg.connect(url)
    else:
        password = (deployment.private_dir / "postgres" / "password").read_text().strip()
        connection = await asyncpg.connect(
            host="127.0.0.1", port=deployment.postgres_port, user="prorl", password=password, database="prorl"
        )
    try:
        return {row["job_id"] for row in await connection.fetch("SELECT job_id FROM jobs")}
    finally:
        await connection.close()


async def assert_all_gone(deployment: Deployment) -> None:
    """Nothing of the job left: no process, no node-local folder, no target pointing at dead servers."""
    left = await asyncio.to_thread(job_processes, deployment.slurm, deployment.job_id)
    assert not left, f"processes of job {deployment.job_id} still running: {left}\n{deployment.output()}"
    assert not deployment.private_dir.exists(), f"{deployment.private_dir} left behind:\n{deployment.output()}"
    assert not list((deployment.slurm.root / "scratch").iterdir())
    assert not (deployment.run_dir / "target").exists()
    assert not (deployment.run_dir / "addresses").exists()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await health(f"127.0.0.1:{deployment.server_port}", timeout_s=2)
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_servers_serve_from_the_jobs_postgres_and_stop_in_order(slurm: SlurmCluster) -> None:
    deployment = await asyncio.to_thread(submit, slurm)
    target = await asyncio.to_thread(wait_for_target, deployment)

    address = f"127.0.0.1:{deployment.server_port}"
    assert target == f"ipv4:{address}"
    assert (deployment.run_dir / "addresses").read_text().split() == [address]
    assert await health(address) == health_pb2.HealthCheckResponse.SERVING, deployment.output()
    async with Client.connect(target, load_balancing="round_robin") as client:
        stats = await client.get_stats()
        assert len(stats.phases) == 3
        job_id = f"slurm-{deployment.job_id}"
        await client.submit(math_request("What is 6 * 7?", "42", job_id=job_id))
        listed = [job.job_id for job in (await client.list_jobs()).jobs]
        assert job_id in listed
    # Kept in the PostgreSQL the script started, not in a SQLite file of the server's.
    assert job_id in await stored_job_ids(deployment)
    log = (deployment.run_dir / f"server-{slurm.node}.log").read_text()
    assert f"instance={deployment.instance_id}" in log, log

    await asyncio.to_thread(slurm.run, "scancel", "--batch", "--signal=TERM", str(deployment.job_id))
    state = await asyncio.to_thread(slurm.wait_job_ended, deployment.job_id)

    assert state == "COMPLETED", deployment.output()  # a requested stop is a clean end
    await assert_all_gone(deployment)
    log = (deployment.run_dir / f"server-{slurm.node}.log").read_text()
    assert "server_stopped" in log and "sandbox_cleanup_failed" not in log, deployment.output()
    postgres_log = (deployment.run_dir / "postgres.log").read_text()
    # The servers were gone before PostgreSQL was asked to stop: a fast shutdown, no smart one.
    assert "received fast shutdown request" in postgres_log and "database system is shut down" in postgres_log
    assert "smart shutdown" not in postgres_log, postgres_log
    output = (slurm.root / "run" / f"prorl-{deployment.job_id}.out").read_text()
    assert output.index("stopping the servers") < output.index("stopping PostgreSQL"), output


async def test_a_plain_scancel_still_leaves_nothing_behind(slurm: SlurmCluster) -> None:
    deployment = await asyncio.to_thread(submit, slurm)
    target = await asyncio.to_thread(wait_for_target, deployment)
    address = target.removeprefix("ipv4:")
    assert await health(address) == health_pb2.HealthCheckResponse.SERVING, deployment.output()

    # Every process of the job gets SIGTERM at once, SIGKILL KillWait (30 s) later.
    await asyncio.to_thread(slurm.run, "scancel", str(deployment.job_id))
    state = await asyncio.to_thread(slurm.wait_job_ended, deployment.job_id)

    assert state == "CANCELLED", deployment.output()
    await assert_all_gone(deployment)
    assert "database system is shut down" in (deployment.run_dir / "postgres.log").read_text()


async def test_an_existing_database_given_as_the_job_store_is_used_and_left_running(
    slurm: SlurmCluster, postgres_url: str
) -> None:
    deployment = await asyncio.to_thread(submit, slurm, PRORL_JOBS__STORE=postgres_url)
    target = await asyncio.to_thread(wait_for_target, deployment)
    async with Client.connect(target, load_balancing="round_robin") as client:
        job_id = f"slurm-{deployment.job_id}"
        await client.submit(math_request("What is 6 * 7?", "42", job_id=job_id))

    await asyncio.to_thread(slurm.run, "scancel", "--batch", "--signal=TERM", str(deployment.job_id))
    assert await asyncio.to_thread(slurm.wait_job_ended, deployment.job_id) == "COMPLETED", deployment.output()

    await assert_all_gone(deployment)
    assert not (deployment.run_dir / "postgres.log").exists()  # no PostgreSQL of the job's own
    assert "using the job store given in PRORL_JOBS__STORE" in deployment.output()
    assert job_id in await stored_job_ids(deployment, postgres_url)  # that database still serves
