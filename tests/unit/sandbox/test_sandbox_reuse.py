"""Sandbox reuse through the allocator, on the fake provider (no Podman): the real
in-sandbox runtime's reset op (as a child subreaper it kills its own descendants and
restores the sandbox's folders), the allocator's hand-over to waiting jobs, its bounds,
idle trimming and retirement. The adversarial suite on real Podman is
tests/adversarial/test_sandbox_reuse.py."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import Client
from prorl_server.app import ProrlServer
from prorl_server.errors import SandboxError
from prorl_server.sandbox.allocator import ReusePolicy, SandboxAllocator
from prorl_server.sandbox.base import SandboxSpec
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeContainer, FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, turn_index
from tests.helpers import assert_eventually, math_request, server_settings

SPEC = SandboxSpec(image="fake:latest", cpus=1.0, memory_mib=256, pids_limit=64)


def image(folder: Path) -> None:
    (folder / "README").write_text("as built\n")
    (folder / "src").mkdir()
    (folder / "src" / "main.py").write_text("print('hi')\n")


@pytest_asyncio.fixture
async def provider() -> AsyncIterator[FakeSandboxProvider]:
    provider = FakeSandboxProvider(instance_id=instance_id("reuse"), images={"fake:latest": image})
    await provider.start()
    yield provider
    await provider.close()
    assert provider.busy == 0


async def allocator(provider: FakeSandboxProvider, **policy: object) -> SandboxAllocator:
    values: dict[str, object] = {"enabled": True, "max_idle": 4, **policy}
    pools = SandboxAllocator(provider, [], reuse=ReusePolicy(**values))  # type: ignore[arg-type]
    pools.start()
    return pools


async def test_the_next_job_gets_the_reset_sandbox_and_none_of_the_last_one(provider: FakeSandboxProvider) -> None:
    pools = await allocator(provider)
    try:
        first = await pools.acquire(SPEC)
        await first.bash(
            "export LEFT=1; cd src; echo x > ../left; echo y >> README; (sleep 1000 &); setsid sleep 999 &",
            timeout_s=10,
        )
        await first.python("secret = 42", timeout_s=10)
        await first.close()
        second = await pools.acquire(SPEC)  # the reset is under way: it is waited for, not a new one started
        assert second.id == first.id and len(provider.created) == 1
        listing = await second.bash(
            "echo LEFT=$LEFT; pwd; ls -1; cat README; grep -l 'slee[p] 99' /proc/[0-9]*/cmdline | wc -l", timeout_s=10
        )
        assert isinstance(second.container, FakeContainer)
        assert listing.output.split("\n")[:5] == ["LEFT=", str(second.container.workdir), "README", "src", "as built"]
        assert listing.output.split()[-1] == "0"
        names = await second.python("print([n for n in dir() if not n.startswith('__')])", timeout_s=10)
        assert names.output.strip() == "[]"
        await second.close()
        await assert_eventually(lambda: pools.stats()[0].warm == 1)
        (stats,) = pools.stats()
        assert stats.reused == 2 and stats.retired == 0 and stats.busy == 0
    finally:
        await pools.close()


async def test_a_sandbox_whose_reset_fails_is_retired(provider: FakeSandboxProvider) -> None:
    pools = await allocator(provider)
    try:
        first = await pools.acquire(SPEC)
        with pytest.raises(SandboxError):  # the job kills the runtime: no reset can run
            await first.bash("kill -9 $PPID; sleep 5", timeout_s=3)
        await first.close()
        await assert_eventually(lambda: pools.stats()[0].retired == 1 and provider.busy == 0)  # removed
        second = await pools.acquire(SPEC)
        assert second.id != first.id and second.jobs_served == 0
        await second.close()
    finally:
        await pools.close()


async def test_the_pool_grows_with_the_load_up_to_its_bound_and_shrinks_when_idle(
    provider: FakeSandboxProvider,
) -> None:
    pools = await allocator(provider, max_idle=2, idle_s=5.0)
    try:
        held = await asyncio.gather(*(pools.acquire(SPEC) for _ in range(3)))
        assert len(provider.created) == 3
        for sandbox in held:
            await sandbox.close()
        # The third found no room and was removed.
        await assert_eventually(lambda: pools.stats()[0].resetting == 0 and provider.busy == 2)
        assert pools.stats()[0].warm == 2
        again = await asyncio.gather(*(pools.acquire(SPEC) for _ in range(2)))
        assert {sandbox.id for sandbox in again} <= {sandbox.id for sandbox in held}
        assert len(provider.created) == 3  # no container was started for them
        for sandbox in again:
            await sandbox.close()
        await assert_eventually(lambda: provider.busy == 0, timeout_s=120, message="idle sandboxes were never removed")
    finally:
        await pools.close()


async def test_a_container_serves_at_most_max_jobs(provider: FakeSandboxProvider) -> None:
    pools = await allocator(provider, max_jobs=2)
    try:
        ids = []
        for _ in range(3):
            sandbox = await pools.acquire(SPEC)
            ids.append(sandbox.id)
            await sandbox.close()
        assert ids[0] == ids[1] != ids[2]
    finally:
        await pools.close()


async def test_without_reuse_a_sandbox_is_removed_after_its_job(provider: FakeSandboxProvider) -> None:
    pools = SandboxAllocator(provider, [])
    pools.start()
    try:
        first = await pools.acquire(SPEC)
        await first.close()
        assert provider.busy == 0
        second = await pools.acquire(SPEC)
        assert second.id != first.id
        await second.close()
    finally:
        await pools.close()


async def test_the_reset_refuses_outside_a_sandbox_and_a_subreaper() -> None:
    """kill(-1) on a host would reach every process of the uid: the op refuses there."""
    import sys

    from prorl_server.sandbox.runtime import RUNTIME_DIR

    code = (  # the package as a sandbox imports it, from the folder the entry scripts are in
        "import sys\n"
        f"sys.path.insert(0, {str(RUNTIME_DIR)!r})\n"
        "from prorl_sandbox_runtime.reset import reset_runtime\n"
        "from prorl_sandbox_runtime.server import Runtime\n"
        "runtime = Runtime(sys.argv[1])\n"
        "try:\n"
        "    reset_runtime(runtime, {'paths': []})\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n"
    )
    with tempfile.TemporaryDirectory() as scratch:  # the sessions' scratch folders go there
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, scratch,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "TMPDIR": scratch},
        )  # fmt: skip
        stdout, stderr = await process.communicate()
    assert stdout.decode().startswith("refused: reset runs only in a sandbox"), stderr.decode()


async def test_through_a_live_server_jobs_one_after_another_share_a_sandbox_and_see_nothing_of_each_other() -> None:
    """A real ProrlServer on a real port and the real client, with reuse on: each math job's
    first turn counts what the job before it left in the workdir, then leaves a file of its
    own. Each Rollout stream must end (a job whose sandbox goes back to the pool ends within
    microseconds of its last event: the event log's followers must not miss that end)."""

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("bash", {"command": "ls -A | wc -l; echo x > left; echo $$"}))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    provider = FakeSandboxProvider(instance_id=instance_id("reuse"))
    settings = server_settings(sandbox={"reuse": {"enabled": True}})
    server = ProrlServer(settings, sandbox_provider=provider, backends=[ScriptedChatBackend(script)])
    await server.start()
    client = Client.connect(server.address)
    try:
        for index in range(3):
            events = [event async for event in client.rollout(math_request("What is 6 * 7?", job_id=f"r{index}"))]
            assert events[-1].finished.result.reward == 1.0
            (output,) = [event.tool_result.output for event in events if event.HasField("tool_result")][:1]
            assert output.split()[0] == "0", output  # nothing of the job before
        assert len(provider.created) == 1  # one sandbox served all three
        stats = await client.get_stats()
        assert stats.sandboxes_busy == 0
        await assert_eventually(lambda: server._sandboxes is not None and server._sandboxes.stats()[0].reused == 3)
    finally:
        await client.close()
        await server.stop()
    assert provider.busy == 0
