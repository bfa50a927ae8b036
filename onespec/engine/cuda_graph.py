"""CUDA graphs for the generation step: the target verify of K+1 rows per request plus the
whole draft loop, captured once per (batch-size bucket, K, forced acceptance).

Only generation-only, all-greedy batches replay a graph (sampling with per-request
generators and rejection sampling run eagerly). A batch smaller than its bucket is padded
with requests whose block table points at a reserved scratch block, so their KV writes
touch nothing real; their rows are dropped from the results.
"""
from __future__ import annotations

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
        if k not in self.bufs:
            n, dev = self.buckets[-1], self.device
            self.bufs[k] = {
                "input_ids": torch.zeros(n * (k + 1), dtype=torch.int64, device=dev),
                "positions": torch.zeros(n * (k + 1), dtype=torch.int64, device=dev),
                "block_tables": torch.full((n, self.width), self.scratch_block,
                                           dtype=torch.int64, device=dev),
                "draft_tokens": torch.zeros(n, k, dtype=torch.int64, device=dev),
            }
        return self.bufs[k]

    def _step(self, b: int, k: int) -> torch.Tensor:
        buf = self._buffers(k)
        rows = b * (k + 1)
        ids, pos = buf["input_ids"][:rows], buf["positions"][:rows]
        tables = buf["block_tables"][:b]
        meta = build_attention_metadata(tables, k + 1, pos, self.block_size,
                                        sliding_window=self.sliding_window, backend="triton")
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        inp = StepInputs(
            input_ids=ids, positions=pos, meta=meta, block_tables=tables, num_ctx=0,
            num_gen=b, k=k, logit_rows=torch.arange(rows, device=self.device),
            ctx_last_rows=empty, draft_ctx_rows=empty,
            draft_reqs=torch.arange(b, device=self.device), gen_start=0,
            shift_ids=torch.full_like(ids, -1), draft_tokens=buf["draft_tokens"][:b],
            draft_probs=None, row_sampling=self.greedy(rows), gen_sampling=self.greedy(b),
            draft_sampling=self.greedy(b), max_kv_draft=0, block_size=self.block_size)
        res = self.worker.step(inp)
        return torch.cat([res.accepted.reshape(-1), res.num_accepted, res.drafts.reshape(-1)])

    def capture(self, k: int, buckets=None):
        """Captures every bucket for draft length k (largest first: they share one pool)."""
        key_a = self.worker.force_acceptance_length
        todo = [b for b in sorted(buckets or self.buckets, reverse=True)
                if (b, k, key_a) not in self.graphs]
        for b in tqdm(todo, desc=f"capturing CUDA graphs (K={k})", leave=False):
            self._buffers(k)["block_tables"].fill_(self.scratch_block)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(b, k)             # warm-up: compiles kernels, builds inputs
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._step(b, k)
            self.graphs[(b, k, key_a)] = (graph, out)

    # ---- replay ------------------------------------------------------------------------
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Returns (num_accepted, accepted rows, drafts) for the real requests."""
        reqs, k = batch.generation, batch.k
        n, b = len(reqs), self.bucket(len(reqs))
        key = (b, k, self.worker.force_acceptance_length)
        if key not in self.graphs:
            self.capture(k, [b])
        graph, out = self.graphs[key]
        buf = self._buffers(k)
        ids, pos, tables, drafts = [], [], [], []
        for r in reqs:
            d = (r.draft_tokens[:k] + [0] * k)[:k]
            drafts.append(d)
            ids += [r.token_ids[-1]] + d
            pos += range(r.num_computed, r.num_computed + k + 1)
            tables.append(r.block_table + [self.scratch_block] * (self.width - len(r.block_table)))
        pad = b - n
        ids += [0] * pad * (k + 1)
        pos += list(range(k + 1)) * pad
        tables += [[self.scratch_block] * self.width] * pad
        drafts += [[0] * k] * pad
        rows = b * (k + 1)
        buf["input_ids"][:rows].copy_(torch.tensor(ids), non_blocking=True)
        buf["positions"][:rows].copy_(torch.tensor(pos), non_blocking=True)
        buf["block_tables"][:b].copy_(torch.tensor(tables), non_blocking=True)
        if k:
            buf["draft_tokens"][:b].copy_(torch.tensor(drafts), non_blocking=True)
        graph.replay()
        self.num_replays += 1
        flat = out.tolist()                                                  # one host copy
        accepted = [flat[i * (k + 1):(i + 1) * (k + 1)] for i in range(n)]
        num_acc = flat[rows:rows + n]
        base = rows + b
        next_drafts = [flat[base + i * k:base + (i + 1) * k] for i in range(n)]
        return num_acc, accepted, next_drafts
