"""P-EAGLE training: one forward predicts depths 0..K-1 from sampled anchors, with
conditional drop-token (COD) sampling so memory does not grow K-fold.

For a sequence x(0..T-1) with target features h(t) and target distributions p(t):

    depth 0, every row a:    token x(a+1),     hidden fc(h(a)),         position a
    depth d, sampled a:      the mask token,   hidden fc(mask_hidden),  position a+d
    target of (a, d):        p(a+1+d), the target's prediction of x(a+2+d)

which is what one parallel drafting forward computes at inference for a root a
(docs/DECODING.md, "Parallel drafting"). Attention matches it: row (a, d) sees depth-0 rows
a' <= a (the committed prefix) and the rows (a, 1..d) of its own rollout, nothing else.

COD sampling: the anchors of depth d are a random subset of those of depth d-1, of
max(ratio^d, ratio_min) times the valid anchors, so every sampled row's rollout is
complete and the rows grow like T·(1 + r + r^2 + ...) instead of T·K.
Loss = sum_d decay^d * KL(p || q_d) over the draft vocabulary, as in ttt.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onespec.layers.rotary import RotaryEmbedding
from onespec.models.eagle3 import Eagle3Head
from onespec.train.features import TargetBatch, project_qkv, repeat_kv
from onespec.train.ttt import StepStats, _step_stats


def cod_anchors(valid: torch.Tensor, depth: int, ratio: float, ratio_min: float,
                generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """valid [T] bool (anchors whose depth-0 target is scored) -> the anchors of depths
    1..depth-1, each a sorted subset of the one before."""
    pool = valid.nonzero().flatten()
    n, out = pool.numel(), []
    for d in range(1, depth):
        size = min(pool.numel(), int(n * max(ratio ** d, ratio_min)))
        if size == 0:
            break
        pick = torch.randperm(pool.numel(), generator=generator)[:size].to(pool.device)
        pool = pool[pick].sort().values
        out.append(pool)
    return out


def peagle_rows(seq_len: int, anchors: list[torch.Tensor], device):
    """(anchor, depth) of every row: the T depth-0 rows, then each sampled depth's."""
    anchor = torch.cat([torch.arange(seq_len, device=device)] + [a.to(device) for a in anchors])
    depth = torch.cat([torch.zeros(seq_len, dtype=torch.long, device=device)] +
                      [torch.full((a.numel(),), d + 1, dtype=torch.long, device=device)
                       for d, a in enumerate(anchors)])
    return anchor, depth


def peagle_mask(anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[N, N] bool, True = attend: depth-0 keys of anchors <= the query's, and the query's
    own rollout up to its depth."""
    real = (depth[None, :] == 0) & (anchor[None, :] <= anchor[:, None])
    rollout = (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None])
    return real | rollout


def peagle_logits(head: Eagle3Head, embed: torch.nn.Embedding, rotary: RotaryEmbedding,
                  input_ids: torch.Tensor, features: torch.Tensor, anchor, depth):
    """One sequence's draft logits [N, Vd] at rows (anchor, depth) [N]; input_ids [T],
    features [T, n·H]."""
    t = input_ids.shape[0]
    real = depth == 0
    next_ids = torch.cat([input_ids[1:], input_ids.new_zeros(1)])           # x(a+1)
    tokens = torch.where(real, next_ids[anchor], head.config.mask_token_id)
    hidden = torch.where(real[:, None], features[anchor.clamp(max=t - 1)],
                         head.mask_hidden.to(features.dtype)[None, :])
    hidden = head.fc(hidden)[None]                                           # [1, N, H]
    positions = (anchor + depth)[None]
    mask = peagle_mask(anchor, depth)
    first = head.layers[0]
    normed = first.hidden_norm(hidden)
    residual = normed if first.norm_before_residual else hidden
    x = torch.cat([first.input_layernorm(embed(tokens)[None].to(hidden.dtype)), normed], -1)
    h = residual
    for i, layer in enumerate(head.layers):
        if i > 0:
            x = layer.input_layernorm(h)
        attn = layer.self_attn
        q, k, v = project_qkv(attn, x, positions, rotary)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, attn.num_heads),
                                             repeat_kv(v, attn.num_heads), attn_mask=mask,
                                             scale=attn.scale)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(1, -1, attn.q_size))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return head.lm_head(head.norm(h[0])).float()


def peagle_forward(head: Eagle3Head, embed: torch.nn.Embedding, rotary: RotaryEmbedding,
                   input_ids: torch.Tensor, loss_mask: torch.Tensor, target: TargetBatch,
                   depth: int, ratio: float, ratio_min: float,
                   generator: torch.Generator | None = None) -> list[StepStats]:
    """input_ids, loss_mask [B, T] -> per-depth stats summed over the batch's sequences.
    Row (a, d) is scored when x(a+2+d) is a loss token; it enters the loss when, besides,
    the target's argmax at a+1+d lies in the draft vocab."""
    b, t = input_ids.shape
    device = input_ids.device
    in_vocab = torch.ones_like(loss_mask) if head.t2d is None else head.t2d[target.target_ids]
    parts = [[] for _ in range(depth)]
    for i in range(b):
        scored0 = torch.zeros(t, dtype=torch.bool, device=device)
        scored0[:t - 2] = loss_mask[i, 2:]
        anchor, dep = peagle_rows(t, cod_anchors(scored0.cpu(), depth, ratio, ratio_min,
                                                 generator), device)
        logits = peagle_logits(head, embed, rotary, input_ids[i], target.features[i],
                               anchor, dep)
        ref = anchor + 1 + dep                                   # whose p the row predicts
        ok = ref + 1 < t
        ref = ref.clamp(max=t - 1)
        scored = ok & loss_mask[i, (ref + 1).clamp(max=t - 1)]
        valid = scored & in_vocab[i, ref]
        for d in range(depth):
            rows = dep == d
            parts[d].append((logits[rows], scored[rows], valid[rows],
                             target.target_logp[i, ref[rows]], target.target_ids[i, ref[rows]]))
    stats = []
    for d in range(depth):
        stats.append(_step_stats(head, *[torch.cat(x) for x in zip(*parts[d])]))
    return stats
