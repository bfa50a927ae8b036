"""Continuous batching with chunked prefill, K+1 verify slots per generation request, and
preemption by recompute when the block pool runs dry. On a target whose every attention
layer slides (`sliding_window`), a request's blocks behind its window go back to the pool
as it advances."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from onespec.engine.kv_cache import BlockPool
from onespec.engine.request import Request, RequestStatus
from onespec.speculative.shape import ChainShape, TreeShape


@dataclass
class ContextChunk:
    req: Request
    start: int            # first position of the chunk
    length: int
    is_last: bool         # the chunk reaches the end of token_ids: its logits give a token
    first: bool = False   # the first chunk since (re)admission: tokens before start were cached


@dataclass
class ScheduledBatch:
    context: list[ContextChunk]
    generation: list[Request]
    k: int                # draft length of this step

    @property
    def requests(self) -> list[Request]:
        return [c.req for c in self.context] + self.generation


@dataclass
class StepOutput:
    """Host-side results of one step, in batch order."""
    context_tokens: list[int]           # [Bc] token sampled at each context chunk's last row
    accepted: list[list[int]]           # [Bg][K+1]
    num_accepted: list[int]             # [Bg]
    drafts: list[list[int]]             # [B][K] next draft tokens (context first)
    relaxed: list[list[int]] | None = None  # [Bg][K] 1: draft accepted by the relaxed rule only
    draft_parents: list[list[int]] | None = None  # [B][N] parents of the drafted tree (trees)
    logprobs: dict | None = None        # {logit row: {token: Logprob}} of emitted tokens' rows
    prompt_logprobs: dict | None = None  # {context chunk: [{token: Logprob}]} prompt tokens


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_tokens: int, max_batch_size: int,
                 max_model_len: int, has_drafter: bool, eos_token_ids: tuple[int, ...],
                 shape: ChainShape | TreeShape | None = None, states=None,
                 sliding_window: int | None = None):
        self.pool = pool
        # every attention layer's window (target and drafter alike), or None: blocks
        # behind it are released while the request runs
        self.sliding_window = sliding_window
        self.states = states      # StatePool of a hybrid target (state_pool.py), or None
        self.shape = shape or ChainShape(has_drafter)   # rows and slots a step takes
        self.max_num_tokens, self.max_batch_size = max_num_tokens, max_batch_size
        self.max_model_len = max_model_len
        self.has_drafter = has_drafter
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_candidates(self) -> int:
        return min(self.max_batch_size, len(self.running) + len(self.waiting))

    # ---- slot reservations -------------------------------------------------------------
    def _gen_slots(self, req: Request, k: int) -> int:
        return req.num_computed + self.shape.gen_slots(k)

    def reserve_ahead(self, req: Request, k: int) -> bool:
        """For a step launched before the one in flight is read (the overlap scheduler):
        slots for a step of k drafts after req accepts up to k + 1 more tokens, and no way
        for those tokens to end req by length. False (nothing preempted) otherwise."""
        sp = req.sampling_params
        if len(req.output_token_ids) + k + 1 >= sp.max_tokens or \
                req.num_tokens + k + 1 >= self.max_model_len:
            return False
        slots = self._gen_slots(req, k) + k + 1
        if not self.pool.can_allocate(req.block_table, slots):
            return False
        self.pool.allocate(req.block_table, slots)
        return True

    def _ctx_slots(self, chunk_end: int, is_last: bool, k: int) -> int:
        return chunk_end + (self.shape.ctx_slots(k) if is_last else 0)

    # ---- schedule ----------------------------------------------------------------------
    def schedule(self, k: int) -> ScheduledBatch:
        budget = self.max_num_tokens
        context: list[ContextChunk] = []
        generation: list[Request] = []
        scheduled = 0
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or scheduled >= self.max_batch_size:
                continue
            if req.in_context:
                length = min(req.num_tokens - req.num_computed, budget)
                if length <= 0:
                    continue
                end = req.num_computed + length
                is_last = end == req.num_tokens
                slots = self._ctx_slots(end, is_last, k)
            else:
                length = self.shape.verify_rows(k)
                if budget < length:
                    continue
                slots = self._gen_slots(req, k)
            if not self._reserve(req, slots):
                continue
            budget -= length
            scheduled += 1
            if req.in_context:
                context.append(ContextChunk(req, req.num_computed, length, is_last))
            else:
                generation.append(req)
        while self.waiting and budget > 0 and scheduled < self.max_batch_size:
            req = self.waiting[0]
            hits = self.pool.match_prefix(req)
            start = len(hits) * self.pool.block_size
            length = min(req.num_tokens - start, budget)
            end = start + length
            is_last = end == req.num_tokens
            slots = self._ctx_slots(end, is_last, k)
            behind = self._blocks_behind_window(start)     # hits the chunk cannot see
            if not self.pool.can_admit(hits, slots, behind) or \
                    (self.states is not None and not self.states.num_free):
                break
            self.pool.admit(req, hits, slots, behind)
            if self.states is not None:
                req.state_slot = self.states.allocate()
            req.num_computed = start
            if req.metrics.num_cached_tokens is None:      # (not again after preemption)
                req.metrics.num_cached_tokens = start
                req.times.first_scheduled_time = time.monotonic()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            context.append(ContextChunk(req, start, length, is_last, first=True))
            budget -= length
            scheduled += 1
        return ScheduledBatch(context, generation, k)

    def _reserve(self, req: Request, slots: int) -> bool:
        """Allocates slots for req, preempting the newest running requests if needed.
        Returns False when req itself had to be preempted."""
        while not self.pool.can_allocate(req.block_table, slots):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        self.pool.allocate(req.block_table, slots)
        return True

    def _blocks_behind_window(self, num_computed: int) -> int:
        """How many leading blocks no row at a position >= num_computed reads (0 without
        a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.pool.block_size

    def _preempt(self, req: Request):
        self.running.remove(req)
        self.pool.free(req.block_table)
        req.released_blocks = 0
        self._free_state(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.in_context = True
        req.draft_tokens, req.features.draft_probs = [], None
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- postprocess -------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        """Appends accepted tokens (stops checked token by token), rewinds rejected KV by
        moving num_computed, frees finished requests. Returns requests that advanced."""
        advanced = []
        ctx_tokens = iter(out.context_tokens)
        drafts = iter(out.drafts)
        parents = iter(out.draft_parents or [])
        for i, chunk in enumerate(batch.context):
            req, token, next_drafts = chunk.req, next(ctx_tokens), next(drafts)
            next_parents = next(parents, [])
            req.num_computed = chunk.start + chunk.length
            if out.prompt_logprobs and i in out.prompt_logprobs:
                req.prompt_logprobs = (req.prompt_logprobs or []) + out.prompt_logprobs[i]
            if not chunk.is_last:
                self.pool.cache_blocks(req)
                self._release_behind_window(req)
                continue
            req.in_context = False
            req.metrics.target_steps += 1
            self._append(req, [token], out.logprobs, [i])
            req.draft_tokens, req.draft_parents = next_drafts, next_parents
            advanced.append(req)
        relaxed = iter(out.relaxed or [])
        rows = len(batch.context)               # the first logit row of each request
        for req, accepted, n in zip(batch.generation, out.accepted, out.num_accepted):
            first, rows = rows, rows + len(accepted)
            next_drafts, relaxed_row = next(drafts), next(relaxed, None)
            next_parents = next(parents, [])
            if req.status != RequestStatus.RUNNING:
                continue    # finished or aborted while this (overlapped) step was in flight
            req.metrics.target_steps += 1
            req.num_computed += n             # KV past the accepted prefix is rewound
            emitted = self._append(req, accepted[:n], out.logprobs, range(first, first + n))
            if batch.k > 0 and req.draft_tokens:
                req.metrics.num_draft_tokens += self.shape.num_drafts(batch.k)
                # only drafts that were emitted (a stop or max_tokens may cut the run), so
                # target_steps + num_accepted_draft_tokens == num_generated_tokens
                req.metrics.num_accepted_draft_tokens += emitted - 1
                if relaxed_row is not None:
                    req.metrics.num_relaxed_accepted_tokens += sum(relaxed_row[:emitted - 1])
            req.draft_tokens, req.draft_parents = next_drafts, next_parents
            advanced.append(req)
        for req in advanced:
            self.pool.cache_blocks(req)       # before a finished request releases them
            if req.is_finished:
                self._release(req)
            else:
                self._release_behind_window(req)    # (after cache_blocks: cached first)
        return advanced

    def _release_behind_window(self, req: Request):
        """Gives back req's blocks that lie wholly behind its window. Every row a later
        step runs for req (prefill chunk, verify row, draft row; the step already in flight
        under the overlap scheduler too) is at a position p >= num_computed and sees keys
        j > p - window, so no key before num_computed - window + 1 is read again: the
        blocks before the one holding it are released (their table entries then name the
        scratch block, which the window's mask hides). A rewind never goes below
        num_computed, and a preempted request recomputes from 0 in fresh blocks."""
        first_seen = self._blocks_behind_window(req.num_computed)
        if first_seen > req.released_blocks:
            self.pool.release_range(req.block_table, req.released_blocks, first_seen)
            req.released_blocks = first_seen

    def _append(self, req: Request, tokens: list[int], logprobs: dict | None = None,
                rows=()) -> int:
        """Appends tokens until a stop condition (with their log-probabilities, from
        logprobs[rows[i]], when the request asks for them); returns how many were
        appended."""
        sp = req.sampling_params
        scored = logprobs is not None and sp.logprobs is not None
        if scored and req.logprobs is None:
            req.logprobs = []
        if tokens and not req.output_token_ids:
            req.times.first_token_time = time.monotonic()
        for i, t in enumerate(tokens):
            req.output_token_ids.append(t)
            if scored:
                req.logprobs.append(logprobs[rows[i]])
            req.metrics.num_generated_tokens += 1
            if req.features.grammar is not None and self._grammar_ends(req, t):
                return i + 1
            if (not sp.ignore_eos and t in self.eos_token_ids) or t in sp.stop_token_set:
                self._finish(req, "stop")
                return i + 1
            if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
                self._finish(req, "length")
                return i + 1
        return len(tokens)

    def _grammar_ends(self, req: Request, token: int) -> bool:
        """Feeds an emitted token to the request's grammar (GrammarState.accept); True when
        that ended the request."""
        ended = req.features.grammar.accept(token, len(req.output_token_ids) - 1)
        if ended is None:
            return False
        reason, req.error = ended
        self._finish(req, reason)
        return True

    def _finish(self, req: Request, reason: str):
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _release(self, req: Request):
        if req in self.running:
            self.running.remove(req)
        self.pool.free(req.block_table)
        req.released_blocks = 0
        self._free_state(req)
        req.draft_tokens = []
        req.features.release()

    def _free_state(self, req: Request):
        """Gives req's recurrent-state slot back (a request that recomputes, after
        preemption, starts from zeros in a fresh one)."""
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None

    def abort(self, req: Request):
        if req.is_finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        self._release(req)
