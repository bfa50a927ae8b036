"""Tiny random-weight DeepSeek-V3 and Qwen3-MoE checkpoints built by the tests themselves."""
from __future__ import annotations

import torch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
        "rope_theta": 10000.0}

DEEPSEEK_VARIANTS = {
    # q LoRA, YaRN, interleaved rope, a dense layer then MoE, 4 groups of which 2 are kept
    "qlora-yarn-grouped": dict(rope_parameters=YARN),
    # q projected directly, plain rope in neox layout, one group, no score normalisation
    "no-qlora": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                     norm_topk_prob=False, first_k_dense_replace=0),
}


def _randomize(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():           # larger-than-default weights: sharper, less tied logits
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "layernorm" in name or name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.3)


def deepseek_config(vocab_size: int = 128, num_layers: int = 3, mtp_layers: int = 0,
                    **overrides):
    import transformers
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                  qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16,
                  max_position_embeddings=256, num_nextn_predict_layers=mtp_layers,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.DeepseekV3Config(**{**fields, **overrides})


def make_deepseek_model(path, seed: int = 0, **overrides):
    """A random DeepseekV3ForCausalLM saved at path; returns the transformers model."""
    import transformers
    cfg = deepseek_config(**overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return model


def make_qwen3_moe_model(path, seed: int = 0, **overrides):
    import transformers
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    cfg = transformers.Qwen3MoeConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return model


class MTPReference(torch.nn.Module):
    """One MTP layer as transformers modules (a decoder layer of `family`), kept by the
    test for a cache-free reference; its weights go into the checkpoint."""

    def __init__(self, cfg, layer_idx: int, own_embed_head: bool, family: str = "deepseek_v3"):
        import importlib
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        prefix = {"deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe",
                  "glm4_moe_lite": "Glm4MoeLite", "deepseek_v32": "DeepseekV32"}[family]
        decoder_layer, rms_norm = (getattr(modeling, prefix + "DecoderLayer"),
                                   getattr(modeling, prefix + "RMSNorm"))
        super().__init__()
        h, v = cfg.hidden_size, cfg.vocab_size
        types = getattr(cfg, "mlp_layer_types", None)
        if types is not None and layer_idx >= len(types):    # MTP layers are MoE layers
            import copy
            cfg = copy.deepcopy(cfg)
            cfg.mlp_layer_types = list(types) + ["sparse"] * (layer_idx + 1 - len(types))
        self.block = decoder_layer(cfg, layer_idx)
        self.enorm, self.hnorm = rms_norm(h), rms_norm(h)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.shared_head_norm = rms_norm(h)
        self.head = torch.nn.Linear(h, v, bias=False) if own_embed_head else None
        self.embed = torch.nn.Embedding(v, h) if own_embed_head else None

    def checkpoint(self, prefix: str) -> dict:
        out = {}
        for k, t in self.block.state_dict().items():
            if k.endswith("experts.gate_up_proj"):
                gate, up = t.chunk(2, dim=1)
                for e in range(t.shape[0]):
                    out[f"{prefix}{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                    out[f"{prefix}{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
            elif k.endswith("experts.down_proj"):
                for e in range(t.shape[0]):
                    out[f"{prefix}{k[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
            else:
                out[prefix + k] = t
        names = {"enorm.weight": self.enorm.weight, "hnorm.weight": self.hnorm.weight,
                 "eh_proj.weight": self.eh_proj.weight,
                 "shared_head.norm.weight": self.shared_head_norm.weight}
        if self.head is not None:
            names["shared_head.head.weight"] = self.head.weight
            names["embed_tokens.weight"] = self.embed.weight
        out.update({prefix + k: t for k, t in names.items()})
        return {k: t.detach().contiguous().clone() for k, t in out.items()}


def add_mtp_layers(path, hf, num_layers: int, seed: int = 5, own_embed_head: bool = True,
                   family: str = "deepseek_v3"):
    """Appends random MTP layers under model.layers.{L + i}.* to the checkpoint at path
    (as DeepSeek-V3 ships them); returns their MTPReference modules."""
    import os

    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    refs = []
    for i in range(num_layers):
        torch.manual_seed(seed + i)
        ref = MTPReference(hf.config, hf.config.num_hidden_layers + i, own_embed_head,
                           family).eval()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p.normal_(0, 0.08) if p.dim() >= 2 else p.normal_(1.0, 0.1)
            ref.block.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
            for name, p in ref.named_parameters():    # layer norms' biases (an indexer's)
                if name.endswith("norm.bias"):
                    p.normal_(0, 0.1)
            if ref.embed is not None:
                ref.embed.weight.normal_(0, 1.0)
        tensors.update(ref.checkpoint(f"model.layers.{hf.config.num_hidden_layers + i}."))
        refs.append(ref)
    save_file(tensors, file, metadata={"format": "pt"})
    return refs
