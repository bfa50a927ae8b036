"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over the paged KV cache.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are packed
(`qkv_proj`, `gate_up_proj`); models/loader.py maps checkpoint names onto them.
The residual stream after chosen layers can be captured for EAGLE-3 (SPEC.md §2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from onespec.layers.attention import AttentionMetadata, cached_attention, paged_attention
from onespec.layers.linear import (decode_sized, fused_add_rms_norm, fused_linear,
                                   fused_linear_argmax, fused_rms_norm, row_kernels)
from onespec.layers.norm import RMSNorm
from onespec.layers.rotary import RotaryEmbedding, rope_settings

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MistralForCausalLM")


@dataclass
class DecoderConfig:
    """The fields of a Hugging Face config.json that the decoder needs."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict, source: str | None = None) -> "DecoderConfig":
        """source: the file cfg came from, for messages (default: cfg.source, as
        loader.read_config sets it)."""
        source = source or getattr(cfg, "source", "config.json")
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None) \
            if isinstance(archs, list) else None
        if arch is None:
            raise ValueError(f"unsupported architecture {archs!r}; supported: {ARCHITECTURES}")
        check_field_types(cfg, source)
        try:
            hidden = cfg["hidden_size"]
            heads = cfg["num_attention_heads"]
            theta, scaling = rope_settings(cfg)
            window = None
            if arch == "MistralForCausalLM":
                window = cfg.get("sliding_window")
            elif cfg.get("use_sliding_window"):
                raise ValueError(f"{arch} with use_sliding_window=true is not supported")
            eos = cfg.get("eos_token_id")
            eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
                mlp_bias=cfg.get("mlp_bias", False),
                qk_norm=arch == "Qwen3ForCausalLM",
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                sliding_window=window,
                eos_token_ids=eos,
            )
        except KeyError as e:
            raise ValueError(f"{source} lacks the required field {e.args[0]!r}") from None


POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim",
                       "max_position_embeddings", "sliding_window")
POSITIVE_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")
BOOL_FIELDS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window")


def check_field_types(cfg: dict, source: str, int_fields=POSITIVE_INT_FIELDS):
    """A ValueError naming the file and the first field the decoder reads whose JSON type or
    sign is wrong (a field that is absent or null is left to the defaults)."""
    def bad(name: str, want: str):
        raise ValueError(f"{source}: field {name!r} must be {want}, got {cfg[name]!r}")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in int_fields:
        if cfg.get(name) is not None and not (is_int(cfg[name]) and cfg[name] >= 1):
            bad(name, "a positive integer")
    for name in POSITIVE_NUMBER_FIELDS:
        v = cfg.get(name)
        if v is not None and not ((is_int(v) or isinstance(v, float)) and v > 0):
            bad(name, "a positive number")
    for name in BOOL_FIELDS:
        if cfg.get(name) is not None and not isinstance(cfg[name], bool):
            bad(name, "true or false")
    eos = cfg.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(is_int(t) and t >= 0 for t in eos_list):
        bad("eos_token_id", "a token id or a list of token ids")


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, input_size: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = self.head_dim ** -0.5
        self.k_cache = self.v_cache = None    # [num_slots, Hkv, D], set by the KV pool

    def project(self, x, positions, rotary: RotaryEmbedding):
        """x [T, in] -> q [T, Hq, D], k, v [T, Hkv, D], with q/k norm and RoPE applied."""
        return self._heads(self.qkv_proj(x), positions, rotary)

    def _heads(self, qkv, positions, rotary: RotaryEmbedding):
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        return q, k, v

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata, *,
                norm: RMSNorm | None = None, residual=None, fast: bool = False):
        """(residual +) o_proj(attention(qkv_proj(norm(x)))); `fast`: Triton kernels."""
        qkv = fused_linear(self.qkv_proj, x, norm=norm, fast=fast)
        out = self.attend(qkv, positions, rotary, meta, fast)
        return fused_linear(self.o_proj, out, residual=residual, fast=fast)

    def attend_decode(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata,
                      norm: RMSNorm | None = None):
        """attend(qkv_proj(norm(x))) on the Triton decode path (x may be a Prenormed: its
        norm begun by the kernel before). Projection, rotary and KV write are one kernel
        where triton_linear.qkv_rope_fusable allows."""
        from onespec.layers import triton_linear as tlin
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        nw = {} if norm is None else {"norm_weight": norm.weight, "eps": norm.eps}
        if rotary.fused_ok and tlin.qkv_rope_fusable(x, w, self.head_dim, self.qk_norm):
            q = tlin.qkv_rope_and_cache(x, w, b, positions, rotary.cos_sin, meta.block_tables,
                                        meta.token_req, meta.block_size, self.k_cache,
                                        self.v_cache, self.num_heads, self.num_kv_heads, **nw)
            out = cached_attention(q, self.k_cache, self.v_cache, meta, self.scale)
            return out.reshape(-1, self.q_size)
        return self.attend(tlin.small_linear(x, w, b, **nw), positions, rotary, meta, True)

    def attend(self, qkv, positions, rotary: RotaryEmbedding, meta: AttentionMetadata,
               fast: bool = False):
        """qkv [T, (Hq + 2 Hkv) D] -> attention output [T, Hq D]; writes this step's KV."""
        if fast and rotary.fused_ok:
            from onespec.layers.triton_linear import rope_and_cache
            q = rope_and_cache(qkv, positions, rotary.cos_sin, meta.block_tables,
                               meta.token_req, meta.block_size, self.k_cache,
                               self.v_cache, self.num_heads, self.num_kv_heads,
                               *((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                                 if self.qk_norm else ()))
            out = cached_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        else:
            q, k, v = self._heads(qkv, positions, rotary)
            out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x, norm: RMSNorm | None = None, residual=None, fast: bool = False):
        """(residual +) down(silu(gate(norm(x))) * up(norm(x)))."""
        act = fused_linear(self.gate_up_proj, x, norm=norm, gated=True, fast=fast)
        return fused_linear(self.down_proj, act, residual=residual, fast=fast)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, h, positions, rotary, meta, fast: bool = False):
        h = self.self_attn(h, positions, rotary, meta, norm=self.input_layernorm, residual=h,
                           fast=fast)
        return self.mlp(h, self.post_attention_layernorm, residual=h, fast=fast)

    def forward_rows(self, h, pre, positions, rotary, meta, next_norm: RMSNorm | None):
        """forward() for batches beyond the decode kernels on the Triton path: the linears
        through cuBLAS, each residual add fused with the RMSNorm after it and SiLU * up as
        one kernel (a layer of the 8B shape at batch 32 ran ~30 us of PyTorch's elementwise
        kernels besides its GEMMs). `pre`: this layer's input norm, left by the layer before
        (None: compute it). Returns (h, next_norm(h) or None)."""
        attn, mlp = self.self_attn, self.mlp
        x = fused_rms_norm(self.input_layernorm, h, True) if pre is None else pre
        out = attn.attend(attn.qkv_proj(x), positions, rotary, meta, True)
        h, x = fused_add_rms_norm(self.post_attention_layernorm, attn.o_proj(out), h, True)
        y = mlp.down_proj(fused_linear(mlp.gate_up_proj, x, gated=True, fast=True))
        if next_norm is None:
            return h + y, None
        return fused_add_rms_norm(next_norm, y, h, True)

    def forward_decode(self, h, pre, positions, rotary, meta, next_norm: RMSNorm | None):
        """forward() for decode-sized batches on the Triton path, with each RMSNorm split
        over the kernels around it: the residual kernel before it leaves rows * weight
        and partial sums of squares, the GEMV after it applies 1/rms (triton_linear).
        `pre`: this layer's input norm, left by the previous layer (None: compute it).
        Returns (h, the next layer's input norm or None)."""
        from onespec.layers.triton_linear import small_linear
        from onespec.layers.triton_mlp import fused_mlp, fused_mlp_supported
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        out = attn.attend_decode(h if pre is None else pre, positions, rotary, meta,
                                 norm1 if pre is None else None)
        h, pre = small_linear(out, attn.o_proj.weight, residual=h,
                              norm_out=(norm2.weight, norm2.eps))
        nn_out = None if next_norm is None else (next_norm.weight, next_norm.eps)
        if fused_mlp_supported(pre.x, mlp.gate_up_proj, mlp.down_proj):
            # gate_up and down as one persistent kernel, no boundary between them
            out = fused_mlp(pre, mlp.gate_up_proj.weight, mlp.down_proj.weight, h,
                            norm_out=nn_out)
            return out if nn_out is not None else (out, None)
        act = small_linear(pre, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, gated=True)
        if nn_out is None:
            return small_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=h), None
        # the next layer's qkv GEMV launches beside this one (its programs fit one per SM)
        return small_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=h,
                            norm_out=nn_out, early_release=True)


class LlamaModel(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> (final-normed hidden [T, H],
    captured residual streams [T, len(capture)·H] or None)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None
        self.fast_kernels = False     # Triton decode kernels (set by the engine on CUDA)

    def setup_rotary(self, max_positions: int, device):
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, device)

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                capture: tuple[int, ...] = ()):
        h = self.model.embed_tokens(input_ids)
        saved = {}
        layers = self.model.layers
        decode = decode_sized(h, self.fast_kernels)
        rows = not decode and row_kernels(h, self.fast_kernels)
        pre = None      # the next input norm: half done (decode), done (rows)
        for i, layer in enumerate(layers):
            last = i + 1 == len(layers)
            if decode:
                nxt = None if last else layers[i + 1].input_layernorm
                h, pre = layer.forward_decode(h, pre, positions, self.rotary, meta, nxt)
            elif rows:      # the last layer's residual add is fused with the final norm
                nxt = self.model.norm if last else layers[i + 1].input_layernorm
                h, pre = layer.forward_rows(h, pre, positions, self.rotary, meta, nxt)
            else:
                h = layer(h, positions, self.rotary, meta, self.fast_kernels)
            if i in capture:
                saved[i] = h
        captured = torch.cat([saved[i] for i in capture], dim=-1) if capture else None
        if rows and pre is not None:
            return pre, captured
        return fused_rms_norm(self.model.norm, h, self.fast_kernels), captured

    def compute_logits(self, hidden):
        return fused_linear(self.lm_head, hidden, out_dtype=torch.float32,
                            fast=self.fast_kernels)                          # [N, V]

    def greedy_tokens(self, hidden):
        """compute_logits(hidden).argmax(-1), without writing the logits on the fast path."""
        return fused_linear_argmax(self.lm_head, hidden, fast=self.fast_kernels)  # [N]
