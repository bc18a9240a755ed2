"""Exact token trajectories across turns: no re-tokenisation drift.

Each turn's prompt is the previous prompt + the ids the model sampled + the
ids of the new messages only. The sampled ids are never re-tokenised, so the
trajectory's token_ids are exactly what the model saw and produced, and the
loss mask is 1 exactly on the sampled ids.

The ids of the new messages come from the chat template itself: the text the
template renders for the whole conversation, minus the text it renders for
the conversation so far. What follows the assistant's content in the
template (e.g. `<|im_end|>\\n`) is added as prompt tokens with the next
prompt, less any of it the model already sampled (its end-of-turn token); so
the trajectory is always exactly the last prompt followed by the last sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prorl_server.errors import LLMError
from prorl_server.llm.chat_template import ChatTokenizer


class TokenConversation:
    def __init__(self, tokenizer: ChatTokenizer, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self._tokenizer = tokenizer
        self._tools = tools
        self._messages: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self._last_text = ""
        """The rendered text the current token_ids correspond to (prompt side)."""
        self._closing: list[int] = []
        """Template tokens that close the last reply, added with the next prompt."""

    def _render(self, messages: Sequence[dict[str, Any]], *, generation: bool) -> str:
        return self._tokenizer.render(messages, add_generation_prompt=generation, tools=self._tools)

    def prompt(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The ids to send for `messages` (the whole conversation so far)."""
        if [_key(m) for m in messages[: len(self._messages)]] != [_key(m) for m in self._messages]:
            raise LLMError(
                "the conversation was rewritten between turns; token trajectories only grow", reason="llm_prompt"
            )
        full = self._render(messages, generation=True)
        if not self._messages:
            ids = self._tokenizer.bos_ids + self._tokenizer.encode(full)
        else:
            if not full.startswith(self._last_text):
                raise LLMError(
                    "the chat template does not render the conversation as a growing prefix", reason="llm_prompt"
                )
            ids = self._closing + self._tokenizer.encode(full[len(self._last_text) :])
            self._closing = []
        self._append(ids, sampled=False)
        self._messages = list(messages)
        self._last_text = full
        return list(self.token_ids)

    def record(self, assistant: dict[str, Any], sampled_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Add the model's reply: its sampled ids (mask 1), then what the template closes it with."""
        self._append(list(sampled_ids), sampled=True, logprobs=logprobs)
        before = self._last_text
        self._messages.append(assistant)
        rendered = self._render(self._messages, generation=False)
        content = str(assistant.get("content") or "")
        index = rendered.find(content, len(before)) if content else len(before)
        if not rendered.startswith(before) or index < 0:
            raise LLMError(
                "the chat template changed the assistant's text; cannot keep exact tokens", reason="llm_prompt"
            )
        closing = rendered[index + len(content) :]
        sampled_tail = self._tokenizer.decode([sampled_ids[-1]]) if sampled_ids else ""
        if sampled_tail and sampled_ids[-1] in self._tokenizer.stop_ids and closing.startswith(sampled_tail):
            closing = closing[len(sampled_tail) :]
        self._closing = self._tokenizer.encode(closing) if closing else []
        self._last_text = rendered

    def _append(self, ids: list[int], *, sampled: bool, logprobs: Sequence[float] = ()) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(list(logprobs) if sampled else [0.0] * len(ids))


def _key(message: dict[str, Any]) -> tuple[str, str]:
    return str(message.get("role")), str(message.get("content") or "")
