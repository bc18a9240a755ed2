"""A model judge: grades a policy's answer against a task's rubric with a model of the
judge pool (settings `judge.*`, docs/llm.md "The judge pool").

The judge pool is a router of its own (never the policy's backends, unless the
operator sets `judge.use_policy_backends`), so a weight update's Pause does not
stop judgements and the policy under training never grades itself by accident.
Each judgement is one fresh conversation (no history, no tools) sampled with the
judge's own sampling (temperature 0 by default), at most `judge.max_tokens`
tokens and `judge.timeout_s` seconds.

Verdicts (`Judgement.verdict`):
- `judged`: the reply was in the format; reward = the weighted scores in [0, 1];
- `judge_unparseable`, `judge_refused`, `judge_echoed_answer` (every line of the
  reply is a line of the answer: the judge copied grading lines the policy wrote):
  reward 0, a verdict of the job's eval
  like any wrong answer (the job SUCCEEDS with reward 0: never an infrastructure
  failure a trainer would mask, never a pass);
- `empty_answer`, `answer_too_long` (over `judge.max_answer_chars`, or over the
  judge's context): reward 0, the judge is not asked (or could not read it).
A judge pool that cannot answer (no backend, every one down, 5xx after the
retries, `judge.timeout_s` passed, a request the backend refuses) raises an
InfrastructureError (`judge_unavailable`, `judge_timeout`, `judge_rejected`):
nothing the policy did.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prorl_server.config import JudgeSettings
from prorl_server.errors import ContextLengthExceeded, InfrastructureError, LLMError
from prorl_server.llm.base import Sampling
from prorl_server.llm.router import BackendRouter, WaitClock
from prorl_server.llm.session import LLMSession
from prorl_server.verifiers.judge_prompt import Rubric, build_prompt, echoes_answer, parse_reply, weighted_reward

Verdict = Literal[
    "judged", "judge_unparseable", "judge_refused", "judge_echoed_answer", "empty_answer", "answer_too_long"
]
MAX_REPLY_CHARS_KEPT = 8000


def judge_options(settings: JudgeSettings) -> JudgeOptions:
    return JudgeOptions(
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        seed=settings.seed,
        model=settings.model,
        timeout_s=settings.timeout_s,
        max_answer_chars=settings.max_answer_chars,
    )


class JudgeMetrics(Protocol):
    def judgement(self, verdict: str, seconds: float, prompt_tokens: int, completion_tokens: int) -> None: ...


@dataclass(frozen=True)
class JudgeOptions:
    """The judge's sampling and limits (from settings `judge.*`)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = 0
    model: str = ""
    timeout_s: float = 120.0
    max_answer_chars: int = 16_000


@dataclass
class Judgement:
    verdict: Verdict
    reward: float
    scores: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    reply: str = ""
    """The judge's raw reply (its first MAX_REPLY_CHARS_KEPT characters)."""
    reason: str = ""
    backend: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    answer_chars: int = 0

    def details(self) -> dict[str, Any]:
        """For a result's details: `verdict`, and everything else under `judge`."""
        return {
            "verdict": self.verdict,
            "judge": {
                "scores": self.scores,
                "weights": self.weights,
                "reply": self.reply,
                "reason": self.reason,
                "backend": self.backend,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "latency_s": round(self.latency_s, 4),
                "answer_chars": self.answer_chars,
            },
        }


class ModelJudge:
    """The server's judge: one per server, shared by every job (`JobJudge` binds it to a job)."""

    def __init__(
        self,
        router: BackendRouter,
        options: JudgeOptions,
        *,
        metrics: JudgeMetrics | None = None,
        pool_name: str = "judge.backends",
    ) -> None:
        self._router = router
        self.options = options
        self._metrics = metrics
        self._pool_name = pool_name

    def for_job(self, job_id: str, *, wait_clock: WaitClock | None = None) -> JobJudge:
        """`wait_clock`: the job's budget clock, stopped while a judgement waits for a judge slot
        (as for the job's own model turns: waiting for a shared model is not the job's time)."""
        return JobJudge(self, job_id, wait_clock)

    async def judge(
        self,
        job_id: str,
        *,
        rubric: Rubric,
        question: str,
        answer: str | None,
        max_answer_chars: int | None = None,
        wait_clock: WaitClock | None = None,
    ) -> Judgement:
        """`max_answer_chars`: the task's own limit, when below the server's. A rubric that
        cannot be graded (Rubric.check) raises ValueError: the calling family's bug."""
        rubric.check()
        weights = {c.name: c.weight for c in rubric.effective_criteria()}
        text = (answer or "").strip()
        if not text:
            return self._count(Judgement("empty_answer", 0.0, weights=weights, reason="nothing was submitted"))
        limit = self.options.max_answer_chars
        whose = "judge.max_answer_chars"
        if max_answer_chars is not None and max_answer_chars < limit:
            limit, whose = max_answer_chars, "the task's max_answer_chars"
        if len(text) > limit:
            reason = f"the answer has {len(text)} characters, over {whose} ({limit})"
            return self._count(
                Judgement("answer_too_long", 0.0, weights=weights, reason=reason, answer_chars=len(text))
            )
        if not self._router.entries():
            raise InfrastructureError(
                f"no judge backend is configured: add one to {self._pool_name} (docs/llm.md, 'The judge pool')",
                reason="judge_unavailable",
            )
        prompt = build_prompt(rubric, question, text)
        options = self.options
        sampling = Sampling(
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            model=options.model,
        )
        # A fresh session per judgement: no history, its own token conversation, routed apart
        # from the job's own turns.
        key = f"{job_id}/judge"
        session = LLMSession(key, self._router)
        if wait_clock is not None:
            self._router.wait_clocks[key] = wait_clock
        started = time.monotonic()
        try:
            async with asyncio.timeout(options.timeout_s):
                result = await session.chat(prompt.messages, [], sampling)
        except TimeoutError:
            raise InfrastructureError(
                f"the judge did not answer within judge.timeout_s ({options.timeout_s:g} s)", reason="judge_timeout"
            ) from None
        except ContextLengthExceeded as exc:
            reason = f"the judge's context cannot hold this answer: {exc.message}"
            return self._count(
                Judgement("answer_too_long", 0.0, weights=weights, reason=reason, answer_chars=len(text))
            )
        except LLMError as exc:
            which = "judge_unavailable" if exc.reason == "llm_unavailable" else "judge_rejected"
            raise InfrastructureError(f"the judge pool failed: {exc.message}", reason=which) from None
        finally:
            self._router.forget(key)
        latency = time.monotonic() - started
        judgement = Judgement(
            "judged",
            0.0,
            weights=weights,
            reply=result.text[:MAX_REPLY_CHARS_KEPT],
            backend=result.backend_id,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            latency_s=latency,
            answer_chars=len(text),
        )
        parsed = parse_reply(result.text, rubric)
        if result.finish_reason == "length":
            judgement.verdict, judgement.reason = "judge_unparseable", "the reply was cut at judge.max_tokens"
        elif parsed.kind == "refused":
            judgement.verdict, judgement.reason = "judge_refused", parsed.reason
        elif parsed.kind == "unparseable":
            judgement.verdict, judgement.reason = "judge_unparseable", parsed.reason
        elif echoes_answer(result.text, text):
            judgement.verdict, judgement.reason = (
                "judge_echoed_answer",
                "every line of the reply is a line of the answer",
            )
        else:
            judgement.scores = parsed.scores
            judgement.reward = weighted_reward(parsed.scores, rubric)
        return self._count(judgement)

    def _count(self, judgement: Judgement) -> Judgement:
        if self._metrics is not None:
            self._metrics.judgement(
                judgement.verdict, judgement.latency_s, judgement.prompt_tokens, judgement.completion_tokens
            )
        return judgement


@dataclass(frozen=True)
class JobJudge:
    """The judge as one job's families see it (`ctx.judge`)."""

    judge: ModelJudge
    job_id: str
    wait_clock: WaitClock | None = None

    async def score(
        self, *, rubric: Rubric, question: str, answer: str | None, max_answer_chars: int | None = None
    ) -> Judgement:
        """Grade `answer` (the policy's text: the only thing of the policy's the judge sees);
        `question` and `rubric` must be the task's, never text the policy wrote."""
        return await self.judge.judge(
            self.job_id,
            rubric=rubric,
            question=question,
            answer=answer,
            max_answer_chars=max_answer_chars,
            wait_clock=self.wait_clock,
        )
