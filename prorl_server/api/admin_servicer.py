"""AdminService: the backend pool and the server's load."""

from __future__ import annotations

import re
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from prorl_client import v1
from prorl_server.errors import InvalidArgument
from prorl_server.jobs.manager import JobManager
from prorl_server.llm.base import LLMBackend
from prorl_server.llm.factory import BackendSpec, build_backend
from prorl_server.llm.router import BackendEntry

BACKEND_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


KIND_NAMES = {
    "openai_chat": v1.BACKEND_KIND_OPENAI_CHAT,
    "vllm": v1.BACKEND_KIND_VLLM,
    "sglang": v1.BACKEND_KIND_SGLANG,
    "embedded": v1.BACKEND_KIND_EMBEDDED,
}
ADDABLE_KINDS = {value: name for name, value in KIND_NAMES.items() if name != "embedded"}
LOGPROBS_MODES = {"processed": v1.LOGPROBS_MODE_PROCESSED, "raw": v1.LOGPROBS_MODE_RAW}


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(values)
    return message


def backend_to_proto(entry: BackendEntry) -> v1.Backend:
    info = entry.backend.info
    return v1.Backend(
        id=info.id,
        kind=KIND_NAMES.get(info.kind, v1.BACKEND_KIND_UNSPECIFIED),
        base_url=info.base_url,
        model=info.model,
        max_in_flight=info.max_in_flight,
        tokenizer_path=str(info.extra.get("tokenizer_path", "")),
        weight=info.weight,
        tool_call_parser=info.tool_call_parser,
        chat_template_kwargs=_struct(info.chat_template_kwargs) if info.chat_template_kwargs else None,
        logprobs_mode=LOGPROBS_MODES.get(info.logprobs_mode, v1.LOGPROBS_MODE_UNSPECIFIED),
        state=v1.BackendState(
            healthy=entry.healthy,
            in_flight=entry.in_flight,
            requests_total=entry.requests_total,
            errors_total=entry.errors_total,
            managed=entry.managed,
        ),
    )


def backend_from_proto(backend: v1.Backend, *, timeout_s: float, max_retries: int) -> LLMBackend:
    if not BACKEND_ID.match(backend.id):
        raise InvalidArgument(f"backend.id {backend.id[:80]!r} is invalid: use 1-64 characters of A-Z a-z 0-9 . _ : -")
    if backend.kind not in ADDABLE_KINDS:
        raise InvalidArgument(
            f"backend.kind {v1.BackendKind.Name(backend.kind)} cannot be added; use "
            "BACKEND_KIND_OPENAI_CHAT, BACKEND_KIND_VLLM or BACKEND_KIND_SGLANG"
        )
    if not backend.base_url.startswith(("http://", "https://")):
        raise InvalidArgument(
            f"backend.base_url must be an http(s) URL such as http://host:8000/v1, got {backend.base_url!r}"
        )
    if backend.weight < 0:
        raise InvalidArgument(f"backend.weight must not be negative, got {backend.weight:g}")
    if backend.max_in_flight < 0:
        raise InvalidArgument(f"backend.max_in_flight must not be negative, got {backend.max_in_flight}")
    spec = BackendSpec(
        id=backend.id,
        kind=ADDABLE_KINDS[backend.kind],
        base_url=backend.base_url,
        model=backend.model,
        api_key=backend.api_key,
        max_in_flight=backend.max_in_flight,
        tokenizer_path=backend.tokenizer_path,
        weight=backend.weight or 1.0,
        tool_call_parser=backend.tool_call_parser or "hermes",
        chat_template_kwargs=json_format.MessageToDict(backend.chat_template_kwargs),
        logprobs_mode="raw" if backend.logprobs_mode == v1.LOGPROBS_MODE_RAW else "processed",
    )
    return build_backend(spec, timeout_s=timeout_s, max_retries=max_retries)


class AdminServicer(v1.AdminServiceServicer):
    def __init__(self, manager: JobManager, *, request_timeout_s: float, max_retries: int) -> None:
        self._manager = manager
        self._timeout_s = request_timeout_s
        self._max_retries = max_retries

    async def AddBackend(  # noqa: N802
        self, request: v1.AddBackendRequest, context: grpc.aio.ServicerContext
    ) -> v1.AddBackendResponse:
        backend = backend_from_proto(request.backend, timeout_s=self._timeout_s, max_retries=self._max_retries)
        entry = self._manager.pool.add(backend)
        return v1.AddBackendResponse(backend=backend_to_proto(entry))

    async def RemoveBackend(  # noqa: N802
        self, request: v1.RemoveBackendRequest, context: grpc.aio.ServicerContext
    ) -> v1.RemoveBackendResponse:
        await self._manager.pool.remove(request.backend_id)
        return v1.RemoveBackendResponse()

    async def ListBackends(  # noqa: N802
        self, request: v1.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> v1.ListBackendsResponse:
        return v1.ListBackendsResponse(backends=[backend_to_proto(e) for e in self._manager.pool.entries()])

    async def Pause(  # noqa: N802
        self, request: v1.PauseRequest, context: grpc.aio.ServicerContext
    ) -> v1.PauseResponse:
        pool = self._manager.pool
        aborted = pool.pause(abort_in_flight=request.abort_in_flight)
        return v1.PauseResponse(aborted=aborted, policy_version=pool.policy_version)

    async def Resume(  # noqa: N802
        self, request: v1.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> v1.ResumeResponse:
        version = request.policy_version if request.HasField("policy_version") else None
        if version is not None and version < 0:
            raise InvalidArgument(f"policy_version must not be negative, got {version}")
        return v1.ResumeResponse(policy_version=self._manager.pool.resume(version))

    async def GetStats(  # noqa: N802
        self, request: v1.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> v1.GetStatsResponse:
        manager = self._manager
        stats = manager.stats()
        by_status = stats["by_status"]
        assert isinstance(by_status, dict)
        return v1.GetStatsResponse(
            phases=[
                v1.PhaseStats(phase=phase, queued=gate.queued, active=gate.active, limit=gate.limit)
                for phase, gate in manager.gates.items()
            ],
            sandboxes_busy=manager.sandboxes.busy,
            pools=[
                v1.SandboxPoolStats(
                    image=p.image,
                    cpus=p.cpus,
                    memory_mib=p.memory_mib,
                    pids_limit=p.pids_limit,
                    warm=p.warm,
                    busy=p.busy,
                    target=p.target,
                )
                for p in manager.sandboxes.stats()
            ],
            jobs=[v1.JobStatusCount(status=status, count=count) for status, count in sorted(by_status.items())],
            backends=[backend_to_proto(e) for e in manager.pool.entries()],
            policy_version=manager.pool.policy_version,
            paused=manager.pool.paused,
        )
