"""The asyncio client: one method per RPC of the contract."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import grpc

from prorl_client import v1
from prorl_client._errors import RpcError

T = TypeVar("T")


async def _unary(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise RpcError.from_grpc(exc) from exc


async def _stream(call: AsyncIterable[T]) -> AsyncIterator[T]:
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as exc:
        raise RpcError.from_grpc(exc) from exc


class Client:
    """A connection to a prorl server.

    Create with `Client.connect(target)` (or `prorl_client.connect`) and close
    with `await client.close()`, or use `async with`.
    """

    def __init__(self, channel: grpc.aio.Channel, *, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._channel = channel
        self._metadata = tuple(metadata)
        self._rollouts = v1.RolloutServiceStub(channel)
        self._admin = v1.AdminServiceStub(channel)

    @classmethod
    def connect(
        cls,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, object]] = (),
    ) -> Client:
        """Open a channel to `target` ("host:port").

        credentials: TLS channel credentials (grpc.ssl_channel_credentials(...));
            None for a plaintext channel.
        token: a bearer token, sent as `authorization: Bearer <token>` with every call.
        metadata: more metadata sent with every call.
        options: gRPC channel options, e.g. ("grpc.max_receive_message_length", n).
        """
        if token:
            metadata = (("authorization", f"Bearer {token}"), *metadata)
        opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024), *options]
        if credentials is None:
            channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            channel = grpc.aio.secure_channel(target, credentials, options=opts)
        return cls(channel, metadata=metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def wait_ready(self) -> None:
        """Wait until the channel is connected; bound it with asyncio.timeout()."""
        await self._channel.channel_ready()

    # --- RolloutService ------------------------------------------------------

    async def rollout(self, request: v1.RolloutRequest) -> AsyncIterator[v1.RolloutEvent]:
        """Run one job; yields its events, the last one `finished`."""
        async for response in _stream(self._rollouts.Rollout(request, metadata=self._metadata)):
            yield response.event

    async def rollout_many(
        self, requests: Iterable[v1.RolloutRequest] | AsyncIterable[v1.RolloutRequest]
    ) -> AsyncIterator[v1.RolloutEvent | v1.RolloutRejected]:
        """Run many jobs over one stream.

        Yields the events of all jobs interleaved (tagged by job id), and a
        RolloutRejected for each request the server refused. Ends when every
        accepted job has finished.
        """

        async def outgoing() -> AsyncIterator[v1.RolloutStreamRequest]:
            if isinstance(requests, AsyncIterable):
                async for request in requests:
                    yield v1.RolloutStreamRequest(rollout=request)
            else:
                for request in requests:
                    yield v1.RolloutStreamRequest(rollout=request)

        call = self._rollouts.RolloutStream(outgoing(), metadata=self._metadata)
        async for response in _stream(call):
            if response.WhichOneof("kind") == "rejected":
                yield response.rejected
            else:
                yield response.event

    async def submit(self, request: v1.RolloutRequest) -> v1.SubmitResponse:
        """Queue a job; returns at once. Idempotent on request.job_id."""
        return await _unary(self._rollouts.Submit(v1.SubmitRequest(rollout=request), metadata=self._metadata))

    async def watch(self, job_id: str, *, after_seq: int = 0) -> AsyncIterator[v1.RolloutEvent]:
        """Replay a job's events after `after_seq`, then follow it to the end."""
        call = self._rollouts.Watch(v1.WatchRequest(job_id=job_id, after_seq=after_seq), metadata=self._metadata)
        async for response in _stream(call):
            yield response.event

    async def get_job(self, job_id: str) -> v1.Job:
        response: v1.GetJobResponse = await _unary(
            self._rollouts.GetJob(v1.GetJobRequest(job_id=job_id), metadata=self._metadata)
        )
        return response.job

    async def list_jobs(
        self,
        *,
        statuses: Sequence[v1.JobStatus] = (),
        labels: Mapping[str, str] | None = None,
        group_id: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> v1.ListJobsResponse:
        """One page of jobs, oldest first; follow `next_page_token` for more."""
        request = v1.ListJobsRequest(
            statuses=statuses,
            labels=dict(labels or {}),
            group_id=group_id,
            page_size=page_size,
            page_token=page_token,
        )
        return await _unary(self._rollouts.ListJobs(request, metadata=self._metadata))

    async def cancel(self, job_id: str, *, reason: str = "") -> v1.Job:
        request = v1.CancelRequest(job_id=job_id, reason=reason)
        response: v1.CancelResponse = await _unary(self._rollouts.Cancel(request, metadata=self._metadata))
        return response.job

    # --- AdminService --------------------------------------------------------

    async def add_backend(self, backend: v1.Backend) -> v1.Backend:
        request = v1.AddBackendRequest(backend=backend)
        response: v1.AddBackendResponse = await _unary(self._admin.AddBackend(request, metadata=self._metadata))
        return response.backend

    async def remove_backend(self, backend_id: str) -> None:
        request = v1.RemoveBackendRequest(backend_id=backend_id)
        await _unary(self._admin.RemoveBackend(request, metadata=self._metadata))

    async def list_backends(self) -> list[v1.Backend]:
        response = await _unary(self._admin.ListBackends(v1.ListBackendsRequest(), metadata=self._metadata))
        return list(response.backends)

    async def pause(self, *, abort_in_flight: bool = False) -> v1.PauseResponse:
        """Stop new generation before a weight update (see AdminService.Pause)."""
        request = v1.PauseRequest(abort_in_flight=abort_in_flight)
        return await _unary(self._admin.Pause(request, metadata=self._metadata))

    async def resume(self, *, policy_version: int | None = None) -> int:
        """Resume generation; returns the policy version now in force."""
        request = v1.ResumeRequest(policy_version=policy_version)
        response: v1.ResumeResponse = await _unary(self._admin.Resume(request, metadata=self._metadata))
        return response.policy_version

    async def get_stats(self) -> v1.GetStatsResponse:
        return await _unary(self._admin.GetStats(v1.GetStatsRequest(), metadata=self._metadata))


def connect(target: str, **kwargs: object) -> Client:
    """Shorthand for `Client.connect(target, **kwargs)`."""
    return Client.connect(target, **kwargs)  # type: ignore[arg-type]
