from __future__ import annotations

from prorl_server.llm.base import ApiToolCall
from prorl_server.llm.tool_calls import from_api, from_text


def test_text_calls_are_read_in_order() -> None:
    text = (
        'Let me compute. <tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
        ' then <tool_call>{"name": "finish", "arguments": {"answer": "1"}}</tool_call>'
    )
    calls = from_text(text, id_prefix="t0")
    assert [(c.id, c.name, c.arguments, c.error) for c in calls] == [
        ("t0c000000", "python", {"code": "print(1)"}, None),
        ("t0c000001", "finish", {"answer": "1"}, None),
    ]


def test_unclosed_block_at_the_end_is_still_a_call() -> None:
    (call,) = from_text('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}')
    assert call.name == "bash" and call.arguments == {"command": "ls"}


def test_arguments_given_as_a_json_string_are_decoded() -> None:
    (call,) = from_text('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>')
    assert call.arguments == {"command": "ls"} and call.error is None


def test_malformed_calls_carry_an_error_that_says_what_to_do() -> None:
    bad_json, no_name, bad_args = from_text(
        '<tool_call>{oops</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "bash", "arguments": [1]}</tool_call>'
    )
    assert bad_json.error is not None and "not valid JSON" in bad_json.error and "<tool_call>" in bad_json.error
    assert no_name.error is not None and '"name"' in no_name.error
    assert bad_args.error is not None and "JSON object" in bad_args.error


def test_text_without_calls_has_none() -> None:
    assert from_text("The answer is 42.") == []


def test_api_calls_decode_their_arguments() -> None:
    good, bad = from_api((ApiToolCall("c1", "bash", '{"command": "ls"}'), ApiToolCall("c2", "python", "{broken")))
    assert good.from_api and good.arguments == {"command": "ls"} and good.error is None
    assert bad.error is not None and "not valid JSON" in bad.error
