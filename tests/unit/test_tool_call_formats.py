"""Tool calls in each model family's own format: read when well formed, a format error when not."""

from __future__ import annotations

import pytest

from prorl_server.agents.tool_calls import PARSERS, call_id, format_hint, parse_text
from prorl_server.llm.base import TOOL_CALL_PARSERS

DS_BEGIN = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"  # noqa: RUF001
DS_END = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"  # noqa: RUF001

# parser -> (one call to bash {"command": "ls"} and one to finish {"answer": "4"}, written natively; a malformed call)
CASES = {
    "hermes": (
        '<think>\nok\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "finish", "arguments": {"answer": "4"}}\n</tool_call>',
        '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call>',
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}; '
        '{"name": "finish", "parameters": {"answer": "4"}}',
        '{"name": "bash", "parameters": {"command": ',
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}}, '
        '{"name": "finish", "arguments": {"answer": "4"}}]',
        '[TOOL_CALLS] [{"name": "bash", "arguments": {"command": }]',
    ),
    "pythonic": ('[bash(command="ls"), finish(answer="4")]', '[bash(command="ls"]'),
    "deepseek_v3": (
        DS_BEGIN
        + 'bash\n```json\n{"command": "ls"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'  # noqa: RUF001
        + 'finish\n```json\n{"answer": "4"}\n```'
        + DS_END,
        DS_BEGIN + "bash\n{no fence",
    ),
    "openai": (
        "<|channel|>analysis<|message|>List files.<|end|><|start|>assistant<|channel|>commentary to=functions.bash "
        '<|constrain|>json<|message|>{"command": "ls"}<|call|><|start|>assistant to=functions.finish'
        '<|channel|>commentary json<|message|>{"answer": "4"}',
        '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": ',
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
        '{"command": "ls"}<|tool_call_end|><|tool_call_begin|>functions.finish:1<|tool_call_argument_begin|>'
        '{"answer": "4"}<|tool_call_end|><|tool_calls_section_end|>',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0 {oops<|tool_calls_section_end|>",
    ),
}


def test_every_parser_is_named_in_the_llm_layer_and_tested() -> None:
    assert tuple(PARSERS) == TOOL_CALL_PARSERS == tuple(CASES)


@pytest.mark.parametrize("parser", list(CASES))
def test_well_formed_calls_are_read_in_order(parser: str) -> None:
    good, _ = CASES[parser]
    calls = parse_text(good, parser, id_prefix="t3")
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("bash", {"command": "ls"}, None),
        ("finish", {"answer": "4"}, None),
    ]
    assert [c.id for c in calls] == ["t3c000000", "t3c000001"]
    assert all(not c.from_api for c in calls)


@pytest.mark.parametrize("parser", list(CASES))
def test_malformed_calls_are_format_errors_with_a_hint(parser: str) -> None:
    _, bad = CASES[parser]
    calls = parse_text(bad, parser)
    assert len(calls) == 1 and calls[0].error, calls
    assert calls[0].error.endswith(format_hint(parser))


@pytest.mark.parametrize("parser", list(CASES))
def test_plain_text_has_no_calls(parser: str) -> None:
    assert parse_text("The answer is 4. Nothing to run here {not json}.", parser) == []


def test_call_ids_are_nine_alphanumerics_as_mistral_requires() -> None:
    for prefix, index in (("t0", 0), ("t12", 7), ("t123456789", 123)):
        value = call_id(prefix, index)
        assert len(value) >= 9 and value.isalnum()
    assert len(call_id("t99", 99)) == 9
