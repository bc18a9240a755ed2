"""What the Podman provider asks Podman for and stages on the host, checked without Podman
(sandbox/podman/container_spec.py, sandbox/podman/staging.py)."""

from __future__ import annotations

from pathlib import Path

from prorl_server.sandbox.base import LABEL_JOB, SandboxSpec
from prorl_server.sandbox.podman import RUNTIME_MOUNT, SECCOMP_PROFILE, SOCKET_MOUNT, PodmanOptions
from prorl_server.sandbox.podman.container_spec import IMAGE_MOUNT, container_kwargs, writable_mounts
from prorl_server.sandbox.podman.staging import RuntimeStaging
from prorl_server.sandbox.runtime import JUDGE_FILE, RUNTIME_FILE


def options(state_dir: Path, *, reusable: bool = False) -> PodmanOptions:
    return PodmanOptions(
        instance_id="unit",
        state_dir=state_dir,
        sandbox_user="prorl",
        container_user="1000:1000",
        workdir="/workspace",
        tmp_mib=64,
        max_output_bytes=1024,
        threads=1,
        runtime_start_timeout_s=5.0,
        cgroup_limits=False,
        reusable=reusable,
    )


SPEC = SandboxSpec(image="img", cpus=1.5, memory_mib=256, pids_limit=64, labels={LABEL_JOB: "j"})


def test_a_runtime_container_is_locked_down_and_starts_the_runtime_as_its_init(tmp_path: Path) -> None:
    staging = RuntimeStaging(tmp_path, "unit", sandbox_user="prorl", container_user="1000:1000")
    kwargs = container_kwargs(
        SPEC, name="c1", labels={LABEL_JOB: "j"}, runtime=True, options=options(tmp_path), staging=staging
    )
    assert kwargs["network_mode"] == "none" and kwargs["cap_drop"] == ["ALL"] and kwargs["no_new_privileges"]
    assert kwargs["mem_limit"] == kwargs["memswap_limit"] == 256 * 1024 * 1024
    assert kwargs["nano_cpus"] == 1_500_000_000 and kwargs["pids_limit"] == 64
    assert kwargs["seccomp_profile_path"] == str(tmp_path / "seccomp.json")
    assert kwargs["init"] is False and kwargs["stop_timeout"] == 0
    assert kwargs["command"][-7:] == [
        f"{RUNTIME_MOUNT}/prorl_runtime.py", "serve", "--init",
        "--socket", f"{SOCKET_MOUNT}/rt.sock", "--workdir", "/workspace",
    ]  # fmt: skip
    mounts = {mount["target"]: mount for mount in kwargs["mounts"]}
    # Without reuse the root is the container's own writable layer; /tmp a tmpfs; no image mount.
    assert "read_only" not in kwargs and "image_volumes" not in kwargs
    assert set(mounts) == {"/tmp", RUNTIME_MOUNT, SOCKET_MOUNT} and mounts["/tmp"]["size"] == "64m"
    assert mounts[RUNTIME_MOUNT]["read_only"] and mounts[RUNTIME_MOUNT]["source"] == str(tmp_path / "runtime")
    assert mounts[SOCKET_MOUNT]["source"] == str(tmp_path / "sockets" / "unit" / "c1")


def test_a_reusable_runtime_container_has_a_read_only_root_and_tmpfs_writable_paths(tmp_path: Path) -> None:
    staging = RuntimeStaging(tmp_path, "unit", sandbox_user="prorl", container_user="1000:1000")
    reusable = options(tmp_path, reusable=True)
    kwargs = container_kwargs(SPEC, name="c1", labels={LABEL_JOB: "j"}, runtime=True, options=reusable, staging=staging)
    mounts = {mount["target"]: mount for mount in kwargs["mounts"]}
    # Read-only root; the writable paths are tmpfs mounts in the API's own form, filled from the image.
    assert kwargs["read_only"] and kwargs["image_volumes"] == [
        {"source": SPEC.image, "destination": IMAGE_MOUNT, "rw": False}
    ]
    assert set(mounts) == {RUNTIME_MOUNT, SOCKET_MOUNT}
    writable = {mount["destination"]: mount["options"] for mount in writable_mounts(SPEC, reusable)}
    assert {"/tmp", "/workspace", "/testbed"} <= set(writable)
    assert "size=64m" in writable["/tmp"] and "mode=1777" in writable["/tmp"] and "exec" in writable["/tmp"]
    assert "U" in writable["/workspace"] and "mode=0755" in writable["/workspace"]
    assert mounts[RUNTIME_MOUNT]["read_only"]


def test_an_exec_container_only_sleeps_and_mounts_nothing_of_the_servers(tmp_path: Path) -> None:
    staging = RuntimeStaging(tmp_path, "unit", sandbox_user="prorl", container_user="1000:1000")
    kwargs = container_kwargs(SPEC, name="c2", labels={}, runtime=False, options=options(tmp_path), staging=staging)
    assert kwargs["command"] == ["sleep", "infinity"] and kwargs["init"] is True
    assert [mount["target"] for mount in kwargs["mounts"]] == ["/tmp"]


def test_staging_copies_the_runtime_harness_and_profile_and_clears_socket_folders(tmp_path: Path) -> None:
    staging = RuntimeStaging(tmp_path, "unit", sandbox_user="prorl", container_user="1000:1000")
    stale = staging.socket_dir("left-over")
    stale.mkdir(parents=True)
    staging.stage()
    assert (staging.runtime_dir / "prorl_runtime.py").read_bytes() == RUNTIME_FILE.read_bytes()
    assert (staging.runtime_dir / "prorl_judge.py").read_bytes() == JUDGE_FILE.read_bytes()
    assert staging.seccomp_profile.read_bytes() == SECCOMP_PROFILE.read_bytes()
    assert (staging.runtime_dir / "prorl_runtime.py").stat().st_mode & 0o777 == 0o644
    codec = Path("prorl_sandbox_runtime", "wire.py")  # the package beside the scripts, mounted with them
    assert (staging.runtime_dir / codec).read_bytes() == (RUNTIME_FILE.parent / codec).read_bytes()
    assert not stale.exists() and staging.sockets_dir.is_dir()
    assert staging.socket_path("c1") == tmp_path / "sockets" / "unit" / "c1" / "rt.sock"
    staging.remove_socket_dirs()
    assert not staging.sockets_dir.exists()
