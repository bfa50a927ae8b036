"""The engine: add_request, then step() = schedule -> run -> postprocess."""
from __future__ import annotations

import gc
import itertools
import logging
import time

import torch

from onespec.combinations import (GRAMMAR, check_combinations, engine_features, graphs_allowed,
                                  spec_features, target_window)
from onespec.config import AUTO_DRAFT_LEN, EngineConfig, SpeculativeConfig, as_speculative_config
from onespec.distributed import WorkerFailure
from onespec.distributed.attention_dp import RankedBlockPool
from onespec.distributed.ranks import Rank0Driver, start_ranks
from onespec.engine.calibrate import build_policy
from onespec.engine.cuda_graph import CudaGraphRunner, PendingStep
from onespec.engine.kv_cache import BlockPool, return_freed_host_memory
from onespec.engine.model_runner import ModelRunner
from onespec.engine.parts import RankParts
from onespec.engine.prefix_cache import PrefixCache
from onespec.engine.request import Request, RequestStatus
from onespec.engine.scheduler import ScheduledBatch, Scheduler, StepOutput
from onespec.engine.stats import SpecStats
from onespec.models.loader import read_config
from onespec.models.registry import load_tokenizer, target_class
from onespec.quant.fp8 import checkpoint_scheme
from onespec.sampling_params import SamplingParams
from onespec.speculative.draft_len import SpeculationGate, draft_len_for_batch
from onespec.speculative.host_drafts import (NGramDrafter, automaton_matched, host_span,
                                             make_host_drafter, record_sa_outcome)
from onespec.speculative.thinking import ThinkingPhase
from onespec.speculative.acceptors import ForcedAcceptor
from onespec.structured.backend import GrammarBackend
from onespec.structured.state import GrammarState

logger = logging.getLogger("onespec.engine")
# what close() drops: the cache tensors of attention layers, and the engine's parts that
# hold tensors or threads (some refer to each other, so dropping the engine alone would
# leave them to the garbage collector)
RELEASED_LAYER_TENSORS = ("k_cache", "v_cache", "kv_pool", "latent_cache", "index_cache")
RELEASED_ENGINE_PARTS = ("model", "drafter", "host_drafter", "runner", "scheduler", "pool",
                         "states", "policy", "grammars", "thinking", "gate", "_fixed_draft_len", "generator",
                         "requests")


def _halves(batch: ScheduledBatch) -> tuple[ScheduledBatch, ScheduledBatch]:
    """The batch's requests split in two (context chunks first, as in the batch)."""
    n, ctx, gen, k = len(batch.requests) // 2, batch.context, batch.generation, batch.k
    if n <= len(ctx):
        return ScheduledBatch(ctx[:n], [], k), ScheduledBatch(ctx[n:], gen, k)
    m = n - len(ctx)
    return ScheduledBatch(ctx, gen[:m], k), ScheduledBatch([], gen[m:], k)


def _known_target_class(model: str):
    """The target's class, or None where its config is unreadable or unsupported (the
    ranks' start-up then says so with its own message)."""
    try:
        return target_class(read_config(model))
    except ValueError:
        return None


def _check_draft_len(k: int, max_draft_len: int):
    if not isinstance(k, int) or not 0 <= k <= max_draft_len:
        raise ValueError(f"draft length must be an integer in [0, max_draft_len = "
                         f"{max_draft_len}], got {k!r}")


class Engine:
    def __init__(self, config: EngineConfig,
                 speculative_config: SpeculativeConfig | dict | None = None,
                 parallel=None):
        """speculative_config: a typed config or vLLM's dictionary form. With
        tensor_parallel_size > 1 this engine is rank 0: it starts the other ranks
        (distributed/ranks.py), which build only the RankParts they run, and drives them.
        parallel: a TensorParallel group of one rank to build the sharded layers on (the
        GPU tests run the sharded path on one GPU with it); None otherwise."""
        speculative_config = as_speculative_config(speculative_config)
        self.config, self.spec_config = config, speculative_config
        # the features in play, their pairs checked once (combinations.py) before any rank
        # starts; the target's own (its window) are added once its config is read
        raw = read_config(config.model)
        target_cls = target_class(raw) \
            if config.attention_backend == "triton" else None     # (its tree masks)
        fp8_checkpoint = checkpoint_scheme(raw, config.model) is not None
        if target_cls is None and config.tensor_parallel_size > 1:
            target_cls = _known_target_class(config.model)   # (a hybrid: refused before ranks)
        self.features = spec_features(speculative_config) | \
            engine_features(config, target_cls, fp8_checkpoint=fp8_checkpoint)
        check_combinations(self.features)
        self.ranks = start_ranks(config, speculative_config, self.features)
        self.parallel = self.ranks.group if self.ranks else parallel
        try:
            self._build(config, speculative_config)
        except BaseException as e:
            failure = self.ranks.startup_failed(e) if self.ranks else None
            self.close()
            if failure is not None:
                raise failure from e
            raise

    def _build(self, config: EngineConfig, speculative_config):
        parts = RankParts.build(config, speculative_config, self.parallel, self.features)
        self.device, self.dtype, self.tree = parts.device, parts.dtype, parts.tree
        self.kernel_settings, self.ops, self.shape = parts.kernel_settings, parts.ops, parts.shape
        self.model, self.drafter = parts.model, parts.drafter
        self.max_model_len, self.max_draft_len = parts.max_model_len, parts.max_draft_len
        worker, drafter, k = parts.worker, parts.drafter, parts.max_draft_len
        self.acceptor = worker.acceptor         # the acceptance rule, for the engine's life
        mcfg = self.model.config
        self.features |= engine_features(
            config, sliding_window=target_window(mcfg), recurrent=parts.states is not None,
            host_synced_experts=getattr(self.model, "host_synced_experts", False))
        self.tokenizer = load_tokenizer(config.model)
        # a model drafter runs in the step; host drafts (the suffix-automaton enhancer, the
        # n-gram drafter) are set in _finish_step
        self.host_drafter = make_host_drafter(speculative_config)
        num_blocks, max_positions = parts.num_kv_blocks, parts.max_positions
        self.states = parts.states      # a hybrid target's recurrent-state pool, or None
        if config.enable_attention_dp:     # each rank's own blocks (attention_dp.py)
            if config.enable_prefix_caching:
                logger.info("prefix caching is off under enable_attention_dp: a cached "
                            "block lives on one rank")
            self.pool = RankedBlockPool(num_blocks, config.tensor_parallel_size,
                                        config.block_size)
        else:
            self.pool = BlockPool(num_blocks, config.block_size,
                                  self._prefix_cache(drafter, speculative_config))
        self.scheduler = Scheduler(self.pool, config.max_num_tokens, config.max_batch_size,
                                   self.max_model_len, drafter is not None, mcfg.eos_token_ids,
                                   self.shape, self.states, mcfg.sliding_window)
        sc = speculative_config
        relaxed = sc is not None and sc.use_relaxed_acceptance_for_thinking
        self.thinking = ThinkingPhase(sc.begin_thinking_phase_token, sc.end_thinking_phase_token,
                                      sc.relaxed_delta) if relaxed else None
        graphs = None
        if config.cuda_graphs and self.kernel_settings.triton and graphs_allowed(self.features):
            graphs = CudaGraphRunner(worker, config.block_size,
                                     -(-max_positions // config.block_size), num_blocks,
                                     config.max_batch_size, self.device, mcfg.sliding_window)
        # structured outputs: xgrammar is imported when the first constrained request comes
        self.grammars = GrammarBackend(self.tokenizer, mcfg.vocab_size, mcfg.eos_token_ids)
        self.runner = ModelRunner(Rank0Driver(worker, self.ranks) if self.ranks else worker,
                                  config.block_size, self.device, mcfg.vocab_size,
                                  mcfg.sliding_window, graphs, self.grammars,
                                  mcfg.eos_token_ids)
        self.auto_draft_len = drafter is not None and sc.draft_len_schedule == AUTO_DRAFT_LEN
        if graphs is not None:       # auto may choose any K: every one is captured now
            for graph_k in (range(k + 1) if self.auto_draft_len else [k]):
                graphs.capture(graph_k)
        self.gate = SpeculationGate(sc.acceptance_window if sc else None,
                                    sc.acceptance_length_threshold if sc else None)
        self.stats = SpecStats(k)
        self._fixed_draft_len = None  # set_draft_len: a K, or a function of the batch size
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self._inflight: PendingStep | None = None    # launched, results not read (overlap)
        self.policy = None           # DraftLenPolicy with draft_len_schedule="auto" (calibrate)
        if self.ranks:
            self.ranks.wait_ready()

    def close(self):
        """Stops the other tensor-parallel ranks and releases every tensor the engine
        holds (the KV pool, CUDA graphs, the target's and drafter's weights), so that their
        memory comes back now rather than at the next garbage collection; idempotent.
        The engine runs no step after it (stats() still answers)."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.shutdown()
        self._inflight = None
        self._release_kv_cache()
        if getattr(self, "states", None) is not None:
            self.states.release()
        for name in RELEASED_ENGINE_PARTS:
            setattr(self, name, None)
        # building a model under torch.device("meta") leaves reference cycles of frames
        # that hold it: only a collection frees the weights
        gc.collect()
        return_freed_host_memory()
        if getattr(getattr(self, "device", None), "type", None) == "cuda":
            torch.cuda.empty_cache()

    def _release_kv_cache(self):
        """Drops every attention layer's cache tensors (views of the pool that other
        objects, such as captured graphs, may also hold)."""
        drafter = getattr(self, "drafter", None)
        for module in (getattr(self, "model", None), drafter and drafter.head):
            for layer in module.modules() if module is not None else ():
                for name in RELEASED_LAYER_TENSORS:
                    if getattr(layer, name, None) is not None:
                        setattr(layer, name, None)

    # ---- draft length and acceptance: set by the engine's owner, never from outside ----
    def calibrate(self):
        """With draft_len_schedule="auto": measures the step-time table of the auto draft
        length on this machine (calibrate.py) by stepping dummy requests, then chooses K
        per step from it. Taken once, after the engine is built and before its first
        request (LLM does it when it is built; add_request does it otherwise); the
        counters start after it. Nothing to do otherwise, or once done."""
        if not self.auto_draft_len or self.policy is not None or self._calibrating:
            return
        self._calibrating = True
        try:
            policy = build_policy(self)
        finally:
            self._calibrating = False
            self._fixed_draft_len = None
        self.policy = policy
        self.reset_stats()

    _calibrating = False

    def set_draft_len(self, k):
        """Runs the following steps with draft length k (0..max_draft_len), or with k(batch
        size) if k is a function; None: back to the config's schedule. Where steps replay
        CUDA graphs, a fixed K's are captured first."""
        if isinstance(k, int):
            _check_draft_len(k, self.max_draft_len)
            graphs = self.runner.graphs
            if graphs is not None:
                graphs.capture(k)
        self._fixed_draft_len = k

    def set_forced_acceptance(self, length: float | None, rates: tuple[float, ...] | None = None):
        """Benchmarks: the forced acceptance of the following steps, on an engine whose
        config forces acceptance (its acceptor is ForcedAcceptor, chosen at build)."""
        if not isinstance(self.acceptor, ForcedAcceptor):
            raise ValueError("set_forced_acceptance needs an engine built with "
                             "force_acceptance_length or force_acceptance_rates")
        self.acceptor.set(length, rates)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether generation steps replay CUDA graphs (engine/cuda_graph.py)."""
        return self.runner.graphs is not None

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far (their blocks freed to let others run)."""
        return self.scheduler.num_preemptions

    def reset_stats(self):
        """Starts the aggregate counters (LLM.stats) afresh."""
        self.stats = SpecStats(self.max_draft_len, self.policy)

    def draft_len(self, batch_size: int) -> int:
        """The draft length of a step of `batch_size` candidate requests."""
        fixed = self._fixed_draft_len
        if fixed is not None:
            return fixed if isinstance(fixed, int) else fixed(batch_size)
        if self.policy is not None:
            return self.policy.choose(batch_size) if self.gate.enabled else 0
        if self.spec_config is None or not self.gate.enabled:
            return 0
        return draft_len_for_batch(self.spec_config.draft_len_schedule, self.max_draft_len,
                                   batch_size)

    # ---- set-up ------------------------------------------------------------------------
    def _prefix_cache(self, drafter, sc) -> PrefixCache | None:
        """A drafter with KV layers makes a block's KV depend on the token after it (its
        lookahead); forced acceptance emits tokens other than those whose KV it computed,
        so then only prompt blocks are cached."""
        if not self.config.enable_prefix_caching:
            return None
        if self.states is not None:
            logger.info("prefix caching is off for %s: its recurrent layers' state at a "
                        "block boundary is not kept", self.model.config.architecture)
            return None
        lookahead = 1 if drafter is not None and drafter.attention_layers else 0
        forced = sc is not None and (sc.force_acceptance_length is not None
                                     or sc.force_acceptance_rates is not None)
        return PrefixCache(self.config.block_size, lookahead, prompt_only=forced)

    # ---- requests ----------------------------------------------------------------------
    def _check_open(self):
        if self.scheduler is None:
            raise RuntimeError("this engine is closed (close() released its model and KV "
                               "cache); build a new one")

    def tokenize(self, prompt) -> list[int]:
        self._check_open()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model!r} has no tokenizer files: "
                                 "pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError(f"the prompt is empty: {prompt!r} encodes to no tokens")
            return ids
        ids = list(prompt)
        vocab = self.model.config.vocab_size
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                              for t in ids):
            raise ValueError(f"a token-id prompt must be a non-empty list of ints in [0, {vocab})")
        return ids

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    compiled_grammar=None) -> Request:
        """Queues one request. cache_salt: its prefix-cache namespace (only requests with
        the same salt share cached blocks); compiled_grammar: the xgrammar grammar of its
        structured_outputs when the caller compiled it already (the server does)."""
        self._check_open()
        self.calibrate()
        sp = sampling_params or SamplingParams()
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        vocab = self.model.config.vocab_size
        bad = [t for t in sp.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[0]}")
        bad = [t for t in sp.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {bad[0]}")
        if sp.needs_logits:
            self.check_logit_processors()
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, so it must be at most "
                             f"{self.max_model_len - 1}")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if sp.structured_outputs is not None:
            self.check_structured_outputs()
        req = Request(rid, ids, sp, cache_salt=cache_salt)
        req.times.arrival_time = time.monotonic()
        if sp.structured_outputs is not None:      # compiled once per spec (cached)
            req.features.grammar = GrammarState(
                self.grammars.matcher(sp.structured_outputs, compiled_grammar))
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def check_structured_outputs(self):
        """A ValueError if this engine cannot constrain outputs (asked before any compile)."""
        check_combinations(self.features | {GRAMMAR})

    def check_logit_processors(self):
        """A ValueError if this engine cannot read a request's verify rows' full logits
        (logit processors: penalties, logit_bias, min_tokens; logprobs)."""
        what = "logit processors (penalties, logit_bias, min_tokens) and logprobs"
        if self.tree is not None:
            raise ValueError(f"{what} cannot be used with use_dynamic_tree yet; use chain "
                             "drafting")
        if self.parallel:
            raise ValueError(f"{what} are not supported with tensor_parallel_size > 1 yet")

    def abort(self, request_id: str):
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One engine step. Returns the requests that advanced (finished ones included).

        With the overlap scheduler, a generation step that replays a CUDA graph is launched
        and, before its results are read, the next step of the same requests is launched
        behind it (its inputs taken from this one's results on the device), so the GPU
        never waits for the host's postprocessing and scheduling. Each call still returns
        one step's results; a request that finishes in step n has its row of step n+1
        computed and dropped. A step that raises is run again in parts
        (_isolate_failure): only a request that fails alone ends, with finish_reason
        "error"."""
        batch, out = None, None
        start = time.perf_counter()
        try:
            if self._inflight is None:
                k = self.draft_len(self.scheduler.num_candidates)
                batch = self.scheduler.schedule(k)
                if not batch.requests:
                    return []
                if not (self.config.overlap_scheduler and self.runner.can_launch(batch)):
                    out = self.runner.run(batch)
                else:
                    self._inflight = self.runner.launch(batch)
            if out is None:
                current = self._inflight
                batch = current.batch
                self._inflight = self._launch_next(current)
                out = self.runner.collect(current)
        except WorkerFailure:        # a tensor-parallel rank is gone: no step can run
            self._inflight = None
            raise
        except Exception as e:       # nothing was postprocessed: the step can run again
            self._inflight = None
            if batch is None:
                raise
            return self._isolate_failure(batch, e)
        except BaseException:
            self._inflight = None
            raise
        if self.policy is not None and not batch.context:
            self.policy.observe_step_time(len(batch.generation), batch.k,
                                          time.perf_counter() - start)
        try:
            return self._finish_step(batch, out)
        except BaseException:
            self._inflight = None
            raise

    def _isolate_failure(self, batch: ScheduledBatch, error: Exception) -> list[Request]:
        """`batch` raised `error` before its results were postprocessed. Runs it again in
        two halves, and a half that fails again in halves, until the failure is pinned on
        single requests: those end with finish_reason "error" (the message in
        Request.error) and free their blocks; the others advance as in any step. Until a
        step fails this costs nothing."""
        reqs = batch.requests
        if len(reqs) == 1:
            self._fail_request(reqs[0], error)
            return reqs
        logger.warning("an engine step of %d requests failed (%s: %s); running them again "
                       "in parts", len(reqs), type(error).__name__, error)
        advanced = []
        for part in _halves(batch):
            try:
                out = self.runner.run(part)
            except WorkerFailure:
                raise
            except Exception as e:
                advanced += self._isolate_failure(part, e)
            else:
                advanced += self._finish_step(part, out)
        return advanced

    def _fail_request(self, req: Request, error: Exception):
        req.error = f"{type(error).__name__}: {error}"
        logger.error("request %s failed in the engine step and was ended: %s",
                     req.request_id, req.error)
        self.scheduler.abort(req)           # frees its blocks
        req.finish_reason = "error"
        self.requests.pop(req.request_id, None)

    def _launch_next(self, current: PendingStep) -> PendingStep | None:
        """Launches the step after `current` for the same requests, if nothing would change
        it: no request waiting, none aborted, the same draft length, and room in every
        request's blocks and budget for one more step whatever `current` accepts.

        Host drafts are known only once `current` is read, so the n-gram drafter never
        chains. With the suffix-automaton enhancer the chained step verifies the model's
        drafts, so it is launched only while the automaton matched none of the requests at
        its last proposal (which set `current`'s drafts, or ran while `current` was in
        flight): when a match starts, the steps run serially (each verifying the
        automaton's drafts) until it ends."""
        sched = self.scheduler
        reqs = current.batch.generation
        if isinstance(self.host_drafter, NGramDrafter) or any(map(automaton_matched, reqs)):
            return None
        if sched.waiting or len(sched.running) != len(reqs) or \
                any(r.status != RequestStatus.RUNNING for r in reqs):
            return None
        k = self.draft_len(sched.num_candidates)
        batch = ScheduledBatch([], list(reqs), k)
        if not self.runner.can_follow(current, batch):
            return None
        if not all(sched.reserve_ahead(r, k) for r in reqs):
            return None
        return self.runner.launch(batch, after=current)

    def _finish_step(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        live = [r.status == RequestStatus.RUNNING for r in batch.generation]
        # drafts each request had for this step's K (fewer when K grew: the rest is padding)
        real = [min(batch.k, len(r.draft_tokens)) for r in batch.generation]
        num_outputs = [len(r.output_token_ids) for r in batch.requests]
        spans = [host_span(r) if d else (0, 0) for r, d in zip(batch.generation, real)]
        advanced = self.scheduler.postprocess(batch, out)
        if self.thinking is not None:
            self._walk_thinking(batch, num_outputs)
        if self.host_drafter is not None:
            self._host_drafts(batch, advanced, num_outputs[len(batch.context):], spans, live)
        drafted = [(n, d) for n, d, a in zip(out.num_accepted, real, live) if d and a]
        self.stats.record_step(batch.k, drafted)
        if self.policy is not None:
            self.policy.observe_acceptance(drafted)
        for req in advanced:
            if req.is_finished:
                self.requests.pop(req.request_id, None)
                self.stats.record_request(req.metrics, len(req.prompt_token_ids))
                if req.metrics.num_draft_tokens:
                    self.gate.record(req.metrics.acceptance_length)
        return advanced

    def _host_drafts(self, batch: ScheduledBatch, advanced: list[Request],
                     num_outputs: list[int], spans: list[tuple[int, int]], live: list[bool]):
        """After postprocess: counts the verified drafts that the suffix automaton proposed
        and how many were emitted (RequestMetrics.num_sa_*), then sets the next drafts of
        every request that goes on from its own tokens (host_drafts.py). num_outputs,
        spans, live: per generation request, from before postprocess."""
        for req, before, span, alive in zip(batch.generation, num_outputs, spans, live):
            if span[1] > span[0] and alive and batch.k:
                record_sa_outcome(req, batch.k, span, len(req.output_token_ids) - before)
        in_flight = self._inflight is not None       # the next step of these requests
        for req in advanced:
            if not req.is_finished:
                self.host_drafter.propose(req, in_flight)

    def _walk_thinking(self, batch: ScheduledBatch, num_outputs: list[int]):
        """Moves each request's thinking phase over the tokens this step fed or emitted: a
        context chunk's prompt tokens (from position 0 in a request's first chunk, whose
        start may follow cached blocks), then new outputs."""
        for req, before in zip(batch.requests, num_outputs):
            chunk = next((c for c in batch.context if c.req is req), None)
            if chunk is not None:
                fed = req.token_ids[0 if chunk.first else chunk.start:chunk.start + chunk.length]
                self.thinking.walk(req, fed, restart=chunk.first)
            self.thinking.walk(req, req.output_token_ids[before:])

    def num_running(self) -> int:
        return sum(r.status == RequestStatus.RUNNING for r in self.scheduler.running)
