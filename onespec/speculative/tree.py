"""Dynamic trees (docs/DECODING.md, "dynamic trees"): pure tensor functions for choosing the
kept nodes, the ancestor masks, greedy acceptance along the longest matching root path, and
moving the accepted path's cache entries and hidden rows to where a chain puts them.

A request's tree is written as `tokens [N]` (target ids) and `parents [N]`: node i + 1
(node 0 is the root, the last accepted token) has parent `parents[i]` in [0, i], so parents
come before their children and node indices in [0, N] address the verify rows
[t_last, n1 .. nN] of the request. Depths are at most the tree's depth D.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from onespec.layers.attention import AttentionMetadata
from onespec.quant.kv_fp8 import raw


@dataclass
class TreeInputs:
    """The verify of a tree step: rows [t_last, nodes] per generation request."""
    parents: Tensor               # [Bg, N] parent row (0 = root) of each node
    ancestors: Tensor             # [Bg, N+1, N+1] bool: row j is row i or an ancestor of it
    positions: Tensor             # [T] rotary positions: prefix length + depth
    meta: AttentionMetadata       # the step's metadata with each request's ancestor mask


def depths_of(parents: list[int]) -> list[int]:
    """Host-side depth of every row [root, nodes] (the root has depth 0)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth


def ancestor_matrix(parents: Tensor, depth: int) -> Tensor:
    """parents [B, N] -> [B, N+1, N+1] bool, entry (i, j) true when row j is row i or one of
    its ancestors. Follows each row's parent chain `depth` times (no host sync)."""
    batch, n = parents.shape
    full = torch.cat([parents.new_zeros(batch, 1), parents], 1)          # [B, N+1] root -> 0
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    cur = torch.arange(n + 1, device=parents.device).expand(batch, n + 1)
    for _ in range(depth):
        cur = full.gather(1, cur)                                         # [B, N+1]
        anc.scatter_(2, cur.unsqueeze(-1), True)
    return anc


def select_tree(scores: Tensor,       # [B, C] cumulative log-probabilities
                tokens: Tensor,       # [B, C] target ids
                cand_parents: Tensor,  # [B, C] candidate index of the parent, -1: the root
                num_nodes: int) -> tuple[Tensor, Tensor]:   # ([B, N], [B, N])
    """Keeps the num_nodes candidates of highest score, in candidate order, as a tree.

    Candidates come in depth order (a parent before its children) and a child's score is its
    parent's plus a log-probability <= 0, so the top-N set holds every kept node's parent;
    the stable sort breaks ties toward the earlier candidate (the parent).
    scores [-.1, -.5, -.3, -.9], parents [-1, -1, 0, 0], N 3 -> kept candidates 0, 1, 2:
    parents [0, 0, 1] (rows 1 and 2 hang off the root, row 3 off row 1).
    """
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_nodes]
    keep = torch.sort(order, dim=1).values                                # [B, N]
    rows = torch.arange(1, num_nodes + 1, device=scores.device).expand_as(keep)
    row_of = torch.zeros_like(cand_parents).scatter_(1, keep, rows)      # [B, C]: 0 = dropped
    par = cand_parents.gather(1, keep)                                   # [B, N]
    parents = torch.where(par < 0, 0, row_of.gather(1, par.clamp(min=0)))
    return tokens.gather(1, keep), parents


def _path_to(last: Tensor, ancestors: Tensor, depths: Tensor, depth: int) -> Tensor:
    """Rows from the root to `last` [B], by depth: [B, D+1]; entries past last's depth hold
    their own index (so moving them is a no-op)."""
    batch, rows = depths.shape
    on_path = ancestors[torch.arange(batch, device=last.device), last]   # [B, N+1]
    col = torch.where(on_path, depths, depth + 1)                        # off-path: dropped
    buf = torch.arange(depth + 2, device=last.device).repeat(batch, 1)  # [B, D+2]
    buf.scatter_(1, col, torch.arange(rows, device=last.device).expand(batch, rows))
    return buf[:, :depth + 1]


def tree_accept(tokens: Tensor,      # [B, N] drafted nodes (target ids)
                parents: Tensor,     # [B, N]
                ancestors: Tensor,   # [B, N+1, N+1] (ancestor_matrix)
                target: Tensor,      # [B, N+1] the target's token at each row
                depth: int) -> tuple[Tensor, Tensor, Tensor]:  # [B, D+1], [B], [B, D+1]
    """Greedy (or sampled exact-match) acceptance on a tree: the longest root path whose
    nodes each equal the target's token at their parent, plus the target's token after it.

    Returns accepted tokens (the target's tokens along the path), num_accepted (path nodes
    + 1) and the path's rows by depth. Siblings hold distinct tokens, so at most one child
    of a row matches; among equally deep matches (only with duplicate padding nodes) the
    first row wins. tokens [7, 8, 9], parents [0, 0, 2], target [8, 5, 9, 4]: the root's
    token 8 is row 2, row 2's token 9 is row 3, row 3's token 4 has no row -> path rows
    [0, 2, 3], accepted [8, 9, 4], num_accepted 3.
    """
    batch, n = tokens.shape
    full = torch.cat([parents.new_zeros(batch, 1), parents], 1)          # [B, N+1]
    match = torch.cat([tokens.new_ones(batch, 1, dtype=torch.bool),
                       tokens == target.gather(1, parents)], 1)          # [B, N+1]
    ok = match
    for _ in range(depth):           # ok: every row from the root to here matches
        ok = match & ok.gather(1, full)
    depths = ancestors.sum(-1) - 1                                       # [B, N+1]
    last = torch.where(ok, depths + 1, 0).argmax(-1)                     # deepest (first)
    path = _path_to(last, ancestors, depths, depth)
    return target.gather(1, path), depths.gather(1, last[:, None])[:, 0] + 1, path


def forced_tree_accept(ancestors: Tensor, target: Tensor, depth: int,
                       num_forced: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Forced acceptance (benchmarks): the path to the first row at depth num_forced - 1
    (or at the tree's greatest depth, if it is shallower); emitted: the target's tokens on
    it. num_forced [B] in [1, D+1]."""
    depths = ancestors.sum(-1) - 1                                       # [B, N+1]
    want = torch.minimum(num_forced - 1, depths.amax(-1))                # [B]
    last = (depths == want[:, None]).int().argmax(-1)                    # first such row
    path = _path_to(last, ancestors, depths, depth)
    return target.gather(1, path), want + 1, path


def mask_tree_block(meta: AttentionMetadata, req_index: Tensor, base: Tensor,
                    ancestors: Tensor) -> AttentionMetadata:
    """A copy of the metadata in which request req_index[g]'s rows see
    the keys in the block of cache positions base[g] .. base[g] + W - 1 only where
    ancestors[g, row, key - base[g]] holds ([G, R, W]); keys outside the block stay causal
    (the rows' `positions` in meta are their cache positions, not their rotary ones)."""
    if meta.mask is None:
        return _tree_rows(meta, req_index, base, ancestors)
    groups, rows, width = ancestors.shape
    key = torch.arange(meta.mask.shape[-1], device=base.device)
    rel = key[None, :] - base[:, None]                                   # [G, KV]
    inside = (rel >= 0) & (rel < width)
    allowed = ancestors.gather(2, rel.clamp(0, width - 1)[:, None, :]
                               .expand(groups, rows, key.shape[0]))      # [G, R, KV]
    mask = meta.mask.clone()
    mask[req_index, 0, :rows] &= ~inside[:, None, :] | allowed
    return replace(meta, mask=mask)


def _tree_rows(meta: AttentionMetadata, req_index: Tensor, base: Tensor,
               ancestors: Tensor) -> AttentionMetadata:
    """mask_tree_block for the Triton backend's metadata: every row gets its own mask row
    over its request's block (`tree_mask` [T, W], `tree_base` [T]); the first R rows of
    request req_index[g] take ancestors[g], other rows a block they never reach (causal)."""
    groups, rows, width = ancestors.shape
    num_rows, device = meta.token_req.shape[0], base.device
    index = torch.arange(num_rows, device=device)
    first = torch.full((meta.block_tables.shape[0],), num_rows, device=device)
    first = first.scatter_reduce(0, meta.token_req, index, "amin")        # [B] first row
    group = torch.full_like(first, -1)
    group[req_index] = torch.arange(groups, device=device)
    g = group[meta.token_req]                                            # [T], -1: no tree
    idx = index - first[meta.token_req]                                  # row in request
    tree = (g >= 0) & (idx < rows)
    gi, ii = g.clamp(min=0), idx.clamp(0, rows - 1)
    mask = (ancestors[gi, ii] & tree[:, None]).to(torch.int8)            # [T, W]
    # rows outside a tree: a block past every position (never reached: plain causal)
    tree_base = torch.where(tree, base.to(meta.positions.dtype)[gi], 1 << 30)
    return replace(meta, tree_mask=mask, tree_base=tree_base)


def _slots(block_tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    return block_tables.gather(1, positions // block_size) * block_size + positions % block_size


def cache_tensors(attn) -> list[Tensor]:
    """The per-slot cache tensors of an attention layer (keys and values, or MLA's latents
    and DSA's indexer keys)."""
    return [t for t in (getattr(attn, name, None) for name in ("k_cache", "v_cache",
                                                                 "latent_cache", "index_cache"))
            if t is not None]


def compact_cache(attn_layers, block_tables: Tensor, base: Tensor, path: Tensor,
                  block_size: int):
    """Moves each request's accepted path (rows path[g, d] of the block at cache position
    base[g]) to positions base[g] + d, where a chain would have written them.
    block_tables [G, nb], base [G], path [G, D+1]."""
    steps = torch.arange(path.shape[1], device=path.device)
    src = _slots(block_tables, base[:, None] + path, block_size).reshape(-1)
    dst = _slots(block_tables, base[:, None] + steps, block_size).reshape(-1)
    by_pool: dict[int, list] = {}      # id(kv_pool) -> the layers of it given here
    rest = []
    for attn in attn_layers:
        pool = getattr(attn, "kv_pool", None)
        (rest if pool is None else by_pool.setdefault(id(pool), [])).append(attn)
    for layers in by_pool.values():
        pool = layers[0].kv_pool
        if len(layers) == pool.shape[1]:    # every layer of the pool: one move for all
            flat = raw(pool).flatten(0, 1)                            # [2 L, slots, Hkv, D]
            flat.index_copy_(1, dst, flat.index_select(1, src))
        else:
            rest += layers
    for attn in rest:
        for cache in map(raw, cache_tensors(attn)):      # (e4m3 caches: as bytes)
            cache.index_copy_(0, dst, cache.index_select(0, src))


def compact_rows(x: Tensor, gen_start: int, rows_per_gen: int, path: Tensor) -> Tensor:
    """x [T, F] with the generation requests' rows (rows_per_gen each from gen_start) moved
    along their accepted paths [G, D+1], as compact_cache moves their cache entries."""
    index = torch.arange(x.shape[0], device=x.device)
    gen = index[gen_start:].view(-1, rows_per_gen)
    gen[:, :path.shape[1]] = gen[:, :1] + path
    return x[index]
