"""Chat template rendering as transformers does it, template errors as LLM errors, stop ids,
chat_template_kwargs per backend and per request, and log-prob semantics on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_client import v1
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.api.backend_messages import backend_to_proto, settings_from_proto
from prorl_server.errors import InvalidArgument, LLMError
from prorl_server.jobs import wire
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import ChatResult, Sampling
from prorl_server.llm.factory import backend_info, build_backend
from prorl_server.llm.hf_tokenizer import HFTokenizer
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from prorl_server.llm.token_conversation import TokenConversation
from tests.fakes.token_servers import FakeVLLM
from tests.unit.llm.model_families import FAMILIES, Family


def family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def tokenizer_for(name: str, tmp_path: Path, **kwargs: object) -> HFTokenizer:
    return HFTokenizer(family(name).write_tokenizer(tmp_path / name), template_kwargs=dict(kwargs))


def test_stop_ids_join_the_eos_and_generation_configs_list(tmp_path: Path) -> None:
    tokenizer = tokenizer_for("llama3.1", tmp_path)
    names = sorted(tokenizer.decode([i]) for i in tokenizer.stop_ids)
    assert names == ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    oss = tokenizer_for("gpt-oss", tmp_path)
    assert sorted(oss.decode([i]) for i in oss.stop_ids) == ["<|call|>", "<|endoftext|>", "<|return|>"]
    phi = tokenizer_for("phi4-mini", tmp_path)
    assert "<|end|>" in {phi.decode([i]) for i in phi.stop_ids}


def test_template_errors_are_llm_errors_with_the_templates_reason(tmp_path: Path) -> None:
    gemma = tokenizer_for("gemma3", tmp_path)
    with pytest.raises(LLMError, match="roles must alternate") as raised:
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], add_generation_prompt=True)
    assert raised.value.reason == "llm_template"
    assert not gemma.renders_tool_role
    assert tokenizer_for("qwen3-thinking", tmp_path).renders_tool_role


def test_strftime_now_and_loopcontrols_are_available(tmp_path: Path) -> None:
    text = tokenizer_for("gpt-oss", tmp_path).render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert "Current date: 20" in text
    folder = family("smollm2").write_tokenizer(tmp_path / "loops")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert HFTokenizer(folder).render(two, add_generation_prompt=False) == "a"


def test_chat_template_kwargs_per_backend_and_per_request(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    thinking = tokenizer_for("qwen3-thinking", tmp_path)
    assert thinking.render(messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    quiet = tokenizer_for("qwen3-thinking", tmp_path, enable_thinking=False)
    assert quiet.render(messages, add_generation_prompt=True).endswith("<think>\n\n</think>\n\n")
    again = quiet.render(messages, add_generation_prompt=True, template_kwargs={"enable_thinking": True})
    assert again.endswith("<|im_start|>assistant\n")


def test_a_retried_prompt_is_not_sent_twice(tmp_path: Path) -> None:
    conversation = TokenConversation(tokenizer_for("qwen2.5", tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    first = conversation.prompt(messages)
    assert conversation.prompt(messages) == first  # the same request after a pause aborted it
    assert conversation.token_ids == first


def test_a_template_that_cannot_continue_fails_as_infrastructure(tmp_path: Path) -> None:
    folder = family("smollm2").write_tokenizer(tmp_path / "strict")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages | length > 2 %}{{ raise_exception('only one exchange') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(folder)
    conversation = TokenConversation(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    conversation.prompt(messages)
    conversation.record({"role": "assistant", "content": "yo"}, tokenizer.encode("yo<|im_end|>"), [-1.0, -1.0, -1.0])
    with pytest.raises(LLMError, match="only one exchange") as raised:
        conversation.prompt([*messages, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}])
    assert raised.value.reason == "llm_template"


async def test_model_turns_say_what_their_logprobs_are_and_where_they_sit(tmp_path: Path) -> None:
    folder = family("qwen2.5").write_tokenizer(tmp_path / "tok")
    fake = FakeVLLM(folder, lambda prompt: "hello")
    fake.eos = fake.tokenizer.token_to_id("<|im_end|>")
    await fake.start()
    pool = BackendRouter(health_interval_s=0)
    backend = build_backend(
        BackendSettings(id="v", kind="vllm", base_url=fake.base_url, tokenizer_path=str(folder), logprobs_mode="raw"),
        timeout_s=5,
        max_retries=0,
    )
    pool.add(backend)
    session = LLMSession("job", pool)
    events: list[dict[str, object]] = []
    recorder = TrajectoryRecorder(lambda event: events.append(wire.agent_event(event)))
    messages = [{"role": "user", "content": "hi"}]
    result = await session.chat(messages, [], Sampling(max_tokens=16, temperature=1.0))
    recorder.model_turn(0, result)
    turn = events[0]["model_turn"]
    assert isinstance(turn, v1.ModelTurn)
    assert turn.logprobs_mode == v1.LOGPROBS_MODE_RAW and turn.token_offset == len(fake.requests[0]["prompt"])
    trajectory = wire.trajectory(recorder, session.token_trajectory())
    (span,) = trajectory.turn_spans
    assert trajectory.token_ids[span.start : span.end] == list(result.token_ids)
    assert span.logprobs_mode == v1.LOGPROBS_MODE_RAW
    await pool.close()
    await fake.stop()


def test_add_backend_carries_parser_kwargs_and_logprobs_mode(tmp_path: Path) -> None:
    folder = family("qwen3-thinking").write_tokenizer(tmp_path / "tok")
    message = v1.Backend(
        id="q",
        kind=v1.BACKEND_KIND_VLLM,
        base_url="http://127.0.0.1:1/v1",
        tokenizer_path=str(folder),
        tool_call_parser="hermes",
        logprobs_mode=v1.LOGPROBS_MODE_RAW,
    )
    message.chat_template_kwargs.update({"enable_thinking": False})
    backend = build_backend(settings_from_proto(message), timeout_s=1, max_retries=0)
    assert backend.info.chat_template_kwargs == {"enable_thinking": False}
    assert backend.info.logprobs_mode == "raw" and backend.info.tool_call_parser == "hermes"
    with pytest.raises(InvalidArgument, match=r"backend\.tool_call_parser: .*'hermes'.*got 'nope'"):
        message.tool_call_parser = "nope"
        settings_from_proto(message)

    class Entry:
        healthy, in_flight, requests_total, errors_total, managed = True, 0, 0, 0, False

    entry = Entry()
    entry.backend = backend  # type: ignore[attr-defined]
    shown = backend_to_proto(entry)  # type: ignore[arg-type]
    assert shown.tool_call_parser == "hermes" and shown.logprobs_mode == v1.LOGPROBS_MODE_RAW
    assert dict(shown.chat_template_kwargs) == {"enable_thinking": False}


def test_chat_results_default_to_no_tool_role() -> None:
    assert ChatResult(text="", finish_reason="stop").tool_role is False


def test_backend_settings_take_parser_kwargs_and_logprobs_mode() -> None:
    from prorl_server.config import ConfigError, load_settings

    backend = {
        "id": "q",
        "kind": "vllm",
        "base_url": "http://x/v1",
        "tokenizer_path": "/models/q",
        "tool_call_parser": "kimi_k2",
        "chat_template_kwargs": {"enable_thinking": False},
        "logprobs_mode": "raw",
    }
    settings = load_settings(None, environ={}, overrides={"llm": {"backends": [backend]}})
    (loaded,) = settings.llm.backends
    assert (loaded.tool_call_parser, loaded.chat_template_kwargs, loaded.logprobs_mode) == (
        "kimi_k2",
        {"enable_thinking": False},
        "raw",
    )
    assert backend_info(loaded).tool_call_parser == "kimi_k2"
    with pytest.raises(ConfigError, match="tool_call_parser"):
        load_settings(None, environ={}, overrides={"llm": {"backends": [{**backend, "tool_call_parser": "x"}]}})


def test_a_tokenizer_that_adds_a_bos_gets_exactly_one(tmp_path: Path) -> None:
    """GGUF models may say add_bos_token: the BOS goes in front unless the template wrote it."""

    class AddsBos(HFTokenizer):
        @property
        def bos_ids(self) -> list[int]:
            return self.encode(self.bos_text)

    messages = [{"role": "user", "content": "hi"}]
    gemma = AddsBos(family("gemma3").write_tokenizer(tmp_path / "gemma"))  # the template writes <bos>
    ids = TokenConversation(gemma).prompt(messages)
    assert ids.count(gemma.bos_ids[0]) == 1 and ids[0] == gemma.bos_ids[0]
    kimi = AddsBos(family("kimi-k2").write_tokenizer(tmp_path / "kimi"))  # the template writes none
    ids = TokenConversation(kimi).prompt(messages)
    assert ids[0] == kimi.bos_ids[0] and ids.count(kimi.bos_ids[0]) == 1


def test_a_template_that_does_not_compile_is_a_bad_tokenizer_folder(tmp_path: Path) -> None:
    from prorl_server.errors import InvalidArgument

    folder = family("smollm2").write_tokenizer(tmp_path / "broken")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="does not compile"):
        HFTokenizer(folder)


def test_chat_backends_pass_chat_template_kwargs_only_when_set() -> None:
    from prorl_server.llm.base import BackendInfo
    from prorl_server.llm.openai_chat import OpenAIChatBackend

    info = BackendInfo(id="c", kind="openai_chat", base_url="http://x/v1", model="m")
    backend = OpenAIChatBackend(info, api_key="", timeout_s=1, max_retries=0)
    plain = backend._payload([], [], Sampling(max_tokens=4, temperature=1.0))
    assert "chat_template_kwargs" not in plain
    info.chat_template_kwargs = {"enable_thinking": True, "x": 1}
    payload = backend._payload([], [], Sampling(max_tokens=4, temperature=1.0, chat_template_kwargs={"x": 2}))
    assert payload["chat_template_kwargs"] == {"enable_thinking": True, "x": 2}


def test_the_tool_role_probe_renders_as_a_job_does(tmp_path: Path) -> None:
    """With a tool declared and the arguments in either shape, as a job's renders are."""
    assert tokenizer_for("command-r-plus", tmp_path).renders_tool_role  # declares `tools` unconditionally
    assert tokenizer_for("hermes-2-pro", tmp_path).renders_tool_role  # likewise
    assert tokenizer_for("deepseek-v3.1", tmp_path).renders_tool_role  # joins argument strings
    assert not tokenizer_for("phi3.5-mini", tmp_path).renders_tool_role  # drops the tool role


def test_named_templates_render_tool_use_when_tools_are_given(tmp_path: Path) -> None:
    """As transformers chooses: Command R and Hermes 2 Pro ship `default` and `tool_use`."""
    folder = family("hermes-2-pro").write_tokenizer(tmp_path / "named")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": config["chat_template"]},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(folder)
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "echo", "description": "Echo.", "parameters": {}}}
    assert tokenizer.render(messages, add_generation_prompt=True) == "hi"
    with_tools = tokenizer.render(messages, add_generation_prompt=True, tools=[tool])
    assert "<tools>" in with_tools and with_tools.endswith("<|im_start|>assistant\n")
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert theirs.apply_chat_template(messages, tools=[tool], add_generation_prompt=True, tokenize=False) == with_tools
    assert theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "hi"
