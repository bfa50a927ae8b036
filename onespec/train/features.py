"""Target features for draft training: a dense (non-paged) forward of the onespec target.

The paged forward in models/llama.py serves the engine; training wants a padded batch
[B, T] with plain causal attention. This forward reuses the target's own modules (embedding,
each layer's norms, packed qkv_proj, o_proj, MLP, the rotary table) and swaps only the
attention kernel, so the captured residual streams are the ones inference captures.

Batches are right-padded: with causal attention a real row never sees a padding row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onespec.models.llama import Attention, LlamaForCausalLM

LOGIT_CHUNK_ROWS = 4096      # rows of [rows, V] target logits materialised at a time


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, num_heads, S, D] (grouped-query attention)."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1) if x.shape[1] != num_heads else x


def project_qkv(attn: Attention, x, positions, rotary):
    """x [B, T, in] -> q [B, Hq, T, D], k, v [B, Hkv, T, D] with RoPE at positions [B, T]."""
    b, t, _ = x.shape
    q, k, v = attn.project(x.reshape(b * t, -1), positions.reshape(-1), rotary)
    return tuple(y.view(b, t, *y.shape[1:]).transpose(1, 2) for y in (q, k, v))


def causal_attention(attn: Attention, x, positions, rotary, sliding_window: int | None):
    """Dense causal self-attention with the module's weights: x [B, T, H] -> [B, T, H]. A
    layer's own window and sinks (gpt-oss: `window`, `sinks`) apply as in inference."""
    b, t, _ = x.shape
    q, k, v = project_qkv(attn, x, positions, rotary)
    k, v = repeat_kv(k, attn.num_heads), repeat_kv(v, attn.num_heads)
    sliding_window = getattr(attn, "window", None) or sliding_window
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:
        i = torch.arange(t, device=x.device)
        mask = i[None, :] <= i[:, None]
        if sliding_window is not None:
            mask &= i[None, :] > i[:, None] - sliding_window
        scores = (q.float() @ k.float().transpose(-1, -2) * attn.scale).masked_fill(
            ~mask, float("-inf"))                                           # [B, Hq, T, T]
        sink = sinks.float().view(1, -1, 1, 1).expand(b, -1, t, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out = (probs @ v.float()).to(q.dtype)
    elif sliding_window is not None and t > sliding_window:
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))


@torch.no_grad()
def dense_forward(model: LlamaForCausalLM, input_ids, capture: tuple[int, ...]):
    """input_ids [B, T] -> (final-normed hidden [B, T, H], captured [B, T, len(capture)·H]).

    Captured values are the residual stream after each layer in `capture` (outputs-of ids,
    docs/DECODING.md "hidden-state capture"), concatenated in the order given (repeats allowed)."""
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    window = model.config.sliding_window
    h = model.model.embed_tokens(input_ids)
    saved = {}
    for i, layer in enumerate(model.model.layers):
        a = causal_attention(layer.self_attn, layer.input_layernorm(h), positions,
                             model.rotary, window)
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in capture:
            saved[i] = h
    return model.model.norm(h), torch.cat([saved[i] for i in capture], dim=-1)


@dataclass
class TargetBatch:
    """What the draft head learns from, for a padded batch [B, T]."""
    features: torch.Tensor       # [B, T, n·H] captured residual streams
    target_logp: torch.Tensor    # [B, T, Vd] float32 log-probs over the draft vocab (renormalised)
    target_ids: torch.Tensor     # [B, T] int64 argmax over the full target vocab


@torch.no_grad()
def target_batch(model: LlamaForCausalLM, input_ids, capture: tuple[int, ...],
                 draft_ids: torch.Tensor | None) -> TargetBatch:
    """Runs the target once. draft_ids [Vd] are the draft vocab's target ids (None: all)."""
    hidden, features = dense_forward(model, input_ids, capture)
    flat = hidden.reshape(-1, hidden.shape[-1])
    logps, argmax = [], []
    for rows in flat.split(LOGIT_CHUNK_ROWS):
        logits = model.compute_logits(rows)                                 # [r, V] float32
        argmax.append(logits.argmax(-1))
        if draft_ids is not None:
            logits = logits[:, draft_ids]
        logps.append(torch.log_softmax(logits, dim=-1))
    b, t = input_ids.shape
    return TargetBatch(features, torch.cat(logps).view(b, t, -1), torch.cat(argmax).view(b, t))
