"""DeepSeek-V3 (MLA + MoE) against Hugging Face transformers: greedy generation token for
token (batched, chunked prefill, preemption), prefill logits, the latent KV cache and its
two attention forms, group-limited routing, and config.json spellings."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TEST_DEVICE, assert_greedy_matches, assert_pool_full, hf_greedy
from moe_utils import DEEPSEEK_VARIANTS, YARN, make_deepseek_model
from onespec import LLM, SamplingParams
from onespec.layers.attention import build_attention_metadata
from onespec.models import deepseek_v3
from onespec.models.deepseek_v3 import DeepseekV3Config, MLARotary, MLAttention
from onespec.models.moe import deepseek_route

NEW_TOKENS = 16
ENGINE_MODES = {
    "batched": dict(),
    "chunked-prefill": dict(max_num_tokens=7),
    "preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=17),
}


def make_prompts(lens=(1, 7, 19, 40), vocab: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{variant: (path, hf model, greedy references for PROMPTS)}."""
    out = {}
    for name, over in DEEPSEEK_VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        hf = make_deepseek_model(path, **over)
        out[name] = (str(path), hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS])
    return out


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("variant", list(DEEPSEEK_VARIANTS))
def test_greedy_matches_transformers(models, variant, mode):
    path, _, refs = models[variant]
    assert_greedy_matches(path, refs, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), **ENGINE_MODES[mode])


@pytest.mark.parametrize("absorb_max_rows", [0, 1000])
def test_both_attention_forms_match_transformers(models, monkeypatch, absorb_max_rows):
    """Every step expanded (0), or every step absorbed, prefill included (1000)."""
    path, _, refs = models["qlora-yarn-grouped"]
    monkeypatch.setattr(deepseek_v3, "ABSORB_MAX_ROWS", absorb_max_rows)
    llm = LLM(path, dtype="float32", device=TEST_DEVICE)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_pool_full(llm)


@torch.no_grad()
def test_prefill_logits_match_transformers(models):
    for variant in DEEPSEEK_VARIANTS:
        path, hf, _ = models[variant]
        llm = LLM(path, dtype="float32", device="cpu")
        model = llm.engine.model
        prompt = PROMPTS[-1]
        n = len(prompt)
        llm.engine.pool.allocate(table := [], n)
        meta = build_attention_metadata(torch.tensor([table]), [n], torch.arange(n), 16, n)
        hidden, _ = model(torch.tensor(prompt), torch.arange(n), meta)
        llm.engine.pool.free(table)
        ours = model.compute_logits(hidden)
        ref = hf(torch.tensor([prompt])).logits[0]
        err = (ours - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, variant


def test_absorbed_and_expanded_attention_agree():
    cfg = DeepseekV3Config.from_hf(json.loads(json.dumps(dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=32, hidden_size=64,
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=24, rope_parameters=YARN,
        max_position_embeddings=256))))
    torch.manual_seed(0)
    attn = MLAttention(cfg)
    rotary = MLARotary(8, 128, cfg.rope_theta, cfg.rope_scaling, True, "cpu")
    attn.allocate_cache(64, "cpu")
    # two requests: a 9-token prefill chunk and a 3-row verify after 20 cached tokens
    attn.latent_cache.normal_()
    positions = torch.cat([torch.arange(9), torch.arange(20, 23)])
    meta = build_attention_metadata(torch.tensor([[0, 1], [2, 3]]), [9, 3], positions, 16, 23)
    x = torch.randn(12, 64)
    q = attn.q_proj(x).view(12, 4, -1)
    q_nope, q_pe = q.split([16, 8], -1)
    q_pe, _ = rotary(positions, q_pe, q_pe[:, :1])
    absorbed = attn.attend_absorbed(q_nope, q_pe, meta)
    expanded = attn.attend_expanded(q_nope, q_pe, meta)
    assert absorbed.shape == (12, 4, 24)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)


def test_pool_holds_latents_not_expanded_keys_and_values(models):
    path, _, _ = models["qlora-yarn-grouped"]
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=20, block_size=4,
              max_model_len=64)
    layers = [layer.self_attn for layer in llm.engine.model.model.layers]
    for a in layers:
        assert a.latent_cache.shape == (21 * 4, 32 + 16)      # one scratch block past the pool
        assert a.cache_bytes_per_token() == (32 + 16) * 4
        # expanded: 4 heads x (16 + 16 keys + 24 values) floats
        assert a.expanded_bytes_per_token() == 4 * (16 + 16 + 24) * 4
        assert not hasattr(a, "k_cache")


def test_group_limited_routing_worked_example():
    # 4 experts in 2 groups of 2; group scores (sum of the best two): g0 = 0.9 + 0.1 + bias
    logits = torch.logit(torch.tensor([[0.9, 0.1, 0.6, 0.5]]))
    bias = torch.zeros(4)
    w, ids = deepseek_route(logits, bias, top_k=2, num_groups=2, topk_groups=1,
                            norm_topk_prob=False, scaling=2.0)
    # g0 = 1.0 < g1 = 1.1: only experts 2 and 3 may be chosen, though expert 0 scores best
    assert sorted(ids[0].tolist()) == [2, 3]
    torch.testing.assert_close(w.sort(-1, descending=True).values, torch.tensor([[1.2, 1.0]]))
    # the bias steers the choice of groups and experts, not the weights
    bias = torch.tensor([0.0, 0.5, 0.0, 0.0])
    w, ids = deepseek_route(logits, bias, 2, 2, 1, norm_topk_prob=True, scaling=1.0)
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(w.sort(-1, descending=True).values, torch.tensor([[0.9, 0.1]]))


def test_config_spellings_agree():
    base = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=32, hidden_size=64,
                intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=24, max_position_embeddings=256)
    yarn4 = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    v4 = DeepseekV3Config.from_hf({**base, "rope_theta": 10000.0,
                                   "rope_scaling": {"type": "yarn", **yarn4}})
    v5 = DeepseekV3Config.from_hf({**base, "rope_parameters": YARN})
    assert v4.rope_theta == v5.rope_theta == 10000.0
    assert {k: v4.rope_scaling[k] for k in yarn4} == {k: v5.rope_scaling[k] for k in yarn4}
    assert v4.rope_scaling["rope_type"] == v5.rope_scaling["rope_type"] == "yarn"
    assert deepseek_v3.softmax_scale(v4) == pytest.approx(
        24 ** -0.5 * (0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        DeepseekV3Config.from_hf({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekV3Config.from_hf({k: v for k, v in base.items() if k != "kv_lora_rank"})


def test_router_stays_float32_in_lower_precision(models):
    path, _, _ = models["qlora-yarn-grouped"]
    llm = LLM(path, dtype="bfloat16", device="cpu")
    moe = llm.engine.model.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == torch.bfloat16
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert_pool_full(llm)
