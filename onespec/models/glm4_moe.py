"""GLM-4.5 / 4.6 / 4.7 MoE (`Glm4MoeForCausalLM`): grouped-query attention with partial
rotary and optional q/k norm, DeepSeek-V3's MoE (sigmoid scores, the correction bias
steering the choice of `topk_group` of `n_group` groups, shared experts), dense MLPs in the
first `first_k_dense_replace` layers, and MTP layers in DeepSeek's layout at
`model.layers.{num_hidden_layers + i}` (models/mtp.py).

Partial rotary: only the first `head_dim * partial_rotary_factor` channels of each query
and key head rotate (in neox layout, halves of that slice); the rest pass through. The
Triton backend runs this class with its rotary outside the fused kernels (`fused_ok` off).

`Glm4MoeLiteForCausalLM` (GLM-4.7-Flash) has DeepSeek-V3's latent attention instead and is
served by models/deepseek_v3.py.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.rotary import RotaryEmbedding
from onespec.models.deepseek_v3 import DeepseekMoE
from onespec.models.llama import MLP, Attention, DecoderConfig, check_architecture
from onespec.models.moe import MoeDecoderLayer, MtpCausalLM

ARCHITECTURES = ("Glm4MoeForCausalLM",)
DEFAULT_PARTIAL_ROTARY = 0.5     # transformers' default for GLM-4 MoE configs without one


@dataclass
class Glm4MoeConfig(DecoderConfig):
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    rotary_dim: int = 0
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf(cls, cfg: dict) -> "Glm4MoeConfig":
        archs = check_architecture(cfg, ARCHITECTURES, "GLM-4 MoE")
        base = DecoderConfig.from_hf({**cfg, "architectures": ["LlamaForCausalLM"]})
        source = getattr(cfg, "source", "config.json")
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                         cfg.get("partial_rotary_factor"))
        factor = DEFAULT_PARTIAL_ROTARY if factor is None else factor
        if not (isinstance(factor, (int, float)) and 0 < factor <= 1):
            raise ValueError(f"{source}: field 'partial_rotary_factor' must be a number in "
                             f"(0, 1], got {factor!r}")
        rotary_dim = int(base.head_dim * factor)
        if rotary_dim % 2:
            raise ValueError(f"{source}: head_dim * partial_rotary_factor = {rotary_dim} "
                             "rotary channels; it must be even")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"{source}: scoring_func {cfg['scoring_func']!r} is not supported "
                             "(GLM-4 MoE routing is 'sigmoid')")
        try:
            values = {f.name: getattr(base, f.name) for f in fields(DecoderConfig)}
            values.update(architecture=next(a for a in archs if a in ARCHITECTURES),
                          qk_norm=bool(cfg.get("use_qk_norm", False)),
                          attention_bias=bool(cfg.get("attention_bias", False)))
            mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0))
            return cls(**values,
                       moe_intermediate_size=cfg["moe_intermediate_size"],
                       n_routed_experts=cfg.get("n_routed_experts") or
                       cfg.get("num_local_experts") or 0,
                       n_shared_experts=cfg.get("n_shared_experts") or 0,
                       num_experts_per_tok=cfg["num_experts_per_tok"],
                       n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                       norm_topk_prob=cfg.get("norm_topk_prob", True),
                       routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                       first_k_dense_replace=cfg.get("first_k_dense_replace", 1) or 0,
                       rotary_dim=rotary_dim, num_nextn_predict_layers=mtp or 0)
        except KeyError as e:
            raise ValueError(f"{source} lacks the required field {e.args[0]!r}") from None

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace


class PartialRotary(RotaryEmbedding):
    """RoPE on the first `rotary_dim` channels of each head (neox layout within them); the
    remaining channels pass unchanged."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict,
                 device):
        super().__init__(rotary_dim, max_positions, theta, scaling, device)
        self.rotary_dim = rotary_dim
        self.fused_ok = False           # the fused Triton rotary kernels rotate whole heads

    def __call__(self, positions, q, k):
        d = self.rotary_dim
        if d == q.shape[-1]:
            return super().__call__(positions, q, k)
        q_rot, k_rot = super().__call__(positions, q[..., :d], k[..., :d])
        return torch.cat([q_rot, q[..., d:]], -1), torch.cat([k_rot, k[..., d:]], -1)


class Glm4MoeDecoderLayer(MoeDecoderLayer):
    def __init__(self, cfg: Glm4MoeConfig, layer_idx: int, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops=ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg, ops) if cfg.is_moe_layer(layer_idx) else \
            MLP(cfg.hidden_size, cfg.intermediate_size, ops=ops)
        self.ops = ops


class Glm4MoeForCausalLM(MtpCausalLM):
    config_class = Glm4MoeConfig
    layer_class = Glm4MoeDecoderLayer

    def make_rotary(self, max_positions: int, device) -> PartialRotary:
        c = self.config
        return PartialRotary(c.rotary_dim, max_positions, c.rope_theta, c.rope_scaling, device)
