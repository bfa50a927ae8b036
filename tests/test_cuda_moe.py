"""CUDA-only checks of the MoE targets on the Triton backend (skip cleanly without a GPU):
DeepSeek-V3 (absorbed MLA kernel, grouped experts) and Qwen3-MoE equal transformers token
for token in float32 with and without CUDA graphs; graph and eager steps agree, MTP
drafting included; MTP stays lossless under graphs."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_full, hf_greedy
from moe_utils import (DEEPSEEK_VARIANTS, add_mtp_layers, make_deepseek_model,
                       make_qwen3_moe_model)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
NEW_TOKENS = 20
GREEDY_KW = dict(max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE_KW = {"batch": {}, "chunked": {"max_num_tokens": 9},
             "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64}}
TARGETS = [*DEEPSEEK_VARIANTS, "qwen3-moe"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """{name: (path, greedy transformers references of PROMPTS)}; the DeepSeek-V3 targets
    carry one MTP layer."""
    out = {}
    for name in TARGETS:
        path = tmp_path_factory.mktemp(name)
        if name == "qwen3-moe":
            hf = make_qwen3_moe_model(path)
        else:
            hf = make_deepseek_model(path, mtp_layers=2, **DEEPSEEK_VARIANTS[name])
            add_mtp_layers(path, hf, 2)
        out[name] = (str(path), [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS])
    return out


def cuda_llm(path, graphs: bool = True, k: int = 0, vanilla: bool = False, **kw):
    from onespec import LLM, MTPConfig
    spec = MTPConfig(num_nextn_predict_layers=k, use_mtp_vanilla=vanilla) if k else None
    llm = LLM(path, device="cuda", dtype="float32", cuda_graphs=graphs, max_batch_size=8,
              speculative_config=spec, **kw)
    assert llm.engine.kernel_settings.triton, "the MoE target did not take the Triton backend"
    return llm


def greedy_run(llm, prompts=PROMPTS):
    from onespec import SamplingParams
    outs = llm.generate(prompts, SamplingParams(**GREEDY_KW))
    assert_pool_full(llm)
    return [o.outputs[0].token_ids for o in outs], [vars(o.metrics) for o in outs]


@pytest.mark.parametrize("engine_kw", list(ENGINE_KW))
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("name", TARGETS)
def test_moe_target_matches_transformers_on_triton(targets, name, graphs, engine_kw):
    path, refs = targets[name]
    llm = cuda_llm(path, graphs, **ENGINE_KW[engine_kw])
    tokens, _ = greedy_run(llm)
    assert tokens == refs
    if graphs:
        assert llm.engine.runner.graphs.num_replays > 0
    if engine_kw == "preempt":
        assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("k,vanilla", [(0, False), (1, False), (3, False), (2, True)])
@pytest.mark.parametrize("num_prompts", [3, 5])          # buckets 4 and 8: padded rows
def test_moe_graphs_agree_with_eager(targets, k, vanilla, num_prompts):
    """Graph steps (verify + MTP draft loop) give the eager steps' tokens and metrics,
    and both equal transformers (MTP is lossless)."""
    path, refs = targets["qlora-yarn-grouped"]
    runs = []
    for graphs in (False, True):
        llm = cuda_llm(path, graphs, k, vanilla)
        runs.append(greedy_run(llm, PROMPTS[:num_prompts]))
        if graphs:
            assert llm.engine.runner.graphs.num_replays > 0
        if k:
            assert llm.stats()["num_draft_tokens"] > 0
    assert runs[0] == runs[1]
    assert runs[1][0] == refs[:num_prompts]

