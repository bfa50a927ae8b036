"""The operations a model's layers are made of, behind one small backend object chosen once
when the model is built: `TorchOps` (portable PyTorch, any device, autograd; the
reference) or `TritonOps` (layers/triton_ops.py: the fused Triton kernels on CUDA).

    norm(norm, x)                          RMSNorm of rows
    linear(layer, x, residual)             (residual +) layer(x)
    gated(layer, x)                        silu(gate) * up of layer(x) = [gate; up]
    add_norm(layer, x, residual, norm)     h = residual + layer(x): (h, norm(h)), the norm
                                           possibly begun only (for the next linear here)
    add_full_norm(...)                     the same with norm(h) complete
    attention(attn, x, positions, ...)     qkv, rotary, KV write, paged attention [T, Hq D]
    embed_concat(ids, table, hidden, ...)  concat(norm_e(embedding), norm_h(hidden))
    routed_experts(experts, x, logits, r)  sum_j w[:, j] * expert_{ids[:, j]}(x), routed (MoE)
    logits(layer, x, norm) / greedy(...)   float32 logits / their argmax per row

A layer calls these in its one forward; which kernels run is the backend's choice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onespec.kernels.settings import KernelSettings
from onespec.layers.attention import AttentionMetadata, windowed_attention
from onespec.layers.norm import RMSNorm
from onespec.quant.kv_fp8 import kv_scales as layer_kv_scales, read_kv, write_kv


class TorchOps:
    """The portable path: PyTorch operations on any device, under autograd too."""

    def norm(self, norm: RMSNorm, x: torch.Tensor, out: torch.Tensor | None = None):
        """norm(x) (copied into `out` if given, e.g. a column slice of a concatenation)."""
        y = norm(x)
        if out is not None:
            out.copy_(y)
        return y

    def linear(self, layer: nn.Linear, x, residual: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = layer(x)
        if residual is not None:
            y = residual + y
        return y if out_dtype is None else y.to(out_dtype)

    def gated(self, layer: nn.Linear, x) -> torch.Tensor:
        gate, up = layer(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def add_norm(self, layer: nn.Linear, x, residual: torch.Tensor, norm: RMSNorm,
                 early_release: bool = False):
        """(h, norm(h)) for h = residual + layer(x). early_release: a kernel-launch hint
        (the next kernel is the next layer's qkv projection)."""
        h = residual + layer(x)
        return h, norm(h)

    def add_full_norm(self, layer: nn.Linear, x, residual: torch.Tensor, norm: RMSNorm):
        h = residual + layer(x)
        return h, norm(h)

    def attention(self, attn, x, positions: torch.Tensor, rotary,
                  meta: AttentionMetadata) -> torch.Tensor:
        """attn's qkv projection of x [T, in], its q/k norm and rotary, this step's k and v
        written to its cache, paged attention: [T, Hq·D] (before o_proj)."""
        return self.attention_from_qkv(attn, attn.qkv_proj(x), positions, rotary, meta)

    def attention_from_qkv(self, attn, qkv: torch.Tensor, positions: torch.Tensor, rotary,
                           meta: AttentionMetadata) -> torch.Tensor:
        """attention() from the projection qkv [T, (Hq + 2 Hkv) D] -> [T, Hq·D]."""
        q, k, v = attn.heads(qkv, positions, rotary)
        out = self.paged_attention(q, k, v, attn.k_cache, attn.v_cache, meta, attn.scale,
                                   **layer_extras(attn))
        return out.reshape(-1, attn.q_size)

    def paged_attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
                        scale: float, sinks=None, window=None, kv_scales=None
                        ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_slots, Hkv, D] -> [T, Hq, D].
        kv_scales (k_scale, v_scale): the caches are e4m3 (quant/kv_fp8.py)."""
        k_scale, v_scale = kv_scales or (None, None)
        write_kv(k_cache, meta.slot_mapping, k, k_scale)
        write_kv(v_cache, meta.slot_mapping, v, v_scale)
        return self.cached_attention(q, k_cache, v_cache, meta, scale, sinks, window,
                                     kv_scales)

    def cached_attention(self, q, k_cache, v_cache, meta: AttentionMetadata,
                         scale: float, sinks: torch.Tensor | None = None,
                         window: int | None = None, kv_scales=None) -> torch.Tensor:
        """paged_attention once the rows' own keys and values are in the cache. sinks [Hq]
        and window: a layer's own (gpt-oss; layers/attention.py windowed_attention);
        kv_scales: e4m3 caches, dequantized to q's dtype as they are read."""
        if sinks is not None or window is not None:
            return windowed_attention(q, k_cache, v_cache, meta, scale, sinks, window,
                                      kv_scales)
        k_scale, v_scale = kv_scales or (None, None)
        keys = read_kv(k_cache, meta.kv_slots, k_scale, q.dtype).transpose(1, 2)  # [B,Hkv,KV,D]
        values = read_kv(v_cache, meta.kv_slots, v_scale, q.dtype).transpose(1, 2)
        queries = q.new_zeros(meta.kv_slots.shape[0], meta.max_q, q.shape[1], q.shape[2])
        queries[meta.token_req, meta.token_idx] = q
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values,
                                             attn_mask=meta.mask, scale=scale,
                                             enable_gqa=q.shape[1] != k_cache.shape[1])
        return out.transpose(1, 2)[meta.token_req, meta.token_idx]           # [T, Hq, D]

    def embed_concat(self, ids, table: torch.Tensor, hidden: torch.Tensor,
                     embed_norm: RMSNorm, hidden_norm: RMSNorm, embeds=None) -> torch.Tensor:
        """concat(embed_norm(embeds), hidden_norm(hidden)) [T, 2H] in hidden's dtype;
        embeds [T, H], or None: table[ids] (cast to hidden's dtype)."""
        if embeds is None:
            embeds = F.embedding(ids, table).to(hidden.dtype)
        h = hidden.shape[-1]
        a = hidden.new_empty(hidden.shape[0], 2 * h)                         # [T, 2H]
        self.norm(embed_norm, embeds, out=a[:, :h])
        self.norm(hidden_norm, hidden, out=a[:, h:])
        return a

    def routed_experts(self, experts, x, logits: torch.Tensor, router, bias=None,
                       residual: torch.Tensor | None = None):
        """experts (models/moe.py Experts) applied to x [T, H] as `router` (models/moe.py
        Router) routes the logits [T, E] -> [T, H] (+ residual)."""
        weights, ids = router.route(logits, bias)
        out = experts.portable(x, ids, weights)
        return out if residual is None else residual + out

    def logits(self, layer: nn.Linear, x, norm: RMSNorm | None = None) -> torch.Tensor:
        """layer(norm(x)) in float32 [N, V]."""
        return self.linear(layer, x if norm is None else self.norm(norm, x),
                           out_dtype=torch.float32)

    def greedy(self, layer: nn.Linear, x, norm: RMSNorm | None = None,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
        """logits(layer, x, norm).argmax(-1) [N] int64, plus offsets[argmax] if given
        (always through PyTorch here: a backend's own kernels override the whole method)."""
        ids = TORCH_OPS.logits(layer, x, norm).argmax(-1)
        return ids if offsets is None else ids + offsets[ids]


TORCH_OPS = TorchOps()


def layer_extras(attn) -> dict:
    """An attention layer's own sinks and window (gpt-oss) and its FP8 cache's scales
    (kv_cache_dtype="fp8"), for cached_attention."""
    return dict(sinks=getattr(attn, "sinks", None), window=getattr(attn, "window", None),
                kv_scales=layer_kv_scales(attn))


def make_ops(settings: KernelSettings) -> TorchOps:
    """The backend `settings` ask for (Triton is imported only when they ask for it)."""
    if not settings.triton:
        return TORCH_OPS
    from onespec.layers.triton_ops import TritonOps    # Triton is an optional dependency
    return TritonOps(settings)
