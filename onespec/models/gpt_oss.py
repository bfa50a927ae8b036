"""gpt-oss (`GptOssForCausalLM`): GQA attention with learned sinks, alternating sliding-window
and full layers, and top-k routed experts with biases and a clamped SwiGLU.

Per layer, for query row at position p (docs/DECODING.md, "gpt-oss"):

    attention:  softmax over [q.k_j * scale for visible j] + [sink_h]; the sink's share is
                dropped, so a head may attend to "nothing" (its outputs shrink towards 0)
    visible j:  j <= p, and j > p - sliding_window on the layers `layer_types` names
                "sliding_attention" (the others see every earlier key)
    router:     logits = x W_r^T + b_r; top-k logits, softmax over those k
    expert e:   [g, u] = x W_gu[e] + b_gu[e] (g, u interleaved columns of gate_up_proj)
                g = min(g, limit); u = clamp(u, -limit, limit)
                y = ((u + 1) * g * sigmoid(alpha * g)) W_d[e] + b_d[e]

Rotary is YaRN (`rope_type` "yarn", neox halves, cos/sin scaled by the attention factor).
Parameters keep the checkpoint's names and layouts (experts stacked as [E, H, 2I] and
[E, I, H]); q/k/v are packed into qkv_proj like the Llama family's. MXFP4 expert weights
are dequantized at load (quant/mxfp4.py).

The metadata the engine builds is full-causal (this config's `sliding_window` is None):
each sliding layer narrows it to its own window (`layer_window`). Attention runs on the
portable path (no Triton kernel has sinks yet: `supports_triton = False`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.attention import AttentionMetadata
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.rotary import check_rope
from onespec.models.deepseek_v3 import MLARotary
from onespec.models.llama import Attention, DecoderConfig, check_field_types
from onespec.models.moe import GATHER_MAX_PAIRS, PagedCausalLM

ARCHITECTURES = ("GptOssForCausalLM",)
ROPE_TYPES = ("default", "yarn")
LAYER_TYPES = ("sliding_attention", "full_attention")


def _rope(cfg: dict, source: str) -> tuple[float, dict]:
    """(theta, scaling) from transformers 5.x rope_parameters or 4.x rope_scaling."""
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {kind!r} is not supported for gpt-oss; "
                         f"supported: {ROPE_TYPES}")
    merged["rope_type"] = kind
    if kind == "yarn" and ("factor" not in merged
                           or "original_max_position_embeddings" not in merged):
        raise ValueError(f"{source}: yarn rope needs 'factor' and "
                         "'original_max_position_embeddings'")
    theta = merged.pop("rope_theta", cfg.get("rope_theta", 150000.0))
    return check_rope(theta, merged, source), merged


@dataclass
class GptOssConfig(DecoderConfig):
    num_local_experts: int = 0
    num_experts_per_tok: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_window: int | None = None           # the window of the sliding layers
    layer_types: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "GptOssConfig":
        source = getattr(cfg, "source", "config.json")
        archs = cfg.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"not a gpt-oss config: architectures {archs!r}")
        check_field_types(cfg, source)
        plain = {k: v for k, v in cfg.items()
                 if k not in ("rope_scaling", "rope_parameters", "sliding_window")}
        base = DecoderConfig.from_hf({**plain, "architectures": ["LlamaForCausalLM"],
                                      "attention_bias": cfg.get("attention_bias", True)},
                                     source)
        theta, scaling = _rope(cfg, source)
        layers = base.num_hidden_layers
        types = cfg.get("layer_types")
        if types is None:          # transformers' default: even layers slide
            types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or \
                any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"{source}: field 'layer_types' must list {layers} entries "
                             f"(num_hidden_layers), each one of {LAYER_TYPES}; got {types!r}")
        window = cfg.get("sliding_window")
        if window is None and "sliding_attention" in types:
            raise ValueError(f"{source}: layer_types has sliding_attention layers but "
                             "'sliding_window' is not set")
        # transformers writes num_local_experts / num_experts_per_tok, openai's original
        # config num_experts / experts_per_token
        experts = cfg.get("num_local_experts", cfg.get("num_experts"))
        top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
        for name, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{source}: field {name!r} must be a positive integer, "
                                 f"got {value!r}")
        if top_k > experts:
            raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds "
                             f"num_local_experts={experts}")
        values = {f.name: getattr(base, f.name) for f in fields(DecoderConfig)}
        values.update(architecture="GptOssForCausalLM", rope_theta=theta, rope_scaling=scaling,
                      rms_norm_eps=cfg.get("rms_norm_eps", 1e-5))
        return cls(**values, num_local_experts=experts, num_experts_per_tok=top_k,
                   swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                   layer_window=window if "sliding_attention" in types else None,
                   layer_types=tuple(types))

    def window_of(self, i: int) -> int | None:
        """Layer i's sliding window, or None for a full-attention layer."""
        return self.layer_window if self.layer_types[i] == "sliding_attention" else None


class GptOssRMSNorm(RMSNorm):
    """RMSNorm with the weight applied in float32 before the cast back (gpt-oss's order)."""

    def forward(self, x):
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (self.weight.float() * normed).to(x.dtype)


def sink_attention(q: torch.Tensor,              # [T, Hq, D]
                   k_cache: torch.Tensor,        # [slots, Hkv, D]
                   v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float,
                   sinks: torch.Tensor,          # [Hq] sink logits
                   window: int | None) -> torch.Tensor:   # [T, Hq, D]
    """Paged attention (torch metadata: kv_slots, mask) whose softmax has one more column
    per head, the sink, dropped after normalisation; `window` narrows the mask to keys
    j > p - window. Scores and softmax in float32."""
    keys = k_cache[meta.kv_slots]                                          # [B, KV, Hkv, D]
    values = v_cache[meta.kv_slots]
    groups = q.shape[1] // k_cache.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=2)
        values = values.repeat_interleave(groups, dim=2)
    b, kv = meta.kv_slots.shape
    queries = q.new_zeros(b, meta.max_q, q.shape[1], q.shape[2])
    queries[meta.token_req, meta.token_idx] = q
    scores = torch.einsum("bqhd,bkhd->bhqk", queries.float(), keys.float()) * scale
    mask = meta.mask                                                       # [B, 1, Q, KV]
    if window is not None:
        q_pos = torch.full((b, meta.max_q), -1, dtype=torch.int64, device=q.device)
        q_pos[meta.token_req, meta.token_idx] = meta.positions
        key = torch.arange(kv, device=q.device)
        # padding rows (position -1) keep their one key 0, as the mask gives them
        mask = mask & ((key[None, None, :] > q_pos[:, :, None] - window)
                       | (q_pos[:, :, None] < 0)).unsqueeze(1)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(b, -1, meta.max_q, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values.float()).to(q.dtype)
    return out[meta.token_req, meta.token_idx]


class GptOssAttention(Attention):
    """Llama's packed-qkv attention with an output bias, per-head sinks, and the layer's
    own sliding window (None: full attention)."""

    def __init__(self, cfg: GptOssConfig, window: int | None):
        super().__init__(cfg)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        self.window = window

    def forward(self, x, positions, rotary, meta: AttentionMetadata):
        """x [T, H] (normed) -> o_proj(attention) [T, H]; writes this step's keys and values
        to the cache."""
        q, k, v = self.project(x, positions, rotary)
        self.k_cache.index_copy_(0, meta.slot_mapping, k)
        self.v_cache.index_copy_(0, meta.slot_mapping, v)
        out = sink_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sinks,
                             self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved (even, odd columns) -> [..., I]."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class GptOssExperts(nn.Module):
    """Stacked experts in the checkpoint's layout: gate_up_proj [E, H, 2I] (x @ W), its bias
    [E, 2I], down_proj [E, I, H], its bias [E, H]."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x, ids, weights):
        """x [T, H], ids / weights [T, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x).
        Up to GATHER_MAX_PAIRS pairs gather their experts' weights (no host sync); more
        loop over the experts the batch reaches."""
        if ids.numel() <= GATHER_MAX_PAIRS:
            gate_up = torch.matmul(x[:, None, None, :], self.gate_up_proj[ids]).squeeze(-2)
            act = clamped_swiglu(gate_up + self.gate_up_proj_bias[ids], self.alpha,
                                 self.limit)                                 # [T, k, I]
            y = torch.matmul(act.unsqueeze(-2), self.down_proj[ids]).squeeze(-2) \
                + self.down_proj_bias[ids]                                   # [T, k, H]
            return (y * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            act = clamped_swiglu(x[rows] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e],
                                 self.alpha, self.limit)
            y = (act @ self.down_proj[e] + self.down_proj_bias[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class GptOssMoE(nn.Module):
    """router (a linear layer with bias; softmax over the top-k logits) and experts."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = GptOssExperts(cfg)
        self.top_k = cfg.num_experts_per_tok

    def forward(self, x):
        top, ids = self.router(x).topk(self.top_k, dim=-1)
        weights = top.softmax(-1)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, cfg.window_of(layer_idx))
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg)

    def forward(self, h, x, positions, rotary, meta, next_norm: RMSNorm | None = None,
                last: bool = False):
        """As DecoderLayer.forward in models/llama.py: (h after the layer, next_norm of it
        or None), x the input norm the layer before left (or None)."""
        if x is None:
            x = self.input_layernorm(h)
        h = h + self.self_attn(x, positions, rotary, meta)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, None if next_norm is None else next_norm(h)


class GptOssForCausalLM(PagedCausalLM):
    config_class = GptOssConfig
    supports_triton = False     # sinks are not in the Triton attention kernel yet
    triton_tree_masks = False
    supports_tensor_parallel = False

    def __init__(self, cfg: GptOssConfig, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, lambda i: GptOssDecoderLayer(cfg, i), ops)
        self.model.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention)."""
        return tuple(layer.self_attn.window for layer in self.model.layers)

    def setup_rotary(self, max_positions: int, device):
        c = self.config
        self.rotary = MLARotary(c.head_dim, max_positions, c.rope_theta, c.rope_scaling,
                                interleave=False, device=device)
