"""One job's model turns as chat, whatever kind of backend serves each one.

A chat backend is called as it is. A token backend is turned into chat through
the job's TokenConversation: render the prompt ids, generate, decode the
sampled ids, record them; so the job keeps one exact token trajectory across
its turns (llm/token_conversation.py). The conversation starts with the first
token turn and lives as long as the job, whichever backend the router picks
for a later turn.

Every result says which backend answered and what its text and log-probs are
(tool_call_parser, logprobs_mode); routing facts (policy version, a switch of
backend) are the session's to add.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from prorl_server.llm.base import ChatBackend, ChatMessage, ChatResult, LLMBackend, Sampling, TokenBackend
from prorl_server.llm.token_conversation import ConversationMark, TokenConversation


class JobChat:
    """The per-job adapter from any backend to a chat turn; holds the job's token trajectory."""

    def __init__(self, *, native_tools: bool = False) -> None:
        """`native_tools`: chat backends get the tools in the request (see ChatBackend.chat)."""
        self._conversation: TokenConversation | None = None
        self._native_tools = native_tools

    async def chat(
        self,
        backend: LLMBackend,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
    ) -> ChatResult:
        """One turn on `backend`. Raises LLMError on a failure that is not the policy's."""
        if isinstance(backend, ChatBackend):
            if self._native_tools:
                result = await backend.chat(messages, tools, sampling, native_tools=True)
            else:  # chat backends written before the keyword existed keep working
                result = await backend.chat(messages, tools, sampling)
        elif isinstance(backend, TokenBackend):
            result = await self._token_turn(backend, messages, tools, sampling)
        else:
            raise TypeError(f"backend {backend.info.id!r} is neither a ChatBackend nor a TokenBackend")
        info = backend.info
        return dataclasses.replace(
            result, backend_id=info.id, tool_call_parser=info.tool_call_parser, logprobs_mode=info.logprobs_mode
        )

    async def _token_turn(
        self,
        backend: TokenBackend,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
    ) -> ChatResult:
        tokenizer = backend.tokenizer
        if self._conversation is None:
            # Templates with tool support render the tools themselves (others ignore them).
            self._conversation = TokenConversation(
                tokenizer, tools or None, template_kwargs=sampling.chat_template_kwargs
            )
        conversation = self._conversation
        prompt = conversation.prompt(messages)
        generation = await backend.generate(prompt, sampling)
        ids = list(generation.token_ids)
        visible = ids[:-1] if ids and ids[-1] in tokenizer.stop_ids else ids
        text = tokenizer.decode(visible)
        conversation.record({"role": "assistant", "content": text}, ids, generation.logprobs)
        return ChatResult(
            text=text,
            finish_reason=generation.finish_reason,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=len(ids),
            token_ids=generation.token_ids,
            logprobs=generation.logprobs,
            latency_s=generation.latency_s,
            prefill_s=generation.prefill_s,
            decode_s=generation.decode_s,
            tool_role=tokenizer.renders_tool_role,
            token_offset=conversation.turn_spans[-1][0],
            routed_experts=generation.routed_experts,
        )

    def mark(self) -> ConversationMark | None:
        """The token conversation's current boundary (None before any token turn)."""
        return self._conversation.mark() if self._conversation is not None else None

    def branch(self, mark: ConversationMark | None, *, train_prefix: bool) -> JobChat:
        """A JobChat that goes on from `mark` of this one's token conversation (llm/token_conversation.py)."""
        other = JobChat(native_tools=self._native_tools)
        if mark is not None and self._conversation is not None:
            other._conversation = self._conversation.branch(mark, train_prefix=train_prefix)
        return other

    def turn_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each token turn's sampled ids in the token trajectory; empty without token turns."""
        return list(self._conversation.turn_spans) if self._conversation is not None else []

    def token_trajectory(self) -> tuple[list[int], list[int], list[float]]:
        """(token_ids, loss_mask, logprobs) of the whole trajectory; empty without token turns."""
        conversation = self._conversation
        if conversation is None:
            return [], [], []
        return list(conversation.token_ids), list(conversation.loss_mask), list(conversation.logprobs)
