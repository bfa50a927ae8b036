"""Target model classes by config.json `architectures`; Llama-family classes otherwise."""
from __future__ import annotations

from onespec.models.deepseek_v3 import DeepseekV3ForCausalLM
from onespec.models.llama import DecoderConfig, LlamaForCausalLM
from onespec.models.qwen3_moe import Qwen3MoeForCausalLM

TARGET_CLASSES = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def target_class(cfg: dict):
    """(config class, model class) for a config.json dict."""
    for arch in cfg.get("architectures") or []:
        if arch in TARGET_CLASSES:
            cls = TARGET_CLASSES[arch]
            return cls.config_class, cls
    return DecoderConfig, LlamaForCausalLM
