"""The mode seam: the settings pick standalone or cluster, and app.py knows neither.

The two modes' behaviour is tested where it shows: standalone by every fast test that
starts a server, the cluster by tests/integration/test_cluster.py on a throwaway PostgreSQL.
Here: which mode the settings make, that a cluster server whose store cannot be reached
refuses to start and stops cleanly, that app.py holds no branch on the mode, and the one
set of submit checks both modes make.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from prorl_client import v1
from prorl_server.app import ProrlServer
from prorl_server.cluster.store import ClusterStore
from prorl_server.config import Settings, load_settings
from prorl_server.errors import AlreadyExists, InvalidArgument
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from prorl_server.jobs.store import JobStoreError
from prorl_server.jobs.submission import Submission
from prorl_server.modes.cluster import ClusterMode
from prorl_server.modes.factory import build_mode
from prorl_server.modes.standalone import StandaloneMode
from tests.unit.docs.test_layers import PACKAGE, imported_modules

APP = PACKAGE / "app.py"


def settings_with(store: bool | str, tmp_path: Path, **sections: Any) -> Settings:
    overrides = {"jobs": {"store": store}, "sandbox": {"state_dir": str(tmp_path)}, **sections}
    return load_settings(None, environ={}, overrides=overrides)


def test_the_store_setting_picks_the_mode(tmp_path: Path) -> None:
    standalone = build_mode(settings_with(True, tmp_path, server={"instance_id": "s1"}))
    assert isinstance(standalone, StandaloneMode) and standalone.runs_jobs
    assert isinstance(standalone.store, SQLiteJobStore)
    assert standalone.store.path == tmp_path / "jobs" / "s1.sqlite"
    in_memory = build_mode(settings_with(False, tmp_path))
    assert isinstance(in_memory, StandaloneMode) and in_memory.store is None

    url = "postgresql://u:secret@db.example/jobs"
    cluster = build_mode(settings_with(url, tmp_path, server={"instance_id": "c1"}))
    assert isinstance(cluster, ClusterMode) and cluster.runs_jobs
    assert isinstance(cluster.store, ClusterStore) and cluster.store.url == url and cluster.store.server_id == "c1"
    front = build_mode(settings_with(url, tmp_path, cluster={"run_jobs": False}))
    assert not front.runs_jobs
    assert not (tmp_path / "jobs").exists()  # building a mode opens nothing


async def test_a_cluster_server_whose_store_cannot_be_reached_refuses_to_start_and_stops(tmp_path: Path) -> None:
    url = f"postgresql://prorl:s3cret@/jobs?host={tmp_path}/nowhere"
    settings = settings_with(url, tmp_path, server={"port": 0}, llm={"embedded": {"enabled": "never"}})
    server = ProrlServer(settings)
    with pytest.raises(JobStoreError) as refused:
        await server.start()
    assert "cannot connect" in refused.value.message and "s3cret" not in refused.value.message
    assert server.manager is None and server.jobs is None  # nothing was started after the store
    await server.stop()  # again: idempotent, and nothing left to close


async def test_a_mode_stops_and_closes_after_a_start_that_failed_at_its_store(tmp_path: Path) -> None:
    mode = build_mode(settings_with(f"postgresql://u@/jobs?host={tmp_path}/nowhere", tmp_path))
    with pytest.raises(JobStoreError):
        await mode.open()
    await mode.shutdown(0)
    await mode.close()


def test_app_py_does_not_branch_on_the_mode() -> None:
    """The mode is app.py's only view of standalone and cluster: nothing of cluster/ in it,
    and no isinstance on a store."""
    assert [m for m in imported_modules(APP) if m.startswith("prorl_server.cluster")] == []
    checks = [
        ast.unparse(node)
        for node in ast.walk(ast.parse(APP.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
    ]
    assert [check for check in checks if "Store" in check or "Mode" in check] == []


def test_a_submission_checks_or_gives_the_job_id_and_tells_a_different_request() -> None:
    request = v1.RolloutRequest(job_id="same", handler="math")
    submission = Submission.of(request)
    assert submission.job_id == "same" and submission.request is request
    submission.check_same(Submission.of(v1.RolloutRequest(job_id="same", handler="math")).fingerprint)
    with pytest.raises(AlreadyExists, match="job id 'same' is already used by a different request; choose a new"):
        submission.check_same(Submission.of(v1.RolloutRequest(job_id="same", handler="code")).fingerprint)
    with pytest.raises(AlreadyExists, match=r"; for the branch$"):
        submission.check_same(b"other", hint="for the branch")
    branch = Submission.of(request, extra=b"turn 2")
    assert branch.fingerprint == submission.fingerprint + b"turn 2"  # the same request forked is another job

    given = Submission.of(v1.RolloutRequest(handler="math"))
    assert len(given.job_id) == 32 and given.request.handler == "math"
    assert given.job_id != Submission.of(v1.RolloutRequest(handler="math")).job_id
    assert given.fingerprint == given.request.SerializeToString(deterministic=True)  # with its new id
    with pytest.raises(InvalidArgument, match="job_id 'a b' is invalid"):
        Submission.of(v1.RolloutRequest(job_id="a b"))
