"""Tiny random-weight hybrid checkpoints (Qwen3-Next, Qwen3.5 dense and MoE) built by the
tests themselves, optionally with an MTP module (`mtp.*`, which transformers does not
read: random weights added to the saved file)."""
from __future__ import annotations

import json
import os

import torch

HYBRID_ARCHS = {
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
}


def make_hybrid_model(path, arch: str = "qwen3-next", num_layers: int = 4, seed: int = 0,
                      mtp: bool = False, embed_scale: float = 1.0, **overrides):
    """A random hybrid model saved at path (layers 0-2 DeltaNet, 3 full attention);
    returns the transformers model. mtp: adds one MTP layer's weights (mtp.*);
    embed_scale > 1: token embeddings dominate the residual stream, so greedy outputs
    soon cycle (model-free drafts then get accepted)."""
    import transformers
    cfg_name, model_name, extra = HYBRID_ARCHS[arch]
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = getattr(transformers, cfg_name)(**{**fields, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():           # larger-than-default weights: sharper, less tied logits
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, 0.1)              # zero-centred norms: 1 + w
        model.model.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(path)
    if mtp:
        add_mtp_weights(path, model, seed)
    return model


def mtp_weights(model, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of one MTP layer for `model`: fc, the two pre-fc norms, a
    full-attention decoder layer shaped like the model's (MoE where it is), the norm."""
    gen = torch.Generator().manual_seed(seed + 100)
    h = model.config.hidden_size
    layer = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    prefix = f"model.layers.{layer}."
    out = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * 0.08}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.randn(h, generator=gen) * 0.1
    for name, p in model.state_dict().items():
        if name.startswith(prefix):
            out["mtp.layers.0." + name[len(prefix):]] = torch.randn(p.shape, generator=gen) * \
                (0.08 if p.dim() >= 2 else 0.1)
    return out


def add_mtp_weights(path, model, seed: int = 0):
    """Writes mtp.* weights into the checkpoint at path and mtp_num_hidden_layers=1."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    extra = mtp_weights(model, seed)
    # per-expert keys, as published checkpoints store them
    for name in [n for n in extra if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t = extra.pop(name)
        base = name.rsplit(".", 1)[0]
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                gate, up = t[e].chunk(2, dim=0)
                extra[f"{base}.{e}.gate_proj.weight"] = gate.contiguous()
                extra[f"{base}.{e}.up_proj.weight"] = up.contiguous()
            else:
                extra[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
    save_file({**weights, **extra}, file, metadata={"format": "pt"})
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["mtp_num_hidden_layers"] = 1
    json.dump(cfg, open(cfg_file, "w"))
    return extra


NEMOTRON_BLOCKS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                   "mlp"]


def make_nemotron_h_model(path, seed: int = 0, embed_scale: float = 1.0, **overrides):
    """A random NemotronHForCausalLM saved at path (Mamba2, MoE, attention, MLP blocks);
    embed_scale as make_hybrid_model's."""
    import transformers
    fields = dict(vocab_size=128, hidden_size=64, layers_block_type=NEMOTRON_BLOCKS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16,
                  n_groups=2, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
                  topk_group=1, max_position_embeddings=256, chunk_size=4, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, time_step_limit=(0.0, 3.0))
    cfg = transformers.NemotronHConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith(("dt_bias", "D")):
                p.normal_(0.0, 0.5)
        for layer in model.model.layers:
            gate = getattr(layer.mixer, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0, 0.3)
        model.model.embeddings.weight.mul_(embed_scale)
    model.save_pretrained(path)
    return model


def nemotron_mtp_weights(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a Nemotron-H MTP step (attention block, MoE block) in the
    stacked form transformers' blocks take: {block index: state dict}, plus 'own':
    enorm, hnorm, eh_proj, final_layernorm."""
    gen = torch.Generator().manual_seed(seed + 200)
    types = list(model.config.layers_block_type)
    h = model.config.hidden_size
    blocks = {}
    for i, kind in enumerate(("full_attention", "moe")):
        src = model.model.layers[types.index(kind)].state_dict()
        blocks[i] = {n: (torch.randn(p.shape, generator=gen) * 0.08 if p.dim() >= 2 else
                         1.0 + torch.randn(p.shape, generator=gen) * 0.1
                         if n.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.3)
                     for n, p in src.items()}
    own = {"enorm.weight": 1.0 + torch.randn(h, generator=gen) * 0.1,
           "hnorm.weight": 1.0 + torch.randn(h, generator=gen) * 0.1,
           "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.08,
           "final_layernorm.weight": 1.0 + torch.randn(h, generator=gen) * 0.1}
    return {"blocks": blocks, "own": own}


def add_nemotron_mtp_weights(path, model, seed: int = 0):
    """Writes mtp.layers.{0,1}.* (per-expert keys) and num_nextn_predict_layers=1."""
    from safetensors.torch import load_file, save_file
    w = nemotron_mtp_weights(model, seed)
    extra = {}
    for i, sd in w["blocks"].items():
        for n, t in sd.items():
            if n.endswith(("experts.up_proj", "experts.down_proj")):
                base, proj = n.rsplit(".", 1)
                for e in range(t.shape[0]):
                    extra[f"mtp.layers.{i}.{base}.{e}.{proj}.weight"] = t[e].contiguous()
            else:
                extra[f"mtp.layers.{i}.{n}"] = t
    for n, t in w["own"].items():
        i = 1 if n.startswith("final_layernorm") else 0
        extra[f"mtp.layers.{i}.{n}"] = t
    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg.update(num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"])
    json.dump(cfg, open(cfg_file, "w"))
    return w
