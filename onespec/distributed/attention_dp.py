"""Attention data parallelism (`enable_attention_dp=True`, TensorRT-LLM's name): the
requests are split over the tensor-parallel ranks for attention, while the MoE and dense
layers stay tensor-parallel over every rank's rows.

    rank 0's scheduler    places each request on one rank when it first gets KV blocks
                          (the rank with the most free blocks: RankedBlockPool); block ids
                          [r * N, (r + 1) * N) are rank r's, N the blocks each rank holds
    attention             weights whole on every rank (replicated, not split by heads);
                          rank r attends only for its own requests' rows and keeps only
                          their KV, in a pool of its own N blocks (global slot s of rank r
                          is local slot s - r * N * block_size)
    after attention       the ranks' rows, padded to the largest rank's row count in this
                          step, are all-gathered: every rank holds every row again
    MLP / MoE, LM head    tensor-parallel as without attention DP (layers.py)

Every rank steps the same inputs (broadcast from rank 0 as for tensor parallelism) and
finds its own rows from them: a request's rank is that of its first block, which each
metadata's key slots carry (AttentionMetadata.kv_slots[:, 0]), so the drafter's metadata
(MTP layers) splits the same way with nothing more sent. What is split is the attention
compute and the KV memory (an MLA target under plain tensor parallelism caches the whole
latent on every rank; here each rank caches only its requests', so the ranks together
hold tensor_parallel_size times the requests); norms, projections outside attention and
the residual stream stay whole on every rank (an all-gather of the attention rows, then
the MoE's one all-reduce, rather than a reduce-scatter and an all-gather per layer).

The portable attention backend only (its metadata lists each request's key slots); no
prefix caching (a cached block lives on one rank); EAGLE-3 heads are refused (their KV
is not split) while MTP layers, being decoder layers of the target, are split with it.
"""
from __future__ import annotations

from collections import deque

import torch
from torch import nn

from onespec.engine.kv_cache import BlockPool
from onespec.layers.attention import AttentionMetadata

ARCHITECTURES = ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM")


def check_attention_dp(cfg: dict, size: int):
    """A ValueError unless the checkpoint of config.json `cfg` can run attention DP over
    `size` ranks (the MLP sizes are checked as for tensor parallelism)."""
    if size < 2:
        raise ValueError(f"enable_attention_dp=True splits requests over the tensor-parallel "
                         f"ranks: it needs tensor_parallel_size > 1, got {size}")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if isinstance(a, str)), None) if isinstance(archs, list) \
        else None
    if arch not in ARCHITECTURES:
        raise ValueError(f"enable_attention_dp=True is not supported for {arch or archs!r} "
                         f"(supported: {ARCHITECTURES}, the MLA / MoE targets); use "
                         "tensor_parallel_size alone")


class _RankRows:
    """One step's split of a metadata's rows over the ranks, as rank `rank` sees it."""

    def __init__(self, meta: AttentionMetadata, rank: int, world_size: int, rank_slots: int):
        if meta.kv_slots is None:
            raise RuntimeError("attention data parallelism needs the portable attention "
                               "backend's metadata (attention_backend='torch')")
        req_rank = torch.div(meta.kv_slots[:, 0], rank_slots, rounding_mode="floor")   # [B]
        row_rank = req_rank[meta.token_req]                                         # [T]
        self.counts = torch.bincount(row_rank, minlength=world_size).tolist()
        self.max_rows = max(self.counts)
        # where each row lands in the gathered [world_size * max_rows] rows
        place = torch.empty_like(row_rank)
        for r in range(world_size):
            rows = (row_rank == r).nonzero().squeeze(1)
            place[rows] = r * self.max_rows + torch.arange(rows.shape[0], device=rows.device)
        self.place = place
        self.rows = (row_rank == rank).nonzero().squeeze(1)
        reqs = (req_rank == rank).nonzero().squeeze(1)
        base = rank * rank_slots

        def local(slots):      # global slots -> this rank's; other ranks' (masked) -> 0
            inside = (slots >= base) & (slots < base + rank_slots)
            return torch.where(inside, slots - base, torch.zeros_like(slots))

        renumber = torch.full_like(req_rank, -1)
        renumber[reqs] = torch.arange(reqs.shape[0], device=reqs.device)
        self.meta = AttentionMetadata(
            renumber[meta.token_req[self.rows]], meta.positions[self.rows],
            meta.block_tables[reqs], meta.block_size, meta.sliding_window,
            token_idx=meta.token_idx[self.rows], kv_slots=local(meta.kv_slots[reqs]),
            mask=meta.mask[reqs], max_q=meta.max_q, rows_per_request=meta.rows_per_request,
            slots=local(meta.slot_mapping[self.rows]))


class DataParallelAttention:
    """Mixed in before an attention layer's class (make_data_parallel): forward runs the
    layer on this rank's rows only, then all-gathers every rank's outputs back into the
    step's row order. The layer's weights are whole; its cache holds this rank's blocks."""

    tp = None
    rank_slots = 0               # cache slots per rank (set with the KV pool)

    def forward(self, x, positions, rotary, meta: AttentionMetadata, residual=None):
        split = self._split(meta)
        if split.counts[self.tp.rank]:
            out = super().forward(x[split.rows], positions[split.rows], rotary, split.meta)
        else:        # no request here this step: nothing to attend, padding to send
            out = x.new_zeros(0, self._out_width())
        padded = out.new_zeros(split.max_rows, out.shape[1])
        padded[:out.shape[0]] = out
        gathered = self.tp.all_gather(padded).view(-1, out.shape[1])
        full = gathered[split.place]
        return full if residual is None else residual + full

    def _out_width(self) -> int:
        # MLA applies o_proj itself (its output is hidden-sized); GQA returns the heads
        mla = getattr(self, "kv_lora_rank", None) is not None
        return self.o_proj.out_features if mla else self.o_proj.in_features

    def _split(self, meta: AttentionMetadata) -> _RankRows:
        """The split of meta's rows, computed by the first layer and kept on meta."""
        key = (id(meta.positions), id(meta.kv_slots), id(meta.token_req))
        cached = getattr(meta, "_rank_rows", None)
        if cached is None or cached[0] != key:
            cached = (key, _RankRows(meta, self.tp.rank, self.tp.world_size, self.rank_slots))
            object.__setattr__(meta, "_rank_rows", cached)
        return cached[1]


def make_data_parallel(attn: nn.Module, tp) -> nn.Module:
    """attn (whole, unsplit) as a DataParallelAttention of group tp, in place."""
    cls = type(attn)
    attn.__class__ = type(f"DataParallel{cls.__name__}", (DataParallelAttention, cls), {})
    attn.tp = tp
    return attn


def set_rank_slots(attn_layers, num_blocks: int, block_size: int):
    """Tells each data-parallel attention layer how many cache slots a rank holds."""
    for a in attn_layers:
        if isinstance(a, DataParallelAttention):
            a.rank_slots = num_blocks * block_size


class RankedBlockPool(BlockPool):
    """The scheduler's block pool over the ranks' pools: num_ranks * blocks_per_rank
    blocks, rank r's ids [r * blocks_per_rank, (r + 1) * blocks_per_rank). A request's
    blocks all come from one rank: the rank of its first block, chosen when it gets one as
    the rank with the most free blocks (the least loaded; the lowest rank on ties). No
    prefix cache (a cached block would tie a later request to its rank)."""

    def __init__(self, blocks_per_rank: int, num_ranks: int, block_size: int):
        super().__init__(blocks_per_rank * num_ranks, block_size, None)
        self.blocks_per_rank, self.num_ranks = blocks_per_rank, num_ranks
        self.free_blocks = None         # per rank instead
        self.rank_free = [deque(range(r * blocks_per_rank, (r + 1) * blocks_per_rank))
                          for r in range(num_ranks)]

    @property
    def num_free_blocks(self) -> int:
        return sum(len(f) for f in self.rank_free)

    def rank_of(self, block_table: list[int]) -> int:
        """The rank a request of this block table lives (or will live) on."""
        if block_table:
            return block_table[0] // self.blocks_per_rank
        return max(range(self.num_ranks), key=lambda r: (len(self.rank_free[r]), -r))

    def can_allocate(self, block_table: list[int], num_slots: int) -> bool:
        need = self.num_blocks_needed(block_table, num_slots)
        return need <= len(self.rank_free[self.rank_of(block_table)])

    def can_admit(self, hits, num_slots: int, skip: int = 0) -> bool:
        """(No prefix cache, so no hits; no sliding targets, so nothing to skip.)"""
        return not hits and self.can_allocate([], num_slots)

    def allocate(self, block_table: list[int], num_slots: int):
        need = self.num_blocks_needed(block_table, num_slots)
        free = self.rank_free[self.rank_of(block_table)]
        if need > len(free):
            raise RuntimeError(f"KV pool of rank {self.rank_of(block_table)} exhausted: need "
                               f"{need} blocks, {len(free)} free")
        for _ in range(need):
            block = free.popleft()
            self.ref_counts[block] = 1
            block_table.append(block)

    def free(self, block_table: list[int]):
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.rank_free[block // self.blocks_per_rank].appendleft(block)
        block_table.clear()

    def flush_cache(self) -> int:
        return 0
