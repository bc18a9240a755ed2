"""ForkJob on a real server (real gRPC, real in-sandbox runtime on the fake provider, the fake
vLLM's token API): forks of a running and of a finished job, forks of forks, exact token
prefixes and loss masks, the sandbox's files, directory and environment at the turn, the
parent undisturbed, and every refusal with its status.

The scripted policy (a fake, named so) reads its prompt: the number of assistant turns in it
is the turn it answers, and the request's seed says which branch it is (none: the parent)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from examples.fork_tree.tree import advantages, sample_tree
from prorl_client import Client, RpcError, v1
from prorl_server.app import ProrlServer
from prorl_server.cluster.jobs import ClusterJobs
from prorl_server.errors import FailedPrecondition
from prorl_server.testing.scripted_llm import tool_call_text
from tests.conftest import TEST_STATE_DIR, instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.helpers import math_request, server_settings

PARENT_TURNS = [
    # turn 0: files in a subdirectory, the shell moves there and exports a variable
    "mkdir -p sub && printf 'zero\\n' > sub/a.txt && printf 'keep' > gone.txt && cd sub && export STAGE=zero",
    # turn 1: another file, one deleted, the variable changed
    "printf 'one\\n' > b.txt && rm ../gone.txt && export STAGE=one",
    # turn 2: waits for the test's gate file (a running parent), then writes what no fork after 1 may see
    "while [ ! -e GATE ]; do sleep 0.02; done; printf 'two\\n' > c.txt && export STAGE=two",
]
PROBE = (
    'printf "cwd=%s stage=%s\\n" "$(basename "$PWD")" "$STAGE"; ls -A1 ..; ls -A1; '
    'for f in *; do if [ -L "$f" ]; then echo "link $f -> $(readlink "$f")"; elif [ -f "$f" ]; then cat "$f"; fi; done'
)
BIG = "head -c 200000 /dev/zero > big.bin"


class Policy:
    """The scripted policy: the parent runs PARENT_TURNS then finishes; a branch (seed set)
    probes its sandbox on its first own turn, writes `seed<N>.txt` on its second, then finishes."""

    def __init__(self) -> None:
        self.fake: FakeVLLM | None = None
        self.gate = ""
        self.turns = list(PARENT_TURNS)

    def __call__(self, prompt: list[int]) -> str:
        assert self.fake is not None
        text = self.fake.tokenizer.decode(prompt, skip_special_tokens=False)
        turn = text.count("<|im_start|>assistant") - 1
        body = self.fake.requests[-1]
        seed = body.get("seed")
        if seed is None:
            if turn < len(self.turns):
                return tool_call_text("bash", {"command": self.turns[turn].replace("GATE", self.gate)})
            return tool_call_text("finish", {"answer": "42"})
        own = [m.start() for m in re.finditer(re.escape(f"seed{seed}-own"), text)]
        if not own:
            return f"seed{seed}-own " + tool_call_text("bash", {"command": PROBE})
        if len(own) == 1:
            return f"seed{seed}-own " + tool_call_text("bash", {"command": f"printf '{seed}' > seed{seed}.txt"})
        return tool_call_text("finish", {"answer": "41" if seed in (1, 3) else "42"})  # seeds 1, 3: wrong


class Served:
    def __init__(self, folder: Path, server: dict[str, Any] | None = None, **jobs: Any) -> None:
        self.server_settings = server or {}
        self.policy = Policy()
        self.tokenizer = write_tiny_tokenizer(folder / "tok")
        self.fake = FakeVLLM(self.tokenizer, self.policy)
        self.fake.max_model_len = 1 << 20
        self.policy.fake = self.fake
        self.policy.gate = str(folder / "gate")
        self.gate = folder / "gate"
        self.provider = FakeSandboxProvider(instance_id=instance_id("fake"))
        self.jobs = jobs

    async def start(self) -> None:
        await self.fake.start()
        backend = {
            "id": "vllm",
            "kind": "vllm",
            "base_url": self.fake.base_url,
            "tokenizer_path": str(self.tokenizer),
        }
        settings = server_settings(
            server=self.server_settings,
            jobs=self.jobs,
            sandbox={"state_dir": str(TEST_STATE_DIR)},
            llm={"backends": [backend]},
        )
        self.server = ProrlServer(settings, sandbox_provider=self.provider)
        await self.server.start()
        tokens = self.server_settings.get("auth_tokens") or [""]
        self.client = Client.connect(self.server.address, token=tokens[0] or None)

    async def stop(self) -> None:
        self.gate.touch()
        await self.client.close()
        await self.server.stop()
        await self.fake.stop()
        assert self.provider.busy == 0
        # The snapshots are gone with the server (the index that makes them usable lived in its memory).
        assert not (TEST_STATE_DIR / "forks" / self.server.settings.server.instance_id).exists()

    def parent(self, job_id: str, *, forkable: bool = True) -> v1.RolloutRequest:
        request = math_request("Work in the sandbox.", "42", job_id=job_id, max_turns=8, forkable=forkable)
        request.limits.tool_timeout.FromSeconds(600)
        return request

    async def result(self, job_id: str) -> v1.RolloutResult:
        events = [event async for event in self.client.watch(job_id)]
        return events[-1].finished.result

    async def events(self, job_id: str) -> list[v1.RolloutEvent]:
        return [event async for event in self.client.watch(job_id)]


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    served = Served(tmp_path)
    await served.start()
    yield served
    await served.stop()


def branch(job_id: str, seed: int, **fields: Any) -> v1.ForkBranch:
    return v1.ForkBranch(job_id=job_id, sampling=v1.SamplingParams(seed=seed, max_tokens=4096), **fields)


def tool_outputs(events: list[v1.RolloutEvent]) -> list[str]:
    return [event.tool_result.output for event in events if event.HasField("tool_result")]


def assert_exact_prefix(parent: v1.RolloutResult, fork: v1.RolloutResult, turn: int, *, trained: bool) -> None:
    """The fork's token chain starts with the parent's up to the end of `turn`'s sampled ids."""
    origin = fork.fork_origin
    end = parent.trajectory.turn_spans[turn].end
    assert origin.prefix_tokens == end > 0
    p, f = parent.trajectory, fork.trajectory
    assert list(f.token_ids[:end]) == list(p.token_ids[:end])
    assert list(f.logprobs[:end]) == list(p.logprobs[:end])
    assert list(f.turn_spans[: turn + 1]) == list(p.turn_spans[: turn + 1])
    assert list(f.turn_policy_versions[: turn + 1]) == list(p.turn_policy_versions[: turn + 1])
    if trained:
        assert list(f.loss_mask[:end]) == list(p.loss_mask[:end])
    else:
        assert set(f.loss_mask[:end]) == {0}
    # What the fork sampled itself, and only that, is in its mask beyond the prefix.
    own = [i for span in f.turn_spans[turn + 1 :] for i in range(span.start, span.end)]
    assert own and [i for i in range(end, len(f.loss_mask)) if f.loss_mask[i]] == own
    assert len(f.token_ids) == len(f.loss_mask) == len(f.logprobs)


async def test_fork_a_running_job_and_a_fork_of_it(served: Served) -> None:
    client = served.client
    await client.submit(served.parent("p"))
    async for event in client.watch("p"):  # turn 2's model turn: the boundary after turn 1 is kept
        if event.HasField("model_turn") and event.model_turn.turn == 2:
            break
    with pytest.raises(RpcError) as early:  # a turn the running parent has not finished yet
        await client.fork_job("p", 2, [branch("early", 1)])
    assert early.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert "has not finished turn 2 yet" in early.value.details

    response = await client.fork_job("p", 1, [branch("f1", 7), branch("f2", 8, train_prefix=True)])
    assert [job.job_id for job in response.jobs] == ["f1", "f2"] and list(response.created) == [True, True]

    f1, f2 = await served.result("f1"), await served.result("f2")
    assert (await client.get_job("p")).status == v1.JOB_STATUS_RUNNING  # the parent goes on, held at its gate
    served.gate.touch()
    parent = await served.result("p")

    assert parent.status == v1.JOB_STATUS_SUCCEEDED and parent.trajectory.num_turns == 4
    assert not parent.HasField("fork_origin")
    for fork, trained in ((f1, False), (f2, True)):
        assert fork.status == v1.JOB_STATUS_SUCCEEDED and fork.reward == 1.0
        assert (fork.fork_origin.parent_job_id, fork.fork_origin.parent_turn) == ("p", 1)
        assert fork.fork_origin.root_job_id == "p" and fork.fork_origin.train_prefix == trained
        assert_exact_prefix(parent, fork, 1, trained=trained)
        assert list(fork.trajectory.messages[:5]) == list(parent.trajectory.messages[:5])
    events = await served.events("f1")
    assert events[1].HasField("forked") and events[1].forked.origin == f1.fork_origin
    assert any("processes" in item for item in events[1].forked.not_carried)
    probe = tool_outputs(events)[0]
    # The directory, the variable and the files as they were after turn 1: no c.txt, gone.txt gone.
    assert probe.startswith("cwd=sub stage=one\n")
    assert probe.endswith("zero\none\n") and "two" not in probe and "gone.txt" not in probe and "c.txt" not in probe

    # A fork of the fork, after its own turn 2 (it wrote seed7.txt at its turn 3): forks of forks work.
    response = await client.fork_job("f1", 3, [branch("g1", 9)])
    assert response.jobs[0].job_id == "g1"
    g1 = await served.result("g1")
    assert g1.status == v1.JOB_STATUS_SUCCEEDED
    assert (g1.fork_origin.parent_job_id, g1.fork_origin.parent_turn, g1.fork_origin.root_job_id) == ("f1", 3, "p")
    assert_exact_prefix(f1, g1, 3, trained=False)
    assert "7" in tool_outputs(await served.events("g1"))[0]  # seed7.txt, printed by the probe's `cat *.txt`
    # ... and after a turn it inherited from its parent.
    await client.fork_job("f1", 0, [branch("g0", 10)])
    g0 = await served.result("g0")
    assert_exact_prefix(parent, g0, 0, trained=False)
    assert tool_outputs(await served.events("g0"))[0].startswith("cwd=sub stage=zero\n")


async def test_fork_a_finished_job_leaves_it_as_it_was(served: Served) -> None:
    client = served.client
    served.gate.touch()
    await client.submit(served.parent("done"))
    before = await served.result("done")
    before_job = await client.get_job("done")

    response = await client.fork_job("done", 2, [branch("", 11), branch("", 12)])
    ids = [job.job_id for job in response.jobs]
    assert len(set(ids)) == 2 and all(ids)
    results = [await served.result(job_id) for job_id in ids]

    for fork in results:
        assert fork.status == v1.JOB_STATUS_SUCCEEDED
        assert_exact_prefix(before, fork, 2, trained=False)
    probes = [tool_outputs(await served.events(job_id))[0] for job_id in ids]
    assert all(p.startswith("cwd=sub stage=two\n") and "two\n" in p for p in probes)
    assert "seed" not in probes[1]  # branches do not see each other's files
    after_job = await client.get_job("done")
    assert after_job.result == before and after_job.last_seq == before_job.last_seq
    # Idempotent per branch id, like Submit.
    again = await client.fork_job("done", 2, [branch(ids[0], 11)])
    assert list(again.created) == [False] and again.jobs[0].job_id == ids[0]


async def test_refusals_say_what_is_wrong(served: Served) -> None:
    client = served.client
    served.gate.touch()
    await client.submit(served.parent("plain", forkable=False))
    await client.submit(served.parent("tree"))
    await served.result("plain")
    await served.result("tree")

    async def refused(job_id: str, turn: int, branches: list[v1.ForkBranch]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(RpcError) as caught:
            await client.fork_job(job_id, turn, branches)
        return caught.value.code, caught.value.details

    code, message = await refused("nobody", 0, [branch("x1", 1)])
    assert code == grpc.StatusCode.NOT_FOUND and "no job with id 'nobody'" in message
    code, message = await refused("plain", 0, [branch("x2", 1)])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "forkable" in message
    code, message = await refused("tree", 3, [branch("x3", 1)])  # turn 3 called finish: no boundary after it
    assert code == grpc.StatusCode.OUT_OF_RANGE and "0, 1, 2" in message
    code, message = await refused("tree", -1, [branch("x4", 1)])
    assert code == grpc.StatusCode.OUT_OF_RANGE
    code, message = await refused("tree", 0, [])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "branches" in message
    code, message = await refused("tree", 0, [branch("tree", 1)])  # the parent's own id
    assert code == grpc.StatusCode.ALREADY_EXISTS
    bad = branch("x5", 1)
    bad.sampling.temperature = 99
    code, message = await refused("tree", 0, [branch("x6", 1), bad])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in message
    with pytest.raises(RpcError):  # refused as a whole: x6 was not started either
        await client.get_job("x6")

    # The sandbox state lost (its snapshot file gone): refused, with the reason; the other turns still fork.
    manager = served.server.manager
    assert manager is not None
    registry = manager._forks
    assert registry is not None
    archive = registry._sources["tree"].boundaries[1].archive
    assert archive is not None and archive.stat().st_mode & 0o077 == 0  # the server's user only
    archive.unlink()
    code, message = await refused("tree", 1, [branch("x7", 1)])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "lost" in message
    ok = await client.fork_job("tree", 0, [branch("x8", 1)])
    assert (await served.result(ok.jobs[0].job_id)).status == v1.JOB_STATUS_SUCCEEDED


async def test_a_snapshot_over_the_cap_leaves_the_turn_unforkable(tmp_path: Path) -> None:
    served = Served(tmp_path, fork_snapshot_max_bytes=100_000)
    served.policy.turns = ["printf small > s.txt", BIG]
    await served.start()
    try:
        await served.client.submit(served.parent("big"))
        parent = await served.result("big")
        assert parent.status == v1.JOB_STATUS_SUCCEEDED  # a state it cannot keep never fails the job
        with pytest.raises(RpcError) as caught:
            await served.client.fork_job("big", 1, [branch("b1", 1)])
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "over 100000 bytes" in caught.value.details
        await served.client.fork_job("big", 0, [branch("b0", 1)])  # turn 0 was small: kept
        assert (await served.result("b0")).status == v1.JOB_STATUS_SUCCEEDED
    finally:
        await served.stop()


async def test_special_files_and_links_stay_what_the_sandbox_saw(served: Served, tmp_path: Path) -> None:
    """A symbolic link to a host file outside the sandbox is carried as the link (never the file's
    content); a FIFO is left out, and the fork's first event says so."""
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host secret")
    served.policy.turns = [f"ln -s {secret} link && mkfifo pipe && printf 'zero\\n' > a.txt && export STAGE=zero"]
    await served.client.submit(served.parent("links"))
    await served.result("links")
    await served.client.fork_job("links", 0, [branch("l1", 5)])
    assert (await served.result("l1")).status == v1.JOB_STATUS_SUCCEEDED
    events = await served.events("l1")
    assert any("work/pipe" in item for item in events[1].forked.not_carried)
    listing = tool_outputs(events)[0].splitlines()
    assert f"link link -> {secret}" in listing and "pipe" not in listing and "a.txt" in listing
    manager = served.server.manager
    assert manager is not None and manager._forks is not None
    archive = manager._forks._sources["links"].boundaries[0].archive
    assert archive is not None
    data = archive.read_bytes()
    assert b"host secret" not in data and str(secret).encode() in data  # the link, not its target


async def test_a_family_without_turn_boundaries_and_a_cluster_refuse(served: Served) -> None:
    request = v1.RolloutRequest(job_id="prog", handler="command", forkable=True)
    request.instance.update(
        {
            "program": {"argv": ["sh", "-c", "echo 42"]},
            "verifier": "math",
            "task": {"question": "6 * 7?", "answer": "42"},
        }
    )
    await served.client.submit(request)
    with pytest.raises(RpcError) as caught:
        await served.client.fork_job("prog", 0, [branch("prog-b", 1)])
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'command' has no turn boundaries" in caught.value.details
    await served.result("prog")

    cluster = ClusterJobs(
        settings=served.server.settings,
        registry=None,  # type: ignore[arg-type]
        manager=served.server.manager,  # type: ignore[arg-type]
        store=None,  # type: ignore[arg-type]
        notifications=None,  # type: ignore[arg-type]
    )
    with pytest.raises(FailedPrecondition, match="not available on a cluster"):
        await cluster.fork(v1.ForkJobRequest(job_id="prog", after_turn=0, branches=[branch("c", 1)]))


async def test_the_tree_example_credits_each_branch_point(served: Served) -> None:
    """examples/fork_tree: a root forked at its midpoint into 4, advantages per branch point."""
    served.gate.touch()
    request = served.parent("")
    request.sampling.max_tokens = 4096
    tree = await sample_tree(served.client, request, 4)

    assert tree.turn == 1 and tree.root.trajectory.num_turns == 4  # the midpoint of turns 0..3
    assert [b.reward for b in tree.branches] == [1.0, 0.0, 1.0, 0.0]  # seeds 1 and 3 answer wrong
    value = (1.0 + 2.0) / 5
    assert tree.value == pytest.approx(value)
    (root, root_adv), *rest = advantages([tree])
    split = tree.branches[0].fork_origin.prefix_tokens
    mask = list(root.trajectory.loss_mask)
    assert {a for a, m in zip(root_adv[:split], mask[:split], strict=True) if m} == {0.0}  # one tree: V - V
    assert {round(a, 9) for a, m in zip(root_adv[split:], mask[split:], strict=True) if m} == {round(1 - value, 9)}
    for branch, adv in rest:
        own = {round(a, 9) for a, m in zip(adv, branch.trajectory.loss_mask, strict=True) if m}
        assert own == {round(branch.reward - value, 9)} and set(adv[:split]) == {0.0}
    # Two trees: the prefixes are credited against each other.
    tree.root.reward, other = 0.0, type(tree)(tree.root, tree.branches[:1], tree.turn)
    (_, first), *_ = advantages([tree, other])
    assert {round(a, 9) for a, m in zip(first[:split], mask[:split], strict=True) if m} == {
        round(tree.value - (tree.value + other.value) / 2, 9)
    }


async def test_a_full_snapshot_space_drops_the_oldest_finished_jobs_snapshots(served: Served) -> None:
    served.gate.touch()
    await served.client.submit(served.parent("old"))
    await served.result("old")
    manager = served.server.manager
    assert manager is not None and manager._forks is not None
    registry = manager._forks
    registry._max_total = registry.stored_bytes + 1  # room for nothing more
    await served.client.submit(served.parent("new"))
    await served.result("new")

    with pytest.raises(RpcError) as caught:
        await served.client.fork_job("old", 0, [branch("old-b", 1)])
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "dropped to make room" in caught.value.details
    assert not any(b.archive for b in registry._sources["old"].boundaries.values())
    await served.client.fork_job("new", 0, [branch("new-b", 1)])  # the newer job's were kept
    assert (await served.result("new-b")).status == v1.JOB_STATUS_SUCCEEDED


async def test_fork_needs_the_servers_bearer_token(tmp_path: Path) -> None:
    """The server has no tenants (docs/forking.md): what guards a job's state is its token."""
    served = Served(tmp_path, server={"auth_tokens": ["sesame"]})
    await served.start()
    try:
        served.gate.touch()
        await served.client.submit(served.parent("guarded"))
        await served.result("guarded")
        async with Client.connect(served.server.address, token="wrong") as stranger:
            with pytest.raises(RpcError) as caught:
                await stranger.fork_job("guarded", 0, [branch("stolen", 1)])
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(RpcError):
            await served.client.get_job("stolen")
    finally:
        await served.stop()
