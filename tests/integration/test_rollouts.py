"""The rollout lifecycle against a real server, real rootless Podman and a scripted fake LLM."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from prorl_client import RpcError, v1
from tests.conftest import job_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index, user_prompt
from tests.helpers import assert_eventually, kinds, math_request

pytestmark = pytest.mark.podman


def solve_with_python(answer: str) -> Any:
    """Turn 0: compute in the sandbox's python; turn 1: finish with `answer`."""

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("python", {"code": "import os; print(6 * 7, os.getuid())"}))
        return ScriptedReply("I am sure now. " + tool_call_text("finish", {"answer": answer}))

    return script


async def collect(stream: Any) -> list[v1.RolloutEvent]:
    return [event async for event in stream]


async def test_correct_answer_gets_reward_1(scripted_llm, start_server, podman_url) -> None:
    llm = await scripted_llm(solve_with_python("42"))
    _, client = await start_server(llm.base_url)

    events = await collect(client.rollout(math_request("What is 6 * 7?", "42", job_id="right-1")))

    assert kinds(events)[0] == "queued" and kinds(events)[-1] == "finished"
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED
    assert result.reward == 1.0
    tool_results = [e.tool_result for e in events if e.HasField("tool_result")]
    # The python tool really ran in the sandbox, as the unprivileged user (uid 1000).
    assert tool_results[0].name == "python" and tool_results[0].output.startswith("42 1000")
    assert tool_results[0].exit_code == 0
    turns = [e.model_turn for e in events if e.HasField("model_turn")]
    assert len(turns) == 2 == result.trajectory.num_turns
    assert all(t.text and t.latency.ToNanoseconds() > 0 and t.backend_id == "scripted" for t in turns)
    phases = [e.phase_started.phase for e in events if e.HasField("phase_started")]
    assert phases == [v1.PHASE_INIT, v1.PHASE_RUN, v1.PHASE_EVAL]
    roles = [m.role for m in result.trajectory.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    timing = result.timing
    assert timing.run.ToNanoseconds() >= timing.llm.ToNanoseconds() > 0
    assert timing.tools.ToNanoseconds() > 0
    assert not job_containers(podman_url, "right-1")


async def test_wrong_answer_gets_reward_0(scripted_llm, start_server) -> None:
    llm = await scripted_llm(solve_with_python("41"))
    _, client = await start_server(llm.base_url)

    events = await collect(client.rollout(math_request("What is 6 * 7?", "42")))

    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED
    assert result.reward == 0.0
    evaluation = next(e.evaluation for e in events if e.HasField("evaluation"))
    assert evaluation.reward == 0.0 and evaluation.details["verdict"] == "wrong"


async def test_malformed_tool_call_is_a_policy_format_error(scripted_llm, start_server) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply("<tool_call>{not json</tool_call>")
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)

    events = await collect(client.rollout(math_request("What is 6 * 7?", "42")))

    bad = next(e.tool_result for e in events if e.HasField("tool_result"))
    assert bad.error and "not valid JSON" in bad.output
    result = events[-1].finished.result
    assert result.reward == 1.0 and result.details["format_errors"] == 1


async def test_cancel_mid_run_ends_cancelled_and_removes_the_container(scripted_llm, start_server, podman_url) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply(tool_call_text("bash", {"command": "sleep 60"}))

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)
    await client.submit(math_request("Loop forever", job_id="cancel-me"))
    await assert_eventually(lambda: bool(job_containers(podman_url, "cancel-me")), message="no sandbox started")

    async def tool_running() -> bool:
        job = await client.get_job("cancel-me")
        return job.phase == v1.PHASE_RUN and len(llm.requests) >= 1

    await assert_eventually(tool_running)

    job = await client.cancel("cancel-me", reason="test says stop")

    assert job.status == v1.JOB_STATUS_CANCELLED
    assert job.result.failure.reason == "cancelled" and job.result.failure.message == "test says stop"
    assert not job_containers(podman_url, "cancel-me")
    events = await collect(client.watch("cancel-me"))
    assert kinds(events)[-1] == "finished"
    # Cancelling a finished job is a no-op that returns it.
    assert (await client.cancel("cancel-me")).status == v1.JOB_STATUS_CANCELLED


async def test_budget_expiry_ends_timed_out_with_the_partial_trajectory(scripted_llm, start_server, podman_url) -> None:
    llm = await scripted_llm(lambda messages: ScriptedReply(tool_call_text("bash", {"command": "sleep 60"})))
    _, client = await start_server(llm.base_url)

    # 8 s: the init phase (a Podman sandbox's start) has to fit in it on a loaded machine.
    events = await collect(client.rollout(math_request("Sleep", job_id="slow-1", budget_s=8.0)))

    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_TIMED_OUT
    assert result.failure.reason == "budget_exceeded"
    assert result.failure.phase == v1.PHASE_RUN
    assert result.failure.kind == v1.FAILURE_KIND_POLICY
    assert result.trajectory.num_turns == 1
    assistant = [m for m in result.trajectory.messages if m.role == "assistant"]
    assert "sleep 60" in assistant[0].content
    assert "tool_call" in kinds(events)
    budget_used = sum(t.ToNanoseconds() for t in (result.timing.init, result.timing.run, result.timing.eval)) / 1e9
    assert 8.0 <= budget_used < 50.0  # stopped by the budget, not by the 60 s command
    assert not job_containers(podman_url, "slow-1")


async def test_watch_after_disconnect_resumes_exactly_once_in_order(scripted_llm, start_server) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        turn = turn_index(messages)
        if turn < 3:
            return ScriptedReply(tool_call_text("bash", {"command": f"echo step {turn}"}), delay_s=0.2)
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)

    seen: list[v1.RolloutEvent] = []
    stream = client.rollout(math_request("Count", job_id="resume-1"))
    async for event in stream:
        seen.append(event)
        if event.HasField("tool_result"):
            break  # the client drops the stream mid-run
    await stream.aclose()

    rest = await collect(client.watch("resume-1", after_seq=seen[-1].seq))

    everything = seen + rest
    assert [e.seq for e in everything] == list(range(1, len(everything) + 1))
    assert kinds(rest)[-1] == "finished" and "finished" not in kinds(seen)
    assert everything[-1].finished.result.reward == 1.0
    full = await collect(client.watch("resume-1"))
    assert full == everything


async def test_rollout_stream_returns_all_results_in_completion_order(scripted_llm, start_server) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        index = int(user_prompt(messages).split()[-1])
        # Later submissions answer sooner: completion order differs from submission order.
        return ScriptedReply(tool_call_text("finish", {"answer": str(index)}), delay_s=0.5 * (8 - index))

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)
    requests = [math_request(f"task {i}", str(i), job_id=f"stream-{i}") for i in range(8)]

    finished: list[str] = []
    per_job: dict[str, list[int]] = {}
    async for item in client.rollout_many(requests):
        assert isinstance(item, v1.RolloutEvent)
        per_job.setdefault(item.job_id, []).append(item.seq)
        if item.HasField("finished"):
            assert item.finished.result.reward == 1.0
            finished.append(item.job_id)

    assert sorted(finished) == sorted(r.job_id for r in requests)
    end_times = {job_id: (await client.get_job(job_id)).end_time.ToNanoseconds() for job_id in finished}
    assert finished == sorted(finished, key=end_times.__getitem__)  # streamed as they completed
    assert finished != [r.job_id for r in requests]  # not in submission order
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in per_job.values())


async def test_rollout_stream_rejects_a_bad_request_and_goes_on(scripted_llm, start_server) -> None:
    llm = await scripted_llm(lambda messages: ScriptedReply(tool_call_text("finish", {"answer": "1"})))
    _, client = await start_server(llm.base_url)
    bad = math_request("x", job_id="bad-1")
    bad.handler = "chess"
    items = [item async for item in client.rollout_many([bad, math_request("y", "1", job_id="good-1")])]

    rejected = [i for i in items if isinstance(i, v1.RolloutRejected)]
    assert len(rejected) == 1 and rejected[0].job_id == "bad-1"
    assert rejected[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "chess" in rejected[0].message
    finished = [i for i in items if isinstance(i, v1.RolloutEvent) and i.HasField("finished")]
    assert [f.job_id for f in finished] == ["good-1"]


async def test_submit_twice_runs_once(scripted_llm, start_server) -> None:
    llm = await scripted_llm(solve_with_python("42"))
    _, client = await start_server(llm.base_url)
    request = math_request("What is 6 * 7?", "42", job_id="once-1")

    first = await client.submit(request)
    second = await client.submit(request)

    assert first.created and not second.created
    assert first.job.job_id == second.job.job_id == "once-1"
    events = await collect(client.watch("once-1"))
    assert events[-1].finished.result.reward == 1.0
    assert len(llm.requests) == 2  # one run: two model turns
    listed = await client.list_jobs()
    assert [job.job_id for job in listed.jobs] == ["once-1"]
    third = await client.submit(request)
    assert not third.created and third.job.status == v1.JOB_STATUS_SUCCEEDED
    changed = math_request("What is 6 * 8?", "48", job_id="once-1")
    with pytest.raises(RpcError) as error:
        await client.submit(changed)
    assert error.value.code == grpc.StatusCode.ALREADY_EXISTS


async def test_list_jobs_filters_and_pages(scripted_llm, start_server) -> None:
    llm = await scripted_llm(lambda messages: ScriptedReply(tool_call_text("finish", {"answer": "1"})))
    _, client = await start_server(llm.base_url)
    for i in range(5):
        request = math_request(f"q{i}", "1", job_id=f"list-{i}", group_id="g-even" if i % 2 == 0 else "g-odd")
        request.labels["parity"] = "even" if i % 2 == 0 else "odd"
        await client.submit(request)
    for i in range(5):
        await collect(client.watch(f"list-{i}"))

    page1 = await client.list_jobs(page_size=2)
    page2 = await client.list_jobs(page_size=2, page_token=page1.next_page_token)
    page3 = await client.list_jobs(page_size=2, page_token=page2.next_page_token)
    ids = [j.job_id for page in (page1, page2, page3) for j in page.jobs]
    assert ids == [f"list-{i}" for i in range(5)] and page3.next_page_token == ""
    even = await client.list_jobs(labels={"parity": "even"})
    assert [j.job_id for j in even.jobs] == ["list-0", "list-2", "list-4"]
    odd = await client.list_jobs(group_id="g-odd", statuses=[v1.JOB_STATUS_SUCCEEDED])
    assert [j.job_id for j in odd.jobs] == ["list-1", "list-3"]
    none = await client.list_jobs(statuses=[v1.JOB_STATUS_FAILED])
    assert list(none.jobs) == []
    with pytest.raises(RpcError) as error:
        await client.list_jobs(page_token="garbage")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_sandbox_failure_is_an_infrastructure_failure(scripted_llm, start_server) -> None:
    llm = await scripted_llm(lambda messages: ScriptedReply(tool_call_text("finish", {"answer": "1"})))
    _, client = await start_server(llm.base_url, sandbox={"allowed_images": ["localhost/prorl-*"]})
    request = math_request("q", "1")
    request.sandbox.image = "localhost/prorl-no-such-image:latest"  # allowed, but never built

    events = await collect(client.rollout(request))

    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_FAILED
    assert result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE
    assert result.failure.phase == v1.PHASE_INIT
    assert "make images" in result.failure.message


async def test_llm_outage_is_an_infrastructure_failure(scripted_llm, start_server) -> None:
    llm = await scripted_llm(lambda messages: ScriptedReply(status=503))
    _, client = await start_server(llm.base_url)

    events = await collect(client.rollout(math_request("q", "1")))

    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_FAILED
    assert result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE
    assert result.failure.phase == v1.PHASE_RUN
    assert result.failure.reason == "llm_unavailable"
    assert len(llm.requests) == 2  # retried once (llm.max_retries=1), then gave up


async def test_structured_api_tool_calls_are_used(scripted_llm, start_server) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            call = {
                "id": "c1",
                "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": "echo $((6*7))"})},
            }
            return ScriptedReply("", tool_calls=[call], finish_reason="tool_calls")
        assert messages[-1]["role"] == "tool" and messages[-1]["tool_call_id"] == "c1"
        assert messages[-1]["content"].startswith("42")
        call = {
            "id": "c2",
            "type": "function",
            "function": {"name": "finish", "arguments": json.dumps({"answer": "42"})},
        }
        return ScriptedReply("", tool_calls=[call], finish_reason="tool_calls")

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)

    events = await collect(client.rollout(math_request("What is 6 * 7?", "42")))

    result = events[-1].finished.result
    assert result.reward == 1.0
    assistant = [m for m in result.trajectory.messages if m.role == "assistant"]
    assert assistant[0].tool_calls[0].name == "bash"


async def test_finished_jobs_beyond_retention_are_forgotten(scripted_llm, start_server) -> None:
    llm = await scripted_llm(lambda messages: ScriptedReply(tool_call_text("finish", {"answer": "1"})))
    _, client = await start_server(llm.base_url, jobs={"retain_finished": 2})
    for i in range(3):
        _ = [e async for e in client.rollout(math_request("q", "1", job_id=f"keep-{i}"))]

    with pytest.raises(RpcError) as error:
        await client.get_job("keep-0")
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert [(await client.get_job(f"keep-{i}")).status for i in (1, 2)] == [v1.JOB_STATUS_SUCCEEDED] * 2


async def test_cancel_aborts_the_in_flight_llm_request(scripted_llm, start_server) -> None:
    llm = await scripted_llm(lambda messages: ScriptedReply("thinking for a long time", delay_s=60))
    _, client = await start_server(llm.base_url)
    await client.submit(math_request("Think", job_id="slow-llm"))
    await assert_eventually(lambda: llm.in_flight == 1, message="the request never reached the LLM")

    job = await client.cancel("slow-llm")

    assert job.status == v1.JOB_STATUS_CANCELLED
    # The HTTP request was dropped, so the backend stopped working on it.
    await assert_eventually(lambda: llm.in_flight == 0, timeout_s=5, message="the LLM request was not aborted")


async def test_outgrowing_the_context_stops_the_loop_as_a_policy_outcome(scripted_llm, start_server) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("bash", {"command": "echo a long observation"}))
        message = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
        return ScriptedReply(status=400, error_message=message)

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)
    events = [e async for e in client.rollout(math_request("q", "1"))]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED  # evaluated as usual: no answer, reward 0
    assert result.reward == 0.0 and result.details["stop_reason"] == "context_length"
    assert len(llm.requests) == 2  # a 400 is not retried


async def test_timing_breakdown_adds_up_to_the_wall_time(scripted_llm, start_server) -> None:
    """queue + init + run + eval + cleanup = total within 50 ms + 5%; llm, tools and sandbox fit inside."""

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("bash", {"command": "sleep 0.3"}), delay_s=0.2)
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}), delay_s=0.1)

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url, phases={"init": 1})
    requests = [math_request("What is 6 * 7?", "42", job_id=f"t{i}") for i in range(3)]  # they queue for init
    results = [i.finished.result async for i in client.rollout_many(requests) if i.HasField("finished")]

    def seconds(d: Any) -> float:
        return d.ToNanoseconds() / 1e9

    for result in results:
        t = result.timing
        parts = seconds(t.queue) + seconds(t.init) + seconds(t.run) + seconds(t.eval) + seconds(t.cleanup)
        assert abs(seconds(t.total) - parts) <= 0.05 + 0.05 * seconds(t.total), t
        inside = seconds(t.init) + seconds(t.run) + seconds(t.eval)
        assert seconds(t.llm) + seconds(t.tools) + seconds(t.sandbox_acquire) <= inside + 0.01
        assert seconds(t.llm) >= 0.3 and seconds(t.tools) >= 0.3 and seconds(t.sandbox_acquire) > 0
    assert max(seconds(r.timing.queue) for r in results) > 0  # the init limit of 1 made some wait
