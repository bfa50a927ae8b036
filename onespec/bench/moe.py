"""The MLA + MoE shapes of `onespec bench decode`, drafted by the target's own MTP layer.

`deepseek-v2-lite` is DeepSeek-V2-Lite / Moonlight-like: 27 layers, hidden 2048, MLA
(no q LoRA, kv_lora_rank 512, 16 heads of 128 + 64 rope dims), a dense first layer, then 64
routed experts of which 6 are active plus 2 shared, vocab 102,400, and one MTP layer;
routing is DeepSeek-V3's (sigmoid, one group). The floor of a step counts the experts the
step's rows are expected to reach: at batch 1 exactly the active ones.

`deepseek-v3.2` has DeepSeek-V3.2's per-layer dimensions (hidden 7168, MLA with q LoRA 1536,
128 heads, 256 routed experts of 2048 with 8 active in 4 of 8 groups plus one shared, the
lightning indexer of 64 heads of 128 keeping the top 2048 tokens, YaRN to 160k positions,
vocab 129,280) with 4 layers instead of 61 (one dense, three MoE) and one MTP layer: about
97 GB of bfloat16 weights, for one H200. `tiny-dsa` is the same architecture in miniature
(the CPU tests run it).

`qwen3.5-moe-hybrid` is Qwen3.5-MoE-like (35B-A3B class, fits one H200 in bf16): 40 layers,
hidden 2048, three gated-DeltaNet layers to one gated full-attention layer (16 key / 32
value heads of 128; 16 query and 2 KV heads of 256, a quarter of each rotated), 256
experts of 512 of which 8 are active plus one shared expert, vocab 248,320, one MTP
layer. Its floor adds the recurrent state a step moves: every request's state read once
and written after each of its K+1 verify rows (the snapshots the commit picks from).
"""
from __future__ import annotations

from onespec.models.gpt_oss import GptOssExperts
from onespec.models.moe import Experts

MTP_SHAPES = {
    "deepseek-v2-lite": ("deepseek-v2-lite-shape", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        first_k_dense_replace=1, vocab_size=102400)),
    "tiny-mla": ("tiny-mla-shape", dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, vocab_size=1000)),
    "deepseek-v3.2": ("deepseek-v3.2-shape", dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=1,
        vocab_size=129280, index_n_heads=64, index_head_dim=128, index_topk=2048,
        max_position_embeddings=163840, rope_scaling={
            "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "tiny-dsa": ("tiny-dsa-shape", dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, vocab_size=1000, index_n_heads=4, index_head_dim=32,
        index_topk=16)),
    "qwen3.5-moe-hybrid": ("qwen3.5-moe-hybrid-shape", dict(
        architectures=["Qwen3_5MoeForCausalLM"], hidden_size=2048, intermediate_size=512,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_hidden_layers=40, full_attention_interval=4, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        vocab_size=248320)),
    "tiny-hybrid": ("tiny-hybrid-shape", dict(
        architectures=["Qwen3_5MoeForCausalLM"], hidden_size=128, intermediate_size=64,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, num_hidden_layers=4,
        full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, vocab_size=1000)),
}


def mtp_target_config(shape: str) -> dict:
    _, fields = MTP_SHAPES[shape]
    if fields.get("architectures") == ["Qwen3_5MoeForCausalLM"]:     # the hybrid shapes
        return {"model_type": "qwen3_5_moe_text", **fields, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                    "partial_rotary_factor": 0.25},
                "max_position_embeddings": 4096, "mtp_num_hidden_layers": 1,
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 1.0, "rope_theta": 10000.0, "rope_interleave": True,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, **fields}


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` tokens reach when each picks top_k uniformly: E(1-(1-k/E)^r)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def _expert_modules(module) -> list:
    """The stacked-expert modules under `module` (models/moe.py's Experts, gpt-oss's)."""
    return [m for m in module.modules() if isinstance(m, (Experts, GptOssExperts))]


def _layer_bytes(module, rows: int, top_k: int) -> float:
    """Weights a pass over `rows` tokens reads: all but the experts, plus those reached."""
    experts = _expert_modules(module)
    expert_ids = {id(p) for e in experts for p in e.parameters()}
    out = float(_nbytes(p for p in module.parameters() if id(p) not in expert_ids))
    for e in experts:
        num = e.gate_up_proj.shape[0]
        out += _nbytes(e.parameters()) / num * expected_experts(num, top_k, rows)
    return out


def moe_step_bytes(model, drafter, batch: int, k: int, kv_tokens: float,
                   target_kv_per_token: int, head_kv_per_token: int) -> dict[str, float]:
    """As models.step_bytes, for an MoE target drafted by its MTP layer: the target's
    layers over batch (K+1) rows, the MTP layer over the same rows at step 0 and one row per
    request in each of the K-1 later passes, the LM head once per pass."""
    rows, top_k = batch * (k + 1), model.config.num_experts_per_tok
    embed = model.model.embed_tokens.weight
    target = sum(_layer_bytes(layer, rows, top_k) for layer in model.model.layers)
    target += _nbytes(model.model.norm.parameters()) + _nbytes([model.lm_head.weight])
    target += rows * embed.shape[1] * embed.element_size()
    out = {"target": target, "head": 0.0, "kv": kv_tokens * target_kv_per_token,
           "state": state_step_bytes(model, batch, k)}
    if drafter is not None and k > 0:
        layer = drafter.head.layers[0]       # (vanilla mode is not benchmarked)
        lm_head = layer.shared_head.head or model.lm_head
        per_pass = _nbytes(p for n, p in layer.named_parameters()
                           if n.split(".")[0] in ("enorm", "hnorm", "eh_proj"))
        per_pass += _nbytes(layer.shared_head.norm.parameters()) + _nbytes([lm_head.weight])
        head_rows = [rows] + [batch] * (k - 1)
        out["head"] = sum(per_pass + _layer_bytes(layer.block, r, top_k) for r in head_rows)
        out["kv"] += k * kv_tokens * head_kv_per_token
    return out


def state_step_bytes(model, batch: int, k: int) -> float:
    """Recurrent state a step of a hybrid target moves: each request's state read once and
    written after each of its K+1 verify rows (0 for other targets)."""
    if not getattr(model, "recurrent", False):
        return 0.0
    from onespec.engine.state_pool import state_bytes
    per = state_bytes(model.recurrent_layers(), model.lm_head.weight.dtype)
    return float(batch * per * (1 + k + 1))


def is_moe(model) -> bool:
    return bool(_expert_modules(model))


def hf_weight_bytes(model, rows: int) -> float:
    """Weights a transformers MoE decode step over `rows` tokens reads: all but the
    embedding table and the stacked experts ([E, ...] `experts.*`), plus the experts the
    rows are expected to reach."""
    embed = model.model.embed_tokens.weight
    top_k = getattr(model.config, "num_experts_per_tok", 0) or 1
    out = 0.0
    for name, p in model.named_parameters():
        if p is embed:
            continue
        if ".experts." in name and p.dim() == 3:
            out += p[0].numel() * p.element_size() * expected_experts(p.shape[0], top_k, rows)
        else:
            out += p.numel() * p.element_size()
    return out
