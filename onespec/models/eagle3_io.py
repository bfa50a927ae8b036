"""Reading and writing EAGLE-3 heads in the SafeAILab and speculators formats
(docs/DECODING.md, "EAGLE-3 head")."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.models.eagle3 import Eagle3Head, Eagle3HeadConfig, make_vocab_maps
from onespec.models.llama import DecoderConfig
from onespec.models.loader import init_dummy_weights, iter_weights, load_weights, read_config
from onespec.quant import fp8

VOCAB_MAPS = ("d2t", "t2d")


def load_eagle3_head(path: str, target: DecoderConfig, num_captured: int, device,
                     dtype, dummy: bool = False, ops: TorchOps = TORCH_OPS,
                     quantize: bool = False) -> Eagle3Head:
    """The head at `path` for a target of config `target`, built with the backend `ops`;
    `quantize` (draft_dtype="fp8"): its linears, lm_head included, as e4m3 weights per
    output channel (quant/fp8.py), computing in `dtype`."""
    raw = read_config(path)
    cfg = Eagle3HeadConfig.from_hf(raw)
    what = f"EAGLE-3 head {path!r}"
    scheme = None if dummy else fp8.checkpoint_scheme(raw, path)    # an FP8 head
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(f"{what} was trained for target hidden size {cfg.target_hidden_size}, "
                         f"but the target has hidden_size {target.hidden_size}")
    if cfg.target_vocab_size != target.vocab_size:
        raise ValueError(f"{what} has vocab_size {cfg.target_vocab_size}, but the target has "
                         f"vocab_size {target.vocab_size}")
    if dummy:
        head = _dummy_head(cfg, num_captured, device, dtype, ops)
        return fp8.quantize_model(head, skip=()) if quantize else head
    weights = dict(iter_weights(path, desc="loading draft head"))
    if cfg.parallel:        # (vLLM-converted heads may keep the model's "model." prefix)
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
    prefixes = ("midlayer.", "layers.0.") if cfg.fmt == "safeailab" and cfg.parallel else \
        ("midlayer.",) if cfg.fmt == "safeailab" else ("layers.0.",)
    if not any(k.startswith(prefixes) for k in weights):
        raise ValueError(f"{what}: config says {cfg.fmt} format but no "
                         f"{' or '.join(p + '*' for p in prefixes)} weights found")
    with torch.device("meta"):
        head = Eagle3Head(cfg, num_captured, ops)
    has_embed = "embed_tokens.weight" in weights
    if has_embed:       # (a parallel head's may have rows past the vocabulary: its mask)
        rows = max(cfg.target_vocab_size, weights["embed_tokens.weight"].shape[0])
        with torch.device("meta"):
            head.embed_tokens = torch.nn.Embedding(rows, cfg.decoder.hidden_size)
    if cfg.parallel:
        _check_mask_token(cfg, what, head.embed_tokens.num_embeddings if has_embed
                          else target.vocab_size)
    head.to_empty(device="cpu")
    fc = weights.get("fc.weight")
    if fc is not None and fc.shape[1] != num_captured * target.hidden_size:
        raise ValueError(f"{what}: fc.weight has shape {tuple(fc.shape)}, expected "
                         f"[{cfg.decoder.hidden_size}, {num_captured * target.hidden_size}] "
                         f"({num_captured} captured layers x target hidden size)")
    if cfg.parallel:
        weights["mask_hidden"] = _mask_hidden(head, weights.get("mask_hidden"), what)
    maps = {k: weights.pop(k) for k in VOCAB_MAPS if k in weights}
    if head.d2t is not None:
        if "d2t" not in maps:
            raise ValueError(f"{what}: draft_vocab_size {cfg.draft_vocab_size} != vocab_size "
                             f"{cfg.target_vocab_size} but the checkpoint has no 'd2t'")
        if maps["d2t"].shape != head.d2t.shape:
            raise ValueError(f"{what}: weight 'd2t' has shape {tuple(maps['d2t'].shape)}, "
                             f"expected {tuple(head.d2t.shape)}")
        head.d2t.copy_(maps["d2t"].long())
        if "t2d" in maps:
            head.t2d.copy_(maps["t2d"].bool())
    rename = (lambda n: "layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n)
    items = weights.items()
    if scheme is not None:
        fp8.prepare_for_checkpoint(head, scheme, list(weights), rename, what)   # (on the CPU)
        rename = fp8.scale_rename(scheme, rename)
        items = fp8.checked_activation_scales(items, what)
    load_weights(head, items, rename=rename, what=what)
    if quantize:        # on the CPU, before the move
        fp8.quantize_model(head, skip=())
    return head.to(device=device, dtype=dtype)   # floating tensors only: d2t/t2d keep theirs


def _check_mask_token(cfg: Eagle3HeadConfig, what: str, rows: int):
    if cfg.mask_token_id >= rows:
        raise ValueError(f"{what}: mask token id {cfg.mask_token_id} is outside the "
                         f"embedding it is read from ({rows} rows)")


def _mask_hidden(head: Eagle3Head, tensor, what: str):
    """A parallel head's learned input at positions after the first: speculators stores
    it as [1, 1, n·H_target], others as [1, n·H_target] or flat."""
    if tensor is None:
        raise ValueError(f"{what}: a parallel head needs the weight 'mask_hidden'")
    if tensor.numel() != head.mask_hidden.numel():
        raise ValueError(f"{what}: weight 'mask_hidden' has shape {tuple(tensor.shape)}, "
                         f"expected {head.mask_hidden.numel()} values (captured layers x "
                         "target hidden size)")
    return tensor.reshape(-1)


def _dummy_head(cfg: Eagle3HeadConfig, num_captured: int, device, dtype,
                ops: TorchOps) -> Eagle3Head:
    """Random weights of the head's shape (benchmarks). The draft vocabulary is the first
    draft_vocab_size target ids: tokenizers number their frequent tokens first, which is
    where a trained head's vocabulary lies too (a grammar benchmark needs its tokens)."""
    with torch.device("meta"):
        head = Eagle3Head(cfg, num_captured, ops)
    head.to_empty(device=device)
    init_dummy_weights(head)
    if cfg.parallel:
        _check_mask_token(cfg, "dummy head", cfg.target_vocab_size)
    if head.d2t is not None:
        chosen = torch.arange(cfg.draft_vocab_size)
        d2t, t2d = make_vocab_maps(chosen, cfg.target_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head.to(dtype=dtype)


def _hf_state_dict(head: Eagle3Head, fmt: str) -> dict[str, torch.Tensor]:
    """Unpacks qkv/gate_up and renames onespec parameters to checkpoint keys."""
    out = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu().contiguous()
        if ".qkv_proj." in name:
            attn = head.get_submodule(name.split(".qkv_proj.")[0])
            parts = t.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", proj)] = part.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        elif name == "mask_hidden":
            out[name] = t.view(1, 1, -1)      # speculators' shape
        else:
            out[name] = t
    if fmt == "safeailab":
        out = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
               for k, v in out.items()}
    return out


def head_config_dict(cfg: Eagle3HeadConfig, fmt: str, speculative_tokens: int = 3) -> dict:
    d = cfg.decoder
    layer = {
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
        "num_hidden_layers": cfg.num_layers, "rms_norm_eps": d.rms_norm_eps,
        "rope_theta": d.rope_theta, "max_position_embeddings": d.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size, "hidden_act": "silu",
    }
    if d.rope_scaling.get("rope_type", "default") != "default":
        layer["rope_scaling"] = d.rope_scaling
    aux = list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None
    parallel = {"mask_token_id": cfg.mask_token_id, "num_depths": cfg.parallel_depth} \
        if cfg.parallel else {}
    if parallel:
        speculative_tokens = cfg.parallel_depth
    kind = "peagle" if parallel else "eagle3"
    if fmt == "safeailab":
        out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer,
               "draft_vocab_size": cfg.draft_vocab_size,
               "target_hidden_size": cfg.target_hidden_size, **parallel}
        if aux:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        return out
    if fmt == "speculators":
        return {
            "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
            "speculators_model_type": kind, **parallel,
            "transformer_layer_config": {"architectures": ["LlamaForCausalLM"],
                                         "model_type": "llama", **layer},
            "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": cfg.norm_before_residual,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": aux,
            "speculators_config": {"algorithm": kind, "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": speculative_tokens}]},
        }
    raise ValueError(f"format must be 'safeailab' or 'speculators', got {fmt!r}")


def save_eagle3_head(head: Eagle3Head, path: str, fmt: str = "safeailab",
                     speculative_tokens: int = 3, dtype=None):
    """Writes config.json + model.safetensors the way published heads are laid out."""
    cfg_dict = head_config_dict(head.config, fmt, speculative_tokens)
    state = _hf_state_dict(head, fmt)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    save_file(state, os.path.join(path, "model.safetensors"))
