"""Tool calls in each model family's own format: read when well formed, a format error when not."""

from __future__ import annotations

import pytest

from prorl_server.gateway.common import read_reply
from prorl_server.llm.base import TOOL_CALL_PARSERS, ChatResult
from prorl_server.llm.tool_calls import PARSERS, call_id, format_hint, parse_text, text_without_calls

DS_BEGIN = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"  # noqa: RUF001
DS_END = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"  # noqa: RUF001
DS31_BEGIN = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"  # noqa: RUF001
DS31_SEP = "<｜tool▁sep｜>"  # noqa: RUF001
DS31_CALL_END = "<｜tool▁call▁end｜>"  # noqa: RUF001
DS31_CALLS_END = "<｜tool▁calls▁end｜>"  # noqa: RUF001

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
    "deepseek_v31": (
        DS31_BEGIN
        + "bash"
        + DS31_SEP
        + '{"command": "ls"}'
        + DS31_CALL_END
        + "<｜tool▁call▁begin｜>finish"  # noqa: RUF001
        + DS31_SEP
        + '{"answer": "4"}'
        + DS31_CALL_END
        + DS31_CALLS_END,
        DS31_BEGIN + "bash" + DS31_SEP + '{"command": ' + DS31_CALL_END + DS31_CALLS_END,
    ),
    # GLM-4 writes one call per reply; the second call is the next reply's (see test below).
    "glm45": (
        "<think>List first.</think>\n<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n"
        "</tool_call>\n<tool_call>finish\n<arg_key>answer</arg_key>\n<arg_value>4</arg_value>\n</tool_call>",
        "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls",
    ),
    "cohere": (
        'I will list the files, then answer.\nAction: ```json\n[\n    {\n        "tool_name": "bash",\n'
        '        "parameters": {"command": "ls"}\n    },\n'
        '    {"tool_name": "finish", "parameters": {"answer": "4"}}\n]\n```',
        'Action: ```json\n[{"tool_name": "bash", "parameters": {"command": }]\n```',
    ),
    "granite": (
        '<|tool_call|>[{"name": "bash", "arguments": {"command": "ls"}}, '
        '{"name": "finish", "arguments": {"answer": "4"}}]',
        '<|tool_call|>[{"name": "bash", "arguments": {"command": }]',
    ),
}

ONE_CALL = {  # parsers whose format holds one call per reply
    "glm4": ('bash\n{"command": "ls"}', 'bash\n{"command": '),
}


def test_every_parser_is_named_in_the_llm_layer_and_tested() -> None:
    assert tuple(PARSERS) == TOOL_CALL_PARSERS
    assert set(PARSERS) == set(CASES) | set(ONE_CALL)


@pytest.mark.parametrize("parser", list(ONE_CALL))
def test_one_call_formats(parser: str) -> None:
    good, bad = ONE_CALL[parser]
    (call,) = parse_text(good, parser, id_prefix="t3")
    assert (call.name, call.arguments, call.error, call.id) == ("bash", {"command": "ls"}, None, "t3c000000")
    (broken,) = parse_text(bad, parser)
    assert broken.error and broken.error.endswith(format_hint(parser))
    assert parse_text("The answer is 4.\nNothing to run here {not json}.", parser) == []


def test_each_hint_shows_its_own_layout() -> None:
    """A format error teaches the model its own format, not another family's."""
    marks = {
        "hermes": "<tool_call>",
        "llama3_json": '"parameters"',
        "mistral": "[TOOL_CALLS]",
        "pythonic": "TOOL(",
        "deepseek_v3": "function<｜tool▁sep｜>",  # noqa: RUF001
        "openai": "to=functions.TOOL",
        "kimi_k2": "<|tool_call_begin|>",
        "deepseek_v31": "<｜tool▁call▁begin｜>TOOL<｜tool▁sep｜>{",  # noqa: RUF001
        "glm4": "TOOL\\n{",
        "glm45": "<arg_key>",
        "cohere": '"tool_name"',
        "granite": "<|tool_call|>[",
    }
    assert set(marks) == set(PARSERS)
    for parser, mark in marks.items():
        assert mark in format_hint(parser), (parser, format_hint(parser))
    assert len({format_hint(parser) for parser in PARSERS}) == len(PARSERS)
    assert '"parameters"' not in format_hint("granite")  # Granite's layout, not Llama's


def test_glm45_values_are_strings_unless_the_template_wrote_json() -> None:
    text = (
        "<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n"
        "<arg_key>lines</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
        "<arg_key>n</arg_key>\n<arg_value>4</arg_value>\n</tool_call>"
    )
    (call,) = parse_text(text, "glm45")
    assert call.arguments == {"path": "a.py", "lines": [1, 2], "n": "4"} and call.error is None
    (bad,) = parse_text('<tool_call>{"name": "bash"}</tool_call>', "glm45")
    assert bad.error and "layout" in bad.error


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


def test_granite_reads_phi4_minis_calls_too() -> None:
    calls = parse_text('<|tool_call|>[{"name": "bash", "arguments": {"command": "ls"}}]<|/tool_call|>', "granite")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("bash", {"command": "ls"}, None)]


@pytest.mark.parametrize("parser", [*CASES, *ONE_CALL])
def test_the_text_without_calls_keeps_none_of_them(parser: str) -> None:
    good = CASES[parser][0] if parser in CASES else ONE_CALL[parser][0]
    rest = text_without_calls(good, parser)
    assert parse_text(rest, parser) == [] and "bash" not in rest and "finish" not in rest, rest
    plain = "The answer is 4. Nothing to run here {not json}."
    assert text_without_calls(plain, parser) == plain


PROSE = "Let me look at the files first."


@pytest.mark.parametrize("parser", ["deepseek_v31", "glm45", "cohere", "granite", "glm4"])
def test_a_gateway_program_gets_the_prose_and_the_calls_of_the_newer_formats(parser: str) -> None:
    """Through the gateway's reading of a reply: the program sees the words the model wrote
    and the calls as calls, never the format's markup (GLM-4's one call stands alone)."""
    good = CASES[parser][0] if parser in CASES else ONE_CALL[parser][0]
    for preamble in ("I will list the files, then answer.", "<think>List first.</think>"):
        good = good.removeprefix(preamble).lstrip()
    text = good if parser == "glm4" else f"{PROSE}\n{good}"
    reply = read_reply(ChatResult(text, "stop", tool_call_parser=parser), parse_calls=True, id_prefix="t4")
    names = [call.name for call in reply.calls]
    assert names == (["bash"] if parser == "glm4" else ["bash", "finish"]), reply
    assert reply.content == ("" if parser == "glm4" else PROSE), reply.content
