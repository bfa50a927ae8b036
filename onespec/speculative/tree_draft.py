"""Drafting a dynamic tree (docs/DECODING.md, "dynamic trees"), EAGLE-2 style.

From each request's root (the draft row of its last accepted token, after draft step 0):
the root's top-k tokens are depth 1; at each later depth the k frontier nodes of highest
cumulative log-probability run one batched draft pass (k rows per request, each attending
to the request's draft KV and to its own ancestors' entries only), and each proposes its
top-k children; the best k children become the next frontier. After the last depth the
`num_nodes` best of all scored nodes are kept (select_tree).

Draft-KV layout of one request whose root sits at draft position Q: the frontier of depth
d (1 <= d < D) writes cache positions Q + 1 + (d-1)·k .. Q + d·k, at rotary position Q + d.
With k = 1 this is exactly where a chain's draft steps write.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from onespec.layers.attention import build_attention_metadata
from onespec.speculative.drafter import Drafter
from onespec.speculative.tree import mask_tree_block, select_tree

if TYPE_CHECKING:
    from onespec.speculative.shape import TreeShape


def _top_children(drafter: Drafter, h: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The top_k draft tokens of each hidden row h [R, H]: (log-probs [R, k], target ids)."""
    logp = torch.log_softmax(drafter.compute_logits(h).float(), dim=-1)  # [R, Vd]
    scores, ids = logp.topk(top_k, dim=-1)
    return scores, drafter.to_target_ids(ids)


def draft_tree(drafter: Drafter, h: Tensor, pos: Tensor, block_tables: Tensor,
               shape: TreeShape, block_size: int, max_kv: int, backend: str
               ) -> tuple[Tensor, Tensor]:
    """h [B, H]: each root row's carried hidden; pos [B]: its draft position Q;
    block_tables [B, nb]; max_kv: bound on Q + 1 + shape.num_draft_slots.
    Returns the kept nodes' tokens [B, N] (target ids) and parents [B, N]."""
    batch, k = h.shape[0], shape.top_k
    device = h.device
    scores, tokens = _top_children(drafter, h, k)                        # [B, k] depth 1
    cand_scores, cand_tokens = [scores], [tokens]
    cand_parents = [torch.full((batch, k), -1, dtype=torch.int64, device=device)]
    frontier = torch.arange(k, device=device).expand(batch, k)           # candidate index
    width = shape.num_draft_slots
    ancestors = torch.zeros(batch, k, width, dtype=torch.bool, device=device)
    own = torch.arange(k, device=device)
    true = torch.ones((), dtype=torch.bool, device=device)   # (a Python True is a host copy,
    #                                                         which graph capture refuses)
    carried = h.repeat_interleave(k, 0)                                  # [B·k, H]
    for d in range(1, shape.depth):
        ancestors[:, own, (d - 1) * k + own] = true          # each node sees its own entry
        cache_pos = (pos[:, None] + 1 + (d - 1) * k + own).reshape(-1)  # [B·k]
        meta = build_attention_metadata(block_tables, k, cache_pos, block_size, max_kv,
                                        None, backend)
        meta = mask_tree_block(meta, torch.arange(batch, device=device), pos + 1, ancestors)
        out = drafter.forward(tokens.reshape(-1), (pos + d).repeat_interleave(k), carried,
                              meta, step=d)                              # [B·k, H]
        child_scores, child_tokens = _top_children(drafter, out, k)      # [B·k, k]
        child_scores = (scores[:, :, None] + child_scores.view(batch, k, k)).view(batch, -1)
        child_tokens = child_tokens.view(batch, k * k)
        first = sum(s.shape[1] for s in cand_scores)   # this depth's first candidate
        cand_scores.append(child_scores)
        cand_tokens.append(child_tokens)
        cand_parents.append(frontier.repeat_interleave(k, 1))            # [B, k²]
        scores, best = child_scores.topk(k, dim=-1)                      # next frontier
        parent = best // k                                               # [B, k] in frontier
        tokens = child_tokens.gather(1, best)
        frontier = first + best
        ancestors = ancestors.gather(1, parent[:, :, None].expand(batch, k, width))
        carried = out.view(batch, k, -1).gather(
            1, parent[:, :, None].expand(batch, k, out.shape[-1])).reshape(batch * k, -1)
    return select_tree(torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1),
                       torch.cat(cand_parents, 1), shape.num_nodes)
