"""MoE routing and the sort of its (token, expert) pairs in one Triton program, for the
decode-sized steps where a string of small PyTorch operations (sigmoid, group scores,
top-k, normalisation, sort, offsets: some thirty launches) would cost more than the
experts' weight stream.

One program holds every token's router logits [T, E] (E a power of two) and computes,
as models/moe.py's routing functions do:

    sigmoid (DeepSeek-V3)  choose with sigmoid + bias within the best `topk_group` of
                           `n_group` groups (a group scores its best two); weights =
                           sigmoid of the chosen, / their sum if norm, * scaling
    softmax (Qwen3-MoE)    the top-k of softmax(logits); / their sum if norm; rounded to
                           the logits' dtype

Top-k is k rounds of "the best remaining" (ties: the lower expert id). The pairs are then
sorted by expert with a counting sort whose ties keep token order, as a stable sort of
the flat [T, k] ids does: a pair's place is its expert's offset plus the number of earlier
tokens that chose the same expert (a token chooses an expert at most once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.kernels.moe import Routing

MAX_TOKENS = 64          # tokens up to which routing runs as this one program
MAX_EXPERTS = 256


@triton.jit
def _best(values, cols, NO: tl.constexpr):
    """Per row: the column of the largest value (the lowest such column on ties)."""
    top = tl.max(values, 1)
    return tl.min(tl.where(values == top[:, None], cols, NO), 1)


@triton.jit
def _group_mask(choice, T_PAD: tl.constexpr, E: tl.constexpr, GROUPS: tl.constexpr,
                TOPK_GROUPS: tl.constexpr):
    """[T, E]: whether each expert lies in one of its token's best TOPK_GROUPS groups, a
    group scoring the sum of its best two choices (its best one if it has one expert)."""
    PER: tl.constexpr = E // GROUPS
    c3 = tl.reshape(choice, [T_PAD, GROUPS, PER])
    first = tl.max(c3, 2)
    if PER >= 2:
        inner = tl.arange(0, PER)[None, None, :]
        at = tl.min(tl.where(c3 == first[:, :, None], inner, PER), 2)
        score = first + tl.max(tl.where(inner == at[:, :, None], float("-inf"), c3), 2)
    else:
        score = first
    groups = tl.arange(0, GROUPS)[None, :]
    keep = tl.zeros([T_PAD, GROUPS], tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        g = _best(tl.where(keep != 0, float("-inf"), score), groups, GROUPS)
        keep = tl.where(groups == g[:, None], 1, keep)
    keep3 = tl.broadcast_to(keep[:, :, None], [T_PAD, GROUPS, PER])
    return tl.reshape(keep3, [T_PAD, E]) != 0


@triton.jit
def _route_sort_kernel(LOGITS, BIAS, IDS, WEIGHTS, SLOTS, PAIR_TOKEN, PAIR_WEIGHT, OFFSETS,
                       num_tokens, stride_l, scaling,
                       T_PAD: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr,
                       SIGMOID: tl.constexpr, GROUPS: tl.constexpr,
                       TOPK_GROUPS: tl.constexpr, NORM: tl.constexpr):
    t = tl.arange(0, T_PAD)
    e = tl.arange(0, E)
    t_ok = t < num_tokens
    logits = tl.load(LOGITS + t[:, None] * stride_l + e[None, :], mask=t_ok[:, None],
                     other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores + tl.load(BIAS + e).to(tl.float32)[None, :]
        if GROUPS > 1:
            choice = tl.where(_group_mask(choice, T_PAD, E, GROUPS, TOPK_GROUPS), choice,
                              float("-inf"))
    else:
        shifted = tl.exp(logits - tl.max(logits, 1)[:, None])
        scores = shifted / tl.sum(shifted, 1)[:, None]
        choice = scores
    cols = e[None, :]
    taken = tl.zeros([T_PAD, E], tl.int32)       # 1 where the token chose the expert
    total = tl.zeros([T_PAD], tl.float32)
    for j in tl.static_range(TOP_K):
        best = _best(tl.where(taken != 0, float("-inf"), choice), cols, E)
        hit = cols == best[:, None]
        taken = tl.where(hit, 1, taken)
        total += tl.sum(tl.where(hit, scores, 0.0), 1)
    taken = tl.where(t_ok[:, None], taken, 0)
    # counting sort: offsets of each expert, then each pair's rank among its expert's
    counts = tl.sum(taken, 0)                                            # [E]
    ends = tl.cumsum(counts, 0)
    tl.store(OFFSETS + 1 + e, ends)
    tl.store(OFFSETS + e, 0, mask=e == 0)
    before = tl.cumsum(taken, 0) - taken + (ends - counts)[None, :]      # [T, E] places
    chosen = tl.zeros([T_PAD, E], tl.int32)
    for j in tl.static_range(TOP_K):
        # the pairs again, in the same order: pair j of a token is its j-th best
        best = _best(tl.where(chosen != 0, float("-inf"), choice), cols, E)
        hit = cols == best[:, None]
        chosen = tl.where(hit, 1, chosen)
        w = tl.sum(tl.where(hit, scores, 0.0), 1)
        if SIGMOID:
            if NORM:
                w = w / (total + 1e-20)
            w = w * scaling
        else:
            if NORM:
                w = w / total
            w = w.to(LOGITS.dtype.element_ty).to(tl.float32)
        place = tl.sum(tl.where(hit, before, 0), 1)
        pair = t * TOP_K + j
        tl.store(IDS + pair, best, mask=t_ok)
        tl.store(WEIGHTS + pair, w, mask=t_ok)
        tl.store(SLOTS + place, pair, mask=t_ok)
        tl.store(PAIR_TOKEN + place, t, mask=t_ok)
        tl.store(PAIR_WEIGHT + place, w, mask=t_ok)


def fused_route_fits(num_tokens: int, num_experts: int, top_k: int, num_groups: int = 1,
                     topk_groups: int = 1) -> bool:
    """Whether route_and_sort takes these shapes (else: PyTorch routing, sort_pairs): at
    most MAX_TOKENS tokens, power-of-two expert and group counts, and top_k experts
    within the groups kept."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0     # noqa: E731
    return (0 < num_tokens <= MAX_TOKENS and num_experts <= MAX_EXPERTS and pow2(num_experts)
            and pow2(num_groups) and num_experts % num_groups == 0
            and 0 < topk_groups <= num_groups
            and 0 < top_k <= topk_groups * (num_experts // num_groups))


def route_and_sort(logits: torch.Tensor,            # [T, E] router logits
                   top_k: int, *, sigmoid: bool, bias: torch.Tensor | None = None,
                   num_groups: int = 1, topk_groups: int = 1, norm_topk_prob: bool = True,
                   scaling: float = 1.0) -> Routing:
    """The routing of models/moe.py (deepseek_route if sigmoid, else softmax_route) and
    its pairs sorted by expert, in one launch (fused_route_fits must hold)."""
    num_tokens, num_experts = logits.shape
    groups, kept = (num_groups, topk_groups) if sigmoid else (1, 1)
    if not fused_route_fits(num_tokens, num_experts, top_k, groups, kept) or \
            (sigmoid and bias is None):
        raise ValueError(f"route_and_sort: logits {tuple(logits.shape)} with top_k={top_k}, "
                         f"n_group={num_groups}, topk_group={topk_groups} are outside the "
                         f"fused routing (tokens <= {MAX_TOKENS}, experts a power of two <= "
                         f"{MAX_EXPERTS}, top_k within the groups kept; a sigmoid router "
                         "needs its bias)")
    dev, pairs = logits.device, num_tokens * top_k
    ints = lambda n: torch.empty(n, dtype=torch.int32, device=dev)    # noqa: E731
    r = Routing(ids=ints(pairs).view(num_tokens, top_k),
                weights=torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev),
                slots=ints(pairs), pair_token=ints(pairs),
                pair_weight=torch.empty(pairs, dtype=torch.float32, device=dev),
                offsets=ints(num_experts + 1))
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_sort_kernel[(1,)](
        logits, logits if bias is None else bias, r.ids, r.weights, r.slots, r.pair_token,
        r.pair_weight, r.offsets, num_tokens, logits.stride(0), float(scaling),
        T_PAD=max(16, triton.next_power_of_2(num_tokens)), E=num_experts, TOP_K=top_k,
        SIGMOID=sigmoid, GROUPS=groups, TOPK_GROUPS=kept, NORM=norm_topk_prob,
        num_warps=4 if num_tokens * num_experts <= 4096 else 8)
    return r
