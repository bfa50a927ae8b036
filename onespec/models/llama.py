"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over the paged KV cache.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are packed
(`qkv_proj`, `gate_up_proj`); models/loader.py maps checkpoint names onto them.
The residual stream after chosen layers can be captured for EAGLE-3 (docs/DECODING.md,
"hidden-state capture"). Each layer has one forward; the backend object it is built with
(layers/ops.py) picks the PyTorch operations or the fused Triton kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from onespec.layers.attention import AttentionMetadata
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
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
# Upper bounds on sizes, far above any published model's: a value past one is a broken
# config that would otherwise fail deep in an allocation.
MAX_FIELD_VALUES = {"vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
                    "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12,
                    "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
                    "max_position_embeddings": 1 << 26, "sliding_window": 1 << 26}
POSITIVE_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")
BOOL_FIELDS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window")


def check_architecture(cfg: dict, architectures, family: str, source: str | None = None
                       ) -> list[str]:
    """The config's `architectures`; a ValueError naming the family (and the file, where
    `source` is given) where none of them is one of `architectures`."""
    archs = cfg.get("architectures") or []
    if not any(a in architectures for a in archs):
        where = f"{source}: " if source else ""
        raise ValueError(f"{where}not a {family} config: architectures {archs!r}")
    return archs


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
        high = MAX_FIELD_VALUES.get(name)
        if high is not None and cfg.get(name) is not None and cfg[name] > high:
            bad(name, f"an integer in [1, {high}]")
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



class SeparateProjAttention(nn.Module):
    """The projections of a GQA layer whose checkpoint keeps q_proj, k_proj, v_proj and
    o_proj apart (models/qwen3_next.py GatedAttention, models/nemotron_h.py NoPEAttention),
    over the paged KV cache; q_proj has `q_outputs` x Hq·D rows (2: query and gate)."""

    def __init__(self, cfg: DecoderConfig, ops: TorchOps = TORCH_OPS, q_outputs: int = 1):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_outputs * self.q_size, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=bias)
        self.scale = self.head_dim ** -0.5
        self.k_cache = self.v_cache = None    # [num_slots, Hkv, D], set by the KV pool
        self.ops = ops


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, input_size: int | None = None,
                 ops: TorchOps = TORCH_OPS):
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
        self.ops = ops

    def project(self, x, positions, rotary: RotaryEmbedding):
        """x [T, in] -> q [T, Hq, D], k, v [T, Hkv, D], with q/k norm and RoPE applied."""
        return self.heads(self.qkv_proj(x), positions, rotary)

    def heads(self, qkv, positions, rotary: RotaryEmbedding):
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D], q/k norm and RoPE."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        return q, k, v

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata):
        """x [T, in] (normed input) -> attention output [T, Hq·D], before o_proj; writes
        this step's keys and values to the cache."""
        return self.ops.attention(self, x, positions, rotary, meta)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.ops = ops

    def forward(self, x, residual=None, next_norm: RMSNorm | None = None, last: bool = False):
        """y = down(silu(gate(x)) * up(x)) for the normed input x. With a residual:
        (residual + y, next_norm of it or None); `last`: next_norm is the model's final
        norm (its result must be complete, not begun for a next linear)."""
        ops = self.ops
        act = ops.gated(self.gate_up_proj, x)
        if residual is None:
            return ops.linear(self.down_proj, act)
        if next_norm is None:
            return ops.linear(self.down_proj, act, residual), None
        if last:
            return ops.add_full_norm(self.down_proj, act, residual, next_norm)
        # the next layer's qkv projection launches beside this one (one program per SM)
        return ops.add_norm(self.down_proj, act, residual, next_norm, early_release=True)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops=ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ops)
        self.ops = ops

    def forward(self, h, x, positions, rotary, meta, next_norm: RMSNorm | None = None,
                last: bool = False):
        """h [T, H] the residual stream; x its input norm if the layer before left it (else
        None: computed here). Returns (h after the layer, next_norm of it or None); see
        MLP.forward for `last`."""
        ops = self.ops
        if x is None:
            x = ops.norm(self.input_layernorm, h)
        out = self.self_attn(x, positions, rotary, meta)                     # [T, Hq·D]
        h, x = ops.add_norm(self.self_attn.o_proj, out, h, self.post_attention_layernorm)
        return self.mlp(x, h, next_norm, last)


class LlamaModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def run_decoder(model: nn.Module, input_ids, positions, meta: AttentionMetadata,
                capture: tuple[int, ...] = ()):
    """model.model's embedding and layers (each called as DecoderLayer.forward: it leaves
    the next layer's input norm) -> (final-normed hidden [T, H], the residual streams
    after the `capture` layers [T, len·H] or None)."""
    h = model.model.embed_tokens(input_ids)
    saved = {}
    layers = model.model.layers
    x = None      # the next layer's input norm, left by the layer before
    for i, layer in enumerate(layers):
        last = i + 1 == len(layers)
        nxt = model.model.norm if last else layers[i + 1].input_layernorm
        h, x = layer(h, x, positions, model.rotary, meta, nxt, last)
        if i in capture:
            saved[i] = h
    captured = torch.cat([saved[i] for i in capture], dim=-1) if capture else None
    return x, captured


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> (final-normed hidden [T, H],
    captured residual streams [T, len(capture)·H] or None)."""

    config_class = DecoderConfig
    supports_triton = True     # the fused Triton kernels serve this class (TritonOps)
    triton_tree_masks = True   # and its attention takes dynamic trees' masks there

    def __init__(self, cfg: DecoderConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None
        self.ops = ops

    def setup_rotary(self, max_positions: int, device):
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, device)

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                capture: tuple[int, ...] = ()):
        return run_decoder(self, input_ids, positions, meta, capture)

    def checkpoint_rename(self, name: str) -> str | None:
        """Checkpoint key -> parameter name (None: skip it; a tied lm_head is the embedding)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    def compute_logits(self, hidden):
        return self.ops.logits(self.lm_head, hidden)                        # [N, V]

    def greedy_tokens(self, hidden):
        """compute_logits(hidden).argmax(-1), without writing the logits where the backend
        can."""
        return self.ops.greedy(self.lm_head, hidden)                        # [N]
