"""CUDA graphs for the generation step: the target verify of K+1 rows per request plus the
whole draft loop, captured once per (batch-size bucket, K, forced acceptance).

Only generation-only, all-greedy batches replay a graph (sampling with per-request
generators and rejection sampling run eagerly). A batch smaller than its bucket is padded
with requests whose block table points at a reserved scratch block, so their KV writes
touch nothing real; their rows are dropped from the results.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from onespec.engine.scheduler import ScheduledBatch
from onespec.layers.attention import build_attention_metadata
from onespec.layers.sampler import GreedySampling
from onespec.spec.worker import SpecWorker, StepInputs

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaGraphRunner:
    def __init__(self, worker: SpecWorker, block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, max_batch_size: int, device,
                 sliding_window: int | None = None):
        self.worker, self.block_size, self.device = worker, block_size, device
        self.sliding_window = sliding_window
        self.scratch_block = scratch_block
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch_size] + [max_batch_size]
        self.width = max_blocks_per_seq
        self.graphs: dict[tuple, tuple] = {}     # (bucket, K, forced acceptance) -> (graph, out)
        self.pool = torch.cuda.graph_pool_handle()
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}
        self.num_replays = 0
        self.greedy = GreedySampling(device)

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (not batch.context and 0 < len(batch.generation) <= self.buckets[-1]
                and not self.worker.use_rejection_sampling
                and all(r.sampling_params.temperature == 0.0 for r in batch.generation)
                and all(len(r.block_table) <= self.width for r in batch.generation))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ---- capture -----------------------------------------------------------------------
    def _buffers(self, k: int) -> dict[str, torch.Tensor]:
        """One pinned host buffer and its device copy per draft length, holding a bucket's
        inputs back to back (_layout); the graph's first node copies them in."""
        if k not in self.bufs:
            size = self._layout(self.buckets[-1], k)[-1]
            self.bufs[k] = {"host": torch.zeros(size, dtype=torch.int64, pin_memory=True),
                            "dev": torch.zeros(size, dtype=torch.int64, device=self.device)}
        return self.bufs[k]

    def _layout(self, b: int, k: int) -> tuple[int, int, int, int, int]:
        """Offsets of input_ids, positions [b (k+1)], draft tokens [b, k], block tables
        [b, width] and the end, for bucket b."""
        rows = b * (k + 1)
        return 0, rows, 2 * rows, 2 * rows + b * k, 2 * rows + b * k + b * self.width

    def _step(self, b: int, k: int) -> torch.Tensor:
        buf = self._buffers(k)
        o_ids, o_pos, o_drafts, o_tables, end = self._layout(b, k)
        dev = buf["dev"]
        dev[:end].copy_(buf["host"][:end], non_blocking=True)     # pinned: captured as a node
        rows = b * (k + 1)
        ids, pos = dev[o_ids:o_pos], dev[o_pos:o_drafts]
        tables = dev[o_tables:end].view(b, self.width)
        meta = build_attention_metadata(tables, k + 1, pos, self.block_size,
                                        sliding_window=self.sliding_window, backend="triton")
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        inp = StepInputs(
            input_ids=ids, positions=pos, meta=meta, block_tables=tables, num_ctx=0,
            num_gen=b, k=k, logit_rows=torch.arange(rows, device=self.device),
            ctx_last_rows=empty, draft_ctx_rows=empty,
            draft_reqs=torch.arange(b, device=self.device), gen_start=0,
            shift_ids=torch.full_like(ids, -1), draft_tokens=dev[o_drafts:o_tables].view(b, k),
            draft_probs=None, row_sampling=self.greedy(rows), gen_sampling=self.greedy(b),
            draft_sampling=self.greedy(b), max_kv_draft=0, block_size=self.block_size)
        res = self.worker.step(inp)
        return torch.cat([res.accepted.reshape(-1), res.num_accepted, res.drafts.reshape(-1)])

    def _fill_inputs(self, reqs, b: int, k: int):
        """Writes the step's inputs into the pinned host buffer in bucket b's layout; rows
        past the real requests are padding (position 0.., the scratch block)."""
        o_ids, o_pos, o_drafts, o_tables, end = self._layout(b, k)
        host = self._buffers(k)["host"].numpy()
        n = len(reqs)
        ids = host[o_ids:o_pos].reshape(b, k + 1)
        pos = host[o_pos:o_drafts].reshape(b, k + 1)
        drafts = host[o_drafts:o_tables].reshape(b, k)
        tables = host[o_tables:end].reshape(b, self.width)
        ids.fill(0)
        drafts.fill(0)
        tables.fill(self.scratch_block)
        pos[:] = np.arange(k + 1)
        for i, r in enumerate(reqs):
            d = r.draft_tokens[:k]
            drafts[i, :len(d)] = d
            ids[i, 0] = r.token_ids[-1]
            pos[i] += r.num_computed
            tables[i, :len(r.block_table)] = r.block_table
        ids[:n, 1:] = drafts[:n]

    def capture(self, k: int, buckets=None):
        """Captures every bucket for draft length k (largest first: they share one pool)."""
        key_a = self.worker.force_acceptance_length
        todo = [b for b in sorted(buckets or self.buckets, reverse=True)
                if (b, k, key_a) not in self.graphs]
        for b in tqdm(todo, desc=f"capturing CUDA graphs (K={k})", leave=False):
            self._fill_inputs([], b, k)      # all padding: the scratch block
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(b, k)             # warm-up: compiles kernels, builds inputs
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # accepted rows [b, k+1], accepted counts [b], next drafts [b, k]
            host = torch.empty(b * (2 * k + 2), dtype=torch.int64, pin_memory=True)
            with torch.cuda.graph(graph, pool=self.pool):
                host.copy_(self._step(b, k), non_blocking=True)   # the graph's last node
            self.graphs[(b, k, key_a)] = (graph, host)

    # ---- replay ------------------------------------------------------------------------
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Returns (num_accepted, accepted rows, drafts) for the real requests."""
        reqs, k = batch.generation, batch.k
        n, b = len(reqs), self.bucket(len(reqs))
        key = (b, k, self.worker.force_acceptance_length)
        if key not in self.graphs:
            self.capture(k, [b])
        graph, out = self.graphs[key]
        self._fill_inputs(reqs, b, k)
        graph.replay()              # copies the inputs in and the results out (pinned)
        torch.cuda.current_stream(self.device).synchronize()       # the step's one sync
        self.num_replays += 1
        rows = b * (k + 1)
        flat = out.tolist()
        accepted = [flat[i * (k + 1):(i + 1) * (k + 1)] for i in range(n)]
        num_acc = flat[rows:rows + n]
        base = rows + b
        next_drafts = [flat[base + i * k:base + (i + 1) * k] for i in range(n)]
        return num_acc, accepted, next_drafts
