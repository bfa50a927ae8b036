"""Training-time test (TTT): the EAGLE-3 draft loop unrolled over K steps on whole sequences.

For a sequence x(0..T-1) with target features h(t) and target distributions p(t) (the
target's prediction of x(t+1)), step i computes, for every row t at once:

    step 0:  token x(t+1),   hidden fc(h(t)),                 position t
    step i:  token x(t+1+i), hidden = step i-1's pre-norm out, position t+i
    target:  p(t+1+i), i.e. the target's prediction of x(t+2+i)

which is what the inference loop (docs/DECODING.md, "draft loop") does at one position
p = t: step 0 over the prefix, then single-token steps at p+1, p+2, ... feeding back the head's own output.
Attention matches the inference KV cache: row t at step i sees step-0 keys of rows <= t
(the prefix, written from target features) and its own keys of steps 1..i (the earlier
drafts of this round), nothing else — `ttt_attention_mask`.

Loss = sum_i decay^i * KL(p || q_i) over the draft vocab (p restricted and renormalised),
averaged over valid rows: inside the sequence, under the loss mask, and with a target argmax
that the draft vocab can express (t2d).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onespec.layers.rotary import RotaryEmbedding
from onespec.models.eagle3 import Eagle3Head
from onespec.train.features import TargetBatch, project_qkv, repeat_kv


def ttt_attention_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """[T, T·(step+1)] bool, True = attend. Key column s·T + j is row j's key of step s.

    Row t sees step-0 keys j <= t and, for each step s in 1..step, only its own key (s·T + t).
    """
    t = torch.arange(seq_len, device=device)
    causal = t[None, :] <= t[:, None]                                        # [T, T]
    diag = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t+n] (fill past the end)."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class StepStats:
    loss: torch.Tensor           # scalar KL of this step (graph attached)
    num_rows: torch.Tensor       # rows in the loss (in-vocab, masked in)
    num_correct: torch.Tensor    # rows where the draft argmax equals the target argmax
    num_scored: torch.Tensor     # rows scored for accuracy (masked in, any target token)


def ttt_logits(head: Eagle3Head, embed: torch.nn.Embedding, rotary: RotaryEmbedding,
               input_ids: torch.Tensor, features: torch.Tensor, num_steps: int):
    """Yields the draft logits [B, T, Vd] of steps 0..num_steps-1 (row t of step i predicts
    x(t+2+i)); input_ids [B, T], features [B, T, n·H] target captures."""
    if len(head.layers) != 1:
        raise ValueError("TTT training supports one-layer EAGLE-3 heads only")
    layer = head.layers[0]
    attn = layer.self_attn
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    hidden = head.fc(features)                                               # [B, T, H]
    keys, values = [], []
    for step in range(num_steps):
        tokens = shift_left(input_ids, 1 + step)                             # x(t+1+i)
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        a = torch.cat([layer.input_layernorm(embed(tokens)), normed], dim=-1)  # [B, T, 2H]
        q, k, v = project_qkv(attn, a, positions + step, rotary)
        keys.append(repeat_kv(k, attn.num_heads))
        values.append(repeat_kv(v, attn.num_heads))
        mask = ttt_attention_mask(t, step, input_ids.device)
        out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                             attn_mask=mask, scale=attn.scale)
        h = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))           # carried pre-norm
        yield head.lm_head(head.norm(hidden)).float()


def ttt_forward(head: Eagle3Head, embed: torch.nn.Embedding, rotary: RotaryEmbedding,
                input_ids: torch.Tensor, loss_mask: torch.Tensor, target: TargetBatch,
                num_steps: int) -> list[StepStats]:
    """input_ids, loss_mask [B, T] (right-padded, mask False on padding) -> per-step stats.

    Step i row t is scored when x(t+2+i) is a loss token; it enters the loss when, besides,
    the target's argmax at t+1+i lies in the draft vocab."""
    in_vocab = torch.ones_like(loss_mask) if head.t2d is None else head.t2d[target.target_ids]
    stats = []
    for step, logits in enumerate(ttt_logits(head, embed, rotary, input_ids, target.features,
                                             num_steps)):
        scored = shift_left(loss_mask, 2 + step, False)
        stats.append(_step_stats(head, logits, scored,
                                 scored & shift_left(in_vocab, 1 + step, False),
                                 shift_left(target.target_logp, 1 + step),
                                 shift_left(target.target_ids, 1 + step)))
    return stats


def _step_stats(head, logits, scored, valid, target_logp, target_ids) -> StepStats:
    """logits, target_logp [B, T, Vd]; scored, valid [B, T] bool; target_ids [B, T]."""
    logq = torch.log_softmax(logits, dim=-1)
    p = target_logp.exp()
    kl = (p * (target_logp - logq)).sum(-1)                                  # [B, T]
    num_rows = valid.sum()
    loss = (kl * valid).sum() / num_rows.clamp(min=1)
    with torch.no_grad():
        correct = head.to_target_ids(logits.argmax(-1)) == target_ids
        num_correct = (correct & scored).sum()
    return StepStats(loss, num_rows, num_correct, scored.sum())


def ttt_loss(stats: list[StepStats], decay: float) -> torch.Tensor:
    """sum_i decay^i * loss_i."""
    return sum(decay ** i * s.loss for i, s in enumerate(stats))
