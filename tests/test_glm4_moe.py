"""GLM-4.x MoE against Hugging Face transformers: greedy generation token for token
(batched, chunked prefill, preemption) for Glm4MoeForCausalLM (partial rotary, q/k norm or
none, attention biases, grouped sigmoid routing, shared experts, dense first layers) and
Glm4MoeLiteForCausalLM (latent attention); MTP on GLM: greedy output equals plain output,
drafts equal a cache-free reference built from transformers modules; config errors."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, assert_drafts_match_reference, assert_greedy_matches, \
    assert_pool_full, hf_greedy
from moe_utils import _randomize, add_mtp_layers
from onespec import LLM, MTPConfig, SamplingParams
from onespec.models.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from test_deepseek_v32 import ENGINE_MODES, GREEDY, NEW_TOKENS, PROMPTS
from test_mtp import reference_drafts

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=1.5, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
VARIANTS = {
    # GLM-4.5's shape: GQA, half the head's channels rotate, q/k/v biases, no q/k norm
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=False,
        num_hidden_layers=3, num_nextn_predict_layers=1)),
    # q/k norm, a quarter of the channels rotate, one group, unnormalised weights
    "glm4-moe-qknorm": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_key_value_heads=1, head_dim=32, use_qk_norm=True, num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        n_group=1, topk_group=1, norm_topk_prob=False, num_nextn_predict_layers=0)),
    # GLM-4.7-Flash: DeepSeek's latent attention with GLM's MoE
    "glm4-moe-lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"])),
}


def make_glm_model(path, variant: str, seed: int = 0):
    import transformers
    cfg_name, model_name, over = VARIANTS[variant]
    cfg = getattr(transformers, cfg_name)(**{**BASE, **over})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{variant: (path, hf model, greedy references for PROMPTS)}."""
    out = {}
    for name in VARIANTS:
        path = tmp_path_factory.mktemp(name)
        hf = make_glm_model(path, name)
        out[name] = (str(path), hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS])
    return out


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(models, variant, mode):
    path, _, refs = models[variant]
    assert_greedy_matches(path, refs, PROMPTS, GREEDY, **ENGINE_MODES[mode])


def test_layers_follow_the_config(models):
    path, _, _ = models["glm4-moe"]
    llm = LLM(path, dtype="float32", device="cpu")
    model = llm.engine.model
    assert isinstance(model, Glm4MoeForCausalLM)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MLP", "DeepseekMoE", "DeepseekMoE"]          # first_k_dense_replace=1
    assert model.rotary.rotary_dim == 8 and not model.rotary.fused_ok   # 16 * 0.5
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    lite = LLM(models["glm4-moe-lite"][0], dtype="float32", device="cpu").engine.model
    assert [type(layer.mlp).__name__ for layer in lite.model.layers] == \
        ["MLP", "DeepseekMoE", "DeepseekMoE"]


def test_config_errors():
    base = {**BASE, "architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 2,
            "num_key_value_heads": 2, "head_dim": 16}
    assert Glm4MoeConfig.from_hf(base).rotary_dim == 8       # transformers' default 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Glm4MoeConfig.from_hf({**base, "partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        Glm4MoeConfig.from_hf({**base, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        Glm4MoeConfig.from_hf({k: v for k, v in base.items() if k != "moe_intermediate_size"})


# ---- MTP ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_target(models):
    """The GLM-4.5-shaped target with one MTP layer in DeepSeek's layout (its own
    embedding and head) appended to its checkpoint, and the layer's reference modules."""
    path, hf, refs = models["glm4-moe"]
    mtp = add_mtp_layers(path, hf, 1, family="glm4_moe")
    return path, hf, mtp, refs


@pytest.mark.parametrize("engine_kw", list(ENGINE_MODES))
def test_mtp_greedy_lossless(mtp_target, engine_kw):
    path, _, _, plain = mtp_target
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, **ENGINE_MODES[engine_kw],
              speculative_config=MTPConfig(num_nextn_predict_layers=3))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0
    assert_pool_full(llm)


def test_lite_mtp_greedy_lossless(models, tmp_path):
    """GLM-4.7-Flash's MTP layer (MLA + GLM's MoE, at model.layers.{L}) drafts losslessly."""
    import json
    import shutil
    _, hf, refs = models["glm4-moe-lite"]
    path = tmp_path / "lite-mtp"
    shutil.copytree(models["glm4-moe-lite"][0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    add_mtp_layers(str(path), hf, 1, family="glm4_moe_lite")
    llm = LLM(str(path), dtype="float32", device=TEST_DEVICE, max_num_tokens=9,
              speculative_config=MTPConfig(num_nextn_predict_layers=2))
    assert type(llm.engine.drafter.head.layers[0].block.mlp).__name__ == "DeepseekMoE"
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.stats()["num_draft_tokens"] > 0
    assert_pool_full(llm)


def test_mtp_drafts_match_cache_free_reference(mtp_target):
    path, hf, mtp, _ = mtp_target
    k = 3
    llm = LLM(path, dtype="float32", device="cpu", max_num_tokens=10,
              speculative_config=MTPConfig(num_nextn_predict_layers=k))
    layer = llm.engine.drafter.head.layers[0]
    torch.testing.assert_close(layer.eh_proj.weight, mtp[0].eh_proj.weight)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert_drafts_match_reference(llm, PROMPTS[1:3], params,
                                  lambda ids: reference_drafts(hf, mtp[0], ids, k), k)


# ---- CUDA: the Triton backend (skips cleanly without a GPU) -------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_cuda_matches_transformers(models, mtp_target, variant, graphs):
    """GEMVs, fused norms and grouped experts in Triton (GLM-4's partial rotary outside
    the fused rotary kernels), with and without CUDA graphs, MTP drafting where the
    checkpoint has it: transformers' tokens."""
    path, _, refs = models[variant]
    k = 3 if variant == "glm4-moe" else 0
    spec = MTPConfig(num_nextn_predict_layers=k) if k else None
    llm = LLM(path, dtype="float32", device="cuda", cuda_graphs=graphs, max_batch_size=8,
              speculative_config=spec)
    assert llm.engine.kernel_settings.triton
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    if graphs:
        assert llm.engine.runner.graphs.num_replays > 0
    assert_pool_full(llm)
