"""Qwen3-MoE against Hugging Face transformers: greedy generation token for token (batched,
chunked prefill, preemption), prefill logits, softmax top-k routing."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, assert_pool_full, hf_greedy
from moe_utils import make_qwen3_moe_model
from onespec import LLM, SamplingParams
from onespec.layers.attention import build_attention_metadata
from onespec.models.moe import softmax_route
from test_deepseek import ENGINE_MODES, NEW_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe")
    hf = make_qwen3_moe_model(path)
    return str(path), hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_greedy_matches_transformers(model, mode):
    path, _, refs = model
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, **ENGINE_MODES[mode])
    layers = llm.engine.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoeBlock", "MLP",
                                                              "SparseMoeBlock"]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
    if mode == "preemption":
        assert llm.stats()["num_preemptions"] > 0
    assert_pool_full(llm)


@torch.no_grad()
def test_prefill_logits_match_transformers(model):
    path, hf, _ = model
    llm = LLM(path, dtype="float32", device="cpu")
    prompt = PROMPTS[-1]
    n = len(prompt)
    llm.engine.pool.allocate(table := [], n)
    meta = build_attention_metadata(torch.tensor([table]), [n], torch.arange(n), 16, n)
    hidden, _ = llm.engine.model(torch.tensor(prompt), torch.arange(n), meta)
    llm.engine.pool.free(table)
    ours = llm.engine.model.compute_logits(hidden)
    ref = hf(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5


def test_softmax_routing_worked_example():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1]]))
    w, ids = softmax_route(logits, top_k=2, norm_topk_prob=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.3]]))
    w, _ = softmax_route(logits, top_k=2, norm_topk_prob=True)
    torch.testing.assert_close(w, torch.tensor([[0.625, 0.375]]))
