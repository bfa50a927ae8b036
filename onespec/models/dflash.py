"""DFlash block drafter (docs/DECODING.md, "DFlash block drafters"): SpecForge's
`DFlashDraftModel` layout, read and run over the paged KV cache.

    c   = hidden_norm(fc(concat(captured target layers)))    # context features [T, H]
    per layer: keys/values of the context rows  k_norm(k_proj(c)), v_proj(c)   (RoPE at p)
               keys/values of the block rows    k_norm(k_proj(ln(x))), v_proj(ln(x))
               x = x + o_proj(attn(q_norm(q_proj(ln(x))) over both, non-causal in the block))
               x = x + mlp(post_attention_layernorm(x))
    drafts = target.lm_head(norm(x)) at the block's rows 1 .. block_size - 1

A block is [anchor token, mask token x (block_size - 1)] at the positions right after
the last verified one; the embedding and LM head are the target's. The context rows'
keys and values depend only on the target's features at their own position, so they
are kept in the paged cache like any draft KV; the block's own keys are overwritten by
the next step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.rotary import RotaryEmbedding
from onespec.models.llama import MLP, Attention, DecoderConfig
from onespec.models.loader import init_dummy_weights, iter_weights, load_weights, read_config

ARCHITECTURE = "DFlashDraftModel"
# DSpark's heads on a DFlash backbone (docs/DECODING.md says what is not known of them)
DSPARK_FIELDS = ("markov_rank", "enable_confidence_head")
DSPARK_WEIGHTS = ("markov_head.", "confidence_head.", "logit_head.")
# dflash_config entries of variants: only these values are run
_DEFAULTS = {"attention_mode": ("gqa", "mha"), "projector_type": (None,),
             "pure_draft_prefix_len": (0, None), "shift_label": (False, None)}


@dataclass
class DFlashHeadConfig:
    decoder: DecoderConfig           # the draft layers' shapes (Qwen3-style, q/k norms)
    block_size: int                  # rows of a block: the anchor and block_size - 1 masks
    mask_token_id: int               # target vocabulary id fed at the masked rows
    target_layer_ids: tuple[int, ...]   # target layers whose outputs are the context

    @classmethod
    def from_hf(cls, cfg: dict) -> "DFlashHeadConfig":
        source = getattr(cfg, "source", "the DFlash drafter's config.json")
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") == "dspark" or cfg.get("dspark_config") is not None or \
                any(cfg.get(k) for k in DSPARK_FIELDS) or "DSparkDraftModel" in archs:
            raise ValueError(f"{source}: DSpark drafters (a DFlash backbone with Markov and "
                             "confidence heads: model_type 'dspark', dspark_config, "
                             f"{', '.join(DSPARK_FIELDS)}) are not supported; plain DFlash "
                             f"drafters ({ARCHITECTURE!r}) are")
        if ARCHITECTURE not in archs:
            raise ValueError(f"{source}: not a DFlash drafter: architectures must hold "
                             f"{ARCHITECTURE!r}, got {archs!r}")
        dcfg = cfg.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise ValueError(f"{source}: dflash_config must be an object, got {dcfg!r}")
        _refuse_variants(cfg, dcfg, source)
        block = cfg.get("block_size")
        _check_int(source, "block_size", block, 2)
        mask = dcfg.get("mask_token_id")
        if mask is None:
            raise ValueError(f"{source}: dflash_config.mask_token_id is required (the token "
                             "fed at the block's masked rows)")
        _check_int(source, "dflash_config.mask_token_id", mask, 0)
        layers = cfg.get("num_hidden_layers")
        _check_int(source, "num_hidden_layers", layers, 1)
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            num_target = cfg.get("num_target_layers")
            if num_target is None:
                raise ValueError(f"{source}: needs dflash_config.target_layer_ids or "
                                 "num_target_layers")
            _check_int(source, "num_target_layers", num_target, 4)
            ids = default_target_layer_ids(num_target, layers)
        if not isinstance(ids, list) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{source}: dflash_config.target_layer_ids must be a non-empty "
                             f"list of layer ids >= 0, got {ids!r}")
        layer_cfg = dict(cfg)
        layer_cfg["architectures"] = ["Qwen3ForCausalLM"]      # q/k norms in every layer
        layer_cfg.setdefault("rope_theta", 10000.0)
        return cls(DecoderConfig.from_hf(layer_cfg, source), block, mask, tuple(ids))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's rule where a config names no layers: the middle layer for one draft
    layer, else num_draft_layers ids spread evenly over 1 .. L - 3 (rounded)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


def _check_int(source: str, name: str, value, low: int):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{source}: {name} must be an integer >= {low}, got {value!r}")


def _refuse_variants(cfg: dict, dcfg: dict, source: str):
    """Variants of the layout this loader does not run, each named."""
    for key, allowed in _DEFAULTS.items():
        if key in dcfg and dcfg[key] not in allowed:
            raise ValueError(f"{source}: dflash_config.{key}={dcfg[key]!r} is not supported "
                             f"(allowed: {', '.join(map(repr, allowed))})")
    if "attention_modes" in dcfg and any(m not in ("gqa", "mha")
                                         for m in dcfg["attention_modes"] or []):
        raise ValueError(f"{source}: dflash_config.attention_modes "
                         f"{dcfg['attention_modes']!r} is not supported (allowed: 'gqa', "
                         "'mha' in every layer)")
    types = cfg.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        raise ValueError(f"{source}: layer_types {types!r} is not supported (allowed: "
                         "'full_attention' in every layer)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported for DFlash "
                         "drafters (allowed: false)")


class DFlashLayer(nn.Module):
    """One draft layer: a Qwen3 decoder layer whose attention also sees the context's
    keys and values."""

    def __init__(self, cfg: DecoderConfig, ops: TorchOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops=ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ops)


class DFlashHead(nn.Module):
    def __init__(self, cfg: DFlashHeadConfig, target_hidden_size: int,
                 ops: TorchOps = TORCH_OPS):
        super().__init__()
        d = cfg.decoder
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * target_hidden_size, d.hidden_size,
                            bias=False)
        self.hidden_norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(d, ops) for _ in range(d.num_hidden_layers)])
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.rotary: RotaryEmbedding | None = None
        self.ops = ops

    def setup_rotary(self, max_positions: int, device):
        d = self.config.decoder
        self.rotary = RotaryEmbedding(d.head_dim, max_positions, d.rope_theta, d.rope_scaling,
                                      device)

    def context(self, captured):
        """The captured target layers [T, n·H_target] -> context features [T, H]."""
        return self.hidden_norm(self.fc(captured))

    def forward(self, ctx, ctx_pos, ctx_slots, x, pos, slots, meta):
        """ctx [Tc, H] context features at positions ctx_pos, whose keys and values go to
        the cache slots ctx_slots; x [Tb, H] the block rows' embeddings at positions pos,
        slots `slots`, attending as `meta` says (every block row sees its whole block).
        Returns the block rows' output before the final norm [Tb, H]."""
        rotary, ops = self.rotary, self.ops
        n = ctx.shape[0]
        both_pos = torch.cat([ctx_pos, pos])
        for layer in self.layers:
            attn = layer.self_attn
            if x.shape[0] == 0:                  # context keys only (nothing drafts)
                _, k, v = attn.project(ctx, ctx_pos, rotary)
            else:   # one projection for both (the context rows' queries go unused)
                q, k, v = attn.project(torch.cat([ctx, layer.input_layernorm(x)]), both_pos,
                                       rotary)
            attn.k_cache.index_copy_(0, ctx_slots, k[:n])
            attn.v_cache.index_copy_(0, ctx_slots, v[:n])
            if x.shape[0] == 0:
                continue
            attn.k_cache.index_copy_(0, slots, k[n:])    # (after the context: they may
            attn.v_cache.index_copy_(0, slots, v[n:])    #  cover rejected rows' slots)
            out = ops.cached_attention(q[n:], attn.k_cache, attn.v_cache, meta, attn.scale)
            x = x + attn.o_proj(out.reshape(-1, attn.q_size))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


def load_dflash_head(path: str, target: DecoderConfig, device, dtype, dummy: bool = False,
                     ops: TorchOps = TORCH_OPS) -> DFlashHead:
    """The drafter at `path` (SpecForge / z-lab layout) for a target of config `target`."""
    cfg = DFlashHeadConfig.from_hf(read_config(path))
    what = f"DFlash drafter {path!r}"
    if cfg.decoder.hidden_size != target.hidden_size:
        raise ValueError(f"{what} has hidden_size {cfg.decoder.hidden_size}, but the target "
                         f"has hidden_size {target.hidden_size} (DFlash drafters share the "
                         "target's embedding and LM head)")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_hidden_layers - 1]
    if bad:
        raise ValueError(f"{what}: dflash_config.target_layer_ids {list(cfg.target_layer_ids)} "
                         f"must lie in 0 .. {target.num_hidden_layers - 2} for the target's "
                         f"{target.num_hidden_layers} layers (outputs of layers before the "
                         "last)")
    if cfg.mask_token_id >= target.vocab_size:
        raise ValueError(f"{what}: dflash_config.mask_token_id {cfg.mask_token_id} is outside "
                         f"the target's vocabulary ({target.vocab_size} tokens)")
    with torch.device("meta"):
        head = DFlashHead(cfg, target.hidden_size, ops)
    head.to_empty(device="cpu")
    if dummy:
        init_dummy_weights(head)
    else:
        weights = dict(iter_weights(path, desc="loading DFlash drafter"))
        if weights and all(k.startswith("model.") for k in weights):
            weights = {k[len("model."):]: v for k, v in weights.items()}
        dspark = sorted(k for k in weights if k.startswith(DSPARK_WEIGHTS))
        if dspark:
            raise ValueError(f"{what}: has DSpark head weights ({dspark[0]}, ...): not "
                             "supported; plain DFlash drafters are")
        extra = sorted(k for k in weights if k.startswith(("embed_tokens.", "lm_head.")))
        if extra:
            raise ValueError(f"{what}: has its own {', '.join(extra)}; DFlash drafters use "
                             "the target's embedding and LM head (the published layout "
                             "holds neither)")
        load_weights(head, weights.items(), what=what)
    return head.to(device=device, dtype=dtype)

