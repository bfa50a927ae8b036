"""Paged KV block pool shared by every target and draft attention layer."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections import deque

import torch

from onespec.engine.prefix_cache import CachedBlock, PrefixCache
from onespec.engine.request import Request
from onespec.quant.kv_fp8 import cache_dtype


class BlockPool:
    """Reference-counted blocks. With a PrefixCache, blocks of finished prefixes stay cached
    when released ("parked"): they count as free, and are reused, least recently released
    first, only once no never-cached block is left."""

    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.cache = cache
        # a block-table entry whose block went back to the pool while its request runs (a
        # sliding-window target's blocks behind the window: release_before) names the
        # scratch block every layer holds past the pool; attention masks it out
        self.released = num_blocks
        self.free_blocks = deque(range(num_blocks))      # free and holding no cached KV
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + (self.cache.num_parked if self.cache else 0)

    def num_blocks_needed(self, block_table: list[int], num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_slots: int) -> bool:
        return self.num_blocks_needed(block_table, num_slots) <= self.num_free_blocks

    def allocate(self, block_table: list[int], num_slots: int):
        """Grows block_table in place until it holds num_slots slots."""
        need = self.num_blocks_needed(block_table, num_slots)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            # (freed blocks go back to the front: reused first, the pool's pages that
            # requests have written stay few; see zeros_on_write)
            block = self.free_blocks.popleft() if self.free_blocks else self.cache.evict()
            self.ref_counts[block] = 1
            block_table.append(block)

    def free(self, block_table: list[int]):
        """Releases a request's blocks, last first (a cached prefix's tail is evicted before
        its head, which more requests share)."""
        for block in reversed(block_table):
            self._release(block)
        block_table.clear()

    def release_range(self, block_table: list[int], start: int, stop: int):
        """Releases the blocks of entries [start, stop), each entry becoming `released`:
        the table keeps its length, so positions keep their entries and allocate() counts
        what is covered. For a target whose every attention layer slides, whose rows never
        read keys behind their window (Scheduler's release behind the window)."""
        for i in range(start, min(stop, len(block_table))):
            self._release(block_table[i])
            block_table[i] = self.released

    def num_held(self, block_table: list[int]) -> int:
        """The blocks a request's table holds (released entries not counted)."""
        return sum(block != self.released for block in block_table)

    def _release(self, block: int):
        if block == self.released:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.cache is not None and self.cache.holds(block):
                self.cache.park(block)
            else:
                self.free_blocks.appendleft(block)

    def flush_cache(self) -> int:
        """Forgets every cached block no request holds (they become plain free blocks);
        returns how many. Blocks held by running requests stay cached."""
        num = 0
        while self.cache is not None and self.cache.num_parked:
            self.free_blocks.appendleft(self.cache.evict())   # written pages: reused first
            num += 1
        return num

    # ---- prefix caching ----------------------------------------------------------------
    def match_prefix(self, req: Request) -> list[CachedBlock]:
        """Cached blocks req (waiting, holding no block) can start with: [] without caching."""
        if self.cache is None or req.sampling_params.prompt_logprobs is not None:
            return []           # prompt log-probabilities need every prompt row computed
        return self.cache.match(req)

    def can_admit(self, hits: list[CachedBlock], num_slots: int, skip: int = 0) -> bool:
        """Whether a request starting with the cached blocks `hits` can get num_slots slots
        (a parked hit counts among the free blocks it takes; the first `skip`, behind a
        sliding window, are not taken)."""
        parked = sum(self.cache.is_parked(h.block_id) for h in hits[skip:]) if hits else 0
        return self.num_blocks_needed(hits, num_slots) + parked <= self.num_free_blocks

    def admit(self, req: Request, hits: list[CachedBlock], num_slots: int, skip: int = 0):
        """Gives req the blocks `hits` (shared, never written again), then fresh blocks up to
        num_slots slots (can_admit first). The first `skip` hits lie behind the window of
        a sliding target: their entries are `released` at once, the blocks not taken."""
        for i, h in enumerate(hits):
            if i < skip:
                req.block_table.append(self.released)
                continue
            if self.ref_counts[h.block_id] == 0:
                self.cache.unpark(h.block_id)
            self.ref_counts[h.block_id] += 1
            req.block_table.append(h.block_id)
        req.released_blocks = min(skip, len(hits))
        if self.cache is not None:
            req.prefix_chain = list(hits)
        self.allocate(req.block_table, num_slots)

    def cache_blocks(self, req: Request):
        """Registers req's blocks that became full and final since the last call."""
        if self.cache is not None:
            self.cache.register(req)


def slots_per_step(k: int, drafting: bool = True) -> int:
    """Cache slots past num_computed that a generation step of draft length k may write:
    the target's K+1 rows at P..P+K, and with a drafter its steps, draft step j writing
    P + n - 1 + j <= P + 2K - 1: max(K + 1, 2K)."""
    return max(k + 1, 2 * k) if drafting else k + 1


def window_blocks(window: int, block_size: int, max_num_tokens: int, shape, k: int) -> int:
    """The most blocks one request of a target whose every layer slides holds at once
    (Scheduler releases those behind the window after each step): from the block of
    num_computed - window + 1 to the last slot reserved past num_computed, a prefill
    chunk's (max_num_tokens + its draft slots) or a generation step's, which the overlap
    scheduler reserves k + 1 positions early."""
    ahead = max(max_num_tokens + shape.ctx_slots(k), shape.gen_slots(k) + k + 1)
    return -(-(window + ahead) // block_size) + 1


def target_attention_layers(model) -> list:
    """The target's layers that keep paged KV: every layer's self_attn, or only the
    full-attention layers of a hybrid target (its attention_layers())."""
    if hasattr(model, "attention_layers"):
        return model.attention_layers()
    return [layer.self_attn for layer in model.model.layers]


def kv_bytes_per_block(attn_layers, block_size: int) -> int:
    """A layer may define cache_bytes_per_token() (e.g. MLA's latent cache); otherwise it
    holds k_cache and v_cache of [slots, Hkv, D] in its cache dtype (1 byte a value under
    kv_cache_dtype="fp8": quant/kv_fp8.py configure_kv_cache runs first)."""
    return sum(block_size * (a.cache_bytes_per_token() if hasattr(a, "cache_bytes_per_token")
                             else 2 * a.num_kv_heads * a.head_dim * cache_dtype(a).itemsize)
               for a in attn_layers)


def allocate_kv_cache(attn_layers, num_blocks: int, block_size: int, device):
    """Gives each attention layer its slice of one block pool, in the layer's cache dtype
    (a draft head may run in a lower precision than its target; e4m3 under
    kv_cache_dtype="fp8"). The layers of one call that share a shape and dtype share one
    tensor [2, layers, slots, Hkv, D] (`kv_pool`; each layer's k_cache and v_cache are
    views of its slices), so an operation on the cache entries of every layer at once is
    one launch (tree.compact_cache). A layer with its own cache layout defines
    allocate_cache(num_slots, device)."""
    slots = num_blocks * block_size
    groups: dict[tuple, list] = {}
    for a in attn_layers:
        if hasattr(a, "allocate_cache"):
            a.allocate_cache(slots, device)
        else:
            groups.setdefault((a.num_kv_heads, a.head_dim, cache_dtype(a)),
                              []).append(a)
    for (heads, dim, dtype), layers in groups.items():
        pool = zeros_on_write((2, len(layers), slots, heads, dim), dtype, device)
        for i, a in enumerate(layers):
            a.k_cache, a.v_cache, a.kv_pool = pool[0, i], pool[1, i], pool


def zeros_on_write(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape). On the CPU the tensor lives in anonymous mapped memory, whose
    pages the OS hands out zeroed when they are first written: a pool sized for what the
    configuration can use costs resident memory only for the blocks requests fill, and
    all of it goes back to the OS when the tensor is freed (no allocator keeps it)."""
    numel = 1
    for n in shape:
        numel *= n
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)    # the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def return_freed_host_memory():
    """Hands the C heap's free pages back to the OS (glibc keeps freed small allocations,
    such as a checkpoint's tensors, for reuse): what a closed engine held leaves the
    process's resident memory. Nothing to do where the C library has no malloc_trim."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
