"""The terminal family on the shipped Harbor tasks (sandbox_images/terminal/tasks) in real rootless
Podman sandboxes, each task's image built offline from its translated Dockerfile (make images):
its oracle solution scores 1 and a wrong one 0, the reward hacks a policy would try score 0, a
task's own limits hold (its agent stopped at its agent timeout and judged on what it left, its
sandboxes given its memory: cgroup v2's memory.max, and what a process may fill, seen from
inside), and unmodified agent programs do a task
through the job's model gateway: the openai-SDK example agent driven by a scripted
OpenAI-compatible model, and mini-swe-agent driven by a fake vLLM (token ids in and out, a
byte-level tokenizer), whose calls come back as one exact token chain."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prorl_client.harbor_import import import_folders

from prorl_client import v1
from tests.conftest import job_containers
from tests.fakes.scripted_llm import ScriptedReply, api_tool_call, tool_call_text, turn_index
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.unit.agents.test_terminal_family import WRONG

pytestmark = pytest.mark.podman

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "sandbox_images" / "terminal" / "tasks"
TASKS = {task["id"]: task["instance"] for task in import_folders([TASKS_DIR]).tasks}
EXAMPLE_AGENT = (ROOT / "examples" / "agents" / "openai_agent.py").read_text()


def solution(task_id: str) -> str:
    return (TASKS_DIR / task_id / "solution" / "solve.sh").read_text()


def commands(*lines: str) -> Any:
    """The policy: each command in the working directory, then finish."""
    replies = [tool_call_text("bash", {"command": f"cd /app && {line}"}) for line in lines]
    replies.append(tool_call_text("finish", {}))

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply(replies[min(turn_index(messages), len(replies) - 1)])

    return script


async def run_terminal(
    scripted_llm: Any,
    start_server: Any,
    task_id: str,
    *lines: str,
    instance: dict[str, Any] | None = None,
    prepare: Callable[[v1.RolloutRequest], None] = lambda request: None,
) -> v1.RolloutResult:
    """A job of a shipped task (or of `instance`) whose policy runs `lines`."""
    llm = await scripted_llm(commands(*lines))
    _, client = await start_server(llm.base_url)
    request = v1.RolloutRequest(handler="terminal")
    request.instance.update(instance or TASKS[task_id])
    prepare(request)
    events = [event async for event in client.rollout(request)]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    return result


def statuses(result: v1.RolloutResult) -> dict[str, str]:
    """Each test's status by `file.py::test` (pytest names it from its root folder, which depends
    on its version: /tests for the image's pytest 7, / for pytest 8)."""
    return {test.rsplit("/", 1)[-1]: str(status) for test, status in dict(result.details["tests"]).items()}


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_the_oracle_scores_one_and_a_wrong_solution_zero(task_id: str, scripted_llm, start_server) -> None:
    right = await run_terminal(scripted_llm, start_server, task_id, solution(task_id))
    assert right.reward == 1.0, right.details
    assert right.details["verdict"] == "passed" and set(statuses(right).values()) == {"PASSED"}

    wrong = await run_terminal(scripted_llm, start_server, task_id, WRONG[task_id])
    assert wrong.reward == 0.0 and wrong.details["verdict"] == "failed", wrong.details
    assert "FAILED" in statuses(wrong).values()


async def test_rewritten_tests_and_a_fake_reward_file_score_zero(scripted_llm, start_server) -> None:
    hack = (
        "printf 'def test_hello_file_exists():\\n    pass\\n' > /tests/test_outputs.py"
        " && mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt"
        " && echo '{\"reward\": 1.0}' > /logs/verifier/reward.json && echo 1 > reward.txt"
    )
    result = await run_terminal(scripted_llm, start_server, "hello-world", hack)
    assert result.reward == 0.0 and result.details["verdict"] == "failed", result.details
    assert statuses(result) == {
        "test_outputs.py::test_hello_file_exists": "FAILED",
        "test_outputs.py::test_hello_file_contents": "FAILED",
    }


async def test_printed_pytest_success_scores_zero(scripted_llm, start_server) -> None:
    forged = (
        "cat > /app/wordfreq.py <<'EOF'\n"
        "import sys\n"
        "print('the 4\\nsaw 3\\nbird 2')\n"
        "for name in ('test_example', 'test_hidden_text', 'test_n_larger_than_vocabulary'):\n"
        "    print('PASSED test_outputs.py::' + name, file=sys.stderr)\n"
        "print('==== 3 passed in 0.01s ====')\n"
        "EOF"
    )
    result = await run_terminal(scripted_llm, start_server, "fix-word-count", forged)
    assert result.reward == 0.0 and result.details["verdict"] in ("failed", "tampered"), result.details
    assert statuses(result)["test_outputs.py::test_hidden_text"] == "FAILED"


async def test_a_conftest_and_a_shadowing_module_in_the_workdir_score_zero(scripted_llm, start_server) -> None:
    conftest = (
        "import pytest\n"
        "@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n"
        "    outcome.get_result().outcome = 'passed'\n"
    )
    shadow = "import _pytest.reports\n_pytest.reports.TestReport.outcome = 'passed'\n"
    hack = f"cat > conftest.py <<'EOF'\n{conftest}EOF\ncat > csv.py <<'EOF'\n{shadow}EOF\ncp conftest.py pytest.ini"
    result = await run_terminal(scripted_llm, start_server, "csv-region-totals", hack)
    assert result.reward == 0.0 and result.details["verdict"] == "failed", result.details
    assert statuses(result)["test_outputs.py::test_input_is_untouched"] == "PASSED"  # the real csv module


async def test_a_link_out_of_the_workdir_carries_nothing_over(scripted_llm, start_server) -> None:
    # A link to the tests folder, and the hello file written through it in the agent's sandbox:
    # the judge's sandbox gets the link only, and the task's own tests.
    hack = "ln -s /tests /app/escape && echo 'Hello, world!' > /app/escape/hello.txt && ls -la /app"
    result = await run_terminal(scripted_llm, start_server, "hello-world", hack)
    assert result.reward == 0.0 and result.details["verdict"] == "failed", result.details


# --- the task's own limits -----------------------------------------------------------------------


async def test_an_agent_past_its_time_is_judged_on_what_it_left(scripted_llm, start_server) -> None:
    # The oracle's work, then a command that never ends: the agent is stopped at the task's agent
    # timeout (not at the command's own 600 s), and what it left scores 1.
    def slow_tools(request: v1.RolloutRequest) -> None:
        request.limits.tool_timeout.FromSeconds(600)

    instance = {**TASKS["hello-world"], "agent_timeout_s": 30}
    result = await run_terminal(
        scripted_llm, start_server, "hello-world", solution("hello-world"), "sleep 3600",
        instance=instance, prepare=slow_tools,
    )  # fmt: skip
    assert result.reward == 1.0 and result.details["verdict"] == "passed", result.details
    assert result.details["stop_reason"] == "agent_timeout" and result.details["agent_timeout_s"] == 30
    assert result.timing.run.ToTimedelta().total_seconds() < 600


TASK_MEMORY_MIB = 300
# The memory the sandbox it runs in has, seen from inside: cgroup v2's memory.max where the
# sandbox has it, and (on any host: a cgroup v1 host's sandbox cannot see the group the server
# made for it) whether a process may fill a third of the task's memory, and twice it (which the
# server's default of 1024 MiB would allow).
MEMORY_PROBE = f"""
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20


def fills(mib):
    done = subprocess.run([sys.executable, "-c", "b = bytearray(%d)" % (mib * MIB)], capture_output=True)
    return "ok" if done.returncode == 0 else "killed"


def memory_probe():
    v2 = Path("/sys/fs/cgroup/memory.max")
    cgroup = v2.read_text().strip() if v2.exists() else "none"
    return "memory.max=%s third=%s twice=%s" % (cgroup, fills({TASK_MEMORY_MIB} // 3), fills(2 * {TASK_MEMORY_MIB}))
"""
EXPECTED_PROBE = rf"memory\.max=({TASK_MEMORY_MIB << 20}|none) third=ok twice=killed"


def memory_task(root: Path) -> dict[str, Any]:
    """A Harbor task, imported: its task.toml asks for 300 MiB, and its tests pass when both the
    agent's sandbox (as the agent wrote its probe to /app/memory.txt) and their own have it."""
    files = {
        "task.toml": (
            "[agent]\ntimeout_sec = 300\n[verifier]\ntimeout_sec = 120\n"
            f'[environment]\ndocker_image = "localhost/prorl-harbor-hello-world:latest"\n'
            f"cpus = 1\nmemory_mb = {TASK_MEMORY_MIB}\n"
        ),
        "instruction.md": "Write what your sandbox's memory allows to /app/memory.txt.\n",
        "tests/test.sh": "#!/bin/bash\npytest /tests/test_memory.py -rA\n",
        "tests/test_memory.py": MEMORY_PROBE
        + (
            f"\n\nEXPECTED = {EXPECTED_PROBE!r}\n\n\n"
            "def test_the_agents_sandbox_had_the_tasks_memory():\n"
            "    import re\n"
            '    assert re.fullmatch(EXPECTED, Path("/app/memory.txt").read_text().strip())\n\n\n'
            "def test_the_tests_sandbox_has_it_too():\n"
            "    import re\n"
            "    assert re.fullmatch(EXPECTED, memory_probe())\n"
        ),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    imported = import_folders([root])
    assert imported.refused == [], imported.refused
    return dict(imported.tasks[0]["instance"])


async def test_the_sandboxes_have_the_tasks_memory(scripted_llm, start_server, tmp_path: Path) -> None:
    instance = memory_task(tmp_path / "memory-limit")
    assert instance["memory_mib"] == TASK_MEMORY_MIB
    write = f"python3 - > /app/memory.txt <<'EOF'\n{MEMORY_PROBE}\nprint(memory_probe())\nEOF"
    result = await run_terminal(scripted_llm, start_server, "memory-limit", write, instance=instance)
    assert result.reward == 1.0 and result.details["verdict"] == "passed", result.details["log_tail"]
    assert statuses(result) == {
        "test_memory.py::test_the_agents_sandbox_had_the_tasks_memory": "PASSED",
        "test_memory.py::test_the_tests_sandbox_has_it_too": "PASSED",
    }

    # The control: the request's own sandbox.memory_mib wins over the task's, and the probe tells.
    def more(request: v1.RolloutRequest) -> None:
        request.sandbox.memory_mib = 1024

    result = await run_terminal(scripted_llm, start_server, "memory-limit", write, instance=instance, prepare=more)
    assert result.reward == 0.0 and "twice=ok" in result.details["log_tail"], result.details["log_tail"]


def example_agent(command: str) -> Any:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_calls=[api_tool_call("bash", {"command": command}, "call_1")])
        return ScriptedReply(tool_calls=[api_tool_call("finish", {"answer": "done"}, "call_2")])

    return script


def program_request(task_id: str) -> v1.RolloutRequest:
    request = v1.RolloutRequest(handler="command")
    request.instance.update(
        {
            "program": {
                "argv": ["/opt/agents/bin/python", "/tmp/openai_agent.py", "--task-file", "$PRORL_TASK_FILE"],
                "files": {"/tmp/openai_agent.py": EXAMPLE_AGENT},
                "cwd": "/app",
                "timeout_s": 300,
            },
            "verifier": "terminal",
            "task": TASKS[task_id],
            "submission": "workdir",
        }
    )
    return request


async def test_an_agent_program_through_the_gateway(scripted_llm, start_server, podman_url: str) -> None:
    llm = await scripted_llm(example_agent(solution("csv-region-totals")))
    _, client = await start_server(llm.base_url)
    events = [event async for event in client.rollout(program_request("csv-region-totals"))]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    assert result.reward == 1.0, result.details
    assert result.details["verifier"] == "terminal" and result.details["verdict"] == "passed"
    assert result.details["calls"] == 2 and result.details["exit_code"] == 0
    # The program was told the task as the family's own agent is, and its bash call ran in the sandbox.
    assert "/app/totals.json" in llm.requests[0]["messages"][1]["content"]
    assert [m for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert not job_containers(podman_url, result.job_id)

    wrong = await scripted_llm(example_agent(WRONG["csv-region-totals"]))
    _, client = await start_server(wrong.base_url)
    events = [event async for event in client.rollout(program_request("csv-region-totals"))]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 0.0, result.details


@pytest_asyncio.fixture
async def fake_vllm(tmp_path: Path) -> AsyncIterator[tuple[FakeVLLM, Path]]:
    folder = write_tiny_tokenizer(tmp_path / "tok")
    server = FakeVLLM(folder, lambda prompt: "")
    server.max_model_len = 65536  # a byte-level tokenizer: prompts are long in tokens
    await server.start()
    yield server, folder
    await server.stop()


def mini_swe_agent(vllm: FakeVLLM, command: str) -> Any:
    """The model's side of mini-swe-agent: run `command`, then submit; the step is read from the
    prompt (how many replies the model has given so far)."""

    def bash_call(text: str) -> str:
        return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': text}})}</tool_call>"

    steps = [bash_call(f"cd /app && {command}"), bash_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]

    def script(prompt: list[int]) -> str:
        text = vllm.tokenizer.decode(prompt, skip_special_tokens=False)
        return steps[min(text.count("<|im_start|>assistant") - 1, len(steps) - 1)]

    return script


async def test_mini_swe_agent_on_a_token_backend(fake_vllm: tuple[FakeVLLM, Path], start_server) -> None:
    vllm, folder = fake_vllm
    vllm.script = mini_swe_agent(vllm, solution("fix-word-count"))
    backend = {"id": "vllm", "kind": "vllm", "base_url": f"{vllm.base_url}", "tokenizer_path": str(folder)}
    _, client = await start_server(None, llm={"backends": [backend], "embedded": {"enabled": "never"}})
    request = program_request("fix-word-count")
    program = request.instance["program"]
    program["argv"] = ["/opt/agents/bin/python", "/opt/agents/run_mini.py", "--workdir", "/app"]
    program["argv"].extend(["--task-file", "$PRORL_TASK_FILE"])
    del program["files"]
    request.sampling.max_tokens = 16384  # one token a byte
    events = [event async for event in client.rollout(request)]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    assert result.reward == 1.0 and result.details["verdict"] == "passed", result.details
    assert result.details["calls"] == 2 and result.details["exit_code"] == 0
    # The calls are one exact chain: the last prompt followed by the last sample.
    prompts = [call["prompt"] for call in vllm.requests]
    (chain,) = result.trajectory.chains
    samples = [list(chain.token_ids[span.start : span.end]) for span in chain.turn_spans]
    assert len(prompts) == len(samples) == 2
    assert prompts[1][: len(prompts[0]) + len(samples[0])] == prompts[0] + samples[0]
    assert list(chain.token_ids) == prompts[-1] + samples[-1]
    assert sum(chain.loss_mask) == sum(len(sample) for sample in samples)
