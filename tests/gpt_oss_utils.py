"""Tiny random-weight gpt-oss checkpoints and EAGLE-3 heads in the published layouts, built
by the tests themselves."""
from __future__ import annotations

import json
import os

import torch

# gpt-oss's rope_parameters, with a 64-token pre-training context
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64,
                "rope_theta": 150000.0}
WINDOW = 8


def gpt_oss_config(num_layers: int = 4, **overrides):
    import transformers
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=32,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=WINDOW, max_position_embeddings=256,
                  rope_parameters=GPT_OSS_YARN, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    return transformers.GptOssConfig(**{**fields, **overrides})


def make_gpt_oss_model(path, seed: int = 0, dtype=torch.float32, **overrides):
    """A random GptOssForCausalLM saved at path (in dtype); returns the float32 model.
    Every parameter is drawn, sinks and biases included (transformers leaves the router
    and the sinks at zero or uninitialised), the experts' inputs large enough to reach the SwiGLU's clamp."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(gpt_oss_config(**overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)
        for layer in model.model.layers:       # gate and up values past swiglu_limit
            layer.mlp.experts.gate_up_proj.mul_(8.0)
    model.to(dtype).save_pretrained(path)
    return model.float()


def write_gpt_oss_eagle3_head(path, target_cfg, aux_layer_ids=(1, 2, 3), draft_vocab: int = 64,
                              seed: int = 1):
    """A random EAGLE-3 head for a gpt-oss target, in the layout published for gpt-oss
    (SpecForge / SafeAILab: LlamaForCausalLMEagle3, eagle_config's aux layer ids in the
    inputs-to convention, head_dim unequal to hidden_size / heads, no rope_theta, a draft
    vocabulary with d2t). Returns the onespec head module."""
    from onespec.models.eagle3 import Eagle3Head, Eagle3HeadConfig, make_vocab_maps
    from onespec.models.eagle3_io import save_eagle3_head
    h = target_cfg.hidden_size
    published = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
        "head_dim": 32, "hidden_act": "silu", "hidden_size": h, "initializer_range": 0.02,
        "intermediate_size": 6 * h, "max_position_embeddings": 256, "model_type": "llama",
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": target_cfg.vocab_size,
        "draft_vocab_size": draft_vocab,
    }
    cfg = Eagle3HeadConfig.from_hf(published)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, len(aux_layer_ids))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(1.0, 0.1)
        g = torch.Generator().manual_seed(seed)
        chosen = torch.sort(torch.randperm(target_cfg.vocab_size, generator=g)[:draft_vocab]).values
        d2t, t2d = make_vocab_maps(chosen, target_cfg.vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    save_eagle3_head(head, str(path), "safeailab")
    with open(os.path.join(path, "config.json"), "w") as f:     # the published fields only
        json.dump(published, f, indent=2)
    return head
