"""Tensor parallelism for the MoE and MLA targets on the CPU, two gloo ranks: Qwen3-MoE and
DeepSeek-V3 give transformers' greedy tokens and one rank's, batched with chunked prefill
and preemption; MTP drafting over two ranks drafts what one rank drafts, step by step, and
stays lossless with the same target steps; a rank really holds its share of the heads,
experts' rows and MTP layer; the divisibility checks name the field. Each 2-rank engine is
started once per module (spawning is slow)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_full, hf_greedy, step_beside_one_rank
from moe_utils import add_mtp_layers, deepseek_config, make_deepseek_model, make_qwen3_moe_model
from onespec import LLM, MTPConfig
from onespec.distributed import TensorParallel
from onespec.distributed.layers import (ParallelLMHead, VocabParallelEmbedding,
                                        check_tensor_parallel, shard_weights)
from test_tensor_parallel import GREEDY, PROMPTS, TIGHT, token_ids

# qwen3-moe: GQA with q/k norm, a dense layer between two MoE layers, no shared experts;
# deepseek: MLA with q projected directly, every layer MoE with a shared expert
TARGETS = {"qwen3-moe": (make_qwen3_moe_model, {}),
           "deepseek": (make_deepseek_model, dict(q_lora_rank=None, rope_interleave=False,
                                                  first_k_dense_replace=0))}


@pytest.fixture(scope="module", params=list(TARGETS))
def target_pair(request, tmp_path_factory):
    """(path, HF model, the 2-rank LLM) for one target family."""
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    make, overrides = TARGETS[request.param]
    hf = make(path, **overrides)
    with LLM(str(path), tensor_parallel_size=2, **TIGHT) as llm:
        yield str(path), hf, llm
    assert all(not p.is_alive() for p in llm.engine.ranks.procs)


def test_greedy_equals_transformers_and_one_rank(target_pair):
    path, hf, llm = target_pair
    got = token_ids(llm.generate(PROMPTS, GREEDY))
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert token_ids(LLM(path, **TIGHT).generate(PROMPTS, GREEDY)) == got
    assert llm.stats()["num_preemptions"] > 0
    # rank 0 holds 2 of 4 heads and half of every expert's rows; the router is whole
    cfg, layers = hf.config, llm.engine.model.model.layers
    moe = layers[-1].mlp
    assert layers[0].self_attn.num_heads == 2
    assert moe.experts.gate_up_proj.shape == (8, cfg.moe_intermediate_size, cfg.hidden_size)
    assert moe.experts.down_proj.shape == (8, cfg.hidden_size, cfg.moe_intermediate_size // 2)
    assert moe.gate.weight.shape == (8, cfg.hidden_size)
    assert_pool_full(llm)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """A DeepSeek-V3 target (q LoRA, a dense layer then MoE, shared experts) with 2 MTP
    layers of their own embedding and head, its HF model and its plain greedy tokens."""
    path = tmp_path_factory.mktemp("tp-mtp")
    hf = make_deepseek_model(path, mtp_layers=2)
    add_mtp_layers(path, hf, 2)
    plain = token_ids(LLM(str(path), **TIGHT).generate(PROMPTS, GREEDY))
    return str(path), hf, plain


@pytest.fixture(scope="module", params=[("eagle", 3), ("vanilla", 2)],
                ids=["eagle-k3", "vanilla-k2"])
def mtp_pair(request, mtp_target):
    path, hf, plain = mtp_target
    mode, k = request.param
    spec = MTPConfig(num_nextn_predict_layers=k, use_mtp_vanilla=mode == "vanilla")
    with LLM(path, speculative_config=spec, tensor_parallel_size=2, **TIGHT) as llm:
        yield mtp_target, spec, llm


def test_mtp_lossless_with_one_rank_drafts_and_target_steps(mtp_pair):
    """Side by side with a one-rank engine, step by step: the same drafts after every step,
    plain greedy's tokens (= transformers'), the same target steps per request."""
    (path, hf, plain), spec, llm = mtp_pair
    one = LLM(path, speculative_config=spec, **TIGHT)
    reqs = step_beside_one_rank(llm, one, PROMPTS, GREEDY)
    assert [r.output_token_ids for r in reqs] == plain
    assert plain == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert llm.stats()["num_preemptions"] > 0
    # the MTP layers are split like the target's: half the heads and expert rows, the
    # own embedding and head vocabulary-parallel
    layer = llm.engine.drafter.head.layers[0]
    assert layer.block.self_attn.num_heads == 2
    assert layer.block.mlp.experts.down_proj.shape[2] == hf.config.moe_intermediate_size // 2
    assert isinstance(layer.embed_tokens, VocabParallelEmbedding)
    assert isinstance(layer.shared_head.head, ParallelLMHead)
    assert_pool_full(llm)


def _config(arch: str, **fields) -> dict:
    if arch == "DeepseekV3ForCausalLM":
        cfg = deepseek_config(**fields).to_dict()
    else:
        from transformers import Qwen3MoeConfig
        base = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
        cfg = Qwen3MoeConfig(**{**base, **fields}).to_dict()
    return {**cfg, "architectures": [arch]}


@pytest.mark.parametrize("arch,fields,size,message", [
    ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=30), 4, "moe_intermediate_size=30"),
    ("Qwen3MoeForCausalLM", dict(intermediate_size=90, mlp_only_layers=[1]), 4,
     "intermediate_size=90"),
    ("Qwen3MoeForCausalLM", dict(num_key_value_heads=3, num_attention_heads=6), 2,
     "num_key_value_heads=3"),
    ("DeepseekV3ForCausalLM", {}, 8, "num_attention_heads=4"),
    ("DeepseekV3ForCausalLM", dict(moe_intermediate_size=34), 4, "moe_intermediate_size=34"),
    ("DeepseekV3ForCausalLM", dict(intermediate_size=90), 4, "intermediate_size=90"),
])
def test_divisibility_is_checked_per_field(arch, fields, size, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size} .*{message}"):
        check_tensor_parallel(_config(arch, **fields), size)


def test_splits_that_fit_are_accepted():
    """Only the MLP kinds a checkpoint has must split: no dense layer, no intermediate_size
    check; MLA's one latent for all heads needs no KV head split."""
    check_tensor_parallel(_config("Qwen3MoeForCausalLM", intermediate_size=90), 4)
    check_tensor_parallel(_config("DeepseekV3ForCausalLM", intermediate_size=90,
                                  first_k_dense_replace=0, num_key_value_heads=3), 4)
    with pytest.raises(ValueError, match="not supported for 'DeepseekV2ForCausalLM'"):
        check_tensor_parallel({**_config("DeepseekV3ForCausalLM"),
                               "architectures": ["DeepseekV2ForCausalLM"]}, 2)


def test_stacked_experts_are_sliced_like_per_expert_keys():
    """Experts stored stacked ([E, 2I, H] gate rows first, [E, H, I]) get the rows and
    columns the per-expert keys of the same experts get."""
    tp = TensorParallel(rank=1, world_size=2, device=torch.device("cpu"), group=None)
    gate, up, down = torch.randn(4, 8, 6), torch.randn(4, 8, 6), torch.randn(4, 6, 8)
    per_expert = dict(shard_weights(
        [(f"mlp.experts.{e}.{p}.weight", w[e]) for e in range(4)
         for p, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))], None, tp))
    stacked = dict(shard_weights([("mlp.experts.gate_up_proj", torch.cat([gate, up], 1)),
                                  ("mlp.experts.down_proj", down)], None, tp))
    for e in range(4):
        gate_up = torch.cat([per_expert[f"mlp.experts.{e}.gate_proj.weight"],
                             per_expert[f"mlp.experts.{e}.up_proj.weight"]])
        assert torch.equal(stacked["mlp.experts.gate_up_proj"][e], gate_up)
        assert torch.equal(stacked["mlp.experts.down_proj"][e],
                           per_expert[f"mlp.experts.{e}.down_proj.weight"])
    assert gate_up.shape == (8, 6) and torch.equal(gate_up[:4], gate[3, 4:])
