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
Parameters keep the checkpoint's names (experts load as [E, H, 2I] and [E, I, H], then
are re-laid out for the grouped kernels); q/k/v are packed into qkv_proj like the Llama
family's. MXFP4 expert weights are dequantized at load (quant/mxfp4.py).

The metadata the engine builds is full-causal (this config's `sliding_window` is None):
each sliding layer narrows it to its own window (`layer_window`), and passes it with its
sinks to the backend (layers/attention.py windowed_attention, or the Triton kernel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.rotary import check_rope
from onespec.models.deepseek_v3 import MLARotary
from onespec.models.llama import Attention, DecoderConfig, check_architecture, \
    check_field_types
from onespec.models.moe import GATHER_MAX_PAIRS, MoeDecoderLayer, PagedCausalLM, Router

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
        check_architecture(cfg, ARCHITECTURES, "gpt-oss")
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
        swiglu = {}
        for name, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            v = cfg.get(name, default)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and v > 0):
                raise ValueError(f"{source}: field {name!r} must be a positive finite "
                                 f"number, got {v!r}")
            swiglu[name] = float(v)
        values = {f.name: getattr(base, f.name) for f in fields(DecoderConfig)}
        values.update(architecture="GptOssForCausalLM", rope_theta=theta, rope_scaling=scaling,
                      rms_norm_eps=cfg.get("rms_norm_eps", 1e-5))
        return cls(**values, num_local_experts=experts, num_experts_per_tok=top_k, **swiglu,
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


class GptOssAttention(Attention):
    """Llama's packed-qkv attention with an output bias, per-head sinks, and the layer's
    own sliding window (None: full attention); the backend reads `sinks` and `window`
    (layers/ops.py layer_extras)."""

    def __init__(self, cfg: GptOssConfig, window: int | None, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, ops=ops)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        self.window = window


def swiglu_halves(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float):
    """gpt-oss's clamped SwiGLU of gate and up [..., I] -> [..., I]."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved (even, odd columns: the checkpoint's order)
    -> [..., I]."""
    return swiglu_halves(gate_up[..., 0::2], gate_up[..., 1::2], alpha, limit)


class GptOssRouter(Router):
    """gpt-oss's rule: the top-k router logits, a softmax over those k (in the logits'
    dtype). The same weights as a softmax over all experts renormalised over the top k
    (`norm_topk_prob`), which is how the Triton backend's fused routing computes them."""

    def route(self, logits, bias=None):
        top, ids = logits.topk(self.top_k, dim=-1)
        return top.softmax(-1), ids


class GptOssExperts(nn.Module):
    """Stacked experts, loaded in the checkpoint's layout: gate_up_proj [E, H, 2I] (x @ W,
    gate and up in alternate columns), gate_up_proj_bias [E, 2I] (alike), down_proj
    [E, I, H], down_proj_bias [E, H]. `fuse_projections` (after loading) turns them into
    models/moe.py's Experts layout, which the grouped Triton kernels read: gate_up_proj
    [E, 2I, H] (gate rows, then up rows), its bias [gate; up], down_proj [E, H, I]."""

    def __init__(self, cfg: GptOssConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.fused = False
        self.ops = ops

    @torch.no_grad()
    def fuse_projections(self):
        """Checkpoint layout -> [E, 2I, H] gate-then-up rows and [E, H, I] (once)."""
        if self.fused:
            return
        gate_up = self.gate_up_proj.data
        w = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)      # [E, H, 2I]
        self.gate_up_proj = nn.Parameter(w.transpose(1, 2).contiguous(), requires_grad=False)
        b = self.gate_up_proj_bias.data
        self.gate_up_proj_bias = nn.Parameter(torch.cat([b[:, 0::2], b[:, 1::2]], -1),
                                              requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.data.transpose(1, 2).contiguous(),
                                      requires_grad=False)
        self.fused = True

    def kernel_extras(self) -> dict:
        """What the grouped Triton kernels take besides the weights (kernels/moe.py)."""
        return dict(gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                    swiglu=(self.alpha, self.limit))

    def forward(self, x, logits, router: Router, residual: torch.Tensor | None = None):
        """x [T, H], router logits [T, E] -> (residual +) sum_j weights[:, j] *
        expert_{ids[:, j]}(x)."""
        if not self.fused:
            raise RuntimeError("GptOssExperts runs after fuse_projections (load_target)")
        return self.ops.routed_experts(self, x, logits, router, None, residual)

    def _act(self, gate_up):
        """[..., 2I] (gate half, up half) -> clamped SwiGLU [..., I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return swiglu_halves(gate, up, self.alpha, self.limit)

    def portable(self, x, ids, weights):
        """x [T, H], ids / weights [T, k] -> the weighted sum of the chosen experts, through
        PyTorch. Up to GATHER_MAX_PAIRS pairs gather their experts' weights (no host sync);
        more loop over the experts the batch reaches."""
        w_gu, b_gu, w_d, b_d = (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj,
                                self.down_proj_bias)
        if ids.numel() <= GATHER_MAX_PAIRS:
            gate_up = torch.matmul(w_gu[ids], x[:, None, :, None]).squeeze(-1) + b_gu[ids]
            act = self._act(gate_up)                                          # [T, k, I]
            y = torch.matmul(w_d[ids], act.unsqueeze(-1)).squeeze(-1) + b_d[ids]
            return (y * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            act = self._act(F.linear(x[rows], w_gu[e], b_gu[e]))
            y = F.linear(act, w_d[e], b_d[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class GptOssMoE(nn.Module):
    """router (a linear layer with bias) and experts."""

    def __init__(self, cfg: GptOssConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = GptOssExperts(cfg, ops)
        self.route = GptOssRouter(cfg.num_experts_per_tok, sigmoid=False, norm_topk_prob=True)

    takes_residual = True    # forward(x, residual, ...) (models/moe.py mlp_step)

    def forward(self, x, residual=None, next_norm: RMSNorm | None = None, last: bool = False):
        """x [T, H] -> [T, H]; with a residual: (residual + that, next_norm of it or None).
        (x [B, T, H], as training's dense forward passes it, is routed as rows.)"""
        ops = self.experts.ops
        if x.dim() > 2:
            return self(x.reshape(-1, x.shape[-1])).view(x.shape)
        out = self.experts(x, ops.linear(self.router, x), self.route, residual)
        if residual is None:
            return out
        return out, None if next_norm is None else ops.norm(next_norm, out)


class GptOssDecoderLayer(MoeDecoderLayer):
    def __init__(self, cfg: GptOssConfig, layer_idx: int, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, cfg.window_of(layer_idx), ops)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, ops)
        self.ops = ops


class GptOssForCausalLM(PagedCausalLM):
    """Built with the engine's backend: on Triton, attention runs the paged kernel with the
    layer's sinks and window, experts the grouped kernels with biases and the clamped
    SwiGLU, linears and norms the GEMV and row kernels. No step syncs with the host, so
    generation steps are graph-captured."""
    config_class = GptOssConfig
    supports_triton = True
    triton_tree_masks = False   # (trees are refused anyway: sliding layers)
    supports_tensor_parallel = False

    def __init__(self, cfg: GptOssConfig, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, lambda i: GptOssDecoderLayer(cfg, i, ops), ops)
        self.model.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention)."""
        return tuple(layer.self_attn.window for layer in self.model.layers)

    def setup_rotary(self, max_positions: int, device):
        c = self.config
        self.rotary = MLARotary(c.head_dim, max_positions, c.rope_theta, c.rope_scaling,
                                interleave=False, device=device)
        # neox halves, one [P, D] cos/sin table (YaRN-scaled): the fused rotary kernels
        # read it as they read RotaryEmbedding's
        half = c.head_dim // 2
        self.rotary.fused_ok = c.head_dim % 2 == 0 and half & (half - 1) == 0
