"""Inputs of a generation step taken from the step before it, on the device.

With the overlap scheduler (engine/engine.py) step n+1 is launched before the host has seen
step n's results, so for each request that continues, its next inputs are derived where
those results are: the first row's token is the last accepted one, the other rows are the
new drafts, and every position moves on by the number of tokens step n accepted.

Both live in flat int64 buffers laid out by the step shape's InputLayout (the inputs) and
ResultsLayout (the previous step's results: accepted, counts, drafts and a tree's parents),
both in speculative/shape.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.speculative.shape import InputLayout, ResultsLayout


@triton.jit
def _chain_kernel(INP, PREV, o_ids, o_pos, o_drafts, o_src, o_num, o_prev_drafts,
                  K: tl.constexpr, ROW_PAD: tl.constexpr):
    i = tl.program_id(0)
    j = tl.load(INP + o_src + i)          # the previous step's request row, -1: host inputs
    if j >= 0:
        c = tl.arange(0, ROW_PAD)
        num = tl.load(PREV + o_num + j)
        last = tl.load(PREV + j * (K + 1) + num - 1)
        drafts = PREV + o_prev_drafts + j * K
        shifted = tl.load(drafts + c - 1, mask=(c >= 1) & (c <= K), other=0)
        tl.store(INP + o_ids + i * (K + 1) + c, tl.where(c == 0, last, shifted), mask=c <= K)
        pos = INP + o_pos + i * (K + 1) + c
        tl.store(pos, tl.load(pos, mask=c <= K) + num, mask=c <= K)
        tl.store(INP + o_drafts + i * K + c, tl.load(drafts + c, mask=c < K), mask=c < K)


def chain_inputs(inp: torch.Tensor, prev: torch.Tensor, layout: InputLayout,
                 results: ResultsLayout):
    """In place on inp (in `layout`): each request row i with source j = src[i] >= 0 takes
    ids [last accepted of j, drafts of j], drafts of j, and its positions + num_accepted[j]
    (the host wrote j's positions of the previous step there). results: prev's layout."""
    k = results.k
    _chain_kernel[(results.b,)](inp, prev, 0, layout.pos_at, layout.drafts_at, layout.src_at,
                                results.num_accepted_at, results.drafts_at, K=k,
                                ROW_PAD=max(2, triton.next_power_of_2(k + 1)), num_warps=1)


def chain_inputs_reference(inp: torch.Tensor, prev: torch.Tensor, layout: InputLayout,
                           results: ResultsLayout):
    """chain_inputs in PyTorch (tests)."""
    v = layout.views(inp)
    ids, pos, drafts = v["ids"], v["pos"], v["drafts"]
    accepted, num, prev_drafts, _ = _views(prev, results)
    for i, j in enumerate(v["src"].tolist()):
        if j < 0:
            continue
        n = int(num[j])
        ids[i, 0] = accepted[j, n - 1]
        ids[i, 1:] = prev_drafts[j]
        drafts[i] = prev_drafts[j]
        pos[i] += n


def _views(prev: torch.Tensor, results: ResultsLayout):
    """accepted [b, K+1], num_accepted [b], drafts [b, D] and parents [b, D] (or None) of
    a step's flat results."""
    b, k, nd = results.b, results.k, results.num_drafts
    return (prev[:results.num_accepted_at].view(b, k + 1),
            prev[results.num_accepted_at:results.drafts_at],
            prev[results.drafts_at:results.parents_at].view(b, nd),
            prev[results.parents_at:results.size].view(b, nd) if results.has_parents else None)


def chain_tree_inputs(inp: torch.Tensor, prev: torch.Tensor, layout: InputLayout,
                      results: ResultsLayout):
    """chain_inputs for tree steps of depth k and num_nodes nodes, in PyTorch operations
    (no host sync: graph-capturable, and runs on any device). The inputs hold ids and
    positions [b, N+1], nodes [b, N], then their parents [b, N]; the previous step's
    results hold accepted [b, k+1], counts [b], nodes [b, N], parents [b, N]. Row i with
    source j >= 0 takes ids [last accepted of j, nodes of j], j's nodes and parents, and
    its positions + num_accepted[j]; other rows keep the host's inputs."""
    k = results.k
    v = layout.views(inp)
    src = v["src"]
    has = (src >= 0)[:, None]
    j = src.clamp(min=0)
    accepted, counts, prev_nodes, prev_parents = _views(prev, results)
    num = counts[j]                                                        # [b]
    # (a row without a source may read a count another bucket's step left there: clamped,
    # so the gather stays in range; its value is dropped below)
    last = accepted[j].gather(1, (num - 1).clamp(0, k)[:, None])
    nodes, parents = prev_nodes[j], prev_parents[j]
    ids = v["ids"]
    ids.copy_(torch.where(has, torch.cat([last, nodes], 1), ids))
    v["pos"].add_(torch.where(has, num[:, None], 0))
    for dst, val in ((v["drafts"], nodes), (v["parents"], parents)):
        dst.copy_(torch.where(has, val, dst))
