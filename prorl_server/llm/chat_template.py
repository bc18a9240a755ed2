"""Chat templates and tokenizers: the model's own, never a hard-coded family.

A `ChatTokenizer` renders messages with the model's chat template (Jinja, as
in Hugging Face's `tokenizer_config.json` or a GGUF file's
`tokenizer.chat_template`) and turns text into ids and back.

Rendering follows Hugging Face transformers' `apply_chat_template` exactly,
because that is what vLLM and SGLang render with and what the models were
trained on: a sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks`
and the `loopcontrols` extension; a `tojson` that keeps key order and text
(`json.dumps(..., ensure_ascii=False)`, not Jinja's own, which sorts keys and
HTML-escapes); `strftime_now`; `raise_exception`; message keys whose value is
None dropped; the special tokens (`bos_token`, `eos_token`, ...) and the
`chat_template_kwargs` (e.g. `enable_thinking`) as template variables.

A template that cannot render (its own `raise_exception`, a syntax error, a
type error on unexpected input) raises `LLMError` with reason
`llm_template`: an infrastructure failure with the template's message,
never an internal error.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from prorl_server.errors import LLMError


class TemplateRaised(jinja2.TemplateError):
    """The template's own `raise_exception(...)`."""


def _raise(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(template: str) -> jinja2.Template:
    """The template compiled in an environment with transformers' semantics."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise LLMError(f"the chat template does not compile: {exc}", reason="llm_template") from None


def _without_none(message: Mapping[str, Any]) -> dict[str, Any]:
    """transformers drops keys whose value is None: templates test for a missing key."""
    return {key: value for key, value in message.items() if value is not None}


_PROBE_OUTPUT = "tool output 7f3a"
_PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "A text."}},
            "required": ["text"],
        },
    },
}
_PROBES: list[tuple[list[dict[str, Any]] | None, dict[str, Any] | str]] = [
    (tools, arguments) for tools in ([_PROBE_TOOL], None) for arguments in ({"text": "x"}, '{"text": "x"}')
]


class ChatTokenizer(abc.ABC):
    """The model's tokenizer plus its chat template."""

    def __init__(
        self,
        template: str,
        *,
        special_tokens: dict[str, str] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tool_template: str | None = None,
    ) -> None:
        """`tool_template`: the one to render with when tools are given (transformers' "tool_use")."""
        self._template = compile_template(template)
        self._tool_template = compile_template(tool_template) if tool_template else None
        self._special = {key: value for key, value in (special_tokens or {}).items() if value}
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        """`chat_template_kwargs` of the backend, e.g. {"enable_thinking": False}."""
        self._tool_role: bool | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's text, as transformers' `apply_chat_template(..., tokenize=False)` gives it.

        `template_kwargs` (per request) override the backend's, which override the special tokens.
        """
        variables: dict[str, Any] = {**self._special, **self.template_kwargs, **(template_kwargs or {})}
        template = self._tool_template if tools and self._tool_template is not None else self._template
        try:
            return template.render(
                messages=[_without_none(m) for m in messages],
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateRaised as exc:
            raise LLMError(f"the chat template refused the conversation: {exc}", reason="llm_template") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise LLMError(
                f"the chat template failed to render ({type(exc).__name__}: {exc})", reason="llm_template"
            ) from None

    @property
    def renders_tool_role(self) -> bool:
        """Whether the template renders a `tool` message after an assistant tool call.

        Templates without a tool role (Gemma's alternate user/model only; some drop
        unknown roles) get tool results as a user message instead. The probe renders
        the way a job does: with a tool declared (templates that list `tools`
        unconditionally fail without one) and the call's arguments as a mapping or as
        JSON text (templates that join argument strings fail on a mapping); the tool
        role is there if any of these renders the tool's output.
        """
        if self._tool_role is None:
            self._tool_role = any(self._probe_tool_role(tools, arguments) for tools, arguments in _PROBES)
        return self._tool_role

    def _probe_tool_role(self, tools: list[dict[str, Any]] | None, arguments: dict[str, Any] | str) -> bool:
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call00001", "type": "function", "function": {"name": "probe", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "call00001", "name": "probe", "content": _PROBE_OUTPUT},
        ]
        try:
            return _PROBE_OUTPUT in self.render(messages, add_generation_prompt=True, tools=tools)
        except LLMError:
            return False

    @property
    def bos_text(self) -> str:
        return self._special.get("bos_token", "")

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special tokens written in it parsed as such, no BOS added."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    @abc.abstractmethod
    def bos_ids(self) -> list[int]:
        """Ids to put before a rendering that does not start with the BOS itself (may be empty).

        Hugging Face tokenizers: always empty; transformers tokenizes a rendered chat
        with `add_special_tokens=False`, so the template alone writes the BOS."""

    @property
    @abc.abstractmethod
    def stop_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn (EOS, end-of-turn)."""
