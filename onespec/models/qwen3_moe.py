"""Qwen3-MoE: Qwen3's attention (q/k norm, GQA) with softmax top-k routed experts.

Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step
== 0; other layers keep a dense MLP of `intermediate_size`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.rotary import RotaryEmbedding
from onespec.models.llama import MLP, Attention, DecoderConfig, check_architecture
from onespec.models.moe import MoeDecoderLayer, PagedCausalLM, SoftmaxMoe

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


@dataclass
class Qwen3MoeConfig(DecoderConfig):
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 1
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3MoeConfig":
        check_architecture(cfg, ARCHITECTURES, "Qwen3-MoE")
        base = DecoderConfig.from_hf({**cfg, "architectures": ["Qwen3ForCausalLM"]})
        try:
            return cls(**{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
                       moe_intermediate_size=cfg["moe_intermediate_size"],
                       # transformers 5.x writes num_local_experts, 4.x num_experts
                       num_experts=cfg.get("num_local_experts") or cfg["num_experts"],
                       num_experts_per_tok=cfg["num_experts_per_tok"],
                       norm_topk_prob=cfg.get("norm_topk_prob", False),
                       decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
                       mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
        except KeyError as e:
            raise ValueError(f"config.json lacks the required field {e.args[0]!r}") from None

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


class SparseMoeBlock(SoftmaxMoe):
    takes_residual = True    # forward(x, residual, ...); off when split over ranks

    def forward(self, x, residual=None, next_norm: RMSNorm | None = None, last: bool = False):
        """x [T, H] -> [T, H]; with a residual: (residual + that, next_norm of it or None),
        the residual added where the experts' pairs are summed."""
        out = self.routed(x, residual)
        if residual is None:
            return out
        return out, None if next_norm is None else self.experts.ops.norm(next_norm, out)


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops=ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, ops) if cfg.is_moe_layer(layer_idx) else \
            MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ops)
        self.ops = ops


class Qwen3MoeForCausalLM(PagedCausalLM):
    config_class = Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, lambda i: Qwen3MoeDecoderLayer(cfg, i, ops), ops)

    def setup_rotary(self, max_positions: int, device):
        c = self.config
        self.rotary = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling,
                                      device)
