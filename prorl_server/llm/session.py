"""One job's conversation with the backend router: the routing of each model turn.

Per turn: lease a backend from the router, send the turn again after a Pause
aborted it (once Resume lets it through, marked as re-sampled), fail over to another healthy
backend when this one stays unreachable, and stamp the result with the
policy version, any switch of backend, and how long the turn waited for a
model slot (not in its latency; the router tells the job's wait clock, so that
the wait is not counted against the job's budget). What a turn is on the leased
backend (for a token backend, the exact token trajectory) is the job's
JobChat's business (llm/job_chat.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from prorl_server.errors import LLMError
from prorl_server.llm.base import ChatMessage, ChatResult, Sampling
from prorl_server.llm.job_chat import JobChat
from prorl_server.llm.router import BackendRouter


class LLMSession:
    def __init__(
        self, job_id: str, router: BackendRouter, *, job_chat: JobChat | None = None, min_policy_version: int = 0
    ) -> None:
        self.job_id = job_id
        self.min_policy_version = min_policy_version
        self._router = router
        self._job_chat = job_chat or JobChat()
        self._last_backend = ""

    async def chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        """One model turn.

        A request aborted by Pause is sent again after Resume. It waits for the
        job's minimum policy version, if the service does not serve it yet. A backend that
        stays unreachable (after its own retries) is marked unhealthy and the
        request goes to another healthy backend, if there is one.
        """
        resampled = False
        waited = 0.0
        while True:
            asked = time.monotonic()
            async with self._router.lease(self.job_id, min_version=self.min_policy_version) as entry:
                waited += time.monotonic() - asked
                version = self._router.policy_version
                request = asyncio.create_task(self._job_chat.chat(entry.backend, messages, tools, sampling))
                self._router.track(request)
                try:
                    result = await request
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if self._router.was_aborted(request) and current is not None and not current.cancelling():
                        resampled = True
                        continue
                    raise
                except LLMError as exc:
                    if exc.reason == "llm_unavailable" and self._router.fail_over(entry):
                        continue
                    raise
            switched = self._last_backend if self._last_backend and self._last_backend != entry.id else ""
            self._last_backend = entry.id
            return dataclasses.replace(
                result,
                backend_id=entry.id,
                policy_version=version,
                switched_from_backend=switched,
                resampled=resampled,
                model_wait_s=waited,
            )

    @property
    def job_chat(self) -> JobChat:
        """The job's token trajectory (a fork branches from it)."""
        return self._job_chat

    def turn_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each turn's sampled ids in the token trajectory; empty for chat backends."""
        return self._job_chat.turn_spans()

    def token_trajectory(self) -> tuple[list[int], list[int], list[float]]:
        """(token_ids, loss_mask, logprobs) of the whole trajectory; empty for chat backends."""
        return self._job_chat.token_trajectory()
