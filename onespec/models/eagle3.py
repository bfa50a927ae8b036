"""EAGLE-3 draft head (SPEC.md §5), shared by inference and training.

    h0  = fc(concat(captured target layers))            # step 0 only, 3H -> H
    e   = input_layernorm(embed(x))
    a   = concat(e, hidden_norm(h))                      # width 2H, embedding first
    h'  = r + o_proj(attn(a))                            # r = h (or hidden_norm(h))
    h'' = h' + mlp(post_attention_layernorm(h'))         # carried to the next step
    logits = lm_head(norm(h''))                          # draft vocab; id + d2t[id] = target id
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.linear import (decode_sized, fused_linear, fused_linear_argmax,
                                   fused_rms_norm)
from onespec.layers.norm import RMSNorm
from onespec.layers.rotary import RotaryEmbedding
from onespec.models.llama import Attention, DecoderConfig, DecoderLayer, MLP, check_field_types


@dataclass
class Eagle3HeadConfig:
    decoder: DecoderConfig             # the head's own layer shapes and RoPE
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...] | None   # input-to convention, as written in checkpoints
    norm_before_residual: bool
    fmt: str                            # "safeailab" | "speculators"

    @classmethod
    def from_hf(cls, cfg: dict) -> "Eagle3HeadConfig":
        if cfg.get("speculators_model_type") == "eagle3":
            fmt, layer_cfg = "speculators", dict(cfg.get("transformer_layer_config") or {})
            if not layer_cfg:
                raise ValueError("speculators config lacks transformer_layer_config")
        elif "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []):
            fmt, layer_cfg = "safeailab", dict(cfg)
        else:
            raise ValueError("not an EAGLE-3 head: config.json needs architectures "
                             "['LlamaForCausalLMEagle3'] (SafeAILab) or speculators_model_type "
                             f"'eagle3'; got architectures={cfg.get('architectures')!r}")
        source = getattr(cfg, "source", "the EAGLE-3 head's config.json")
        layer_cfg["architectures"] = ["LlamaForCausalLM"]
        layer_cfg.setdefault("rope_theta", 10000.0)
        decoder = DecoderConfig.from_hf(layer_cfg, source)
        check_field_types(cfg, source, ("target_hidden_size", "target_vocab_size",
                                        "draft_vocab_size"))
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids",
                        cfg.get("eagle_aux_hidden_state_layer_ids"))
        target_vocab = cfg.get("target_vocab_size") or layer_cfg.get("vocab_size")
        return cls(
            decoder=decoder,
            target_hidden_size=cfg.get("target_hidden_size") or decoder.hidden_size,
            target_vocab_size=target_vocab,
            draft_vocab_size=cfg.get("draft_vocab_size") or target_vocab,
            num_layers=layer_cfg.get("num_hidden_layers", 1),
            aux_layer_ids=tuple(aux) if aux else None,
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            fmt=fmt,
        )


class Eagle3Layer(nn.Module):
    """The first draft layer: attention over concat(embedding, hidden) of width 2H."""

    def __init__(self, cfg: DecoderConfig, norm_before_residual: bool):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.mlp_bias)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, hidden, positions, rotary, meta, attn_fn=None, fast=False,
                ids=None, table=None):
        """embeds [T, H], or None with token ids [T] and the embedding table."""
        h = hidden.shape[-1]
        decode = decode_sized(hidden, fast)
        if decode and embeds is None:
            from onespec.layers.triton_linear import embed_norm_concat
            e_norm, h_norm = self.input_layernorm, self.hidden_norm
            a = embed_norm_concat(ids, table, hidden, (e_norm.weight, e_norm.eps),
                                  (h_norm.weight, h_norm.eps))                # [T, 2H]
        else:
            if embeds is None:
                embeds = F.embedding(ids, table).to(hidden.dtype)
            a = hidden.new_empty(hidden.shape[0], 2 * h)                     # [T, 2H]
            fused_rms_norm(self.input_layernorm, embeds, fast, out=a[:, :h])
            fused_rms_norm(self.hidden_norm, hidden, fast, out=a[:, h:])
        residual = a[:, h:] if self.norm_before_residual else hidden
        if decode and attn_fn is None:
            return self._forward_decode(a, residual, positions, rotary, meta)
        if attn_fn is None:
            h = self.self_attn(a, positions, rotary, meta, residual=residual, fast=fast)
        else:
            h = residual + attn_fn(a, positions, rotary, meta)
        return self.mlp(h, self.post_attention_layernorm, residual=h, fast=fast)

    def _forward_decode(self, a, residual, positions, rotary, meta):
        """The layer on the Triton path, with the post-attention RMSNorm split across
        o_proj (which leaves rows * weight and partial sums of squares) and gate_up
        (which applies 1/rms), as DecoderLayer.forward_decode does."""
        from onespec.layers.triton_linear import small_linear
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        out = attn.attend_decode(a, positions, rotary, meta)
        h, pre = small_linear(out, attn.o_proj.weight, residual=residual,
                              norm_out=(post.weight, post.eps))
        act = small_linear(pre, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, gated=True)
        return small_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=h)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3HeadConfig, num_captured: int = 3):
        super().__init__()
        d = cfg.decoder
        self.config = cfg
        self.fc = nn.Linear(num_captured * cfg.target_hidden_size, d.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(d, cfg.norm_before_residual)] +
                                    [DecoderLayer(d) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = None     # set when the head has its own
        has_map = cfg.draft_vocab_size != cfg.target_vocab_size
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
                             if has_map else None)
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
                             if has_map else None)
        self.rotary: RotaryEmbedding | None = None
        self.fast_kernels = False     # Triton decode kernels (set by the engine on CUDA)

    def setup_rotary(self, max_positions: int, device):
        d = self.config.decoder
        self.rotary = RotaryEmbedding(d.head_dim, max_positions, d.rope_theta, d.rope_scaling,
                                      device)

    def forward(self, embeds, hidden, positions, meta, ids=None, table=None):
        """embeds [T, H] (token embeddings; or None, with token ids [T] and the embedding
        table), hidden [T, H] -> pre-norm output [T, H]."""
        fast = self.fast_kernels
        h = self.layers[0](embeds, hidden, positions, self.rotary, meta, fast=fast, ids=ids,
                           table=table)
        for layer in self.layers[1:]:
            h = layer(h, positions, self.rotary, meta, fast)
        return h

    def compute_logits(self, hidden):
        return fused_linear(self.lm_head, hidden, norm=self.norm, out_dtype=torch.float32,
                            fast=self.fast_kernels)                         # [N, Vd]

    def greedy_target_ids(self, hidden):
        """to_target_ids(compute_logits(hidden).argmax(-1)) [N]; when fast, no logits are
        written and the map to target ids happens in the argmax's last kernel."""
        return fused_linear_argmax(self.lm_head, hidden, norm=self.norm, offsets=self.d2t,
                                   fast=self.fast_kernels)

    def to_target_ids(self, draft_ids):
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """SPEC.md §2: outputs of layers (1, L//2 - 1, L - 4)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def capture_from_aux_ids(aux_ids) -> tuple[int, ...]:
    """Checkpoints name the layers as inputs-to; onespec captures outputs-of (one less)."""
    return tuple(i - 1 for i in aux_ids)


def make_vocab_maps(draft_to_target: torch.Tensor, target_vocab_size: int):
    """draft_to_target [Vd] (sorted target ids) -> (d2t [Vd] offsets, t2d [V] bool)."""
    d2t = draft_to_target - torch.arange(len(draft_to_target))
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return d2t, t2d
