"""/v1/completions and /v1/chat/completions: a Reply's jobs -> engine loop -> response.

A request is admitted first (admission.py: parsed, tokenized, its grammar compiled), so
what reaches the engine is valid. Once queued, a request is aborted as soon as its client
goes away: a closed stream cancels the SSE generator, a non-stream request is raced
against a disconnect watcher; either way the engine-loop generator's `finally` aborts and
frees KV blocks.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from onespec.serve.admission import Admission, first_or_disconnect
from onespec.serve.async_engine import EngineError, EngineLoop
from onespec.serve.errors import STATUS_CLIENT_CLOSED, APIError
from onespec.serve.limits import ServerLimits
from onespec.serve.metrics import ServerMetrics
from onespec.serve.responses import CHAT, SSE_DONE, Job, Reply, sse


class AbortingStreamingResponse(StreamingResponse):
    """Closes its body iterator and calls on_close however the response ends, so a
    client gone mid-stream never leaves its request running (whatever the ASGI server)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()




class OpenAIServing(Admission):
    """Turns request bodies into engine requests (Admission) and engine updates into
    responses."""

    def __init__(self, loop: EngineLoop, served_model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits | None = None, tool_call_parser: str | None = None):
        super().__init__(loop, served_model_name, limits, tool_call_parser)
        self.metrics = metrics

    # ---- jobs -> responses ---------------------------------------------------------------
    async def serve(self, reply: Reply, request: Request, stream: bool) -> Response:
        """Runs the reply's jobs in the engine. The first sample of each prompt is added
        first; its other samples once it has its first token, so that they find the
        prompt's KV in the prefix cache instead of computing it again."""
        firsts = [job for job in reply.jobs if job.counts_prompt]
        queues = {job.index: await self._add(job) for job in firsts}   # 400s before replying
        prefilled = {job.index: asyncio.Event() for job in firsts}
        leader = {}
        for job in reply.jobs:
            leader[job.index] = job.index if job.counts_prompt else leader[job.index - 1]

        async def updates(job: Job):
            if not job.counts_prompt:
                await prefilled[leader[job.index]].wait()
                queues[job.index] = await self._add(job)
            it = self._advance(reply, job, self.loop.updates(job.request_id,
                                                             queues[job.index]))
            async with aclosing(it):
                async for item in it:
                    if job.counts_prompt:
                        prefilled[job.index].set()
                    yield item
            if job.counts_prompt:
                prefilled[job.index].set()    # (failed before its first token)

        streams = [updates(job) for job in reply.jobs]
        if stream:
            return AbortingStreamingResponse(
                self._sse(reply, streams), on_close=lambda: self._abort(reply),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._complete(reply, streams, request)

    async def _add(self, job: Job) -> asyncio.Queue:
        try:
            return await self.loop.add(job.prompt_token_ids, job.sampling_params,
                                       job.request_id, cache_salt=job.cache_salt,
                                       compiled_grammar=job.compiled_grammar)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise APIError(str(e), param=field if field in ("stop_token_ids", "logit_bias")
                           else None) from None
        except EngineError as e:
            raise APIError(str(e), status=503) from None

    def _abort(self, reply: Reply):
        for job in reply.jobs:
            self.loop.abort(job.request_id)

    async def _advance(self, reply: Reply, job: Job,
                       updates) -> AsyncIterator[tuple[Job, str, list[int]]]:
        """Yields (job, text delta, new token ids) per engine step until the job is
        finished; records the request in the metrics however it ends (with the times its
        tokens arrived, for the latency histograms)."""
        token_times: list[float] = []
        times = None
        try:
            async with aclosing(updates) as it:
                async for u in it:
                    if u.new_token_ids:
                        token_times.append(time.monotonic())
                    times = u.times
                    job.metrics = u.metrics
                    if u.prompt_logprobs is not None:
                        job.prompt_logprobs = u.prompt_logprobs
                    if reply.echo_only:       # the one token decoded is dropped
                        u.new_token_ids, u.logprobs = [], None
                    if u.logprobs is not None:
                        job.logprobs += u.logprobs
                    delta = job.detok.update(u.new_token_ids, u.finish_reason is not None)
                    job.finish_reason = "stop" if job.detok.stopped else u.finish_reason
                    yield job, delta, u.new_token_ids
                    if job.finish_reason is not None:
                        return          # a stop string: closing `updates` aborts the request
        finally:
            self.metrics.record_request(reply.kind, job.finish_reason or "abort",
                                        len(job.prompt_token_ids), job.metrics, times,
                                        token_times, token_times[-1] if token_times else None)

    async def _complete(self, reply: Reply, streams: list, request: Request) -> Response:
        async def consume():
            async with aclosing(merge(streams)) as it:
                async for _ in it:
                    pass

        work = asyncio.ensure_future(consume())
        if not await first_or_disconnect(work, request):
            self._abort(reply)
            return Response(status_code=STATUS_CLIENT_CLOSED)
        if isinstance(work.exception(), EngineError):
            raise APIError(str(work.exception()), status=500)
        work.result()
        return JSONResponse(reply.response())

    async def _sse(self, reply: Reply, streams: list) -> AsyncIterator[str]:
        if reply.kind == CHAT:
            for job in reply.jobs:
                yield reply.chunk(job, "", role=True)
        try:
            async with aclosing(merge(streams)) as it:
                async for job, delta, token_ids in it:
                    if reply.tools is not None:
                        for chunk in reply.tool_chunks(job, token_ids):
                            yield chunk
                    elif delta or job.finish_reason or (token_ids and (
                            reply.return_token_ids or reply.logprobs is not None)):
                        yield reply.chunk(job, delta, token_ids, job.finish_reason)
        except EngineError as e:
            yield sse(APIError(str(e), status=500).body())
        else:
            if reply.include_usage:
                yield reply.usage_chunk()
        yield SSE_DONE


async def merge(streams: list) -> AsyncIterator:
    """The items of several async generators as they come; an exception in one ends all
    (each generator is closed however the merge ends)."""
    if len(streams) == 1:                 # the common case: no tasks needed
        async with aclosing(streams[0]) as it:
            async for item in it:
                yield item
        return
    done = object()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen):
        try:
            async with aclosing(gen) as it:
                async for item in it:
                    await queue.put((item, None))
        except Exception as e:            # noqa: BLE001 - handed to the consumer
            await queue.put((None, e))
        await queue.put((done, None))

    tasks = [asyncio.ensure_future(pump(g)) for g in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
