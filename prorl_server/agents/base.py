"""The AgentHandler interface: what a task family implements.

A handler is chosen by the request's `handler` field. At submission the job
code calls `validate`, which turns the request's instance into the family's
pydantic model (or raises InvalidArgument naming the field). Then the job
pipeline runs `init` -> `run` -> `evaluate`, each in its own phase with its
own concurrency limit: `run` returns a `RunOutcome` and `evaluate` receives
it. `shape_result` has the last word on the details. An exception in a phase
goes to that phase's hook, which classifies it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import copy
import difflib
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from prorl_server.agents.branching import Branching
from prorl_server.agents.outcomes import EvalOutcome, FailureInfo, Limits, RunOutcome, TaskNeeds
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.errors import InfrastructureError, InvalidArgument, PolicyError
from prorl_server.llm.base import ChatFn, Sampling
from prorl_server.sandbox.base import Sandbox
from prorl_server.sandbox.output import cap_text
from prorl_server.sandbox.snapshot import DEFAULT_ROOTS, Root
from prorl_server.verifiers.judge import JobJudge

# Re-exported: the value types every family uses.
__all__ = [
    "AgentHandler",
    "AnyHandler",
    "EvalOutcome",
    "FailureInfo",
    "Limits",
    "RolloutContext",
    "RunOutcome",
    "SandboxFactory",
    "TaskInstance",
    "TaskNeeds",
    "classify",
]

SandboxFactory = Callable[[], Awaitable[Sandbox]]
"""Starts a sandbox of the job's image."""


@dataclass(frozen=True)
class JobGateway:
    """The job's model gateway, open in one of its sandboxes."""

    port: int
    """On the sandbox's loopback: http://127.0.0.1:<port>/v1 for OpenAI SDKs, without /v1 for Anthropic's."""
    api_key: str
    """The job's key: refused once the gateway is closed."""
    outage: Callable[[], InfrastructureError | None] = lambda: None
    """The backends' failure on the program's latest model call, when none succeeded since."""


GatewayOpener = Callable[[Sandbox], AbstractAsyncContextManager[JobGateway]]
"""Opens the job's model gateway in a sandbox for as long as the context lasts."""


class JobClock(Protocol):
    """The job's clock (jobs/phase_runner.py BudgetClock): a deadline it governs stops while
    the job waits for a model slot, as the job's budget does."""

    def governing(self, deadline: asyncio.Timeout) -> AbstractContextManager[None]: ...


class TaskInstance(BaseModel):
    """A family's task instance, checked at submission.

    A field the family does not know is refused, by name, with the closest known
    field when one is close: a typo (`choice` for `choices`) would otherwise turn
    the task into another one silently. Columns that a family's published datasets
    carry and that it knowingly does not use are listed in `ignored_fields`, and
    dropped before validation.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    ignored_fields: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored_fields(cls, data: Any) -> Any:
        if cls.ignored_fields and isinstance(data, dict):
            return {key: value for key, value in data.items() if key not in cls.ignored_fields}
        return data


InstanceT = TypeVar("InstanceT", bound=TaskInstance)
OutcomeT = TypeVar("OutcomeT", bound=RunOutcome)
MIN_TOOL_TIMEOUT_S = 0.1
"""A tool call at a time limit's very end still gets this long (the limit itself cancels it)."""


@dataclass(frozen=True)
class _TimeLimit:
    """A `RolloutContext.time_limit` in force: its deadline and its whole length."""

    deadline: asyncio.Timeout
    seconds: float


@dataclass
class _JobSandboxes:
    """A job's sandboxes and the time spent getting them (shared by views of a context)."""

    opened: list[Sandbox] = field(default_factory=list)
    acquire_s: float = 0.0


class RolloutContext(Generic[InstanceT]):
    """Everything a handler may use during one job."""

    def __init__(
        self,
        *,
        job_id: str,
        instance: InstanceT,
        limits: Limits,
        sampling: Sampling,
        chat: ChatFn,
        sandbox_factory: SandboxFactory,
        recorder: TrajectoryRecorder,
        model_gateway: GatewayOpener | None = None,
        judge: JobJudge | None = None,
        branching: Branching | None = None,
        clock: JobClock | None = None,
    ) -> None:
        self.job_id = job_id
        self.instance = instance
        self.limits = limits
        self.sampling = sampling
        self.chat = chat
        """The agent's model turns (one conversation, the job's token trajectory)."""
        self.model_gateway = model_gateway
        """For an agent program: the job's model gateway (its calls become token chains, one per
        history), opened in a sandbox with `async with ctx.model_gateway(sandbox) as gateway`."""
        self._judge = judge
        self.recorder = recorder
        self.branching = branching
        """Set for a forkable job or a fork (agents/branching.py): the loop's turn boundaries."""
        self._sandbox_factory = sandbox_factory
        self._sandboxes = _JobSandboxes()
        self._clock = clock
        self._time_limit: _TimeLimit | None = None

    def for_instance(self, instance: TaskInstance) -> RolloutContext[Any]:
        """A view of this job for another family's phases (the command family judges with the
        math, code or SWE family): the same sandboxes, model and recorder, another instance."""
        view: RolloutContext[Any] = copy.copy(self)
        view.instance = instance
        return view

    @property
    def judge(self) -> JobJudge:
        """The server's model judge for this job (settings `judge.*`): `await ctx.judge.score(rubric=...,
        question=..., answer=...)` grades a policy's answer, the only text of the policy's it sees."""
        if self._judge is None:
            raise InfrastructureError("this server gives jobs no model judge", reason="judge_unavailable")
        return self._judge

    @contextlib.asynccontextmanager
    async def time_limit(self, seconds: float, *, used_s: float = 0.0) -> AsyncIterator[asyncio.Timeout]:
        """A time limit of the task's own for its agent (a Harbor task's [agent] timeout_sec),
        counted as the job's budget is: not while the job waits for a model slot. The body is
        cancelled when it runs out (TimeoutError, with the yielded deadline expired), and each
        tool call meanwhile gets no more than what is left of it (`tool_timeout_s`). `used_s` of
        it is spent already: a fork's agent goes on with what its parent had left at the branch."""
        async with asyncio.timeout(max(seconds - used_s, 0.0)) as deadline:
            governing = self._clock.governing(deadline) if self._clock is not None else contextlib.nullcontext()
            with governing:
                outer, self._time_limit = self._time_limit, _TimeLimit(deadline, seconds)
                try:
                    yield deadline
                finally:
                    self._time_limit = outer

    @property
    def time_used_s(self) -> float | None:
        """How much of the innermost `time_limit` is used (a fork's parent's part included): what
        a fork after this point carries on. None without a limit, or while its clock stands still."""
        limit = self._time_limit
        if limit is None:
            return None
        if limit.deadline.expired():
            return limit.seconds
        when = limit.deadline.when()
        if when is None:
            return None
        left = when - asyncio.get_running_loop().time()
        return min(max(limit.seconds - left, 0.0), limit.seconds)

    @contextlib.contextmanager
    def time_stopped(self) -> Iterator[None]:
        """The `time_limit` stands still meanwhile: the job's own work (a fork's snapshot or
        restore) is not the agent's time, so a fork's agent and its parent's count the same."""
        limit = self._time_limit
        when = limit.deadline.when() if limit is not None and not limit.deadline.expired() else None
        if limit is None or when is None:  # no limit, or the job's clock stopped it already
            yield
            return
        loop = asyncio.get_running_loop()
        left = when - loop.time()
        limit.deadline.reschedule(None)
        try:
            yield
        finally:
            if not limit.deadline.expired():
                limit.deadline.reschedule(loop.time() + left)

    @property
    def tool_timeout_s(self) -> float:
        """A tool call's time: the job's limit, within what is left of a `time_limit`, so that the
        sandbox itself stops a command at the deadline and its shell is free afterwards."""
        limit = self.limits.tool_timeout_s
        when = self._time_limit.deadline.when() if self._time_limit is not None else None
        if when is None:
            return limit
        return max(min(limit, when - asyncio.get_running_loop().time()), MIN_TOOL_TIMEOUT_S)

    @property
    def sandbox_acquire_s(self) -> float:
        return self._sandboxes.acquire_s

    async def open_sandbox(self) -> Sandbox:
        """Start a sandbox for this job; the pipeline removes it when the job ends.

        Every sandbox of a job is of the job's image (the request's, else the
        handler's `image_for`, else the default), which Submit checked against
        the server's allow-list: a handler cannot pick another one here."""
        started = time.perf_counter()
        sandbox: Sandbox = await self._sandbox_factory()
        self._sandboxes.acquire_s += time.perf_counter() - started
        self._sandboxes.opened.append(sandbox)
        return sandbox

    @property
    def sandbox(self) -> Sandbox:
        """The job's first sandbox."""
        if not self._sandboxes.opened:
            raise InfrastructureError("no sandbox was opened in init", reason="no_sandbox")
        return self._sandboxes.opened[0]

    async def close_sandboxes(self) -> None:
        sandboxes, self._sandboxes.opened = self._sandboxes.opened, []
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


def _did_you_mean(error: ValidationError, loc: tuple[int | str, ...]) -> str:
    """ ", did you mean 'x'?" for an unknown field close to a known one of its model, else the known ones."""
    model = _model_at(error.title, loc)
    if model is None:
        return ""
    known = [name for name in model.model_fields if name not in model.ignored_fields]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; the fields are: {', '.join(known)}"


def _model_at(title: str, loc: tuple[int | str, ...]) -> type[TaskInstance] | None:
    """The instance model that holds the field at `loc` (nested models included)."""
    model: Any = _model_named(title)
    for part in loc[:-1]:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        info = model.model_fields.get(part)
        model = _inner_model(info.annotation) if info is not None else None
    return model if isinstance(model, type) and issubclass(model, TaskInstance) else None


def _inner_model(annotation: Any) -> Any:
    """The TaskInstance model inside an annotation such as list[Case] or Case | None."""
    if isinstance(annotation, type) and issubclass(annotation, TaskInstance):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _model_named(title: str) -> type[TaskInstance] | None:
    """The TaskInstance subclass a ValidationError is about (its title is the model's name)."""
    stack: list[type[TaskInstance]] = [TaskInstance]
    while stack:
        model = stack.pop()
        if model.__name__ == title:
            return model
        stack.extend(model.__subclasses__())
    return None


def invalid_instance(family: str, error: ValidationError) -> InvalidArgument:
    """The first problem pydantic found, as `<family> instance field 'x': what is wrong`."""
    first = error.errors()[0]
    top, *inner = [str(part) for part in first["loc"]] or ["(instance)"]
    where = f" (at {'.'.join(inner)})" if inner else ""
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "missing: this field is required"
    elif first["type"] == "extra_forbidden":
        message = "unknown field" + _did_you_mean(error, first["loc"])
    return InvalidArgument(cap_text(f"{family} instance field {top!r}{where}: {message}", 1000)[0])


class AgentHandler(abc.ABC, Generic[InstanceT, OutcomeT]):
    """One task family. Subclasses set `name` and `instance_model` and implement the phases."""

    name: str = ""
    instance_model: type[InstanceT]
    default_image: str | None = None
    """Image when the request names none; None: the server's default image."""
    forkable: ClassVar[bool] = False
    """Its run has turn boundaries a ForkJob can branch at (the shared tool loop has)."""

    def fork_roots(self, instance: InstanceT) -> Sequence[Root]:
        """The directories whose files a fork carries (sandbox/snapshot.py)."""
        return DEFAULT_ROOTS

    def validate(self, instance: dict[str, Any]) -> InstanceT:
        """The instance as this family's model; InvalidArgument naming the field if unusable."""
        try:
            return self.parse(instance)
        except ValidationError as exc:
            raise invalid_instance(self.name, exc) from None

    def parse(self, instance: dict[str, Any]) -> InstanceT:
        """The instance model from the request's dict; pydantic's ValidationError if it does not fit."""
        return self.instance_model.model_validate(instance)

    def image_for(self, instance: InstanceT) -> str | None:
        """The sandbox image this instance needs when the request names none."""
        return self.default_image

    def needs(self, instance: InstanceT) -> TaskNeeds:
        """The sandbox resources and the budget the instance itself asks for (a Harbor task's
        task.toml); Submit applies them where the request does not say otherwise."""
        return TaskNeeds()

    @abc.abstractmethod
    async def init(self, ctx: RolloutContext[InstanceT]) -> None: ...

    @abc.abstractmethod
    async def run(self, ctx: RolloutContext[InstanceT]) -> OutcomeT: ...

    @abc.abstractmethod
    async def evaluate(self, ctx: RolloutContext[InstanceT], outcome: OutcomeT) -> EvalOutcome: ...

    def on_init_error(self, ctx: RolloutContext[InstanceT], exc: BaseException) -> FailureInfo:
        return classify(exc)

    def on_run_error(self, ctx: RolloutContext[InstanceT], exc: BaseException) -> FailureInfo:
        return classify(exc)

    def on_eval_error(self, ctx: RolloutContext[InstanceT], exc: BaseException) -> FailureInfo:
        return classify(exc)

    def shape_result(self, ctx: RolloutContext[InstanceT], details: dict[str, Any]) -> dict[str, Any]:
        """Last word on the result's details (e.g. drop bulky fields)."""
        return details


AnyHandler = AgentHandler[Any, Any]
"""A handler of any family, as the registry and the job code hold them."""
