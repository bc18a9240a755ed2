"""The asyncio client: one method per RPC of the contract, plus `follow`, a Watch that
survives the loss of its server.

One client can stand for several servers sharing a job store: `Client.connect`
takes a list of addresses, or a DNS name with many addresses, and balances calls
over them with gRPC's `round_robin` policy. Each call (a stream included) goes to
one server; when a server goes away its calls fail with UNAVAILABLE and new calls
go to the servers left, so `follow` resumes a job's events on another server from
the last sequence number it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import random
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import grpc

from prorl_client import v1
from prorl_client._errors import RpcError

T = TypeVar("T")

LoadBalancing = Literal["round_robin", "pick_first"]

# `follow` waits this long at most between two attempts.
MAX_BACKOFF_S = 10.0
# Subscribe streams that `follow_feed` resumes.
RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)


async def _unary(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise RpcError.from_grpc(exc) from exc


async def _stream(call: AsyncIterable[T]) -> AsyncIterator[T]:
    """The call's messages; leaving early (closing the iterator) cancels the call, so the
    server stops sending at once rather than when the call is garbage-collected."""
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as exc:
        raise RpcError.from_grpc(exc) from exc
    finally:
        if isinstance(call, grpc.aio.Call):
            call.cancel()


def multi_address_target(addresses: Sequence[str]) -> str:
    """One gRPC target for several servers given as "IP:PORT" ("[IPv6]:PORT"):
    `ipv4:10.0.0.1:50051,10.0.0.2:50051` (or `ipv6:...`), as gRPC's core resolves it.

    Raises ValueError for anything but IP addresses with ports of one family:
    gRPC's address lists take no host names (a name with many addresses is
    one target, `dns:///NAME:PORT`).
    """
    if not addresses:
        raise ValueError("no server addresses given")
    versions = set()
    for address in addresses:
        host, _, port = address.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        try:
            ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
        except ValueError:
            raise ValueError(
                f"{address!r} is not IP:PORT; a list takes IP addresses (IPv6 as [IP]:PORT), "
                "a host name with many addresses is one target: 'dns:///NAME:PORT'"
            ) from None
        if bracketed != (ip.version == 6) or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{address!r} is not IP:PORT (IPv6 as [IP]:PORT)")
        versions.add(ip.version)
    if len(versions) > 1:
        raise ValueError("a list of servers takes IPv4 or IPv6 addresses, not both")
    return f"ipv{versions.pop()}:" + ",".join(addresses)


def _channel_options(
    options: Sequence[tuple[str, object]], load_balancing: LoadBalancing | None, *, implied: LoadBalancing | None
) -> list[tuple[str, object]]:
    """The channel's options: ours, the caller's, then the balancing policy as a service
    config, the one given or else the one the target implies. A "grpc.service_config" of
    the caller's own replaces an implied policy and cannot be combined with a given one."""
    opts: list[tuple[str, object]] = [("grpc.max_receive_message_length", 64 * 1024 * 1024), *options]
    if load_balancing not in (None, "round_robin", "pick_first"):
        raise ValueError(f"load_balancing must be 'round_robin' or 'pick_first', got {load_balancing!r}")
    if any(name == "grpc.service_config" for name, _ in options):
        if load_balancing is not None:
            raise ValueError("give load_balancing or a grpc.service_config option, not both")
        return opts
    policy = load_balancing or implied
    if policy is None:
        return opts
    return [*opts, ("grpc.service_config", json.dumps({"loadBalancingConfig": [{policy: {}}]}))]


class Client:
    """A connection to a prorl server, or to several that share a job store.

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
        target: str | Sequence[str],
        *,
        load_balancing: LoadBalancing | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, object]] = (),
    ) -> Client:
        """Open a channel to `target`: one server ("host:port"), a DNS name that
        resolves to several ("dns:///prorl.example:50051"), or a list of servers'
        "IP:PORT" (["10.0.0.1:50051", "10.0.0.2:50051"], IPv6 as "[IP]:PORT").

        load_balancing: how calls are spread over the target's addresses, set as
            the channel's service config: "round_robin" (each call to the next
            ready server) or "pick_first" (all calls to one server until it goes
            away). None: "round_robin" for a list, gRPC's default ("pick_first")
            for a single target. An own "grpc.service_config" in `options` takes
            the place of the implied one.
        credentials: TLS channel credentials (grpc.ssl_channel_credentials(...));
            None for a plaintext channel. Over a list of addresses, also name the
            host the servers' certificates are for:
            options=[("grpc.ssl_target_name_override", "prorl.example")].
        token: a bearer token, sent as `authorization: Bearer <token>` with every call.
        metadata: more metadata sent with every call.
        options: gRPC channel options, e.g. ("grpc.max_receive_message_length", n).
        """
        if token:
            metadata = (("authorization", f"Bearer {token}"), *metadata)
        implied: LoadBalancing | None = None
        if not isinstance(target, str):
            target, implied = multi_address_target(target), "round_robin"
        opts = _channel_options(options, load_balancing, implied=implied)
        if credentials is None:
            channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            channel = grpc.aio.secure_channel(target, credentials, options=opts)
        return cls(channel, metadata=metadata)

    async def close(self) -> None:
        """Close the channel; calls under way are cancelled."""
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

    async def watch(self, job_id: str, *, after_seq: int = 0) -> AsyncGenerator[v1.RolloutEvent, None]:
        """Replay a job's events after `after_seq`, then follow it to the end."""
        call = self._rollouts.Watch(v1.WatchRequest(job_id=job_id, after_seq=after_seq), metadata=self._metadata)
        async for response in _stream(call):
            yield response.event

    async def follow(
        self, job_id: str, *, after_seq: int = 0, retries: int = 5, backoff_s: float = 0.2
    ) -> AsyncIterator[v1.RolloutEvent]:
        """Like `watch`, but carries on when the stream's server goes away.

        When the stream breaks with UNAVAILABLE (its server stopped, restarted
        or is unreachable), Watch is called again after the last seq seen; on a
        channel over several servers sharing a job store that call goes to
        another one. Each event is yielded once, in order, to the job's end.

        retries: how many times in a row a broken stream is resumed without an
            event coming in between; then its RpcError is raised. Any other
            error is raised at once.
        backoff_s: the wait before the first resumption; it doubles with each
            further one in a row (up to 10 s), randomised by up to half so that
            many followers do not resume in step.
        """
        failures = 0
        while True:
            try:
                async with contextlib.aclosing(self.watch(job_id, after_seq=after_seq)) as events:
                    async for event in events:
                        if event.seq <= after_seq:
                            continue  # already yielded before a resumption
                        failures = 0
                        after_seq = event.seq
                        yield event
                return
            except RpcError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE or failures >= retries:
                    raise
            delay = min(MAX_BACKOFF_S, backoff_s * 2**failures)
            failures += 1
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def subscribe(
        self,
        *,
        after_cursor: str = "",
        handlers: Sequence[str] = (),
        group_ids: Sequence[str] = (),
        labels: Mapping[str, str] | None = None,
        statuses: Sequence[v1.JobStatus] = (),
        event_kinds: Sequence[str] = (),
    ) -> AsyncGenerator[v1.FeedEvent, None]:
        """The events of every job that match the filter, from the service's feed, one
        FeedEvent each with its cursor; a progress mark (no event matched up to a cursor)
        is a FeedEvent with only a cursor. The server sends events in batches
        (SubscribeResponse.events); this yields them one by one. after_cursor: "" from
        now, "oldest" from the oldest kept, or a cursor yielded to go on after it."""
        request = v1.SubscribeRequest(
            filter=v1.EventFilter(
                handlers=handlers,
                group_ids=group_ids,
                labels=dict(labels or {}),
                statuses=statuses,
                event_kinds=event_kinds,
            ),
            after_cursor=after_cursor,
        )
        async for response in _stream(self._rollouts.Subscribe(request, metadata=self._metadata)):
            for event in response.events:
                yield event
            if not response.events or response.cursor != response.events[-1].cursor:
                yield v1.FeedEvent(cursor=response.cursor)  # a progress mark (past the events)

    async def follow_feed(
        self, *, after_cursor: str = "", retries: int = 5, backoff_s: float = 0.2, **filter: Any
    ) -> AsyncIterator[v1.FeedEvent]:
        """Like `subscribe`, but goes on after the stream ends with UNAVAILABLE (its server
        went away; on a channel over servers sharing a store, another one takes over),
        CANCELLED (its server stopped and cancelled the call) or RESOURCE_EXHAUSTED (this
        consumer fell behind): Subscribe again after the last cursor yielded. So each
        matching event is yielded once, in order, for as long as the caller reads, until
        `retries` attempts in a row fail (waits of `backoff_s` doubling, randomised, as for
        `follow`): then the last error is raised. OUT_OF_RANGE (events lost to retention)
        and any other error are raised at once."""
        failures = 0
        while True:
            try:
                async with contextlib.aclosing(self.subscribe(after_cursor=after_cursor, **filter)) as stream:
                    async for response in stream:
                        failures = 0  # an event or a progress mark: the stream works again
                        after_cursor = response.cursor
                        yield response
            except RpcError as exc:
                if exc.code not in RESUMABLE or failures >= retries:
                    raise
            delay = min(MAX_BACKOFF_S, backoff_s * 2**failures)
            failures += 1
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def get_job(self, job_id: str) -> v1.Job:
        """A job's status, phase, labels and times, with its result once it ended; NOT_FOUND if
        the server never had it or no longer retains it."""
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
        """Cancel a job wherever it is (its model request, its sandbox commands, its containers)
        and return it once its sandboxes are gone; a job that already ended keeps its result."""
        request = v1.CancelRequest(job_id=job_id, reason=reason)
        response: v1.CancelResponse = await _unary(self._rollouts.Cancel(request, metadata=self._metadata))
        return response.job

    async def fork_job(self, job_id: str, after_turn: int, branches: Sequence[v1.ForkBranch]) -> v1.ForkJobResponse:
        """Branch a forkable job (running or finished) after its model turn `after_turn` into
        one new job per branch, each starting from the job's exact token ids and sandbox files
        at that turn; returns the new jobs in the branches' order."""
        request = v1.ForkJobRequest(job_id=job_id, after_turn=after_turn, branches=list(branches))
        response: v1.ForkJobResponse = await _unary(self._rollouts.ForkJob(request, metadata=self._metadata))
        return response

    # --- AdminService --------------------------------------------------------

    async def add_backend(self, backend: v1.Backend) -> v1.Backend:
        """Add an LLM backend at run time; returns it as the server holds it."""
        request = v1.AddBackendRequest(backend=backend)
        response: v1.AddBackendResponse = await _unary(self._admin.AddBackend(request, metadata=self._metadata))
        return response.backend

    async def remove_backend(self, backend_id: str) -> None:
        """Remove a backend: its jobs finish their current request there and move on."""
        request = v1.RemoveBackendRequest(backend_id=backend_id)
        await _unary(self._admin.RemoveBackend(request, metadata=self._metadata))

    async def list_backends(self) -> list[v1.Backend]:
        """The server's LLM backends, with their health and load."""
        response = await _unary(self._admin.ListBackends(v1.ListBackendsRequest(), metadata=self._metadata))
        return list(response.backends)

    async def list_judge_backends(self) -> list[v1.Backend]:
        """The judge pool's backends (settings `judge.*`), with their health and load; empty when
        the judges share the policy's pool (judge.use_policy_backends)."""
        response = await _unary(self._admin.ListBackends(v1.ListBackendsRequest(), metadata=self._metadata))
        return list(response.judge_backends)

    async def pause(self, *, abort_in_flight: bool = False) -> v1.PauseResponse:
        """Stop new generation before a weight update (see AdminService.Pause)."""
        request = v1.PauseRequest(abort_in_flight=abort_in_flight)
        return await _unary(self._admin.Pause(request, metadata=self._metadata))

    async def resume(self, *, policy_version: int | None = None) -> int:
        """Resume generation; returns the policy version now in force."""
        request = v1.ResumeRequest(policy_version=policy_version)
        response: v1.ResumeResponse = await _unary(self._admin.Resume(request, metadata=self._metadata))
        return response.policy_version

    async def update_weights(
        self,
        model_path: str,
        *,
        backend_ids: Sequence[str] = (),
        policy_version: int | None = None,
        resume: bool = False,
    ) -> v1.UpdateWeightsResponse:
        """Load a checkpoint into the backends while generation is paused (see
        AdminService.UpdateWeights); with resume, generation resumes under the
        new policy version once every backend serves it."""
        request = v1.UpdateWeightsRequest(
            model_path=model_path, backend_ids=list(backend_ids), policy_version=policy_version, resume=resume
        )
        return await _unary(self._admin.UpdateWeights(request, metadata=self._metadata))

    async def get_stats(self, *, include_cluster: bool = False) -> v1.GetStatsResponse:
        """The server's load; with include_cluster, also every server of its cluster
        (servers sharing a PostgreSQL job store) and the cluster's jobs by status."""
        request = v1.GetStatsRequest(include_cluster=include_cluster)
        return await _unary(self._admin.GetStats(request, metadata=self._metadata))


# `prorl_client.connect(...)` is `Client.connect(...)`, the same parameters by construction.
connect = Client.connect
