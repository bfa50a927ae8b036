"""DeepSeek-style multi-token-prediction (MTP) layers, read from the target's checkpoint.

Layer i lives under `model.layers.{num_hidden_layers + i}.` (transformers drops these keys):

    x   = eh_proj(concat(enorm(embed(token)), hnorm(h)))       # embedding first, 2H -> H
    out = shared_head.norm(block(x))                            # block: a full decoder layer
    logits = shared_head.head(out)                              # the target's lm_head if absent

`embed_tokens` and `shared_head.head` are optional (the target's are used without them).

Qwen3-Next / Qwen3.5 keep one MTP module under `mtp.`: `fc` (eh_proj), `pre_fc_norm_embedding`
(enorm), `pre_fc_norm_hidden` (hnorm), `layers.{i}` (a full-attention decoder layer of the
target, MoE where the target is), `norm` (shared_head.norm), with the same order and flow;
the target names its layout (`mtp_rename`) and its norm kind (`make_norm`: zero-centred).

Under tensor parallelism the MTP layers are sharded, not replicated as the EAGLE-3 head is:
an MTP block is a whole decoder layer of the target (MLA and, in DeepSeek-V3, a full MoE
layer of experts), so a replicated copy would cost every rank a whole layer's weights and
expert work each draft step, where an EAGLE-3 head is one small dense layer. The block is
split as the target's layers are (distributed/layers.py shard_layer), an own embedding and
head vocabulary-parallel as the target's; enorm, hnorm, eh_proj and shared_head.norm are
whole on every rank. Every output the next draft step reads (the block's residual stream
after its all-reduces, the greedy ids of the vocabulary-parallel head, gathered logits) is
the same bytes on every rank, so the ranks draft the same tokens.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from onespec.distributed.layers import (ParallelLMHead, VocabParallelEmbedding, shard_layer,
                                        shard_weights)
from onespec.layers.norm import RMSNorm
from onespec.models.loader import init_dummy_weights, iter_weights, load_weights, read_config
from onespec.quant import fp8

OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, own_head: bool,
                 make_norm=None):
        super().__init__()
        self.norm = make_norm() if make_norm else RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False) if own_head else None


class MTPLayer(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, vocab_size: int, eps: float,
                 own_embed: bool = False, own_head: bool = False, make_norm=None):
        """make_norm: builds the family's norm (default: RMSNorm of hidden_size, eps)."""
        super().__init__()
        norm = make_norm or (lambda: RMSNorm(hidden_size, eps))
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = SharedHead(hidden_size, vocab_size, eps, own_head, make_norm)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size) if own_embed else None
        self.block = block

    def forward(self, embeds, hidden, positions, rotary, meta):
        """embeds [T, H] (token embeddings), hidden [T, H] -> shared_head.norm(block) [T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))
        h, _ = self.block(x, None, positions, rotary, meta)      # (DecoderLayer.forward)
        return self.shared_head.norm(h)


class MTPHead(nn.Module):
    """The MTP layers a drafter uses, with their rotary table (the target's kind)."""

    def __init__(self, layers: list[MTPLayer], target):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.make_rotary = target.make_rotary
        self.rotary = None

    def setup_rotary(self, max_positions: int, device):
        self.rotary = self.make_rotary(max_positions, device)


def _mtp_rename(num_target_layers: int, num_layers: int):
    """'model.layers.{L + i}.X' -> 'layers.{i}.X' (MTP modules) or 'layers.{i}.block.X'."""
    pattern = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def rename(name: str) -> str | None:
        m = pattern.fullmatch(name)
        i = int(m.group(1)) - num_target_layers if m else -1
        if not 0 <= i < num_layers:
            return None
        rest = m.group(2)
        inner = "" if rest.split(".")[0] in OWN_MODULES else "block."
        return f"layers.{i}.{inner}{rest}"
    return rename


def _shard(layer: MTPLayer, cfg, tp):
    """A (meta-device) MTP layer split as the target's layers are (module docstring)."""
    shard_layer(layer.block, tp)
    with torch.device("meta"):
        if layer.embed_tokens is not None:
            layer.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        if layer.shared_head.head is not None:
            layer.shared_head.head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)


def load_mtp_head(path: str, target, num_layers: int, device, dtype,
                  dummy: bool = False, parallel=None, quantize: bool = False) -> MTPHead:
    """MTP layers 0..num_layers-1 of the checkpoint at `path`, for `target` (a model with
    make_decoder_layer and make_rotary, e.g. DeepseekV3ForCausalLM); `parallel` (a
    distributed.TensorParallel): this rank's shards only. An FP8 checkpoint's layers load
    as they are quantized (quant/fp8.py); `quantize` (draft_dtype="fp8") quantizes the
    others per output channel, all but the vocabulary head."""
    cfg = target.config
    if not hasattr(target, "make_decoder_layer"):
        raise ValueError(f"MTP drafting needs a target with MTP layers (DeepSeek-V3, "
                         f"Qwen3-Next, Qwen3.5 families); {cfg.architecture} has none")
    available = cfg.num_nextn_predict_layers
    if num_layers > available:
        raise ValueError(f"the checkpoint has num_nextn_predict_layers={available} MTP layers; "
                         f"{num_layers} were asked for (MTP-Eagle needs 1, vanilla MTP one "
                         "per draft)")
    if hasattr(target, "mtp_rename"):          # the family's own layout (one key -> names)
        rename, where = target.mtp_rename(cfg.num_hidden_layers, num_layers), "mtp.*"
    else:
        one = _mtp_rename(cfg.num_hidden_layers, num_layers)
        rename, where = (lambda raw: [n] if (n := one(raw)) is not None else []), \
            f"model.layers.{cfg.num_hidden_layers}.*"
    declared = fp8.checkpoint_scheme(read_config(path), path)
    scheme = None if dummy else declared
    weights = ((n, t) for raw, t in iter_weights(path, "loading MTP layers")
               for n in rename(raw))
    if parallel is not None:    # copied: no slice keeps a whole checkpoint tensor alive
        weights = ((n, t.clone()) for n, t in shard_weights(weights, cfg, parallel))
    weights = {} if dummy else dict(weights)
    if not dummy and not weights:
        raise ValueError(f"checkpoint {path!r} holds no weights under {where} although "
                         f"its config.json declares {available} MTP layers")
    with torch.device("meta"):
        layers = [MTPLayer(target.make_decoder_layer(cfg.num_hidden_layers + i),
                           cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps,
                           own_embed=f"layers.{i}.embed_tokens.weight" in weights,
                           own_head=f"layers.{i}.shared_head.head.weight" in weights,
                           make_norm=getattr(target, "make_norm", None))
                  for i in range(num_layers)]
        if parallel is not None:
            for layer in layers:
                _shard(layer, cfg, parallel)
        head = MTPHead(layers, target)
    what = f"MTP layers of {path!r}"
    load_rename = lambda n: n   # noqa: E731 (the keys are renamed already)
    if scheme is not None:
        fp8.prepare_for_checkpoint(head, scheme, list(weights), load_rename, what)
        load_rename = fp8.scale_rename(scheme, load_rename)
    head.to_empty(device=device if dummy else "cpu")
    if dummy:
        init_dummy_weights(head, seed=1)
    else:
        items = weights.items()
        if scheme is not None:
            items = fp8.checked_activation_scales(items, what)
        load_weights(head, items, rename=load_rename, what=what)
    if quantize or (dummy and declared is not None):     # (random weights: its layout)
        fp8.quantize_model(head, skip=("head",), block=declared.block if declared else None)
    head = head.to(device=device, dtype=dtype).eval()
    fp8.dequantize_direct_reads(head)
    return head
