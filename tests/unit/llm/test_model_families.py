"""Exact tokens for the model families RL teams train: a matrix over real chat templates.

For each family (tests/unit/llm/model_families.py: the model's real Hugging Face
template and its tokenizer settings), six scripted replies in the model's
own format, the awkward ones included (no reasoning block, a malformed call,
a reply cut by max_tokens inside its reasoning, a trailing newline), go
through the real tool loop on a token backend. The trajectory must be the
last prompt followed by the last sample, every prompt must extend the one
before with what was sampled, the loss mask must be 1 exactly on sampled ids,
no end-of-turn or BOS token may be doubled, and the first prompt must be
transformers' own `apply_chat_template` token for token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from prorl_server.agents.base import Limits, RolloutContext
from prorl_server.agents.loop import run_tool_loop
from prorl_server.agents.outcomes import ToolOutput
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.agents.tools import FinishTool, Tool, ToolContext
from prorl_server.llm.base import BackendInfo, Generation, Sampling, TokenBackend
from prorl_server.llm.chat_template import ChatTokenizer
from prorl_server.llm.hf_tokenizer import HFTokenizer
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from prorl_server.llm.tool_calls import format_hint
from tests.unit.llm.model_families import FAMILIES, TEMPLATES, Family


class EchoTool(Tool):
    name = "echo"
    description = "Repeat the text."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "The text to repeat."}},
        "required": ["text"],
    }

    async def run(self, ctx: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        return ToolOutput(f"echo: {arguments['text']}")


class ScriptedTokenBackend(TokenBackend):
    """Samples the family's scripted replies, tokenized with the model's tokenizer."""

    def __init__(self, tokenizer: ChatTokenizer, family: Family) -> None:
        self.info = BackendInfo(id="scripted", kind="vllm", base_url="", model="", tool_call_parser=family.parser)
        self._tokenizer = tokenizer
        self._script = family.script()
        self.prompts: list[list[int]] = []
        self.samples: list[list[int]] = []

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
        text, stopped = self._script[len(self.prompts)]
        ids = self._tokenizer.encode(text)
        self.prompts.append(list(prompt_ids))
        self.samples.append(ids)
        finish = "stop" if stopped else "length"
        return Generation(tuple(ids), tuple([-0.5] * len(ids)), finish, len(prompt_ids), 0.001)

    async def check_health(self) -> bool:
        return True

    async def close(self) -> None:
        return None


SYSTEM = "You are a careful agent. Use the tools."
USER = "What is 2 + 2? Echo 'hi' first, then call finish."


async def run_family(family: Family, folder: Path) -> tuple[ScriptedTokenBackend, LLMSession, TrajectoryRecorder]:
    tokenizer = HFTokenizer(family.write_tokenizer(folder))
    backend = ScriptedTokenBackend(tokenizer, family)
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend)
    session = LLMSession("job", pool)
    recorder = TrajectoryRecorder(lambda event: None)

    async def no_sandbox() -> Any:
        raise AssertionError("no sandbox in this test")

    ctx = RolloutContext(
        job_id="job",
        instance={},
        limits=Limits(max_turns=6, tool_timeout_s=5),
        sampling=Sampling(max_tokens=64, temperature=1.0, chat_template_kwargs=dict(family.template_kwargs)),
        chat=session.chat,
        sandbox_factory=no_sandbox,
        recorder=recorder,
    )
    outcome = await run_tool_loop(ctx, system_prompt=SYSTEM, user_prompt=USER, tools=[EchoTool(), FinishTool()])
    assert outcome.stop_reason == "finish"
    await pool.close()
    return backend, session, recorder


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
async def test_six_turns_keep_exact_tokens(family: Family, tmp_path: Path) -> None:
    backend, session, recorder = await run_family(family, tmp_path / "tok")
    tokenizer = backend.tokenizer
    prompts, samples = backend.prompts, backend.samples
    token_ids, loss_mask, logprobs = session.token_trajectory()

    assert len(prompts) == 6
    assert token_ids == prompts[-1] + samples[-1]
    for turn in range(1, len(prompts)):
        before = prompts[turn - 1] + samples[turn - 1]
        assert prompts[turn][: len(before)] == before, f"turn {turn} rewrote history"
        assert len(prompts[turn]) > len(before)
    sampled_positions = [i for i, bit in enumerate(loss_mask) if bit]
    expected_positions: list[int] = []
    for prompt, sample in zip(prompts, samples, strict=True):
        expected_positions += list(range(len(prompt), len(prompt) + len(sample)))
    assert sampled_positions == expected_positions
    assert [lp for lp, bit in zip(logprobs, loss_mask, strict=True) if bit] == [-0.5] * len(expected_positions)
    assert session.turn_spans() == [(len(p), len(p) + len(s)) for p, s in zip(prompts, samples, strict=True)]

    # No end-of-turn token twice in a row: a sampled stop is never followed by the template's own.
    ends = set(tokenizer.stop_ids) | {tokenizer.encode(t)[0] for t in ("<|end|>",) if len(tokenizer.encode(t)) == 1}
    # A stop token that is also a role tag (GLM's <|observation|>, <|user|>) may be followed by another
    # message's tag, never by itself.
    for prompt, sample in zip(prompts[:-1], samples[:-1], strict=True):
        if sample and sample[-1] in ends:
            following = token_ids[len(prompt) + len(sample)]
            pair = tokenizer.decode([sample[-1], following])
            assert following != sample[-1], f"{pair!r} doubles the end of turn"
            tag = tokenizer.decode([following]) in family.role_stops
            assert following not in ends or tag, f"{pair!r} doubles the end of turn"
    bos = family.model.get("bos_token")
    if bos and "bos_token" in (TEMPLATES / family.file).read_text():  # the template writes the BOS: once
        bos_id = tokenizer.encode(bos)[0]
        assert token_ids.count(bos_id) == 1 and token_ids[0] == bos_id

    # Every observation reached the model, in the role the template renders.
    text = tokenizer.decode(token_ids)
    assert "echo: hi" in text and "echo: again" in text
    roles = [m["role"] for m in recorder.messages]
    assert ("tool" in roles) == family.tool_role
    # no call, malformed call, truncated reply: three format errors, counted
    assert recorder.format_errors == 3

    # Each later message is in the trajectory as its template writes it (a role tag dropped, or a
    # tool result sent as a user turn where the template has its own markers, fails here).
    last_reply = max(i for i, m in enumerate(recorder.messages) if m["role"] == "assistant")
    later = recorder.messages[2:last_reply]  # what the model was shown after the first prompt
    for message in later:
        content = str(message.get("content") or "")
        wrap = {"tool": family.tool_wrap, "user": family.user_wrap}.get(str(message["role"]), "")
        if wrap:
            assert wrap.format(content.strip()) in text, f"{message['role']} message not as the template writes it"
    assert not family.tool_wrap or any(m["role"] == "tool" for m in later)
    for written_once in family.once:
        assert text.count(written_once) == 1, f"{written_once!r} repeated"
    # The format errors teach the family's own layout.
    hint = format_hint(family.parser)
    assert family.hint_mark in hint
    assert any(hint in str(m.get("content")) for m in later)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_first_prompt_is_transformers_own(family: Family, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")  # a test-only dependency (dev extra)
    folder = family.write_tokenizer(tmp_path / "tok")
    ours = HFTokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    tools = [EchoTool().schema(), FinishTool().schema()]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    if family.name == "gemma3":  # Gemma folds the system prompt into the first user turn itself
        messages = messages[1:]
    from prorl_server.llm.token_conversation import TokenConversation

    conversation = TokenConversation(ours, tools, template_kwargs=family.template_kwargs)
    expected = theirs.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, **family.template_kwargs
    )
    expected_ids = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert conversation.prompt(messages) == list(expected_ids)


def test_tojson_keeps_order_and_text_like_transformers(tmp_path: Path) -> None:
    family = next(f for f in FAMILIES if f.name == "qwen2.5")
    ours = HFTokenizer(family.write_tokenizer(tmp_path / "tok"))
    tool = {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run <code> & 'quote' café",
            "parameters": {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}}},
        },
    }
    text = ours.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=[tool])
    assert json.dumps(tool, ensure_ascii=False) in text
    assert "&#34;" not in text and "\\u00e9" not in text
