"""One speculative step with a dynamic tree (docs/DECODING.md, "dynamic trees"):
tree-masked verify -> acceptance along the longest matching root path -> the accepted
path's cache entries and hidden rows moved to chain positions -> draft step 0 -> tree
expansion.

A generation request's verify block is N + 1 rows [t_last, n1 .. nN] at cache positions
P .. P+N (row i writes position P + i) and rotary positions P + depth; after acceptance
the path's rows sit at P .. P + n - 1, as a chain of n - 1 accepted drafts would have left
them, so draft step 0 and everything after treat the block as a chain's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from onespec.speculative.tree import compact_cache, compact_rows
from onespec.speculative.tree_draft import draft_tree

if TYPE_CHECKING:
    from onespec.speculative.shape import TreeShape


def tree_step(worker, inp, shape: TreeShape):
    """worker: the SpecWorker (target, drafter, sampling helpers); inp: StepInputs of a step
    with K = shape.depth. Returns (context_tokens [Bc], accepted [Bg, D+1],
    num_accepted [Bg], drafts [Bd, N], parents [Bd, N])."""
    tree = inp.tree
    positions, meta = (tree.positions, tree.meta) if tree is not None else \
        (inp.positions, inp.meta)
    hidden, captured = worker.verify_rows(inp, positions, meta)
    rows = hidden[inp.logit_rows]
    sampled = worker.verifier.tokens(rows, inp.row_sampling, None)                   # [R]
    bc, bg, width = inp.num_ctx, inp.num_gen, shape.num_nodes + 1
    context_tokens = sampled[:bc]
    if bg:
        accepted, num_accepted, path = worker.acceptor.accept_tree(
            inp, shape.depth, sampled[bc:].view(bg, width))
        base = inp.positions[inp.gen_start::width]                          # [Bg] P
        compact_cache([layer.self_attn for layer in worker.target.model.layers],
                      inp.block_tables[bc:], base, path, inp.block_size)
        hidden = compact_rows(hidden, inp.gen_start, width, path)
        captured = compact_rows(captured, inp.gen_start, width, path)
        step0 = accepted.new_zeros(bg, width)
        step0[:, :accepted.shape[1]] = accepted                             # [Bg, N+1]
    else:
        empty = torch.empty(0, shape.depth + 1, dtype=torch.int64, device=rows.device)
        accepted, num_accepted, step0 = empty, empty[:, 0], empty
    h = worker.first_pass(inp, hidden, captured, context_tokens, step0)
    h, pos, block_tables = worker.roots(inp, h, num_accepted, width)
    if h.shape[0] == 0:            # only chunks that do not end their prompt: no drafts
        none = torch.empty(0, shape.num_nodes, dtype=torch.int64, device=rows.device)
        return context_tokens, accepted, num_accepted, none, none
    drafts, parents = draft_tree(worker.drafter, h, pos, block_tables, shape, inp.block_size,
                                 inp.max_kv_draft, worker.attn_backend)
    return context_tokens, accepted, num_accepted, drafts, parents

