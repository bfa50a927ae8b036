"""EAGLE-3 draft head (docs/DECODING.md, "EAGLE-3 head"), shared by inference and training.

    h0  = fc(concat(captured target layers))            # step 0 only, 3H -> H
    e   = input_layernorm(embed(x))
    a   = concat(e, hidden_norm(h))                      # width 2H, embedding first
    h'  = r + o_proj(attn(a))                            # r = h (or hidden_norm(h))
    h'' = h' + mlp(post_attention_layernorm(h'))         # carried to the next step
    logits = lm_head(norm(h''))                          # draft vocab; id + d2t[id] = target id

A parallel (P-EAGLE) head is the same network with a learned `mask_hidden` [n·H_target]
and a mask token: one forward drafts K tokens, the positions after the first fed
(embed(mask token), fc(mask_hidden)) instead of a drafted token and a carried hidden
(docs/DECODING.md, "Parallel drafting").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
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
    # parallel (P-EAGLE) heads: the mask token fed at positions after the first (None: a
    # chain head), and the number of tokens one forward was trained to propose (None: not
    # written in the config)
    mask_token_id: int | None = None
    parallel_depth: int | None = None

    @property
    def parallel(self) -> bool:
        return self.mask_token_id is not None

    @classmethod
    def from_hf(cls, cfg: dict) -> "Eagle3HeadConfig":
        source = getattr(cfg, "source", "the EAGLE-3 head's config.json")
        kind = cfg.get("speculators_model_type")
        if kind in ("eagle3", "peagle"):
            fmt, layer_cfg = "speculators", dict(cfg.get("transformer_layer_config") or {})
            if not layer_cfg:
                raise ValueError("speculators config lacks transformer_layer_config")
        elif "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []) or \
                _vllm_parallel_config(cfg):
            fmt, layer_cfg = "safeailab", dict(cfg)
        else:
            _refuse_other_drafters(cfg, source)
            raise ValueError("not an EAGLE-3 head: config.json needs architectures "
                             "['LlamaForCausalLMEagle3'] (SafeAILab) or speculators_model_type "
                             f"'eagle3' or 'peagle'; got architectures="
                             f"{cfg.get('architectures')!r}")
        mask_token, depth = _parallel_fields(cfg, kind, source)
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
            mask_token_id=mask_token,
            parallel_depth=depth,
        )


# where parallel heads keep their mask token: speculators writes mask_token_id; vLLM's
# converted configs carry ptd_token_id or pard_token
MASK_TOKEN_KEYS = ("mask_token_id", "ptd_token_id", "pard_token")


def _parallel_fields(cfg: dict, kind, source: str) -> tuple[int | None, int | None]:
    """(mask token id, trained parallel depth) of a P-EAGLE head, (None, None) for a chain
    head. The depth is `num_depths` where written, else the speculators proposal's
    `speculative_tokens`."""
    mask = next((cfg[k] for k in MASK_TOKEN_KEYS if cfg.get(k) is not None), None)
    if kind == "peagle" and mask is None:
        raise ValueError(f"{source}: a P-EAGLE head (speculators_model_type 'peagle') needs "
                         f"a mask token: one of {', '.join(MASK_TOKEN_KEYS)}")
    if mask is None:
        return None, None
    for flag in ("norm_before_fc", "norm_output"):
        if cfg.get(flag):
            raise ValueError(f"{source}: {flag}=true is not supported for parallel heads "
                             "(allowed: false or absent)")
    depth = cfg.get("num_depths")
    if depth is None:
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        depth = methods[0].get("speculative_tokens")
    _check_count(source, "mask token id", mask, 0)
    if depth is not None:       # (vLLM's flat configs do not say it)
        _check_count(source, "num_depths (the parallel depth)", depth, 1)
    return mask, depth


def _vllm_parallel_config(cfg: dict) -> bool:
    """vLLM's converted P-EAGLE config: a flat Llama config ("LlamaForCausalLM") with the
    drafter's draft_vocab_size and ptd_token_id (or pard_token)."""
    return "LlamaForCausalLM" in (cfg.get("architectures") or []) and \
        "draft_vocab_size" in cfg and \
        any(cfg.get(k) is not None for k in ("ptd_token_id", "pard_token"))


def _check_count(source: str, name: str, value, low: int):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{source}: {name} must be an integer >= {low}, got {value!r}")


def _refuse_other_drafters(cfg: dict, source: str):
    """Block drafters of other layouts get an error naming what they are."""
    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" in archs or cfg.get("dflash_config") is not None or \
            cfg.get("speculators_model_type") in ("dflash", "dspark"):
        raise ValueError(f"{source}: a DFlash/DSpark block drafter (architectures "
                         f"{archs!r}) is not an EAGLE-3 head; load DFlash drafters with "
                         "DFlashConfig (method 'dflash'); EAGLE-3 heads are SafeAILab "
                         "'LlamaForCausalLMEagle3', speculators 'eagle3' and P-EAGLE "
                         "(speculators 'peagle')")


class Eagle3Layer(nn.Module):
    """The first draft layer: attention over concat(embedding, hidden) of width 2H."""

    def __init__(self, cfg: DecoderConfig, norm_before_residual: bool,
                 ops: TorchOps = TORCH_OPS):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, input_size=2 * h, ops=ops)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.mlp_bias, ops)
        self.norm_before_residual = norm_before_residual
        self.ops = ops

    def forward(self, embeds, hidden, positions, rotary, meta, attn_fn=None, ids=None,
                table=None):
        """embeds [T, H], or None with token ids [T] and the embedding table; hidden [T, H]
        -> the layer's output [T, H]. attn_fn(a, positions, rotary, meta) -> [T, Hq·D]:
        attention of its own instead of self_attn's (training checks)."""
        ops = self.ops
        a = ops.embed_concat(ids, table, hidden, self.input_layernorm, self.hidden_norm,
                             embeds)                                         # [T, 2H]
        residual = a[:, hidden.shape[-1]:] if self.norm_before_residual else hidden
        out = (attn_fn or self.self_attn)(a, positions, rotary, meta)        # [T, Hq·D]
        h, x = ops.add_norm(self.self_attn.o_proj, out, residual, self.post_attention_layernorm)
        return self.mlp(x, h)[0]


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3HeadConfig, num_captured: int = 3, ops: TorchOps = TORCH_OPS):
        super().__init__()
        d = cfg.decoder
        self.config = cfg
        self.fc = nn.Linear(num_captured * cfg.target_hidden_size, d.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(d, cfg.norm_before_residual, ops)] +
                                    [DecoderLayer(d, ops) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = None     # set when the head has its own
        has_map = cfg.draft_vocab_size != cfg.target_vocab_size
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
                             if has_map else None)
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
                             if has_map else None)
        self.rotary: RotaryEmbedding | None = None
        self.ops = ops
        # parallel heads: the captured-layer input of positions after the first
        self.mask_hidden = nn.Parameter(torch.zeros(num_captured * cfg.target_hidden_size)) \
            if cfg.parallel else None

    def setup_rotary(self, max_positions: int, device):
        d = self.config.decoder
        self.rotary = RotaryEmbedding(d.head_dim, max_positions, d.rope_theta, d.rope_scaling,
                                      device)

    def initial_hidden(self, captured):
        """fc over the captured target layers [T, n·H_target] -> step 0's hidden [T, H]."""
        return self.ops.linear(self.fc, captured)

    def mask_input(self):
        """A parallel head's hidden input at positions after the first: fc(mask_hidden)
        [1, H]."""
        return self.fc(self.mask_hidden.view(1, -1))

    def forward(self, embeds, hidden, positions, meta, ids=None, table=None):
        """embeds [T, H] (token embeddings; or None, with token ids [T] and the embedding
        table), hidden [T, H] -> pre-norm output [T, H]."""
        h = self.layers[0](embeds, hidden, positions, self.rotary, meta, ids=ids, table=table)
        for layer in self.layers[1:]:
            h, _ = layer(h, None, positions, self.rotary, meta)
        return h

    def compute_logits(self, hidden):
        return self.ops.logits(self.lm_head, hidden, self.norm)              # [N, Vd]

    def greedy_target_ids(self, hidden):
        """to_target_ids(compute_logits(hidden).argmax(-1)) [N]; where the backend can, no
        logits are written and the map to target ids happens in the argmax's last kernel."""
        return self.ops.greedy(self.lm_head, hidden, self.norm, offsets=self.d2t)

    def to_target_ids(self, draft_ids):
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """The outputs of layers (1, L//2 - 1, L - 4) (docs/DECODING.md, "hidden-state capture")."""
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
