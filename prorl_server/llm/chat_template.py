"""Chat templates and tokenizers: the model's own, never a hard-coded family.

A `ChatTokenizer` renders messages with the model's chat template (Jinja, as
in Hugging Face's `tokenizer_config.json` or a GGUF file's
`tokenizer.chat_template`) and turns text into ids and back.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.sandbox


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTokenizer(abc.ABC):
    """The model's tokenizer plus its chat template."""

    def __init__(self, template: str, *, special_tokens: dict[str, str] | None = None) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)
        self._special = special_tokens or {}

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None,
            **self._special,
        )

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special tokens written in it parsed as such, no BOS added."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    @abc.abstractmethod
    def bos_ids(self) -> list[int]:
        """Ids the model expects at the very start of a sequence (may be empty)."""

    @property
    @abc.abstractmethod
    def stop_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn (EOS, end-of-turn)."""
