"""CUDA graphs for the generation step: the target verify of K+1 rows per request plus the
whole draft loop, captured once per (batch-size bucket, K, forced acceptance).

Only generation-only, all-greedy batches replay a graph (sampling with per-request
generators and rejection sampling run eagerly). A batch smaller than its bucket is padded
with requests whose block table points at a reserved scratch block, so their KV writes
touch nothing real; their rows are dropped from the results.

A step is launched (inputs copied in, graph replayed, results copied out, an event
recorded) and collected later, so the overlap scheduler (engine.py) can launch the next
step, its inputs chained from this one's results on the device (kernels/chain.py; a tree's
nodes and parents too), before this one is read.

Hybrid targets (engine/state_pool.py): the requests' recurrent-state slots are one more
input (InputLayout.slots; padding requests take the pool's scratch slot and start from
zeros), each verify row's state goes to the snapshot rows of its place in the bucket (fixed
by the bucket), and the commit of the accepted row is an index copy inside the graph. A
chained step runs the previous step's requests in the same order, so its slots are the
same ones, written again by the host, and the state it reads is the one the previous
replay committed: nothing more to chain.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm.auto import tqdm

from onespec.engine.scheduler import ScheduledBatch
from onespec.engine.state_pool import RecurrentBatch
from onespec.layers.attention import build_attention_metadata
from onespec.layers.sampler import GreedySampling
from onespec.speculative.shape import InputLayout
from onespec.speculative.worker import SpecWorker, StepInputs
from onespec.structured.step import GraphMasks, StepGrammar


@dataclass
class ConstrainedGraphs:
    """A bucket's step for batches with grammar-constrained requests, in K + 1 graphs:
    `verify` (the target, masked acceptance, draft step 0's forward) and one per draft step
    (its forward and masked pick). Between them the host reads the tokens just chosen and
    fills the next graph's masks (`masks`)."""
    verify: torch.cuda.CUDAGraph
    drafts: list
    masks: GraphMasks
    results: torch.Tensor          # accepted rows [b, k+1], counts [b], drafts [b, k]


@dataclass
class PendingStep:
    """A launched graph step whose results the host has not read yet."""
    batch: ScheduledBatch
    bucket: int
    slot: int            # which pinned input/output pair it uses


def fill_slots(slots, reqs, scratch: int):
    """Writes the requests' recurrent-state slots into a bucket's slots input (a numpy
    view), the scratch slot for the padding past them."""
    slots.fill(scratch)
    for i, req in enumerate(reqs):
        if req.state_slot is None:
            raise RuntimeError(f"request {req.request_id} holds no recurrent state slot")
        slots[i] = req.state_slot


def graph_recurrent_batch(slots: torch.Tensor, rows: int, scratch: int) -> RecurrentBatch:
    """A bucket's RecurrentBatch over its slots input [b] (a view of the device input
    buffer): b generation requests of `rows` rows each, the padding ones (the scratch slot)
    starting from zeros. Built from device tensors only: the graph captures it."""
    b = slots.shape[0]
    return RecurrentBatch(slots=slots, fresh=slots == scratch, q_lens=[rows] * b, num_ctx=0,
                          gen_rows=rows)


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# threads warming the buckets up before capture (compiling their Triton kernels side by
# side); 1 warms them up one by one inside the capture loop
COMPILE_THREADS = os.cpu_count() or 1


class CudaGraphRunner:
    def __init__(self, worker: SpecWorker, block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, max_batch_size: int, device,
                 sliding_window: int | None = None):
        self.worker, self.block_size, self.device = worker, block_size, device
        self.sliding_window = sliding_window
        self.scratch_block = scratch_block
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch_size] + [max_batch_size]
        self.width = max_blocks_per_seq
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}   # (bucket, K, forced acceptance)
        self.pool = torch.cuda.graph_pool_handle()
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}
        self.num_replays = 0
        self.constrained: dict[tuple, ConstrainedGraphs] = {}   # (bucket, K, forced)
        self.constrained_pool = torch.cuda.graph_pool_handle()
        self.num_constrained = 0    # constrained steps run from graphs
        self.num_reused_masks = 0   # their verify rows masked with the draft loop's masks
        self.num_chained = 0        # replays whose inputs came from the step before (overlap)
        self.greedy = GreedySampling(device)
        self.shape = worker.shape      # inputs, results, tree inputs of a step
        self.states = worker.states    # a hybrid target's recurrent-state pool, or None

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (not batch.context and 0 < len(batch.generation) <= self.buckets[-1]
                and not self.worker.use_rejection_sampling
                and all(r.sampling_params.temperature == 0.0 and
                        not r.sampling_params.needs_logits for r in batch.generation)
                and all(len(r.block_table) <= self.width for r in batch.generation))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ---- capture -----------------------------------------------------------------------
    def _buffers(self, k: int) -> dict:
        """Per draft length: the inputs of a bucket back to back (_layout) in two pinned host
        buffers (a step's inputs are written while the step before may still be copying
        its own in) and their device copy; the results of the last step on the device
        (`prev`, what a chained step reads) and in two pinned buffers; one event per
        pinned pair, recorded when the step that uses it has copied its results out."""
        if k not in self.bufs:
            size = self._layout(self.buckets[-1], k).size
            out = self._results_size(self.buckets[-1], k)
            self.bufs[k] = {
                "host": [torch.zeros(size, dtype=torch.int64, pin_memory=True)
                         for _ in range(2)],
                "dev": torch.zeros(size, dtype=torch.int64, device=self.device),
                "prev": torch.zeros(out, dtype=torch.int64, device=self.device),
                "out": [torch.zeros(out, dtype=torch.int64, pin_memory=True) for _ in range(2)],
                "events": [torch.cuda.Event() for _ in range(2)],
                "next": 0}
        return self.bufs[k]

    def _layout(self, b: int, k: int) -> InputLayout:
        """Bucket b's inputs in the flat buffers (the shape's InputLayout)."""
        lay = self.shape.input_layout(b, k, self.width)
        return replace(lay, has_slots=True) if self.states is not None else lay

    def _results_size(self, b: int, k: int) -> int:
        """Length of a step's results for bucket b (the shape's ResultsLayout)."""
        return self.shape.results_layout(b, k).size

    def _step(self, b: int, k: int, buf: dict | None = None):
        """The graphed step: inputs from `dev` (rows with a chain source from `prev`),
        results to `prev` (of `buf`, by default draft length k's buffers)."""
        from onespec.kernels.chain import chain_inputs, chain_tree_inputs  # Triton: only
        buf = buf or self._buffers(k)                                      # where graphs run
        results = self.shape.results_layout(b, k)
        chain = chain_tree_inputs if results.has_parents else chain_inputs
        chain(buf["dev"], buf["prev"], self._layout(b, k), results)
        res = self.worker.step(self._inputs(b, k, buf["dev"]))
        out = results.pack(res.accepted, res.num_accepted, res.drafts, res.draft_parents)
        buf["prev"][:out.numel()].copy_(out)

    def _inputs(self, b: int, k: int, dev: torch.Tensor, grammar=None) -> StepInputs:
        """The step inputs of bucket b, views of the device input buffer `dev`."""
        lay = self._layout(b, k)
        v = lay.views(dev)
        r, rows = lay.rows, b * lay.rows
        ids, pos = v["ids"].reshape(-1), v["pos"].reshape(-1)
        tables = v["tables"]
        meta = build_attention_metadata(tables, r, pos, self.block_size,
                                        sliding_window=self.sliding_window, backend="triton")
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        every = torch.arange(b, device=self.device)
        # a tree step's: as ModelRunner's, from the parents on the device
        tree = self.shape.tree_inputs(k, v["parents"], v["pos"][:, 0], meta, every)
        if self.states is not None:
            meta.recurrent = graph_recurrent_batch(v["slots"], r, self.states.scratch_slot)
        return StepInputs(
            input_ids=ids, positions=pos, meta=meta, block_tables=tables, num_ctx=0,
            num_gen=b, k=k, logit_rows=torch.arange(rows, device=self.device),
            ctx_last_rows=empty, draft_ctx_rows=empty, draft_reqs=every, gen_start=0,
            shift_ids=torch.full_like(ids, -1),
            draft_tokens=v["drafts"],
            draft_probs=None, row_sampling=self.greedy(rows), gen_sampling=self.greedy(b),
            draft_sampling=self.greedy(b), max_kv_draft=0, block_size=self.block_size,
            grammar=grammar, tree=tree)

    def _fill_inputs(self, reqs, b: int, k: int, host: torch.Tensor, chained: bool = False):
        """Writes the step's inputs into a pinned host buffer in bucket b's layout; rows
        past the real requests are padding (position 0.., the scratch block). `chained`:
        request i continues row i of the step launched just before, whose results the host
        has not seen: its tokens and drafts come from there on the device, and its
        positions (written here as that step's) move on by its accepted count."""
        lay = self._layout(b, k)
        host = host.numpy()
        n = len(reqs)
        v = lay.views(host)
        ids, pos, drafts, parents = v["ids"], v["pos"], v["drafts"], v["parents"]
        tables, src = v["tables"], v["src"]
        ids.fill(0)
        host[lay.drafts_at:lay.tables_at] = 0     # padding trees: every node under the root
        tables.fill(self.scratch_block)
        src.fill(-1)
        pos[:] = np.arange(lay.rows)
        if lay.has_slots:     # (a chained step's: the same requests, the same slots)
            fill_slots(v["slots"], reqs, self.states.scratch_slot)
        for i, req in enumerate(reqs):
            pos[i] += req.num_computed
            tables[i, :len(req.block_table)] = req.block_table
            if not chained:
                d, par = self.shape.verified_drafts(req, k)
                drafts[i] = d
                if par is not None:
                    parents[i] = par
                ids[i, 0] = req.token_ids[-1]
        if chained:
            src[:n] = np.arange(n)
        else:
            ids[:n, 1:] = drafts[:n]

    def capture(self, k: int, buckets=None):
        """Captures every bucket for draft length k (largest first: they share one pool)."""
        key_a = self.worker.forced_key
        todo = [b for b in sorted(buckets or self.buckets, reverse=True)
                if (b, k, key_a) not in self.graphs]
        buf = self._buffers(k)
        torch.cuda.synchronize(self.device)   # no launched step still reads dev or prev
        self._compile_ahead(todo, k)
        for b in tqdm(todo, desc=f"capturing CUDA graphs (K={k})", leave=False):
            end = self._layout(b, k).size
            self._fill_inputs([], b, k, buf["host"][0])      # all padding: the scratch block
            buf["dev"][:end].copy_(buf["host"][0][:end])
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(b, k)             # warm-up: compiles kernels, builds inputs
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._step(b, k)
            self.graphs[(b, k, key_a)] = graph

    def _compile_ahead(self, buckets: list[int], k: int):
        """Runs one step of every bucket at once, one thread each, before the capture loop.

        Nearly all of a first capture's time is Triton compiling the kernels, one
        specialisation after another, and the buckets need different ones (row counts, the
        decode kernels or the row path). Triton's compiler releases the GIL for most of its
        work, so the threads compile side by side. Every thread queues its work on one
        stream, so kernels sharing state (attention's ticket counters, which each launch
        leaves zero) run one after another as in a serial warm-up; each bucket has its own
        inputs (all padding) and results, and nothing else computed here is kept: the
        capture loop warms up each bucket again, then with every kernel compiled."""
        threads = min(len(buckets), COMPILE_THREADS)
        if threads < 2:
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def warm_up(b: int):
            host = torch.zeros(self._layout(b, k).size, dtype=torch.int64)
            self._fill_inputs([], b, k, host)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                buf = {"dev": host.to(self.device),
                       "prev": torch.zeros(self._results_size(b, k), dtype=torch.int64,
                                           device=self.device)}
                self._step(b, k, buf)

        with ThreadPoolExecutor(threads) as pool:
            list(tqdm(pool.map(warm_up, buckets), total=len(buckets), leave=False,
                      desc=f"compiling kernels for {len(buckets)} buckets (K={k})"))
        torch.cuda.current_stream(self.device).wait_stream(stream)

    # ---- replay ------------------------------------------------------------------------
    def can_chain(self, prev: PendingStep, batch: ScheduledBatch) -> bool:
        """Whether `batch` (prev's requests, in order) can run as prev's chained successor:
        same bucket and draft length (so prev's results lie where it reads them), its graph
        already captured (capturing would overwrite them)."""
        b = self.bucket(len(batch.generation))
        return (batch.k == prev.batch.k and b == prev.bucket and self.can_run(batch)
                and (b, batch.k, self.worker.forced_key) in self.graphs)

    def launch(self, batch: ScheduledBatch, chained: bool = False) -> PendingStep:
        """Enqueues the batch's step (inputs in, graph, results out) without waiting for
        it. `chained`: the batch is the previous launch's, request for request (see
        _fill_inputs)."""
        reqs, k = batch.generation, batch.k
        b = self.bucket(len(reqs))
        key = (b, k, self.worker.forced_key)
        if key not in self.graphs:
            self.capture(k, [b])
        buf = self._buffers(k)
        slot = self._load_inputs(reqs, b, k, chained)
        self.graphs[key].replay()
        size = self._results_size(b, k)
        buf["out"][slot][:size].copy_(buf["prev"][:size], non_blocking=True)
        buf["events"][slot].record()
        self.num_replays += 1
        self.num_chained += chained
        return PendingStep(batch, b, slot)

    def _load_inputs(self, reqs, b: int, k: int, chained: bool = False) -> int:
        """Writes the step's inputs (_fill_inputs) into the next pinned buffer and enqueues
        their copy to the device; returns that buffer's slot."""
        buf = self._buffers(k)
        slot = buf["next"]
        buf["next"] ^= 1
        buf["events"][slot].synchronize()   # the launch before last, which used it, is done
        end = self._layout(b, k).size
        self._fill_inputs(reqs, b, k, buf["host"][slot], chained)
        buf["dev"][:end].copy_(buf["host"][slot][:end], non_blocking=True)
        return slot

    def collect(self, step: PendingStep) -> tuple[list[int], list[list[int]], list[list[int]],
                                                  list[list[int]] | None]:
        """Waits for a launched step; returns (num_accepted, accepted rows, drafts, a
        tree's parents or None) of its real requests."""
        k, b, n = step.batch.k, step.bucket, len(step.batch.generation)
        results = self.shape.results_layout(b, k)
        buf = self._buffers(k)
        buf["events"][step.slot].synchronize()          # the step's one sync
        return results.unpack(buf["out"][step.slot][:results.size].tolist(), n)

    # ---- steps with grammar-constrained requests --------------------------------------
    def run_constrained(self, batch: ScheduledBatch, grammar: StepGrammar
                        ) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Runs a batch with grammar-constrained requests (can_run) from its bucket's
        ConstrainedGraphs, synchronously: K + 1 replays, the host filling each one's masks
        from the matchers (StepGrammar) in between. Returns what collect does."""
        reqs, k = batch.generation, batch.k
        n, b = len(reqs), self.bucket(len(reqs))
        key = (b, k, self.worker.forced_key)
        if key not in self.constrained:
            self._capture_constrained(b, k)
        cg = self.constrained[key]
        self._load_inputs(reqs, b, k)
        cg.masks.set_verify(grammar)
        cg.verify.replay()
        results = self.shape.results_layout(b, k)
        head = cg.results[:results.drafts_at].tolist()          # waits for the verify
        num_acc, accepted, _, _ = results.unpack(head, n)
        drafts = cg.results[results.drafts_at:results.parents_at].view(b, k)
        mask = grammar.start([], accepted, num_acc) if k else None
        used = []
        for j, graph in enumerate(cg.drafts):
            cg.masks.set_draft(mask)
            used.append(mask)
            graph.replay()
            if j < k - 1:                                         # waits for the draft step
                mask = grammar.advance(drafts[:n, j].tolist())
        self.num_constrained += 1
        self.num_reused_masks += grammar.reused
        if not cg.drafts:
            return num_acc, accepted, [[] for _ in reqs]
        next_drafts = drafts[:n].tolist()
        grammar.keep_draft_masks(reqs, used, next_drafts,
                                 [len(r.output_token_ids) + a for r, a in zip(reqs, num_acc)])
        return num_acc, accepted, next_drafts

    def _capture_constrained(self, b: int, k: int):
        """Captures bucket b's ConstrainedGraphs (after a warm-up run compiles its kernels).
        The draft-step graphs continue from tensors the verify graph leaves (its inputs'
        metadata, the DraftLoop); the graphs replay in capture order, so what later captures
        in the pool reuse of them is always written before it is read."""
        buf = self._buffers(k)
        torch.cuda.synchronize(self.device)
        end = self._layout(b, k).size
        self._fill_inputs([], b, k, buf["host"][0])              # all padding
        buf["dev"][:end].copy_(buf["host"][0][:end])
        masks = GraphMasks(b, k, self.worker.target.config.vocab_size, self.device)
        layout = self.shape.results_layout(b, k)
        results = torch.zeros(layout.size, dtype=torch.int64, device=self.device)
        drafts = results[layout.drafts_at:layout.parents_at].view(b, k)

        def segments(graphs=None):
            """Runs the verify and each draft step, each captured into graphs[i] if given."""
            def run(i, fn):
                if graphs is None:
                    return fn()
                with torch.cuda.graph(graphs[i], pool=self.constrained_pool):
                    return fn()

            def verify():      # the inputs' metadata is built in the graph: it follows them
                inp = self._inputs(b, k, buf["dev"], masks)
                _, accepted, num_accepted, loop = self.worker.verify(inp)
                results[:layout.drafts_at].copy_(torch.cat([accepted.reshape(-1), num_accepted]))
                return inp, loop

            inp, loop = run(0, verify)
            for j in range(k if loop is not None else 0):   # (no drafter: host drafts)
                run(j + 1, lambda: drafts[:, j].copy_(
                    self.worker.draft_next(inp, loop, j, masks.draft)))
            return loop is not None

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            segments()                                            # warm-up
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graphs = [torch.cuda.CUDAGraph() for _ in range(k + 1)]
        with torch.inference_mode():
            drafting = segments(graphs)
        self.constrained[(b, k, self.worker.forced_key)] = ConstrainedGraphs(
            graphs[0], graphs[1:] if drafting else [], masks, results)

    def standalone(self, key: tuple) -> torch.cuda.CUDAGraph:
        """Graph `key`, to replay outside the engine (profiling): its inputs as the last
        launch left them, but no row chained to a previous step (a chained row's
        positions would move on by its accepted count at every replay)."""
        b, k, _ = key
        lay = self._layout(b, k)
        torch.cuda.synchronize(self.device)
        self.bufs[k]["dev"][lay.src_at:lay.slots_at] = -1
        return self.graphs[key]
