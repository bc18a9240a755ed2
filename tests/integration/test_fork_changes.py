"""ForkJob of a SWE job on real rootless Podman: the repository is carried as its changes over
the image's files (a stat listing taken before the first turn), and the fork's repository, a
fresh container of the same image restored from them, lists the same entries, types, modes,
link targets and sha256 as the parent's at the branch point; what the parent deleted (a tracked
file, a whole folder, an untracked file the image holds) stays deleted; a file the policy put
under .git is not carried; the stored snapshot holds the changed entries only."""

from __future__ import annotations

import io
import tarfile
from typing import Any

import pytest

from prorl_client import v1
from prorl_server.agents.swe import DEFAULT_REPO_DIR
from prorl_server.datasets.swe import TASKS_DIR, load_task
from prorl_server.sandbox import snapshot
from tests.conftest import TEST_STATE_DIR, job_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index

pytestmark = pytest.mark.podman

TASK = load_task(TASKS_DIR / "r1chardj0n3s__parse-1.20.2")
REPO = TASK.get("repo_dir", DEFAULT_REPO_DIR)
# Turn 0 changes the repository in every way (the files picked from git's own list, the same in
# every container of the image), moves the shell and exports a variable.
SETUP = (
    f"cd {REPO} && top=$(git ls-files | grep -v / | LC_ALL=C sort) && f=$(echo \"$top\" | grep '[.]py$' | head -1) "
    '&& g=$(echo "$top" | grep -vx "$f" | head -1) && h=$(echo "$top" | grep -vx "$f" | tail -1) '
    "&& d=$(git ls-files '*/*' | grep -v '^tests/' | LC_ALL=C sort | head -1 | cut -d/ -f1) "
    '&& [ -n "$f" ] && [ -n "$d" ] && [ "$g" != "$h" ] '
    '&& printf \'\\n# changed\\n\' >> "$f" && rm -- "$g" && chmod 0700 "$h" && rm -rf -- "$d" '
    "&& mkdir -p added/deep && head -c 200000 /dev/urandom > added/deep/blob.bin && chmod 0640 added/deep/blob.bin "
    '&& ln -s "$f" rel-link && ln -s /etc/hostname abs-link && mkdir -p __pycache__ && printf pyc > __pycache__/x.pyc '
    "&& printf hidden > .git/agent-file && echo \"$g $d\" > /tmp/gone.txt && cd added/deep && export FORK_VAR='a b'"
)
MANIFEST = (
    f'echo "cwd=$PWD var=$FORK_VAR gone=$(cat /tmp/gone.txt)"; cd {REPO} && '
    "find . -path ./.git -prune -o -printf '%p %y %m %l\\n' | LC_ALL=C sort; "
    "find . -path ./.git -prune -o -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; "
    "echo agent-file: $(ls -A .git | grep -c agent-file)"
)


def policy(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Parent and fork alike: 0 changes, 1 the manifest, then finish."""
    commands = [SETUP, MANIFEST]
    turn = turn_index(messages)
    if turn < len(commands):
        return ScriptedReply(tool_call_text("bash", {"command": commands[turn]}))
    return ScriptedReply(tool_call_text("finish", {}))


def outputs(events: list[v1.RolloutEvent]) -> list[str]:
    return [event.tool_result.output for event in events if event.HasField("tool_result")]


async def test_a_swe_fork_restores_the_repository_from_its_changes(scripted_llm, start_server, podman_url) -> None:
    llm = await scripted_llm(policy)
    server, client = await start_server(llm.base_url, sandbox={"tmp_mib": 256})
    request = v1.RolloutRequest(job_id="pod-swe-parent", handler="swe", forkable=True)
    request.instance.update({key: value for key, value in TASK.items() if key != "patch"})
    request.limits.max_turns = 6
    parent_events = [event async for event in client.rollout(request)]
    parent = parent_events[-1].finished.result
    assert parent.status == v1.JOB_STATUS_SUCCEEDED, parent.failure
    assert outputs(parent_events)[0] == "", outputs(parent_events)[0]  # every step of the setup ran
    at_turn_0 = outputs(parent_events)[1]
    head, _, listing = at_turn_0.partition("\n")
    assert head.startswith(f"cwd={REPO}/added/deep var=a b gone=") and "agent-file: 1" in at_turn_0
    gone_file, gone_dir = head.split("gone=")[1].split()
    assert "./added/deep/blob.bin f 640 \n" in listing and "./abs-link l 777 /etc/hostname\n" in listing
    assert f"./{gone_file} " not in listing and f"./{gone_dir} " not in listing

    # What the server kept after turn 0: the changed entries and the deletions, not the repository.
    folder = TEST_STATE_DIR / "forks" / server.settings.server.instance_id
    (kept,) = sorted(folder.rglob("0.tar"))
    with tarfile.open(fileobj=io.BytesIO(kept.read_bytes())) as tar:
        names = {m.name for m in tar.getmembers() if m.name.startswith("repo/") and not m.isdir()}
        listed = tar.extractfile(snapshot.DELETED)
        assert listed is not None
        deleted = set(listed.read().decode().split("\0"))
    assert {"repo/added/deep/blob.bin", "repo/rel-link", "repo/abs-link", "repo/__pycache__/x.pyc"} <= names
    assert len(names) == 6  # and the two changed tracked files (contents, a mode)
    assert deleted == {f"repo/{gone_file}", f"repo/{gone_dir}"}

    await client.fork_job("pod-swe-parent", 0, [v1.ForkBranch(job_id="pod-swe-fork")])
    fork_events = [event async for event in client.watch("pod-swe-fork")]
    fork = fork_events[-1].finished.result
    assert fork.status == v1.JOB_STATUS_SUCCEEDED, fork.failure
    # The fork's first own turn is the manifest: the parent's, but for the file under .git.
    assert outputs(fork_events)[0] == at_turn_0.replace("agent-file: 1", "agent-file: 0")
    assert fork.details["patch"] == parent.details["patch"]
    for job_id in ("pod-swe-parent", "pod-swe-fork"):
        assert not job_containers(podman_url, job_id)
