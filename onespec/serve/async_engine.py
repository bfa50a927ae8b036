"""The one loop that owns the engine.

The engine is not thread-safe, so a single asyncio task makes every engine call:
pending `add` / `abort` commands are applied between steps on the event-loop thread, and
`engine.step()` runs on one dedicated worker thread while the task awaits it (the event loop
keeps serving HTTP meanwhile), so no two engine calls ever overlap and every step sees the
same thread-local torch state (CUDA stream, device). Each request gets an asyncio.Queue of
StepUpdates, filled on the event-loop thread after every step it advanced in.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from onespec.distributed import WorkerFailure
from onespec.engine.engine import Engine
from onespec.engine.request import Request, RequestMetrics, RequestTimes
from onespec.sampling_params import SamplingParams

logger = logging.getLogger("onespec.serve")


@dataclass
class StepUpdate:
    new_token_ids: list[int]
    finish_reason: str | None                  # set once the engine finished the request
    metrics: RequestMetrics
    error: str | None = None                   # the engine failed: the request is dropped
    logprobs: list | None = None               # entries of new_token_ids (if asked for)
    prompt_logprobs: list | None = None        # in a request's first update (if asked for)
    times: RequestTimes | None = None          # when it arrived, was scheduled, ...


@dataclass
class EngineSnapshot:
    """Engine numbers copied by the loop between steps, safe to read from any handler."""
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_waiting: int = 0
    num_running: int = 0
    stats: dict = field(default_factory=dict)


class EngineError(RuntimeError):
    """The engine step failed; the request was aborted."""


@dataclass
class _Stream:
    req: Request
    queue: asyncio.Queue
    num_sent: int = 0


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: deque = deque()
        self._streams: dict[str, _Stream] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.snapshot = EngineSnapshot()
        self.num_prompt_tokens = 0       # of requests added, and tokens sent to requests
        self.num_generated_tokens = 0    # (the periodic stats line reads them)
        self._take_snapshot()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self):
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onespec-step")
        self._task = asyncio.create_task(self._run(), name="onespec-engine-loop")

    async def stop(self):
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:       # noqa: BLE001 - the loop crashed: logged when it did
                pass
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- commands (called from request handlers) -----------------------------------------
    async def add(self, prompt_token_ids: list[int], sp: SamplingParams, request_id: str,
                  cache_salt: str | None = None, compiled_grammar=None) -> asyncio.Queue:
        """Queues the request for the loop; raises ValueError if the engine rejects it.
        cache_salt and compiled_grammar: as Engine.add_request takes them."""
        if not self.is_running:
            raise EngineError("the engine loop is not running")
        fut = asyncio.get_running_loop().create_future()
        self._commands.append(("add", (prompt_token_ids, sp, request_id, cache_salt,
                                       compiled_grammar), fut))
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(request_id)         # it may have been added just before the cancel
            raise

    async def ping(self):
        """Returns once the loop has been between two steps (for /health?deep=1)."""
        if not self.is_running:
            raise EngineError("the engine loop is not running")
        fut = asyncio.get_running_loop().create_future()
        self._commands.append(("ping", None, fut))
        self._wake.set()
        await fut

    async def flush_cache(self) -> int:
        """Between two steps, forgets the cached prefixes no request holds; returns the
        number of blocks freed (for a router's /flush_cache)."""
        if not self.is_running:
            raise EngineError("the engine loop is not running")
        fut = asyncio.get_running_loop().create_future()
        self._commands.append(("flush", None, fut))
        self._wake.set()
        return await fut

    def abort(self, request_id: str):
        """Aborts the request before the next step, freeing its KV blocks."""
        self._commands.append(("abort", request_id, None))
        if self._wake is not None:
            self._wake.set()

    async def updates(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[StepUpdate]:
        """Yields the StepUpdates of an added request, the last one finished. Closing the
        generator early (client gone, stop string) aborts the request."""
        finished = False
        try:
            while not finished:
                update: StepUpdate = await queue.get()
                if update.error is not None:
                    finished = True
                    raise EngineError(update.error)
                finished = update.finish_reason is not None
                yield update
        finally:
            if not finished:
                self.abort(request_id)

    # ---- the loop ------------------------------------------------------------------------
    async def _run(self):
        try:
            while True:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    if not self._commands:
                        await self._wake.wait()
                    continue
                try:
                    advanced = await asyncio.get_running_loop().run_in_executor(
                        self._executor, self.engine.step)
                except WorkerFailure:      # a tensor-parallel rank is gone: the loop ends
                    raise
                except Exception as e:     # not pinned on a request: fail those in flight
                    logger.exception("engine step failed; aborting all in-flight requests")
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    continue
                self._dispatch(advanced)
                self._take_snapshot()
        except Exception as e:             # a bug outside engine.step: nobody must hang
            logger.exception("the engine loop crashed")
            self._fail_all(f"the engine loop crashed: {type(e).__name__}: {e}")
            raise

    def _apply_commands(self):
        if not self._commands:
            return
        while self._commands:
            kind, arg, fut = self._commands.popleft()
            if kind == "abort":
                self._streams.pop(arg, None)
                self._abort(arg)
            elif kind == "ping":
                if not fut.done():
                    fut.set_result(None)
            elif kind == "flush":
                if not fut.done():
                    fut.set_result(self.engine.pool.flush_cache())
            elif not fut.done():           # done: the caller went away before it was applied
                self._add(fut, *arg)
        self._take_snapshot()

    def _add(self, fut: asyncio.Future, prompt_token_ids, sp, request_id: str, cache_salt,
             compiled_grammar):
        try:
            req = self.engine.add_request(prompt_token_ids, sp, request_id, cache_salt,
                                          compiled_grammar)
        except Exception as e:             # ValueError: bad request; the caller decides
            fut.set_exception(e)
            return
        self.num_prompt_tokens += len(req.prompt_token_ids)
        stream = _Stream(req, asyncio.Queue())
        self._streams[request_id] = stream
        fut.set_result(stream.queue)

    def _abort(self, request_id: str):
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)

    def _dispatch(self, advanced: list[Request]):
        for req in advanced:
            stream = self._streams.get(req.request_id)
            if stream is None:
                continue
            first, sent = stream.num_sent == 0, stream.num_sent
            new = req.output_token_ids[sent:]
            stream.num_sent += len(new)
            self.num_generated_tokens += len(new)
            reason = req.finish_reason if req.is_finished else None
            if reason == "error":          # this request alone failed in the engine step
                update = StepUpdate([], None, copy.copy(req.metrics),
                                    f"the engine failed on this request: {req.error}")
            else:
                update = StepUpdate(
                    new, reason, copy.copy(req.metrics),
                    logprobs=None if req.logprobs is None else req.logprobs[sent:],
                    prompt_logprobs=req.prompt_logprobs if first else None,
                    times=copy.copy(req.times))
            stream.queue.put_nowait(update)
            if req.is_finished:
                del self._streams[req.request_id]

    def _fail_all(self, message: str):
        """Ends every in-flight and queued request with an error update."""
        for request_id, stream in list(self._streams.items()):
            stream.queue.put_nowait(StepUpdate([], None, copy.copy(stream.req.metrics), message))
            self._abort(request_id)
        self._streams.clear()
        while self._commands:
            kind, arg, fut = self._commands.popleft()
            if kind != "abort" and not fut.done():
                fut.set_exception(EngineError(message))
        self._take_snapshot()

    def _take_snapshot(self):
        eng = self.engine
        self.snapshot = EngineSnapshot(eng.pool.num_blocks, eng.pool.num_free_blocks,
                                       len(eng.scheduler.waiting), len(eng.scheduler.running),
                                       eng.stats.as_dict())
