"""More sandboxes at once than the kernel's per-user key quota: no keyring per container.

runc gives each container a new session keyring unless told not to, and each one is
charged to the sandbox user's uid (kernel.keys.maxkeys, 200 by default; maxbytes,
20,000). Past the quota, container starts fail with "unable to create session key:
disk quota exceeded", which a job reports as an infrastructure failure. The host
set-up turns keyrings off (containers.conf `keyring = false`).
"""

from __future__ import annotations

import asyncio
import pwd
from pathlib import Path

import pytest

from prorl_server.sandbox.base import Sandbox
from prorl_server.sandbox.podman import PodmanProvider
from tests.conftest import SANDBOX_USER, instance_id, podman_options, server_containers, small_spec

pytestmark = pytest.mark.podman


def key_usage(uid: int) -> tuple[int, int, int, int]:
    """(keys, max keys, bytes, max bytes) charged to `uid`, from /proc/key-users."""
    for line in Path("/proc/key-users").read_text().splitlines():
        owner, rest = line.split(":", 1)
        if int(owner) == uid:
            fields = rest.split()
            keys, max_keys = fields[2].split("/")
            used, max_bytes = fields[3].split("/")
            return int(keys), int(max_keys), int(used), int(max_bytes)
    return (
        0,
        int(Path("/proc/sys/kernel/keys/maxkeys").read_text()),
        0,
        int(Path("/proc/sys/kernel/keys/maxbytes").read_text()),
    )


async def test_live_sandboxes_take_no_key_each(provider: PodmanProvider) -> None:
    uid = pwd.getpwnam(SANDBOX_USER).pw_uid
    before = key_usage(uid)[0]
    sandboxes = await asyncio.gather(*(provider.create(small_spec()) for _ in range(12)))
    try:
        answers = await asyncio.gather(*(s.bash("echo up", timeout_s=60) for s in sandboxes))
        assert [a.output for a in answers] == ["up\n"] * len(sandboxes)
        # Each container would hold a session keyring (one key or more) while it lives.
        assert key_usage(uid)[0] - before < len(sandboxes)
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes))


@pytest.mark.slow
async def test_more_sandboxes_at_once_than_the_key_quota(podman_url: str) -> None:
    uid = pwd.getpwnam(SANDBOX_USER).pw_uid
    _, max_keys, _, _ = key_usage(uid)
    count = max_keys + 10
    instance = instance_id("keys")
    provider = PodmanProvider(url_factory=lambda: podman_url, options=podman_options(instance, threads=16))
    await provider.start()
    sandboxes: list[Sandbox] = []
    try:
        started = await asyncio.gather(
            *(provider.create(small_spec(memory_mib=64, pids_limit=16)) for _ in range(count)),
            return_exceptions=True,
        )
        sandboxes = [s for s in started if isinstance(s, Sandbox)]
        failures = [repr(s) for s in started if not isinstance(s, Sandbox)]
        assert not failures, f"{len(failures)} of {count} sandboxes failed to start: {failures[:3]}"
        answers = await asyncio.gather(*(s.bash("echo up", timeout_s=120) for s in sandboxes))
        assert [a.output for a in answers] == ["up\n"] * count
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes), return_exceptions=True)
        await provider.close()
    assert not server_containers(podman_url, instance)
