"""The AgentHandler interface: what a task family implements.

A handler is chosen by the request's `handler` field. The job pipeline calls
`validate` at submission, then `init` -> `run` -> `evaluate`, each in its own
phase with its own concurrency limit, and `shape_result` last. An exception
in a phase goes to that phase's hook, which classifies it.
"""

from __future__ import annotations

import abc
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.errors import InfrastructureError, PolicyError
from prorl_server.llm.base import ChatResult, Sampling
from prorl_server.sandbox.base import Sandbox
from prorl_server.sandbox.output import cap_text

ChatFn = Callable[[Sequence[dict[str, Any]], Sequence[dict[str, Any]], Sampling], Awaitable[ChatResult]]
SandboxFactory = Callable[[], Awaitable[Sandbox]]


@dataclass(frozen=True)
class Limits:
    max_turns: int
    tool_timeout_s: float


# A result's details go out in the evaluation event and in the result: each text in them
# (log tails, a SWE patch) is cut head and tail to MAX_DETAIL_TEXT_BYTES, and all of them
# together to about MAX_DETAILS_BYTES, so that a result stays readable over gRPC.
MAX_DETAIL_TEXT_BYTES = 64 << 10
MAX_DETAILS_BYTES = 256 << 10
MAX_FAILURE_MESSAGE_BYTES = 4 << 10


def _cap_texts(value: Any, limit: int) -> Any:
    if isinstance(value, str):
        return cap_text(value, limit)[0]
    if isinstance(value, dict):
        return {_cap_texts(str(key), limit): _cap_texts(item, limit) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cap_texts(item, limit) for item in value]
    return value


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, default=str).encode())


def bound_details(details: dict[str, Any]) -> dict[str, Any]:
    """`details` with every text cut to MAX_DETAIL_TEXT_BYTES (harder when there are many),
    and fields that still do not fit MAX_DETAILS_BYTES replaced by a note of their size."""
    for limit in (MAX_DETAIL_TEXT_BYTES, 1024):
        bounded: dict[str, Any] = _cap_texts(details, limit)
        if _json_bytes(bounded) <= MAX_DETAILS_BYTES:
            return bounded
    kept: dict[str, Any] = {}
    room = MAX_DETAILS_BYTES
    for key, value in sorted(details.items(), key=lambda item: _json_bytes(item[1])):
        for limit in (MAX_DETAIL_TEXT_BYTES, 1024):
            candidate = _cap_texts(value, limit)
            if _json_bytes(candidate) <= room:
                break
        else:
            candidate = f"[omitted: {_json_bytes(value)} bytes of details]"
        kept[_cap_texts(str(key), 1024)] = candidate
        room -= _json_bytes(candidate)
    return kept


@dataclass
class EvalOutcome:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)
    """Bounded on construction (see `bound_details`)."""

    def __post_init__(self) -> None:
        self.details = bound_details(self.details)


@dataclass
class FailureInfo:
    """How a handler classifies an exception: infrastructure or policy."""

    infrastructure: bool
    reason: str
    message: str

    def __post_init__(self) -> None:
        self.message = cap_text(self.message, MAX_FAILURE_MESSAGE_BYTES)[0]


class RolloutContext:
    """Everything a handler may use during one job."""

    def __init__(
        self,
        *,
        job_id: str,
        instance: dict[str, Any],
        limits: Limits,
        sampling: Sampling,
        chat: ChatFn,
        sandbox_factory: SandboxFactory,
        recorder: TrajectoryRecorder,
    ) -> None:
        self.job_id = job_id
        self.instance = instance
        self.limits = limits
        self.sampling = sampling
        self.chat = chat
        self.recorder = recorder
        self.state: dict[str, Any] = {}
        self._sandbox_factory = sandbox_factory
        self._sandboxes: list[Sandbox] = []
        self.sandbox_acquire_s = 0.0

    async def open_sandbox(self) -> Sandbox:
        """Start a sandbox for this job; the pipeline removes it when the job ends.

        Every sandbox of a job is of the job's image (the request's, else the
        handler's `image_for`, else the default), which Submit checked against
        the server's allow-list: a handler cannot pick another one here."""
        started = time.perf_counter()
        sandbox = await self._sandbox_factory()
        self.sandbox_acquire_s += time.perf_counter() - started
        self._sandboxes.append(sandbox)
        return sandbox

    @property
    def sandbox(self) -> Sandbox:
        """The job's first sandbox."""
        if not self._sandboxes:
            raise InfrastructureError("no sandbox was opened in init", reason="no_sandbox")
        return self._sandboxes[0]

    async def close_sandboxes(self) -> None:
        sandboxes, self._sandboxes = self._sandboxes, []
        for sandbox in sandboxes:
            await sandbox.close()


def classify(exc: BaseException) -> FailureInfo:
    """Default classification: our own dependency errors are infrastructure,
    anything unexpected is infrastructure too (a bug is never the policy's fault)."""
    if isinstance(exc, InfrastructureError):
        return FailureInfo(True, exc.reason, exc.message)
    if isinstance(exc, PolicyError):
        return FailureInfo(False, exc.reason, exc.message)
    return FailureInfo(True, "internal", f"{type(exc).__name__}: {exc}")


class AgentHandler(abc.ABC):
    """One task family. Subclasses set `name` and implement the three phases."""

    name: str = ""
    default_image: str | None = None
    """Image when the request names none; None: the server's default image."""

    def image_for(self, instance: dict[str, Any]) -> str | None:
        """The sandbox image this instance needs when the request names none."""
        return self.default_image

    @abc.abstractmethod
    def validate(self, instance: dict[str, Any]) -> None:
        """Raise InvalidArgument naming the problem if the instance is unusable."""

    @abc.abstractmethod
    async def init(self, ctx: RolloutContext) -> None: ...

    @abc.abstractmethod
    async def run(self, ctx: RolloutContext) -> None: ...

    @abc.abstractmethod
    async def evaluate(self, ctx: RolloutContext) -> EvalOutcome: ...

    def on_init_error(self, ctx: RolloutContext, exc: BaseException) -> FailureInfo:
        return classify(exc)

    def on_run_error(self, ctx: RolloutContext, exc: BaseException) -> FailureInfo:
        return classify(exc)

    def on_eval_error(self, ctx: RolloutContext, exc: BaseException) -> FailureInfo:
        return classify(exc)

    def shape_result(self, ctx: RolloutContext, details: dict[str, Any]) -> dict[str, Any]:
        """Last word on the result's details (e.g. drop bulky fields)."""
        return details
