"""Who is blamed for a failed sandbox call (sandbox/blame.py), and how much
tool output and detail a job keeps (agents/recorder.py, agents/base.py)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from prorl_server.agents.outcomes import MAX_DETAILS_BYTES, EvalOutcome, FailureInfo, ToolOutput
from prorl_server.agents.recorder import SPENT_RESULT_BYTES, TOOL_OUTPUT_BUDGET_BYTES, TrajectoryRecorder
from prorl_server.errors import SandboxBroken, SandboxLimitExceeded
from prorl_server.llm.tool_calls import ParsedCall
from prorl_server.sandbox.blame import Evidence, HostView, RuntimeState, Symptom, blame, process_ref, process_status

LOST = Symptom("closed")
TIMEOUT = Symptom("timeout")


@pytest.mark.parametrize(
    ("symptom", "evidence", "reason"),
    [
        (LOST, Evidence(runtime=RuntimeState.DEAD), "runtime_killed"),
        (TIMEOUT, Evidence(runtime=RuntimeState.STOPPED), "runtime_stopped"),
        (LOST, Evidence(runtime=RuntimeState.RUNNING), "runtime_socket_closed"),
        (LOST, Evidence(limits_hit=["memory"], runtime=RuntimeState.CONTAINER_GONE), "memory_limit"),
        (TIMEOUT, Evidence(limits_hit=["memory", "pids"], runtime=RuntimeState.RUNNING), "pids_limit"),
        (Symptom("refused", errno.EAGAIN), Evidence(limits_hit=["pids"]), "pids_limit"),
        (Symptom("refused", errno.ENOSPC), Evidence(full_filesystems=["/tmp"]), "disk_full"),
        (Symptom("refused", errno.ENOSPC), Evidence(full_filesystems=["/"]), "disk_full"),
    ],
)
def test_what_only_the_agent_could_have_done_is_policy(symptom: Symptom, evidence: Evidence, reason: str) -> None:
    error = blame("bash", symptom, evidence)
    assert isinstance(error, SandboxBroken) and error.reason == reason
    assert isinstance(error, SandboxLimitExceeded) == reason.endswith("_limit")


@pytest.mark.parametrize(
    ("symptom", "evidence"),
    [
        (LOST, Evidence(runtime=RuntimeState.CONTAINER_GONE)),  # stopped or killed from outside
        (LOST, Evidence(runtime=RuntimeState.UNKNOWN)),  # nothing seen: no blame
        (TIMEOUT, Evidence(runtime=RuntimeState.RUNNING)),  # alive, just not answering
        (Symptom("refused", errno.ENOENT), Evidence(limits_hit=["pids"])),  # unrelated to the limit
        (Symptom("refused", errno.ENOSPC), Evidence()),  # the host's disk, not the sandbox's own writes
        (Symptom("refused", None), Evidence()),
    ],
)
def test_what_the_agent_could_not_have_caused_is_not_blamed_on_it(symptom: Symptom, evidence: Evidence) -> None:
    assert blame("bash", symptom, evidence) is None


def test_process_states_come_from_the_hosts_proc() -> None:
    me = process_ref(os.getpid())
    assert me is not None and process_status(me) == "alive"
    assert process_status(type(me)(me.pid, me.start_time + 1)) == "gone"  # a reused pid is not ours
    parent = process_ref(os.getppid())
    assert parent is not None
    view = HostView(init=parent, runtime=me)
    assert view.runtime_state() is RuntimeState.RUNNING
    assert HostView.find(os.getpid(), "no such command line") is None


def call(index: int) -> ParsedCall:
    return ParsedCall(f"c{index}", "bash", {}, "{}", from_api=False)


def test_a_jobs_tool_output_is_bounded_however_much_its_tools_print() -> None:
    events: list[ToolOutput] = []
    recorder = TrajectoryRecorder(lambda event: events.append(event.output))  # type: ignore[union-attr]
    kept = [recorder.tool_result(0, call(i), ToolOutput("é" * 40_000 + f"end {i}")) for i in range(60)]

    assert [k.output for k in kept] == [e.output for e in events]  # the model sees what is recorded
    sizes = [len(k.output.encode()) for k in kept]
    assert sizes[0] == 80_005 and not kept[0].truncated  # whole while the budget lasts
    assert sum(sizes) <= TOOL_OUTPUT_BUDGET_BYTES + 60 * (SPENT_RESULT_BYTES + 200)
    assert all(k.truncated for k in kept[20:]) and "end 59\n" in kept[-1].output  # the tail is kept
    assert "tool output budget" in kept[-1].output and max(sizes[20:]) < SPENT_RESULT_BYTES + 200
    small = recorder.tool_result(1, call(99), ToolOutput("ok"))
    assert small.output == "ok" and not small.truncated


def test_details_and_failure_messages_are_bounded() -> None:
    outcome = EvalOutcome(0.0, {"patch": "x" * 3_000_000, "tests": [{"output": "y" * 500}] * 20_000, "n": 1})
    assert len(json.dumps(outcome.details).encode()) <= MAX_DETAILS_BYTES + 1024
    assert outcome.details["n"] == 1 and "truncated" in outcome.details["patch"]
    assert str(outcome.details["tests"]).startswith("[omitted")
    assert EvalOutcome(1.0, {"verdict": "pass"}).details == {"verdict": "pass"}
    assert len(FailureInfo(True, "x", "m" * 1_000_000).message) < 5000
