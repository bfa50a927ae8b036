"""Paged KV block pool shared by every target and draft attention layer."""
from __future__ import annotations

from collections import deque

import torch


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

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
            block_table.append(self.free_blocks.popleft())

    def free(self, block_table: list[int]):
        self.free_blocks.extend(block_table)
        block_table.clear()


def slots_per_step(k: int, drafting: bool = True) -> int:
    """Cache slots past num_computed that a generation step of draft length k may write:
    the target's K+1 rows at P..P+K, and with a drafter its steps, draft step j writing
    P + n - 1 + j <= P + 2K - 1: max(K + 1, 2K)."""
    return max(k + 1, 2 * k) if drafting else k + 1


def kv_bytes_per_block(attn_layers, block_size: int) -> int:
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * a.o_proj.weight.element_size()
               for a in attn_layers)


def allocate_kv_cache(attn_layers, num_blocks: int, block_size: int, device):
    """Gives each attention layer (target and draft alike) its slice of one block pool, in
    the layer's own dtype (a draft head may run in a lower precision than its target)."""
    for a in attn_layers:
        shape = (num_blocks * block_size, a.num_kv_heads, a.head_dim)
        a.k_cache = torch.zeros(shape, dtype=a.o_proj.weight.dtype, device=device)
        a.v_cache = torch.zeros_like(a.k_cache)
