"""The start-up check of the host limits that decide how many sandboxes a node holds."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from prorl_server.sandbox.base import SandboxSpec
from prorl_server.sandbox.podman import PodmanOptions, host_limits
from prorl_server.sandbox.podman.container_spec import container_kwargs
from prorl_server.sandbox.podman.host_limits import (
    USER_NPROC_CEILING,
    HostFacts,
    capacities,
    keyring_off,
    limit_problems,
)
from prorl_server.sandbox.podman.staging import RuntimeStaging

ROOMY = HostFacts(
    pid_max=4194304, keys_maxkeys=200, keyring_off=True, nofile_soft=1024, nofile_hard=1 << 20, memory_mib=24 * 1024
)


def facts(**changes: object) -> HostFacts:
    values = {**ROOMY.__dict__, **changes}
    return HostFacts(**values)


def test_a_thousand_sandboxes_fit_a_24_gib_host_set_up_by_the_script() -> None:
    assert limit_problems(ROOMY, 1000) == []
    allowed = capacities(ROOMY)
    assert min(allowed, key=lambda name: allowed[name]) == "memory" and allowed["memory"] == 1536


def test_each_limit_a_cap_runs_into_is_named_with_its_fix() -> None:
    tight = facts(pid_max=32768, keyring_off=False, nofile_hard=2048, memory_mib=8 * 1024)
    problems = limit_problems(tight, 9000)
    named = {problem.split("on this host ", 1)[1].split(" ", 1)[0] for problem in problems}
    assert named == {"memory", "nproc", "pid_max", "nofile", "maxkeys"}
    by_name = {name: next(p for p in problems if f"on this host {name} " in p) for name in named}
    assert "kernel.pid_max" in by_name["pid_max"] and "8192 sandboxes" in by_name["pid_max"]
    assert "keyring = false" in by_name["maxkeys"] and "about 200 sandboxes" in by_name["maxkeys"]
    assert f"ceiling is {USER_NPROC_CEILING}" in by_name["nproc"]
    assert "ulimit -Hn" in by_name["nofile"]


def test_without_a_cap_only_the_keyring_quota_is_named() -> None:
    assert limit_problems(facts(pid_max=32768, memory_mib=1024), 0) == []
    (problem,) = limit_problems(facts(keyring_off=False), 0)
    assert problem.startswith("no sandbox.max_sandboxes, but on this host maxkeys allows about 200 sandboxes: ")


def test_keyring_false_is_read_only_from_the_containers_table(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf"
    conf.write_text('[containers]\nlog_driver = "k8s-file"\nkeyring = false  # none\n[engine]\nruntime = "runc"\n')
    assert keyring_off(conf)
    conf.write_text("[containers]\n# keyring = false\n[engine]\nkeyring = false\n")
    assert not keyring_off(conf)
    assert not keyring_off(tmp_path / "missing.conf")


def test_the_open_files_limit_is_raised_toward_what_the_sandboxes_need(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, tuple[int, int]]] = []
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append((which, limits)))
    assert host_limits.raise_nofile(facts(nofile_soft=1024, nofile_hard=4000), 1000) == 1256
    assert host_limits.raise_nofile(facts(nofile_soft=1024, nofile_hard=1100), 1000) == 1100
    assert host_limits.raise_nofile(facts(nofile_soft=20000, nofile_hard=40000), 1000) == 20000
    assert calls == [(resource.RLIMIT_NOFILE, (1256, 4000)), (resource.RLIMIT_NOFILE, (1100, 1100))]


def test_every_sandbox_gets_the_shared_process_ceiling(tmp_path: Path) -> None:
    """The ceiling is for all sandboxes together (one host uid): per sandbox, pids.max counts."""
    setup = (Path(__file__).resolve().parents[3] / "scripts" / "setup_host.sh").read_text()
    assert f'"nproc={USER_NPROC_CEILING}:{USER_NPROC_CEILING}"' in setup
    options = PodmanOptions(
        instance_id="unit", state_dir=tmp_path, sandbox_user="prorl", container_user="1000:1000",
        workdir="/workspace", tmp_mib=64, max_output_bytes=1024, threads=1, runtime_start_timeout_s=5.0,
        cgroup_limits=False,
    )  # fmt: skip
    staging = RuntimeStaging(tmp_path, "unit", sandbox_user="prorl", container_user="1000:1000")
    spec = SandboxSpec(image="img", cpus=1.0, memory_mib=256, pids_limit=64)
    kwargs = container_kwargs(spec, name="c", labels={}, runtime=True, options=options, staging=staging)
    nproc = next(limit for limit in kwargs["ulimits"] if limit["Name"] == "nproc")
    assert nproc == {"Name": "nproc", "Soft": USER_NPROC_CEILING, "Hard": USER_NPROC_CEILING}
    assert kwargs["pids_limit"] == 64


def test_a_limit_the_server_may_not_raise_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(which: int, limits: tuple[int, int]) -> None:
        raise ValueError("not allowed to raise the soft limit")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert host_limits.raise_nofile(facts(nofile_soft=1024, nofile_hard=4000), 1000) == 1024
