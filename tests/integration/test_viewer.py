"""`prorl view` and the runner's display: the HTML page, checked as text and in a real browser (headless Chromium)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prorl_client.display import plain_table, summarize, summary_rows
from prorl_client.viewer import render

from tests import chromium
from tests.conftest import ServerFactory
from tests.fakes.scripted_llm import Script, ScriptedLLMServer, ScriptedReply, tool_call_text, user_prompt


def record(task_id: str, *, handler: str = "math", reward: float = 1.0, **fields: Any) -> dict[str, Any]:
    """A result line as `prorl run` writes it: 3 prompt tokens, 2 sampled, 1 tool token, 1 sampled."""
    base: dict[str, Any] = {
        "task_id": task_id,
        "sample": 0,
        "job_id": f"run-{task_id}-0",
        "handler": handler,
        "status": "JOB_STATUS_SUCCEEDED",
        "reward": reward,
        "failure": None,
        "messages": [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "What is <b>6*7</b>? </script>"},
            {"role": "assistant", "content": "<tool_call>", "toolCalls": [{"name": "bash", "argumentsJson": "{}"}]},
            {"role": "tool", "name": "bash", "content": "42\n[exit code 0]"},
            {"role": "assistant", "content": "finish 42"},
        ],
        "token_ids": [11, 12, 13, 101, 102, 14, 103],
        "loss_mask": [0, 0, 0, 1, 1, 0, 1],
        "logprobs": [0.0, 0.0, 0.0, -0.05, -3.5, 0.0, -0.2],
        "turn_policy_versions": [3, 4],
        "num_turns": 2,
        "timing": {"queue": "0.010s", "init": "0.200s", "run": "1.500s", "eval": "0.100s", "cleanup": "0.050s"},
        "details": {"format_errors": 1, "stop_reason": "finish", "failed_tests": ["test_a", "test_b"]},
        "timeline": [
            {"kind": "phase", "name": "queue", "start": 0.0, "end": 0.01},
            {"kind": "phase", "name": "init", "start": 0.01, "end": 0.21},
            {"kind": "phase", "name": "run", "start": 0.21, "end": 1.71},
            {"kind": "model", "name": "turn 0", "start": 0.21, "end": 0.9, "turn": 0, "policy_version": 3},
            {"kind": "tool", "name": "bash", "start": 0.9, "end": 1.0, "turn": 0, "exit_code": 0},
            {"kind": "model", "name": "turn 1", "start": 1.0, "end": 1.7, "turn": 1, "policy_version": 4},
            {"kind": "phase", "name": "eval", "start": 1.71, "end": 1.81},
            {"kind": "phase", "name": "cleanup", "start": 1.81, "end": 1.86},
        ],
    }
    base.update(fields)
    return base


FAILED = record(
    "q2",
    handler="swe",
    reward=0.0,
    status="JOB_STATUS_FAILED",
    failure={"kind": "FAILURE_KIND_POLICY", "phase": "PHASE_RUN", "reason": "max_turns", "message": "4 turns"},
)


def test_page_shows_rollouts_conversation_tokens_and_timing() -> None:
    page = render([record("q1"), FAILED], token_text=lambda ids: [f"<{i}>" for i in ids], source="r.jsonl")

    assert page.count("<tr class='row'") == 2 and page.count("<section class='rollout'") == 2
    assert "data-status='failed' data-family='swe'" in page
    # Text from the trajectory is escaped, so it cannot break the page.
    assert "What is &lt;b&gt;6*7&lt;/b&gt;? &lt;/script&gt;" in page and "</script>" not in page.split("<script>")[0]
    assert "→ <b>bash</b>" in page and "policy v3" in page and "policy v4" in page
    assert "failed_tests" in page and "test_b" in page
    assert "policy: max_turns (in run): 4 turns" in page
    # Tokens: mask 0 grey, mask 1 shaded by log-prob, hover text with id, text and log-prob.
    tokens = re.findall(r"<span class='tok (m[01])' data-id='(\d+)' data-lp='([-\d.]+)'", page)
    assert tokens[:7] == [
        ("m0", "11", "0.0000"), ("m0", "12", "0.0000"), ("m0", "13", "0.0000"), ("m1", "101", "-0.0500"),
        ("m1", "102", "-3.5000"), ("m0", "14", "0.0000"), ("m1", "103", "-0.2000"),
    ]  # fmt: skip
    assert "title='id 102 · &quot;&lt;102&gt;&quot; · log-prob -3.5000'" in page
    assert page.count("<span class='turn-mark'>") == 4  # two turns per rollout
    # The waterfall: phases, model turns and tool calls, each a positioned bar.
    assert len(re.findall(r"class='wf-bar wf-(?:phase|model|tool)", page)) == 16
    assert "http://" not in page and "https://" not in page  # nothing to fetch: opens offline


def test_turn_marks_come_from_the_servers_turn_spans() -> None:
    spans = [
        {"turn": 0, "start": 3, "end": 5, "policy_version": "3", "logprobs_mode": "LOGPROBS_MODE_PROCESSED"},
        {"turn": 1, "start": 6, "end": 7, "policy_version": "4", "logprobs_mode": "LOGPROBS_MODE_RAW"},
    ]
    page = render([record("q1", turn_spans=spans)])
    marks = re.findall(r"<span class='turn-mark'>([^<]*)</span><span class='tok m1' data-id='(\d+)'", page)
    assert marks == [
        ("turn 0 · policy v3 · processed log-probs", "101"), ("turn 1 · policy v4 · raw log-probs", "103"),
    ]  # fmt: skip


def test_token_ids_shown_without_a_tokenizer_and_old_lines_still_render() -> None:
    old = record("q1")
    del old["timeline"], old["handler"]
    page = render([old])
    assert "<span class='tok m1' data-id='101'" in page and ">101 </span>" in page
    assert "pass --tokenizer for text" in page
    assert page.count("class='wf-bar") == 5  # queue, init, run, eval, cleanup from the timing


def test_time_waiting_for_a_model_slot_is_a_bar_of_its_own_and_a_column_of_the_turns() -> None:
    waited = record("q1")
    waited["timeline"].insert(4, {"kind": "wait", "name": "wait 1", "start": 1.0, "end": 1.6, "turn": 1})
    waited["timeline"][5] = {**waited["timeline"][5], "start": 1.6, "end": 1.7}
    page = render([waited])
    bars = re.findall(r"class='wf-bar wf-wait wf-wait' style='left:([\d.]+)%;width:([\d.]+)%' title='([^']*)'", page)
    assert len(bars) == 1 and "waiting for a model slot" in bars[0][2] and "not in the budget" in bars[0][2]
    assert float(bars[0][1]) == pytest.approx(100 * 0.6 / 1.86, abs=0.01)
    cells = re.findall(r"<tr><td>(\d)</td><td>v\d</td><td></td><td></td><td></td><td>([\d.]+s)</td>", page)
    assert cells == [("0", "0.00s"), ("1", "0.60s")]  # the turns table: what each turn waited
    old = record("q1", timing={**record("q1")["timing"], "modelWait": "0.900s"})
    del old["timeline"]
    fallback = render([old])  # a line without a timeline: the total wait, from the result's timing
    assert fallback.count("class='wf-bar wf-wait") == 1 and "model wait" in fallback


def test_summary_per_family() -> None:
    rows = summary_rows(summarize([record("q1"), record("q3", reward=0.0), FAILED]))
    assert rows[0] == ["math", "2", "2", "0.500", "2.0", "2", "2", "finish x2", "-"]
    assert rows[1][:2] == ["swe", "1"] and rows[1][-1] == "policy: max_turns x1"
    assert rows[2][:4] == ["all", "3", "2", "0.333"]
    text = plain_table(rows)
    assert text.splitlines()[0].split() == [
        "family", "rollouts", "ok", "mean", "reward", "mean", "turns", "tool", "calls", "format", "errors",
        "stopped", "by", "failures",
    ]  # fmt: skip


def test_prorl_view_command_filters_by_job(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(record("q1")) + "\n" + json.dumps(FAILED) + "\n" + '{"task_id": "cut')
    out = tmp_path / "one.html"
    completed = subprocess.run(
        [sys.executable, "-m", "prorl_client.runner", "view", str(results), "--job", "run-q2-0", "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert f"1 rollouts: file://{out}" in completed.stderr
    assert out.read_text().count("<section class='rollout'") == 1
    missing = subprocess.run(
        [sys.executable, "-m", "prorl_client.runner", "view", str(results), "--job", "nope", "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 1 and "no rollout of nope" in missing.stderr


def answer_with_a_tool_first(messages: list[dict[str, Any]]) -> ScriptedReply:
    if not any(m["role"] == "tool" or "<tool_response>" in str(m.get("content")) for m in messages):
        return ScriptedReply(tool_call_text("bash", {"command": "echo thinking"}))
    return ScriptedReply(tool_call_text("finish", {"answer": user_prompt(messages).split()[-1].rstrip("?")}))


def test_page_in_headless_chromium(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    page.write_text(render([record("q1"), FAILED, record("q3", handler="code")]))
    dom = chromium.check_page(page, rollouts=3)
    assert "What is &lt;b&gt;6*7&lt;/b&gt;?" in dom  # escaped text stays text
    shot = tmp_path / "page.png"
    chromium.screenshot(page, shot, width=1200, height=800)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


@pytest.mark.podman
async def test_a_run_seen_in_headless_chromium(
    scripted_llm: Callable[[Script], Awaitable[ScriptedLLMServer]], start_server: ServerFactory, tmp_path: Path
) -> None:
    """`prorl run` against a live server, `prorl view` of its results, the page opened in Chromium."""
    llm = await scripted_llm(answer_with_a_tool_first)
    server, _ = await start_server(llm.base_url)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": f"q{n}", "question": f"Repeat {n}", "answer": str(n)}) + "\n" for n in (1, 2))
    )
    out = tmp_path / "results.jsonl"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prorl_client.runner", "run", str(tasks), "--out", str(out), "--server", server.address,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    # Not a terminal: one plain line per rollout, then the summary table.
    lines = stderr.decode().splitlines()
    progress = [line.split(" |")[0] for line in lines if line.startswith("rollouts ")]
    assert progress == ["rollouts 1/2", "rollouts 2/2"]
    assert any(line.split()[:5] == ["math", "2", "2", "1.000", "2.0"] for line in lines), lines
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for rec in records:
        kinds = [span["kind"] + ":" + span["name"] for span in rec["timeline"]]
        assert kinds[:4] == ["phase:queue", "phase:init", "phase:run", "phase:eval"]
        assert {"model:turn 0", "tool:bash", "model:turn 1", "tool:finish"} <= set(kinds)
        assert all(span["start"] <= span["end"] for span in rec["timeline"])

    page = tmp_path / "results.html"
    view = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prorl_client.runner", "view", str(out), stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await view.communicate()
    assert view.returncode == 0, stderr.decode()
    # The scripted model answers with text only: no token ids to show.
    dom = await asyncio.to_thread(chromium.check_page, page, rollouts=2, tokens=False)
    assert "echo thinking" in dom and "no token ids" in dom
