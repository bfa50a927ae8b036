"""A fresh EAGLE-3 head for a target, initialised from the target where that helps."""
from __future__ import annotations

import torch

from onespec.models.eagle3 import Eagle3Head, Eagle3HeadConfig
from onespec.models.llama import LlamaForCausalLM


def head_config_for_target(target: LlamaForCausalLM, capture: tuple[int, ...],
                           draft_vocab_size: int) -> Eagle3HeadConfig:
    """One Llama layer shaped like the target's (H, heads, kv heads, head_dim, MLP width,
    eps, RoPE); `capture` is outputs-of ids, written to the checkpoint as inputs-to (+1)."""
    t = target.config
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings, "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab_size, "target_hidden_size": t.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in capture]},
    }
    if t.rope_scaling.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = t.rope_scaling
    return Eagle3HeadConfig.from_hf(cfg)


@torch.no_grad()
def build_head(target: LlamaForCausalLM, capture: tuple[int, ...],
               draft_ids: torch.Tensor | None, d2t=None, t2d=None) -> Eagle3Head:
    """float32 head on the CPU. The final norm is the target's, lm_head rows are the target's
    rows of the draft vocab; the rest keeps PyTorch's default init. The head has no embedding
    of its own: it reads the target's (frozen, not saved)."""
    vocab = target.config.vocab_size
    cfg = head_config_for_target(target, capture, vocab if draft_ids is None else len(draft_ids))
    head = Eagle3Head(cfg, num_captured=len(capture)).float()
    head.norm.weight.copy_(target.model.norm.weight.float().cpu())
    lm = target.lm_head.weight.float().cpu()
    head.lm_head.weight.copy_(lm if draft_ids is None else lm[draft_ids.cpu()])
    if draft_ids is not None:
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head
