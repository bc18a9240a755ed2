"""The fake sandbox provider (tests/fakes/sandbox_provider.py) keeps the provider contract:
real processes that are gone after close, specs honoured as far as jobs can tell, images
prepared by their setup hooks, failures reported as the Podman provider reports them."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from prorl_server.errors import SandboxError
from prorl_server.sandbox.allocator import SandboxAllocator
from prorl_server.sandbox.base import LABEL_JOB, LABEL_MANAGED, LABEL_SERVER, SandboxSpec
from prorl_server.sandbox.blame import process_ref, process_status
from tests.fakes.sandbox_provider import FakeContainer, FakeSandboxProvider


def spec(image: str = "fake-python", **labels: str) -> SandboxSpec:
    return SandboxSpec(image=image, cpus=0.5, memory_mib=128, pids_limit=32, labels=labels)


def container_of(sandbox: object) -> FakeContainer:
    container = getattr(sandbox, "container", None)
    assert isinstance(container, FakeContainer)
    return container


async def test_sandboxes_are_real_processes_that_are_gone_after_close(fake_provider: FakeSandboxProvider) -> None:
    first, second = await asyncio.gather(fake_provider.create(spec()), fake_provider.create(spec()))
    assert fake_provider.busy == 2 and first.id != second.id
    pids = []
    for sandbox in (first, second):
        health = await sandbox.health()
        container = container_of(sandbox)
        assert container.process is not None and health.pid == container.process.pid
        reported = await sandbox.bash("echo $PPID", timeout_s=10)  # bash's parent is the runtime
        assert int(reported.output) == health.pid
        assert "running" in await container.describe() and await container.limits_hit() == []
        pids.append(health.pid)
    refs = [process_ref(pid) for pid in pids]
    assert all(ref is not None and process_status(ref) == "alive" for ref in refs)

    await first.close()
    assert fake_provider.busy == 1
    await fake_provider.close()  # removes what is left; the sandbox's own close then has nothing to do
    await second.close()
    assert fake_provider.busy == 0
    for ref in refs:
        assert ref is not None and process_status(ref) == "gone"
    assert not container_of(first).folder.exists() and not container_of(second).folder.exists()


async def test_specs_are_recorded_with_their_labels(fake_provider: FakeSandboxProvider) -> None:
    sandbox = await fake_provider.create(spec("some-image", **{LABEL_JOB: "job-1"}))
    try:
        container = container_of(sandbox)
        assert container.spec.image == "some-image" and fake_provider.created == [container.spec]
        assert container.labels == {LABEL_MANAGED: "1", LABEL_SERVER: fake_provider.instance_id, LABEL_JOB: "job-1"}
        assert sandbox.id.startswith(f"prorl-{fake_provider.instance_id}-")
    finally:
        await sandbox.close()


def git_repository(workdir: Path) -> None:
    repo = workdir / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    for command in (
        ["git", "init", "-q"],
        ["git", "add", "."],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
    ):
        subprocess.run(command, cwd=repo, check=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
async def test_an_image_setup_lays_out_the_workdir_and_unknown_images_are_refused() -> None:
    provider = FakeSandboxProvider(images={"fake-swe": git_repository, "fake-plain": None})
    await provider.start()
    try:
        sandbox = await provider.create(spec("fake-swe"))
        await sandbox.edit("str_replace", "repo/calc.py", old_str="a - b", new_str="a + b")
        diff = await sandbox.bash("cd repo && git --no-pager diff --stat", timeout_s=10)
        assert "calc.py | 2 +-" in diff.output
        plain = await provider.create(spec("fake-plain"))
        assert await plain.list_dir(".") == []
        with pytest.raises(SandboxError) as error:
            await provider.create(spec("not-built"))
        assert error.value.reason == "sandbox_image" and provider.busy == 2
    finally:
        await provider.close()
    assert provider.busy == 0


async def test_a_runtime_killed_from_outside_is_an_infrastructure_error(fake_provider: FakeSandboxProvider) -> None:
    sandbox = await fake_provider.create(spec())
    try:
        container = container_of(sandbox)
        assert container.process is not None
        container.process.kill()
        await container.process.wait()
        with pytest.raises(SandboxError) as error:  # the fake sees nothing to blame on the agent
            await sandbox.bash("echo", timeout_s=5)
        assert error.value.reason == "sandbox_lost" and "exited with -9" in error.value.message
    finally:
        await sandbox.close()
    assert fake_provider.busy == 0


async def test_a_failed_or_cancelled_start_leaves_nothing(
    fake_provider: FakeSandboxProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = FakeSandboxProvider(python="/bin/false")
    await broken.start()
    with pytest.raises(SandboxError) as error:
        await broken.create(spec())
    assert error.value.reason == "sandbox_start" and broken.busy == 0

    # Cancelled once its runtime process runs and before the provider connects to it (on a
    # busy machine a creation left to race a poll loop may finish first).
    runtime_started = asyncio.Event()
    start = FakeContainer.start

    async def start_and_stay(self: FakeContainer, python: str, timeout_s: float) -> None:
        await start(self, python, timeout_s)
        runtime_started.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(FakeContainer, "start", start_and_stay)
    creation = asyncio.ensure_future(fake_provider.create(spec()))
    await runtime_started.wait()
    (container,) = fake_provider.containers
    assert container.process is not None and container.process.returncode is None
    creation.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creation
    assert fake_provider.busy == 0 and not container.folder.exists()
    assert container.process.returncode is not None


async def test_warm_pools_count_the_fakes_sandboxes(fake_provider: FakeSandboxProvider) -> None:
    pools = SandboxAllocator(fake_provider, [])
    sandbox = await pools.acquire(spec())
    assert pools.busy == 1 and fake_provider.busy == 1
    await sandbox.close()
    assert pools.busy == 0 and fake_provider.busy == 0
    await pools.close()
