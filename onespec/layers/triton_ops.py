"""The Triton backend of layers/ops.py (CUDA), by the number of rows a forward carries:

- decode-sized (at most MAX_ROWS rows): every linear is one GEMV kernel that streams its
  weight once with the work around it as its epilogue (kernels/gemv.py); an RMSNorm after
  a residual add is split across the GEMVs around it (`Prenormed`); the qkv GEMV writes
  rotated heads and the KV cache itself where it can (kernels/rope_kv.py);
- more rows: the linears through cuBLAS, with the RMSNorms, residual add + RMSNorm and
  SiLU * up as Triton row kernels (kernels/rows.py);
- routed experts (MoE targets): routing and the sort of the (token, expert) pairs in one
  program at decode sizes (kernels/moe_route.py), then a grouped GEMM over the pairs
  (kernels/moe.py);
- under autograd: the PyTorch path (TorchOps);
- FP8 linears (quant/fp8.py): decode-sized rows through the FP8 GEMV (kernels/fp8_gemv.py,
  e4m3 weights widened in registers, per-channel or per-block scales), more rows
  dequantize the weight and take cuBLAS; FP8 experts through the grouped GEMM's FP8 path.
Attention reads the block pool directly (kernels/attention.py) when the metadata was
built for it. Each kernel runs with programmatic dependent launch where the GPU has it
and the settings allow.
"""
from __future__ import annotations

import torch
from torch import nn

from onespec.kernels import attention as attention_kernels
from onespec.kernels.fp8_gemv import fp8_gemv
from onespec.kernels.gemv import Prenormed, gemv, gemv_argmax, gemv_prenorm
from onespec.kernels.launch import pdl_supported
from onespec.kernels.moe import grouped_experts, sort_pairs
from onespec.kernels.moe_route import fused_route_fits, route_and_sort
from onespec.kernels.rope_kv import qkv_rope_and_cache, qkv_rope_fusable, rope_and_cache
from onespec.kernels.rows import add_rms_norm, embed_norm_concat, rms_norm, silu_mul
from onespec.kernels.settings import MAX_ROWS, KernelSettings
from onespec.layers.attention import AttentionMetadata
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TorchOps, layer_extras
from onespec.quant.fp8 import FP8Linear
from onespec.quant.kv_fp8 import kv_scales


def completed(x):
    """Rows as a tensor: a Prenormed's RMSNorm finished (x * 1/rms of its partial sums)."""
    if not isinstance(x, Prenormed):
        return x
    rstd = torch.rsqrt(x.ss.sum(1, keepdim=True) / x.x.shape[1] + x.eps)
    return (x.x.float() * rstd).to(x.x.dtype)


class TritonOps(TorchOps):
    def __init__(self, settings: KernelSettings):
        self.settings = settings
        self._pdl: dict[torch.device, bool] = {}

    def pdl(self, device: torch.device) -> bool:
        """Whether kernels on `device` launch with programmatic dependent launch."""
        if device not in self._pdl:
            self._pdl[device] = self.settings.pdl and pdl_supported(device)
        return self._pdl[device]

    @staticmethod
    def rows(x) -> bool:
        """Whether rows x [M, K] take Triton kernels at all: no autograd."""
        return isinstance(x, Prenormed) or (x.dim() == 2 and not torch.is_grad_enabled())

    @staticmethod
    def decode_sized(x) -> bool:
        """Whether rows x [M, K] take the decode GEMVs: at most MAX_ROWS, no autograd."""
        return isinstance(x, Prenormed) or (
            x.dim() == 2 and x.shape[0] <= MAX_ROWS and not torch.is_grad_enabled())

    def _x(self, x: torch.Tensor | Prenormed) -> torch.Tensor:
        return x.x if isinstance(x, Prenormed) else x

    def norm(self, norm: RMSNorm, x, out=None):
        if not self.rows(x):
            return super().norm(norm, x, out)
        return rms_norm(x, norm.weight, norm.eps, out, pdl=self.pdl(x.device))

    def _fp8(self, layer: FP8Linear, x, **kw):
        return fp8_gemv(x, layer.weight, layer.weight_scale, layer.block, layer.bias,
                        pdl=self.pdl(self._x(x).device), **kw)

    def linear(self, layer: nn.Linear, x, residual=None, out_dtype=None):
        if isinstance(layer, FP8Linear):
            if self.decode_sized(x):
                return self._fp8(layer, x, residual=residual, out_dtype=out_dtype)
            return super().linear(layer, completed(x), residual, out_dtype)
        if not self.decode_sized(x):
            return super().linear(layer, x, residual, out_dtype)
        return gemv(x, layer.weight, layer.bias, residual=residual, out_dtype=out_dtype,
                    pdl=self.pdl(self._x(x).device))

    def gated(self, layer: nn.Linear, x):
        if isinstance(layer, FP8Linear):
            if self.decode_sized(x):
                return self._fp8(layer, x, gated=True)
            return silu_mul(layer(x), pdl=self.pdl(x.device)) if self.rows(x) \
                else super().gated(layer, x)
        if self.decode_sized(x):
            return gemv(x, layer.weight, layer.bias, gated=True,
                        pdl=self.pdl(self._x(x).device))
        if self.rows(x):
            return silu_mul(layer(x), pdl=self.pdl(x.device))
        return super().gated(layer, x)

    def add_norm(self, layer: nn.Linear, x, residual, norm: RMSNorm,
                 early_release: bool = False):
        if isinstance(layer, FP8Linear):
            return self.add_full_norm(layer, x, residual, norm)
        if self.decode_sized(x):
            return gemv_prenorm(x, layer.weight, residual, (norm.weight, norm.eps),
                                layer.bias, early_release=early_release,
                                pdl=self.pdl(self._x(x).device))
        return self.add_full_norm(layer, x, residual, norm)

    def add_full_norm(self, layer: nn.Linear, x, residual, norm: RMSNorm):
        if self.decode_sized(x):
            h = self.linear(layer, x, residual)
            return h, self.norm(norm, h)
        if self.rows(x):
            return add_rms_norm(layer(x), residual, norm.weight, norm.eps,
                                pdl=self.pdl(x.device))
        return super().add_full_norm(layer, x, residual, norm)

    def attention(self, attn, x, positions, rotary, meta: AttentionMetadata):
        if not self.rows(x):
            return super().attention(attn, x, positions, rotary, meta)
        # `positions` are the rows' rotary positions, meta's their cache positions: the same
        # but for a dynamic tree's rows, which rotate at their depth
        tree = dict(rotary_positions=positions) if meta.tree_mask is not None else {}
        cache_positions = meta.positions if tree else positions
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        fusable = not isinstance(attn.qkv_proj, FP8Linear) and \
            qkv_rope_fusable(x, w, attn.head_dim, attn.qk_norm)
        if self.decode_sized(x) and rotary.fused_ok and fusable:
            q = qkv_rope_and_cache(x, w, b, cache_positions, rotary.cos_sin,
                                   meta.block_tables, meta.token_req, meta.block_size,
                                   attn.k_cache, attn.v_cache, attn.num_heads,
                                   attn.num_kv_heads, pdl=self.pdl(self._x(x).device),
                                   kv_scales=kv_scales(attn), **tree)
            out = self.cached_attention(q, attn.k_cache, attn.v_cache, meta, attn.scale,
                                        **layer_extras(attn))
            return out.reshape(-1, attn.q_size)
        qkv = self.linear(attn.qkv_proj, x)
        if not rotary.fused_ok:
            return self.attention_from_qkv(attn, qkv, positions, rotary, meta)
        q = rope_and_cache(qkv, cache_positions, rotary.cos_sin, meta.block_tables,
                           meta.token_req, meta.block_size, attn.k_cache, attn.v_cache,
                           attn.num_heads, attn.num_kv_heads,
                           *((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
                             if attn.qk_norm else ()), pdl=self.pdl(qkv.device),
                           kv_scales=kv_scales(attn), **tree)
        out = self.cached_attention(q, attn.k_cache, attn.v_cache, meta, attn.scale,
                                    **layer_extras(attn))
        return out.reshape(-1, attn.q_size)

    def cached_attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         sinks=None, window=None, kv_scales=None):
        if meta.kv_slots is not None:      # metadata built for the PyTorch path
            return super().cached_attention(q, k_cache, v_cache, meta, scale, sinks, window,
                                            kv_scales)
        return attention_kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.token_req, meta.positions, scale,
            meta.block_size, window if window is not None else meta.sliding_window,
            rows_per_request=meta.rows_per_request,
            pdl=self.pdl(q.device), tree_mask=meta.tree_mask, tree_base=meta.tree_base,
            packs=meta.row_packs, sinks=sinks, kv_scales=kv_scales)

    def routed_experts(self, experts, x, logits, router, bias=None, residual=None):
        if not self.rows(x):
            return super().routed_experts(experts, x, logits, router, bias, residual)
        groups = (router.num_groups, router.topk_groups) if router.sigmoid else (1, 1)
        if fused_route_fits(x.shape[0], experts.num_experts, router.top_k, *groups):
            routing = route_and_sort(logits, router.top_k, sigmoid=router.sigmoid, bias=bias,
                                     num_groups=router.num_groups,
                                     topk_groups=router.topk_groups,
                                     norm_topk_prob=router.norm_topk_prob,
                                     scaling=router.scaling)
        else:
            routing = sort_pairs(*reversed(router.route(logits, bias)), experts.num_experts)
        scales = (experts.gate_up_proj_scale, experts.down_proj_scale) \
            if getattr(experts, "quantized", False) else None
        extras = experts.kernel_extras() if hasattr(experts, "kernel_extras") else {}
        return grouped_experts(x, experts.gate_up_proj, experts.down_proj, routing, residual,
                               scales, experts.block if scales else None, **extras)

    def embed_concat(self, ids, table, hidden, embed_norm: RMSNorm, hidden_norm: RMSNorm,
                     embeds=None):
        if embeds is not None or not self.decode_sized(hidden):
            return super().embed_concat(ids, table, hidden, embed_norm, hidden_norm, embeds)
        return embed_norm_concat(ids, table, hidden, (embed_norm.weight, embed_norm.eps),
                                 (hidden_norm.weight, hidden_norm.eps),
                                 pdl=self.pdl(hidden.device))

    def greedy(self, layer: nn.Linear, x, norm=None, offsets=None):
        if isinstance(layer, FP8Linear):
            if not self.decode_sized(x):
                return super().greedy(layer, x, norm, offsets)
            if norm is not None:
                x = self.norm(norm, completed(x))
            ids = self._fp8(layer, x, out_dtype=torch.float32).argmax(-1)
            return ids if offsets is None else ids + offsets[ids]
        if not self.decode_sized(x):
            return super().greedy(layer, x, norm, offsets)
        if norm is not None:
            x = self.norm(norm, x)
        return gemv_argmax(x, layer.weight, layer.bias, offsets=offsets,
                           pdl=self.pdl(x.device))
