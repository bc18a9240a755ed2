"""A repository's snapshot carries its changes only (Root.pristine), on the fake provider (the
real in-sandbox runtime and scripts as local processes; every sandbox gets a fresh copy of
the image's files at the same path, as a SWE image gives each container its own /testbed).

The parent's sandbox changes its repository in every way a policy can (contents, new files
and folders, deletions of tracked, untracked and ignored files and of a whole folder, a mode,
links made and retargeted, a file turned into a folder, a rename, an ignored build output,
a commit and an `update-index --assume-unchanged` that hide changes from git, a file under
.git, one outside the repository); the archive holds those entries and nothing else, and a
fresh sandbox restored from it, and a fork of that fork, list the same entries, modes, link
targets and sha256 as the parent. Then the archives a policy could forge in the new format,
refused by the host and by the unpacking script alike; last, a forkable SWE job through a real
server and ForkJob (the tool loop lists the repository before its first turn), whose stored
snapshot holds its three changed files, and whose fork sees the parent's repository and is
judged resolved on it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.sandbox import snapshot
from prorl_server.sandbox.base import SandboxSpec
from prorl_server.sandbox.sandbox import Sandbox
from prorl_server.sandbox.snapshot import (
    RUNTIME_SCRATCH,
    Root,
    SandboxState,
    SnapshotRefused,
    capture,
    check_archive,
    record_base,
    restore,
)
from prorl_server.testing.scripted_llm import ScriptedLLMServer, ScriptedReply, tool_call_text, turn_index
from tests.conftest import TEST_STATE_DIR, instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.helpers import server_settings
from tests.unit.agents import test_families_fast as families
from tests.unit.agents.test_families_fast import GIT, SWE_IMAGE, calc_repository, swe_instance
from tests.unit.sandbox.test_snapshot_archive import archive

IMAGE = "localhost/prorl-swe-fake__tree-1.0:latest"
UNCHANGED = [f"pkg/mod{i}.py" for i in range(40)]


def tree_repository(workdir: Path) -> None:
    """The fake image: `repo`, a git repository with tracked files, an untracked file and an
    ignored build output the image itself holds (as `pip install -e .` leaves egg-info)."""
    repo = workdir / "repo"
    for folder in ("pkg", "docs/api", "build"):
        (repo / folder).mkdir(parents=True)
    (repo / ".gitignore").write_text("build/\n*.so\n")
    (repo / "a.py").write_text("print('a')\n")
    (repo / "run.sh").write_text("#!/bin/sh\necho run\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "conf").write_text("conf\n")
    for name in UNCHANGED:
        (repo / name).write_text(f"# {name}\n" + "x = 1\n" * 200)
    (repo / "pkg" / "b.py").write_text("b = 2\n")
    (repo / "pkg" / "c.py").write_text("c = 3\n")
    (repo / "docs" / "api" / "index.txt").write_text("docs\n")
    (repo / "link").symlink_to("a.py")
    for command in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "base"]):
        subprocess.run(command, cwd=repo, check=True, env={**os.environ, **GIT})
    (repo / "notes.txt").write_text("untracked in the image\n")
    (repo / "build" / "old.so").write_bytes(b"\x7fELF image build")


# Every kind of change, from the repository's folder; git's own view is fooled twice (a commit
# moves HEAD and the index; assume-unchanged hides a.py's edit from `git status`).
CHANGES = (
    "printf 'print(\"changed\")\\n' > a.py && git update-index --assume-unchanged a.py "
    "&& printf 'new\\n' > new.py && git add new.py && git -c user.name=t -c user.email=t@t commit -qm agent "
    "&& mkdir -p pkg/new/deep && printf 'deep\\n' > pkg/new/deep/d.txt "
    "&& rm pkg/c.py && rm -r docs && rm build/old.so && printf 'built\\n' > ext.so "
    "&& chmod 0600 pkg/b.py && ln -s pkg/b.py newlink && rm link && ln -s run.sh link "
    "&& rm conf && mkdir conf && printf 'in a folder now\\n' > conf/inner && mv notes.txt renamed.txt "
    "&& printf 'hidden\\n' > .git/agent-file && printf 'outside\\n' > ../outside.txt"
)
MANIFEST = (
    "cd repo && find . -path ./.git -prune -o -mindepth 1 -printf '%p %y %m %l\\n' | LC_ALL=C sort; "
    "find . -path ./.git -prune -o -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; "
    "ls -A .git | grep -c agent-file; ls -A .. | grep -c outside.txt"
)
SPEC = SandboxSpec(image=IMAGE, cpus=1.0, memory_mib=256, pids_limit=64)


@pytest_asyncio.fixture
async def provider() -> AsyncIterator[FakeSandboxProvider]:
    provider = FakeSandboxProvider(images={IMAGE: tree_repository}, instance_id=instance_id("snap"), fixed_workdir=True)
    await provider.start()
    yield provider
    await provider.close()
    assert provider.busy == 0


def roots_of(provider: FakeSandboxProvider) -> tuple[Root, ...]:
    repo = Root("repo", str(provider.workdir / "repo"), exclude=(".git",), pristine=True)
    return repo, Root("tmp", exclude=RUNTIME_SCRATCH)


def members(state: SandboxState) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(state.archive)) as tar:
        return {member.name: member for member in tar.getmembers()}


def deletions(state: SandboxState) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(state.archive)) as tar:
        listed = tar.extractfile(snapshot.DELETED)
        assert listed is not None
        return sorted(listed.read().decode().split("\0"))


async def run(sandbox: Sandbox, command: str) -> str:
    result = await sandbox.bash(command, timeout_s=120)
    assert result.exit_code == 0, result.output
    return result.output


async def test_a_repository_snapshot_holds_its_changes_and_restores_byte_for_byte(
    provider: FakeSandboxProvider,
) -> None:
    roots = roots_of(provider)
    parent = await provider.create(SPEC)
    base = await record_base(parent, roots)
    assert base is not None
    await run(parent, f"cd repo && ({CHANGES})")
    await run(parent, f"cd {provider.workdir}/repo/pkg/new")  # the shell's directory, carried beside the files
    state = await capture(parent, roots, max_bytes=1 << 20, base=base)
    expected = await run(parent, f"cd {provider.workdir} && {{ {MANIFEST}; }}")
    assert expected.endswith("1\n1\n")  # the parent has the file under .git and the one outside the repository

    assert state.changed_only == ("repo",)
    found = members(state)
    files = sorted(name for name, m in found.items() if name.startswith("repo/") and not m.isdir())
    assert files == [
        "repo/a.py",  # changed, though `git status` says it is not (assume-unchanged)
        "repo/conf/inner",
        "repo/ext.so",  # ignored by .gitignore, and new: it may matter (a rebuilt extension)
        "repo/link",  # retargeted
        "repo/new.py",  # committed by the agent: HEAD moved, the image's did not
        "repo/newlink",
        "repo/pkg/b.py",  # its mode only
        "repo/pkg/new/deep/d.txt",
        "repo/renamed.txt",
    ]
    assert found["repo/link"].linkname == "run.sh" and found["repo/pkg/b.py"].mode == 0o600
    assert not any(name.startswith("repo/.git") for name in found)
    assert not any(name.startswith(f"repo/{unchanged}") for unchanged in UNCHANGED for name in found)
    # What is gone: the topmost entry of each removed subtree, tracked, untracked or ignored.
    assert deletions(state) == ["repo/build/old.so", "repo/docs", "repo/notes.txt", "repo/pkg/c.py"]
    assert len(state.archive) < 40_000  # the unchanged files (over 40 of them, 1.2 kB each) stay out

    # A fresh sandbox of the image (the same path, the image's files again), restored.
    fork = await provider.create(SPEC)
    fork_base = await record_base(fork, roots)  # before the restore, as a fork's loop takes it
    await restore(fork, roots, state)
    assert await run(fork, "pwd") == f"{provider.workdir}/repo/pkg/new\n"
    got = await run(fork, f"cd {provider.workdir} && {{ {MANIFEST}; }} || true")
    assert got == expected.removesuffix("1\n1\n") + "0\n0\n"  # only .git's and the outside file are not carried
    assert await run(fork, f"cd {provider.workdir}/repo && git rev-list --count HEAD") == "1\n"  # the image's .git

    # A fork of the fork: its own changes are the parent's (the restore wrote them after its base).
    again = await capture(fork, roots, max_bytes=1 << 20, base=fork_base)
    again_files = sorted(n for n, m in members(again).items() if n.startswith("repo/") and not m.isdir())
    assert again_files == files and deletions(again) == deletions(state)
    grandchild = await provider.create(SPEC)
    await record_base(grandchild, roots)
    await restore(grandchild, roots, again)
    got = await run(grandchild, f"cd {provider.workdir} && {{ {MANIFEST}; }} || true")
    assert got == expected.removesuffix("1\n1\n") + "0\n0\n"
    for sandbox in (parent, fork, grandchild):
        await sandbox.close()


async def test_without_its_listing_the_repository_is_kept_whole(provider: FakeSandboxProvider) -> None:
    """The listing lives in the sandbox's scratch: a policy that removes it only costs size."""
    roots = roots_of(provider)
    parent = await provider.create(SPEC)
    base = await record_base(parent, roots)
    assert base is not None
    await run(parent, f"rm -rf {base} && cd repo && rm pkg/c.py && printf 'x\\n' > a.py")
    state = await capture(parent, roots, max_bytes=1 << 20, base=base)
    expected = await run(parent, f"cd {provider.workdir} && {{ {MANIFEST}; }} || true")
    assert state.changed_only == () and f"repo/{UNCHANGED[0]}" in members(state)
    fork = await provider.create(SPEC)
    await record_base(fork, roots)
    await restore(fork, roots, state)
    assert await run(fork, f"cd {provider.workdir} && {{ {MANIFEST}; }} || true") == expected
    for sandbox in (parent, fork):
        await sandbox.close()


# --- archives a policy could forge (one that replaced the sandbox's python3 makes them) ---------

ROOTS = (Root("repo", "/testbed", exclude=(".git",), pristine=True), Root("tmp", exclude=RUNTIME_SCRATCH))


def with_deletions(*names: str, kind: bytes | str = b"") -> bytes:
    return archive(("repo", "dir", b""), (snapshot.DELETED, kind, "\0".join(names).encode()))


FORGED = {
    "a deletion by traversal": with_deletions("repo/../../etc/passwd"),
    "an absolute deletion": with_deletions("/etc/passwd"),
    "a deletion in an unknown root": with_deletions("home/user/.ssh"),
    "a deletion of .git": with_deletions("repo/.git"),
    "a deletion inside .git": with_deletions("repo/.git/config"),
    "a deletion of the root itself": with_deletions("repo"),
    "a deletion in a root kept whole": with_deletions("tmp/x"),
    "a deletion list that is a link": with_deletions("repo/a", kind="sym:/etc/passwd"),
    "a file under .git": archive(("repo/.git/hooks/pre-commit", b"", b"#!/bin/sh\nexit 0\n")),
    "a file in the runtime's scratch": archive(("tmp/prorl-bash-1/rc", b"", b"x")),
    "a file beneath a link of the archive": archive(("repo/l", "sym:/etc", b""), ("repo/l/x", b"", b"pwn")),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_the_host_refuses_a_forged_changes_archive(case: str) -> None:
    with pytest.raises(SnapshotRefused):
        check_archive(FORGED[case], ROOTS, max_bytes=4096, changed_only=("repo",))


def test_the_host_refuses_changes_claimed_for_a_root_that_is_not_the_images() -> None:
    with pytest.raises(SnapshotRefused, match="not the image's"):
        check_archive(archive(("tmp", "dir", b"")), ROOTS, max_bytes=4096, changed_only=("tmp",))


def test_the_host_counts_the_deletion_list_to_the_cap() -> None:
    names = [f"repo/f{i:04d}" for i in range(1000)]
    check_archive(with_deletions(*names), ROOTS, max_bytes=1 << 20, changed_only=("repo",))
    with pytest.raises(SnapshotRefused, match="over the cap"):
        check_archive(with_deletions(*names), ROOTS, max_bytes=4096, changed_only=("repo",))


def restore_in(folder: Path, data: bytes) -> subprocess.CompletedProcess[str]:
    """The fork's unpacking script on a folder of this host: `repo` a root kept as its changes."""
    scratch = folder / "scratch"
    scratch.mkdir()
    (scratch / "files.tar").write_bytes(data)
    args = {
        "archive": str(scratch / "files.tar"),
        "roots": [["repo", str(folder / "repo"), [".git"]], ["tmp", str(folder / "tmp"), list(RUNTIME_SCRATCH)]],
        "changed_only": ["repo"],
    }
    return subprocess.run(
        [sys.executable, "-c", snapshot._RESTORE, json.dumps(args)], capture_output=True, text=True, check=False
    )


def image_like(folder: Path) -> Path:
    """A fork's fresh repository: a file, a .git, and a link out of the repository (images hold such)."""
    (folder / "outside").mkdir()
    (folder / "outside" / "secret").write_text("untouched")
    repo = folder / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "config").write_text("[core]\n")
    (repo / "keep.py").write_text("keep")
    (repo / "out").symlink_to(folder / "outside")
    return repo


@pytest.mark.parametrize("case", sorted(FORGED))
def test_the_unpacking_script_refuses_a_forged_changes_archive(tmp_path: Path, case: str) -> None:
    repo = image_like(tmp_path)
    result = restore_in(tmp_path, FORGED[case])
    assert result.returncode != 0 and "bad member" in result.stderr
    assert (repo / ".git" / "config").read_text() == "[core]\n" and (repo / "keep.py").read_text() == "keep"
    assert (tmp_path / "outside" / "secret").read_text() == "untouched"
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["secret"]


@pytest.mark.parametrize(
    "data",
    [
        archive(("repo/out/secret", b"", b"pwn")),  # through the fresh tree's own link
        with_deletions("repo/out/secret"),
    ],
    ids=["a write", "a deletion"],
)
def test_the_unpacking_script_never_goes_through_a_link_of_the_forks_tree(tmp_path: Path, data: bytes) -> None:
    repo = image_like(tmp_path)
    result = restore_in(tmp_path, data)
    assert result.returncode != 0 and "through a link" in result.stderr
    assert (tmp_path / "outside" / "secret").read_text() == "untouched"
    assert (repo / "out").is_symlink()


def test_the_unpacking_script_applies_changes_over_the_images_files(tmp_path: Path) -> None:
    repo = image_like(tmp_path)
    (repo / "gone.txt").write_text("deleted by the parent")
    (repo / "old").mkdir()
    (repo / "old" / "x").write_text("x")
    (tmp_path / "tmp" / "prorl-bash-1").mkdir(parents=True)  # the runtime's scratch, in a root kept whole
    (tmp_path / "tmp" / "prorl-bash-1" / "rc").write_text("the session's")
    (tmp_path / "tmp" / "stale").write_text("not in the snapshot")
    data = archive(
        ("repo", "dir", b""),
        ("tmp", "dir", b""),
        ("repo/new.txt", b"", b"new"),
        ("repo/old", b"", b"a file now"),
        (snapshot.DELETED, b"", b"repo/gone.txt\0repo/never-there"),
    )
    result = restore_in(tmp_path, data)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in repo.iterdir()) == [".git", "keep.py", "new.txt", "old", "out"]
    assert (repo / "old").read_text() == "a file now" and (repo / "keep.py").read_text() == "keep"
    assert (repo / "out").is_symlink() and (repo / ".git" / "config").exists()
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == ["prorl-bash-1"]  # cleared but for the scratch
    assert (tmp_path / "tmp" / "prorl-bash-1" / "rc").read_text() == "the session's"


# --- ForkJob of a SWE job: the loop lists the repository before its first turn ---------------


submission_file = families.submission_file  # the SWE handler's diff, a host path with the fake


def calc_with_notes(workdir: Path) -> None:
    """The SWE family's fake calc image, with a file the image holds untracked."""
    calc_repository(workdir)
    (workdir / "repo" / "NOTES.txt").write_text("untracked in the image\n")


@pytest.mark.usefixtures("submission_file")
async def test_a_forked_swe_job_restores_the_repository_from_its_changes() -> None:
    provider = FakeSandboxProvider(
        images={SWE_IMAGE: calc_with_notes}, instance_id=instance_id("swefork"), fixed_workdir=True
    )
    instance = {key: value for key, value in swe_instance(provider).items() if key != "patch"}
    repo = instance["repo_dir"]
    turns = [
        # turn 0: the fix, a new file, a deletion, a mode, a link, and a move of the shell
        f"cd {repo} && sed -i '2s/a - b/a + b/' calc.py && printf 'x = 1\\n' > extra.py "
        "&& rm NOTES.txt && chmod 0700 extra.py && ln -s calc.py alias.py && cd tests",
        f"cd {repo} && find . -path ./.git -prune -o -printf '%p %y %m %l\\n' | LC_ALL=C sort "
        "&& find . -path ./.git -prune -o -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum",
    ]

    def policy(messages: list[dict[str, Any]]) -> ScriptedReply:
        turn = turn_index(messages)
        if turn < len(turns):
            return ScriptedReply(tool_call_text("bash", {"command": turns[turn]}))
        return ScriptedReply(tool_call_text("finish", {}))

    llm = ScriptedLLMServer(policy)
    await llm.start()
    settings = server_settings(
        sandbox={"state_dir": str(TEST_STATE_DIR)}, llm={"backends": [{"id": "scripted", "base_url": llm.base_url}]}
    )
    server = ProrlServer(settings, sandbox_provider=provider)
    await server.start()
    client = Client.connect(server.address)
    try:
        request = v1.RolloutRequest(job_id="swe-parent", handler="swe", forkable=True)
        request.instance.update(instance)
        request.limits.max_turns = 6
        events = [event async for event in client.rollout(request)]
        parent = events[-1].finished.result
        assert parent.status == v1.JOB_STATUS_SUCCEEDED and parent.reward == 1.0, (
            parent.failure,
            {k: str(v)[:300] for k, v in parent.details.items()},
        )
        listing = [e.tool_result.output for e in events if e.HasField("tool_result")][1]
        assert "./extra.py f 700 \n" in listing and "./alias.py l 777 calc.py\n" in listing
        assert "NOTES" not in listing

        # The snapshot after turn 0 on disk: the changed entries, not the repository.
        kept = sorted((TEST_STATE_DIR / "forks" / settings.server.instance_id).rglob("0.tar"))
        assert len(kept) == 1
        with tarfile.open(kept[0]) as tar:
            names = {m.name for m in tar.getmembers() if m.name.startswith("repo/") and not m.isdir()}
            listed = tar.extractfile(snapshot.DELETED)
            assert listed is not None and listed.read() == b"repo/NOTES.txt"
        assert names == {"repo/calc.py", "repo/extra.py", "repo/alias.py"}

        await client.fork_job("swe-parent", 0, [v1.ForkBranch(job_id="swe-fork")])
        fork_events = [event async for event in client.watch("swe-fork")]
        fork = fork_events[-1].finished.result
        assert fork.status == v1.JOB_STATUS_SUCCEEDED, fork.failure
        assert next(e.tool_result.output for e in fork_events if e.HasField("tool_result")) == listing
        assert fork.reward == 1.0 and fork.details["patch"] == parent.details["patch"]
    finally:
        await client.close()
        await server.stop()
        await llm.stop()
    assert provider.busy == 0
