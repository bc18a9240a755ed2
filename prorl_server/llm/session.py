"""One job's conversation with the LLM pool: routing, retries after a pause,
and for token backends the exact token trajectory."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prorl_server.errors import LLMError
from prorl_server.llm.base import ChatBackend, ChatResult, Sampling, TokenBackend
from prorl_server.llm.router import BackendEntry, BackendPool
from prorl_server.llm.token_conversation import TokenConversation


class LLMSession:
    def __init__(self, job_id: str, pool: BackendPool) -> None:
        self.job_id = job_id
        self._pool = pool
        self._conversation: TokenConversation | None = None
        self._last_backend = ""

    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        """One model turn.

        A request aborted by Pause is sent again after Resume. A backend that
        stays unreachable (after its own retries) is marked unhealthy and the
        request goes to another healthy backend, if there is one.
        """
        while True:
            async with self._pool.lease(self.job_id) as entry:
                version = self._pool.policy_version
                request = asyncio.create_task(self._call(entry, messages, tools, sampling))
                self._pool.track(request)
                try:
                    result = await request
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if self._pool.was_aborted(request) and current is not None and not current.cancelling():
                        continue
                    raise
                except LLMError as exc:
                    if exc.reason == "llm_unavailable" and self._pool.fail_over(entry):
                        continue
                    raise
            switched = self._last_backend if self._last_backend and self._last_backend != entry.id else ""
            self._last_backend = entry.id
            return ChatResult(
                text=result.text,
                finish_reason=result.finish_reason,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                tool_calls=result.tool_calls,
                token_ids=result.token_ids,
                logprobs=result.logprobs,
                backend_id=entry.id,
                latency_s=result.latency_s,
                policy_version=version,
                switched_from_backend=switched,
                prefill_s=result.prefill_s,
                decode_s=result.decode_s,
                tool_call_parser=entry.backend.info.tool_call_parser,
                tool_role=result.tool_role,
                logprobs_mode=entry.backend.info.logprobs_mode,
                token_offset=result.token_offset,
            )

    async def _call(
        self,
        entry: BackendEntry,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
    ) -> ChatResult:
        backend = entry.backend
        if isinstance(backend, ChatBackend):
            return await backend.chat(messages, tools, sampling)
        assert isinstance(backend, TokenBackend)
        if self._conversation is None:
            # Templates with tool support render the tools themselves (others ignore them).
            self._conversation = TokenConversation(
                backend.tokenizer, tools or None, template_kwargs=sampling.chat_template_kwargs
            )
        conversation = self._conversation
        prompt = conversation.prompt(messages)
        generation = await backend.generate(prompt, sampling)
        ids = list(generation.token_ids)
        visible = ids[:-1] if ids and ids[-1] in backend.tokenizer.stop_ids else ids
        text = backend.tokenizer.decode(visible)
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
            tool_role=backend.tokenizer.renders_tool_role,
            token_offset=conversation.turn_spans[-1][0],
        )

    def turn_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each turn's sampled ids in the token trajectory; empty for chat backends."""
        return list(self._conversation.turn_spans) if self._conversation is not None else []

    def token_trajectory(self) -> tuple[list[int], list[int], list[float]]:
        """(token_ids, loss_mask, logprobs) of the whole trajectory; empty for chat backends."""
        conversation = self._conversation
        if conversation is None:
            return [], [], []
        return list(conversation.token_ids), list(conversation.loss_mask), list(conversation.logprobs)


ChatFn = Callable[[Sequence[dict[str, Any]], Sequence[dict[str, Any]], Sampling], Awaitable[ChatResult]]
