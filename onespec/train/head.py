"""A fresh EAGLE-3 head for a target, initialised from the target where that helps."""
from __future__ import annotations

import torch

from onespec.models.eagle3 import Eagle3Head, Eagle3HeadConfig
from onespec.models.llama import LlamaForCausalLM


def head_config_for_target(target: LlamaForCausalLM, capture: tuple[int, ...],
                           draft_vocab_size: int, num_layers: int = 1,
                           parallel_depth: int | None = None) -> Eagle3HeadConfig:
    """Llama layers shaped like the target's (H, heads, kv heads, head_dim, MLP width,
    eps, RoPE); `capture` is outputs-of ids, written to the checkpoint as inputs-to (+1).
    parallel_depth: a P-EAGLE head of that depth, its mask token one past the vocabulary."""
    t = target.config
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
        "num_hidden_layers": num_layers, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings, "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab_size, "target_hidden_size": t.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in capture]},
    }
    if t.rope_scaling.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = t.rope_scaling
    if parallel_depth is not None:
        cfg |= {"mask_token_id": t.vocab_size, "num_depths": parallel_depth}
    return Eagle3HeadConfig.from_hf(cfg)


@torch.no_grad()
def build_head(target: LlamaForCausalLM, capture: tuple[int, ...],
               draft_ids: torch.Tensor | None, d2t=None, t2d=None, num_layers: int = 1,
               parallel_depth: int | None = None) -> Eagle3Head:
    """float32 head on the CPU. The final norm is the target's, lm_head rows are the target's
    rows of the draft vocab; the rest keeps PyTorch's default init. A chain head has no
    embedding of its own: it reads the target's (frozen, not saved). A parallel head
    (parallel_depth) trains its own, the target's rows plus the mask token's (their mean),
    as P-EAGLE does; its mask_hidden starts small and random."""
    vocab = target.config.vocab_size
    cfg = head_config_for_target(target, capture, vocab if draft_ids is None else len(draft_ids),
                                 num_layers, parallel_depth)
    head = Eagle3Head(cfg, num_captured=len(capture)).float()
    if parallel_depth is not None:
        table = target.model.embed_tokens.weight.float().cpu()
        head.embed_tokens = torch.nn.Embedding(vocab + 1, table.shape[1])
        head.embed_tokens.weight.copy_(torch.cat([table, table.mean(0, keepdim=True)]))
        head.mask_hidden.normal_(0, 0.02)
    head.norm.weight.copy_(target.model.norm.weight.float().cpu())
    lm = target.lm_head.weight.float().cpu()
    head.lm_head.weight.copy_(lm if draft_ids is None else lm[draft_ids.cpu()])
    if draft_ids is not None:
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head
