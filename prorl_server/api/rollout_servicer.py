"""RolloutService: proto in, manager call, proto out. No logic of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from prorl_client import v1
from prorl_server.api.errors import status_code
from prorl_server.errors import InvalidArgument, ProrlError
from prorl_server.jobs import wire
from prorl_server.jobs.feed import Feed
from prorl_server.jobs.service import JobService

# Responses buffered per RolloutStream before its watchers wait for the client.
STREAM_BUFFER = 256


class RolloutServicer(v1.RolloutServiceServicer):
    def __init__(self, jobs: JobService, feed: Feed) -> None:
        self._jobs = jobs
        self._feed = feed

    async def Rollout(  # noqa: N802
        self, request: v1.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[v1.RolloutResponse]:
        job, _ = await self._jobs.submit(request)
        async for event in self._jobs.watch(job.job_id):
            yield v1.RolloutResponse(event=event)

    async def RolloutStream(  # noqa: N802
        self, request_iterator: AsyncIterator[v1.RolloutStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[v1.RolloutStreamResponse]:
        """Submit each incoming request; merge the events of all of them.

        Leaving the stream (client gone) stops only the forwarding: the jobs
        go on and can be watched again.
        """
        out: asyncio.Queue[v1.RolloutStreamResponse | InvalidArgument | None] = asyncio.Queue(STREAM_BUFFER)
        watched: set[str] = set()

        async def forward(job_id: str) -> None:
            async for event in self._jobs.watch(job_id):
                await out.put(v1.RolloutStreamResponse(event=event))

        async def requests() -> AsyncIterator[v1.RolloutStreamRequest]:
            """The client's requests; one that cannot be read ends the stream with a status."""
            try:
                async for item in request_iterator:
                    yield item
            except Exception as exc:  # e.g. bytes that are not a RolloutStreamRequest
                await out.put(
                    InvalidArgument(
                        f"a message on the request stream could not be read ({type(exc).__name__}); "
                        "the stream is closed, jobs it already submitted go on and can be watched"
                    )
                )

        async def pump() -> None:
            async with asyncio.TaskGroup() as forwarders:
                async for item in requests():
                    try:
                        job, _ = await self._jobs.submit(item.rollout)
                    except ProrlError as exc:
                        rejected = v1.RolloutRejected(
                            job_id=item.rollout.job_id, code=status_code(exc).value[0], message=exc.message
                        )
                        await out.put(v1.RolloutStreamResponse(rejected=rejected))
                        continue
                    if job.job_id not in watched:
                        watched.add(job.job_id)
                        forwarders.create_task(forward(job.job_id))
            await out.put(None)

        pump_task = asyncio.create_task(pump())
        try:
            while (response := await out.get()) is not None:
                if isinstance(response, InvalidArgument):
                    raise response
                yield response
            await pump_task
        finally:
            pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump_task

    async def Submit(  # noqa: N802
        self, request: v1.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> v1.SubmitResponse:
        job, created = await self._jobs.submit(request.rollout)
        return v1.SubmitResponse(job=wire.job(job), created=created)

    async def Watch(  # noqa: N802
        self, request: v1.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[v1.WatchResponse]:
        async for event in self._jobs.watch(request.job_id, request.after_seq):
            yield v1.WatchResponse(event=event)

    async def GetJob(  # noqa: N802
        self, request: v1.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> v1.GetJobResponse:
        return v1.GetJobResponse(job=wire.job(await self._jobs.get(request.job_id)))

    async def ListJobs(  # noqa: N802
        self, request: v1.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> v1.ListJobsResponse:
        jobs, token = await self._jobs.list(
            statuses=list(request.statuses),
            labels=dict(request.labels),
            group_id=request.group_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return v1.ListJobsResponse(jobs=[wire.job(job) for job in jobs], next_page_token=token)

    async def Cancel(  # noqa: N802
        self, request: v1.CancelRequest, context: grpc.aio.ServicerContext
    ) -> v1.CancelResponse:
        job = await self._jobs.cancel(request.job_id, request.reason)
        return v1.CancelResponse(job=wire.job(job))

    async def ForkJob(  # noqa: N802
        self, request: v1.ForkJobRequest, context: grpc.aio.ServicerContext
    ) -> v1.ForkJobResponse:
        branches = await self._jobs.fork(request)
        return v1.ForkJobResponse(
            jobs=[wire.job(job) for job, _ in branches], created=[created for _, created in branches]
        )

    async def Subscribe(  # noqa: N802
        self, request: v1.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Each response is written while watching for the consumer to fall too far behind:
        a send that cannot complete (the consumer stopped reading) is given up, so that a
        stalled consumer is ended as one that reads too slowly is."""
        subscription = await self._feed.subscribe(request.filter, request.after_cursor)
        overrun = asyncio.ensure_future(subscription.overrun())
        try:
            async with contextlib.aclosing(subscription.responses()) as responses:
                async for response in responses:
                    write = asyncio.ensure_future(context.write(response))
                    await asyncio.wait({write, overrun}, return_when=asyncio.FIRST_COMPLETED)
                    if not write.done():
                        write.cancel()
                        raise subscription.too_slow(overrun.result())
                    write.result()
                    subscription.delivered()
                    if overrun.done():  # it judged the send that has just completed after all
                        overrun = asyncio.ensure_future(subscription.overrun())
        finally:
            overrun.cancel()
            subscription.close()
