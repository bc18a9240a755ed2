"""Checking a RolloutRequest and filling in the server's defaults.

Every refusal is an InvalidArgument whose message names the field and says
what would be accepted; an image outside sandbox.allowed_images (named by the
request or by the task instance) is a PermissionDenied.
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf.json_format import MessageToDict

from prorl_client import v1
from prorl_server.agents.base import Limits, TaskNeeds
from prorl_server.agents.registry import HandlerRegistry
from prorl_server.config import Settings
from prorl_server.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from prorl_server.jobs.record import JobPlan
from prorl_server.jobs.wire import seconds
from prorl_server.llm.base import Sampling

JOB_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_LABELS = 64
MAX_LABEL_CHARS = 256
# Fields that are stored, listed back or sent on to a backend have a size, so
# that one request can neither bloat the store nor every ListJobs page.
MAX_GROUP_ID_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MAX_TOKENS = 1 << 20
MAX_CANCEL_REASON_CHARS = 1024


def check_job_id(job_id: str) -> None:
    if not JOB_ID.match(job_id):
        raise InvalidArgument(f"job_id {job_id[:140]!r} is invalid: use 1-128 characters of A-Z a-z 0-9 . _ : -")


def _sampling(request: v1.RolloutRequest, settings: Settings) -> Sampling:
    params = request.sampling
    temperature = params.temperature if params.HasField("temperature") else settings.llm.default_temperature
    if not 0 <= temperature <= 10:
        raise InvalidArgument(f"sampling.temperature must be between 0 and 10, got {temperature}")
    top_p = params.top_p if params.HasField("top_p") else None
    if top_p is not None and not 0 < top_p <= 1:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {top_p}")
    max_tokens = params.max_tokens if params.HasField("max_tokens") else settings.llm.default_max_tokens
    if not 1 <= max_tokens <= MAX_MAX_TOKENS:
        raise InvalidArgument(f"sampling.max_tokens must be between 1 and {MAX_MAX_TOKENS}, got {max_tokens}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop holds {len(params.stop)} strings; at most {MAX_STOP_STRINGS}")
    for stop in params.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(
                f"sampling.stop strings must be 1-{MAX_STOP_CHARS} characters, got one of {len(stop)}"
            )
    if len(params.model) > MAX_MODEL_CHARS:
        raise InvalidArgument(f"sampling.model is {len(params.model)} characters; at most {MAX_MODEL_CHARS}")
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=tuple(params.stop),
        seed=params.seed if params.HasField("seed") else None,
        model=params.model,
        chat_template_kwargs=MessageToDict(params.chat_template_kwargs),
    )


def _budget(request: v1.RolloutRequest, settings: Settings, needs: TaskNeeds) -> float:
    """The request's budget, else the default; at least what the task's own time limits need
    (a budget that ran out first would end the job before the task's limits could)."""
    jobs = settings.jobs
    if not request.limits.HasField("budget"):
        if needs.budget_s > jobs.max_budget_s:
            raise InvalidArgument(
                f"the task's own time limits ({needs.budget_from}) need a job budget of {needs.budget_s:g}s, "
                f"over this server's maximum of {jobs.max_budget_s:g}s (setting jobs.max_budget_s)"
            )
        return max(jobs.default_budget_s, needs.budget_s)
    budget = seconds(request.limits.budget)
    if budget <= 0:
        raise InvalidArgument(f"limits.budget must be positive, got {budget:g}s")
    if budget > jobs.max_budget_s:
        raise InvalidArgument(f"limits.budget {budget:g}s exceeds this server's maximum of {jobs.max_budget_s:g}s")
    if budget < needs.budget_s:
        raise InvalidArgument(
            f"limits.budget {budget:g}s is less than the {needs.budget_s:g}s the task's own time limits need "
            f"({needs.budget_from}): the budget would end the job before they do; give at least that, or none"
        )
    return budget


def _resources(request: v1.RolloutRequest, settings: Settings, needs: TaskNeeds) -> tuple[float, int]:
    """The sandboxes' CPUs and memory: the request's, else the task's own, else the defaults;
    a task asking for more than this server gives is refused, naming the setting."""
    box, spec = settings.sandbox, request.sandbox

    def pick(field: str, task: float | None, default: float, maximum: float, unit: str, max_unit: str) -> float:
        if spec.HasField(field):
            return float(getattr(spec, field))
        if task is None:
            return default
        if task > maximum:
            raise InvalidArgument(
                f"the task asks for {task:g} {unit} ({needs.resources_from}); this server gives a sandbox at most "
                f"{maximum:g}{max_unit} (setting sandbox.max_{field}); a request's sandbox.{field} may ask for less"
            )
        return task

    cpus = pick("cpus", needs.cpus, box.cpus, box.max_cpus, "CPUs", "")
    if not 0 < cpus <= box.max_cpus:
        raise InvalidArgument(f"sandbox.cpus must be in (0, {box.max_cpus:g}], got {cpus:g}")
    memory = int(pick("memory_mib", needs.memory_mib, box.memory_mib, box.max_memory_mib, "MiB of memory", " MiB"))
    if not 16 <= memory <= box.max_memory_mib:
        raise InvalidArgument(f"sandbox.memory_mib must be between 16 and {box.max_memory_mib}, got {memory}")
    return cpus, memory


def _limits(request: v1.RolloutRequest, settings: Settings, budget_s: float) -> Limits:
    jobs = settings.jobs
    limits = request.limits
    max_turns = limits.max_turns if limits.HasField("max_turns") else jobs.default_max_turns
    if not 1 <= max_turns <= jobs.max_turns_ceiling:
        raise InvalidArgument(f"limits.max_turns must be between 1 and {jobs.max_turns_ceiling}, got {max_turns}")
    tool_timeout = jobs.default_tool_timeout_s
    if limits.HasField("tool_timeout"):
        tool_timeout = seconds(limits.tool_timeout)
        if tool_timeout <= 0:
            raise InvalidArgument(f"limits.tool_timeout must be positive, got {tool_timeout:g}s")
        if tool_timeout > budget_s:
            raise InvalidArgument(
                f"limits.tool_timeout {tool_timeout:g}s exceeds the job's budget of {budget_s:g}s; "
                "a tool call cannot outlast the job"
            )
    tool_timeout = min(tool_timeout, budget_s)
    return Limits(max_turns=max_turns, tool_timeout_s=tool_timeout)


def check_cancel_reason(reason: str) -> None:
    if len(reason) > MAX_CANCEL_REASON_CHARS:
        raise InvalidArgument(f"reason is {len(reason)} characters; at most {MAX_CANCEL_REASON_CHARS}")


def _labels(request: v1.RolloutRequest) -> None:
    if len(request.group_id) > MAX_GROUP_ID_CHARS:
        raise InvalidArgument(f"group_id is {len(request.group_id)} characters; at most {MAX_GROUP_ID_CHARS}")
    if len(request.labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels, got {len(request.labels)}")
    for key, value in request.labels.items():
        if not key or len(key) > MAX_LABEL_CHARS or len(value) > MAX_LABEL_CHARS:
            raise InvalidArgument(f"label {key[:40]!r}: keys must be non-empty, keys and values ≤ {MAX_LABEL_CHARS}")


MAX_RESTARTS = 10


def _retry(request: v1.RolloutRequest, settings: Settings) -> None:
    restarts = request.retry.max_restarts
    if restarts > MAX_RESTARTS:
        raise InvalidArgument(f"retry.max_restarts must be at most {MAX_RESTARTS}, got {restarts}")
    if restarts and not settings.jobs.store:
        raise FailedPrecondition(
            "retry.max_restarts needs the durable job store, which this server runs without (jobs.store = false)"
        )


def _image(image: str, settings: Settings) -> str:
    """The image a job's sandboxes start from, if this server allows it (the request's,
    else the task instance's, else the default): an allow-list, because an image is code
    the server runs and it decides which sandbox mode and limits apply."""
    if not settings.sandbox.image_allowed(image):
        raise PermissionDenied(
            f"sandbox image {image[:200]!r} is not allowed on this server; allowed: "
            f"{', '.join(settings.sandbox.allowed_images)} (setting sandbox.allowed_images)",
            reason="image_not_allowed",
        )
    return image


def resolve_plan(request: v1.RolloutRequest, settings: Settings, registry: HandlerRegistry) -> JobPlan:
    if not request.handler:
        raise InvalidArgument(f"handler is empty; this server has: {', '.join(registry.names())}")
    handler = registry.get(request.handler)
    if request.instance.ByteSize() > settings.jobs.max_instance_bytes:
        raise InvalidArgument(
            f"instance is {request.instance.ByteSize()} bytes; the limit is {settings.jobs.max_instance_bytes}"
        )
    try:
        instance: dict[str, Any] = MessageToDict(request.instance)
    except ValueError as exc:  # NaN or infinity: JSON, and so the task, cannot carry them
        raise InvalidArgument(f"instance holds a value JSON cannot represent: {exc}") from None
    task = handler.validate(instance)
    _labels(request)
    _retry(request, settings)
    box = settings.sandbox
    spec = request.sandbox
    needs = handler.needs(task)
    cpus, memory = _resources(request, settings, needs)
    pids = spec.pids_limit if spec.HasField("pids_limit") else box.pids_limit
    if not 8 <= pids <= 65536:
        raise InvalidArgument(f"sandbox.pids_limit must be between 8 and 65536, got {pids}")
    budget_s = _budget(request, settings, needs)
    if request.min_policy_version < 0:
        raise InvalidArgument(f"min_policy_version must not be negative, got {request.min_policy_version}")
    return JobPlan(
        handler=handler,
        instance=task,
        limits=_limits(request, settings, budget_s),
        sampling=_sampling(request, settings),
        budget_s=budget_s,
        image=_image(spec.image or handler.image_for(task) or box.default_image, settings),
        cpus=cpus,
        memory_mib=memory,
        pids_limit=pids,
        priority=request.priority,
        min_policy_version=request.min_policy_version,
    )


MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


def check_page(page_size: int, page_token: str) -> tuple[int, int]:
    """ListJobs' paging as (page size, the job number the page starts after)."""
    if page_size < 0:
        raise InvalidArgument(f"page_size must not be negative, got {page_size}")
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    try:
        after = int(page_token) if page_token else 0
    except ValueError:
        raise InvalidArgument("page_token is not one this server issued; pass next_page_token as given") from None
    return size, after


def unknown_job(job_id: str) -> NotFound:
    return NotFound(f"no job with id {job_id!r} (never submitted, or finished and no longer retained)")
